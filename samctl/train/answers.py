"""Self-distilled training answers: the target model's own greedy responses to training prompts.

Shared by `samctl train sdsat` and `samctl train eagle` (`--responses self`). Drafters are scored
on what the target emits under greedy decoding, so training on the target's own answers (as
Medusa-2 and the EAGLE follow-ups do when the SFT data is not the model's) matches what acceptance
measures; the datasets' human answers are another distribution.

- `write_responses(engine, prompts, max_new_tokens, batch_size)`: greedy answers to token-id
  prompts through the batched engine (`Session.generate_batch` with a lossless method), each
  cut after its first EOS (kept) or at max_new_tokens (no EOS appended).
- `cached_responses(engine, prompts, ..., cache=path)`: the same, answered in order in chunks and
  saved after each chunk to a JSON file in the cache folder (outside the repository), keyed by the
  caller (model fingerprint + prompt selection): a rerun reuses every answer already written and
  an interrupted run resumes. `enough(answers)` may stop it early (a token budget).

- `write_answers(session, prompts, path, ...)`: conversations (`samctl.train.prompts.Prompt`,
  one or more user turns) answered turn after turn through the session's batched engine
  (`Session.generate_batch`: greedy, so every answer is plain greedy decoding's, written several
  times faster than one sequence at a time by a lossless method such as `adaptive`). Each finished
  turn is appended to a JSONL file at once (`Answer`: prompt, turn, the turn's prompt ids with the
  earlier turns and answers in the chat template, its output ids); a rerun reads the file and
  answers only what is missing, so an interrupted run resumes. The caller names the file by model
  fingerprint and prompt set. A token budget or a deadline stops it between two answers.

Knows an Engine (model, tokenizer, EOS ids) and token ids; never the training objectives.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from samctl.session import Engine

if TYPE_CHECKING:
    from samctl.session import Session
    from samctl.train.prompts import Prompt


def write_responses(engine: Engine, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                    log: Callable[[str], None] | None = None, method: str = "adaptive") -> list[list[int]]:
    """The model's own greedy answers to `prompts` (token ids), through the batched engine with
    lossless `method` (each answer is plain greedy decoding's), cut after EOS (kept)."""
    from samctl.config import SessionConfig
    from samctl.session import Session

    session = Session.over(engine, SessionConfig(method=method, max_new_tokens=max_new_tokens, quiet=True))
    results = session.generate_batch(prompts, batch_size=batch_size)
    if log is not None:
        log(f"responses: {len(prompts)} written")
    return [list(r.tokens) for r in results]


def cached_responses(engine: Engine, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                     cache: Path, key: str, chunk: int = 128,
                     enough: Callable[[list[list[int]]], bool] | None = None,
                     log: Callable[[str], None] | None = None) -> list[list[int]]:
    """Answers to a prefix of `prompts` (all of them unless `enough` says stop), written `chunk`
    prompts at a time and saved to cache/responses-<key>.json after each chunk; the saved prefix is
    reused. The key must name the model and the prompt order (the caller's fingerprint + selection)."""
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    path = Path(cache) / f"responses-{key}.json"
    answers: list[list[int]] = []
    if path.exists():
        saved = json.loads(path.read_text(encoding="utf-8"))
        answers = [list(map(int, a)) for a in saved["responses"]][: len(prompts)]
        log(f"responses: {len(answers)} reused from {path}")
    tic, written = time.time(), 0
    while len(answers) < len(prompts) and not (enough is not None and enough(answers)):
        part = prompts[len(answers) : len(answers) + chunk]
        answers += write_responses(engine, part, max_new_tokens, batch_size)
        written += sum(map(len, answers[-len(part):]))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "max_new_tokens": max_new_tokens, "responses": answers}),
                       encoding="utf-8")
        os.replace(tmp, path)
        log(f"responses: {len(answers)}/{len(prompts)} prompts answered, {written} new tokens at "
            f"{written / (time.time() - tic):.0f} tokens/s -> {path}")
    return answers


@dataclass(frozen=True)
class Answer:
    prompt: int  # index into the prompt list
    turn: int
    prompt_ids: list[int]  # the turn's input: earlier turns and their answers, then this turn
    output_ids: list[int]  # the greedy answer, EOS included when it ended on one
    kind: str = ""

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class _Stop(Exception):
    """Raised from a result callback to end a batch early (budget or deadline)."""


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
                  chunk: int = 512, log: Callable[[str], None] | None = None) -> list[Answer]:
    """Answer `prompts` turn by turn in order, `chunk` prompts at a time (every first turn of a
    chunk, then every second turn, ...), appending each finished turn to `path` (JSONL); answers
    already there are reused. Stops once the answers hold `max_tokens` tokens (prompt + output) or
    at `deadline` (time.time()). A turn whose input exceeds `max_prompt_tokens` is left out with
    its later turns. -> every answered turn, in (prompt, turn) order (a prompt's later turns may
    be missing when the budget ran out between them)."""
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
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
                    try:
                        session.generate_batch(inputs, batch_size=batch_size, on_result=finished)
                    except _Stop:
                        pass
                    log(f"answers: {len(done)} turns, {total} tokens; {written} new answer tokens at "
                        f"{written / max(time.time() - tic, 1e-9):.0f} tokens/s -> {path}")
            if spent():
                break
    # a turn is answered only after the turns before it, so every answer here has its earlier ones
    return [done[key] for key in sorted(done) if key[0] < len(prompts)]


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
