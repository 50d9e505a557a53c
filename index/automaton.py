"""Suffix automaton over token ids: streaming longest-suffix match and retrieval drafts.

Contract. A generalized suffix automaton over a set of documents of int32 token ids (>= 0).
Every path from the root spells a substring of one single document, so a match never crosses a
document boundary. The token buffer holds all documents, each followed by a separator (-1), so
a continuation sliced out of it stops at the end of its document. Per state:
    len        length of the longest string of the state
    link       suffix link (-1 for the root)
    first_end  buffer position of the last token of the first (earliest-ending) occurrence
    last_end   the same for the latest occurrence
    count      number of occurrences (end positions) over all documents
Two kinds share the structure and the kernels: a static automaton built once over a corpus
(`build`, counts computed offline) and an incremental one grown token by token (`empty` +
`extend`/`end_document`, counts and last_end kept exact online).

Layout (flat arrays, no Python object per state; all little-endian fixed width):
    states [S, 8] int32   one 32-byte record per state, columns LEN..HEAD below, so a step
                          touches one cache line for the state
    edges  [E, 4] int32   second and later out-edges: (src, token, dst, next); a state's first
                          out-edge is inline in its record (most states have exactly one), the
                          rest are chained through `next`, which always points to a lower index
    slots  [H]    int32   open-addressing hash table (linear probing, H a power of two, load
                          <= 1/2) mapping (src, token) to an index into `edges`, -1 = empty
    tokens [T]    int32   the documents, each followed by -1
    meta   [8]    int64   counters (see M_*)

It does NOT know text, tokenizers, files (index/store.py writes `to_arrays()`), or decoding
policy (which occurrence to trust, chain versus tree: decode/ decides).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, NamedTuple

import numpy as np
from numba import njit

from samctl.index.best_first import DEPTH, REF, tree_buffers, tree_push, tree_take
from samctl.index.errors import UserError
from samctl.index.automaton_layout import (COUNT, E_DST, E_NEXT, E_SRC, E_TOK, EDGE_DST, EDGE_TOK, FIRST_END, HEAD,
                                    LAST_END, LEN, LINK, M_BUF, M_DOC_OPEN, M_DOCS, M_EDGES, M_LAST,
                                    M_ROOT_DEGREE, M_STATES, M_TOKENS, N_EDGE_COLS, N_META, N_STATE_COLS, SEP, edge_count)

OCCURRENCES = ("first", "latest")
_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)


# ---------------------------------------------------------------------------------------------
# Kernels: transitions


@njit(cache=True, inline="always")
def _hash_slot(state, token, mask):
    key = (np.uint64(state) << np.uint64(32)) | np.uint64(token)
    h = key * _HASH_MUL
    h ^= h >> np.uint64(29)
    return np.int64(h & np.uint64(mask))


@njit(cache=True)
def _find(states, edges, slots, state, token):
    # -> destination of the edge state --token-->, or -1. O(1) expected.
    if token < 0:
        return -1
    if states[state, EDGE_TOK] == token:
        return states[state, EDGE_DST]
    if states[state, HEAD] < 0:  # only the inline edge (or none): no hash probe
        return -1
    mask = len(slots) - 1
    i = _hash_slot(state, token, mask)
    while True:
        e = slots[i]
        if e < 0:
            return -1
        if edges[e, E_SRC] == state and edges[e, E_TOK] == token:
            return edges[e, E_DST]
        i = (i + 1) & mask


@njit(cache=True)
def _redirect(states, edges, slots, state, token, dst):
    if states[state, EDGE_TOK] == token:
        states[state, EDGE_DST] = dst
        return
    mask = len(slots) - 1
    i = _hash_slot(state, token, mask)
    while True:
        e = slots[i]
        if edges[e, E_SRC] == state and edges[e, E_TOK] == token:
            edges[e, E_DST] = dst
            return
        i = (i + 1) & mask


@njit(cache=True)
def _slots_insert(edges, slots, e):
    mask = len(slots) - 1
    i = _hash_slot(edges[e, E_SRC], edges[e, E_TOK], mask)
    while slots[i] >= 0:
        i = (i + 1) & mask
    slots[i] = e


@njit(cache=True)
def _rehash(edges, n_edges, n_slots):
    slots = np.full(n_slots, -1, dtype=np.int32)
    for e in range(n_edges):
        _slots_insert(edges, slots, e)
    return slots


@njit(cache=True)
def _add_edge(states, edges, slots, meta, state, token, dst):
    # the edge is absent before; the caller reserved capacity
    if state == 0:
        meta[M_ROOT_DEGREE] += 1
    if states[state, EDGE_TOK] < 0:
        states[state, EDGE_TOK] = token
        states[state, EDGE_DST] = dst
        return
    e = meta[M_EDGES]
    edges[e, E_SRC] = state
    edges[e, E_TOK] = token
    edges[e, E_DST] = dst
    edges[e, E_NEXT] = states[state, HEAD]
    states[state, HEAD] = e
    meta[M_EDGES] = e + 1
    _slots_insert(edges, slots, e)


# ---------------------------------------------------------------------------------------------
# Kernels: construction
#
# No kernel below allocates: `_insert` stops before a token that might overflow an array and
# the Python side grows the arrays and resumes. One token adds at most 2 states and at most
# len[last] + 1 (suffix-link walk, lengths strictly decrease) + out-degree of the root (a
# clone copies a state's out-edges, and no state has more than the root) + 1 edges.


@njit(cache=True)
def _edge_headroom(states, meta):
    return states[meta[M_LAST], LEN] + meta[M_ROOT_DEGREE] + 2


@njit(cache=True)
def _new_state(states, meta, length, link, end):
    s = meta[M_STATES]
    states[s, LEN] = length
    states[s, LINK] = link
    states[s, FIRST_END] = end
    states[s, LAST_END] = end
    states[s, COUNT] = 0
    states[s, EDGE_TOK] = -1
    states[s, EDGE_DST] = -1
    states[s, HEAD] = -1
    meta[M_STATES] = s + 1
    return s


@njit(cache=True)
def _clone(states, edges, slots, meta, q, length, online):
    # Online (incremental) counts are totals, so the clone copies q's count and last end (its
    # end positions so far are q's); offline counts are own counts, so the clone starts empty.
    c = _new_state(states, meta, length, states[q, LINK], states[q, FIRST_END])
    if online:
        states[c, COUNT] = states[q, COUNT]
        states[c, LAST_END] = states[q, LAST_END]
    else:
        states[c, LAST_END] = -1
    states[c, EDGE_TOK] = states[q, EDGE_TOK]
    states[c, EDGE_DST] = states[q, EDGE_DST]
    e = states[q, HEAD]
    while e >= 0:
        _add_edge(states, edges, slots, meta, c, edges[e, E_TOK], edges[e, E_DST])
        e = edges[e, E_NEXT]
    return c


@njit(cache=True)
def _split(states, edges, slots, meta, p, token, q, online):
    """Clone q at length len[p]+1 and move the edges p' --token--> q (p' on p's link chain) to it."""
    c = _clone(states, edges, slots, meta, q, states[p, LEN] + 1, online)
    states[q, LINK] = c
    while p >= 0 and _find(states, edges, slots, p, token) == q:
        _redirect(states, edges, slots, p, token, c)
        p = states[p, LINK]
    return c


