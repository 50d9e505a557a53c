"""REST (He et al. 2024): a tree of the most frequent continuations of the context in a datastore.

Each step (t0 = the pending token):
    s = the longest suffix of prompt + output + t0 of length max_span (16) down to min_span (2)
        found in the static store; no such suffix: no draft
    tree = the num_nodes (64) continuation prefixes of at most max_depth (10) tokens that follow
        s most often in the store
REST counts the prefixes over (up to 5,000 of) s's occurrences in a suffix array. Here the
store's cursor (index/cursor.py) builds the tree (`Cursor.tree`): from a suffix automaton's
occurrence counts or a suffix array's ranges, over all occurrences, best first by count. It
streams over committed tokens like SAM-Decoding's. A sharded store's cursor has one pointer per
shard, and the tree comes from the shard with the longest match (its counts only). An n-gram
table has no such tree. This module knows cursors, not structures or store files.
"""
from __future__ import annotations

import numpy as np
import torch

from samctl.decode.drafters.base import Drafter
from samctl.decode.tree import DraftTree
from samctl.index.cursor import Structure, cursor
from samctl.index.errors import ConfigError
from samctl.decode.configs import RestConfig


class RestDrafter(Drafter):
    name = "rest"

    def __init__(self, config: RestConfig, static: Structure | None) -> None:
        if static is None:
            raise ConfigError("method rest drafts from a datastore: pass {store} (a store built by samctl build)")
        self.config = config
        self.static = cursor(static)
        if self.static.tree is None:
            raise ConfigError("method rest needs counts of long continuations, and {store} is an n-gram table: pass "
                              "a suffix-automaton or suffix-array store")
        self.static.reset(np.zeros(1, dtype=np.int32))  # compile now
        self.static.tree(self.static.peek(0)[1], 1, 1, 1, 1)

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor | None) -> None:
        self.static.reset(prompt)

    def propose(self, t0: int) -> DraftTree:
        cfg = self.config
        length, handle = self.static.peek(t0)
        if length < cfg.min_span:
            return DraftTree.empty()
        tokens, parents = self.static.tree(handle, length, cfg.max_span, cfg.num_nodes, cfg.max_depth)
        return DraftTree(tokens=tokens.astype(np.int64), parents=parents)

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        self.static.advance(committed)
