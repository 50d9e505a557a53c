"""Open any store: a `.sam` file (index/datastore.py), a sharded store directory (index/sharded.py)
or a directory kind's store (index/kinds.py). Apart because datastore.py knows nothing of shards.
"""
from __future__ import annotations

import json
import os

from samctl.index.datastore import Datastore, load_single
from samctl.index.kinds import KINDS, StoreKind


def load_datastore(path: str | os.PathLike, verify: bool = False, occurrence: str = "first") -> Datastore:
    """Read and validate a store; a UserError on any problem. `occurrence`: which occurrence a
    suffix automaton's continuations come from."""
    if os.path.isdir(path):
        manifest = _manifest(path)
        kind = KINDS.get(str(manifest.get("kind"))) if manifest else _kind_by_files(path)
        if kind is not None and kind.directory and "shards" not in manifest:
            return kind.load(path, verify=verify, occurrence=occurrence)
        from samctl.index.sharded import load_sharded  # numba loads with a store, not for `build --help`

        return load_sharded(path, verify=verify, occurrence=occurrence)
    return load_single(path, verify=verify, occurrence=occurrence)


def _manifest(path: str | os.PathLike) -> dict:
    # The manifest, untrusted: the kind's own loader checks it (empty when unreadable; the sharded
    # loader then says what is wrong).
    try:
        with open(os.path.join(path, "manifest.json"), "rb") as handle:
            manifest = json.loads(handle.read(1 << 20).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _kind_by_files(path: str | os.PathLike) -> StoreKind | None:
    # A directory whose manifest is unreadable: the directory kind whose files it holds, so that its
    # loader words the error (and the advice to rebuild); None for a sharded store's.
    return next((k for k in KINDS.values() if k.files and all(os.path.isfile(os.path.join(path, f)) for f in k.files)),
                None)
