"""Draft trees and the tensors that verify them in one forward pass.

A draft is a tree rooted at the pending token t0 (a chain is a tree). Verification input is
`[t0, node_0, ..., node_{m-1}]`; node i sits at input index i + 1, at position L + depth(i)
where L is the cached length, and attends to the cache plus its own ancestors.

A tree may end in context rows (`accept_limit`): nodes verified in the same forward for their
logits only (lookahead's Jacobi window), which acceptance never walks into.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numba
import numpy as np
import torch
from samctl.decode.engine.transfer import to_device


@dataclass
class DraftTree:
    """tokens: [m] int64 (host array or device tensor); parents: [m] int32, parents[i] < i,
    -1 means "child of the root t0". A token of -1 is a placeholder that never matches
    (an empty Token Recycle row); it is fed to the model as 0.
    q: [m, V] draft probabilities, only for drafts sampled from a draft model.
    accept_limit: nodes i >= accept_limit are context rows, verified but never accepted (None: all
    nodes are drafts); a context row may hang below a draft node, never the reverse."""

    tokens: np.ndarray | torch.Tensor
    parents: np.ndarray
    q: torch.Tensor | None = None
    is_chain: bool = field(default=False)
    accept_limit: int | None = None

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents), (len(self.tokens), len(self.parents))
        assert self.accept_limit is None or 0 <= self.accept_limit <= len(self.parents), self.accept_limit

    @property
    def drafts(self) -> int:
        """Nodes that acceptance may walk into (context rows excluded)."""
        return len(self.parents) if self.accept_limit is None else self.accept_limit

    @classmethod
    def chain(cls, tokens: np.ndarray | torch.Tensor, q: torch.Tensor | None = None) -> "DraftTree":
        parents = np.arange(-1, len(tokens) - 1, dtype=np.int32)
        return cls(tokens=tokens, parents=parents, q=q, is_chain=True)

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls.chain(np.zeros(0, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.parents)

    def depths(self) -> np.ndarray:
        return tree_depths(self.parents)

    def prefix(self, k: int) -> "DraftTree":
        """The first k nodes (a tree again: parents come before their children); a chain drawn from
        a draft model keeps the draft probabilities of its first k tokens."""
        if self.is_chain:
            return DraftTree.chain(self.tokens[:k], None if self.q is None else self.q[:k])
        return DraftTree(tokens=self.tokens[:k], parents=self.parents[:k])

    def limit_depth(self, max_depth: int) -> "DraftTree":
        """Drop nodes deeper than max_depth (root children have depth 1)."""
        if self.is_chain:  # a chain's depth is its length: no kernel call on the hot path
            return self if len(self) <= max_depth else self.prefix(max_depth)
        depth = self.depths()
        if len(depth) == 0 or depth.max() <= max_depth:
            return self
        keep = np.flatnonzero(depth <= max_depth)
        parents = kept_parents(self.parents, keep)
        # a device index: indexing device tokens with a host index copies it pageable, which waits
        tokens = self.tokens[to_device(keep, self.tokens.device)] if isinstance(self.tokens, torch.Tensor) else self.tokens[keep]
        limit = None if self.accept_limit is None else int(np.searchsorted(keep, self.accept_limit))
        return DraftTree(tokens=tokens, parents=parents, q=None, accept_limit=limit)


def kept_parents(parents: np.ndarray, keep: np.ndarray) -> np.ndarray:
    # parents: [m] int32 of a tree; keep: [k] rising node indices, each kept node's parent kept too
    # -> [k] int32, the kept nodes' parents as indices into keep (-1: the root)
    remap = np.full(len(parents), -1, dtype=np.int32)
    remap[keep] = np.arange(len(keep), dtype=np.int32)
    return np.where(parents[keep] >= 0, remap[np.maximum(parents[keep], 0)], -1).astype(np.int32)


@numba.njit(cache=True)
def tree_depths(parents: np.ndarray) -> np.ndarray:
    # parents: [m] int32 with parents[i] < i -> depth [m] int32, root children at 1
    depth = np.empty(len(parents), dtype=np.int32)
    for i in range(len(parents)):
        depth[i] = 1 if parents[i] < 0 else depth[parents[i]] + 1
    return depth


@numba.njit(cache=True)
def ancestor_matrix(parents: np.ndarray) -> np.ndarray:
    # parents: [m] int32 -> visible [m+1, m+1] bool over verify inputs (root at 0):
    # visible[a, b] iff input b is input a or one of its ancestors.
    q = len(parents) + 1
    visible = np.zeros((q, q), dtype=np.bool_)
    visible[0, 0] = True
    for i in range(len(parents)):
        row = i + 1
        parent_row = parents[i] + 1
        for b in range(row):
            visible[row, b] = visible[parent_row, b]
        visible[row, row] = True
    return visible


@numba.njit(cache=True)
def walk_tree(parents: np.ndarray, node_tokens: np.ndarray, choices: np.ndarray, limit: int = -1,
              start: int = -1) -> np.ndarray:
    # parents: [m] int32, node_tokens: [m] int64 (input tokens without the root),
    # choices: [m+1] int64, the target's token (argmax or one sample) at each input;
    # limit: nodes >= limit are context rows, never followed (-1: none are);
    # start: nodes 0..start are a chain of known tokens, accepted without a check (-1: none).
    # -> accepted input indices, root (0) first. From the current input, follow the child whose
    # token equals the choice there; stop when no child carries it. The choice at the last
    # accepted input is the bonus token.
    end = len(parents) if limit < 0 else limit
    path = np.empty(len(parents) + 1, dtype=np.int64)
    for i in range(start + 2):
        path[i] = i
    n = start + 2
    current = start  # node index of the current input; -1 is the root
    while True:
        wanted = choices[current + 1]
        nxt = -1
        for i in range(current + 1, end):
            if parents[i] == current and node_tokens[i] == wanted:
                nxt = i
                break
        if nxt < 0:
            return path[:n]
        path[n] = nxt + 1
        n += 1
        current = nxt
