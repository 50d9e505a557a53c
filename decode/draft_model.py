"""A draft model for drafters that run a small LM next to the target, its sequences in one batch.

Each holder (`DraftModel`; one per sequence in flight, `fork`) owns a row of one BatchedTarget
over the draft's weights (decode/engine/batched.py), so the draft forwards of every row of a
batched step run as one forward (`extend`). Contract per row: the cache holds K/V for a token
sequence the caller knows (`cached` entries); `extend` appends each given row's tokens and returns
the next-token logits at its last one (and, on request, the post-norm hidden state there);
`keep(n)` drops everything after the first n cached tokens. The caller decides which tokens to
feed; feeding only uncached tokens is what keeps drafting cheap. Rows not fed in a forward get a
placeholder input written behind their cached entries, where nothing reads it.

The draft's vocabulary may differ from the target's: logits are sliced to the first
`vocab_limit` ids (the target's size), so the draft never proposes an id the target lacks.
Knows nothing of acceptance rules, the target, text or files.
"""
from __future__ import annotations

import heapq
import weakref
from typing import Sequence

import numpy as np
import torch

from samctl.decode.engine.batched import BatchedTarget
from samctl.decode.engine.transfer import to_device
from samctl.decode.tree import DraftTree


class _Rows:
    """The draft LM's BatchedTarget and which of its rows are handed out; a row freed by a holder
    that is gone is reused, lowest first, so the rows drafting in a step stay near the front."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.target = BatchedTarget(model, 1, 64)
        self.free: list[int] = []
        self.handed = 0  # rows handed out so far, freed ones included

    def take(self) -> int:
        if self.free:
            return heapq.heappop(self.free)
        row, self.handed = self.handed, self.handed + 1
        if row >= self.target.rows:
            self.target.resize(max(2 * self.target.rows, row + 1))
        return row

    def give_back(self, row: int) -> None:
        self.target.lengths[row] = 0
        heapq.heappush(self.free, row)


class DraftModel:
    """One sequence's row of a draft LM (`fork` gives another row of the same batch, the weights
    and the batch's cache storage shared)."""

    def __init__(self, model: torch.nn.Module, vocab_limit: int | None = None, rows: _Rows | None = None) -> None:
        self.model = model.eval()
        self.rows = rows if rows is not None else _Rows(self.model)
        self.device, self.dtype = self.rows.target.device, self.rows.target.dtype
        self.max_positions = self.rows.target.max_positions
        out_vocab = int(model.config.vocab_size)
        self.vocab = out_vocab if vocab_limit is None else min(out_vocab, int(vocab_limit))
        self.hidden_size = int(model.config.hidden_size)
        self.gives_hidden = self.rows.target.gives_hidden
        self.row = self.rows.take()
        weakref.finalize(self, self.rows.give_back, self.row)
        self.fed = 0  # tokens fed since construction (counts work; tests check nothing is fed twice)
        self.dropped = 0  # cache entries removed by `keep`

    @property
    def cached(self) -> int:
        """Tokens whose K/V are in this row's cache."""
        return int(self.rows.target.lengths[self.row])

    def reset(self) -> None:
        self.rows.target.lengths[self.row] = 0

    def fork(self) -> "DraftModel":
        """Another row of the same batch: one per sequence in flight (the batched engine's rows)."""
        return DraftModel(self.model, self.vocab, self.rows)

    def keep(self, n: int) -> None:
        assert 0 <= n <= self.cached, (n, self.cached)
        self.dropped += self.cached - n
        self.rows.target.lengths[self.row] = n


