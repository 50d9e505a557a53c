"""samctl/train/answers.py (the target's own answers, shared by the trainers)
and `samctl train eagle`'s data selection, on the embedded target."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from samctl.models import load_engine

TARGET = Path(__file__).resolve().parent.parent / "samctl" / "models" / "default" / "target"
pytestmark = pytest.mark.skipif(not TARGET.is_dir(), reason="no embedded target in this checkout")


@pytest.fixture(scope="module")
def engine():
    return load_engine(str(TARGET), "cpu", "float32")


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


def _session(engine, max_new_tokens):
    from samctl.train.answers import answering_session

    return answering_session(engine, max_new_tokens, chat=False)


def test_batched_left_padded_answers_equal_naive_greedy(engine, tmp_path):
    from samctl.train.answers import write_answers
    from samctl.train.prompts import Prompt

    texts = ["def add(a, b):", "Write a function that reverses a list in Python.", "x", "Question: 2 + 2 = ?"]
    prompts = [engine.encode(t, chat=False) for t in texts]
    assert len({len(p) for p in prompts}) > 1  # the batch really pads
    answers = write_answers(_session(engine, 12), [Prompt("t", (t,)) for t in texts], tmp_path / "a.jsonl",
                            batch_size=3, log=lambda _: None)
    assert [a.prompt_ids for a in answers] == prompts
    assert [a.output_ids for a in answers] == [naive_greedy(engine, p, 12) for p in prompts]


def test_cached_answers_are_reused_and_extended(engine, tmp_path, monkeypatch):
    from samctl.session import Session
    from samctl.train.answers import read_answers, write_answers
    from samctl.train.prompts import Prompt

    prompts = [Prompt("code", (f"def f{i}(x):",)) for i in range(5)]
    path = tmp_path / "a.jsonl"
    session = _session(engine, 6)
    calls = []
    real = Session.generate_batch
    monkeypatch.setattr(Session, "generate_batch", lambda self, p, **k: calls.append(len(p)) or real(self, p, **k))
    first = write_answers(session, prompts, path, batch_size=2, chunk=2, max_tokens=1, log=lambda _: None)
    assert len(first) == 1 and calls == [2] and list(read_answers(path).values()) == first  # budget spent
    every = write_answers(session, prompts, path, batch_size=2, chunk=2, log=lambda _: None)
    assert every[:1] == first and len(every) == 5 and calls == [2, 1, 2, 1]  # only the 4 new prompts answered
    fresh = write_answers(session, prompts, tmp_path / "b.jsonl", batch_size=5, log=lambda _: None)
    assert every == fresh
    assert write_answers(session, prompts, path, batch_size=2, log=lambda _: None) == every and calls == [2, 1, 2, 1, 5]


def test_sampled_answers_are_seeded_and_every_batch_draws_its_own(engine, tmp_path):
    from samctl.decode.configs import SamplingConfig
    from samctl.train.answers import write_answers
    from samctl.train.prompts import Prompt

    prompts = [Prompt("same", ("def f(x):",))] * 6  # one prompt per chunk: each chunk is its own batch
    session = _session(engine, 12)

    def write(name, sampling, chunk=1):
        answers = write_answers(session, prompts, tmp_path / name, batch_size=2, chunk=chunk, sampling=sampling,
                                log=lambda _: None)
        return [tuple(a.output_ids) for a in answers]

    warm = SamplingConfig(temperature=2.0, seed=7)
    sampled = write("a.jsonl", warm)
    assert sampled == write("b.jsonl", warm)  # seeded: the same draws again
    assert len(set(sampled)) > 1  # chunks do not repeat each other's draws
    assert sampled != write("c.jsonl", SamplingConfig(temperature=2.0, seed=8))
    greedy = write("d.jsonl", SamplingConfig())
    assert set(greedy) == {tuple(naive_greedy(engine, engine.encode("def f(x):", chat=False), 12))}
    assert all(len(a) <= 12 for a in sampled)


def test_batched_answers_are_greedy_resumable_and_multi_turn(engine, tmp_path):
    from samctl.config import SessionConfig
    from samctl.session import Session
    from samctl.train.answers import read_answers, write_answers
    from samctl.train.prompts import Prompt

    session = Session.over(engine, SessionConfig(method="adaptive", max_new_tokens=10, quiet=True))
    prompts = [Prompt("code", (f"def f{i}(x):",)) for i in range(5)] + [Prompt("chat2", ("def g(x):", "and h?"))]
    path = tmp_path / "answers.jsonl"
    first = write_answers(session, prompts, path, batch_size=3, max_tokens=20, log=lambda _: None)
    assert 1 <= len(first) < 7 and len(read_answers(path)) == len(path.read_text().splitlines())
    every = write_answers(session, prompts, path, batch_size=3, log=lambda _: None)  # resumes
    assert [(a.prompt, a.turn) for a in every] == [(i, 0) for i in range(6)] + [(5, 1)]
    assert all(a in every for a in first) and len(path.read_text().splitlines()) == 7
    for answer in every:  # each answer is plain greedy decoding's
        assert answer.output_ids == naive_greedy(engine, answer.prompt_ids, 10)
    second = every[-1]  # the second turn's input holds the first turn and its answer
    assert second.prompt_ids == engine.encode_conversation(
        [{"role": "user", "content": "def g(x):"}, {"role": "assistant", "content": engine.decode(every[5].output_ids)},
         {"role": "user", "content": "and h?"}], chat=False)
    with open(path, "a") as f:
        f.write('{"prompt": 9, "tu')  # a torn line from a kill is dropped
    assert read_answers(path) == {(a.prompt, a.turn): a for a in every}


def test_prompts_come_from_any_corpus_and_spec_bench_turns_are_kept_out(tmp_path):
    from samctl.train.prompts import drop_excluded, read_prompts

    (tmp_path / "a.jsonl").write_text(
        json.dumps({"instruction": "Sort this", "input": "3 1 2", "output": "1 2 3"}) + "\n"
        + json.dumps({"question": "What is  2+2?", "answer": "4"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                   {"role": "user", "content": "Bye"}]}) + "\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "p.txt").write_text("Rewrite this paragraph.")
    prompts = read_prompts([str(tmp_path / "a.jsonl"), str(tmp_path / "docs")])
    assert [p.turns for p in prompts] == [("Sort this\n\n3 1 2",), ("What is  2+2?",), ("Hi", "Bye"),
                                          ("Rewrite this paragraph.",)]
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["what is 2+2?", "Bye"]}) + "\n")
    assert drop_excluded(prompts, [str(questions)]) == ([prompts[0], prompts[3]], 2)
    assert drop_excluded(prompts, []) == (prompts, 0)


def test_mixture_interleaves_every_kind_from_local_text(tmp_path):
    from samctl.train.prompts import local_texts, mixture

    (tmp_path / "gsm8k_train.jsonl").write_text("".join(
        json.dumps({"question": f"What is {i} plus {i}?", "answer": str(2 * i)}) + "\n" for i in range(4)))
    (tmp_path / "gpteacher_roleplay.json").write_text(json.dumps(
        [{"instruction": f"You are a pirate number {i}. Greet me.", "input": "", "output": "Arr"} for i in range(4)]))
    sentences, texts = local_texts()
    if not sentences or not texts:
        pytest.skip("no local prose (standard library docstrings, /usr/share/doc) on this machine")
    prompts = mixture(tmp_path, seed=1)
    assert {p.kind for p in prompts[:5]} == {"math", "roleplay", "chat2", "translation", "summarization"}
    assert all(len(p.turns) == 2 for p in prompts if p.kind == "chat2")
    assert any(p.turns[0].startswith("Translate English to ") for p in prompts[:5])
    assert mixture(tmp_path, seed=1) == prompts


def test_train_eagle_self_distilled_run_records_its_data(tmp_path):
    import samctl.train.eagle as train

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"{i} plus {i} is {2 * i}."} for i in range(30)]
    (data / "gsm8k_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "specbench_question.jsonl").write_text(json.dumps({"turns": ["What is 3 plus 3?"]}) + "\n")
    args = ["--model", str(TARGET), "--prompts", str(data / "gsm8k_train.jsonl"),
            "--exclude", str(data / "specbench_question.jsonl"), "--cache", str(tmp_path / "cache"),
            "--out", str(tmp_path / "head"), "--max-tokens", "1500", "--max-new-tokens", "16",
            "--batch-size", "8", "--heldout", "3", "--max-steps", "2", "--threads", "1"]
    report = train.main(args)
    assert report["data"]["excluded_prompts"] == 1 and report["data"]["answer_method"] == "adaptive"
    assert report["run"]["steps"] == 2 and 0.0 <= report["heldout"]["top1"] <= 1.0
    saved = json.loads((tmp_path / "head" / "eagle.json").read_text())
    assert saved["training"]["data"]["answers_key"] == report["data"]["answers_key"]
    assert len(list((tmp_path / "cache").glob("answers-*.jsonl"))) == 1
    again = train.main(args + ["--baseline-head", str(tmp_path / "head")])  # answers and features reused
    assert again["data"]["answers_key"] == report["data"]["answers_key"]
    assert again["heldout_baseline"]["top1"] == report["heldout"]["top1"]


def test_features_in_padded_batches_equal_one_forward_per_sequence_and_are_cached(engine, tmp_path):
    import numpy as np

    from samctl.decode.eagle_head import target_features
    from samctl.train.eagle import cached_features

    rng = np.random.default_rng(0)
    seqs = [rng.integers(5, engine.vocab_size, size=n).astype(np.int64) for n in (7, 30, 12, 30, 5)]
    features, choices = cached_features(engine, seqs, tmp_path, "m", log=lambda _: None, shard=3, batch_tokens=64)
    start = 0
    for ids in seqs:
        alone, _ = target_features(engine.model, torch.from_numpy(ids))
        assert torch.allclose(features[start : start + len(ids)].float(), alone, atol=2e-2, rtol=1e-2)
        assert choices[start : start + len(ids) - 1].tolist() == ids[1:].tolist()  # the next token
        start += len(ids)
    assert len(list(tmp_path.glob("features-*.safetensors"))) == 2  # shards of 3 and 2 sequences
    again, _ = cached_features(engine, seqs[:3] + [seqs[3][:10]], tmp_path, "m", log=lambda _: None, shard=3)
    assert torch.equal(again[: sum(map(len, seqs[:3]))], features[: sum(map(len, seqs[:3]))])
    assert len(list(tmp_path.glob("features-*.safetensors"))) == 3  # only the changed shard is new
