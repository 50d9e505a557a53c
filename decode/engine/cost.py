"""The target's verify-cost curve t(n): the time of one forward over n input tokens.

`measure_cost` is the one measurement: verify forwards of N = 1.. total input tokens after a fixed
context, as the decode loop runs them ([N, 1] below the row count, [rows, w] beyond, w doubling from
1), then interpolated (the curve is smooth; a denser grid costs start-up time). The widths are
visited round-robin and each keeps its fastest time: on a shared machine another process only ever
adds time. A measurement may be stopped between two forwards (`stop`), which raises `Stopped`.

Under CUDA graphs a verify of n tokens runs the graph of the smallest width w >= n, so t(n) is a
step function measured at the graph widths only; interpolating there would sell 33..63 nodes at
less than the 64-input price. Callers keep eager and graph curves apart (samctl/costs.py).

It knows the target and token ids; caching curves on disk is the caller's business.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from samctl.decode.engine.batched import BatchedTarget
from samctl.decode.engine.target import TargetModel, room
from samctl.decode.tree import DraftTree
from samctl.index.errors import UserError

MEASURED_WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # widths of the forwards measured (eager)
BATCH_POINTS = (1, 4, 16, 64, 256)  # rows of the [N, 1] forwards measured below the batch size


class Stopped(Exception):
    """A cost measurement was stopped before its end (its `stop` said so)."""


def check_stop(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise Stopped("the measurement was stopped")


def linear_cost(token_cost: float, n: int = 256) -> np.ndarray:
    """cost[k] = 1 + token_cost * k: a verify of t0 plus k nodes, relative to t0 alone."""
    return 1.0 + token_cost * np.arange(n + 1, dtype=np.float64)


def relative_cost(t_ms: np.ndarray | list[float], n: int | None = None) -> np.ndarray:
    """t_ms: [w] times of verifying 1..w tokens -> cost [n + 1] (n: 256, or w when longer) with
    cost[k] = t(1 + k) / t(1), made non-decreasing and extended past w along the last measured slope."""
    t = np.maximum.accumulate(np.asarray(t_ms, dtype=np.float64))
    n = max(256, len(t)) if n is None else n
    rel = t / t[0]
    slope = (rel[-1] - rel[-2]) if len(rel) > 1 else 0.0
    k = np.arange(n + 1)
    return np.where(k < len(rel), rel[np.minimum(k, len(rel) - 1)], rel[-1] + slope * (k - len(rel) + 1))


class VerifyCost:
    """What a drafter sizes its drafts by: cost[k] = t(1 + k) / t(1), the price of k draft nodes
    relative to plain decoding, at the context the row has reached; the batched budget reads
    cost[N - 1] = t(N) / t(1) for N input tokens in all, at the step's mean context.
    `measured`: curves after two context lengths, t(n, L) linear in L beyond the first (a shorter
    context is priced as the first), so a long prompt gets shorter drafts; `at(L)` recomputes the
    relative curve per bucket of `BUCKET` entries. `fixed`: one relative curve at every context."""

    BUCKET = 64

    def __init__(self, relative: np.ndarray, short_ms: np.ndarray | None = None, long_ms: np.ndarray | None = None,
                 contexts: tuple[int, int] = (0, 1)) -> None:
        self.relative = np.asarray(relative, dtype=np.float64)
        rel = self.relative
        if rel.ndim != 1 or len(rel) < 2 or rel[0] <= 0 or np.any(np.diff(rel) < 0):
            raise UserError("the verify-cost curve must be positive and non-decreasing from n = 1: "
                            "re-measure it with samctl calibrate")
        self.short_ms, self.long_ms, self.contexts = short_ms, long_ms, contexts
        self._bucket, self._at = None, self.relative  # at(): the last context's bucket and curve

    @classmethod
    def fixed(cls, cost: "VerifyCost | np.ndarray | list[float] | None") -> "VerifyCost":
        """`cost` as a VerifyCost: itself, a fixed relative curve, or (None) 0.5% a draft node."""
        if isinstance(cost, VerifyCost):
            return cost
        return cls(linear_cost(0.005) if cost is None else np.asarray(cost, dtype=np.float64))

    @classmethod
    def one_curve(cls, cost: "VerifyCost | np.ndarray | list[float]") -> "VerifyCost":
        """`cost` as a VerifyCost: itself, or t_ms [n] priced alike at every context (what samctl's
        sessions use: priced by two curves, batch jobs and a one-client server ran no faster)."""
        return cost if isinstance(cost, VerifyCost) else cls.measured(cost, cost, (0, 0))

    @classmethod
    def measured(cls, short_ms: list[float], long_ms: list[float], contexts: tuple[int, int]) -> "VerifyCost":
        """From t_ms [n] after contexts[0] and after contexts[1] committed entries (`measure_cost`)."""
        short, long = np.asarray(short_ms, dtype=np.float64), np.asarray(long_ms, dtype=np.float64)
        if contexts[1] <= contexts[0] or short.shape != long.shape:  # no second context: one curve
            long, contexts = short, (contexts[0], contexts[0])
        return cls(relative_cost(short), short, long, contexts)

    def at(self, context: int) -> np.ndarray:
        """The relative curve [257 or longer] after `context` committed entries."""
        if self.short_ms is None or self.contexts[1] <= self.contexts[0]:
            return self.relative
        bucket = int(context) // self.BUCKET
        if bucket != self._bucket:
            low, high = self.contexts
            share = max(0.0, ((bucket + 0.5) * self.BUCKET - low) / (high - low))  # shorter: priced as the first
            t = np.maximum(self.short_ms + share * (self.long_ms - self.short_ms), self.short_ms[0])
            self._bucket, self._at = bucket, relative_cost(t)
        return self._at


@torch.inference_mode()
def measure_cost(target: BatchedTarget, rows: int = 1, max_width: int = 64, context: int = 256, rounds: int = 2,
                 widths: tuple[int, ...] = MEASURED_WIDTHS, clock: Callable[[], float] = time.perf_counter,
                 stop: Callable[[], bool] | None = None) -> np.ndarray:
    """-> t_ms [rows * max_width]: milliseconds of one verify forward of `target` over N = 1.. total
    input tokens with up to `rows` rows in flight, after `context` committed entries per row, fastest
    of `rounds`. `clock`: time.process_time measures one CPU thread's own work on a busy machine.
    The target's rows hold nothing committed afterwards."""
    vocab = int(getattr(target.model.config, "vocab_size", 1000))
    gen = torch.Generator().manual_seed(0)
    graphs = graph_widths(target)
    grid = [w for w in (graphs or widths) if w < max_width]
    grid.append(next((w for w in graphs if w >= max_width), max_width))
    shapes = sorted({(b, 1) for b in BATCH_POINTS if b < rows} | {(rows, w) for w in grid}, key=lambda s: s[0] * s[1])
    context = measurable_context(target, context, grid[-1])
    # A verify's time depends on how many entries it attends to, not on what they hold: one token
    # per row is prefilled (which allocates the cache) and the rows are then taken to hold
    # `context` entries, instead of prefilling rows * context tokens.
    check_stop(stop)
    target.reserve(room(context, grid[-1]))
    target.prefill(list(range(rows)), [np.array([1], dtype=np.int64)] * rows, [False] * rows)
    sync = (lambda: torch.cuda.synchronize(target.device)) if target.device.type == "cuda" else (lambda: None)
    best = np.full(len(shapes), np.inf)
    for r in range(rounds + 1):  # round 0 warms up and is not kept
        for i, (b, w) in enumerate(shapes):
            target.lengths[:] = 0
            target.lengths[:b] = context  # the same context every time: the verify is not kept
            inputs = [torch.randint(0, vocab, (w,), generator=gen).to(target.device) for _ in range(b)]
            trees = [DraftTree.chain(np.zeros(w - 1, dtype=np.int64)) for _ in range(b)]
            check_stop(stop)
            sync()
            tic = clock()
            target.verify(inputs, trees)
            sync()
            if r:
                best[i] = min(best[i], 1e3 * (clock() - tic))
    target.lengths[:] = 0
    points = np.array([b * w for b, w in shapes], dtype=np.float64)
    fitted = monotone_fit(best)
    n = np.arange(1, rows * max_width + 1)
    if graphs:  # t(n) = t(the graph that serves n)
        return fitted[np.minimum(np.searchsorted(points, n), len(points) - 1)]
    return np.interp(n, points, fitted)


