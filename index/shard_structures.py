"""Sharded structures queried as one store: suffix automata (one pointer per shard, all shards in
one compiled call) and suffix arrays (each shard asked in turn); the earliest occurrence wins, as
one structure over all shards would answer. The store directory that holds them: index/sharded.py."""
from __future__ import annotations

import numba
import numpy as np
from numba import njit

from samctl.index.automaton import COUNT, E_DST, E_NEXT, E_TOK, EDGE_DST, EDGE_TOK, HEAD, SuffixAutomaton, sam_step
from samctl.index.errors import UserError
from samctl.index.lookup import Lookup
from samctl.index.suffix_array import SAMPLES, SuffixArray


# ---------------------------------------------------------------------------------------------
# kernels: one pointer (state, length) per shard, all shards in one call


@njit(cache=True)
def shards_walk(states_t, edges_t, slots_t, st, ln, tokens, peeked_st, peeked_ln, use_peeked):
    # states_t/edges_t/slots_t: tuples of the shards' kernel arrays; st, ln: [N] int64 pointers,
    # moved in place over tokens ([k] int32) in every shard. With use_peeked, the step over
    # tokens[0] is taken from peeked_st/peeked_ln ([N] int64, what shards_peek computed for it
    # from this same pointer): a decode step then probes each shard once, not twice.
    start = 0
    if use_peeked:
        for i in range(len(st)):
            st[i], ln[i] = peeked_st[i], peeked_ln[i]
        start = 1
    for i in range(len(states_t)):
        s, m = st[i], ln[i]
        for j in range(start, len(tokens)):
            s, m = sam_step(states_t[i], edges_t[i], slots_t[i], s, m, tokens[j])
        st[i], ln[i] = s, m


@njit(cache=True)
def shards_peek(states_t, edges_t, slots_t, st, ln, t0, prefer_last, out_st, out_ln):
    # -> (shard, state, length) of the longest match after t0 without moving the pointers; ties
    # go to the lowest shard (first occurrence) or, with prefer_last, the highest (latest).
    # Every shard's moved pointer goes to out_st/out_ln ([N] int64).
    best, best_state, best_len = 0, 0, -1
    for i in range(len(states_t)):
        s, m = sam_step(states_t[i], edges_t[i], slots_t[i], st[i], ln[i], t0)
        out_st[i], out_ln[i] = s, m
        if m > best_len or (prefer_last and m == best_len):
            best, best_state, best_len = i, s, m
    return best, best_state, best_len


@njit(cache=True)
def children(states, edges, state):
    # -> (tokens [m] int32, counts [m] int64): every out-edge of state and its destination count
    n = 0
    e = states[state, HEAD]
    while e >= 0:
        n += 1
        e = edges[e, E_NEXT]
    tok = np.empty(n + 1, dtype=np.int32)
    cnt = np.empty(n + 1, dtype=np.int64)
    m = 0
    if states[state, EDGE_TOK] >= 0:
        tok[0], cnt[0] = states[state, EDGE_TOK], states[states[state, EDGE_DST], COUNT]
        m = 1
    e = states[state, HEAD]
    while e >= 0:
        tok[m], cnt[m] = edges[e, E_TOK], states[edges[e, E_DST], COUNT]
        m += 1
        e = edges[e, E_NEXT]
    return tok[:m], cnt[:m]


def _bound(kernel, *args):
    """The compiled entry point of a numba kernel for these arguments' types: a dispatcher types
    tuples of arrays in Python on every call (about 1 µs with 8 shards). Callers keep these types."""
    return kernel.compile(tuple(numba.typeof(a) for a in args))


def _readonly(array: np.ndarray) -> np.ndarray:
    # one numba type for every shard (memory-mapped shards are read-only, built ones are not),
    # so the shards' arrays form a homogeneous tuple that kernels index at run time
    view = array.view()
    view.flags.writeable = False
    return view


