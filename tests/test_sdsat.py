"""SDSAT: the training layout keeps standard tokens blind to SATs, the settings are checked, and
`sdsat` decoding is plain greedy decoding of the fine-tuned model, token for token."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from samctl.decode.drafters.sdsat import SdsatConfig, SdsatDrafter
from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.methods import MethodConfig, make_drafter
from samctl.decode.sdsat import IGNORE, SatSettings, make_batch, read_settings, sample_anchors, sat_layout
from samctl.decode.engine.target import TargetModel
from samctl.index.errors import UserError
from tests.mock_lm import CopyLM
from tests.test_decode_greedy import hf_greedy, prompts

SAT = {"sat_token_id": 90, "sat_count": 4}


def test_layout_matches_naive_definition():
    rng = np.random.default_rng(0)
    for _ in range(50):
        t, k = int(rng.integers(2, 12)), int(rng.integers(1, 5))
        anchors = np.sort(rng.choice(t - 1, size=int(rng.integers(1, t)), replace=False))
        positions, visible, source = sat_layout(t, anchors, k)
        for i in range(t + len(anchors) * k):
            for j in range(t + len(anchors) * k):
                if i < t:  # standard rows: causal over standard tokens, never a SAT
                    want = j <= i
                else:
                    b, slot = divmod(i - t, k)
                    if j < t:
                        want = j <= anchors[b]
                    else:
                        b2, slot2 = divmod(j - t, k)
                        want = b2 == b and slot2 <= slot
                assert visible[i, j] == want, (t, k, anchors, i, j)
        for b, p in enumerate(anchors):
            rows = t + b * k + np.arange(k)
            assert positions[rows].tolist() == [p + j for j in range(1, k + 1)]
            assert source[rows].tolist() == [p + j + 1 for j in range(1, k + 1)]


def test_training_batch_standard_logits_are_the_models_own(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(3)
    seqs = [rng.integers(3, 90, size=n) for n in (20, 13)]
    anchors = [sample_anchors(4, len(s), 3, rng) for s in seqs]
    batch = make_batch(seqs, [4, 4], anchors, 3, sat_id=91, pad_id=0)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.mask,
                    use_cache=False).logits
        width = max(len(s) for s in seqs)
        for r, seq in enumerate(seqs):
            alone = model(input_ids=torch.tensor(seq)[None]).logits[0]
            torch.testing.assert_close(out[r, : len(seq)], alone, atol=1e-4, rtol=1e-4)
            p = int(anchors[r][0])  # block 0 equals feeding [x_0..x_p, SAT x 3] on its own
            explicit = model(input_ids=torch.tensor([*seq[: p + 1], 91, 91, 91])[None]).logits[0, p + 1 :]
            torch.testing.assert_close(out[r, width : width + 3], explicit, atol=1e-4, rtol=1e-4)
            labels = batch.labels[r, width : width + 3].tolist()
            assert labels == [int(seq[p + j + 1]) if p + j + 1 < len(seq) else IGNORE for j in (1, 2, 3)]
            assert batch.labels[r, : len(seq) - 1][3:].tolist() == seq[4:].tolist()  # response labels only


def test_kl_teacher_sees_what_the_untrained_model_sees(tiny_model_dir):
    # The training forward (lower layers once, top layers on top) gives the model's own logits,
    # and before any step the frozen teacher's distribution at the standard positions is the
    # model's: the KL term starts at 0 and only measures drift of the trained top layers.
    import samctl.train.sdsat as train

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(5)
    seqs = [rng.integers(3, 90, size=n) for n in (18, 11)]
    batch = make_batch(seqs, [3, 3], [sample_anchors(3, len(s), 2, rng) for s in seqs], 3, sat_id=91, pad_id=0)
    with torch.no_grad():
        whole = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.mask,
                      use_cache=False).logits
        for top in (1, len(model.model.layers)):
            logits, base = train.split_forward(model, batch, top, torch.device("cpu"))
            torch.testing.assert_close(logits, whole, atol=1e-4, rtol=1e-4)
            width = max(len(s) for s in seqs)
            frozen = train.FrozenTop(model, top)
            args = (base[:, :width], batch.mask[:, :, :width, :width], batch.position_ids[:, :width],
                    model.model.rotary_emb)
            original = torch.log_softmax(whole[:, :width], -1)
            torch.testing.assert_close(frozen.log_probs(*args), original, atol=1e-4, rtol=1e-4)
            model.model.layers[-1].mlp.down_proj.weight.add_(0.05)  # training moves the model, not the copy
            moved, _ = train.split_forward(model, batch, top, torch.device("cpu"))
            assert not torch.allclose(torch.log_softmax(moved[:, :width], -1), original, atol=1e-3)
            torch.testing.assert_close(frozen.log_probs(*args), original, atol=1e-4, rtol=1e-4)
            model.model.layers[-1].mlp.down_proj.weight.sub_(0.05)


def test_settings_are_read_or_refused_in_one_line():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=100, sdsat={"sat_token_id": 7, "sat_count": 5, "sat_token": "<x>"})
    assert read_settings(config) == SatSettings(7, 5, "<x>", False)
    for bad, words in ((None, "samctl train sdsat --model m"), ({"sat_count": 5}, "damaged"),
                       ({"sat_token_id": 100, "sat_count": 5}, "outside the vocabulary"),
                       ({"sat_token_id": 3, "sat_count": 0}, "sat_count >= 1")):
        config = LlamaConfig(vocab_size=100, sdsat=bad)
        with pytest.raises(UserError, match=words):
            read_settings(config, "m")


def test_sat_count_beyond_training_is_refused():
    model = CopyLM(vocab=16)
    with pytest.raises(UserError, match="at most 3"):
        SdsatDrafter(TargetModel(model), read_settings(model.config), SdsatConfig(sat_count=5))


def test_greedy_equals_generate(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.config.sdsat = SAT
    for k in (1, 4):
        for prompt in prompts(model.config.vocab_size):
            target = TargetModel(model)
            drafter = make_drafter("sdsat", vocab_size=96, device=target.device, target=target,
                                   config=MethodConfig(sdsat=SdsatConfig(sat_count=k)))
            for new, eos in ((60, ()), (7, (int(hf_greedy(model, prompt, 5, None)[3]),))):
                expected = hf_greedy(model, prompt, new, eos=eos[0] if eos else None)
                result = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=new, eos_token_ids=eos))
                assert result.tokens == expected, (k, prompt, eos)


def test_copy_model_accepts_sat_drafts():
    # The copy rule reads SATs as tokens: after a repeated phrase its SAT guesses are often right,
    # so steps of more than t1 + the bonus token show the drafts are verified and kept.
    model = CopyLM(vocab=32)
    target = TargetModel(model)
    prompt = list(range(3, 20)) * 3
    result = generate(target, make_drafter("sdsat", vocab_size=32, device=target.device, target=target),
                      prompt, GenerationConfig(max_new_tokens=40))
    assert result.tokens == model.reference(prompt, 40)
    assert result.metrics.new_tokens / result.metrics.steps >= 2.0


def test_cli_refuses_a_model_without_sats(tmp_path):
    from click.testing import CliRunner

    from samctl.cli import cli

    result = CliRunner().invoke(cli, ["generate", "--method", "sdsat", "--prompt", "hi", "--max-new-tokens", "4"],
                                standalone_mode=False)
    assert isinstance(result.exception, UserError)
    assert "`samctl train sdsat --model" in str(result.exception) and "\n" not in str(result.exception)


def test_train_script_writes_a_folder_sdsat_loads(tmp_path):
    import samctl.train.sdsat as train

    data = tmp_path / "gsm.jsonl"
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"{i} plus {i} is {2 * i}. The answer is {2 * i}."}
            for i in range(24)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sat-model"
    report = train.main(["--model", "samctl/models/default/target", "--out", str(out), "--data", str(data),
                         "--num-prompts", "20", "--heldout", "4", "--responses", "data", "--max-steps", "3",
                         "--sat-count", "3", "--blocks", "4", "--threads", "1"])
    assert report["training"]["steps"] == 3 and len(report["after"]["sat_accuracy"]) == 3
    assert report["added_to_vocab"]  # the embedded tokenizer has no spare special token
    saved = json.loads((out / "sdsat_report.json").read_text())
    assert saved["sat_token_id"] == report["sat_token_id"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    settings = read_settings(model.config)
    assert settings.sat_count == 3 and settings.added_to_vocab
    target = TargetModel(model)
    prompt = [5, 6, 7, 8, 9]
    result = generate(target, make_drafter("sdsat", vocab_size=model.config.vocab_size, device=target.device,
                                           target=target), prompt, GenerationConfig(max_new_tokens=12))
    assert result.tokens == hf_greedy(model, prompt, 12, eos=None)


def test_train_reads_any_input_with_the_models_own_answers(tmp_path):
    # Plain documents and Spec-Bench questions carry no answers: the model writes its own (the one
    # answer writer, kept under --cache), and a rerun reuses them instead of answering again.
    import samctl.train.sdsat as train
    from samctl.models import load_engine
    from samctl.train.answers import read_answers
    from tests.test_eagle_training import naive_greedy

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"p{i}.txt").write_text(f"Write a function number {i} that adds two numbers.")
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "turns": [f"Count to {i}.", "Again."]}) + "\n"
                                 for i in range(4)))
    cache = tmp_path / "cache"
    argv = ["--model", "samctl/models/default/target", "--out", str(tmp_path / "o"), "--data", str(docs),
            str(questions), "--heldout", "2", "--max-new-tokens", "8", "--max-steps", "1", "--sat-count", "2",
            "--blocks", "2", "--threads", "1", "--cache", str(cache)]
    report = train.main(argv)
    assert report["responses"] == "self" and report["train_sequences"] == 8 and report["heldout_sequences"] == 2
    assert "before_data_answers" not in report  # no record holds an answer of its own
    [path] = cache.glob("sdsat-answers-*.jsonl")
    answers = read_answers(path)
    assert sorted(answers) == [(i, 0) for i in range(10)]  # first turns only
    engine = load_engine("samctl/models/default/target", "cpu", "float32")
    for answer in answers.values():  # the model's own greedy answers
        assert answer.output_ids == naive_greedy(engine, answer.prompt_ids, 8)
    lines = path.read_text()
    assert train.main(argv)["train_sequences"] == 8 and path.read_text() == lines  # reused, nothing rewritten


def test_train_on_the_records_answers_needs_records_with_answers(tmp_path):
    import samctl.train.sdsat as train

    docs = tmp_path / "p.txt"
    docs.write_text("Some plain text without an answer.")
    with pytest.raises(UserError, match="--responses self"):
        train.main(["--model", "samctl/models/default/target", "--out", str(tmp_path / "o"), "--data", str(docs),
                    "--responses", "data", "--threads", "1"])


def test_nucleus_reference_trees_are_the_papers():
    from samctl.decode.drafters.sdsat_nucleus import TREES, static_tree
    from samctl.decode.tree import tree_depths

    widths = {5: [4, 8, 8, 5, 3], 7: [4, 8, 8, 6, 5, 3, 2], 9: [4, 8, 8, 6, 6, 5, 4, 3, 2],
              11: [4, 8, 8, 8, 6, 6, 6, 5, 4, 3, 2], 13: [4, 8, 8, 8, 8, 8, 6, 6, 6, 5, 4, 3, 2]}
    for k in TREES:
        parents, slot = static_tree(k)
        depth = tree_depths(parents)  # node 0 (t1) at depth 1, the paper's depth j at j + 1
        assert np.bincount(depth)[2:].tolist() == widths[k]
        assert (parents[1:] < np.arange(1, len(parents))).all() and slot[0] == -1
        assert ((slot[1:] // 10) == depth[1:] - 2).all()  # a node at depth j reads SAT j's candidates
    with pytest.raises(UserError, match="k = 5, 7, 9, 11, 13"):
        static_tree(4)


def test_nucleus_reference_greedy_equals_generate(tiny_model_dir):
    # Greedy, the paper's nucleus variant is argmax everywhere: plain greedy decoding.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.config.sdsat = {"sat_token_id": 90, "sat_count": 5}
    for prompt in prompts(model.config.vocab_size):
        target = TargetModel(model)
        drafter = make_drafter("sdsat-nucleus-reference", vocab_size=96, device=target.device, target=target)
        for new in (40, 3):
            result = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=new))
            assert result.tokens == hf_greedy(model, prompt, new, eos=None), prompt


def test_nucleus_reference_is_biased_and_the_loop_is_not():
    # t1 has two children that both offer token A; the target says A or B with 1/2 each. The
    # reference's independent draw per path accepts A with 3/4 and re-draws after a miss, so A
    # comes out with 7/8; the loop's one draw per node keeps the target's 1/2.
    from samctl.decode.drafters.sdsat_nucleus import best_of_paths
    from samctl.decode.sampling import SamplingConfig
    from samctl.decode.tree import walk_tree

    a, b, t1 = 3, 4, 5
    logits = torch.full((4, 8), -30.0)
    logits[:, [a, b]] = 0.0  # every row: A or B, 1/2 each
    parents = np.array([-1, 0, 0], dtype=np.int32)
    input_ids = torch.tensor([1, t1, a, a])
    sampling = SamplingConfig(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    n, ours = 2000, 0
    for _ in range(n):
        path, bonus, host = best_of_paths(logits, parents, input_ids, sampling, generator)
        assert path[:2].tolist() == [0, 1]  # t1 is always kept
        ours += (host[path[2]] if len(path) > 2 else bonus) == a
    # the loop: one draw at t1's row decides, and a child carries it or the draw itself is the bonus
    choices = torch.multinomial(torch.softmax(logits[1], -1), n, replacement=True, generator=generator).numpy()
    loops = sum(walk_tree(parents, input_ids[1:].numpy(), np.array([t1, c, 0, 0]), -1, 0)[-1] == 2 or c == a
                for c in choices)
    assert abs(ours / n - 7 / 8) < 0.03 and abs(loops / n - 1 / 2) < 0.03, (ours / n, loops / n)


def test_nucleus_reference_samples_and_is_reproducible(tiny_model_dir):
    from samctl.decode.sampling import SamplingConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.config.sdsat = {"sat_token_id": 90, "sat_count": 5}
    target = TargetModel(model)
    runs = []
    for _ in range(2):
        sampling = SamplingConfig(temperature=1.0, top_p=0.9, seed=3)
        drafter = make_drafter("sdsat-nucleus-reference", vocab_size=96, device=target.device, target=target,
                               sampling=sampling)
        runs.append(generate(target, drafter, [5, 6, 7, 8], GenerationConfig(max_new_tokens=30,
                                                                              sampling=sampling)))
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 30
    assert runs[0].metrics.drafted > 0
    # it samples: greedy decoding gives other tokens (one seed's runs agreeing would not show it)
    drafter = make_drafter("sdsat-nucleus-reference", vocab_size=96, device=target.device, target=target,
                           sampling=SamplingConfig())
    assert generate(target, drafter, [5, 6, 7, 8], GenerationConfig(max_new_tokens=30)).tokens != runs[0].tokens
