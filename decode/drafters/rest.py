"""REST (He et al. 2024): a tree of the most frequent continuations of the context in a datastore.

Each step, s = the longest suffix of prompt + output + t0, max_span down to min_span tokens, found
in the static store (none: no draft); the tree is the num_nodes continuation prefixes of at most
max_depth tokens that follow s most often. The store's cursor builds it (`Cursor.tree`) over all
occurrences, where REST samples up to 5,000; a sharded store's from the shard with the longest
match. An n-gram table has no such tree.
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
