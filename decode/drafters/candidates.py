"""Kernels of the `adaptive` drafter: scored candidate trees from every source, merged and cut.

A candidate buffer holds draft nodes from several sources, one row each:
    tok [C] int32    the token
    par [C] int32    the row of its parent (-1: a child of the pending token t0), always < row
    prob [C] float64 estimated probability that the whole path to the node is accepted
    cell [C] int32   the calibration cell that priced the node's last edge
A source kernel appends its own best-first tree to the buffer and returns the new row count.

Path probabilities multiply per-edge acceptance estimates; an edge's estimate is the running mean
of its calibration cell (what verification accepted for edges of that source, effective match
length, continuation frequency and support), so P(path) = prod of cell means along it. Because
exactly one path of a tree is accepted, the expected accepted length of a tree is the sum of its
nodes' path probabilities. `select` keeps the nodes that maximise
    (1 + sum of kept path probabilities) / cost[kept]
where cost[n] is the relative time of verifying t0 plus n nodes (cost[0] = 1).

Cells: source x length bucket x frequency bucket x support bucket (see `cell_index`). Token
Recycle rows use the length bucket for the depth and the frequency bucket for the rank.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from samctl.index.automaton import COUNT, FIRST_END, LEN, LINK, sam_step, sam_topk_children
from samctl.index.ngram import ngram_find
from samctl.index.suffix_array import sa_children

SRC_DYNAMIC, SRC_STATIC, SRC_MEMORY, SRC_RECYCLE = range(4)
SOURCES = ("dynamic", "static", "memory", "recycle")
N_LEN, N_FREQ, N_SUPPORT = 8, 5, 3
N_CELLS = len(SOURCES) * N_LEN * N_FREQ * N_SUPPORT
_LEN_EDGES = (1, 2, 3, 4, 6, 9, 15)  # bucket b holds lengths in (edge[b-1], edge[b]]; 16+ is the last


@njit(cache=True)
def length_bucket(length):
    for b in range(len(_LEN_EDGES)):
        if length <= _LEN_EDGES[b]:
            return b
    return N_LEN - 1


@njit(cache=True)
def cell_index(source, length, freq, support):
    # freq in [0, 1] -> 5 equal buckets; support = occurrences of the matched context -> 1, 2-3, 4+
    f = min(int(freq * N_FREQ), N_FREQ - 1)
    s = 0 if support <= 1 else (1 if support <= 3 else 2)
    return ((source * N_LEN + length_bucket(length)) * N_FREQ + f) * N_SUPPORT + s


def prior_means() -> np.ndarray:
    """Starting estimate of every cell ([N_CELLS] float64), before any verification: the
    frequency (bucket middle) times a confidence that grows with the match length, lower for the
    static store (other text than this request) and for the memory of other requests. Token
    Recycle: the published chance that the r-th candidate is the target's choice."""
    prior = np.zeros(N_CELLS, dtype=np.float64)
    lengths = (1, 2, 3, 4, 5.5, 8, 12, 20)  # representative length of each bucket
    trust = {SRC_DYNAMIC: 1.0, SRC_STATIC: 0.7, SRC_MEMORY: 0.8}
    rank_accept = (0.55, 0.14, 0.07, 0.045, 0.03)
    for src in range(len(SOURCES)):
        for b, length in enumerate(lengths):
            for f in range(N_FREQ):
                for s in range(N_SUPPORT):
                    i = ((src * N_LEN + b) * N_FREQ + f) * N_SUPPORT + s
                    if src == SRC_RECYCLE:
                        prior[i] = rank_accept[f]
                    else:
                        confidence = 0.2 + 0.75 * (1.0 - np.exp(-length / 3.0))
                        prior[i] = trust[src] * (f + 0.5) / N_FREQ * confidence
    return prior


# -- best-first helpers: a max-heap of candidate rows keyed by prob -------------------------


@njit(cache=True)
def _push(heap, size, key, item):
    heap[size] = item
    i = size
    while i > 0:
        up = (i - 1) // 2
        if key[heap[i]] <= key[heap[up]]:
            break
        heap[i], heap[up] = heap[up], heap[i]
        i = up
    return size + 1


@njit(cache=True)
def _pop(heap, size, key):
    top = heap[0]
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        best = i
        for child in (2 * i + 1, 2 * i + 2):
            if child < size and key[heap[child]] > key[heap[best]]:
                best = child
        if best == i:
            return top, size
        heap[i], heap[best] = heap[best], heap[i]
        i = best


