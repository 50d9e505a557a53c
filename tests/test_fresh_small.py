"""The smaller items of issue 24 (item 11): a prompt that leaves less room than --max-new-tokens
says so once; --resume says what it skipped; simulate's advice when the store's tokenizer is not
the traces'; an interrupted run never says "done"; /sources for every method; a note for drafter
flags the method does not read."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import save_tiny_model_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def samctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "samctl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("small24") / "model"
    save_tiny_model_with_tokenizer(path)  # a 256-token context
    return path


def test_a_prompt_leaving_little_room_says_so_once(model):
    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # about 190 of the 256 positions
    proc = samctl("generate", "--model", str(model), "--prompt", prompt, "--max-new-tokens", "100", "--threads", "1",
                  "--compare", "--json")
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "new tokens fit, fewer than --max-new-tokens 100" in line]
    assert len(notes) == 1, proc.stderr
    assert "-token context: at most" in notes[0]


def test_the_room_noted_is_the_tokens_a_full_context_generates():
    # the embedded model: "word " * 1000 leaves about 20 positions, and it does not stop on EOS there
    proc = samctl("generate", "--prompt", "word " * 1000, "--max-new-tokens", "100", "--threads", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    note = next(line for line in proc.stderr.splitlines() if "new tokens fit" in line)
    result = json.loads(proc.stdout)
    assert result["finish_reason"] == "length"
    assert result["metrics"]["new_tokens"] == int(note.split("at most ")[1].split()[0]), (note, result["metrics"])


def test_resume_says_how_many_records_it_skipped(model, tmp_path):
    batch = tmp_path / "in.jsonl"
    batch.write_text("".join(json.dumps({"id": i, "prompt": f"def f{i}(a):"}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps({"id": i, "text": "x"}) + "\n" for i in range(2)))
    proc = samctl("generate", "--model", str(model), "--input", str(batch), "--output", str(out), "--resume",
                  "--max-new-tokens", "4", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    assert f"--resume: skipped 2 record(s) already in {out}" in proc.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0, 1, 2]


def test_simulate_advice_with_a_store_of_another_tokenizer_is_not_circular(tmp_path):
    (tmp_path / "a.txt").write_text("def add(a, b):\n    return a + b\n")
    store = tmp_path / "bytes.sam"
    assert samctl("build", str(tmp_path / "a.txt"), "-o", str(store), "--tokenizer", "bytes", "-q").returncode == 0
    traces = tmp_path / "t.jsonl"
    traces.write_text(json.dumps({"prompt_ids": [1, 2, 3], "output_ids": [4, 5],
                                  "tokenizer": {"name": "my-model", "fingerprint": "0123abcd"}}) + "\n")
    proc = samctl("simulate", "--traces", str(traces), "--sam", str(store))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "pass --tokenizer" not in proc.stderr
    assert "rebuild the store with --tokenizer my-model" in proc.stderr
    # without a store, --tokenizer is the way out
    proc = samctl("simulate", "--traces", str(traces), "--tokenizer", "bytes")
    assert proc.returncode == 2 and "pass --tokenizer my-model" in proc.stderr


def test_an_interrupted_progress_never_says_done(monkeypatch, capsys):
    from samctl import progress

    monkeypatch.setattr(progress, "LINE_PERIOD_S", 0.0)
    with pytest.raises(KeyboardInterrupt):
        with progress.progress_bar("building", "token", quiet=False) as bar:
            bar.update(5)
            raise KeyboardInterrupt
    err = capsys.readouterr().err
    assert "stopped after" in err and "done" not in err.splitlines()[-1]
    with progress.progress_bar("building", "token", quiet=False) as bar:
        bar.update(5)
    assert "done in" in capsys.readouterr().err.splitlines()[-1]


def test_sources_reports_every_method():
    from samctl.commands.chat import Console
    from samctl.decode.methods import make_drafter

    console = Console.__new__(Console)
    console.method, console.store_name = "lookahead", None

    class Session:
        drafter = make_drafter("lookahead", vocab_size=64, device="cpu")

    console.sessions = {"lookahead": Session()}
    text = console.sources()
    assert text.startswith("method lookahead: ") and "pool tuples: 0" in text


def test_a_flag_the_method_does_not_read_gets_a_note():
    proc = samctl("generate", "--method", "sam", "--max-nodes", "3", "--no-recycle", "--gamma", "5",
                  "--prompt", "x", "--sam", "missing.sam")
    assert "samctl: note: method sam does not use --max-nodes, --no-recycle, --gamma" in proc.stderr
    proc = samctl("generate", "--method", "adaptive", "--max-nodes", "3", "--occurrence", "latest",
                  "--prompt", "x", "--sam", "missing.sam")
    assert "does not use" not in proc.stderr and proc.returncode == 2


def test_which_flags_a_method_ignores_comes_from_the_registry():
    from samctl.decode.methods import method
    from samctl.options import ignored_settings

    changed = {"gamma": 5, "stop_threshold": 0.5, "bounds": (1, 6), "max_nodes": 3}
    assert ignored_settings(changed, "sam") == ["--max-nodes", "--gamma", "--stop-threshold", "--bounds"]
    assert ignored_settings(changed, "sd") == ["--max-nodes", "--stop-threshold", "--bounds"]
    assert ignored_settings(changed, "specdec++") == ["--max-nodes", "--gamma"]
    assert ignored_settings({"gamma": 5, "bounds": [2, 20], "max_nodes": 3}, "ouroboros") == ["--max-nodes"]
    assert ignored_settings({"gamma": 4, "stop_threshold": 0.3, "bounds": (2, 20)}, "sam") == []
    assert method("sam+draft").reads("gamma") and not method("sam+draft").reads("bounds")
    assert method("ouroboros").reads("lookahead.pool_text") and not method("ouroboros").reads("lookahead.window")
