"""One drafting budget across the rows of a batched verify step.

Each row offers draft nodes in an order where every prefix is a tree (parents[i] < i), with p_i
the estimated probability that node i's whole path is accepted. Exactly one path of a tree is
accepted, so the expected accepted length of a tree is the sum of its nodes' p. A batched verify
pads rows to the widest, so a step where each of A rows verifies at most w nodes costs
t(A * (1 + w)), with t measured over the forward's total input tokens. The step keeps the width

    w* = argmax_w  (A + sum_b sum_{i < min(w, m_b)} p_{b,i}) / t(A * (1 + w))

that is, width levels (each row's next most likely node) are handed out while expected committed
tokens per unit of time rise; a level costs the same whichever rows use it, so every row keeps its
first min(w*, m_b) nodes. When one more input per row costs about as much as a row (a CPU at
large A), w* is 0 unless the rows' next nodes are nearly sure: no hand-set threshold.

Drafters that price their own nodes (`propose_scored`, adaptive's calibrated cells) give p; for
the others `TreeCalibration` learns the acceptance of an edge by depth and sibling rank from what
verification accepts, shared by the rows of one run.
"""
from __future__ import annotations

import numpy as np
from numba import njit

N_DEPTH, N_RANK = 8, 4  # TreeCalibration cells: depth 1..8+ x sibling rank 0..3+


def cost_at(t_ms: np.ndarray, n: int) -> float:
    """t_ms: [n_max] time of a forward over 1..n_max input tokens -> t(n), extended along the last
    slope past n_max."""
    if n <= len(t_ms):
        return float(t_ms[n - 1])
    slope = float(t_ms[-1] - t_ms[-2]) if len(t_ms) > 1 else float(t_ms[-1])
    return float(t_ms[-1]) + slope * (n - len(t_ms))


def choose_width(probs: list[np.ndarray], t_ms: np.ndarray, max_width: int, min_width: int = 0) -> int:
    # probs: A arrays [m_b] float64 of path probabilities in prefix-closed order; t_ms: [n_max]
    # -> w in [min_width, max(min_width, max_width)]: the draft nodes each row may verify this step
    rows = len(probs)
    top = min(max_width, max((len(p) for p in probs), default=0))
    if top <= min_width:
        return min_width
    padded = np.zeros((rows, top), dtype=np.float64)
    for b, p in enumerate(probs):
        k = min(len(p), top)
        padded[b, :k] = p[:k]
    gain = np.concatenate(([0.0], padded.sum(axis=0).cumsum()))  # gain[w]: expected accepted drafts
    widths = np.arange(min_width, top + 1)
    rate = (rows + gain[widths]) / np.array([cost_at(t_ms, rows * (1 + w)) for w in widths])
    return int(widths[int(np.argmax(rate))])


@njit(cache=True)
def path_probs(parents, edge):
    # parents: [m] int32 (parents[i] < i); edge: [m] float64, P(node accepted | parent accepted)
    # -> [m] float64 P(the whole path to node i is accepted)
    out = np.empty(len(parents), dtype=np.float64)
    for i in range(len(parents)):
        out[i] = edge[i] if parents[i] < 0 else out[parents[i]] * edge[i]
    return out


@njit(cache=True)
def tree_cells(parents):
    # parents: [m] int32 -> cell [m] int32 = depth bucket x sibling rank (rank = order among the
    # children of the same parent, as the drafter listed them)
    m = len(parents)
    depth = np.empty(m, dtype=np.int32)
    seen = np.zeros(m + 1, dtype=np.int32)  # children met so far, per parent + 1
    cells = np.empty(m, dtype=np.int32)
    for i in range(m):
        p = parents[i]
        depth[i] = 1 if p < 0 else depth[p] + 1
        rank = seen[p + 1]
        seen[p + 1] += 1
        cells[i] = min(depth[i] - 1, N_DEPTH - 1) * N_RANK + min(rank, N_RANK - 1)
    return cells


@njit(cache=True)
def learn_tree(parents, cells, limit, path, hits, trials):
    # parents, cells: [m] the verified tree; limit: nodes >= limit are context rows (never tried);
    # path: [a+1] accepted input indices, root (0) first. A node was tried when its parent is the
    # root or accepted; a hit when it is accepted itself.
    accepted = np.zeros(len(parents) + 1, dtype=np.bool_)
    accepted[0] = True
    for j in range(1, len(path)):
        accepted[path[j]] = True
    for i in range(limit):
        if accepted[parents[i] + 1]:
            trials[cells[i]] += 1.0
            if accepted[i + 1]:
                hits[cells[i]] += 1.0


class TreeCalibration:
    """Edge acceptance by (depth, sibling rank) for drafters that give no estimate of their own:
    mean = (hits + w * prior) / (trials + w), learned from every row of the run."""

    def __init__(self, prior_first: float = 0.4, prior_other: float = 0.05, weight: float = 4.0) -> None:
        self.prior = np.full(N_DEPTH * N_RANK, prior_other, dtype=np.float64)
        self.prior[::N_RANK] = prior_first
        self.weight = weight
        self.hits = np.zeros_like(self.prior)
        self.trials = np.zeros_like(self.prior)

    @property
    def means(self) -> np.ndarray:
        return (self.hits + self.weight * self.prior) / (self.trials + self.weight)

    def score(self, parents: np.ndarray) -> np.ndarray:
        # parents: [m] int32 -> [m] float64 estimated path probabilities
        parents = np.asarray(parents, dtype=np.int32)
        return path_probs(parents, self.means[tree_cells(parents)])

    def learn(self, parents: np.ndarray, limit: int, path: np.ndarray) -> None:
        # parents: [m] int32 of the verified tree; path: [a+1] int64 accepted input indices
        parents = np.asarray(parents, dtype=np.int32)
        if len(parents):
            learn_tree(parents, tree_cells(parents), limit, np.asarray(path, dtype=np.int64), self.hits, self.trials)
