"""Layout of the suffix automaton's arrays (index/automaton.py describes them), without numba:
what code that only reads a store's shapes and counters (`samctl info`) needs."""
from __future__ import annotations

import numpy as np

SEP = -1  # separator after each document in the token buffer; never a transition label

# Columns of `states`.
LEN, LINK, FIRST_END, LAST_END, COUNT, EDGE_TOK, EDGE_DST, HEAD = range(8)
N_STATE_COLS = 8
# Columns of `edges`.
E_SRC, E_TOK, E_DST, E_NEXT = range(4)
N_EDGE_COLS = 4
# Entries of `meta`.
M_STATES, M_EDGES, M_BUF, M_TOKENS, M_DOCS, M_LAST, M_DOC_OPEN, M_ROOT_DEGREE = range(8)
N_META = 8


def edge_count(states: np.ndarray, meta: np.ndarray) -> int:
    """All transitions of an automaton's arrays: inline first edges plus the chained ones.
    states: [S, N_STATE_COLS] int32, meta: [N_META] int64."""
    n = int(meta[M_STATES])
    return int(np.count_nonzero(states[:n, EDGE_TOK] >= 0)) + int(meta[M_EDGES])