@njit(cache=True)
def _sam_add(states, edges, slots, meta, last, token, pos, online):
    """Generalized-SAM extension of state `last` by `token` (at buffer position pos) -> the
    extended prefix's state. An existing transition (the prefix occurred before, possibly in
    another document) makes no new state, except a clone when its target is longer than len[last]+1."""
    q = _find(states, edges, slots, last, token)
    if q >= 0:
        if states[last, LEN] + 1 == states[q, LEN]:
            return q
        return _split(states, edges, slots, meta, last, token, q, online)
    cur = _new_state(states, meta, states[last, LEN] + 1, 0, pos)
    p = last
    while p >= 0:
        q = _find(states, edges, slots, p, token)
        if q >= 0:
            break
        _add_edge(states, edges, slots, meta, p, token, cur)
        p = states[p, LINK]
    if p < 0:
        return cur
    if states[p, LEN] + 1 == states[q, LEN]:
        states[cur, LINK] = q
    else:
        states[cur, LINK] = _split(states, edges, slots, meta, p, token, q, online)
    return cur


@njit(cache=True, nogil=True)  # releases the GIL: `samctl build` reports progress meanwhile
def _insert(states, edges, slots, buf, meta, tokens, doc_offsets, d, i, close_docs, online, pointer, own):
    """Insert tokens[doc_offsets[d]:] document by document from token i; returns (d, i) where it
    stopped: d == len(doc_offsets) - 1 when done, else the arrays need room first.

    pointer: [state, length] of a match moved over each token *before* it is inserted, so it stays
    an earlier occurrence (SAM-Decoding's dynamic pointer); empty for none. close_docs: end each
    document (separator; the next starts at the root). online: keep counts and last ends exact
    after every token by walking the new state's suffix-link chain (short on natural text, linear
    in a run of one repeated token); offline: own counts, for `_propagate_offline`. own (non-empty
    when appending to totals): count[s] keeps the old total (a clone copies it, as online) and the
    new end positions at s go to own[s], for `_propagate_appended`.
    """
    n_docs = len(doc_offsets) - 1
    while d < n_docs:
        stop = doc_offsets[d + 1]
        while i < stop:
            n_edges = meta[M_EDGES] + _edge_headroom(states, meta)
            if (meta[M_STATES] + 2 > states.shape[0] or n_edges > edges.shape[0]
                    or 2 * n_edges > len(slots) or meta[M_BUF] + 2 > len(buf)):
                return d, i
            if meta[M_DOC_OPEN] == 0:
                meta[M_DOC_OPEN] = 1
                meta[M_DOCS] += 1
            token = tokens[i]
            if len(pointer) == 2:
                pointer[0], pointer[1] = sam_step(states, edges, slots, pointer[0], pointer[1], token)
            pos = meta[M_BUF]
            buf[pos] = token
            appending = len(own) > 0
            last = _sam_add(states, edges, slots, meta, meta[M_LAST], token, pos, online or appending)
            if appending:
                own[last] += 1
                states[last, LAST_END] = pos
            elif online:
                s = last
                while s >= 0:
                    states[s, COUNT] += 1
                    states[s, LAST_END] = pos
                    s = states[s, LINK]
            else:
                states[last, COUNT] += 1
                states[last, LAST_END] = pos
            meta[M_LAST] = last
            meta[M_BUF] = pos + 1
            meta[M_TOKENS] += 1
            i += 1
        if close_docs and meta[M_DOC_OPEN] == 1:
            buf[meta[M_BUF]] = SEP  # room: reserved with the document's last token
            meta[M_BUF] += 1
            meta[M_LAST] = 0
            meta[M_DOC_OPEN] = 0
        d += 1
    return d, i


