"""`samctl distill`: answers by the (embedded) model, resumable, then a store over them."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from samctl.index.load import load_datastore
from samctl.cli import cli
from samctl.index.errors import UserError
from samctl.tokenizer import load_tokenizer

PROMPTS = [{"id": "a", "prompt": "Write a Python function that adds two numbers."},
           {"prompt": "What is 2 + 3?"},
           {"turns": ["Name a color.", "Another one."]},
           {"nothing": 1}]


def _run(args):
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.slow
def test_distill_answers_resumes_and_builds(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    extra = tmp_path / "extra.txt"
    extra.write_text("An extra document about colors: red, green and blue.\n")
    out = tmp_path / "self.sam"
    args = ["distill", "--prompts", str(prompts), "-o", str(out), "--max-new-tokens", "12", "--threads", "1"]
    _run(args + ["--also", str(extra)])
    answers_path = tmp_path / "self.sam.answers.jsonl"
    answers = [json.loads(line) for line in answers_path.read_text().splitlines()]
    assert [a["id"] for a in answers] == ["a", 2, 3, 4]
    assert "error" in answers[3] and all("text" in a for a in answers[:3])
    assert len(answers[2]["turn_texts"]) == 2

    store = load_datastore(out)
    assert store.meta.written_by["method"] == "adaptive"
    assert store.meta.written_by["answers"] == "3"
    assert store.meta.corpus.documents == 4  # three answered records + the --also file
    # every answer is in the store verbatim
    tok = load_tokenizer("default")
    for a in answers[:3]:
        ids = np.array(tok.encode(a["text"].strip()), dtype=np.int32)
        assert store.structure.match(ids)[1] == len(ids)

    # a second run resumes: only the failed record is tried again, nothing is regenerated
    result = _run(args)
    assert "resuming: 3 prompt(s) already answered" in result.output
    again = answers_path.read_text().splitlines()
    assert len(again) == 5 and "error" in json.loads(again[-1])
    assert load_datastore(out).meta.corpus.documents == 3

    # the answers above were written on the batched engine (8 records in flight by default); one
    # record at a time gives the same greedy texts
    single = tmp_path / "single"
    single.mkdir()
    _run(["distill", "--prompts", str(prompts), "-o", str(single / "s.sam"), "--max-new-tokens", "12",
          "--threads", "1", "--batch-size", "1"])
    one_by_one = [json.loads(line) for line in (single / "s.sam.answers.jsonl").read_text().splitlines()]
    assert [a.get("text") for a in one_by_one] == [a.get("text") for a in answers]


@pytest.mark.parametrize("extra, message", [
    (["-o", "{tmp}/missing/self.sam"], "does not exist: create it"),
    (["-o", "{tmp}/notes.txt"], "exists and is not a samctl store"),
    (["-o", "{tmp}/self.sam", "--answers", "{tmp}/missing/a.jsonl"], "--answers"),
    (["-o", "{tmp}/self.sam", "--also", "{tmp}/no-such-corpus"], "--also"),
    (["-o", "{tmp}/self.sam", "--answers", "{tmp}/p.jsonl"], "is what --prompts reads"),  # it was deleted
])
def test_distill_refuses_unusable_paths_before_the_model_loads(tmp_path, extra, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n")
    (tmp_path / "notes.txt").write_text("not a store")
    args = ["distill", "--prompts", str(prompts), *[a.format(tmp=tmp_path) for a in extra]]
    result = CliRunner().invoke(cli, args)  # a UserError: samctl.cli.main words it in one line, exit 2
    assert isinstance(result.exception, UserError) and message in str(result.exception), result.exception
    assert (tmp_path / "notes.txt").read_text() == "not a store"
    assert not list(tmp_path.glob("*.answers.jsonl")) and prompts.read_text() == json.dumps(PROMPTS[0]) + "\n"
