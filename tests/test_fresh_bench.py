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


def _record(method, qid, group, new_tokens, time_s):
    return {"method": method, "question_id": qid, "category": group, "group": group, "new_tokens": new_tokens,
            "time_s": time_s, "tokens_per_s": new_tokens / time_s, "steps": new_tokens, "draft_s": 0.0,
            "mismatched_turns": 0, "turns": [{}]}


def test_short_answers_are_listed_not_timed_and_tables_give_n():
    from samctl.bench_report import MIN_TIMED_TOKENS, aggregate, markdown, short_answers

    records = [_record("ar", 1, "coding", 64, 1.0), _record("sam", 1, "coding", 64, 0.5),
               _record("ar", 2, "coding", 48, 1.0), _record("sam", 2, "coding", 48, 0.5),
               # a 1-token answer: a timer blip makes it look 20x faster
               _record("ar", 3, "qa", 1, 0.2), _record("sam", 3, "qa", 1, 0.01)]
    table = aggregate(records, ["ar", "sam"])
    assert table["overall"]["sam"]["speedup"] == pytest.approx(2.0)
    assert table["overall"]["sam"]["questions"] == 2 and table["qa"]["sam"]["speedup"] is None
    assert short_answers(records) == [{"question_id": 3, "group": "qa", "new_tokens": 1}] and MIN_TIMED_TOKENS > 1
    text = markdown({"run": {}, "methods": ["ar", "sam"], "table": table, "short_answers": short_answers(records),
                     "mismatches": {"ar": 0, "sam": 0}})
    assert "## coding (n = 2)" in text and "## qa (n = 0; 1 short answer(s) left out)" in text
    assert "## overall (n = 2; 1 short answer(s) left out)" in text
    assert "question 3 (qa, 1 token)" in text
