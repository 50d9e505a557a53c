"""Suffix automaton against brute force on random small documents (alphabets of 2-5 symbols)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from samctl.index.automaton import COUNT, LINK, SuffixAutomaton
from samctl.index.errors import UserError


def random_docs(rng: np.random.Generator, n_docs: int | None = None, max_len: int = 25) -> list[list[int]]:
    alphabet = int(rng.integers(2, 6))
    n_docs = int(rng.integers(1, 5)) if n_docs is None else n_docs
    return [list(rng.integers(0, alphabet, size=int(rng.integers(0, max_len)))) for _ in range(n_docs)]


def concat(docs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.array([t for d in docs for t in d], dtype=np.int32)
    offsets = np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)
    return tokens, offsets


def buffer_of(docs: list[list[int]]) -> list[int]:
    """The automaton's token buffer: non-empty documents, each followed by -1."""
    out: list[int] = []
    for d in docs:
        if d:
            out += list(d) + [-1]
    return out


def end_positions(docs: list[list[int]], s: list[int]) -> list[int]:
    """Buffer positions where an occurrence of s (inside one document) ends, ascending."""
    buf, n, out = buffer_of(docs), len(s), []
    for end in range(len(buf)):
        window = buf[end - n + 1 : end + 1] if n else []
        if n and end - n + 1 >= 0 and window == s and -1 not in window:
            out.append(end)
    return out


def occurs(docs: list[list[int]], s: list[int]) -> bool:
    return not s or bool(end_positions(docs, s))


def longest_suffix(docs: list[list[int]], query: list[int]) -> int:
    for length in range(len(query), -1, -1):
        if occurs(docs, query[len(query) - length :]):
            return length
    return 0


def random_query(rng: np.random.Generator, docs: list[list[int]]) -> list[int]:
    """Half the time a substring of a document plus noise, so long matches get exercised."""
    flat = [t for d in docs for t in d]
    alphabet = max(flat, default=0) + 2  # includes a token the corpus never saw
    if flat and rng.random() < 0.5:
        d = max(docs, key=len)
        i = int(rng.integers(0, len(d)))
        return list(rng.integers(0, alphabet, size=int(rng.integers(0, 3)))) + d[i : i + int(rng.integers(1, 12))]
    return list(rng.integers(0, alphabet, size=int(rng.integers(0, 12))))


SEEDS = range(60)


@pytest.mark.parametrize("seed", SEEDS)
def test_match_step_count_continuation(seed: int) -> None:
    rng = np.random.default_rng(seed)
    docs = random_docs(rng)
    sam = SuffixAutomaton.build(*concat(docs))
    latest = SuffixAutomaton.from_arrays(sam.to_arrays(), occurrence="latest")
    buf = buffer_of(docs)
    assert sam.tokens.tolist() == buf
    for _ in range(15):
        query = random_query(rng, docs)
        state, length = 0, 0
        for i, token in enumerate(query):  # streaming step == match of every prefix
            state, length = sam.step(state, length, token)
            assert length == longest_suffix(docs, query[: i + 1])
        assert sam.match(np.array(query, dtype=np.int32)) == (state, length)
        matched = query[len(query) - length :]
        ends = end_positions(docs, matched)
        if length == 0:
            assert state == 0 and sam.continuation(state, 5).size == 0
            continue
        assert sam.count(state) == len(ends)
        assert sam.length(state) >= length
        for automaton, end in ((sam, ends[0]), (latest, ends[-1])):
            assert automaton.end_position(state) == end
            cont = automaton.continuation(state, 6).tolist()
            after = buf[end + 1 : end + 7]
            expected = after[: after.index(-1)] if -1 in after else after
            assert cont == expected


