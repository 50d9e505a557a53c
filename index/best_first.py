"""Best-first top-prefix trees (REST's tree) over any source of next tokens: the candidate store
and the take-best step of the automaton's `sam_frequent_tree` and the suffix array's `sa_tree`.

A prefix's count never exceeds its parent's, so taking candidates best first (ties: the earlier
pushed), a node's children pushed when it is taken, yields exactly the top prefixes by count."""
from __future__ import annotations

import numpy as np
from numba import njit

# Rows of the candidate store `cand` [5, cap] int64: a candidate's count, the source's handle for
# its prefix (an automaton state, a suffix range's lo), its token, parent node and depth.
CNT, REF, TOK, PAR, DEPTH = range(5)


@njit(cache=True, inline="always")
def tree_buffers(num_nodes):
    # -> out_tok, out_par [num_nodes] int32, cand [5, cap] int64, taken [cap] bool
    cap = num_nodes * (num_nodes + 1)  # each taken node (and the root) pushes <= num_nodes children
    return (np.empty(num_nodes, dtype=np.int32), np.empty(num_nodes, dtype=np.int32),
            np.empty((5, cap), dtype=np.int64), np.zeros(cap, dtype=np.bool_))


@njit(cache=True, inline="always")
def tree_push(cand, n_cand, count, ref, token, parent, depth):
    cand[CNT, n_cand], cand[REF, n_cand], cand[TOK, n_cand] = count, ref, token
    cand[PAR, n_cand], cand[DEPTH, n_cand] = parent, depth
    return n_cand + 1


@njit(cache=True, inline="always")
def tree_take(cand, taken, n_cand, out_tok, out_par, m):
    """Node m := the most frequent candidate not yet taken, the earliest pushed among ties (a linear
    scan: <= 64 * 65 candidates, tiny); -> its column in cand, -1 when none is left."""
    best = -1
    for c in range(n_cand):
        if not taken[c] and (best < 0 or cand[CNT, c] > cand[CNT, best]):
            best = c
    if best >= 0:
        taken[best] = True
        out_tok[m], out_par[m] = cand[TOK, best], cand[PAR, best]
    return best