@njit(cache=True)
def _pending(size):
    # -> (prob, tok, par, cell, heap): the pending candidates of a best-first expansion
    return (np.empty(size, dtype=np.float64), np.empty(size, dtype=np.int32), np.empty(size, dtype=np.int32),
            np.empty(size, dtype=np.int32), np.empty(size, dtype=np.int64))


@njit(cache=True)
def _take(heap, size, c_prob, c_tok, c_par, c_cell, tok, par, prob, cell, n):
    # the best pending candidate c becomes buffer row n -> (c, size, n + 1)
    c, size = _pop(heap, size, c_prob)
    tok[n], par[n], prob[n], cell[n] = c_tok[c], c_par[c], c_prob[c], c_cell[c]
    return c, size, n + 1


# -- sources --------------------------------------------------------------------------------


@njit(cache=True)
def automaton_candidates(states, edges, slots, state, length, t0, source, means, min_length, max_levels, budget, k,
                         min_prob, tok, par, prob, cell, n):
    # states/edges/slots: a suffix automaton's kernel arrays; (state, length): the match of the
    # text before t0 (the caller's pointer is not moved). Appends up to `budget` rows from row n.
    # Roots: the match state and its suffix-link ancestors down to min_length (at most
    # max_levels), each proposing its top-k next tokens at its own match length; then best-first.
    # Candidates below min_prob are never pushed: `select` would drop them anyway.
    state, length = sam_step(states, edges, slots, state, length, t0)
    budget = min(budget, len(tok) - n)
    if budget <= 0 or length < min_length or state <= 0:
        return n
    pending = budget * (k + 1) + max_levels * k
    c_prob, c_tok, c_par, c_cell, heap = _pending(pending)
    c_state = np.empty(pending, dtype=np.int32)
    c_len = np.empty(pending, dtype=np.int32)
    kid_tok = np.empty(k, dtype=np.int32)
    kid_dst = np.empty(k, dtype=np.int32)
    n_c, size = 0, 0
    s, ell, levels = state, length, 0
    while s > 0 and ell >= min_length and levels < max_levels:
        n_c, size = _push_children(states, edges, s, ell, -1, 1.0, source, means, k, min_prob, kid_tok, kid_dst,
                                   c_prob, c_tok, c_par, c_state, c_len, c_cell, heap, n_c, size)
        levels += 1
        s = states[s, LINK]
        ell = states[s, LEN] if s > 0 else 0
    start = n
    while size > 0 and n - start < budget:
        c, size, n = _take(heap, size, c_prob, c_tok, c_par, c_cell, tok, par, prob, cell, n)
        if n_c + k <= pending:
            n_c, size = _push_children(states, edges, c_state[c], c_len[c], n - 1, c_prob[c], source, means, k,
                                       min_prob, kid_tok, kid_dst, c_prob, c_tok, c_par, c_state, c_len, c_cell,
                                       heap, n_c, size)
    return n


@njit(cache=True)
def _push_children(states, edges, s, ell, parent_row, parent_prob, source, means, k, min_prob, kid_tok, kid_dst,
                   c_prob, c_tok, c_par, c_state, c_len, c_cell, heap, n_c, size):
    support = states[s, COUNT]
    m = sam_topk_children(states, edges, s, k, kid_tok, kid_dst)
    for j in range(m):
        freq = states[kid_dst[j], COUNT] / support if support > 0 else 0.0
        ci = cell_index(source, ell, min(freq, 1.0), support)
        if parent_prob * means[ci] < min_prob:
            continue
        c_prob[n_c] = parent_prob * means[ci]
        c_tok[n_c], c_par[n_c], c_state[n_c], c_len[n_c], c_cell[n_c] = kid_tok[j], parent_row, kid_dst[j], ell + 1, ci
        size = _push(heap, size, c_prob, n_c)
        n_c += 1
    return n_c, size


