"""Per-run decoding metrics, the same fields in `generate --json`, batch output and `bench`.

Counting: `new_tokens` are generated ids up to and including EOS, capped exactly at
max_new_tokens. The first new token comes from the prefill; every later decode step (one target
forward) commits 1 + a tokens, a accepted draft tokens plus one bonus token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class PredictionUsage:
    """What a request's prediction (its expected output) contributed, counted over distinct
    positions of the prediction, so that accepted + rejected <= tokens: a position is accepted
    when a draft token drawn from it was accepted, rejected when drafted (verified) but never
    accepted. A draft token is drawn from the prediction when the text ending in it (the token
    and at least the one before it) occurs in the prediction; its position is the first such
    occurrence."""

    tokens: int  # the prediction's length in tokens
    accepted: int
    rejected: int


@dataclass
class Metrics:
    new_tokens: int = 0
    steps: int = 0  # decode steps = target verify forwards after the prefill
    accepted: int = 0  # draft tokens accepted, over all steps
    drafted: int = 0  # draft tokens proposed (tree nodes, root excluded), over all steps
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[a] = steps that accepted a drafts
    step_draft_us: list[float] = field(default_factory=list)  # propose + observe of each step
    step_drafted: list[int] = field(default_factory=list)  # draft nodes verified by each step
    draft_s: float = 0.0  # propose + observe, host side
    verify_s: float = 0.0  # the verify forwards (rows batched together share them)
    accept_s: float = 0.0  # the accept step, in host_s: on a GPU mostly the wait for the verify at the step's one sync
    prefill_s: float = 0.0
    time_s: float = 0.0  # wall time of the whole generation, prefill included
    cpu_s: float = 0.0  # this process's CPU time over the same span (other processes do not count; rows batched together share it, as they share time_s)
    eager_verifies: int = 0  # CUDA graphs on, yet the verify ran eagerly (wider than every graph, or capture failed)

    def record_step(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.step_drafted.append(drafted)
        self.accepted += accepted
        self.accept_hist.extend([0] * (accepted + 1 - len(self.accept_hist)))  # nothing when long enough
        self.accept_hist[accepted] += 1

    def record_draft(self, seconds: float) -> None:
        """One step's drafting cost (propose + observe)."""
        self.draft_s += seconds
        self.step_draft_us.append(1e6 * seconds)

    def draft_us_quantile(self, q: float) -> float:
        return float(np.quantile(self.step_draft_us, q)) if self.step_draft_us else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per decode step, bonus included (plain decoding: 1.0)."""
        return (self.new_tokens - 1) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def other_s(self) -> float:
        return max(0.0, self.time_s - self.draft_s - self.verify_s)

    @property
    def host_s(self) -> float:
        """Everything in the decode steps outside the verify forward: drafting, budget, acceptance
        (its host sync included), commit, bookkeeping."""
        return max(0.0, self.time_s - self.prefill_s - self.verify_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0

    def to_dict(self) -> dict:
        def per_step(total: float, scale: float, digits: int) -> float:
            return round(scale * total / self.steps, digits) if self.steps else 0.0

        return {
            "new_tokens": self.new_tokens, "steps": self.steps, "mean_accepted": round(self.mean_accepted, 4),
            "accept_hist": list(self.accept_hist), "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4), "tokens_per_s": round(self.tokens_per_s, 3),
            "time_s": round(self.time_s, 6), "cpu_s": round(self.cpu_s, 6), "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6), "other_s": round(self.other_s, 6),
            "prefill_s": round(self.prefill_s, 6),
            "forward_ms_per_step": per_step(self.verify_s, 1e3, 3), "host_ms_per_step": per_step(self.host_s, 1e3, 3),
            "accept_ms_per_step": per_step(self.accept_s, 1e3, 3), "draft_us_per_step": per_step(self.draft_s, 1e6, 2),
            "draft_us_median": round(self.draft_us_quantile(0.5), 2),
            "draft_us_p90": round(self.draft_us_quantile(0.9), 2), "eager_verifies": self.eager_verifies,
        }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter length if one extends the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
