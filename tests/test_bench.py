"""`samctl bench` on a tiny local model: files, counting, greedy equality; report arithmetic."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from samctl.index.errors import UserError
from samctl.bench_report import aggregate, markdown
from samctl.commands.bench import _cut, read_questions
from samctl.decode.metrics import first_difference as _first_difference
from tests.conftest import save_tiny_model_with_tokenizer

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["def add(a, b):\n    return a + b\n", "Again, shorter."]},
    {"question_id": 82, "category": "roleplay", "turns": ["The quick brown fox jumps over the lazy dog."]},
    {"question_id": 241, "category": "summarization", "turns": ["Summarize the document. The answer is in the passage above."]},
    {"question_id": 242, "category": "summarization", "turns": ["The dog sleeps. Summarize the document."]},
]


def samctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "samctl", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def bench_files(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench")
    save_tiny_model_with_tokenizer(path / "model")
    save_tiny_model_with_tokenizer(path / "draft", seed=1)
    questions = path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    corpus = path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "def add(a, b):\n    return a + b\n" * 3}) + "\n")
    store = path / "store.sam"
    proc = samctl("build", str(corpus), "-o", str(store), "--tokenizer", str(path / "model"))
    assert proc.returncode == 0, proc.stderr
    return path, questions, store


@pytest.mark.slow
def test_bench_writes_records_summary_and_plot(bench_files):
    path, questions, store = bench_files
    out = path / "out"
    methods = "pld,sam,rest,sd,hf-greedy,hf-pld,hf-assisted"
    proc = samctl("bench", "--model", str(path / "model"), "--draft-model", str(path / "draft"), "--sam", str(store),
                  "--questions", str(questions), "--methods", methods, "--max-new-tokens", "12",
                  "--limit", "1", "--repeats", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "greedy mismatches against ar: 0" in proc.stderr
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    all_methods = ["ar"] + methods.split(",")
    # --limit 1 per reported category: one MT-bench question (two turns), one summarization question
    assert sorted({r["question_id"] for r in records}) == [81, 241]
    assert len(records) == 2 * len(all_methods)
    ar = {r["question_id"]: r for r in records if r["method"] == "ar"}
    for r in records:
        assert r["mismatched_turns"] == 0, r
        assert len(r["repeat_times_s"]) == 2 and r["time_s"] == pytest.approx(min(r["repeat_times_s"]), abs=1e-5)
        assert r["group"] == ("mt_bench" if r["question_id"] == 81 else "summarization")
        assert len(r["turns"]) == (2 if r["question_id"] == 81 else 1)
        assert r["new_tokens"] == ar[r["question_id"]]["new_tokens"]  # same counting for every method
        assert all(1 <= t["new_tokens"] <= 12 for t in r["turns"])
        assert [t["text"] for t in r["turns"]] == [t["text"] for t in ar[r["question_id"]]["turns"]]
        if r["method"].startswith("hf-"):
            assert r["draft_s"] is None and r["steps"] >= 1
        else:
            assert r["turns"][0]["metrics"]["new_tokens"] == r["turns"][0]["new_tokens"]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["table"]) == ["mt_bench", "summarization", "overall"]
    assert summary["table"]["overall"]["ar"]["speedup"] == 1.0
    assert summary["table"]["overall"]["hf-greedy"]["mean_accepted"] == 1.0
    assert summary["table"]["overall"]["hf-greedy"]["speedup_vs_hf_greedy"] == 1.0
    assert set(summary["mismatches"].values()) == {0}
    md = (out / "summary.md").read_text()
    assert "## mt_bench" in md and "## overall" in md and "| hf-pld |" in md
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_refuses_bad_input(bench_files, tmp_path):
    path, questions, _ = bench_files
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa"}\n')
    proc = samctl("bench", "--model", str(path / "model"), "--questions", str(bad), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "turns" in proc.stderr
    proc = samctl("bench", "--model", str(path / "model"), "--questions", str(questions), "--methods", "ar,nope",
                  "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "unknown method nope" in proc.stderr


def test_questions_limit_per_category_round_robin(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": ["x"]}
            for i, c in enumerate(["writing", "writing", "math", "math", "qa", "qa", "qa"])]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    picked = read_questions(path, None, 2)
    assert [q.qid for q in picked] == [0, 2, 4, 5]  # one writing and one math make mt_bench's two
    assert [q.qid for q in read_questions(path, "qa", None)] == [4, 5, 6]
    assert [q.qid for q in read_questions(path, "math", 1)] == [2]
    with pytest.raises(UserError, match="choose from"):
        read_questions(path, "nope", None)


def test_counting_helpers():
    assert _cut([5, 2, 7, 2], {2}, 10) == [5, 2]
    assert _cut([5, 6, 7], {2}, 2) == [5, 6]
    assert _first_difference([1, 2, 3], [1, 2, 3]) is None
    assert _first_difference([1, 2, 3], [1, 4, 3]) == 1
    assert _first_difference([1, 2], [1, 2, 3]) == 2


def _rec(method, qid, group, tokens, time_s, steps, draft_s=0.0):
    return {"method": method, "question_id": qid, "group": group, "new_tokens": tokens, "time_s": time_s,
            "tokens_per_s": tokens / time_s, "steps": steps, "draft_s": draft_s, "mismatched_turns": 0,
            "turns": [{}]}


def test_aggregate_is_spec_bench_speedup():
    records = [
        _rec("ar", 1, "a", 100, 10.0, 99), _rec("ar", 2, "a", 100, 1.0, 99),
        _rec("x", 1, "a", 100, 5.0, 33, 1.0), _rec("x", 2, "a", 100, 1.0, 33, 0.5),
    ]
    row = aggregate(records, ["ar", "x"])["a"]["x"]
    # mean of rates: x (20 + 100) / 2 = 60, ar (10 + 100) / 2 = 55
    assert row["speedup"] == pytest.approx(60 / 55, abs=1e-3)
    assert row["speedup_total_time"] == pytest.approx((200 / 6) / (200 / 11), abs=1e-3)
    assert row["mean_accepted"] == pytest.approx((200 - 2) / 66, abs=1e-3)
    assert row["draft_share"] == pytest.approx(1.5 / 6, abs=1e-4)
    summary = {"run": {"model": "m"}, "methods": ["ar", "x"], "table": aggregate(records, ["ar", "x"]),
               "mismatches": {"ar": 0, "x": 0}}
    assert "| x | 1.09x | 1.83x | — | 3.00 |" in markdown(summary)


def numba_overloads() -> int:
    """Compiled (or cache-loaded) signatures of every numba kernel samctl has imported."""
    from numba.core.registry import CPUDispatcher

    seen = {id(d): d for name, module in list(sys.modules.items()) if name.startswith("samctl")
            for d in vars(module).values() if isinstance(d, CPUDispatcher)}
    return sum(len(d.overloads) for d in seen.values())


def test_bench_warm_up_compiles_what_the_timed_questions_run(bench_files, tmp_path):
    # A kernel first compiled inside a question costs about a second in one timed step (the GPU
    # lease saw `adaptive`'s memory of earlier requests compile so at the second question).
    from samctl.commands.bench import _run_all, _runner, _warm_up
    from samctl.config import SessionConfig
    from samctl.session import Session

    path, questions, _ = bench_files
    session = Session(SessionConfig(model=str(path / "model"), method="ar", max_new_tokens=12, quiet=True))
    runners = {name: _runner(name, session, {}) for name in ("ar", "adaptive", "pld")}
    asked = read_questions(questions, None, None)
    _warm_up(runners, session.engine, asked[0], chat=False)
    before = numba_overloads()
    _run_all(runners, session.engine, asked, session.config, 1, tmp_path / "records.jsonl")
    assert numba_overloads() == before


def test_int8_peers_differ_without_failing_the_run():
    from samctl.commands.bench import peers_on_another_model

    mismatches = {"ar": 0, "adaptive": 0, "hf-greedy": 3, "hf-pld": 2, "hf-assisted": 0}
    assert peers_on_another_model(mismatches, "int8") == ["hf-greedy", "hf-pld"]
    assert peers_on_another_model(mismatches, "none") == []  # the same float32 model: a difference fails
    assert peers_on_another_model({**mismatches, "adaptive": 1}, "int8") == ["hf-greedy", "hf-pld"]  # samctl's still fail
