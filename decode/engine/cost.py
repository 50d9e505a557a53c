"""The target's verify-cost curve t(n): the time of one forward over n input tokens.

`measure_verify_cost` times verify forwards of 1..n_max tokens (t0 plus a chain of n - 1 draft
nodes) after a fixed context, as the decode loop runs them, at widths doubling from 1 then
interpolated (the curve is smooth; a denser grid costs start-up time, on a large model on a CPU
minutes, and tells little more). The widths are visited round-robin and each keeps its fastest
time: on a shared machine another process only ever adds time, so the minimum is the forward's own
cost and a busy moment cannot bend one width. `relative_cost` turns it into what drafters size
drafts by: cost[k] = t(1 + k) / t(1), the price of k draft nodes relative to plain decoding.
A measurement may be stopped between two forwards (`stop`: a server shutting down while it
starts), which raises `Stopped`.

Under CUDA graphs (`target.graphs` on) a verify of n tokens runs the graph of the smallest
width w >= n, so t(n) is a step function: the curve is measured at the graph widths only and
t(n) = t(width(n)); interpolating there would sell 33..63 nodes at less than the 64-input price.
Callers keep eager and graph curves apart (samctl/costs.py keys on it).

It knows the target and token ids; caching curves on disk is the caller's business.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from samctl.decode.engine.target import TargetModel
from samctl.decode.tree import DraftTree

MEASURED_WIDTHS = (1, 2, 4, 8, 16, 32, 64)


class Stopped(Exception):
    """A cost measurement was stopped before its end (its `stop` said so)."""


def check_stop(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise Stopped("the measurement was stopped")


def linear_cost(token_cost: float, n: int = 256) -> np.ndarray:
    """cost[k] = 1 + token_cost * k: a verify of t0 plus k nodes, relative to t0 alone."""
    return 1.0 + token_cost * np.arange(n + 1, dtype=np.float64)


def relative_cost(t_ms: np.ndarray | list[float], n: int = 256) -> np.ndarray:
    """t_ms: [w] times of verifying 1..w tokens -> cost [n + 1] with cost[k] = t(1 + k) / t(1),
    made non-decreasing and extended past w along the last measured slope."""
    t = np.maximum.accumulate(np.asarray(t_ms, dtype=np.float64))
    rel = t / t[0]
    slope = (rel[-1] - rel[-2]) if len(rel) > 1 else 0.0
    k = np.arange(n + 1)
    return np.where(k < len(rel), rel[np.minimum(k, len(rel) - 1)], rel[-1] + slope * (k - len(rel) + 1))


@torch.inference_mode()
def measure_verify_cost(target: TargetModel, n_max: int = 64, context: int = 256, rounds: int = 2,
                        widths: tuple[int, ...] = MEASURED_WIDTHS, stop: Callable[[], bool] | None = None) -> list[float]:
    """-> t_ms [n_max]: milliseconds of a verify forward over n = 1..n_max tokens after `context`
    cached tokens (fastest of `rounds`, measured at `widths` and interpolated between them; under
    CUDA graphs measured at the graph widths and taken as steps). `stop()` true: raise Stopped."""
    vocab = int(getattr(target.model.config, "vocab_size", 1000))
    gen = torch.Generator().manual_seed(0)
    context = max(1, min(context, target.max_positions - n_max - 64))
    prompt = torch.randint(0, vocab, (context,), generator=gen).to(target.device)
    check_stop(stop)
    target.prefill(prompt)
    device = target.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    graphs = graph_widths(target)
    points = [w for w in (graphs or widths) if w < n_max]
    points.append(next((w for w in graphs if w >= n_max), n_max))  # the width that serves n_max
    best = np.full(len(points), np.inf)
    inputs = [torch.randint(0, vocab, (w,), generator=gen).to(target.device) for w in points]
    for r in range(rounds + 1):  # round 0 warms up and is not kept
        for i, ids in enumerate(inputs):
            tree = DraftTree.chain(ids[1:].cpu().numpy())
            check_stop(stop)
            sync()
            tic = time.perf_counter()
            target.verify(ids, tree)
            sync()
            if r:
                best[i] = min(best[i], 1e3 * (time.perf_counter() - tic))
            target.keep(np.zeros(1, dtype=np.int64))  # the context grows by one: immaterial here
    fitted = monotone_fit(best)
    n = np.arange(1, n_max + 1)
    if graphs:  # t(n) = t(width(n))
        return [float(t) for t in fitted[np.searchsorted(np.asarray(points), n)]]
    return list(np.interp(n, points, fitted))


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