@njit(cache=True)
def ngram_candidates(table, context, means, min_length, budget, k, min_prob, tok, par, prob, cell, n):
    # table: an n-gram store's NgramArrays (index/ngram.py); context: [c] int32, the text ending at
    # t0. A node's children are the top-k next tokens of the longest table context that is a
    # suffix of (context + path to the node). Appends up to `budget` rows from row n.
    # The entries are read here: fetching them per node through an index/ kernel made this kernel
    # 70% slower (8.0 -> 13.7 us a call for 48 nodes, measured), so only the layout's names cross.
    keys, ctx, order_start, ctx_start, offsets, nxt, counts, totals, max_n = table
    budget = min(budget, len(tok) - n)
    if budget <= 0:
        return n
    keep = min(len(context), max_n)
    work = np.empty(keep + budget + 1, dtype=np.int32)
    depth = np.zeros(budget, dtype=np.int32)
    pending = (budget + 1) * k
    c_prob, c_tok, c_par, c_cell, heap = _pending(pending)
    n_c, size = 0, 0
    start = n
    node, node_prob, node_depth = -1, 1.0, 0
    while True:
        # 1) the text ending at `node`: context tail + the path from the root
        work[:keep] = context[len(context) - keep:]
        v = node
        for q in range(node_depth - 1, -1, -1):
            work[keep + q] = tok[v]
            v = par[v]
        length, i = ngram_find(keys, ctx, order_start, ctx_start, work, keep + node_depth, max_n)
        # 2) push its top-k next tokens
        if length >= min_length and n_c + k <= pending:
            total = totals[i]
            for e in range(offsets[i], min(offsets[i + 1], offsets[i] + k)):
                freq = counts[e] / total if total > 0 else 0.0
                ci = cell_index(SRC_STATIC, length, min(freq, 1.0), total)
                if node_prob * means[ci] < min_prob:
                    continue
                c_prob[n_c], c_tok[n_c], c_par[n_c], c_cell[n_c] = node_prob * means[ci], nxt[e], node, ci
                size = _push(heap, size, c_prob, n_c)
                n_c += 1
        if size == 0 or n - start >= budget:
            return n
        # 3) keep the best pending candidate
        c, size, n = _take(heap, size, c_prob, c_tok, c_par, c_cell, tok, par, prob, cell, n)
        node, node_prob = n - 1, c_prob[c]
        node_depth = depth[c_par[c] - start] + 1 if c_par[c] >= 0 else 1
        depth[node - start] = node_depth


@njit(cache=True)
def sa_candidates(data, table, w, p, first, vocab, lo, hi, length, means, min_length, budget, k, min_prob, tok, par,
                  prob, cell, n):
    # (data, table, w, p, first, vocab): a suffix array's kernel arrays; (lo, hi, length): the match
    # once t0 follows (the cursor's peek). Like `automaton_candidates` from one root (no suffix
    # links): a node's range is its pattern's suffixes, its children the runs of next tokens there.
    budget = min(budget, len(tok) - n)
    if budget <= 0 or length < min_length:
        return n
    pending = (budget + 1) * k
    c_prob, c_tok, c_par, c_cell, heap = _pending(pending)
    c_lo = np.empty(pending, dtype=np.int64)
    c_hi = np.empty(pending, dtype=np.int64)
    c_len = np.empty(pending, dtype=np.int32)
    kid_tok = np.empty(k, dtype=np.int32)
    kid_lo = np.empty(k, dtype=np.int64)
    kid_hi = np.empty(k, dtype=np.int64)
    n_c, size = 0, 0
    node, node_prob, node_lo, node_hi, ell = -1, 1.0, lo, hi, length
    start = n
    while True:
        # 1) push the node's top-k next tokens, each priced by its share of the node's occurrences
        if n_c + k <= pending:
            support = node_hi - node_lo
            m = sa_children(data, table, w, p, first, vocab, node_lo, node_hi, ell, k, kid_tok, kid_lo, kid_hi)
            for j in range(m):
                ci = cell_index(SRC_STATIC, ell, min((kid_hi[j] - kid_lo[j]) / support, 1.0), support)
                if node_prob * means[ci] < min_prob:
                    continue
                c_prob[n_c], c_tok[n_c], c_par[n_c], c_cell[n_c] = node_prob * means[ci], kid_tok[j], node, ci
                c_lo[n_c], c_hi[n_c], c_len[n_c] = kid_lo[j], kid_hi[j], ell + 1
                size = _push(heap, size, c_prob, n_c)
                n_c += 1
        if size == 0 or n - start >= budget:
            return n
        # 2) keep the best pending candidate
        c, size, n = _take(heap, size, c_prob, c_tok, c_par, c_cell, tok, par, prob, cell, n)
        node, node_prob, node_lo, node_hi, ell = n - 1, c_prob[c], c_lo[c], c_hi[c], c_len[c]