@torch.inference_mode()
def extend(holders: Sequence[DraftModel], feeds: Sequence[np.ndarray | torch.Tensor],
           hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    # holders: k distinct rows of one batch; feeds: k arrays [n_i >= 1] int64, each the tokens after
    # its row's cached ones (a row with nothing cached: a host array, prefilled)
    # -> (logits [k, V'] at each feed's last token, hidden [k, H] there or None). One prefill of the
    # empty rows, one verify forward of the others (chains), both in the draft's batch.
    target = holders[0].rows.target
    target.wants_hidden = hidden
    for h, feed in zip(holders, feeds):
        h.fed += len(feed)
    logits: list[torch.Tensor | None] = [None] * len(holders)
    states: list[torch.Tensor | None] = [None] * len(holders)
    empty = [i for i, h in enumerate(holders) if h.cached == 0]
    if empty:
        out = target.prefill([holders[i].row for i in empty], [np.asarray(feeds[i], dtype=np.int64) for i in empty],
                             [False] * len(empty))
        for j, i in enumerate(empty):
            logits[i] = out[j][-1]
            states[i] = target.prefill_hidden[j][-1] if hidden else None
    growing = [i for i, h in enumerate(holders) if logits[i] is None]
    if growing:
        feeds_in = [feeds[i] if isinstance(feeds[i], torch.Tensor) else to_device(np.asarray(feeds[i]), target.device)
                    for i in growing]
        trees = [DraftTree.chain(np.zeros(len(f) - 1, dtype=np.int64)) for f in feeds_in]
        out, state = _verify([holders[i] for i in growing], feeds_in, trees, last=True, hidden=hidden)
        keep_rows([holders[i] for i in growing], [np.arange(len(f)) for f in feeds_in])
        if not empty:  # every row grew: already in the holders' order
            return out[:, : holders[0].vocab], state
        for j, i in enumerate(growing):
            logits[i], states[i] = out[j], state[j] if hidden else None
    return torch.stack(logits)[:, : holders[0].vocab], torch.stack(states) if hidden else None


@torch.inference_mode()
def verify_rows(holders: Sequence[DraftModel], inputs: Sequence[torch.Tensor],
                trees: Sequence[DraftTree]) -> list[torch.Tensor]:
    # holders: k distinct rows of one batch, each with something cached; inputs: k tensors [q_i]
    # int64 = [root, nodes...] on the draft's device; trees: their trees -> logits [q_i, V'] per
    # holder, from one forward. Nothing is kept yet: `keep_rows` follows with each row's path.
    for h, x in zip(holders, inputs):
        h.fed += len(x)
    holders[0].rows.target.wants_hidden = False
    logits, offsets = _verify(holders, inputs, trees, last=False)
    return [logits[offsets[h.row]: offsets[h.row + 1], : h.vocab] for h in holders]


def keep_rows(holders: Sequence[DraftModel], paths: Sequence[np.ndarray]) -> None:
    # paths: per holder the input indices of its accepted path in the last forward, root (0) first
    target = holders[0].rows.target
    kept = [np.zeros(0, dtype=np.int64)] * (1 + max(h.row for h in holders))
    for h, path in zip(holders, paths):
        kept[h.row] = np.asarray(path, dtype=np.int64)
    target.keep(kept)


def _verify(holders: Sequence[DraftModel], inputs: Sequence[torch.Tensor], trees: Sequence[DraftTree],
            last: bool, hidden: bool = False):
    # One verify forward over rows 0..max(row): the holders' inputs, a placeholder input in the
    # other rows (written behind their cached entries, never kept). -> last=False: (logits [N, V]
    # of every real input, offsets [rows + 1]); last: (logits [k, V] at each holder's last input,
    # in the holders' order, and with `hidden` the hidden states [k, H] there, else None).
    target = holders[0].rows.target
    rows = 1 + max(h.row for h in holders)
    all_inputs = [torch.zeros(1, dtype=torch.int64, device=target.device)] * rows
    all_trees = [DraftTree.empty()] * rows
    for h, x, tree in zip(holders, inputs, trees):
        all_inputs[h.row], all_trees[h.row] = x, tree
    if not last:
        return target.verify(all_inputs, all_trees)
    out, _ = target.verify(all_inputs, all_trees, last=True)  # [rows, V]: each row's last input
    order = [h.row for h in holders]
    state = target.hidden if hidden else None
    if order != list(range(rows)):  # placeholder rows between, or the rows in another order
        picked = to_device(np.array(order), target.device)
        out = out.index_select(0, picked)
        state = state.index_select(0, picked) if hidden else None
    return out, state
