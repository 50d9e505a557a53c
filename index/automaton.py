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

from typing import NamedTuple

import numpy as np
from numba import njit

from index.errors import UserError

SEP = -1  # separator after each document in the token buffer; never a transition label

# Columns of `states`.
LEN, LINK, FIRST_END, LAST_END, COUNT, EDGE_TOK, EDGE_DST, HEAD = range(8)
N_STATE_COLS = 8
# Columns of `edges`.
E_SRC, E_TOK, E_DST, E_NEXT = range(4)
N_EDGE_COLS = 4
# Entries of `meta`.
M_STATES, M_EDGES, M_BUF, M_TOKENS, M_DOCS, M_LAST, M_DOC_OPEN = range(7)
N_META = 8

OCCURRENCES = ("first", "latest")
_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)


# ---------------------------------------------------------------------------------------------
# Kernels: transitions
# ---------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _hash_slot(state, token, mask):
    key = (np.uint64(state) << np.uint64(32)) | np.uint64(token)
    h = key * _HASH_MUL
    h ^= h >> np.uint64(29)
    return np.int64(h & np.uint64(mask))


@njit(cache=True)
def _find(states, edges, slots, state, token):
    """Destination of the edge state --token-->, or -1. O(1) expected."""
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
    """Point the existing edge state --token--> at dst."""
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
    """Add the edge state --token--> dst (absent before); returns (edges, slots), maybe regrown."""
    if states[state, EDGE_TOK] < 0:
        states[state, EDGE_TOK] = token
        states[state, EDGE_DST] = dst
        return edges, slots
    e = meta[M_EDGES]
    if e == edges.shape[0]:
        grown = np.empty((max(16, edges.shape[0] * 3 // 2), N_EDGE_COLS), dtype=np.int32)
        grown[:e] = edges[:e]
        edges = grown
    if 2 * (e + 1) > len(slots):  # keep load factor <= 1/2
        slots = _rehash(edges, e, 2 * len(slots))
    edges[e, E_SRC] = state
    edges[e, E_TOK] = token
    edges[e, E_DST] = dst
    edges[e, E_NEXT] = states[state, HEAD]
    states[state, HEAD] = e
    meta[M_EDGES] = e + 1
    _slots_insert(edges, slots, e)
    return edges, slots


# ---------------------------------------------------------------------------------------------
# Kernels: construction
# ---------------------------------------------------------------------------------------------


@njit(cache=True)
def _new_state(states, meta, length, link, end):
    s = meta[M_STATES]
    if s == states.shape[0]:
        grown = np.empty((max(16, s * 3 // 2), N_STATE_COLS), dtype=np.int32)
        grown[:s] = states[:s]
        states = grown
    states[s, LEN] = length
    states[s, LINK] = link
    states[s, FIRST_END] = end
    states[s, LAST_END] = end
    states[s, COUNT] = 0
    states[s, EDGE_TOK] = -1
    states[s, EDGE_DST] = -1
    states[s, HEAD] = -1
    meta[M_STATES] = s + 1
    return s, states


@njit(cache=True)
def _clone(states, edges, slots, meta, q, length, online):
    """New state with q's link, first end and out-edges, and the given length.

    Online (incremental) counts are totals, so the clone copies q's count and last end (its
    end positions so far are q's); offline counts are own counts, so the clone starts empty.
    """
    c, states = _new_state(states, meta, length, states[q, LINK], states[q, FIRST_END])
    if online:
        states[c, COUNT] = states[q, COUNT]
        states[c, LAST_END] = states[q, LAST_END]
    else:
        states[c, LAST_END] = -1
    if states[q, EDGE_TOK] >= 0:
        states[c, EDGE_TOK] = states[q, EDGE_TOK]
        states[c, EDGE_DST] = states[q, EDGE_DST]
    e = states[q, HEAD]
    while e >= 0:
        edges, slots = _add_edge(states, edges, slots, meta, c, edges[e, E_TOK], edges[e, E_DST])
        e = edges[e, E_NEXT]
    return c, states, edges, slots


@njit(cache=True)
def _split(states, edges, slots, meta, p, token, q, online):
    """Clone q at length len[p]+1 and move the edges p' --token--> q (p' on p's link chain) to it."""
    c, states, edges, slots = _clone(states, edges, slots, meta, q, states[p, LEN] + 1, online)
    states[q, LINK] = c
    while p >= 0 and _find(states, edges, slots, p, token) == q:
        _redirect(states, edges, slots, p, token, c)
        p = states[p, LINK]
    return c, states, edges, slots


@njit(cache=True)
def _sam_add(states, edges, slots, meta, last, token, pos, online):
    """Generalized-SAM extension of state `last` by `token`, which sits at buffer position pos.

    Returns (the state of the extended prefix, states, edges, slots). When the transition
    already exists (the prefix occurred before, possibly in another document) no new state is
    made, except a clone when the existing target is longer than len[last]+1.
    """
    q = _find(states, edges, slots, last, token)
    if q >= 0:
        if states[last, LEN] + 1 == states[q, LEN]:
            return q, states, edges, slots
        return _split(states, edges, slots, meta, last, token, q, online)
    cur, states = _new_state(states, meta, states[last, LEN] + 1, 0, pos)
    p = last
    while p >= 0:
        q = _find(states, edges, slots, p, token)
        if q >= 0:
            break
        edges, slots = _add_edge(states, edges, slots, meta, p, token, cur)
        p = states[p, LINK]
    if p < 0:
        return cur, states, edges, slots
    if states[p, LEN] + 1 == states[q, LEN]:
        states[cur, LINK] = q
        return cur, states, edges, slots
    c, states, edges, slots = _split(states, edges, slots, meta, p, token, q, online)
    states[cur, LINK] = c
    return cur, states, edges, slots


@njit(cache=True)
def _propagate_offline(states, n_states):
    """Own counts/last ends -> totals: add each state into its link by decreasing length.

    Invariant used: len[link[s]] < len[s], so a counting sort by length orders children first.
    """
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
def _build_kernel(states, edges, slots, buf, meta, tokens, doc_offsets):
    pos = 0
    for d in range(len(doc_offsets) - 1):
        if doc_offsets[d + 1] == doc_offsets[d]:
            continue
        last = 0
        for i in range(doc_offsets[d], doc_offsets[d + 1]):
            token = tokens[i]
            buf[pos] = token
            last, states, edges, slots = _sam_add(states, edges, slots, meta, last, token, pos, False)
            states[last, COUNT] += 1
            states[last, LAST_END] = pos
            pos += 1
        buf[pos] = SEP
        pos += 1
        meta[M_DOCS] += 1
    meta[M_BUF] = pos
    meta[M_TOKENS] = len(tokens)
    _propagate_offline(states, meta[M_STATES])
    return states, edges, slots


@njit(cache=True)
def _extend_kernel(states, edges, slots, buf, meta, tokens):
    """Append tokens to the open document; counts and last ends stay exact online.

    Each insert walks the new state's suffix-link chain (+1 count, last end = pos): O(chain)
    per token, short on natural text (a long run of one repeated token makes it linear).
    """
    last = meta[M_LAST]
    pos = meta[M_BUF]
    if len(tokens) > 0 and meta[M_DOC_OPEN] == 0:
        meta[M_DOC_OPEN] = 1
        meta[M_DOCS] += 1
    for token in tokens:
        if pos == len(buf):
            grown = np.empty(max(16, len(buf) * 2), dtype=np.int32)
            grown[:pos] = buf[:pos]
            buf = grown
        buf[pos] = token
        last, states, edges, slots = _sam_add(states, edges, slots, meta, last, token, pos, True)
        s = last
        while s >= 0:
            states[s, COUNT] += 1
            states[s, LAST_END] = pos
            s = states[s, LINK]
        pos += 1
    meta[M_BUF] = pos
    meta[M_LAST] = last
    meta[M_TOKENS] += len(tokens)
    return states, edges, slots, buf


# ---------------------------------------------------------------------------------------------
# Kernels: queries (pure; callable directly by decoders on `SuffixAutomaton.kernel_arrays`)
# ---------------------------------------------------------------------------------------------


@njit(cache=True)
def sam_step(states, edges, slots, state, length, token):
    """Match (state, length) of text s -> match of s + token.

    Follows suffix links until a transition on token exists; the new length is
    min(length, len[state]) + 1 at that state, or (0, 0) at the root.
    """
    while True:
        d = _find(states, edges, slots, state, token)
        if d >= 0:
            return d, min(length, states[state, LEN]) + 1
        if state == 0:
            return 0, 0
        state = states[state, LINK]
        length = states[state, LEN]


@njit(cache=True)
def sam_match(states, edges, slots, tokens):
    state = 0
    length = 0
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
def _topk_children(states, edges, state, k, out_tok, out_dst):
    """Write the (up to) k out-edges of state with the largest destination counts into out_*,
    by count descending then token ascending; returns how many. O(degree * k)."""
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
    m = _topk_children(states, edges, state, k, out_tok, out_dst)
    counts = np.empty(m, dtype=np.int32)
    for i in range(m):
        counts[i] = states[out_dst[i], COUNT]
    return out_tok[:m].copy(), counts


@njit(cache=True)
def _heap_better(prob, seq, a, b):
    return prob[a] > prob[b] or (prob[a] == prob[b] and seq[a] < seq[b])


@njit(cache=True)
def _heap_push(heap, size, prob, seq, item):
    heap[size] = item
    i = size
    while i > 0:
        parent = (i - 1) // 2
        if not _heap_better(prob, seq, heap[i], heap[parent]):
            break
        heap[i], heap[parent] = heap[parent], heap[i]
        i = parent
    return size + 1


@njit(cache=True)
def _heap_pop(heap, size, prob, seq):
    top = heap[0]
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        best = i
        for child in (2 * i + 1, 2 * i + 2):
            if child < size and _heap_better(prob, seq, heap[child], heap[best]):
                best = child
        if best == i:
            break
        heap[i], heap[best] = heap[best], heap[i]
        i = best
    return top, size


@njit(cache=True)
def sam_tree_draft(states, edges, state, max_nodes, k):
    """Best-first draft tree below `state` (SAM-Decoding sam_only).

    A candidate is (node state, token, parent node, depth) with path probability
    P(child) = P(parent) * count[child] / count[parent state]; the children of a node are its
    top-k out-edges by count. Candidates are taken best first (ties: first pushed); a candidate
    whose depth already holds k nodes is dropped. Stops at max_nodes - 1 nodes (the root, the
    current token, counts as one) or when no candidate is left.
    Returns (tokens [m] int32, parents [m] int32) in creation order; parents[i] < i, -1 = root.
    """
    m_max = max(max_nodes - 1, 0)
    out_tok = np.empty(m_max, dtype=np.int32)
    out_par = np.empty(m_max, dtype=np.int32)
    if m_max == 0 or k <= 0:
        return out_tok, out_par
    cap = k * (m_max + 1)
    prob = np.empty(cap, dtype=np.float64)
    seq = np.arange(cap)  # candidate id = push order, the tie breaker
    c_state = np.empty(cap, dtype=np.int32)
    c_tok = np.empty(cap, dtype=np.int32)
    c_par = np.empty(cap, dtype=np.int32)
    c_depth = np.empty(cap, dtype=np.int32)
    heap = np.empty(cap, dtype=np.int64)
    per_depth = np.zeros(m_max + 1, dtype=np.int32)
    kid_tok = np.empty(k, dtype=np.int32)
    kid_dst = np.empty(k, dtype=np.int32)
    n_cand = 0
    size = 0
    node_state = state
    node_prob = 1.0
    node = -1
    depth = 0
    m = 0
    while True:
        # 1) push the children of the node just created (first: of the root)
        parent_cnt = states[node_state, COUNT]
        n_kids = _topk_children(states, edges, node_state, k, kid_tok, kid_dst)
        for j in range(n_kids):
            c = n_cand
            n_cand += 1
            ratio = states[kid_dst[j], COUNT] / parent_cnt if parent_cnt > 0 else 0.0
            prob[c] = node_prob * ratio
            c_state[c] = kid_dst[j]
            c_tok[c] = kid_tok[j]
            c_par[c] = node
            c_depth[c] = depth
            size = _heap_push(heap, size, prob, seq, c)
        # 2) pop the best candidate whose depth has room
        found = False
        while size > 0 and not found:
            c, size = _heap_pop(heap, size, prob, seq)
            found = per_depth[c_depth[c]] < k
        if not found:
            break
        per_depth[c_depth[c]] += 1
        out_tok[m] = c_tok[c]
        out_par[m] = c_par[c]
        node = m
        m += 1
        if m == m_max:
            break
        node_state = c_state[c]
        node_prob = prob[c]
        depth = c_depth[c] + 1
    return out_tok[:m], out_par[:m]


# ---------------------------------------------------------------------------------------------
# Validation of untrusted arrays
# ---------------------------------------------------------------------------------------------

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


def _validate(states: np.ndarray, edges: np.ndarray, slots: np.ndarray, buf: np.ndarray, meta: np.ndarray) -> None:
    """Cheap vectorized checks that make every kernel read in bounds and terminate."""
    n_states, n_edges, n_slots, n_buf = len(states), len(edges), len(slots), len(buf)
    _check(meta.shape == (N_META,), f"meta has shape {meta.shape}")
    _check(
        (meta[M_STATES], meta[M_EDGES], meta[M_BUF]) == (n_states, n_edges, n_buf),
        "meta counters disagree with the array lengths",
    )
    _check(n_states >= 1, "no root state")
    _check(0 <= meta[M_LAST] < n_states, "last state out of range")
    _check(n_slots >= 2 * n_edges and n_slots > 0 and n_slots & (n_slots - 1) == 0, "hash table size")
    length, link = states[:, LEN], states[:, LINK]
    _check(length[0] == 0 and link[0] == -1, "bad root state")
    rest = link[1:]
    _check(bool(np.all((rest >= 0) & (rest < n_states))), "suffix link out of range")
    # strictly decreasing lengths along links: every link chain ends at the root
    _check(bool(np.all(length[rest] < length[1:])), "suffix link does not shorten")
    for col in (FIRST_END, LAST_END):
        end = states[:, col]
        _check(bool(np.all((end >= -1) & (end < n_buf))), "end position outside the token buffer")
    _check(bool(np.all(states[:, COUNT] >= 0)), "negative count")
    tok, dst, head = states[:, EDGE_TOK], states[:, EDGE_DST], states[:, HEAD]
    _check(bool(np.all((tok >= -1) & ((tok < 0) | ((dst >= 0) & (dst < n_states))))), "inline edge out of range")
    _check(bool(np.all((head >= -1) & (head < n_edges))), "edge chain head out of range")
    if n_edges:
        _check(bool(np.all((edges[:, E_SRC] >= 0) & (edges[:, E_SRC] < n_states))), "edge source out of range")
        _check(bool(np.all(edges[:, E_TOK] >= 0)), "negative edge token")
        _check(bool(np.all((edges[:, E_DST] >= 0) & (edges[:, E_DST] < n_states))), "edge target out of range")
        nxt = edges[:, E_NEXT]
        _check(bool(np.all((nxt >= -1) & (nxt < np.arange(n_edges)))), "edge chain does not descend")
    _check(bool(np.all((slots >= -1) & (slots < n_edges))), "hash slot out of range")
    _check(int(np.count_nonzero(slots < 0)) == n_slots - n_edges, "hash table entry count")
    _check(bool(np.all(buf >= SEP)), "token below the separator")


# ---------------------------------------------------------------------------------------------
# The stateful wrapper
# ---------------------------------------------------------------------------------------------


class KernelArrays(NamedTuple):
    """What the query kernels take; valid until the next `extend`/`end_document`."""

    states: np.ndarray  # [S', 8] int32 (capacity may exceed num_states)
    edges: np.ndarray  # [E', 4] int32
    slots: np.ndarray  # [H] int32
    tokens: np.ndarray  # [T'] int32
    n_tokens: int  # used length of `tokens`
    end_col: int  # FIRST_END or LAST_END, per `occurrence`


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, int(n - 1).bit_length())


class SuffixAutomaton:
    """Static (`build`) or incremental (`empty`) generalized suffix automaton; see the module doc."""

    def __init__(self, states, edges, slots, buf, meta, occurrence: str, static: bool) -> None:
        if occurrence not in OCCURRENCES:
            raise UserError(f"occurrence must be one of {OCCURRENCES}, got {occurrence!r}")
        self._states, self._edges, self._slots, self._buf = states, edges, slots, buf
        self._meta = meta
        self.occurrence = occurrence
        self.static = static
        self._end_col = FIRST_END if occurrence == "first" else LAST_END

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def build(cls, tokens: np.ndarray, doc_offsets: np.ndarray, occurrence: str = "first") -> "SuffixAutomaton":
        """Static automaton over documents tokens[doc_offsets[i]:doc_offsets[i+1]].

        tokens: [n] int32 >= 0, all documents concatenated without separators
        doc_offsets: [d+1] int64, non-decreasing, from 0 to n
        Both first and latest end positions are computed, so either `occurrence` works.
        """
        tokens = np.ascontiguousarray(tokens)
        doc_offsets = np.ascontiguousarray(doc_offsets, dtype=np.int64)
        if tokens.ndim != 1 or tokens.dtype != np.int32:
            raise UserError(f"tokens must be a 1-D int32 array, got {tokens.dtype} {tokens.shape}")
        n = len(tokens)
        if n and int(tokens.min()) < 0:
            raise UserError("token ids must be >= 0")
        if len(doc_offsets) < 1 or doc_offsets[0] != 0 or doc_offsets[-1] != n or np.any(np.diff(doc_offsets) < 0):
            raise UserError("doc_offsets must rise from 0 to len(tokens)")
        if n + len(doc_offsets) >= 2**30:
            raise UserError(f"{n} tokens is too many for one automaton (int32 ids): split the corpus")
        n_docs = len(doc_offsets) - 1
        # States <= 2n+1 (generalized SAM over a trie of <= n+1 nodes); np.empty only maps the
        # pages, which become resident when a state is written, so the bound costs no memory.
        states = np.empty((2 * n + 2, N_STATE_COLS), dtype=np.int32)
        edges = np.empty((max(16, n // 2), N_EDGE_COLS), dtype=np.int32)
        slots = np.full(_pow2_at_least(max(16, n)), -1, dtype=np.int32)
        buf = np.empty(n + n_docs, dtype=np.int32)
        meta = np.zeros(N_META, dtype=np.int64)
        _, states = _new_state(states, meta, 0, -1, -1)
        states, edges, slots = _build_kernel(states, edges, slots, buf, meta, tokens, doc_offsets)
        return cls(states, edges, slots, buf, meta, occurrence, static=True)

    @classmethod
    def empty(cls, capacity: int = 1024, occurrence: str = "first") -> "SuffixAutomaton":
        """Incremental automaton with room for `capacity` tokens before it regrows."""
        capacity = max(16, int(capacity))
        states = np.empty((2 * capacity + 2, N_STATE_COLS), dtype=np.int32)
        edges = np.empty((capacity, N_EDGE_COLS), dtype=np.int32)
        slots = np.full(_pow2_at_least(2 * capacity), -1, dtype=np.int32)
        buf = np.empty(capacity + 1, dtype=np.int32)
        meta = np.zeros(N_META, dtype=np.int64)
        _, states = _new_state(states, meta, 0, -1, -1)
        return cls(states, edges, slots, buf, meta, occurrence, static=False)

    def extend(self, tokens: np.ndarray) -> None:
        """Append tokens ([k] int32 >= 0) to the current document."""
        if self.static:
            raise UserError("this suffix automaton is static: use SuffixAutomaton.empty() to grow one")
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(tokens) and int(tokens.min()) < 0:
            raise UserError("token ids must be >= 0")
        self._states, self._edges, self._slots, self._buf = _extend_kernel(
            self._states, self._edges, self._slots, self._buf, self._meta, tokens
        )

    def end_document(self) -> None:
        """Close the current document: the next `extend` starts a new one."""
        if self.static:
            raise UserError("this suffix automaton is static: use SuffixAutomaton.empty() to grow one")
        meta = self._meta
        if not meta[M_DOC_OPEN]:
            return
        pos = int(meta[M_BUF])
        if pos == len(self._buf):
            self._buf = np.concatenate([self._buf, np.empty(len(self._buf), dtype=np.int32)])
        self._buf[pos] = SEP
        meta[M_BUF] = pos + 1
        meta[M_LAST] = 0
        meta[M_DOC_OPEN] = 0

    def finalize_counts(self) -> None:
        """Make `count` exact. A static automaton computes counts when built and an incremental
        one keeps them exact on every insert, so there is nothing left to do; callers that hold
        either kind may call it unconditionally."""

    # -- queries -----------------------------------------------------------------------------

    def step(self, state: int, length: int, token: int) -> tuple[int, int]:
        """Match (state, length) of a text -> the match of the text followed by token."""
        return sam_step(self._states, self._edges, self._slots, state, length, token)

    def match(self, tokens: np.ndarray) -> tuple[int, int]:
        """Longest suffix of tokens ([k] int32) found in one document: (state, length)."""
        return sam_match(self._states, self._edges, self._slots, np.asarray(tokens, dtype=np.int32))

    def continuation(self, state: int, n: int) -> np.ndarray:
        """Up to n tokens ([m] int32) after the first (or latest) occurrence of state.

        Stops at the end of that document; empty for the root. A view into the token buffer:
        copy it before modifying.
        """
        start, stop = sam_continuation_span(self._states, self._buf, self._meta[M_BUF], state, n, self._end_col)
        return self._buf[start:stop]

    def topk_next(self, state: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k most frequent next tokens of state and their counts ([m] int32 each), by count
        descending, then token ascending."""
        return sam_topk_next(self._states, self._edges, state, k)

    def tree_draft(self, state: int, max_nodes: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Best-first tree of at most max_nodes - 1 draft tokens below state; see sam_tree_draft.

        Returns (tokens [m] int32, parents [m] int32): creation order, parents[i] < i, -1 means
        a child of the root (the current token, not included).
        """
        return sam_tree_draft(self._states, self._edges, state, max_nodes, k)

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
        """All transitions: inline first edges plus the chained ones."""
        n = self.num_states
        return int(np.count_nonzero(self._states[:n, EDGE_TOK] >= 0)) + int(self._meta[M_EDGES])

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
        """Trimmed arrays that fully describe the automaton (views where possible)."""
        meta = self._meta
        return {
            "states": self._states[: int(meta[M_STATES])],
            "edges": self._edges[: int(meta[M_EDGES])],
            "slots": self._slots,
            "tokens": self._buf[: int(meta[M_BUF])],
            "meta": meta.copy(),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], occurrence: str = "first") -> "SuffixAutomaton":
        """Static automaton over `to_arrays()` output (zero-copy; arrays may be read-only memmaps).

        The arrays are untrusted: inconsistent ones raise UserError instead of letting a kernel
        read out of bounds or loop forever.
        """
        states = _take(arrays, "states", _I32, 2, N_STATE_COLS)
        edges = _take(arrays, "edges", _I32, 2, N_EDGE_COLS)
        slots = _take(arrays, "slots", _I32, 1)
        buf = _take(arrays, "tokens", _I32, 1)
        meta = _take(arrays, "meta", _I64, 1)
        _validate(states, edges, slots, buf, meta)
        return cls(states, edges, slots, buf, meta.copy(), occurrence, static=True)
