"""`samctl bench` measures speed, not learning or noise (issue 24, items 4 and 10): every repeat of
a question starts from the same drafter state, and answers too short to time are kept out of
the speedups (listed, with n per category)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import save_tiny_model_with_tokenizer

QUESTIONS = [
    {"question_id": 1, "category": "coding", "turns": ["def add(a, b):\n    return a + b\n"]},
    {"question_id": 2, "category": "coding", "turns": ["The quick brown fox jumps over the lazy dog."]},
    {"question_id": 3, "category": "summarization", "turns": ["Summarize the document. The answer is in the passage."]},
]


def samctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "samctl", *args], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench24")
    save_tiny_model_with_tokenizer(path / "model")
    questions = path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path, questions


def test_every_repeat_starts_from_the_same_drafter_state(files):
    path, questions = files
    out = path / "repeats"
    proc = samctl("bench", "--model", str(path / "model"), "--questions", str(questions), "--threads", "1",
                  "--methods", "adaptive,recycle,sam+recycle,lookahead", "--max-new-tokens", "48", "--repeats", "3",
                  "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["method"] for r in records} == {"ar", "adaptive", "recycle", "sam+recycle", "lookahead"}
    for r in records:  # greedy: the same state gives the same drafts, so the same step counts
        assert len(r["repeat_steps"]) == 3 and len(set(r["repeat_steps"])) == 1, r
        assert r["steps"] == r["repeat_steps"][0]
