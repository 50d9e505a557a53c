"""One pointer per index structure: where the text so far matches a store, and what follows.

A cursor follows a growing text (the prompt, then each step's committed tokens) over a structure
that does not change meanwhile: a suffix automaton, a sharded store, an n-gram table. The drafters
(sam, adaptive, rest) ask it, for the pending token t0, how long the match would be and what
continues it, without moving it. Every cursor answers the same calls:

    reset(context)            start: match the longest suffix of context ([k] int tokens)
    advance(tokens)           follow the committed tokens ([k] int)
    peek(t0) -> (length, handle)   the match once t0 follows; the cursor stays where it is
    draft(handle, n)          up to n tokens ([m] int32) that follow a peeked match

and, for the compiled drafting kernels, the flat arrays and state to start from:

    automata (AutomatonCursor, ShardedCursor):
        before(t0) -> (states, edges, slots, state, length)   the match before t0, in the shard
                      whose match is longest once t0 follows (a kernel steps over t0 itself)
        at(handle) -> (states, edges, slots, state)           a peeked match
    n-gram table (NgramCursor):
        arrays, context(t0)   the table's NgramArrays and the text ending at t0 ([<= max_n] int32)

The moves are one compiled call each (the same kernels as before cursors existed); each cursor is
a few attributes, so a step costs no Python per token. Structures that grow while a cursor reads
them (the dynamic automaton over prompt + output) keep their own (state, length) instead.
"""
from __future__ import annotations

import numpy as np

from samctl.index.automaton import SuffixAutomaton
from samctl.index.ngram import NgramArrays, NgramTable
from samctl.index.sharded import ShardedAutomaton


class AutomatonCursor:
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


class ShardedCursor:
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
        self.max_n = table.config.max_n
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


def cursor(structure: SuffixAutomaton | ShardedAutomaton | NgramTable) -> AutomatonCursor | ShardedCursor | NgramCursor:
    """The cursor of a store's structure, at the start of an empty text."""
    if isinstance(structure, SuffixAutomaton):
        return AutomatonCursor(structure)
    if isinstance(structure, ShardedAutomaton):
        return ShardedCursor(structure)
    return NgramCursor(structure)
