"""The table of store kinds: a new index structure is one module plus one entry in KINDS.

Every structure, whatever its kind, answers `lookup(structure, context, n, k) -> Lookup`,
`counts(structure) -> {name: int}` (names: the entry's count_names) and has a drafters' cursor
(index/cursor.py). A file kind's structure is written by `save_datastore` as a `.sam` store file
(`to_arrays`, read back by `from_arrays`); a directory kind writes and reads its own directory.
Sharded stores (index/sharded.py) are a layout of a kind with `sharded`, not a kind.

The structures' modules (and numba with them) are imported inside the entries' functions, so
that reading this table (`build --help`, `info`) stays light.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import numpy as np

from samctl.index.automaton_layout import E_TOK, EDGE_TOK, edge_count
from samctl.index.lookup import Lookup
from samctl.index.sa_layout import FILES as SA_FILES


@dataclass(frozen=True)
class BuildOptions:
    """What building needs beyond the corpus and its StoreMeta (not recorded in the store)."""

    path: str = ""  # where a directory kind writes itself
    memory_limit: int | None = None  # bytes the suffix sort may hold (sa); None: half the free memory
    threads: int = 1  # sorting processes at once (sa)
    # progress: heartbeat(read) is a context manager around a long call; read() -> tokens done
    heartbeat: Callable[[Callable[[], int] | None], ContextManager[Any]] | None = None


@dataclass(frozen=True)
class StoreKind:
    name: str
    label: str  # "suffix automaton"
    help: str  # what `build --kind` says of it
    # (tokens [n] int32, doc_offsets [d+1] int64, meta, options) -> structure
    build: Callable[[np.ndarray, np.ndarray, Any, BuildOptions], Any]
    lookup: Callable[[Any, np.ndarray, int, int], Any]
    counts: Callable[[Any], dict[str, int]]  # its size, for `samctl info` and the build summary
    count_names: tuple[str, ...]
    # file kinds: (arrays, meta, occurrence, check) -> structure
    from_arrays: Callable[..., Any] | None = None
    # the arrays holding ids a draft can contain (checked < vocab)
    token_columns: Callable[[dict[str, np.ndarray]], list[np.ndarray]] | None = None
    # `counts` from a file's array shapes, without loading it
    file_counts: Callable[[dict[str, np.ndarray]], dict[str, int]] | None = None
    load: Callable[..., Any] | None = None  # directory kinds: (path, verify, occurrence) -> store
    # directory kinds: its files beside the manifest (they tell the kind when the manifest is
    # unreadable, so that the error advises rebuilding that kind)
    files: tuple[str, ...] = ()
    # `--append-to` works (an automaton grows in place; a directory kind is rebuilt over
    # `structure.documents()` and the new documents)
    grows: bool = False
    # `--shards` works: (the shards' structures, whole-document runs in corpus order; occurrence)
    sharded: Callable[[list[Any], str], Any] | None = None

    directory = property(lambda self: self.load is not None)
    shards = property(lambda self: self.sharded is not None)


def _heartbeat(options: BuildOptions):
    return options.heartbeat(None) if options.heartbeat is not None else nullcontext()


# -- sam: the suffix automaton (index/automaton.py) ----------------------------------------------


def _sam_build(tokens, doc_offsets, meta, options):
    from samctl.index.automaton import SuffixAutomaton

    watch = (lambda sam: options.heartbeat(lambda: sam.num_tokens)) if options.heartbeat is not None else None
    return SuffixAutomaton.build(tokens, doc_offsets, watch=watch)


def _sam_lookup(sam, context, n, k):
    state, length = sam.match(context)
    next_tokens, next_counts = sam.topk_next(state, k)
    return Lookup(int(length), sam.count(state) if length else 0, np.array(sam.continuation(state, n)),
                  next_tokens, next_counts)


def _sam_from_arrays(arrays, meta, occurrence, check):
    from samctl.index.automaton import SuffixAutomaton

    return SuffixAutomaton.from_arrays(arrays, occurrence=occurrence, check_links=check)


def _sam_sharded(automata, occurrence):
    from samctl.index.shard_structures import ShardedAutomaton

    return ShardedAutomaton(automata, occurrence=occurrence)


def _sam_columns(arrays):
    return [arrays["tokens"], arrays["states"][:, EDGE_TOK], arrays["edges"][:, E_TOK]]


def _sam_file_counts(arrays):
    return {"states": len(arrays["states"]), "edges": edge_count(arrays["states"], arrays["meta"])}


# -- ngram: the pruned n-gram table (index/ngram.py) ---------------------------------------------


def _ngram_build(tokens, doc_offsets, meta, options):
    from samctl.index.ngram import NgramTable

    with _heartbeat(options):
        return NgramTable.build(tokens, doc_offsets, meta.build.ngram_config())


def _ngram_lookup(table, context, n, k):
    length, next_tokens, next_counts = table.lookup(context)
    return Lookup(int(length), int(next_counts.sum()), np.array(table.continuation(context, n)),
                  np.array(next_tokens[:k]), np.array(next_counts[:k]))


def _ngram_from_arrays(arrays, meta, occurrence, check):
    from samctl.index.ngram import NgramTable

    return NgramTable.from_arrays(arrays, meta.build.ngram_config())


# -- sa: the suffix array (index/suffix_array.py) ------------------------------------------------


def _sa_build(tokens, doc_offsets, meta, options):
    from samctl.index.suffix_array import build_suffix_array

    with _heartbeat(options):
        return build_suffix_array(options.path, tokens, doc_offsets, meta, options.memory_limit,
                                  options.threads).structure


def _sa_load(path, verify=False, occurrence="first"):
    from samctl.index.suffix_array import load_suffix_array

    return load_suffix_array(path, verify=verify)


def _sa_sharded(arrays, occurrence):
    from samctl.index.shard_structures import ShardedSuffixArray

    return ShardedSuffixArray(arrays)  # continuations come from the earliest occurrence only


KINDS: dict[str, StoreKind] = {kind.name: kind for kind in (
    StoreKind("sam", "suffix automaton", "exact matches of any length, the largest on disk",
              build=_sam_build, lookup=_sam_lookup,
              counts=lambda sam: {"states": sam.num_states, "edges": sam.num_edges}, count_names=("states", "edges"),
              from_arrays=_sam_from_arrays, token_columns=_sam_columns, file_counts=_sam_file_counts,
              grows=True, sharded=_sam_sharded),
    StoreKind("ngram", "n-gram table", "contexts of up to --max-n tokens, the smallest",
              build=_ngram_build, lookup=_ngram_lookup,
              counts=lambda t: {"contexts": t.num_contexts, "entries": t.num_entries},
              count_names=("contexts", "entries"),
              from_arrays=_ngram_from_arrays, token_columns=lambda a: [a["next"], a["ctx"]],
              file_counts=lambda a: {"contexts": len(a["keys"]), "entries": len(a["next"])}),
    StoreKind("sa", "suffix array", "exact matches of any length, a tenth of the automaton's size; a directory, "
                                    "built by infini-gram's indexer (pip install 'samctl[sa]')",
              build=_sa_build, lookup=lambda sa, context, n, k: sa.lookup(context, n, k),
              counts=lambda sa: {"suffixes": sa.num_tokens + sa.num_documents}, count_names=("suffixes",),
              load=_sa_load, files=SA_FILES, grows=True, sharded=_sa_sharded),
)}