@njit(cache=True, nogil=True)  # releases the GIL: `samctl build` reports progress meanwhile
def _propagate_offline(states, n_states):
    """Own counts/last ends -> totals: add each state into its link by decreasing length
    (len[link[s]] < len[s], so a counting sort by length orders children first)."""
    max_len = 0
    for s in range(n_states):
        max_len = max(max_len, states[s, LEN])
    bucket = np.zeros(max_len + 2, dtype=np.int64)
    for s in range(n_states):
        bucket[states[s, LEN] + 1] += 1
    for i in range(1, max_len + 2):
        bucket[i] += bucket[i - 1]
    order = np.empty(n_states, dtype=np.int32)
    for s in range(n_states):
        order[bucket[states[s, LEN]]] = s
        bucket[states[s, LEN]] += 1
    for i in range(n_states - 1, 0, -1):
        s = order[i]
        p = states[s, LINK]
        states[p, COUNT] += states[s, COUNT]
        if states[s, LAST_END] > states[p, LAST_END]:
            states[p, LAST_END] = states[s, LAST_END]


@njit(cache=True)
def _propagate_appended(states, own, n_states):
    """Add an append's new end positions (own[s]: at s itself, from `_insert`) to the counts and
    latest ends above them: only the link-ancestors of states with own > 0 change; they are
    collected once each and summed children first, by decreasing length (len[link[s]] < len[s])."""
    visited = np.zeros(n_states, dtype=np.uint8)
    union = np.empty(n_states, dtype=np.int32)
    m = 0
    for s in range(n_states):
        if own[s] > 0:
            t = s
            while t >= 0 and visited[t] == 0:
                visited[t] = 1
                union[m] = t
                m += 1
                t = states[t, LINK]
    # counting sort of the collected states by decreasing length
    max_len = 0
    for k in range(m):
        max_len = max(max_len, states[union[k], LEN])
    start = np.zeros(max_len + 2, dtype=np.int64)
    for k in range(m):
        start[max_len - states[union[k], LEN] + 1] += 1
    for i in range(1, max_len + 2):
        start[i] += start[i - 1]
    order = np.empty(m, dtype=np.int32)
    for k in range(m):
        slot = max_len - states[union[k], LEN]
        order[start[slot]] = union[k]
        start[slot] += 1
    for s in order:
        states[s, COUNT] += own[s]  # own[s] now includes every child's new positions
        p = states[s, LINK]
        if p >= 0:
            own[p] += own[s]
            if states[s, LAST_END] > states[p, LAST_END]:
                states[p, LAST_END] = states[s, LAST_END]


