"""The one writer of a target model's own answers to training prompts (the trainers share it).

Drafters are scored on what the target emits, so they train on its own answers (as Medusa-2 and
the EAGLE follow-ups do), not the datasets' human ones. `write_answers` answers conversations turn
after turn through a session's batched engine with a lossless method (greedy answers are plain
greedy decoding's, sampled ones follow the model's distribution) and appends each finished turn to
a JSONL file at once; a rerun answers only what is missing, so an interrupted run resumes.

Knows a session (model, tokenizer, EOS ids) and token ids; never the training objectives.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from samctl.decode.configs import SamplingConfig
from samctl.heads import model_fingerprint
from samctl.models import Engine, load_engine

if TYPE_CHECKING:
    from samctl.session import Session
    from samctl.train.prompts import Prompt


@dataclass(frozen=True)
class Answer:
    prompt: int  # index into the prompt list
    turn: int
    prompt_ids: list[int]  # the turn's input: earlier turns and their answers, then this turn
    output_ids: list[int]  # the answer, EOS included when it ended on one
    kind: str = ""

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class _Stop(Exception):
    """Raised from a result callback to end a batch early (budget or deadline)."""


def answers_key(fingerprint: dict, prompts: Sequence["Prompt"], *settings) -> str:
    """Names an answer file: the model, every prompt's turns in order, and the answering settings."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(json.dumps(prompt.turns).encode("utf-8"))
    return hashlib.sha256(json.dumps([fingerprint, digest.hexdigest(), *settings], sort_keys=True).encode()).hexdigest()[:16]


def answering_session(engine: Engine, max_new_tokens: int, chat: bool) -> "Session":
    """A session over a trainer's loaded engine that answers with `adaptive` (lossless)."""
    from samctl.config import SessionConfig
    from samctl.session import Session

    return Session.over(engine, SessionConfig(method="adaptive", max_new_tokens=max_new_tokens, chat=chat, quiet=True))


def own_answers(engine: Engine, prompts: Sequence["Prompt"], chat: bool, *, cache: str, name: str,
                max_new_tokens: int, max_prompt_tokens: int, batch_size: int,
                sampling: SamplingConfig = SamplingConfig(), settings: tuple = ()) -> list[Answer]:
    """The engine's own answers (`write_answers`), kept in `cache` (reused and resumed there) as
    NAME-answers-KEY.jsonl, or in a scratch folder when `cache` is empty; `settings` enter the key."""
    session = answering_session(engine, max_new_tokens, chat)
    with tempfile.TemporaryDirectory() as scratch:
        key = answers_key(model_fingerprint(engine.model, engine.tokenizer), prompts, max_new_tokens,
                          max_prompt_tokens, chat, *settings)
        path = Path(cache or scratch) / f"{name}-answers-{key}.jsonl"
        return write_answers(session, prompts, path, batch_size=batch_size, max_prompt_tokens=max_prompt_tokens,
                             sampling=sampling)


def trainer_engine(config, model: str) -> Engine:
    """A trainer's start: --threads and --seed set, then the model in float32 on unpacked weights
    (prepacked ones do not train) and transformers' forward (the native one reads the weights once)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    return load_engine(model, config.device, "float32", prepack=False, backend="hf")


def read_answers(path: Path) -> dict[tuple[int, int], Answer]:
    """The answers already in `path` by (prompt, turn); a torn last line (a kill mid-write) is dropped."""
    answers: dict[tuple[int, int], Answer] = {}
    if Path(path).exists():
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                answer = Answer(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                continue
            answers[(answer.prompt, answer.turn)] = answer
    return answers


def write_answers(session: "Session", prompts: Sequence["Prompt"], path: Path, *, batch_size: int = 32,
                  max_prompt_tokens: int = 512, max_tokens: int | None = None, deadline: float | None = None,
                  chunk: int = 512, sampling: SamplingConfig = SamplingConfig(),
                  log: Callable[[str], None] | None = None) -> list[Answer]:
    """Answer `prompts` turn by turn, `chunk` prompts at a time (every first turn of a chunk, then
    every second, ...), appending each finished turn to `path` (JSONL) and reusing those there. With
    a seed, each batch of a chunk and turn draws from its own seeded stream. Stops once the answers
    hold `max_tokens` tokens (prompt + output) or at `deadline` (time.time()). A turn whose input
    exceeds `max_prompt_tokens` is left out with its later turns. -> the answered turns, in
    (prompt, turn) order."""
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    if session.config.sampling != sampling:
        session = session.for_method(session.config.method, sampling=sampling)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = read_answers(path)
    total = sum(a.tokens for a in done.values())
    if done:
        log(f"answers: {len(done)} turns ({total} tokens) reused from {path}")
    tic, written, too_long = time.time(), 0, set()

    def spent() -> bool:
        return (max_tokens is not None and total >= max_tokens) or (deadline is not None and time.time() >= deadline)

    with open(path, "a", encoding="utf-8") as out:
        for start in range(0, len(prompts), chunk):
            for turn in range(max(len(p.turns) for p in prompts[start : start + chunk])):
                if spent():
                    break
                todo, inputs = [], []
                for i in range(start, min(start + chunk, len(prompts))):
                    if turn >= len(prompts[i].turns) or (i, turn) in done or i in too_long:
                        continue
                    if turn and (i, turn - 1) not in done:
                        continue
                    ids = session.encode(_conversation(session, prompts[i], i, turn, done))
                    if len(ids) > max_prompt_tokens:
                        too_long.add(i)
                        continue
                    todo.append(i)
                    inputs.append(ids)

                def finished(result, todo=todo, inputs=inputs, turn=turn) -> None:
                    nonlocal total, written
                    if result.finish_reason == "error":
                        return
                    i = todo[result.index]
                    answer = Answer(i, turn, [int(t) for t in inputs[result.index]], [int(t) for t in result.tokens],
                                    prompts[i].kind)
                    out.write(json.dumps(asdict(answer)) + "\n")
                    out.flush()
                    done[(i, turn)] = answer
                    total += answer.tokens
                    written += len(answer.output_ids)
                    if spent():
                        raise _Stop

                if todo:
                    if sampling.seed is not None:
                        session = session.for_method(session.config.method, sampling=replace(
                            sampling, seed=_batch_seed(sampling.seed, start, turn)))
                    with contextlib.suppress(_Stop):
                        session.generate_batch(inputs, batch_size=batch_size, on_result=finished)
                    log(f"answers: {len(done)} turns, {total} tokens; {written} new answer tokens at "
                        f"{written / max(time.time() - tic, 1e-9):.0f} tokens/s -> {path}")
            if spent():
                break
    # a turn is answered only after the turns before it, so every answer here has its earlier ones
    return [done[key] for key in sorted(done) if key[0] < len(prompts)]


def _batch_seed(seed: int, start: int, turn: int) -> int:
    """The seed of the batch of the chunk starting at prompt `start`, turn `turn`: distinct per batch."""
    return int.from_bytes(hashlib.sha256(json.dumps([seed, start, turn]).encode()).digest()[:8], "little") >> 1


def _conversation(session: "Session", prompt: "Prompt", index: int, turn: int,
                  done: dict[tuple[int, int], Answer]) -> str | list[dict[str, str]]:
    """The input of `turn`: its text alone, or the earlier turns with their answers, then it."""
    if turn == 0:
        return prompt.turns[0]
    messages = []
    for k in range(turn):
        messages += [{"role": "user", "content": prompt.turns[k]},
                     {"role": "assistant", "content": session.decode(done[(index, k)].output_ids)}]
    return messages + [{"role": "user", "content": prompt.turns[turn]}]

