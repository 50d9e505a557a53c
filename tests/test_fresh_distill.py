"""`samctl distill` never resumes with answers that other settings produced, and its default
--chat falls back to plain prompts on a model without a chat template (issue 24, item 3)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from samctl.cli import cli
from samctl.index.load import load_datastore
from tests.conftest import save_tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny models with the same tokenizer (another seed), and one without a chat template."""
    root = tmp_path_factory.mktemp("distill-models")
    save_tiny_model_with_tokenizer(root / "a", seed=0)
    save_tiny_model_with_tokenizer(root / "b", seed=1)
    save_tiny_model_with_tokenizer(root / "plain", seed=0)
    (root / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    config = root / "plain" / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    return root


def _distill(prompts, out, *args):
    return CliRunner().invoke(cli, ["distill", "--prompts", str(prompts), "-o", str(out), "--threads", "1", *args])


def _answers(out):
    return [json.loads(line) for line in (out.parent / (out.name + ".answers.jsonl")).read_text().splitlines()]


def test_other_settings_start_the_answers_over(tmp_path, models):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "The quick brown fox"}\n')
    out = tmp_path / "self.sam"
    first = _distill(prompts, out, "--model", str(models / "a"), "--max-new-tokens", "6")
    assert first.exit_code == 0, first.output
    assert {a["produced_by"]["max_new_tokens"] for a in _answers(out)} == {6}

    same = _distill(prompts, out, "--model", str(models / "a"), "--max-new-tokens", "6")
    assert "resuming: 2 prompt(s) already answered" in same.output and len(_answers(out)) == 2

    for change, check in ((["--model", str(models / "b"), "--max-new-tokens", "6"], lambda p: p["model"].endswith("b")),
                          (["--model", str(models / "b"), "--max-new-tokens", "9"], lambda p: p["max_new_tokens"] == 9),
                          (["--model", str(models / "b"), "--max-new-tokens", "9", "--no-chat"], lambda p: not p["chat"]),
                          (["--model", str(models / "b"), "--max-new-tokens", "9", "--no-chat", "--temperature", "0.9",
                            "--seed", "1"], lambda p: p["sampling"] != "greedy")):
        run = _distill(prompts, out, *change)
        assert run.exit_code == 0, run.output
        assert "starting the answers over" in run.output and "resuming" not in run.output
        answers = _answers(out)
        assert len(answers) == 2 and all(check(a["produced_by"]) for a in answers), change
        written_by = load_datastore(out).meta.written_by
        assert written_by["model"] == answers[0]["produced_by"]["model"]
        assert written_by["max_new_tokens"] == str(answers[0]["produced_by"]["max_new_tokens"])
        assert written_by["chat_template"] == str(answers[0]["produced_by"]["chat"]).lower()


def test_default_chat_falls_back_on_a_model_without_a_template(tmp_path, models):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    out = tmp_path / "self.sam"
    run = _distill(prompts, out, "--model", str(models / "plain"), "--max-new-tokens", "4")
    assert run.exit_code == 0, run.output
    assert "has no chat template: the prompts are given as plain text" in run.output
    answers = _answers(out)
    assert "error" not in answers[0] and answers[0]["produced_by"]["chat"] is False
    assert load_datastore(out).meta.written_by["chat_template"] == "false"

    forced = _distill(prompts, tmp_path / "forced.sam", "--model", str(models / "plain"), "--chat")
    assert forced.exit_code != 0 and "pass --no-chat" in str(forced.exception) + forced.output