# ---------------------------------------------------------------------------------------------
# Kernels: queries (pure; callable directly by decoders on `SuffixAutomaton.kernel_arrays`)


@njit(cache=True)
def sam_step(states, edges, slots, state, length, token):
    """Match (state, length) of text s -> match of s + token: min(length, len[state]) + 1 at the
    first state on the suffix-link chain with a transition on token, or (0, 0)."""
    for _ in range(states.shape[0]):  # a cap for corrupt links; valid chains are shorter
        d = _find(states, edges, slots, state, token)
        if d >= 0:
            return d, min(length, states[state, LEN]) + 1
        if state == 0:
            break
        state = states[state, LINK]
        length = states[state, LEN]
    return 0, 0


@njit(cache=True)
def sam_walk(states, edges, slots, state, length, tokens):
    for token in tokens:
        state, length = sam_step(states, edges, slots, state, length, token)
    return state, length


@njit(cache=True)
def sam_continuation_span(states, buf, n_buf, state, n, end_col):
    """[start, stop) of the up-to-n tokens after the occurrence's end; stops at a separator."""
    if state <= 0 or n <= 0:
        return 0, 0
    start = states[state, end_col] + 1
    stop = min(start + n, n_buf)
    i = start
    while i < stop and buf[i] >= 0:
        i += 1
    return start, i


@njit(cache=True)
def sam_topk_children(states, edges, state, k, out_tok, out_dst):
    """The (up to) k out-edges of state with the largest destination counts, into out_*, by count
    descending then token ascending; returns how many. O(degree * k)."""
    m = 0
    e = -2  # -2: the inline edge next, then the chain
    while True:
        if e == -2:
            token = states[state, EDGE_TOK]
            dst = states[state, EDGE_DST]
            e = states[state, HEAD]
            if token < 0:
                break
        elif e >= 0:
            token = edges[e, E_TOK]
            dst = edges[e, E_DST]
            e = edges[e, E_NEXT]
        else:
            break
        cnt = states[dst, COUNT]
        # insertion into the sorted top-k buffer
        i = m
        while i > 0:
            pc = states[out_dst[i - 1], COUNT]
            if pc > cnt or (pc == cnt and out_tok[i - 1] < token):
                break
            i -= 1
        if i >= k:
            continue
        j = min(m, k - 1)
        while j > i:
            out_tok[j] = out_tok[j - 1]
            out_dst[j] = out_dst[j - 1]
            j -= 1
        out_tok[i] = token
        out_dst[i] = dst
        if m < k:
            m += 1
    return m


@njit(cache=True)
def sam_topk_next(states, edges, state, k):
    out_tok = np.empty(max(k, 0), dtype=np.int32)
    out_dst = np.empty(max(k, 0), dtype=np.int32)
    if k <= 0:
        return out_tok, out_tok.copy()
    m = sam_topk_children(states, edges, state, k, out_tok, out_dst)
    counts = np.empty(m, dtype=np.int32)
    for i in range(m):
        counts[i] = states[out_dst[i], COUNT]
    return out_tok[:m].copy(), counts


@njit(cache=True)
def sam_span_state(states, state, length, span):
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
def sam_frequent_tree(states, edges, state, num_nodes, max_depth):
    """Top continuation prefixes below `state` by occurrence count, best first (index/best_first.py):
    (tokens [m] int32, parents [m] int32), m <= num_nodes, parents[i] < i, -1 = child of the root.
    A prefix's count is that of the state it reaches from `state`."""
    out_tok, out_par, cand, taken = tree_buffers(num_nodes)
    kid_tok = np.empty(num_nodes, dtype=np.int32)
    kid_dst = np.empty(num_nodes, dtype=np.int32)
    n_cand, m, node_state, depth = 0, 0, state, 0
    while m < num_nodes:
        # 1) push the children of node m - 1, just taken (first: of the root), unless at max depth
        if depth < max_depth:
            for j in range(sam_topk_children(states, edges, node_state, num_nodes - m, kid_tok, kid_dst)):
                n_cand = tree_push(cand, n_cand, states[kid_dst[j], COUNT], kid_dst[j], kid_tok[j], m - 1, depth + 1)
        # 2) take the most frequent candidate
        best = tree_take(cand, taken, n_cand, out_tok, out_par, m)
        if best < 0:
            break
        node_state, depth = cand[REF, best], cand[DEPTH, best]
        m += 1
    return out_tok[:m], out_par[:m]


