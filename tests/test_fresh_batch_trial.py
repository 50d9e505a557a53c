"""A new user's trial of `generate` batches: --resume never takes a bad line's number for a record's
id and counts one record per output line, and its progress counts only the records it runs."""
from __future__ import annotations

import json

import pytest

from samctl import progress
from samctl.index.errors import UserError
from samctl.records import RecordRunner, count_records, finished_keys, read_records, unfinished
from tests.test_cli_robustness import _main


def test_resume_skips_one_record_per_output_line_and_never_a_bad_lines_number(tmp_path):
    lines = ['{"id": 5, "prompt": "a"}', '{"id": broken', '{"id": 2, "prompt": "b"}', '{"id": 5, "prompt": "c"}',
             '{"prompt": "d"}']
    bad, failed = RecordRunner(session=None).process(2, lines[1])
    assert failed and json.loads(bad) == {"line": 2, "error": json.loads(bad)["error"]}
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": 5, "text": "x"}) + "\n" + bad + "\n")  # killed after two lines
    skipped = []
    left = unfinished(read_records(lines), finished_keys(str(out)), lambda: skipped.append(1))
    assert [number for number, _ in left] == [3, 4, 5] and len(skipped) == 2
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    with open(tmp_path / "in.jsonl") as handle:
        assert count_records(handle, finished_keys(str(out))) == 3 and count_records(handle) == 5


def test_resume_progress_counts_the_records_it_runs(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress, "LINE_PERIOD_S", 0.0)  # a progress line on every record
    batch = tmp_path / "in.jsonl"
    batch.write_text("".join(json.dumps({"id": i, "prompt": f"def f{i}(a):"}) + "\n" for i in range(4)))
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps({"id": i, "text": "x"}) + "\n" for i in range(3)))
    code, _, err = _main(["generate", "--model", str(model_dir), "--input", str(batch), "--output", str(out),
                          "--resume", "--max-new-tokens", "4", "--threads", "1"], capsys)
    assert code == 0, err
    assert "samctl: generate: 1/1 records" in err and "done in" in err, err
    assert f"--resume: skipped 3 record(s) already in {out}" in err


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi", "--output", "{out}"], "--output applies to a batch: give --input FILE"),
    (["--prompt", "hi", "--field", "text"], "--field applies to a batch: give --input FILE"),
    (["--input", "{batch}", "--json"], "--json applies to a single prompt; a batch's output is JSON lines already"),
    (["--input", "{batch}", "--prediction", "{batch}"], "--prediction applies to a single prompt; in a batch give "),
    (["--input", "{batch}", "--compare", "--compare-runs", "3"], "--compare-runs applies to a single prompt; "),
    (["--prompt", "hi", "--compare-runs", "5"], "--compare-runs sets the rounds of --compare: add --compare"),
])
def test_a_flag_the_run_would_ignore_is_refused_in_one_line(args, message, tmp_path, capsys):
    batch, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    batch.write_text('{"prompt": "a"}\n')
    args = [a.format(batch=batch, out=out) for a in args]
    code, stdout, err = _main(["generate", *args, "--threads", "1"], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err and stdout == "", err
    assert not out.exists()


def test_quiet_compare_prints_no_summary_unless_the_outputs_differ(model_dir, monkeypatch, capsys):
    from samctl.session import Session

    args = ["generate", "--model", str(model_dir), "--prompt", "def f(a):", "--max-new-tokens", "4", "--threads", "1",
            "--compare", "--compare-runs", "1", "-q"]
    code, out, err = _main(args, capsys)
    assert code == 0 and out and err == "", err
    compare = Session.compare
    monkeypatch.setattr(Session, "compare", lambda *a, **k: {**compare(*a, **k), "identical": False,
                                                             "first_difference": 2, "exact_dtype": True})
    code, _, err = _main(args, capsys)
    assert code == 1 and err.count("\n") == 1 and "OUTPUTS DIFFER at token 2" in err, err


@pytest.mark.parametrize("flags, note", [
    (["--compare"], "note: --compare times records one at a time: batch size 1"),
    (["--memory-save", "{memory}"], "note: --memory-file/--memory-save keep one drafter's memory: batch size 1"),
])
def test_a_batch_that_runs_one_record_at_a_time_says_so_once(flags, note, model_dir, tmp_path, capsys):
    batch = tmp_path / "in.jsonl"
    batch.write_text("".join(json.dumps({"id": i, "prompt": f"def f{i}(a):"}) + "\n" for i in range(2)))
    flags = [f.format(memory=tmp_path / "memory.sam") for f in flags]
    code, _, err = _main(["generate", "--model", str(model_dir), "--input", str(batch), "--max-new-tokens", "4",
                          "--threads", "1", *flags], capsys)
    assert code == 0 and err.count(note) == 1, err


def test_a_turn_that_is_not_text_is_named():
    from samctl.records import prompt_turns

    with pytest.raises(UserError, match=r"^turn 2 of the record's `turns` is not text: give every turn as a string$"):
        prompt_turns({"turns": ["Hi", 5]}, None)
    with pytest.raises(UserError, match="no prompt"):
        prompt_turns({"turns": []}, None)
    assert prompt_turns({"turns": ["Hi", "again"]}, None) == ["Hi", "again"]


def test_bench_notes_an_unread_store_only_when_no_method_reads_it(model_dir, tmp_path, capsys):
    (tmp_path / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 3)
    store = tmp_path / "s.sam"
    assert _main(["build", str(tmp_path / "a.txt"), "-o", str(store), "--tokenizer", str(model_dir), "-q"],
                 capsys)[0] == 0
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "coding", "turns": ["def add(a, b):"]}) + "\n")
    said = {}
    for methods in ("sam", "pld"):
        code, _, err = _main(["bench", "--model", str(model_dir), "--sam", str(store), "--questions", str(questions),
                              "--methods", methods, "--max-new-tokens", "4", "--threads", "1",
                              "--out", str(tmp_path / methods)], capsys)
        assert code == 0, err
        said[methods] = err
    assert "does not use the store" not in said["sam"], said["sam"]
    assert said["pld"].count(f"note: method ar does not use the store {store}") == 1, said["pld"]
