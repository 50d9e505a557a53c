"""REST drafter: the tree holds the most frequent continuation prefixes (brute force on small
random corpora), the context suffix is the longest of max_span..min_span tokens in the store."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from samctl.decode.drafters.rest import RestConfig, RestDrafter
from samctl.index.automaton import SuffixAutomaton
from samctl.index.errors import UserError


def build(docs: list[list[int]]) -> SuffixAutomaton:
    tokens = np.asarray([t for d in docs for t in d], dtype=np.int32)
    offsets = np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)
    return SuffixAutomaton.build(tokens, offsets)


def occurs(docs: list[list[int]], s: tuple[int, ...]) -> bool:
    return any(tuple(d[i : i + len(s)]) == s for d in docs for i in range(len(d) - len(s) + 1))


def naive_suffix(docs, context: list[int], cfg: RestConfig) -> tuple[int, ...] | None:
    for n in range(min(cfg.max_span, len(context)), cfg.min_span - 1, -1):
        if occurs(docs, tuple(context[-n:])):
            return tuple(context[-n:])
    return None


def naive_prefix_counts(docs, s: tuple[int, ...], max_depth: int) -> Counter:
    """REST's trie: every prefix of every occurrence's continuation, counted."""
    counts: Counter = Counter()
    for d in docs:
        for i in range(len(d) - len(s) + 1):
            if tuple(d[i : i + len(s)]) == s:
                after = d[i + len(s) : i + len(s) + max_depth]
                for k in range(1, len(after) + 1):
                    counts[tuple(after[:k])] += 1
    return counts


def paths(tree) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for tok, par in zip(tree.tokens.tolist(), tree.parents.tolist()):
        assert par < len(out)
        out.append((out[par] if par >= 0 else ()) + (tok,))
    return out


def check_tree(docs, context: list[int], cfg: RestConfig) -> None:
    drafter = RestDrafter(cfg, build(docs))
    drafter.start(np.asarray(context[:-1], dtype=np.int64), None)
    tree = drafter.propose(context[-1])
    s = naive_suffix(docs, context, cfg)
    if s is None:
        assert len(tree) == 0
        return
    counts = naive_prefix_counts(docs, s, cfg.max_depth)
    got = paths(tree)
    assert len(set(got)) == len(got)
    assert len(got) == min(cfg.num_nodes, len(counts))
    # the chosen prefixes are a top-by-count set: none left out outnumbers one taken
    taken = [counts[p] for p in got]
    assert all(counts[p] > 0 for p in got), (got, counts)
    left_out = [c for p, c in counts.items() if p not in set(got)]
    assert not left_out or max(left_out) <= min(taken), (taken, left_out)
    assert all(len(p) <= cfg.max_depth for p in got)


docs_strategy = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=40), min_size=1, max_size=4)


@settings(max_examples=80, deadline=None)
@given(docs=docs_strategy, context=st.lists(st.integers(0, 4), min_size=1, max_size=20),
       nodes=st.integers(1, 12), depth=st.integers(1, 5), spans=st.tuples(st.integers(1, 3), st.integers(3, 8)))
def test_tree_is_top_prefixes_by_count(docs, context, nodes, depth, spans):
    check_tree(docs, context, RestConfig(min_span=spans[0], max_span=spans[1], num_nodes=nodes, max_depth=depth))


def test_streaming_pointer_matches_full_context():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 6, 200).tolist() for _ in range(3)]
    cfg = RestConfig(max_span=5, num_nodes=8, max_depth=4)
    drafter = RestDrafter(cfg, build(docs))
    text = rng.integers(0, 6, 60).tolist()
    drafter.start(np.asarray(text[:10], dtype=np.int64), None)
    pos = 10
    while pos < len(text) - 1:
        tree = drafter.propose(text[pos])
        fresh = RestDrafter(cfg, build(docs))
        fresh.start(np.asarray(text[:pos], dtype=np.int64), None)
        expected = fresh.propose(text[pos])
        assert tree.tokens.tolist() == expected.tokens.tolist() and tree.parents.tolist() == expected.parents.tolist()
        drafter.observe(np.asarray(text[pos : pos + 2], dtype=np.int64), None, None)
        pos += 2


def test_needs_an_automaton_store():
    with pytest.raises(UserError, match="store="):
        RestDrafter(RestConfig(), None)
    with pytest.raises(UserError):
        RestConfig(min_span=3, max_span=2)
