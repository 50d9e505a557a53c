"""Model-free replay equals the engine when the reference is the model's own greedy output."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from samctl.decode.drafters.adaptive import AdaptiveConfig
from samctl.decode.drafters.lookahead import LookaheadConfig
from samctl.decode.drafters.sam import SamConfig
from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.methods import REPLAYABLE, MethodConfig, make_drafter, uses_store
from samctl.decode.simulate import (
    CostModel, Tally, check_replayable, make_trace, replay, sweep_configs, tally_by_category,
)
from samctl.decode.engine.target import TargetModel
from samctl.index.automaton import SuffixAutomaton
from samctl.index.errors import UserError
from tests.mock_lm import CopyLM

# adaptive without its Token Recycle part and lookahead without its Jacobi window: those parts
# learn from logits, which a replay has not got, so only the retrieval sources replay exactly.
EAGER = MethodConfig(sam=SamConfig(dyn_threshold=2, static_bias=1), adaptive=AdaptiveConfig(recycle=False),
                     lookahead=LookaheadConfig(window=0))


def drafter_for(method: str, vocab: int, static, config: MethodConfig = EAGER, eos: tuple[int, ...] = ()):
    return make_drafter(method, vocab_size=vocab, device=torch.device("cpu"), eos_token_ids=eos,
                        static=static if uses_store(method) else None, config=config)


def engine_and_replay(model, method: str, prompt: list[int], max_new: int, static, eos: tuple[int, ...] = ()):
    vocab = model.config.vocab_size
    result = generate(TargetModel(model), drafter_for(method, vocab, static, eos=eos), prompt,
                      GenerationConfig(max_new_tokens=max_new, eos_token_ids=eos))
    trace = make_trace(prompt, result.tokens, eos, max_new)
    return result.metrics, replay(drafter_for(method, vocab, static, eos=eos), trace)


def assert_same_counts(engine, sim, what) -> None:
    for name in ("new_tokens", "steps", "drafted", "accepted", "accept_hist"):
        assert getattr(engine, name) == getattr(sim, name), (what, name, engine.to_dict(), sim.to_dict())
    assert engine.mean_accepted == sim.mean_accepted


def copy_prompt(vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    doc = rng.permutation(vocab)[:40].tolist()
    noise = rng.integers(0, vocab, 15).tolist()
    return doc + noise + doc[:3]


@pytest.mark.parametrize("method", REPLAYABLE)
def test_replay_equals_engine_on_copy_model(method):
    model = CopyLM(vocab=64)
    for seed in range(3):
        prompt = copy_prompt(64, seed)
        # a store holding part of the answer, so static and REST drafts fire too
        answer = model.reference(prompt, 60)
        static = SuffixAutomaton.build(np.asarray(answer[10:50], dtype=np.int32), np.array([0, 40]))
        engine, sim = engine_and_replay(model, method, prompt, 120, static)
        assert_same_counts(engine, sim, (method, seed))
        if method != "ar":
            assert sim.mean_accepted > 1.5, (method, sim.to_dict())


@pytest.mark.parametrize("method", ["pld", "sam", "rest", "adaptive"])
def test_replay_equals_engine_on_tiny_model_with_eos(tiny_llama, method):
    rng = np.random.default_rng(1)
    base = rng.integers(3, 96, 12).tolist()
    prompt = base + base[:7] + rng.integers(3, 96, 5).tolist()
    free = generate(TargetModel(tiny_llama), make_drafter("ar", vocab_size=96, device=torch.device("cpu")),
                    prompt, GenerationConfig(max_new_tokens=70)).tokens
    eos = (free[45],)  # a token the model emits, so both runs stop there
    static = SuffixAutomaton.build(np.asarray(free[5:40], dtype=np.int32), np.array([0, 35]))
    for max_new in (1, 2, 30, 70):
        engine, sim = engine_and_replay(tiny_llama, method, prompt, max_new, static, eos)
        assert_same_counts(engine, sim, (method, max_new))


def test_trace_is_cut_like_engine_output():
    trace = make_trace([1, 2], [5, 6, 2, 7, 2], eos_token_ids=(2,))
    assert trace.reference.tolist() == [5, 6, 2]
    assert make_trace([1], [5, 6, 7, 8], max_new_tokens=2).reference.tolist() == [5, 6]
    with pytest.raises(UserError, match="empty"):
        make_trace([], [1])


def test_replay_reports_what_the_drafter_did():
    # A prompt that is the answer: pld drafts it all, ten tokens a step (its num_draft).
    answer = list(range(10, 60))
    trace = make_trace([3] + answer + [3], answer)
    m = replay(drafter_for("pld", 64, None), trace)
    assert m.new_tokens == 50 and m.accepted == m.drafted
    assert m.steps == -(-49 // 11)  # 49 tokens after the first, 1 + 10 a step
    ar = replay(drafter_for("ar", 64, None), trace)
    assert ar.steps == 49 and ar.mean_accepted == 1.0 and ar.drafted == 0


def test_tally_pools_steps_and_costs_drafts():
    trace_a = make_trace([3, 10, 11, 12, 13, 3], [10, 11, 12, 13], category="x")
    trace_b = make_trace([4], [20, 21, 22], category="y")
    drafter = drafter_for("pld", 64, None)
    metrics = [replay(drafter, t) for t in (trace_a, trace_b)]
    tallies = tally_by_category([trace_a, trace_b], metrics)
    assert set(tallies) == {"x", "y", "overall"}
    overall = tallies["overall"]
    assert overall.traces == 2 and overall.new_tokens == 7
    assert overall.steps == metrics[0].steps + metrics[1].steps
    assert overall.mean_accepted == (7 - 2) / overall.steps
    free = CostModel(forward_ms=10.0, token_cost=0.0)
    # no draft time and free draft tokens: the speedup is forwards saved
    overall.draft_s = 0.0
    assert free.speedup(overall) == pytest.approx(7 / (2 + overall.steps))
    assert CostModel(token_cost=1.0).speedup(overall) < free.speedup(overall)
    assert Tally().to_dict(free)["mean_accepted"] == 0.0


def test_only_retrieval_methods_replay():
    for method in REPLAYABLE:
        check_replayable(method)
    with pytest.raises(UserError, match="logits.*samctl bench"):
        check_replayable("recycle")
    with pytest.raises(UserError, match="draft model"):
        check_replayable("sd")


def test_sweep_covers_the_grid():
    with_store = list(sweep_configs("sam", MethodConfig(), has_store=True))
    without = list(sweep_configs("sam", MethodConfig(), has_store=False))
    assert len(with_store) == 5 * 3 * 4 * 2 and len(without) == 5 * 3 * 4
    setting, config = without[0]
    assert config.sam.dyn_threshold == setting["sam.dyn_threshold"] and config.sam.max_draft == setting["sam.max_draft"]
    assert len({(c.sam.dyn_threshold, c.sam.alpha, c.sam.max_draft, c.sam.static_bias) for _, c in with_store}) == len(with_store)
    assert len(list(sweep_configs("pld", MethodConfig(), has_store=False))) == 20
    assert list(sweep_configs("ar", MethodConfig(), has_store=False)) == [({}, MethodConfig())]


# ---------------------------------------------------------------------------------------------
# samctl simulate, end to end with the byte-level tokenizer (no model)

def samctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "samctl", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trace_files(tmp_path_factory):
    path = tmp_path_factory.mktemp("sim")
    code = "def add(a, b):\n    return a + b\n"
    rows = [
        {"prompt": "Repeat: " + code, "output": code, "category": "copy"},
        {"instruction": "Write add.", "input": "", "output": code * 2, "category": "code"},
        {"question_id": 7, "category": "code", "turns": ["Write add.", "Again."], "reference": [code, code + code]},
        {"question": "1 + 1?", "answer": "1 + 1 = 2. The answer is 2."},
    ]
    traces = path / "traces.jsonl"
    traces.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    corpus = path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": code * 3 + "1 + 1 = 2."}) + "\n")
    store = path / "store.sam"
    proc = samctl("build", str(corpus), "-o", str(store), "--tokenizer", "bytes")
    assert proc.returncode == 0, proc.stderr
    return traces, store


@pytest.mark.slow
def test_simulate_cli_reports_every_method_and_category(trace_files):
    traces, store = trace_files
    proc = samctl("simulate", "--traces", str(traces), "--sam", str(store), "--methods", "ar,pld,sam,rest", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["traces"] == 5  # the Spec-Bench record gives one trace per turn
    assert set(report["methods"]) == {"ar", "pld", "sam", "rest"}
    for by_cat in report["methods"].values():
        assert set(by_cat) == {"copy", "code", "uncategorized", "overall"}
    ar = report["methods"]["ar"]["overall"]
    assert ar["mean_accepted"] == 1.0 and ar["forwards"] == ar["new_tokens"] and ar["drafted_per_step"] == 0
    for method in ("pld", "sam", "rest"):
        row = report["methods"][method]["overall"]
        assert row["new_tokens"] == ar["new_tokens"]
        assert row["forwards"] < ar["forwards"] and row["mean_accepted"] > 1.0, (method, row)
    table = samctl("simulate", "--traces", str(traces), "--sam", str(store), "--methods", "pld,sam")
    assert table.returncode == 0 and "| overall | sam |" in table.stdout, table.stderr


@pytest.mark.slow
def test_simulate_cli_sweep_and_errors(trace_files):
    traces, store = trace_files
    proc = samctl("simulate", "--traces", str(traces), "--tokenizer", "bytes", "--methods", "pld", "--sweep", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert len(result["grid"]["pld"]) == 20
    best = result["best"]["overall"]["pld"]
    assert best["projected_speedup"] == max(p["results"]["overall"]["projected_speedup"] for p in result["grid"]["pld"])
    assert best["projected_speedup"] >= best["default_projected_speedup"]
    refused = samctl("simulate", "--traces", str(traces), "--tokenizer", "bytes", "--methods", "sam+recycle")
    assert refused.returncode == 2 and "samctl bench" in refused.stderr
    no_store = samctl("simulate", "--traces", str(traces), "--tokenizer", "bytes", "--methods", "rest")
    assert no_store.returncode == 2 and "--sam" in no_store.stderr


def test_simulate_reads_predictions_and_cost_curves(tmp_path):
    # A record's `prediction` (the file being edited) reaches adaptive as if it were in the prompt;
    # a cost curve from `samctl calibrate --json` sizes its drafts and projects the speedup.
    code = "".join(f"def function_{i}(value):\n    return value * {i} + {i * i}\n\n" for i in range(12))
    edited = code.replace("value", "item")
    traces = tmp_path / "edit.jsonl"
    rows = [{"prompt": "Rename value to item.", "prediction": code, "output": edited},
            {"prompt": "Rename value to item.", "output": edited}]
    traces.write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"t_ms": [10.0 + 0.5 * n for n in range(64)]}))
    proc = samctl("simulate", "--traces", str(traces), "--tokenizer", "bytes", "--methods", "adaptive",
                  "--memory", "0", "--cost-curve", str(curve), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["cost_model"]["verify_ms"][0] == 10.0
    per_trace = [replay(make_drafter("adaptive", vocab_size=256, device=torch.device("cpu"),
                                     config=MethodConfig(adaptive=AdaptiveConfig(memory=0))),
                        make_trace(list(b"Rename value to item."), list(edited.encode()), prediction=p))
                 for p in (list(code.encode()), None)]
    assert per_trace[0].mean_accepted > 3 * per_trace[1].mean_accepted, [m.to_dict() for m in per_trace]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    refused = samctl("simulate", "--traces", str(traces), "--tokenizer", "bytes", "--cost-curve", str(bad))
    assert refused.returncode == 2 and "samctl calibrate" in refused.stderr


def test_simulate_chat_encodes_as_generate(model_dir, tmp_path):
    # A tokenizer.json folder loads without transformers (FastTokenizer), yet --chat renders
    # its template as generate --chat does: every turn's prompt equals the engine's ids.
    from samctl.commands.simulate import read_traces
    from samctl.models import load_engine
    from samctl.tokenizer import ByteTokenizer, FastTokenizer, load_tokenizer

    tok = load_tokenizer(str(model_dir))
    assert isinstance(tok, FastTokenizer)
    traces = tmp_path / "chat.jsonl"
    traces.write_text(json.dumps({"turns": ["Add a and b.", "Now the fox."],
                                  "reference": ["def add(a, b):", "The quick brown fox."]}) + "\n")
    engine = load_engine(str(model_dir), device="cpu")
    conversation = [{"role": "user", "content": "Add a and b."}]
    expected = [engine.encode_conversation(conversation, chat=True),
                engine.encode_conversation(conversation + [{"role": "assistant", "content": "def add(a, b):"},
                                                           {"role": "user", "content": "Now the fox."}], chat=True)]
    assert [t.prompt.tolist() for t in read_traces(traces, tok, True, None, None)] == expected
    with pytest.raises(UserError, match="no chat template: drop chat="):
        read_traces(traces, ByteTokenizer(), True, None, None)


def test_simulate_reports_a_bad_record_and_reads_the_rest(tmp_path, capsys):
    # Spec-Bench's rag records hold a list of answers per turn, not the turn's output.
    from samctl.commands.simulate import read_traces
    from samctl.tokenizer import ByteTokenizer

    rows = [{"turns": ["Who?"], "reference": [["Ray", "Harrison"]], "question_id": 481},
            {"prompt": "Say hi", "output": "hi there"}, {"prompt": "x", "output": "y", "prediction": 3},
            {"turns": ["One.", "Two."], "reference": ["1", "2"]}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    traces = read_traces(path, ByteTokenizer(), False, None, None)
    assert [bytes(t.reference.tolist()).decode() for t in traces] == ["hi there", "1", "2"]
    err = capsys.readouterr().err
    assert "skipped 2 record(s)" in err and "mixed.jsonl:1: turn 0's reference is a list, not text" in err
    path.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(UserError, match="holds no traces"):
        read_traces(path, ByteTokenizer(), False, None, None)


def test_simulate_skips_a_line_that_is_not_a_json_object(tmp_path, capsys):
    from samctl.commands.simulate import read_traces
    from samctl.tokenizer import ByteTokenizer

    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps({"prompt": "a", "output": "b"}) + "\n{not json\n[1, 2]\n"
                    + json.dumps({"prompt": "c", "output": "d"}) + "\n")
    traces = read_traces(path, ByteTokenizer(), False, None, None)
    assert [bytes(t.reference.tolist()).decode() for t in traces] == ["b", "d"]
    err = capsys.readouterr().err
    assert "skipped 2 record(s)" in err and "broken.jsonl:2 is not JSON" in err


@pytest.mark.parametrize("args, message", [
    (["--forward-ms", "nan"], "--forward-ms"), (["--token-cost", "inf"], "--token-cost"),
    (["--forward-ms", "-1"], "--forward-ms")])
def test_simulate_refuses_a_cost_model_that_is_not_finite(tmp_path, capsys, args, message):
    from samctl.cli import main

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "a", "output": "b"}) + "\n")
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--traces", str(path), "--tokenizer", "bytes", "--methods", "pld", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("samctl: error: the cost model needs a finite") and message in err, err


def test_a_cost_curve_with_infinite_times_is_refused(tmp_path):
    from samctl.costs import read_cost_curve

    (tmp_path / "c.json").write_text('{"t_ms": [1.0, Infinity]}')
    with pytest.raises(UserError, match="positive finite times"):
        read_cost_curve(tmp_path / "c.json")
