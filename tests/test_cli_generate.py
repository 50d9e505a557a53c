"""`samctl generate` end to end on a tiny local model: single prompt, batch, stores, errors.

Most tests run the CLI in this process (`samctl` below: same entry point, arguments, streams and
exit status as `python -m samctl`, without a new interpreter and torch import per call); the two
that need a real process (a closed pipe, a kill mid-batch) launch one."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from samctl.cli import main
from tests.conftest import save_tiny_model_with_tokenizer

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


def samctl(*args: str, stdin: str | None = None) -> SimpleNamespace:
    """Run `samctl args` in this process -> returncode, stdout, stderr (as subprocess.run's)."""
    threads = torch.get_num_threads()  # --threads sets the process's torch threads: give them back
    with CliRunner().isolation(input=stdin) as (out, err, _):
        try:
            main(list(args))
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
        finally:
            torch.set_num_threads(threads)
        return SimpleNamespace(returncode=code, stdout=out.getvalue().decode(), stderr=err.getvalue().decode())


def test_single_prompt_json_and_compare(model_dir):
    proc = samctl("generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "40",
                  "--json", "--compare")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    metrics = out["metrics"]
    for key in ("new_tokens", "steps", "mean_accepted", "accept_hist", "drafted", "acceptance_rate",
                "tokens_per_s", "time_s", "draft_s", "verify_s", "other_s"):
        assert key in metrics, key
    # the accept step (on a GPU: the wait at the step's one sync) is a part of the host's time
    assert 0 < metrics["accept_ms_per_step"] <= metrics["host_ms_per_step"]
    assert out["compare"]["identical"] is True
    assert out["method"] == "adaptive" and out["config"]["generation"]["max_new_tokens"] == 40


def test_compare_runs_alternate_and_report_the_median(model_dir):
    proc = samctl("generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "20",
                  "--method", "pld", "--compare", "--compare-runs", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    compare = json.loads(proc.stdout)["compare"]
    assert len(compare["speedup_runs"]) == 3 and compare["identical"] is True
    assert compare["speedup"] == sorted(compare["speedup_runs"])[1]
    line = next(line for line in proc.stderr.splitlines() if "speedup" in line)
    assert "median of 3 alternating runs, range" in line and "after a warm-up" in line
    refused = samctl("generate", "--model", str(model_dir), "--prompt", PROMPT, "--compare", "--compare-runs", "0")
    assert refused.returncode == 2 and "--compare-runs must be >= 1" in refused.stderr


def test_streamed_text_equals_json_text(model_dir):
    common = ("generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "30", "--method", "pld")
    streamed = samctl(*common)
    as_json = samctl(*common, "--json")
    assert streamed.returncode == 0 and as_json.returncode == 0, streamed.stderr + as_json.stderr
    assert streamed.stdout == json.loads(as_json.stdout)["text"] + "\n"


def test_batch_keeps_order_reports_bad_records_and_fails(model_dir, tmp_path):
    lines = [
        json.dumps({"id": "a", "prompt": PROMPT}),
        "this is not json",
        json.dumps({"id": "c", "nothing": "here"}),
        json.dumps({"id": "d", "prompt": "x " * 400}),  # longer than the model's 256 positions
        json.dumps({"question_id": 7, "turns": ["The quick brown fox", "The dog sleeps."]}),
        json.dumps({"id": "f", "body": "The quick brown fox"}),
    ]
    proc = samctl("generate", "--model", str(model_dir), "--input", "-", "--max-new-tokens", "12",
                  "--compare", stdin="\n".join(lines) + "\n")
    assert proc.returncode == 1, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r.get("id") for r in records] == ["a", None, "c", "d", 7, "f"] and records[1]["line"] == 2
    assert "text" in records[0] and records[0]["compare"]["identical"] is True
    assert "not JSON" in records[1]["error"]
    assert "no prompt" in records[2]["error"] and "no prompt" in records[5]["error"]
    assert "context" in records[3]["error"]
    assert len(records[4]["turn_texts"]) == 2 and all(c["identical"] for c in records[4]["compare"])
    assert "3 record(s) failed" not in proc.stderr and "4 record(s) failed" in proc.stderr

    with_field = samctl("generate", "--model", str(model_dir), "--input", "-", "--field", "body",
                        "--max-new-tokens", "5", stdin=lines[5] + "\n")
    assert with_field.returncode == 0 and "text" in json.loads(with_field.stdout)

    # a record's `prediction` (adaptive drafts from it); one that is not text fails that record only
    predicted = [json.dumps({"id": "p", "prompt": PROMPT, "prediction": PROMPT}),
                 json.dumps({"id": "q", "prompt": PROMPT, "prediction": 3})]
    with_prediction = samctl("generate", "--model", str(model_dir), "--input", "-", "--max-new-tokens", "12",
                             "--compare", stdin="\n".join(predicted) + "\n")
    out = [json.loads(line) for line in with_prediction.stdout.splitlines()]
    assert with_prediction.returncode == 1 and out[0]["compare"]["identical"] is True
    assert "prediction" in out[1]["error"]
    # on the batched engine each record's prediction drafts for its own row (what it drafts, and
    # so the counts, depend on the batch's drafting budget; the answer does not)
    mixed = [predicted[0], json.dumps({"id": "r", "prompt": PROMPT}), predicted[0]]
    runs = [samctl("generate", "--model", str(model_dir), "--input", "-", "--max-new-tokens", "12", "--quiet",
                   "--batch-size", size, stdin="\n".join(mixed) + "\n") for size in ("1", "3")]
    serial, batched = ([json.loads(line) for line in run.stdout.splitlines()] for run in runs)
    assert [r["text"] for r in batched] == [r["text"] for r in serial] == [out[0]["text"]] * 3
    for record in (batched[0], batched[2]):
        usage = record["prediction_usage"]
        assert usage["tokens"] == serial[0]["prediction_usage"]["tokens"]
        assert usage["accepted"] + usage["rejected"] <= usage["tokens"]
    assert "prediction_usage" not in batched[1]


def test_store_from_the_models_tokenizer_is_used_and_lossless(model_dir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text(PROMPT * 3 + "    return a + b\n")
    store = tmp_path / "s.sam"
    built = samctl("build", str(corpus), "-o", str(store), "--tokenizer", str(model_dir), "--quiet")
    assert built.returncode == 0, built.stderr
    proc = samctl("generate", "--model", str(model_dir), "--sam", str(store), "--prompt", PROMPT,
                  "--max-new-tokens", "40", "--json", "--compare", "--sam-threshold", "2", "--static-bias", "0")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["compare"]["identical"] is True


def test_tokenizer_mismatch_is_refused(model_dir, tmp_path):
    other = tmp_path / "other-model"
    save_tiny_model_with_tokenizer(other, vocab=280, extra_text="completely different words here")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n")
    store = tmp_path / "s.sam"
    assert samctl("build", str(corpus), "-o", str(store), "--tokenizer", str(other), "--quiet").returncode == 0
    proc = samctl("generate", "--model", str(model_dir), "--sam", str(store), "--prompt", "hi")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rebuild the store with `samctl build --tokenizer" in lines[0] and str(model_dir) in lines[0]
    # the store was built with a model's tokenizer: the first advice is to run that model
    assert f"pass --model {other.resolve()} (the model it was built with)" in lines[0]
    forgot = samctl("generate", "--sam", str(store), "--prompt", "hi")  # the embedded default model
    assert forgot.returncode == 2 and f"pass --model {other.resolve()} (the model it was built with)" in forgot.stderr


@pytest.mark.parametrize("args,message", [
    ((), "exactly one of"),
    (("--prompt", "a", "--prompt-file", "/dev/null"), "exactly one of"),
    (("--prompt", "a", "--model", "/nonexistent/model"), "model /nonexistent/model does not exist: pass --model"),
    (("--prompt", "a", "--model", "./nope"), "model ./nope does not exist: pass --model"),
    (("--prompt", "a", "--method", "sd", "--draft-model", "./nope"), "draft model ./nope does not exist"),
    (("--prompt", "a", "--max-new-tokens", "0"), "max-new-tokens"),
    (("--prompt", "a", "--temperature", "-1"), "temperature"),
])
def test_argument_errors_are_one_line(model_dir, args, message):
    if "--model" not in args:
        args = (*args, "--model", str(model_dir))
    proc = samctl("generate", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_prediction_and_memory_files(model_dir, tmp_path, monkeypatch):
    # A flat verify-cost curve: how much adaptive drafts must not depend on this machine's load.
    monkeypatch.setattr("samctl.costs.cost_curve", lambda engine, *_, **__: [1.0] * 64)
    # --prediction drafts from an expected output; --memory-save writes the outputs as a store
    # that --memory-file preloads (checked against the model's tokenizer like any store).
    prediction = tmp_path / "pred.txt"
    prediction.write_text("def add(a, b):\n    return a + b\n")
    memory = tmp_path / "memory.sam"
    first = samctl("generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "24", "--json",
                   "--prediction", str(prediction), "--memory-save", str(memory), "--compare")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["compare"]["identical"] is True
    usage = json.loads(first.stdout)["prediction_usage"]  # decode.metrics.PredictionUsage
    assert usage["accepted"] + usage["rejected"] <= usage["tokens"]
    assert memory.is_file() and "memory of 1 output" in first.stderr
    again = samctl("generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "24", "--json",
                   "--memory-file", str(memory))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["text"] == json.loads(first.stdout)["text"]
    # the preloaded memory is used: it holds this very output, so more of it is drafted and accepted
    without = samctl("generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "24", "--json")
    with_memory, fresh = json.loads(again.stdout)["metrics"], json.loads(without.stdout)["metrics"]
    assert with_memory["accepted"] > fresh["accepted"], (with_memory, fresh)
    info = samctl("info", str(memory), "--json")
    assert info.returncode == 0 and json.loads(info.stdout)["corpus"]["documents"] == 1
    refused = samctl("generate", "--model", str(model_dir), "--prompt", PROMPT, "--method", "pld",
                     "--prediction", str(prediction))
    assert refused.returncode == 2 and "does not draft from a prediction" in refused.stderr


def test_an_empty_prompt_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr("samctl.session.Session", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for args, where in ((("--prompt", ""), "--prompt"), (("--prompt-file", str(empty)), f"--prompt-file {empty}")):
        proc = samctl("generate", *args)
        assert proc.returncode == 2
        assert proc.stderr == f"samctl: error: {where} is empty: give at least one token of text\n"


def test_prediction_with_a_method_that_ignores_it_names_the_methods_that_take_one(tmp_path):
    from samctl.commands.generate import generate
    from samctl.decode.methods import REGISTRY

    takers = [name for name, m in REGISTRY.items() if m.takes_prediction]
    assert "lookahead" not in takers and "adaptive" in takers
    prediction = tmp_path / "p.txt"
    prediction.write_text("expected output\n")
    proc = samctl("generate", "--prompt", "hi", "--method", "lookahead", "--prediction", str(prediction))
    assert proc.returncode == 2
    assert proc.stderr == ("samctl: error: method lookahead does not draft from a prediction: drop --prediction "
                           f"or use --method {' or '.join(takers)}\n")
    option = next(p for p in generate.params if p.name == "prediction_file")
    assert option.help.startswith(f"{', '.join(takers)}: the expected output")


def test_calibrate_prints_a_cost_curve(model_dir, tmp_path):
    proc = samctl("calibrate", "--model", str(model_dir), "--json", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    curve = json.loads(proc.stdout)
    assert len(curve["t_ms"]) == len(curve["t_ms_long"]) == 64
    assert all(t > 0 for t in curve["t_ms"] + curve["t_ms_long"])
    assert curve["contexts"][0] <= curve["contexts"][1]  # equal where the model has no room for the longer one
    assert curve["t_ms"] == sorted(curve["t_ms"])  # a monotone fit
    table = samctl("calibrate", "--model", str(model_dir), "--threads", "1")  # cached now
    assert table.returncode == 0 and "| 64 |" in table.stdout and "measuring" not in table.stderr


def test_bad_sampling_values_and_prompt_fields_are_one_line(model_dir):
    for value in ("nan", "inf", "-1"):
        proc = samctl("generate", "--model", str(model_dir), "--prompt", "x", "--temperature", value)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--temperature" in proc.stderr, proc.stderr
    lines = [json.dumps({"id": "e", "prompt": ""}), json.dumps({"id": "t", "turns": "a string"})]
    proc = samctl("generate", "--model", str(model_dir), "--input", "-", "--max-new-tokens", "4",
                  stdin="\n".join(lines) + "\n")
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert "empty" in records[0]["error"] and "list of texts" in records[1]["error"]


def test_blank_lines_get_an_error_line_and_quiet_means_no_notes(model_dir, tmp_path):
    corpus = tmp_path / "a.txt"
    corpus.write_text(PROMPT)
    store = tmp_path / "s.sam"
    assert samctl("build", str(corpus), "-o", str(store), "--tokenizer", str(model_dir), "-q").returncode == 0
    lines = [json.dumps({"id": "a", "prompt": PROMPT}), "", "   ", json.dumps({"id": "d", "prompt": "x"})]
    proc = samctl("generate", "--model", str(model_dir), "--sam", str(store), "--method", "ar", "--input", "-",
                  "--max-new-tokens", "4", "--quiet", stdin="\n".join(lines) + "\n")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r.get("id", r.get("line")) for r in records] == ["a", 2, 3, "d"]  # one output line per input line
    assert "blank" in records[1]["error"] and "blank" in records[2]["error"] and "text" in records[3]
    # --quiet: the failure count (an error) stays, the note about the unused store goes
    assert proc.stderr.strip() == "samctl: 2 record(s) failed; see their `error` fields"
    loud = samctl("generate", "--model", str(model_dir), "--sam", str(store), "--method", "ar", "--prompt", "x",
                  "--max-new-tokens", "2")
    assert loud.returncode == 0 and "does not use the store" in loud.stderr


def test_a_closed_output_pipe_exits_zero(model_dir):
    records = "".join(json.dumps({"id": i, "prompt": PROMPT}) + "\n" for i in range(40))
    proc = subprocess.Popen([sys.executable, "-m", "samctl", "generate", "--model", str(model_dir), "--input", "-",
                             "--max-new-tokens", "8", "--quiet"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.write(records)
    proc.stdin.close()
    first = proc.stdout.readline()  # then the reader goes away, as `| head -1` does
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    assert json.loads(first)["id"] == 0 and "Traceback" not in err and "Exception ignored" not in err

@pytest.mark.slow
def test_resume_after_a_kill_skips_finished_records(model_dir, tmp_path):
    import os
    import signal
    import time

    records = [json.dumps({"id": f"r{i}", "prompt": PROMPT + " " * i}) for i in range(16)]
    records.insert(5, "not json")
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("\n".join(records) + "\n")
    common = [sys.executable, "-m", "samctl", "generate", "--model", str(model_dir), "--input", str(inputs),
              "--max-new-tokens", "12", "--threads", "1", "--quiet", "--method", "pld",
              "--batch-size", "1"]  # one record at a time, so the kill lands between two records
    whole = samctl(*common[3:], "--output", str(tmp_path / "whole.jsonl"))
    assert whole.returncode == 1, whole.stderr
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([*common, "--output", str(out)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 3:
            os.kill(proc.pid, signal.SIGKILL)  # a kill mid-batch, without any cleanup
            break
        time.sleep(0.02)
    proc.wait()
    done_before = out.read_text().count("\n")
    resumed = samctl(*common[3:], "--output", str(out), "--resume")
    # The bad line (the 6th) fails again only if the kill came before it was written.
    assert resumed.returncode == (1 if done_before <= 5 else 0), (done_before, resumed.stderr)

    def strip(path) -> list[dict]:
        return [{k: v for k, v in json.loads(line).items() if k != "metrics"} for line in path.read_text().splitlines()]

    assert 3 <= done_before < len(records), f"the kill landed after {done_before} of {len(records)} records"
    assert strip(out) == strip(tmp_path / "whole.jsonl")
    refused = samctl(*common[3:], "--resume")
    assert refused.returncode == 2 and "not stdout" in refused.stderr
