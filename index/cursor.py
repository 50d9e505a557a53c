"""One pointer per index structure: where the text so far matches a store, and what follows.

A cursor follows a growing text (the prompt, then each step's committed tokens) over a structure
that does not change meanwhile; the drafters ask it, for the pending token t0, how long the match
would be and what continues it, without moving it. Every cursor answers the same calls:

    reset(context)            start: match the longest suffix of context ([k] int tokens)
    advance(tokens)           follow the committed tokens ([k] int)
    peek(t0) -> (length, handle)   the match once t0 follows; the cursor stays where it is
    draft(handle, n)          up to n tokens ([m] int32) that follow a peeked match
    max_match                 the longest match the structure can report (None: unbounded)
    tree(handle, length, span, num_nodes, max_depth) -> (tokens, parents)
                              the num_nodes continuation prefixes (at most max_depth tokens) that
                              most often follow the peeked match's suffix of at most span tokens,
                              best first ([m] int32 each; parents[i] < i, -1 = the root); an
                              n-gram table has none (`tree` is None)

and, for the compiled drafting kernels, the flat arrays and state to start from:

    automata (AutomatonCursor, ShardedCursor):
        before(t0) -> (states, edges, slots, state, length)   the match before t0, in the shard
                      whose match is longest once t0 follows (a kernel steps over t0 itself)
        at(handle) -> (states, edges, slots, state)           a peeked match
    n-gram table (NgramCursor):
        arrays, context(t0)   the table's NgramArrays and the text ending at t0 ([<= max_n] int32)
    suffix arrays (SuffixArrayCursor, ShardedSuffixArrayCursor):
        at(handle) -> (data, table, w, p, first, vocab, lo, hi, length)
                              a peeked match: its suffix array's kernel arrays and range
                              (valid until the cursor moves)

Each move is one compiled call. A structure that grows while read (the dynamic automaton over
prompt + output) keeps its own (state, length) instead.
"""
from __future__ import annotations

import numpy as np

from samctl.index.automaton import SuffixAutomaton, sam_frequent_tree, sam_span_state
from samctl.index.ngram import NgramArrays, NgramTable
from samctl.index.shard_structures import ShardedAutomaton, ShardedSuffixArray
from samctl.index.suffix_array import MAX_MATCH, SuffixArray, follow_state, sa_find, sa_follow, sa_tree