def measure_verify_cost(target: TargetModel, n_max: int = 64, context: int = 256, rounds: int = 2,
                        widths: tuple[int, ...] = MEASURED_WIDTHS, stop: Callable[[], bool] | None = None) -> list[float]:
    """-> t_ms [n_max]: `measure_cost` of a one-row target (decode.engine.target.TargetModel)."""
    return [float(t) for t in measure_cost(target.rows, 1, n_max, context, rounds, widths, stop=stop)]


def measure_batch_cost(model: torch.nn.Module, rows: int, max_width: int = 8, context: int = 256, rounds: int = 2,
                       clock: Callable[[], float] = time.perf_counter, stop: Callable[[], bool] | None = None) -> np.ndarray:
    """-> t_ms [rows * max_width]: `measure_cost` of a new eager target of `rows` rows; the batched
    drafting budget prices a step's padded block [A, q] at t(A * q)."""
    target = BatchedTarget(model, rows, room(context, max_width))
    return measure_cost(target, rows, max_width, context, rounds, clock=clock, stop=stop)


def measurable_context(target: BatchedTarget, context: int, width: int) -> int:
    """`context`, cut to what the model's positions leave room for beside verifies `width` wide."""
    return max(1, min(context, target.max_positions - width - 8))


def graph_widths(target: TargetModel) -> tuple[int, ...]:
    """The widths a target's verifies run at under working CUDA graphs; () when it runs eagerly."""
    graphs = getattr(target, "graphs", None)
    return tuple(graphs.widths) if graphs is not None and graphs.failed is None else ()


def monotone_fit(values: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators):
    a slow outlier at one width is averaged with its neighbours instead of lifting every later one."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in np.asarray(values, dtype=np.float64):
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.full(int(c), s / c) for s, c in blocks])
