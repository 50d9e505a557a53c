"""Token Recycle (Luo et al. 2024): draft trees from recycled candidate tokens.

State: a table A[V, k] of each token's k most likely successors, written from the target's logits
at every verified input (rejected nodes too) and never reset. Draft: a static template tree rooted
at t0 whose node [r1, r2, ...] is "the r2-th candidate of the r1-th candidate"; each level is one
gather from A, and empty rows (-1) draft placeholders that never match. On a GPU the table stays
on the device; on the CPU numba kernels run over its memory (microseconds, not torch's per-op cost).
"""
from __future__ import annotations

import heapq

import numba
import numpy as np
import torch

from samctl.decode.drafters.base import Drafter
from samctl.decode.tree import DraftTree, tree_depths
from samctl.decode.configs import RECYCLE_RANK_ACCEPT as _RANK_ACCEPT, RecycleConfig
from samctl.decode.engine.transfer import to_device



def build_template(config: RecycleConfig) -> tuple[np.ndarray, np.ndarray]:
    """Best-first tree of the `nodes` most probable candidate paths under _RANK_ACCEPT.
    -> (parents [m] int32, ranks [m] int64) in BFS order (by depth, then creation)."""
    accept = _RANK_ACCEPT[: config.k]
    heap = [(-accept[r], (r,)) for r in range(config.k)]
    heapq.heapify(heap)
    paths: list[tuple[int, ...]] = []
    while heap and len(paths) < config.nodes:
        neg_prob, path = heapq.heappop(heap)
        paths.append(path)
        if len(path) < config.max_depth:
            for r in range(config.k):
                heapq.heappush(heap, (neg_prob * accept[r], path + (r,)))
    paths.sort(key=lambda path: (len(path), path))
    index = {path: i for i, path in enumerate(paths)}
    parents = np.array([index.get(path[:-1], -1) for path in paths], dtype=np.int32)
    ranks = np.array([path[-1] for path in paths], dtype=np.int64)
    return parents, ranks