class _AutomatonTree:
    max_match = None

    def tree(self, handle, length: int, span: int, num_nodes: int, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
        # the suffix of length `span` is the match's state, or the ancestor whose length range holds span
        states, edges, _, state = self.at(handle)
        state = sam_span_state(states, state, length, span)
        return sam_frequent_tree(states, edges, state, num_nodes, max_depth)


class AutomatonCursor(_AutomatonTree):
    """A match pointer into one suffix automaton: (state, length) of the longest suffix found."""

    def __init__(self, automaton: SuffixAutomaton) -> None:
        self.automaton = automaton
        self.arrays = automaton.kernel_arrays  # valid while the automaton does not grow
        self.state, self.length = 0, 0

    def reset(self, context: np.ndarray) -> None:
        self.state, self.length = self.automaton.match(context)

    def advance(self, tokens: np.ndarray) -> None:
        self.state, self.length = self.automaton.walk(self.state, self.length, tokens)

    def peek(self, t0: int) -> tuple[int, int]:
        state, length = self.automaton.step(self.state, self.length, t0)
        return length, state

    def draft(self, handle: int, n: int) -> np.ndarray:
        return self.automaton.continuation(handle, n)

    def before(self, t0: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
        a = self.arrays
        return a.states, a.edges, a.slots, self.state, self.length

    def at(self, handle: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        a = self.arrays
        return a.states, a.edges, a.slots, handle


class ShardedCursor(_AutomatonTree):
    """One match pointer per shard; a peek answers from the shard with the longest match (the
    lowest on ties: the first occurrence, as one store over all shards would give)."""

    def __init__(self, sharded: ShardedAutomaton) -> None:
        self.sharded = sharded
        self.states, self.lengths = sharded.pointer()

    def reset(self, context: np.ndarray) -> None:
        self.states, self.lengths = self.sharded.match(np.asarray(context, dtype=np.int32))

    def advance(self, tokens: np.ndarray) -> None:
        self.sharded.walk(self.states, self.lengths, tokens)

    def peek(self, t0: int) -> tuple[int, tuple[int, int]]:
        shard, state, length = self.sharded.peek(self.states, self.lengths, t0)
        return length, (shard, state)

    def draft(self, handle: tuple[int, int], n: int) -> np.ndarray:
        return self.sharded.continuation(*handle, n)

    def before(self, t0: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
        shard = self.sharded.peek(self.states, self.lengths, t0)[0]
        s = self.sharded
        return s.states[shard], s.edges[shard], s.slots[shard], int(self.states[shard]), int(self.lengths[shard])

    def at(self, handle: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        shard, state = handle
        s = self.sharded
        return s.states[shard], s.edges[shard], s.slots[shard], state


class NgramCursor:
    """The last max_n tokens of the text: an n-gram table matches no further back."""

    def __init__(self, table: NgramTable) -> None:
        self.table = table
        self.arrays: NgramArrays = table.kernel_arrays
        self.max_n = self.max_match = table.config.max_n
        self.tail = np.zeros(0, dtype=np.int32)

    def reset(self, context: np.ndarray) -> None:
        self.tail = np.asarray(context[-self.max_n:], dtype=np.int32)

    def advance(self, tokens: np.ndarray) -> None:
        self.tail = np.concatenate((self.tail, np.asarray(tokens, dtype=np.int32)))[-self.max_n:]

    def context(self, t0: int) -> np.ndarray:
        return np.append(self.tail, np.int32(t0))[-self.max_n:]

    def peek(self, t0: int) -> tuple[int, np.ndarray]:
        context = self.context(t0)
        length, _, _ = self.table.lookup(context)
        return length, context

    def draft(self, handle: np.ndarray, n: int) -> np.ndarray:
        return self.table.continuation(handle, n)

    tree = None  # a table keeps next tokens per context, not counts of longer continuations


class SuffixArrayCursor:
    """The match of the text in a suffix array and the text's last MAX_MATCH tokens' keys (a
    broken match is searched again over them: a suffix array has no links). `advance` only holds
    the committed tokens; the next `peek` follows them and steps over t0 in one compiled call
    (after a model's forward every cache is cold, and each call costs some 10 µs)."""

    max_match = None  # a match grows without bound; only its re-search after a break is capped

    def __init__(self, sa: SuffixArray) -> None:
        self.sa = sa
        self.arrays = sa.kernel_arrays
        self.state = follow_state()
        self.keys = np.zeros(MAX_MATCH + 1, dtype=np.int64)  # the text's last keys, then a peeked t0's
        self._pending: np.ndarray | None = None  # committed tokens not followed yet

    def reset(self, context: np.ndarray) -> None:
        self.state = follow_state()
        self._pending = None
        self._follow(np.asarray(context), -1)

    def advance(self, tokens: np.ndarray) -> None:
        # tokens are read at the next peek: the caller does not write to them meanwhile
        if self._pending is not None:  # two advances without a peek between them
            self._follow(self._pending, -1)
        self._pending = np.asarray(tokens)

    def peek(self, t0: int) -> tuple[int, tuple[int, int, int]]:
        length, lo, hi = self._follow(_NONE if self._pending is None else self._pending, t0)
        self._pending = None
        return length, (lo, hi, length)

    def _follow(self, tokens: np.ndarray, t0: int) -> tuple[int, int, int]:
        return sa_follow(*self.arrays[:5], self.keys, self.state, tokens, t0)

    def draft(self, handle: tuple[int, int, int], n: int) -> np.ndarray:
        return self.sa.continuation(*handle, n)

    def at(self, handle: tuple[int, int, int]) -> tuple:
        return (*self.arrays, *handle)

    def tree(self, handle: tuple[int, int, int], length: int, span: int, num_nodes: int,
             max_depth: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi, length = handle
        if length > span:  # the range of the last `span` tokens holds the longer match's
            end = int(self.state[3]) + 1  # the text's last keys, then the peeked t0's
            lo, hi = sa_find(*self.arrays[:5], self.keys, end - span, end)
            length = span
        return sa_tree(*self.arrays, lo, hi, length, num_nodes, max_depth)


_NONE = np.zeros(0, dtype=np.int64)


class ShardedSuffixArrayCursor:
    """One suffix-array cursor per shard; a peek answers from the shard with the longest match, the
    lowest on ties (the earliest occurrence). A handle is (shard, that shard's handle)."""

    max_match = None

    def __init__(self, sharded: ShardedSuffixArray) -> None:
        self.cursors = [SuffixArrayCursor(shard) for shard in sharded.shards]

    def reset(self, context: np.ndarray) -> None:
        for c in self.cursors:
            c.reset(context)

    def advance(self, tokens: np.ndarray) -> None:
        for c in self.cursors:
            c.advance(tokens)  # each reuses its own last peek's step over tokens[0]

    def peek(self, t0: int) -> tuple[int, tuple[int, tuple]]:
        best_length, best = -1, (0, None)
        for i, c in enumerate(self.cursors):
            length, handle = c.peek(t0)
            if length > best_length:
                best_length, best = length, (i, handle)
        return best_length, best

    def draft(self, handle: tuple[int, tuple], n: int) -> np.ndarray:
        return self.cursors[handle[0]].draft(handle[1], n)

    def at(self, handle: tuple[int, tuple]) -> tuple:
        return self.cursors[handle[0]].at(handle[1])

    def tree(self, handle: tuple[int, tuple], length: int, span: int, num_nodes: int,
             max_depth: int) -> tuple[np.ndarray, np.ndarray]:
        return self.cursors[handle[0]].tree(handle[1], length, span, num_nodes, max_depth)


Structure = SuffixAutomaton | ShardedAutomaton | NgramTable | SuffixArray | ShardedSuffixArray
Cursor = AutomatonCursor | ShardedCursor | NgramCursor | SuffixArrayCursor | ShardedSuffixArrayCursor
_CURSORS = {SuffixAutomaton: AutomatonCursor, ShardedAutomaton: ShardedCursor, NgramTable: NgramCursor,
            SuffixArray: SuffixArrayCursor, ShardedSuffixArray: ShardedSuffixArrayCursor}


def cursor(structure: Structure) -> Cursor:
    return _CURSORS[type(structure)](structure)