@njit(cache=True)
def recycle_candidates(table, t0, means, max_depth, budget, min_prob, tok, par, prob, cell, n):
    # table: [V, k] int32, each token's most likely successors by rank (-1 = unknown). Best-first
    # over (node, rank) with the rank's calibrated chance. Appends up to `budget` rows from n.
    budget = min(budget, len(tok) - n)
    k = table.shape[1]
    if budget <= 0 or t0 < 0 or t0 >= table.shape[0]:
        return n
    pending = (budget + 1) * k
    c_prob, c_tok, c_par, c_cell, heap = _pending(pending)
    c_depth = np.empty(pending, dtype=np.int32)
    n_c, size = 0, 0
    start = n
    node, node_tok, node_prob, node_depth = -1, t0, 1.0, 0
    while True:
        if node_depth < max_depth and 0 <= node_tok < table.shape[0] and n_c + k <= pending:
            for r in range(k):
                succ = table[node_tok, r]
                if succ < 0:
                    break
                ci = cell_index(SRC_RECYCLE, node_depth + 1, min(r, N_FREQ - 1) / N_FREQ + 1e-9, 0)
                if node_prob * means[ci] < min_prob:
                    continue
                c_prob[n_c], c_tok[n_c], c_par[n_c] = node_prob * means[ci], succ, node
                c_depth[n_c], c_cell[n_c] = node_depth + 1, ci
                size = _push(heap, size, c_prob, n_c)
                n_c += 1
        if size == 0 or n - start >= budget:
            return n
        c, size, n = _take(heap, size, c_prob, c_tok, c_par, c_cell, tok, par, prob, cell, n)
        node, node_tok, node_prob, node_depth = n - 1, c_tok[c], c_prob[c], c_depth[c]


@njit(cache=True)
def propose_tree(d_states, d_edges, d_slots, d_state, d_length,
                 s_states, s_edges, s_slots, s_state, s_length, use_static,
                 m_states, m_edges, m_slots, m_state, m_length, use_memory,
                 table, use_recycle, t0, means, cost, settings, tok, par, prob, cell, n):
    # One call per step for every automaton source, Token Recycle and `select`; rows 0..n-1 may
    # hold candidates already (an n-gram store's). settings: [8] float64 = levels, width, budget,
    # min_prob, max_nodes, static_min_length, static_levels, recycle_budget.
    levels, width, budget = int(settings[0]), int(settings[1]), int(settings[2])
    min_prob, max_nodes = settings[3], int(settings[4])
    n = automaton_candidates(d_states, d_edges, d_slots, d_state, d_length, t0, SRC_DYNAMIC, means, 1, levels,
                             budget, width, min_prob, tok, par, prob, cell, n)
    if use_static:
        n = automaton_candidates(s_states, s_edges, s_slots, s_state, s_length, t0, SRC_STATIC, means,
                                 int(settings[5]), int(settings[6]), budget, width, min_prob, tok, par, prob, cell, n)
    if use_memory:
        n = automaton_candidates(m_states, m_edges, m_slots, m_state, m_length, t0, SRC_MEMORY, means, 2, levels,
                                 budget, width, min_prob, tok, par, prob, cell, n)
    if use_recycle:
        n = recycle_candidates(table, t0, means, 6, int(settings[7]), min_prob, tok, par, prob, cell, n)
    return select(tok, par, prob, cell, n, cost, max_nodes, min_prob)


# -- merge, select, learn -------------------------------------------------------------------