@numba.njit(cache=True)
def expand_template(table: np.ndarray, t0: int, parents: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    # table: [V+1, k] int64; parents/ranks: [m] -> draft tokens [m] int64, -1 where the row is empty
    out = np.empty(len(parents), dtype=np.int64)
    for i in range(len(parents)):
        parent_tok = t0 if parents[i] < 0 else out[parents[i]]
        out[i] = -1 if parent_tok < 0 else table[parent_tok, ranks[i]]
    return out


BLOCK = 64  # logits per block in `learn_rows`


def learn_rows(table: np.ndarray, ids: np.ndarray, logits: np.ndarray) -> None:
    """table[ids[i]] = the k ids of logits[i]'s largest values, as torch.topk (ties: the lower id
    first), for each valid ids[i]; the last row of a duplicated id wins, as in SAM-Decoding. Block
    maxima let one compiled pass skip every block below the k-th best so far (a fifth of
    torch.topk's time at 49k ids).
    table: [V', k] int; ids: [q] int (placeholders < 0); logits: [q, >= V'] on the CPU."""
    vocab = min(len(table), logits.shape[1])
    keep = np.flatnonzero((ids >= 0) & (ids < len(table)))
    if not len(keep) or not vocab:
        return
    tokens, last = np.unique(ids[keep][::-1], return_index=True)  # each id's last row
    rows = keep[::-1][last]
    logits = logits.float()
    if 2 * len(rows) < len(ids):  # a prompt: many repeated ids, fewer rows to reduce
        logits, rows = logits[torch.from_numpy(rows)], np.arange(len(rows))
    n = vocab // BLOCK
    maxima = logits[:, : n * BLOCK].contiguous().view(len(logits), n, BLOCK).amax(-1)
    _top_rows(table, tokens, rows, logits.numpy(), maxima.numpy(), vocab)


@numba.njit(cache=True)
def _top_rows(table: np.ndarray, tokens: np.ndarray, rows: np.ndarray, logits: np.ndarray, maxima: np.ndarray,
              vocab: int) -> None:
    # maxima: [q, n] the largest of each block logits[r, b * BLOCK: (b + 1) * BLOCK]; the last
    # vocab - n * BLOCK ids are read in full
    k, n = table.shape[1], maxima.shape[1]
    vals = np.empty(k, dtype=np.float32)
    idx = np.empty(k, dtype=np.int64)
    for t in range(len(tokens)):
        r = rows[t]
        m = 0
        for b in range(n + 1):
            if b < n and m == k and maxima[r, b] < vals[k - 1]:
                continue
            for j in range(b * BLOCK, min(vocab, b * BLOCK + BLOCK) if b < n else vocab):
                v = logits[r, j]
                if m == k and v <= vals[k - 1]:  # blocks go by rising id: a tie keeps the lower id
                    continue
                p = m if m < k else k - 1  # insertion: larger first, then the lower id
                while p > 0 and vals[p - 1] < v:
                    vals[p], idx[p] = vals[p - 1], idx[p - 1]
                    p -= 1
                vals[p], idx[p] = v, j
                if m < k:
                    m += 1
        for i in range(k):
            table[tokens[t], i] = idx[i] if i < m else -1


class TokenRecycleDrafter(Drafter):
    name = "recycle"
    prefill_logits = "all"  # the table learns every prompt position's successors

    def __init__(self, vocab_size: int, device: torch.device, config: RecycleConfig = RecycleConfig()) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # Row vocab_size is a sink for writes that must not land (duplicates, placeholders).
        self.table = torch.full((vocab_size + 1, config.k), -1, dtype=torch.int64, device=self.device)
        self.parents, self.ranks = build_template(config)
        self.on_cpu = self.device.type == "cpu"
        if self.on_cpu:
            expand_template(self.table.numpy(), 0, self.parents, self.ranks)  # compile now
        else:
            self._levels = self._device_levels()
        self._last_write = torch.empty(vocab_size + 1, dtype=torch.int64, device=self.device)

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor) -> None:
        self._learn(to_device(prompt, self.device), prompt_logits)

    def propose(self, t0: int) -> DraftTree:
        if self.on_cpu:
            tokens = expand_template(self.table.numpy(), t0, self.parents, self.ranks)
            return DraftTree(tokens=tokens, parents=self.parents)
        return DraftTree(tokens=self._expand_on_device(t0), parents=self.parents)

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        self._learn(input_ids, logits)

    def _learn(self, ids: torch.Tensor, logits: torch.Tensor) -> None:
        # ids: [q] int64 device; logits: [q, V]
        if self.on_cpu:
            learn_rows(self.table.numpy()[: self.vocab_size], ids.numpy(), logits)
            return
        successors = torch.topk(logits[:, : self.vocab_size], self.config.k, dim=-1).indices
        # Without a sync: every write but each token's last goes to the sink row, so the outcome is
        # deterministic (index_put with duplicates is not); the last is a scatter-max over [V+1]
        # (a [q, q] comparison would be gigabytes for a long prompt).
        order = torch.arange(ids.shape[0], device=ids.device)
        rows = torch.where(ids < 0, self.vocab_size, ids)
        last = self._last_write.fill_(-1).scatter_reduce_(0, rows, order, "amax")
        rows = torch.where(last[rows] == order, rows, self.vocab_size)
        self.table.index_put_((rows,), successors)

    def _device_levels(self) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
        # Template nodes are in BFS order, so each depth is a contiguous slice of the token vector
        # (index 0 = the root t0, node i at i + 1).
        depth = tree_depths(self.parents)
        levels = []
        for d in range(1, depth.max() + 1):
            nodes = np.flatnonzero(depth == d)
            levels.append((slice(nodes[0] + 1, nodes[-1] + 2),
                           torch.from_numpy(self.parents[nodes].astype(np.int64) + 1).to(self.device),
                           torch.from_numpy(self.ranks[nodes]).to(self.device)))
        return levels

    def _expand_on_device(self, t0: int) -> torch.Tensor:
        tokens = torch.empty(len(self.parents) + 1, dtype=torch.int64, device=self.device)
        tokens[:1].fill_(t0)  # a fill kernel: `tokens[0] = t0` copies a host scalar, a sync on a GPU
        for level, parent_idx, rank in self._levels:
            parent_tok = tokens[parent_idx]
            child = self.table[parent_tok.clamp_min(0), rank]
            tokens[level] = torch.where(parent_tok < 0, -1, child)
        return tokens[1:]
