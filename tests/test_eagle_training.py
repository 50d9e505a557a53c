"""samctl/train/answers.py (the target's own greedy answers, shared by train_eagle and train_sdsat)
and `samctl train eagle`'s data selection, on the embedded target."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from samctl.runtime import load_engine

TARGET = Path(__file__).resolve().parent.parent / "samctl" / "models" / "default" / "target"
pytestmark = pytest.mark.skipif(not TARGET.is_dir(), reason="no embedded target in this checkout")


@pytest.fixture(scope="module")
def engine():
    return load_engine(str(TARGET), "cpu", "float32", quiet=True)


def naive_greedy(engine, prompt: list[int], max_new_tokens: int) -> list[int]:
    """One unpadded full forward per token; stops after EOS (kept)."""
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            token = int(engine.model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token in engine.eos_token_ids:
                break
    return out


def test_batched_left_padded_answers_equal_naive_greedy(engine):
    from samctl.train.answers import write_responses

    texts = ["def add(a, b):", "Write a function that reverses a list in Python.", "x", "Question: 2 + 2 = ?"]
    prompts = [engine.encode(t, chat=False) for t in texts]
    assert len({len(p) for p in prompts}) > 1  # the batch really pads
    answers = write_responses(engine, prompts, max_new_tokens=12, batch_size=3)
    assert answers == [naive_greedy(engine, p, 12) for p in prompts]


def test_cached_answers_are_reused_and_extended(engine, tmp_path, monkeypatch):
    import samctl.train.answers as sd

    prompts = [engine.encode(f"def f{i}(x):", chat=False) for i in range(5)]
    first = sd.cached_responses(engine, prompts, 6, 2, tmp_path, "k", chunk=2, enough=lambda a: len(a) >= 2)
    assert len(first) == 2 and json.loads((tmp_path / "responses-k.json").read_text())["responses"] == first
    calls = []
    real = sd.write_responses
    monkeypatch.setattr(sd, "write_responses", lambda e, p, *a, **k: calls.append(len(p)) or real(e, p, *a, **k))
    every = sd.cached_responses(engine, prompts, 6, 2, tmp_path, "k", chunk=2)
    assert every[:2] == first and len(every) == 5 and calls == [2, 1]  # only the 3 new prompts answered
    assert every == sd.write_responses(engine, prompts, 6, 5)
    assert sd.cached_responses(engine, prompts, 6, 2, tmp_path, "k") == every and calls == [2, 1, 5]


def test_spec_bench_turns_are_kept_out(tmp_path):
    from samctl.train.eagle import drop_excluded

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["What is  2+2?", "And 3+3?"]}) + "\n")
    rows = [("gsm8k", "what is 2+2?", "4"), ("gsm8k", "What is 5+5?", "10"), ("x", "and 3+3?\n", "6")]
    assert drop_excluded(rows, questions) == ([rows[1]], 2)
    assert drop_excluded(rows, tmp_path / "absent.jsonl") == (rows, 0)


def test_train_eagle_self_distilled_run_records_its_data(tmp_path):
    import samctl.train.eagle as train

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"{i} plus {i} is {2 * i}."} for i in range(30)]
    (data / "gsm8k_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "specbench_question.jsonl").write_text(json.dumps({"turns": ["What is 3 plus 3?"]}) + "\n")
    args = ["--model", str(TARGET), "--data-dir", str(data), "--cache", str(tmp_path / "cache"),
            "--out", str(tmp_path / "head"), "--max-tokens", "1500", "--max-new-tokens", "16",
            "--response-batch", "8", "--heldout", "3", "--max-steps", "2", "--threads", "1"]
    report = train.main(args)
    assert report["data"]["responses"] == "self" and report["data"]["excluded_instructions"] == 1
    assert report["run"]["steps"] == 2 and 0.0 <= report["heldout"]["top1"] <= 1.0
    saved = json.loads((tmp_path / "head" / "eagle.json").read_text())
    assert "self" in json.dumps(saved)
    assert len(list((tmp_path / "cache").glob("responses-*.json"))) == 1
    again = train.main(args + ["--baseline-head", str(tmp_path / "head")])  # answers and features reused
    assert again["data"]["responses_key"] == report["data"]["responses_key"]
    assert again["heldout_baseline"]["top1"] == report["heldout"]["top1"]