# ---------------------------------------------------------------------------------------------
# Validation of untrusted arrays

_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise UserError(f"corrupt suffix automaton: {what}: rebuild the store with `samctl build`")


def _take(arrays: dict[str, np.ndarray], name: str, dtype: np.dtype, ndim: int, cols: int = 0) -> np.ndarray:
    _check(name in arrays, f"array {name!r} is missing")
    a = np.asarray(arrays[name])
    _check(a.dtype == dtype, f"array {name!r} has dtype {a.dtype}, expected {dtype}")
    _check(a.ndim == ndim, f"array {name!r} has shape {a.shape}")
    if cols:
        _check(a.shape[1] == cols, f"array {name!r} has shape {a.shape}, expected [*, {cols}]")
    _check(a.flags.c_contiguous, f"array {name!r} is not contiguous")
    return a


_PROBLEMS = (
    "",
    "bad root state",
    "suffix link out of range",
    "suffix link does not shorten",
    "end position outside the token buffer",
    "negative count",
    "inline edge out of range",
    "edge chain head out of range",
    "edge out of range",
    "edge chain does not descend",
    "hash slot out of range",
    "hash table entry count",
    "token below the separator",
)


@njit(cache=True)
def _check_kernel(states, edges, slots, buf, links):
    """0 if the arrays are safe for every kernel, else an index into _PROBLEMS: every index a kernel
    follows is range-checked; edge chains end (next < own index); hash probes end (entries = edges
    < slots); suffix-link walks are capped at #states. With `links`, also len[link[s]] < len[s],
    so link chains end at the root (a random gather, about 20 ns per state; the rest streams)."""
    n_states, n_edges, n_buf = states.shape[0], edges.shape[0], len(buf)
    if states[0, LEN] != 0 or states[0, LINK] != -1:
        return 1
    # the gather reads a compact copy of the lengths (4 bytes per state, mostly in cache)
    # rather than the 32-byte records: several times faster on a large automaton
    length = np.empty(n_states if links else 0, dtype=np.int32)
    for s in range(len(length)):
        length[s] = states[s, LEN]
    for s in range(n_states):
        link = states[s, LINK]
        if s > 0:
            if link < 0 or link >= n_states:
                return 2
            if links and length[link] >= length[s]:
                return 3
        if not (-1 <= states[s, FIRST_END] < n_buf and -1 <= states[s, LAST_END] < n_buf):
            return 4
        if states[s, COUNT] < 0:
            return 5
        tok = states[s, EDGE_TOK]
        if tok < -1 or (tok >= 0 and not 0 <= states[s, EDGE_DST] < n_states):
            return 6
        if not -1 <= states[s, HEAD] < n_edges:
            return 7
    for e in range(n_edges):
        if not (0 <= edges[e, E_SRC] < n_states and edges[e, E_TOK] >= 0 and 0 <= edges[e, E_DST] < n_states):
            return 8
        if not -1 <= edges[e, E_NEXT] < e:
            return 9
    used = 0
    for i in range(len(slots)):
        if slots[i] >= 0:
            used += 1
        if not -1 <= slots[i] < n_edges:
            return 10
    if used != n_edges:
        return 11
    for i in range(n_buf):
        if buf[i] < SEP:
            return 12
    return 0


def _validate(states: np.ndarray, edges: np.ndarray, slots: np.ndarray, buf: np.ndarray, meta: np.ndarray,
              check_links: bool) -> None:
    n_states, n_edges, n_slots, n_buf = len(states), len(edges), len(slots), len(buf)
    _check(meta.shape == (N_META,), f"meta has shape {meta.shape}")
    _check((meta[M_STATES], meta[M_EDGES], meta[M_BUF]) == (n_states, n_edges, n_buf),
           "meta counters disagree with the array lengths")
    _check(n_states >= 1, "no root state")
    _check(0 <= meta[M_LAST] < n_states, "last state out of range")
    _check(n_slots >= 2 * n_edges and n_slots > 0 and n_slots & (n_slots - 1) == 0, "hash table size")
    problem = _check_kernel(states, edges, slots, buf, check_links)
    _check(problem == 0, _PROBLEMS[problem])


