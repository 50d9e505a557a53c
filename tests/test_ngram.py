"""N-gram table against brute-force counting on random small documents."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from samctl.index.errors import UserError
from samctl.index.ngram import NgramConfig, NgramTable


def random_docs(rng: np.random.Generator, max_len: int = 40) -> list[list[int]]:
    alphabet = int(rng.integers(2, 6))
    return [list(rng.integers(0, alphabet, size=int(rng.integers(0, max_len)))) for _ in range(int(rng.integers(1, 5)))]


def concat(docs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.array([t for d in docs for t in d], dtype=np.int32)
    return tokens, np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)


def brute_table(docs: list[list[int]], config: NgramConfig) -> dict[tuple, tuple[list[tuple[int, int]], int]]:
    """context -> (kept [(token, count)] by count desc/token asc, total)."""
    nexts: dict[tuple, Counter] = {}
    for d in docs:
        for n in range(1, config.max_n + 1):
            for s in range(len(d) - n):
                nexts.setdefault(tuple(d[s : s + n]), Counter())[d[s + n]] += 1
    table = {}
    for ctx, counter in nexts.items():
        kept = sorted(((t, c) for t, c in counter.items() if c >= config.min_count), key=lambda tc: (-tc[1], tc[0]))
        if kept:
            table[ctx] = (kept[: config.top_k], sum(counter.values()))
    return table


def brute_lookup(table, context: list[int], max_n: int) -> tuple[int, list[tuple[int, int]]]:
    for n in range(min(max_n, len(context)), 0, -1):
        if tuple(context[len(context) - n :]) in table:
            return n, table[tuple(context[len(context) - n :])][0]
    return 0, []


def random_config(rng: np.random.Generator) -> NgramConfig:
    return NgramConfig(max_n=int(rng.integers(1, 5)), min_count=int(rng.integers(1, 4)), top_k=int(rng.integers(1, 4)))


@pytest.mark.parametrize("seed", range(60))
def test_lookup_and_counts_match_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    docs, config = random_docs(rng), random_config(rng)
    table = NgramTable.build(*concat(docs), config)
    ref = brute_table(docs, config)
    assert table.num_contexts == len(ref)
    assert table.num_entries == sum(len(v[0]) for v in ref.values())
    alphabet = max((t for d in docs for t in d), default=0) + 2
    for _ in range(20):
        context = list(rng.integers(0, alphabet, size=int(rng.integers(0, 7))))
        n, tokens, counts = table.lookup(np.array(context, dtype=np.int32))
        ref_n, ref_kept = brute_lookup(ref, context, config.max_n)
        assert n == ref_n
        assert list(zip(tokens.tolist(), counts.tolist())) == ref_kept
        # continuation: greedy chain over the brute-force table
        chain, expected = list(context), []
        for _ in range(5):
            m, kept = brute_lookup(ref, chain, config.max_n)
            if m == 0:
                break
            chain.append(kept[0][0])
            expected.append(kept[0][0])
        assert table.continuation(np.array(context, dtype=np.int32), 5).tolist() == expected


def test_no_cross_document_contexts() -> None:
    docs = [[1, 2], [3, 4], [1, 2], [3, 4]]
    table = NgramTable.build(*concat(docs), NgramConfig(max_n=2, min_count=1, top_k=4))
    assert table.lookup(np.array([2], dtype=np.int32))[0] == 0  # 2 is always last in its document
    n, tokens, counts = table.lookup(np.array([1], dtype=np.int32))
    assert (n, tokens.tolist(), counts.tolist()) == (1, [2], [2])


def test_pruning() -> None:
    docs = [[0, 1, 0, 1, 0, 2, 0, 3, 0, 1]]
    n, tokens, counts = NgramTable.build(*concat(docs), NgramConfig(max_n=1, min_count=2, top_k=8)).lookup(
        np.array([0], dtype=np.int32))
    assert (n, tokens.tolist(), counts.tolist()) == (1, [1], [3])
    n, tokens, counts = NgramTable.build(*concat(docs), NgramConfig(max_n=1, min_count=1, top_k=2)).lookup(
        np.array([0], dtype=np.int32))
    assert (tokens.tolist(), counts.tolist()) == ([1, 2], [3, 1])


@pytest.mark.parametrize("seed", range(20))
def test_adaptive_tree_paths_are_table_continuations(seed: int) -> None:
    # adaptive's n-gram kernel: every child is a top-k next token of the text ending at it
    from samctl.decode.drafters.candidates import N_CELLS, ngram_candidates

    rng = np.random.default_rng(500 + seed)
    docs, config = random_docs(rng), random_config(rng)
    table = NgramTable.build(*concat(docs), config)
    ref = brute_table(docs, config)
    context = list(rng.integers(0, 4, size=int(rng.integers(1, 5))))
    budget, k = int(rng.integers(1, 12)), int(rng.integers(1, 4))
    out = [np.empty(64, np.int32), np.empty(64, np.int32), np.empty(64, np.float64), np.empty(64, np.int32)]
    m = ngram_candidates(table.kernel_arrays, np.array(context, dtype=np.int32), np.ones(N_CELLS), 1, budget, k, 0.0,
                         *out, 0)
    tokens, parents = out[0][:m], out[1][:m]
    tokens, parents = tokens.tolist(), parents.tolist()
    assert len(tokens) <= budget
    for i, (t, p) in enumerate(zip(tokens, parents)):
        assert -1 <= p < i
        path, v = [t], p
        while v >= 0:
            path.insert(0, tokens[v])
            v = parents[v]
        _, kept = brute_lookup(ref, context + path[:-1], config.max_n)
        assert t in [tok for tok, _ in kept[:k]]  # each child is a top-k next token of its text
    siblings = Counter(zip(parents, tokens))
    assert all(c == 1 for c in siblings.values())
    if brute_lookup(ref, context, config.max_n)[0] > 0:
        assert tokens  # something to draft, so the tree is not empty


@pytest.mark.parametrize("seed", range(5))
def test_round_trip_and_corruption(seed: int) -> None:
    rng = np.random.default_rng(900 + seed)
    docs = [list(rng.integers(0, 3, size=50)) for _ in range(3)]
    config = NgramConfig(max_n=3, min_count=2, top_k=2)
    table = NgramTable.build(*concat(docs), config)
    arrays = {}
    for name, a in table.to_arrays().items():
        a = a.copy()
        a.flags.writeable = False
        arrays[name] = a
    loaded = NgramTable.from_arrays(arrays, config)
    assert loaded.config == config
    for _ in range(10):
        ctx = rng.integers(0, 3, size=4).astype(np.int32)
        assert [np.asarray(x).tolist() for x in loaded.lookup(ctx)] == [np.asarray(x).tolist() for x in table.lookup(ctx)]
        assert loaded.continuation(ctx, 9).tolist() == table.continuation(ctx, 9).tolist()
    with pytest.raises(UserError):
        NgramTable.from_arrays(arrays, NgramConfig(max_n=2))

    def corrupt(name, fn):
        out = {k: v.copy() for k, v in arrays.items()}
        fn(out[name])
        return out

    bad = [
        {k: v for k, v in arrays.items() if k != "offsets"},
        {**arrays, "next": arrays["next"].astype(np.int64)},
        corrupt("offsets", lambda o: o.__setitem__(-1, o[-1] + 1)),
        corrupt("offsets", lambda o: o.__setitem__(1, -5)),
        corrupt("order_start", lambda o: o.__setitem__(-1, o[-1] - 1)),
        corrupt("ctx_start", lambda o: o.__setitem__(1, o[1] + 1)),
        corrupt("config", lambda c: c.__setitem__(0, 0)),
        corrupt("keys", lambda k: k.__setitem__(slice(None), k[::-1].copy())),
        {**arrays, "totals": arrays["totals"][:-1]},
    ]
    for b in bad:
        with pytest.raises(UserError):
            NgramTable.from_arrays(b)


def test_config_validation() -> None:
    for kwargs in ({"max_n": 0}, {"min_count": 0}, {"top_k": 0}):
        with pytest.raises(UserError):
            NgramConfig(**kwargs)


def test_hash_collisions_are_grouped_exactly() -> None:
    """Give every context the same hash: grouping must still count each context separately."""
    from samctl.index.ngram import _contexts, _count_order, _group, _positions

    rng = np.random.default_rng(3)
    docs = [list(rng.integers(0, 3, size=30)) for _ in range(3)]
    tokens, offsets = concat(docs)
    config = NgramConfig(max_n=2, min_count=1, top_k=8)
    keys, nxt, start = _positions(tokens, offsets, 2)
    collided = np.zeros_like(keys)
    order = np.lexsort((nxt, collided))
    assert _count_order(collided[order], nxt[order], _contexts(tokens, start[order], 2), 1, 8)[-1]
    _, ctx, off, next_tokens, counts, _ = _group(tokens, [collided, nxt, start], 2, config)
    got = {}
    for i in range(len(off) - 1):
        got[tuple(ctx[2 * i : 2 * i + 2].tolist())] = list(zip(next_tokens[off[i] : off[i + 1]].tolist(),
                                                                 counts[off[i] : off[i + 1]].tolist()))
    ref = {c: kept for c, (kept, _) in brute_table(docs, config).items() if len(c) == 2}
    assert got == ref
