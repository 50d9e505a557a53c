"""Text inputs that are not UTF-8 (issue 24, item 2): one input gets a one-line error (exit 2);
in a batch the record gets an `error` and the records around it are processed and written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from samctl.textio import check_utf8
from samctl.index.errors import UserError
from samctl.tokenizer import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]
LATIN1 = "Résumé of the café\n".encode("latin-1")
needs_default_model = pytest.mark.skipif(not DEFAULT_MODEL_DIR.is_dir(), reason="embedded default model not installed")


def samctl(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "samctl", *args], cwd=ROOT, capture_output=True, input=stdin,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_check_utf8_names_the_byte_and_where():
    assert check_utf8("plain ünïcode\n", "x") == "plain ünïcode\n"
    bad = LATIN1.decode("utf-8", "surrogateescape")
    with pytest.raises(UserError, match=r"p.txt is not UTF-8 \(byte 0xe9 at column 2\): re-encode"):
        check_utf8(bad, "p.txt")
    with pytest.raises(UserError, match="line 2, column 2"):
        check_utf8("ok\n" + bad, "f")


def test_latin1_prompt_file_and_prediction_are_one_line_errors(tmp_path):
    prompt = tmp_path / "latin1.txt"
    prompt.write_bytes(LATIN1)
    good = tmp_path / "good.txt"
    good.write_text("fine\n")
    for args in (["--prompt-file", str(prompt)], ["--prompt-file", str(good), "--prediction", str(prompt)]):
        proc = samctl("generate", *args, "--max-new-tokens", "4", "--threads", "1")
        err = proc.stderr.decode()
        assert proc.returncode == 2, err
        assert err.count("\n") == 1 and "is not UTF-8 (byte 0xe9" in err and "Traceback" not in err


@needs_default_model
def test_a_latin1_record_in_a_batch_gets_an_error_and_the_rest_go_on(tmp_path):
    batch = (json.dumps({"id": "a", "prompt": "def add(a, b):"}).encode() + b"\n"
             + b'{"id": "b", "prompt": "caf\xe9"}\n'
             + json.dumps({"id": "c", "prompt": "def sub(a, b):"}).encode() + b"\n")
    for source in ("file", "stdin"):
        path = tmp_path / "batch.jsonl"
        path.write_bytes(batch)
        args = ["--input", str(path)] if source == "file" else ["--input", "-"]
        proc = samctl("generate", *args, "--max-new-tokens", "4", "--threads", "1", "--quiet",
                      stdin=batch if source == "stdin" else None)
        lines = [json.loads(line) for line in proc.stdout.decode().splitlines()]
        assert [r["id"] for r in lines] == ["a", "b", "c"], proc.stderr.decode()  # the id read past the bad byte
        assert "text" in lines[0] and "text" in lines[2]
        assert "line 2 is not UTF-8 (byte 0xe9" in lines[1]["error"]
        assert proc.returncode == 1 and "Traceback" not in proc.stderr.decode()


def test_a_refused_line_keeps_the_id_it_holds(tmp_path):
    """A line refused for a byte elsewhere keeps its id (issue 42, item 10), and --resume finds the
    same id; an id holding the bad byte, or a line that is no JSON object, gets its line number
    as `line`, never as an `id`."""
    from samctl.records import RecordRunner, finished_keys, line_key, output_key

    def line(raw: bytes) -> str:
        return raw.decode("utf-8", "surrogateescape")

    cases = [(b'{"id": "b", "prompt": "caf\xe9"}', "b"), (b'{"question_id": 7, "prompt": "\xe9"}', 7),
             (b'{"id": "caf\xe9", "prompt": "x"}', None), (b'not json \xe9', None), (b'["\xe9"]', None), (b"", None)]
    for raw, found in cases:
        key = {"line": 3} if found is None else {"id": found}
        assert line_key(line(raw), 3) == key, raw
        out, failed = RecordRunner(session=None).process(3, line(raw))
        assert failed and json.loads(out).items() > key.items() and output_key(3, line(raw)) == json.dumps(key)
        (tmp_path / "out.jsonl").write_text(out + "\n", encoding="utf-8")
        assert finished_keys(str(tmp_path / "out.jsonl")) == {json.dumps(key): 1}


def test_latin1_questions_and_traces_are_one_line_errors(tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_bytes(b'{"question_id": 1, "turns": ["caf\xe9"]}\n')
    traces = tmp_path / "t.jsonl"
    traces.write_bytes(b'{"prompt": "caf\xe9", "output": "x"}\n')
    for args in (["bench", "--questions", str(questions), "--out", str(tmp_path / "out")],
                 ["simulate", "--traces", str(traces), "--tokenizer", "bytes"]):
        proc = samctl(*args)
        err = proc.stderr.decode()
        assert proc.returncode == 2 and err.count("\n") == 1 and "is not UTF-8" in err, err


@needs_default_model
def test_distill_answers_the_utf8_prompts_around_a_latin1_one(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"id": 1, "prompt": "Name a color."}\n{"id": 2, "prompt": "caf\xe9"}\n'
                        b'{"id": 3, "prompt": "Name a fruit."}\n')
    out = tmp_path / "self.sam"
    proc = samctl("distill", "--prompts", str(prompts), "-o", str(out), "--max-new-tokens", "4", "--threads", "1", "-q")
    assert proc.returncode == 0, proc.stderr.decode()
    answers = [json.loads(line) for line in (tmp_path / "self.sam.answers.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == [1, 2, 3]
    assert "not UTF-8" in answers[1]["error"] and "text" in answers[0] and "text" in answers[2]