# ---------------------------------------------------------------------------------------------
# The stateful wrapper


class KernelArrays(NamedTuple):
    """What the query kernels take; valid until the next `extend`/`end_document`."""

    states: np.ndarray  # [S', 8] int32 (capacity may exceed num_states)
    edges: np.ndarray  # [E', 4] int32
    slots: np.ndarray  # [H] int32
    tokens: np.ndarray  # [T'] int32
    n_tokens: int  # used length of `tokens`
    end_col: int  # FIRST_END or LAST_END, per `occurrence`


_NO_POINTER = np.zeros(0, dtype=np.int64)
_NO_OWN = np.zeros(0, dtype=np.int32)


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, int(n - 1).bit_length())


def _grown(a: np.ndarray, used: int, need: int) -> np.ndarray:
    out = np.empty((max(need, len(a) * 3 // 2),) + a.shape[1:], dtype=a.dtype)
    out[:used] = a[:used]
    return out


def checked_corpus(tokens: np.ndarray, doc_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Documents as `build` and `appended` (and NgramTable.build) take them: tokens [n] int32 >= 0 and doc_offsets
    [d+1] int64 rising from 0 to n, both contiguous; a UserError otherwise."""
    tokens = np.ascontiguousarray(tokens)
    doc_offsets = np.ascontiguousarray(doc_offsets, dtype=np.int64)
    if tokens.ndim != 1 or tokens.dtype != np.int32:
        raise UserError(f"tokens must be a 1-D int32 array, got {tokens.dtype} {tokens.shape}")
    n = len(tokens)
    if n and int(tokens.min()) < 0:
        raise UserError("token ids must be >= 0")
    if len(doc_offsets) < 1 or doc_offsets[0] != 0 or doc_offsets[-1] != n or np.any(np.diff(doc_offsets) < 0):
        raise UserError("doc_offsets must rise from 0 to len(tokens)")
    return tokens, doc_offsets


class SuffixAutomaton:
    """Static (`build`) or incremental (`empty`); see the module doc."""

    def __init__(self, states, edges, slots, buf, meta, occurrence: str, static: bool) -> None:
        if occurrence not in OCCURRENCES:
            raise UserError(f"occurrence must be one of {OCCURRENCES}, got {occurrence!r}")
        self._states, self._edges, self._slots, self._buf = states, edges, slots, buf
        self._meta = meta
        self.occurrence = occurrence
        self.static = static
        self._end_col = FIRST_END if occurrence == "first" else LAST_END
        self._scratch = (np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64))  # extend_tracking's

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def build(cls, tokens: np.ndarray, doc_offsets: np.ndarray, occurrence: str = "first",
              watch: Callable[["SuffixAutomaton"], ContextManager[Any]] | None = None) -> "SuffixAutomaton":
        """Static automaton over documents tokens[doc_offsets[i]:doc_offsets[i+1]] (tokens [n]
        int32 >= 0, doc_offsets [d+1] int64 rising from 0 to n); either `occurrence` works later.
        `watch(sam)` is entered around the (GIL-free) kernels: another thread may read
        `sam.num_tokens` to report progress."""
        tokens, doc_offsets = checked_corpus(tokens, doc_offsets)
        n = len(tokens)
        if n + len(doc_offsets) >= 2**30:
            raise UserError(f"{n} tokens is too many for one automaton (int32 ids): split the corpus")
        # States <= 2n+1 (generalized SAM over a trie of <= n+1 nodes); np.empty only maps the
        # pages, which become resident when a state is written, so the bound costs no memory.
        # Chained (second and later) edges measured 0.5-0.65 per token on code: room for 0.75
        # (untouched rows stay unmapped), and a hash table for that at load <= 1/2.
        sam = cls._allocate(2 * n + 2, 3 * n // 4, n + len(doc_offsets), occurrence, static=True)
        with watch(sam) if watch is not None else nullcontext():
            sam._insert(tokens, doc_offsets, close_docs=True, online=False)
            _propagate_offline(sam._states, sam._meta[M_STATES])
        return sam

    def appended(self, tokens: np.ndarray, doc_offsets: np.ndarray) -> "SuffixAutomaton":
        """A new static automaton over this one's documents then the new ones (shapes as in
        `build`), equal state for state to `build` over all of them, without re-reading the old.

        The old arrays (maybe read-only memmaps) are copied once with room for the new tokens. Old
        states hold total counts, so a clone copies the total of the state it splits; the new end
        positions are counted apart, then added along the suffix links above them
        (`_propagate_appended`)."""
        tokens, doc_offsets = checked_corpus(tokens, doc_offsets)
        n = len(tokens)
        meta = self._meta.copy()
        if meta[M_DOC_OPEN]:
            raise UserError("this automaton has an open document: end_document() before appending")
        n_states, n_edges, n_buf = int(meta[M_STATES]), int(meta[M_EDGES]), int(meta[M_BUF])
        if n_buf + n + len(doc_offsets) >= 2**30:
            raise UserError(f"{n_buf + n} tokens is too many for one automaton (int32 ids): split the corpus")
        states = np.empty((n_states + 2 * n + 2, N_STATE_COLS), dtype=np.int32)
        states[:n_states] = self._states[:n_states]
        edges = np.empty((max(16, n_edges + 3 * n // 4), N_EDGE_COLS), dtype=np.int32)
        edges[:n_edges] = self._edges[:n_edges]
        need_slots = _pow2_at_least(2 * len(edges))
        slots = (_rehash(edges, n_edges, need_slots) if need_slots > len(self._slots)
                 else np.array(self._slots, dtype=np.int32))
        buf = np.empty(n_buf + n + len(doc_offsets), dtype=np.int32)
        buf[:n_buf] = self._buf[:n_buf]
        sam = SuffixAutomaton(states, edges, slots, buf, meta, self.occurrence, static=True)
        own = np.zeros(len(states), dtype=np.int32)  # states never regrow: 2 per token reserved above
        sam._insert(tokens, doc_offsets, close_docs=True, online=False, own=own)
        _propagate_appended(sam._states, own, int(sam._meta[M_STATES]))
        return sam

    @classmethod
    def empty(cls, capacity: int = 1024, occurrence: str = "first") -> "SuffixAutomaton":
        capacity = max(16, int(capacity))
        return cls._allocate(2 * capacity + 2, 2 * capacity, capacity + 2, occurrence, static=False)

    @classmethod
    def _allocate(cls, n_states: int, n_edges: int, n_buf: int, occurrence: str, static: bool) -> "SuffixAutomaton":
        n_edges = max(16, n_edges)
        states = np.empty((max(16, n_states), N_STATE_COLS), dtype=np.int32)
        edges = np.empty((n_edges, N_EDGE_COLS), dtype=np.int32)
        slots = np.full(_pow2_at_least(2 * n_edges), -1, dtype=np.int32)
        buf = np.empty(max(16, n_buf), dtype=np.int32)
        meta = np.zeros(N_META, dtype=np.int64)
        _new_state(states, meta, 0, -1, -1)
        return cls(states, edges, slots, buf, meta, occurrence, static)

    def _insert(self, tokens: np.ndarray, doc_offsets: np.ndarray, close_docs: bool, online: bool,
                pointer: np.ndarray = _NO_POINTER, own: np.ndarray = _NO_OWN) -> None:
        d, i, n_docs = 0, 0, len(doc_offsets) - 1
        while True:
            d, i = _insert(self._states, self._edges, self._slots, self._buf, self._meta,
                           tokens, doc_offsets, d, i, close_docs, online, pointer, own)
            if d == n_docs:
                return
            self._reserve()

    def _reserve(self) -> None:
        meta = self._meta
        n_states, n_edges, n_buf = int(meta[M_STATES]), int(meta[M_EDGES]), int(meta[M_BUF])
        need_edges = n_edges + int(_edge_headroom(self._states, meta))
        if n_states + 2 > len(self._states):
            self._states = _grown(self._states, n_states, n_states + 2)
        if need_edges > len(self._edges):
            self._edges = _grown(self._edges, n_edges, need_edges)
        if 2 * need_edges > len(self._slots):
            self._slots = _rehash(self._edges, n_edges, _pow2_at_least(max(2 * need_edges, 2 * len(self._slots))))
        if n_buf + 2 > len(self._buf):
            self._buf = _grown(self._buf, n_buf, n_buf + 2)

    def _growing(self, tokens: np.ndarray) -> np.ndarray:
        if self.static:
            raise UserError("this suffix automaton is static: use SuffixAutomaton.empty() to grow one")
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(tokens) and int(tokens.min()) < 0:
            raise UserError("token ids must be >= 0")
        return tokens

    def extend(self, tokens: np.ndarray) -> None:
        tokens = self._growing(tokens)
        self._insert(tokens, np.array([0, len(tokens)], dtype=np.int64), close_docs=False, online=True)

    def extend_tracking(self, tokens: np.ndarray, state: int, length: int) -> tuple[int, int]:
        """`extend`, moving the match (state, length) over each token just before inserting it;
        returns the moved match, which is then always an earlier occurrence of the text's suffix
        (so it has a continuation). One kernel call for the whole run of tokens."""
        # Called once per decode step: scratch arrays are reused rather than allocated.
        pointer, offsets = self._scratch
        tokens = self._growing(tokens)
        pointer[0], pointer[1] = state, length
        offsets[1] = len(tokens)
        self._insert(tokens, offsets, close_docs=False, online=True, pointer=pointer)
        return int(pointer[0]), int(pointer[1])

    def end_document(self) -> None:
        tokens = self._growing(np.zeros(0, dtype=np.int32))  # no tokens: the kernel only closes an open document
        self._insert(tokens, np.zeros(2, dtype=np.int64), close_docs=True, online=True)

    # -- queries -----------------------------------------------------------------------------

    def step(self, state: int, length: int, token: int) -> tuple[int, int]:
        return sam_step(self._states, self._edges, self._slots, state, length, token)

    def match(self, tokens: np.ndarray) -> tuple[int, int]:
        return sam_walk(self._states, self._edges, self._slots, 0, 0, np.asarray(tokens, dtype=np.int32))

    def walk(self, state: int, length: int, tokens: np.ndarray) -> tuple[int, int]:
        return sam_walk(self._states, self._edges, self._slots, state, length, np.asarray(tokens, dtype=np.int32))

    def continuation(self, state: int, n: int) -> np.ndarray:
        """Up to n tokens ([m] int32) after the first (or latest) occurrence of state, within its
        document: a view into the token buffer, copy it before modifying."""
        start, stop = sam_continuation_span(self._states, self._buf, self._meta[M_BUF], state, n, self._end_col)
        return self._buf[start:stop]

    def topk_next(self, state: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k most frequent next tokens of state and their counts ([m] int32 each)."""
        return sam_topk_next(self._states, self._edges, state, k)

    def length(self, state: int) -> int:
        return int(self._states[state, LEN])

    def count(self, state: int) -> int:
        return int(self._states[state, COUNT])

    def end_position(self, state: int) -> int:
        """Buffer position of the last token of the occurrence `continuation` uses (-1: root)."""
        return int(self._states[state, self._end_col])

    @property
    def kernel_arrays(self) -> KernelArrays:
        return KernelArrays(self._states, self._edges, self._slots, self._buf, int(self._meta[M_BUF]), self._end_col)

    @property
    def num_states(self) -> int:
        return int(self._meta[M_STATES])

    @property
    def num_edges(self) -> int:
        return edge_count(self._states, self._meta)

    @property
    def num_tokens(self) -> int:
        return int(self._meta[M_TOKENS])

    @property
    def num_documents(self) -> int:
        """Non-empty documents."""
        return int(self._meta[M_DOCS])

    @property
    def tokens(self) -> np.ndarray:
        """The token buffer: documents each followed by -1 ([T] int32 view)."""
        return self._buf[: int(self._meta[M_BUF])]

    # -- arrays ------------------------------------------------------------------------------

    def to_arrays(self) -> dict[str, np.ndarray]:
        meta = self._meta
        return {"states": self._states[: int(meta[M_STATES])], "edges": self._edges[: int(meta[M_EDGES])],
                "slots": self._slots, "tokens": self._buf[: int(meta[M_BUF])], "meta": meta.copy()}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], occurrence: str = "first",
                    check_links: bool = True) -> "SuffixAutomaton":
        """Static automaton over `to_arrays()` output (zero-copy; may be read-only memmaps).

        The arrays are untrusted: inconsistent ones raise UserError. check_links adds
        len[link[s]] < len[s], a random gather that is most of the load time (~0.25 s at 8M
        tokens); skipping it is safe: link walks are capped, and a bad link only yields bad
        drafts, which verification rejects."""
        states = _take(arrays, "states", _I32, 2, N_STATE_COLS)
        edges = _take(arrays, "edges", _I32, 2, N_EDGE_COLS)
        slots = _take(arrays, "slots", _I32, 1)
        buf = _take(arrays, "tokens", _I32, 1)
        meta = _take(arrays, "meta", _I64, 1)
        _validate(states, edges, slots, buf, meta, check_links)
        return cls(states, edges, slots, buf, meta.copy(), occurrence, static=True)
