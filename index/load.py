"""Open any store: a `.sam` file (index/datastore.py) or a sharded store directory (index/sharded.py).

Its own module because sharded stores build on single ones: datastore.py knows nothing of shards.
"""
from __future__ import annotations

import os

from samctl.index.datastore import Datastore, load_single


def load_datastore(path: str | os.PathLike, verify: bool = False, occurrence: str = "first") -> Datastore:
    """Read and validate a store; raises UserError (StoreError for the file) on any problem.

    `occurrence` picks which occurrence a suffix automaton's continuations come from. A directory
    is a sharded store (index/sharded.py), returned as a ShardedDatastore with the same queries.
    """
    if os.path.isdir(path):
        from samctl.index.sharded import load_sharded  # numba loads with a store, not for `build --help`

        return load_sharded(path, verify=verify, occurrence=occurrence)
    return load_single(path, verify=verify, occurrence=occurrence)
