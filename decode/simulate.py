"""Model-free replay: how a retrieval drafter would do if the model produced a known reference.

`replay` runs the decode loop of `decode.loop.generate` with the target replaced by the
reference: the first reference token comes from the "prefill", and each step

    1) propose  tree = drafter.propose(t0), t0 = ref[i], cut to the tokens still wanted
    2) verify   the target's choice at input j is the reference token after its path:
                choices[j] = ref[i + 1 + depth_j] (depth 0 = the root t0; past the reference's
                end, -1, which matches no draft)
    3) accept   walk_tree along those choices, exactly as the engine does; the choice at the last
                accepted input is the bonus token
    4) commit   committed = t0 + accepted drafts, i advances by 1 + accepted (less at the end)
    5) observe  drafter.observe(committed, None, None): no logits exist here

Only inputs on the accepted path are ever compared, and those spell the reference, so when the
reference is the model's own greedy output, steps, accepted tokens and draft lengths equal the
engine's exactly. Drafters that learn from the target's logits cannot be replayed
(`check_replayable`); drafters that read its hidden states (`needs_hidden`) replay when the caller
passes `hidden`, the target's features over prompt + reference from one teacher-forced forward.

Also here: `Tally`, totals over traces, and `CostModel`, which turns steps and draft sizes into a
projected speedup to rank settings in a sweep. It knows token ids and drafters, not files or text.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from samctl.decode.methods import REPLAYABLE, MethodConfig, method as method_entry
from samctl.decode.metrics import Metrics
from samctl.index.errors import ConfigError, UserError

if TYPE_CHECKING:  # the replay needs torch; reading the cost model and settings (simulate --help) does not
    from samctl.decode.drafters.base import Drafter

def check_replayable(name: str) -> None:
    why = method_entry(name).not_replayable
    if why:
        raise UserError(f"method {name} cannot be replayed without a model ({why}): simulate takes "
                        f"{', '.join(REPLAYABLE)}; measure {name} with samctl bench")


@dataclass(frozen=True)
class Trace:
    """A prompt and the output the model is assumed to produce after it."""

    prompt: np.ndarray  # [n] int64, n >= 1
    reference: np.ndarray  # [r] int64, r >= 1, cut at the first EOS (kept) and at max_new_tokens
    max_new_tokens: int  # >= r: the engine's cap, which bounds draft depth even when EOS comes first
    category: str = ""
    id: str = ""
    prediction: np.ndarray | None = None  # [p] int64: the expected output handed to drafters that take one

    def __post_init__(self) -> None:
        assert 1 <= len(self.reference) <= self.max_new_tokens, (len(self.reference), self.max_new_tokens)


def make_trace(prompt: list[int] | np.ndarray, reference: list[int] | np.ndarray, eos_token_ids: tuple[int, ...] = (),
               max_new_tokens: int | None = None, category: str = "", trace_id: str = "",
               prediction: list[int] | np.ndarray | None = None) -> Trace:
    """A trace whose reference is cut the way the engine cuts output: after the first EOS, and at
    max_new_tokens."""
    prompt = np.asarray(prompt, dtype=np.int64)
    reference = np.asarray(reference, dtype=np.int64)
    if len(prompt) == 0 or len(reference) == 0:
        raise UserError(f"trace {trace_id or '?'} has an empty prompt or reference: give both as non-empty text")
    if eos_token_ids:
        hits = np.flatnonzero(np.isin(reference, np.asarray(eos_token_ids, dtype=np.int64)))
        if len(hits):
            reference = reference[: hits[0] + 1]
    reference = reference[:max_new_tokens]  # None: all of it
    cap = len(reference) if max_new_tokens is None else max_new_tokens
    return Trace(prompt=prompt, reference=reference, max_new_tokens=cap, category=category, id=trace_id,
                 prediction=None if prediction is None else np.asarray(prediction, dtype=np.int64))


def replay(drafter: Drafter, trace: Trace, hidden: Any = None) -> Metrics:
    """The metrics `generate` would report for this drafter if the model emitted trace.reference.
    hidden: [n + r, H] tensor, the target's features at every prompt and reference position, for
    drafters with `needs_hidden`. draft_s counts start + propose + observe, as in the engine."""
    from samctl.decode.tree import walk_tree

    limit, cap = len(trace.reference), trace.max_new_tokens
    # The model's choices after the reference's end (past its EOS) are unknown: -1 never matches.
    ref = np.concatenate((trace.reference, np.full(cap - limit, -1, dtype=np.int64)))
    metrics = Metrics()
    start = time.perf_counter()
    if trace.prediction is not None:
        drafter.expect(trace.prediction)
    features = hidden is not None and drafter.needs_hidden
    n = len(trace.prompt)
    drafter.start(trace.prompt, None, **({"hidden": hidden[:n]} if features else {}))
    metrics.draft_s = time.perf_counter() - start
    emitted = 1  # the prefill's token; t0 = ref[emitted - 1]
    while emitted < limit:
        # 1) propose, cut like the engine: no deeper than the tokens still wanted after t0's bonus
        tic = time.perf_counter()
        tree = drafter.propose(int(ref[emitted - 1])).limit_depth(cap - emitted - 1)
        draft_s = time.perf_counter() - tic
        # 2) verify and 3) accept against the reference
        node_tokens = np.asarray(tree.tokens, dtype=np.int64)
        depths = np.concatenate(([0], tree.depths())).astype(np.int64)
        choices = ref[emitted + depths]  # depth <= cap - emitted - 1 keeps every index < cap
        path = walk_tree(tree.parents, node_tokens, choices, tree.drafts)
        # 4) commit: drafts then the bonus, cut at the reference's end (its EOS, or the cap)
        accepted = len(path) - 1
        take = min(accepted + 1, limit - emitted)
        metrics.record_step(drafted=tree.drafts, accepted=min(accepted, take))
        committed = ref[emitted - 1 : emitted + accepted]
        rows = slice(n + emitted - 1, n + emitted + accepted)  # committed's positions in prompt + reference
        emitted += take
        # 5) observe, unless the output is complete (the engine skips it then too)
        tic = time.perf_counter()
        if emitted < limit:
            drafter.observe(committed, None, None, **({"hidden": hidden[rows]} if features else {}))
        metrics.record_draft(draft_s + time.perf_counter() - tic)
    drafter.finish(trace.reference)
    metrics.new_tokens = limit
    metrics.time_s = time.perf_counter() - start
    return metrics


@dataclass(frozen=True)
class CostModel:
    """Time of a target forward: forward_ms for one token, times cost[k] = t(1 + k) / t(1) for a
    verify of k draft nodes. Linear by default (cost[k] = 1 + token_cost * k); `from_curve` takes
    a measured curve (samctl calibrate). Plain decoding spends one forward per token (prefill
    counted as one forward for both sides), a method one per step plus its drafting time:
        speedup = new_tokens * F / (traces * F + sum over steps of cost[k_step] * F + draft_s)
    Defaults: a 7B model on a datacenter GPU (about 20 ms a token, 64 extra tokens adding about a
    third); measure yours with `samctl calibrate` and pass it."""

    forward_ms: float = 20.0
    token_cost: float = 0.005
    verify_ms: tuple[float, ...] = ()  # measured t(1), t(2), ...; empty: the linear model

    def __post_init__(self) -> None:
        if not (math.isfinite(self.forward_ms) and self.forward_ms > 0
                and math.isfinite(self.token_cost) and self.token_cost >= 0):
            raise ConfigError("the cost model needs a finite {forward_ms} > 0 and {token_cost} >= 0, got {f} and {t}",
                              f=self.forward_ms, t=self.token_cost)
        if self.verify_ms and (len(self.verify_ms) < 2 or min(self.verify_ms) <= 0):
            raise UserError("a verify-cost curve needs at least two positive times: re-run samctl calibrate")

    @classmethod
    def from_curve(cls, t_ms: list[float]) -> "CostModel":
        return cls(forward_ms=float(t_ms[0]), verify_ms=tuple(float(t) for t in t_ms))

    def curve(self, n: int = 256) -> np.ndarray:
        """[n + 1] relative cost of verifying k = 0..n draft nodes."""
        from samctl.decode.engine.cost import linear_cost, relative_cost

        return relative_cost(self.verify_ms, n) if self.verify_ms else linear_cost(self.token_cost, n)

    def speedup(self, tally: "Tally") -> float:
        f = self.forward_ms / 1e3
        sizes = np.asarray(sorted(tally.drafted_hist), dtype=np.int64)
        counts = np.asarray([tally.drafted_hist[k] for k in sizes], dtype=np.float64)
        curve = self.curve(int(sizes.max()) if len(sizes) else 1)
        verify = float(np.dot(counts, curve[sizes])) if len(sizes) else 0.0
        method = tally.traces * f + verify * f + tally.draft_s
        return tally.new_tokens * f / method if method > 0 else 0.0


@dataclass
class Tally:
    """Totals over traces. Per-step means pool all steps (a step of a long trace weighs as much
    as a step of a short one), as MAT does."""

    traces: int = 0
    new_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    time_s: float = 0.0
    accept_hist: list[int] = field(default_factory=list)
    drafted_hist: Counter = field(default_factory=Counter)  # draft size -> steps

    def add(self, m: Metrics) -> None:
        self.traces += 1
        for name in ("new_tokens", "steps", "drafted", "accepted", "draft_s", "time_s"):
            setattr(self, name, getattr(self, name) + getattr(m, name))
        self.drafted_hist.update(m.step_drafted)
        self.accept_hist.extend([0] * (len(m.accept_hist) - len(self.accept_hist)))  # nothing when longer
        for a, n in enumerate(m.accept_hist):
            self.accept_hist[a] += n

    @property
    def mean_accepted(self) -> float:
        """Tokens per decode step, bonus included; each trace's first token is the prefill's."""
        return (self.new_tokens - self.traces) / self.steps if self.steps else 0.0

    def to_dict(self, cost: CostModel) -> dict[str, Any]:
        steps = max(self.steps, 1)
        return {
            "traces": self.traces, "new_tokens": self.new_tokens, "steps": self.steps,
            "forwards": self.traces + self.steps,  # prefills included
            "mean_accepted": round(self.mean_accepted, 4), "drafted_per_step": round(self.drafted / steps, 3),
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "draft_us_per_step": round(1e6 * self.draft_s / steps, 2),
            "projected_speedup": round(cost.speedup(self), 3), "accept_hist": list(self.accept_hist),
        }


def tally_by_category(traces: list[Trace], metrics: list[Metrics]) -> dict[str, Tally]:
    """Tallies per trace category plus "overall"."""
    tallies: dict[str, Tally] = {}
    for trace, m in zip(traces, metrics):
        for key in (trace.category or "uncategorized", "overall"):
            tallies.setdefault(key, Tally()).add(m)
    return tallies


def sweep_configs(method: str, base: MethodConfig, has_store: bool) -> Iterator[tuple[dict[str, Any], MethodConfig]]:
    """Every grid point of `method`'s sweep (its registry entry) as (setting {"section.field":
    value}, config based on base)."""
    entry = method_entry(method)
    grid = {k: v for k, v in entry.sweep.items() if has_store or k not in entry.store_fields}
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        config = base
        for (section, name), value in zip(keys, values):
            part = dataclasses.replace(getattr(config, section), **{name: value})
            config = dataclasses.replace(config, **{section: part})
        yield {f"{s}.{n}": v for (s, n), v in zip(keys, values)}, config
