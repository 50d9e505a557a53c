"""The cursors of index/cursor.py against naive references: every structure, the same calls."""
from __future__ import annotations

import numpy as np
import pytest

from samctl.index.automaton import LEN, SuffixAutomaton
from samctl.index.cursor import AutomatonCursor, NgramCursor, ShardedCursor, cursor
from samctl.index.ngram import NgramConfig, NgramTable
from samctl.index.sharded import ShardedAutomaton
from tests.test_automaton import concat, longest_suffix, random_docs
from tests.test_ngram import brute_lookup, brute_table


def follow(c, prompt: list[int], steps: list[list[int]]):
    """Reset on prompt, then advance step by step; yields (text so far, cursor) before each step."""
    c.reset(np.array(prompt, dtype=np.int32))
    text = list(prompt)
    for step in steps:
        yield text, c
        c.advance(np.array(step, dtype=np.int32))
        text += step


def random_text(rng: np.random.Generator, docs: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    flat = [t for d in docs for t in d] or [0]
    source = list(rng.choice(flat, size=30)) + list(max(docs, key=len))
    prompt = source[: int(rng.integers(0, 6))]
    rest = source[len(prompt):]
    steps, i = [], 0
    while i < len(rest) and len(steps) < 8:
        n = int(rng.integers(1, 4))
        steps.append(rest[i : i + n])
        i += n
    return prompt, steps


@pytest.mark.parametrize("seed", range(25))
def test_automaton_cursors_peek_the_longest_suffix(seed: int) -> None:
    rng = np.random.default_rng(seed)
    docs = random_docs(rng, n_docs=4)
    if not any(docs):
        docs[0] = [0, 1]
    whole = SuffixAutomaton.build(*concat(docs))
    split = ShardedAutomaton([SuffixAutomaton.build(*concat(docs[:2])), SuffixAutomaton.build(*concat(docs[2:]))])
    prompt, steps = random_text(rng, docs)
    for c in (cursor(whole), cursor(split)):
        assert isinstance(c, (AutomatonCursor, ShardedCursor))
        for text, at in follow(c, prompt, steps):
            t0 = int(rng.integers(0, 4))
            length, handle = at.peek(t0)
            assert length == longest_suffix(docs, text + [t0])
            drafted = at.draft(handle, 5).tolist()
            if length:  # the draft continues an occurrence of the match inside one document
                match = (text + [t0])[len(text) + 1 - length:]
                assert any(d[i : i + length + len(drafted)] == match + drafted
                           for d in docs for i in range(len(d)))
            states, edges, slots, state, before = at.before(t0)
            best = longest_suffix(docs, text)  # a sharded cursor's shard is the best after t0, not before
            assert before == best if isinstance(at, AutomatonCursor) else before <= best
            assert states[state, LEN] >= before  # the state holds the match


@pytest.mark.parametrize("seed", range(25))
def test_ngram_cursor_matches_the_table(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    docs = random_docs(rng, n_docs=3)
    config = NgramConfig(max_n=int(rng.integers(1, 5)), min_count=1, top_k=3)
    ref = brute_table(docs, config)
    c = cursor(NgramTable.build(*concat(docs), config))
    assert isinstance(c, NgramCursor)
    prompt, steps = random_text(rng, docs)
    for text, at in follow(c, prompt, steps):
        t0 = int(rng.integers(0, 4))
        length, handle = at.peek(t0)
        assert length == brute_lookup(ref, text + [t0], config.max_n)[0]
        assert at.context(t0).tolist() == (text + [t0])[-config.max_n:]