@pytest.mark.parametrize("seed", SEEDS)
def test_topk_next_counts(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    docs = random_docs(rng)
    sam = SuffixAutomaton.build(*concat(docs))
    for _ in range(10):
        state, length = sam.match(np.array(random_query(rng, docs), dtype=np.int32))
        matched_len = sam.length(state)  # topk is a property of the state's whole class
        buf = buffer_of(docs)
        if state == 0:
            nxt = Counter(t for t in buf if t >= 0)
        else:
            end = sam.end_position(state)
            s = buf[end - matched_len + 1 : end + 1]
            nxt = Counter(buf[e + 1] for e in end_positions(docs, s) if buf[e + 1] >= 0)
        k = int(rng.integers(1, 5))
        expected = sorted(nxt.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        tokens, counts = sam.topk_next(state, k)
        assert list(zip(tokens.tolist(), counts.tolist())) == expected
        assert tokens.dtype == np.int32 and counts.dtype == np.int32


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("occurrence", ["first", "latest"])
def test_incremental_equals_build(seed: int, occurrence: str) -> None:
    rng = np.random.default_rng(3000 + seed)
    docs = random_docs(rng)
    static = SuffixAutomaton.build(*concat(docs))
    dyn = SuffixAutomaton.empty(capacity=1, occurrence=occurrence)  # forces every array to regrow
    for d in docs:
        cut = int(rng.integers(0, len(d) + 1))
        dyn.extend(np.array(d[:cut], dtype=np.int32))
        dyn.extend(np.array(d[cut:], dtype=np.int32))
        dyn.end_document()
    a, b = static.to_arrays(), dyn.to_arrays()
    assert np.array_equal(a["states"], b["states"])
    assert np.array_equal(a["edges"], b["edges"])
    assert np.array_equal(a["tokens"], b["tokens"])
    assert (dyn.num_states, dyn.num_edges, dyn.num_tokens, dyn.num_documents) == (
        static.num_states, static.num_edges, static.num_tokens, static.num_documents)
    for _ in range(5):
        q = np.array(random_query(rng, docs), dtype=np.int32)
        assert dyn.match(q) == static.match(q)


def test_incremental_latest_tracks_newest_occurrence() -> None:
    dyn = SuffixAutomaton.empty(occurrence="latest")
    dyn.extend(np.array([5, 6, 7, 5, 6, 8], dtype=np.int32))
    state, length = dyn.match(np.array([5, 6], dtype=np.int32))
    assert length == 2 and dyn.count(state) == 2
    assert dyn.continuation(state, 3).tolist() == [8]
    first = SuffixAutomaton.empty(occurrence="first")
    first.extend(np.array([5, 6, 7, 5, 6, 8], dtype=np.int32))
    assert first.continuation(first.match(np.array([5, 6], dtype=np.int32))[0], 3).tolist() == [7, 5, 6]


def test_no_match_across_documents() -> None:
    sam = SuffixAutomaton.build(np.array([1, 2, 3, 4], dtype=np.int32), np.array([0, 2, 4]))
    assert sam.match(np.array([2, 3], dtype=np.int32))[1] == 1
    state, _ = sam.match(np.array([1], dtype=np.int32))
    assert sam.continuation(state, 10).tolist() == [2]
    assert sam.num_documents == 2 and sam.num_tokens == 4


@pytest.mark.parametrize("seed", range(20))
def test_size_bounds(seed: int) -> None:
    """The preallocation bounds: at most 2n-1 states (n >= 2) and 3n transitions."""
    rng = np.random.default_rng(5000 + seed)
    docs = random_docs(rng, max_len=60)
    n = sum(len(d) for d in docs)
    sam = SuffixAutomaton.build(*concat(docs))
    assert sam.num_states <= max(2 * n - 1, n + 1)
    assert sam.num_edges <= 3 * n


def test_counts_sum_at_root() -> None:
    rng = np.random.default_rng(7)
    docs = random_docs(rng, n_docs=4, max_len=40)
    sam = SuffixAutomaton.build(*concat(docs))
    states = sam.to_arrays()["states"]
    assert states[0, COUNT] == sum(len(d) for d in docs)


@pytest.mark.parametrize("seed", range(10))
def test_round_trip_readonly(seed: int) -> None:
    rng = np.random.default_rng(4000 + seed)
    docs = random_docs(rng)
    sam = SuffixAutomaton.build(*concat(docs))
    arrays = {}
    for name, a in sam.to_arrays().items():
        a = a.copy()
        a.flags.writeable = False
        arrays[name] = a
    loaded = SuffixAutomaton.from_arrays(arrays)
    assert loaded.num_states == sam.num_states and loaded.num_edges == sam.num_edges
    for _ in range(5):
        q = np.array(random_query(rng, docs), dtype=np.int32)
        state, length = sam.match(q)
        assert loaded.match(q) == (state, length)
        assert loaded.continuation(state, 4).tolist() == sam.continuation(state, 4).tolist()
        assert [x.tolist() for x in loaded.topk_next(state, 3)] == [x.tolist() for x in sam.topk_next(state, 3)]
    with pytest.raises(UserError):
        loaded.extend(np.array([1], dtype=np.int32))


def _corruptions(arrays: dict[str, np.ndarray]):
    """(description, corrupted copy) pairs; each must be rejected."""
    def edit(name, fn):
        out = {k: v.copy() for k, v in arrays.items()}
        fn(out[name])
        return out

    n_states = len(arrays["states"])
    yield "missing", {k: v for k, v in arrays.items() if k != "slots"}
    yield "dtype", {**arrays, "states": arrays["states"].astype(np.int64)}
    yield "truncated tokens", {**arrays, "tokens": arrays["tokens"][:-1]}
    yield "link out of range", edit("states", lambda s: s.__setitem__((1, LINK), n_states))
    yield "link cycle", edit("states", lambda s: s.__setitem__((1, LINK), n_states - 1))
    yield "inline edge target", edit("states", lambda s: s.__setitem__((0, 6), n_states + 5))
    yield "first end", edit("states", lambda s: s.__setitem__((1, 2), len(arrays["tokens"]) + 3))
    yield "edge target", edit("edges", lambda e: e.__setitem__((0, 2), -4))
    yield "edge chain loop", edit("edges", lambda e: e.__setitem__((0, 3), 0))
    yield "full hash table", edit("slots", lambda s: s.__setitem__(slice(None), 0))
    yield "meta", edit("meta", lambda m: m.__setitem__(0, 3))


def test_from_arrays_rejects_corruption() -> None:
    rng = np.random.default_rng(11)
    docs = [list(rng.integers(0, 3, size=60)) for _ in range(3)]
    arrays = {k: v.copy() for k, v in SuffixAutomaton.build(*concat(docs)).to_arrays().items()}
    assert len(arrays["edges"]) > 0
    for what, bad in _corruptions(arrays):
        with pytest.raises(UserError):
            SuffixAutomaton.from_arrays(bad)
            pytest.fail(f"accepted corruption: {what}")


def test_unchecked_link_cycle_cannot_hang_step() -> None:
    """Without the link check a cyclic suffix link passes validation, but link walks are capped."""
    docs = [[0, 1, 2, 0, 1, 3, 1, 2]]
    arrays = {k: v.copy() for k, v in SuffixAutomaton.build(*concat(docs)).to_arrays().items()}
    states = arrays["states"]
    a, b = 1, len(states) - 1
    states[a, LINK], states[b, LINK] = b, a  # a two-state cycle that avoids the root
    with pytest.raises(UserError):
        SuffixAutomaton.from_arrays(arrays)
    loaded = SuffixAutomaton.from_arrays(arrays, check_links=False)
    for start in (a, b):
        loaded.step(start, 1, 99)  # 99 has no transition anywhere: walks links until the cap


def test_bad_inputs() -> None:
    with pytest.raises(UserError):
        SuffixAutomaton.build(np.array([1, -2], dtype=np.int32), np.array([0, 2]))
    with pytest.raises(UserError):
        SuffixAutomaton.build(np.array([1, 2], dtype=np.int32), np.array([0, 3]))
    with pytest.raises(UserError):
        SuffixAutomaton.empty(occurrence="middle")
    assert SuffixAutomaton.build(np.zeros(0, dtype=np.int32), np.array([0])).num_states == 1


def test_extend_tracking_equals_step_then_extend():
    rng = np.random.default_rng(5)
    for trial in range(30):
        tokens = rng.integers(0, 3, rng.integers(1, 60)).astype(np.int32)
        slow, fast = SuffixAutomaton.empty(4), SuffixAutomaton.empty(4)
        state, length = 0, 0
        for token in tokens:
            state, length = slow.step(state, length, int(token))
            slow.extend(np.array([token], dtype=np.int32))
        cut = int(rng.integers(0, len(tokens) + 1))
        pointer = fast.extend_tracking(tokens[:cut], 0, 0)
        pointer = fast.extend_tracking(tokens[cut:], *pointer)
        assert pointer[1] == length, (trial, tokens)
        assert fast.continuation(pointer[0], 50).tolist() == slow.continuation(state, 50).tolist()
        for name, array in slow.to_arrays().items():
            np.testing.assert_array_equal(array, fast.to_arrays()[name], err_msg=name)


@pytest.mark.parametrize("seed", range(40))
def test_appended_equals_full_build(seed: int) -> None:
    """Appending documents to a (read-only, reloaded) store's automaton gives exactly the
    automaton a full build over old + new documents gives, and answers queries like brute force."""
    rng = np.random.default_rng(5000 + seed)
    old, new = random_docs(rng), random_docs(rng, n_docs=int(rng.integers(0, 4)))
    if rng.random() < 0.3:  # new documents that repeat old text: clones of old states
        new.append(list(old[0]) + list(rng.integers(0, 3, size=3)))
    arrays = {}
    for name, a in SuffixAutomaton.build(*concat(old)).to_arrays().items():
        a = a.copy()
        a.flags.writeable = False
        arrays[name] = a
    grown = SuffixAutomaton.from_arrays(arrays).appended(*concat(new))
    full = SuffixAutomaton.build(*concat(old + new))
    a, b = full.to_arrays(), grown.to_arrays()
    assert np.array_equal(a["states"], b["states"])
    assert np.array_equal(a["edges"], b["edges"])
    assert np.array_equal(a["tokens"], b["tokens"])
    assert np.array_equal(a["meta"], b["meta"])
    docs = old + new
    for occurrence in ("first", "latest"):
        loaded = SuffixAutomaton.from_arrays(grown.to_arrays(), occurrence=occurrence)
        reference = SuffixAutomaton.from_arrays(full.to_arrays(), occurrence=occurrence)
        for _ in range(8):
            q = np.array(random_query(rng, docs), dtype=np.int32)
            state, length = loaded.match(q)
            assert length == longest_suffix(docs, q.tolist())
            assert (state, length) == reference.match(q)
            assert loaded.count(state) == (len(end_positions(docs, q[len(q) - length:].tolist())) if length
                                           else reference.count(0))
            assert loaded.continuation(state, 5).tolist() == reference.continuation(state, 5).tolist()
            assert [x.tolist() for x in loaded.topk_next(state, 3)] == [x.tolist() for x in reference.topk_next(state, 3)]


def test_appended_to_nothing_and_bad_input() -> None:
    docs = [[1, 2, 3], [2, 3, 4]]
    empty = SuffixAutomaton.build(np.zeros(0, dtype=np.int32), np.array([0]))
    grown = empty.appended(*concat(docs))
    assert np.array_equal(grown.to_arrays()["states"], SuffixAutomaton.build(*concat(docs)).to_arrays()["states"])
    with pytest.raises(UserError):
        grown.appended(np.array([-3], dtype=np.int32), np.array([0, 1]))