@njit(cache=True)
def select(tok, par, prob, cell, n, cost, max_nodes, min_prob):
    # Merge rows 0..n-1 into a trie (same parent and token = one node, keeping the higher
    # probability and its cell), then keep the most probable nodes, as many as maximise
    # (1 + sum prob) / cost[kept]. A child never outranks its parent (its probability is its
    # parent's times an estimate <= 1, and merging keeps maxima), so every kept node's parent is
    # kept. -> (tokens [m] int64, parents [m] int32, cells [m] int32, is_chain) with parents[i] < i.
    node_of = np.empty(n, dtype=np.int32)  # row -> merged node
    m_tok = np.empty(n, dtype=np.int32)
    m_par = np.empty(n, dtype=np.int32)
    m_prob = np.empty(n, dtype=np.float64)
    m_cell = np.empty(n, dtype=np.int32)
    first_child = np.full(n + 1, -1, dtype=np.int32)  # index parent + 1 (0 = the root)
    next_sibling = np.full(n, -1, dtype=np.int32)
    m = 0
    for r in range(n):
        parent = node_of[par[r]] if par[r] >= 0 else -1
        found = first_child[parent + 1]
        while found >= 0 and m_tok[found] != tok[r]:
            found = next_sibling[found]
        if found >= 0:
            node_of[r] = found
            if prob[r] > m_prob[found]:
                m_prob[found], m_cell[found] = prob[r], cell[r]
            continue
        m_tok[m], m_par[m], m_prob[m], m_cell[m] = tok[r], parent, prob[r], cell[r]
        next_sibling[m] = first_child[parent + 1]
        first_child[parent + 1] = m
        node_of[r] = m
        m += 1
    # rank: probability descending, creation order on ties (a parent is created before its child)
    order = np.argsort(-m_prob[:m], kind="mergesort")
    best_n, best_rate, expected = 0, 1.0 / cost[0], 1.0
    limit = min(m, max_nodes, len(cost) - 1)
    for i in range(limit):
        p = m_prob[order[i]]
        if p < min_prob:
            break
        expected += p
        rate = expected / cost[i + 1]
        if rate > best_rate:
            best_n, best_rate = i + 1, rate
    # emit the kept nodes in rank order, parents remapped
    rank_of = np.full(m, -1, dtype=np.int32)
    out_tok = np.empty(best_n, dtype=np.int64)
    out_par = np.empty(best_n, dtype=np.int32)
    out_cell = np.empty(best_n, dtype=np.int32)
    is_chain = True
    for i in range(best_n):
        v = order[i]
        rank_of[v] = i
        out_tok[i] = m_tok[v]
        out_par[i] = rank_of[m_par[v]] if m_par[v] >= 0 else -1
        out_cell[i] = m_cell[v]
        is_chain = is_chain and out_par[i] == i - 1
    return out_tok, out_par, out_cell, is_chain


@njit(cache=True)
def learn(tokens, parents, cells, accepted, hits, trials, prior, means, weight, max_trials):
    # tokens/parents/cells: the last draft tree; accepted: [a] the draft tokens it committed, in
    # order. Every node whose parent was accepted (or is the root) was tried: a hit when it is
    # the accepted child. A tried cell's mean becomes (hits + weight * prior) / (trials + weight);
    # past max_trials its evidence is rescaled, so the estimate keeps following the workload.
    current = -1
    depth = 0
    while True:
        nxt = -1
        for i in range(len(parents)):
            if parents[i] == current:
                c = cells[i]
                trials[c] += 1.0
                if depth < len(accepted) and tokens[i] == accepted[depth] and nxt < 0:
                    nxt = i
                    hits[c] += 1.0
                if trials[c] > max_trials:
                    hits[c] *= max_trials / trials[c]
                    trials[c] = max_trials
                means[c] = (hits[c] + weight * prior[c]) / (trials[c] + weight)
        if nxt < 0:
            return
        current = nxt
        depth += 1


@njit(cache=True)
def prediction_positions(states, edges, slots, state, length, t0, tokens, parents, n_prediction):
    # The dynamic automaton holds the prediction as its first document, at positions
    # 0..n_prediction-1. -> [m] int32: for each node of the tree, where in the prediction the text
    # ending at it (2+ tokens) first occurs, else -1. Counts Predicted Outputs usage only.
    m = len(tokens)
    pos = np.full(m, -1, dtype=np.int32)
    node_state = np.empty(m, dtype=np.int64)
    node_len = np.empty(m, dtype=np.int64)
    root_state, root_len = sam_step(states, edges, slots, state, length, t0)
    for i in range(m):
        s, ell = (root_state, root_len) if parents[i] < 0 else (node_state[parents[i]], node_len[parents[i]])
        s, ell = sam_step(states, edges, slots, s, ell, tokens[i])
        node_state[i], node_len[i] = s, ell
        if ell >= 2 and states[s, FIRST_END] < n_prediction:
            pos[i] = states[s, FIRST_END]
    return pos
