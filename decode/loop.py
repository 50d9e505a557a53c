"""The decode loop: one loop for every method.

    1) propose  the drafter returns a draft tree rooted at the pending token t0
    2) verify   one target forward over [t0, nodes...] with the tree mask
    3) accept   the target's choice at every input (argmax, or one sample each), moved to the host
                in the step's only synchronization; walk the tree along those choices
    4) commit   keep the accepted path's K/V, emit its tokens, stop at EOS or max_new_tokens
    5) observe  the drafter learns what was committed and sees every verified input's logits
                (and, for a drafter with `needs_hidden`, the target's last hidden state at each
                committed position, from the same verify forward)

Greedy output equals plain greedy decoding token for token. With sampling, one draw per node
shared by every path through it keeps the output distribution exactly the target's
(`decode.accept.tree_accept` for deterministic drafts, `decode.accept.speculative_accept` for
drafts carrying q).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from samctl.decode.accept import speculative_accept, tree_accept
from samctl.decode.drafters.base import Drafter
from samctl.decode.metrics import Metrics, PredictionUsage
from samctl.decode.sampling import SamplingConfig, choose_tokens
from samctl.decode.engine.target import TargetModel, to_device
from samctl.index.errors import ConfigError, UserError


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    eos_token_ids: tuple[int, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError("{max_new_tokens} must be >= 1, got {value}", value=self.max_new_tokens)


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only, EOS included when generation stopped on it
    finish_reason: str  # "eos" | "length" | "stop" (on_tokens asked to stop)
    metrics: Metrics
    prediction: PredictionUsage | None = None  # set by the caller that handed the drafter a prediction


class _Output:
    """Collects emitted tokens, cutting at the first EOS, exactly at max_new_tokens, and where
    on_tokens says a stop string ended the answer."""

    def __init__(self, config: GenerationConfig, on_tokens: Callable[[list[int]], bool | None] | None) -> None:
        self.tokens: list[int] = []
        self.limit = config.max_new_tokens
        self.eos = set(config.eos_token_ids)
        self.on_tokens = on_tokens
        self.finish_reason = ""

    def emit(self, new: list[int]) -> None:
        take = new[: self.limit - len(self.tokens)]
        for i, tok in enumerate(take):
            if tok in self.eos:
                take = take[: i + 1]
                self.finish_reason = "eos"
                break
        self.tokens.extend(take)
        if not self.finish_reason and len(self.tokens) >= self.limit:
            self.finish_reason = "length"
        if self.on_tokens and take:
            self._stop_at(self.on_tokens(take), len(take))

    def _stop_at(self, answer: bool | int | None, given: int) -> None:
        # on_tokens ends generation (a stop string, a client gone) by returning True (after every
        # token it was given) or an int k: the k-th completed a stop string, the rest are not the
        # answer and are dropped (a step may commit several tokens past a stop string)
        if answer is None or answer is False:
            return
        if answer is not True and answer < given:
            del self.tokens[len(self.tokens) - given + answer:]
            self.finish_reason = "stop"
        elif not self.finish_reason:
            self.finish_reason = "stop"

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def remaining(self) -> int:
        return self.limit - len(self.tokens)


@torch.inference_mode()
def generate(
    target: TargetModel,
    drafter: Drafter,
    prompt_ids: list[int] | np.ndarray,
    config: GenerationConfig,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
) -> GenerationResult:
    """Generate up to config.max_new_tokens after prompt_ids with drafts from `drafter`;
    `on_tokens` gets the new tokens of each step and may return True to stop after them, or k to
    stop after the first k of them."""
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    error = prompt_error(prompt, target.max_positions, target.context_note)
    if error:
        raise UserError(error)
    generator = _make_generator(config.sampling, target.device)
    metrics = Metrics()
    out = _Output(config, on_tokens)
    start, cpu_start = time.perf_counter(), time.process_time()

    # Only Token Recycle reads the logits of every prompt position; the rest need the last row.
    all_logits = drafter.prefill_logits == "all"
    hidden = drafter.needs_hidden  # EAGLE heads read the target's features
    target.capture_hidden(hidden)
    logits = target.prefill(to_device(prompt, target.device), all_logits, reserve=len(prompt) + config.max_new_tokens)
    t0 = int(choose_tokens(logits[-1:], config.sampling, generator)[0])  # the prefill's one host sync
    metrics.prefill_s = time.perf_counter() - start
    tic = time.perf_counter()
    if hidden:
        drafter.start(prompt, logits, hidden=target.hidden)
    else:
        drafter.start(prompt, logits)
    metrics.draft_s += time.perf_counter() - tic
    out.emit([t0])

    own_rule = drafter.accept  # only reference reproductions that are not lossless
    eager_before = target.eager_fallbacks
    while not out.done and target.cached + 1 < target.max_positions:
        t0 = _step(target, drafter, t0, config.sampling, generator, out, metrics, own_rule)
    if not out.done:
        out.finish_reason = "length"  # the model's context is full
    drafter.finish(np.asarray(out.tokens, dtype=np.int64))
    metrics.new_tokens = len(out.tokens)
    metrics.eager_verifies = target.eager_fallbacks - eager_before
    metrics.time_s = time.perf_counter() - start
    metrics.cpu_s = time.process_time() - cpu_start
    return GenerationResult(tokens=out.tokens, finish_reason=out.finish_reason, metrics=metrics)


def prompt_error(prompt: np.ndarray, max_positions: int, context_note: str = "the model's context") -> str:
    """Why no token can be generated after `prompt` ("" when one can)."""
    if len(prompt) == 0:
        return "the prompt is empty: give at least one token of text"
    if len(prompt) + 1 > max_positions:
        return f"prompt is {len(prompt)} tokens, {context_note} is {max_positions}: shorten the prompt"
    return ""


def _step(
    target: TargetModel,
    drafter: Drafter,
    t0: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    out: _Output,
    metrics: Metrics,
    own_rule: Callable | None = None,
) -> int:
    # 1) propose: drafts deeper than the tokens still wanted, or than the context allows, are waste
    tic = time.perf_counter()
    tree = drafter.propose(t0)
    depth = min(out.remaining - 1, target.max_positions - target.cached - 1)
    limited = tree.limit_depth(depth)
    if limited is not tree:
        drafter.keep_depth(depth)
        tree = limited
    input_ids = target.verify_input(t0, tree)
    draft_s = time.perf_counter() - tic

    # 2) verify and 3) accept
    tic = time.perf_counter()
    logits = target.verify(input_ids, tree)
    if own_rule is not None:  # the drafter's own acceptance (decode/drafters/base.py)
        path, bonus, host_inputs = own_rule(logits, tree, input_ids, sampling, generator)
    elif tree.q is not None and not sampling.greedy:
        path, bonus, host_inputs = speculative_accept(logits, tree, input_ids, sampling, generator)
    else:
        path, bonus, host_inputs = tree_accept(logits, tree, input_ids, sampling, generator)
    metrics.verify_s += time.perf_counter() - tic

    # 4) commit
    target.keep(path)
    committed = host_inputs[path]
    before = len(out.tokens)
    out.emit([int(t) for t in committed[1:]] + [bonus])
    metrics.record_step(drafted=tree.drafts, accepted=min(len(path) - 1, len(out.tokens) - before))

    # 5) observe
    tic = time.perf_counter()
    if not out.done:
        if target.hidden is not None:  # [q, H] of this verify -> [1 + a, H] at the committed inputs
            drafter.observe(committed, input_ids, logits, hidden=target.hidden[to_device(path, target.device)])
        else:
            drafter.observe(committed, input_ids, logits)
    metrics.record_draft(draft_s + time.perf_counter() - tic)
    return bonus


def _make_generator(sampling: SamplingConfig, device: torch.device) -> torch.Generator | None:
    if sampling.greedy:
        return None
    generator = torch.Generator(device=device)
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)
    return generator
