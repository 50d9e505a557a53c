"""REST (He et al. 2024): a tree of the most frequent continuations of the context in a datastore.

Each step (t0 = the pending token):
    s = the longest suffix of prompt + output + t0 of length max_span (16) down to min_span (2)
        found in the static store; no such suffix: no draft
    tree = the num_nodes (64) continuation prefixes of at most max_depth (10) tokens that follow
        s most often in the store
REST counts the prefixes over (up to 5,000 of) s's occurrences in a suffix array. With a suffix
automaton the count of prefix p is the occurrence count of the state reached from s's state by p
(every path spells s + p, whose end positions are that state's), so taking candidates best first
by count, a node's children pushed when it is taken, yields exactly the top prefixes by count:
a child never outnumbers its parent. All occurrences count here, not the first 5,000.

The store's cursor (index/cursor.py) streams over committed tokens like SAM-Decoding's; the
suffix of length max_span is its state, or the ancestor along suffix links whose length range
holds max_span. A sharded store's cursor has one pointer per shard, and the tree comes from the
shard with the longest match (its counts only). This module knows the automaton's arrays, not store files.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from numba import njit

from samctl.decode.drafters.base import Drafter
from samctl.decode.tree import DraftTree
from samctl.index.automaton import LEN, LINK, SuffixAutomaton, sam_step, sam_topk_next
from samctl.index.cursor import cursor
from samctl.index.errors import ConfigError
from samctl.index.sharded import ShardedAutomaton
from samctl.decode.configs import RestConfig

if TYPE_CHECKING:
    from samctl.index.ngram import NgramTable


@njit(cache=True)
def span_state(states, state, length, span):
    # -> the state holding the suffix of length min(length, span) of the matched text: climb
    # suffix links while the parent's longest string still has >= span tokens.
    if length <= span:
        return state
    for _ in range(states.shape[0]):
        parent = states[state, LINK]
        if parent < 0 or states[parent, LEN] < span:
            return state
        state = parent
    return state


@njit(cache=True)
def rest_tree(states, edges, slots, state, num_nodes, max_depth):
    """Top continuation prefixes below `state` by occurrence count, best first.

    states/edges/slots: a suffix automaton's kernel arrays. Candidates are (state, token, parent node,
    depth) keyed by count; ties go to the earlier-pushed one. Returns (tokens [m] int32,
    parents [m] int32) with m <= num_nodes, parents[i] < i, -1 = child of the root.
    """
    out_tok = np.empty(num_nodes, dtype=np.int32)
    out_par = np.empty(num_nodes, dtype=np.int32)
    cap = num_nodes * (num_nodes + 1)  # each taken node (and the root) pushes <= num_nodes children
    c_count = np.empty(cap, dtype=np.int64)
    c_state = np.empty(cap, dtype=np.int32)
    c_tok = np.empty(cap, dtype=np.int32)
    c_par = np.empty(cap, dtype=np.int32)
    c_depth = np.empty(cap, dtype=np.int32)
    taken = np.zeros(cap, dtype=np.bool_)
    n_cand = 0
    node, node_state, depth, m = -1, state, 0, 0
    while m < num_nodes:
        # 1) push the children of the node just taken (first: of the root), unless at max depth
        if depth < max_depth:
            kid_tok, kid_cnt = sam_topk_next(states, edges, node_state, num_nodes - m)
            for j in range(len(kid_tok)):
                c_count[n_cand] = kid_cnt[j]
                c_tok[n_cand] = kid_tok[j]
                # the out-edge exists, so the step takes it without following a suffix link
                c_state[n_cand] = sam_step(states, edges, slots, node_state, states[node_state, LEN], kid_tok[j])[0]
                c_par[n_cand] = node
                c_depth[n_cand] = depth + 1
                n_cand += 1
        # 2) take the most frequent candidate (a linear scan: <= 64 * 65 candidates, tiny)
        best = -1
        for c in range(n_cand):
            if not taken[c] and (best < 0 or c_count[c] > c_count[best]):
                best = c
        if best < 0:
            break
        taken[best] = True
        out_tok[m] = c_tok[best]
        out_par[m] = c_par[best]
        node, node_state, depth = m, c_state[best], c_depth[best]
        m += 1
    return out_tok[:m], out_par[:m]


class RestDrafter(Drafter):
    name = "rest"

    def __init__(self, config: RestConfig, static: "SuffixAutomaton | ShardedAutomaton | NgramTable | None") -> None:
        if static is None:
            raise ConfigError("method rest drafts from a datastore: pass {store} (a store built by samctl build)")
        if not isinstance(static, (SuffixAutomaton, ShardedAutomaton)):
            raise ConfigError("method rest needs a suffix-automaton store, and {store} is an n-gram table: pass a store "
                              "built by `samctl build --kind sam`")
        self.config = config
        self.static = cursor(static)
        states, edges, slots, _, _ = self.static.before(0)
        rest_tree(states, edges, slots, 0, 1, 1)  # compile now

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor | None) -> None:
        self.static.reset(prompt)

    def propose(self, t0: int) -> DraftTree:
        cfg = self.config
        length, handle = self.static.peek(t0)
        if length < cfg.min_span:
            return DraftTree.empty()
        states, edges, slots, state = self.static.at(handle)
        state = span_state(states, state, length, cfg.max_span)
        tokens, parents = rest_tree(states, edges, slots, state, cfg.num_nodes, cfg.max_depth)
        return DraftTree(tokens=tokens.astype(np.int64), parents=parents)

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        self.static.advance(committed)