class ShardedAutomaton:
    def __init__(self, shards: list[SuffixAutomaton], occurrence: str = "first") -> None:
        if not shards:
            raise UserError("a sharded store needs at least one shard")
        self.shards = list(shards)
        self.occurrence = occurrence
        self._prefer_last = occurrence == "latest"
        arrays = [s.kernel_arrays for s in self.shards]
        self.states = tuple(_readonly(a.states) for a in arrays)
        self.edges = tuple(_readonly(a.edges) for a in arrays)
        self.slots = tuple(_readonly(a.slots) for a in arrays)
        self._peek_st = np.zeros(len(self.shards), dtype=np.int64)  # the last peek's moved pointer
        self._peek_ln = np.zeros(len(self.shards), dtype=np.int64)
        self._peeked_for: tuple[int, int] | None = None  # (id of the peeked pointer, its token)
        st, ln = np.zeros(len(self.shards), dtype=np.int64), np.zeros(len(self.shards), dtype=np.int64)
        self._walk = _bound(shards_walk, self.states, self.edges, self.slots, st, ln, np.zeros(1, dtype=np.int32),
                            self._peek_st, self._peek_ln, False)
        self._peek = _bound(shards_peek, self.states, self.edges, self.slots, st, ln, 0, False,
                            self._peek_st, self._peek_ln)

    def __len__(self) -> int:
        return len(self.shards)

    def pointer(self) -> tuple[np.ndarray, np.ndarray]:
        # ([N] int64 states, [N] int64 lengths) at every shard's root
        self._peeked_for = None
        return np.zeros(len(self.shards), dtype=np.int64), np.zeros(len(self.shards), dtype=np.int64)

    def match(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        states, lengths = self.pointer()
        self.walk(states, lengths, tokens)
        return states, lengths

    def walk(self, states: np.ndarray, lengths: np.ndarray, tokens: np.ndarray) -> None:
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        # the last peek's steps are reused when they were taken from this pointer, unmoved since
        # (every walk and new pointer clears the record), over this first token
        reuse = len(tokens) > 0 and self._peeked_for == (id(states), int(tokens[0]))
        self._peeked_for = None
        self._walk(self.states, self.edges, self.slots, states, lengths, tokens, self._peek_st, self._peek_ln, reuse)

    def peek(self, states: np.ndarray, lengths: np.ndarray, token: int) -> tuple[int, int, int]:
        """(shard, state, length) of the longest match once token follows; the pointer stays."""
        shard, state, length = self._peek(self.states, self.edges, self.slots, states, lengths, int(token),
                                          self._prefer_last, self._peek_st, self._peek_ln)
        self._peeked_for = (id(states), int(token))
        return int(shard), int(state), int(length)

    def best(self, states: np.ndarray, lengths: np.ndarray) -> tuple[int, int, int]:
        """(shard, state, length) of the pointer's longest match, ties as in `peek`."""
        order = np.arange(len(self.shards))[::-1] if self._prefer_last else np.arange(len(self.shards))
        shard = int(order[np.argmax(lengths[order])])
        return shard, int(states[shard]), int(lengths[shard])

    def continuation(self, shard: int, state: int, n: int) -> np.ndarray:
        return self.shards[shard].continuation(state, n)

    def lookup(self, context: np.ndarray, n: int, k: int) -> Lookup:
        """What `Datastore.lookup` answers for one store over all the shards' documents."""
        states, lengths = self.match(np.asarray(context, dtype=np.int32))
        shard, state, length = self.best(states, lengths)
        holders = [(self.shards[i].count(int(states[i])), *children(self.states[i], self.edges[i], int(states[i])))
                   for i in np.flatnonzero(lengths == length)]
        return merged_lookup(length, holders, self.continuation(shard, state, n), k)

    num_tokens = property(lambda self: sum(s.num_tokens for s in self.shards))
    num_states = property(lambda self: sum(s.num_states for s in self.shards))
    num_edges = property(lambda self: sum(s.num_edges for s in self.shards))
    num_documents = property(lambda self: sum(s.num_documents for s in self.shards))


class ShardedSuffixArray:
    def __init__(self, shards: list[SuffixArray]) -> None:
        if not shards:
            raise UserError("a sharded store needs at least one shard")
        self.shards = list(shards)

    def __len__(self) -> int:
        return len(self.shards)

    def lookup(self, context: np.ndarray, n: int, k: int) -> Lookup:
        # the continuation from the earliest occurrence: the lowest shard holding the longest match
        found = [shard.lookup(context, n, SAMPLES) for shard in self.shards]  # every next token it samples
        length = max(f.match_length for f in found)
        holders = [f for f in found if f.match_length == length]
        return merged_lookup(length, [(f.count, f.next_tokens, f.next_counts) for f in holders],
                             holders[0].continuation, k)

    num_tokens = property(lambda self: sum(s.num_tokens for s in self.shards))
    num_documents = property(lambda self: sum(s.num_documents for s in self.shards))


def merged_lookup(length: int, holders: list[tuple[int, np.ndarray, np.ndarray]], continuation: np.ndarray,
                  k: int) -> Lookup:
    """One store's answer from its shards': `length` is the longest match of any shard; holders
    are (count, next tokens [m] int32, their counts [m] int) of each shard whose match is that long."""
    count = sum(c for c, _, _ in holders) if length else 0
    ids, inverse = np.unique(np.concatenate([t for _, t, _ in holders]), return_inverse=True)
    totals = np.zeros(len(ids), dtype=np.int64)
    np.add.at(totals, inverse, np.concatenate([c for _, _, c in holders]).astype(np.int64))
    order = np.lexsort((ids, -totals))[:k]  # count descending, then token ascending
    return Lookup(int(length), int(count), np.array(continuation), ids[order].astype(np.int32),
                  totals[order].astype(np.int32))
