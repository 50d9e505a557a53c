"""Self-distilled training answers: the target model's own greedy responses to training prompts.

Shared by `samctl train sdsat` and `samctl train eagle` (`--responses self`). Drafters are scored
on what the target emits under greedy decoding, so training on the target's own answers (as
Medusa-2 and the EAGLE follow-ups do when the SFT data is not the model's) matches what acceptance
measures; the datasets' human answers are another distribution.

- `write_responses(engine, prompts, max_new_tokens, batch_size)`: transformers' `generate`,
  greedy, batched with left padding (prompts sorted by length so a batch pads little), each answer
  cut after its first EOS (kept) or at max_new_tokens (no EOS appended).
- `cached_responses(engine, prompts, ..., cache=path)`: the same, answered in order in chunks and
  saved after each chunk to a JSON file in the cache folder (outside the repository), keyed by the
  caller (model fingerprint + prompt selection): a rerun reuses every answer already written and
  an interrupted run resumes. `enough(answers)` may stop it early (a token budget).

Knows an Engine (model, tokenizer, EOS ids) and token ids; never the training objectives.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from samctl.runtime import Engine


def write_responses(engine: Engine, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                    log: Callable[[str], None] | None = None) -> list[list[int]]:
    """The model's own greedy answers to `prompts` (token ids), batched (left-padded), cut after EOS."""
    eos = list(engine.eos_token_ids)
    pad = eos[0] if eos else 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    responses: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in batch)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch], device=engine.device)
        mask = (torch.arange(width, device=engine.device)[None] >= torch.tensor(
            [width - len(prompts[i]) for i in batch], device=engine.device)[:, None]).long()
        with torch.inference_mode():
            out = engine.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                        max_new_tokens=max_new_tokens, pad_token_id=pad,
                                        eos_token_id=eos or None)[:, width:].tolist()
        for i, row in zip(batch, out):
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            responses[i] = row[:cut]
        if log is not None:
            log(f"responses: {min(start + len(batch), len(order))}/{len(order)}")
    return responses


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
