"""Sharded stores: a directory of shards of one kind plus a manifest, queried as one store.

Layout of a store directory (conventionally named `*.samd`):

    manifest.json     {"format": "samctl-sharded-store", "format_version": 1, "kind": "sam" | "sa",
                       "created_by", "tokenizer", "build", "corpus"  (as in a .sam header),
                       "shards": [{"file", "documents", "tokens", "bytes", "crc32"}, ...]}
    shard-00000.sam   one `.sam` store file per shard (index/store.py), same tokenizer and build
                      config; or shard-00000.sa, one suffix-array store directory per shard
                      (index/suffix_array.py). A directory shard's bytes are its files' sum, its
                      crc32 its manifest's (which holds its files' crc32s).

Shards hold contiguous runs of whole documents in corpus order (`plan_shards`: a document is
never split). Since no match crosses a document, for any text:
    the longest suffix found in the union = the longest found in any shard (length L);
    its count = the sum of its counts over the shards whose match has length L;
    its first occurrence lies in the lowest such shard, its latest in the highest;
    the counts of its next tokens add up over those shards in the same way.
So `ShardedDatastore.lookup` answers exactly what one store over the same corpus answers. The
drafters follow one pointer per shard (automata: `ShardedAutomaton.walk`, one kernel call for all
shards, reusing the steps of the last `peek` over the same token; suffix arrays: one cursor per
shard, index/cursor.py) and draft from the shard holding the longest match (`peek`): for `sam`
and its continuation this is again exactly the single store's draft; tree drafters (`rest`,
`adaptive`) rank next tokens by that shard's counts only.

The manifest is untrusted input, like a store header: a missing or malformed manifest, a shard
file missing, resized, from another tokenizer or holding other counts than the manifest says,
each raise a one-line StoreError. Whole-file checksums (crc32) are checked with `verify=True`,
as blob checksums are in index/store.py. Writing (`StoreDirectoryWriter`) fills a temporary
directory beside the target, fsyncs it and renames it into place: the directory appears
complete or not at all.

This module knows store files, automata and suffix arrays, not tokenizers, text, processes or Ray.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numba
import numpy as np
from numba import njit

from samctl.index.automaton import COUNT, E_DST, E_NEXT, E_TOK, EDGE_DST, EDGE_TOK, HEAD, SuffixAutomaton, sam_step
from samctl.index.datastore import CorpusStats, StoreMeta, load_single, parse_meta, save_datastore
from samctl.index.kinds import KINDS, BuildOptions
from samctl.index.lookup import Lookup
from samctl.index.errors import ConfigError, UserError
from samctl.index.store import StoreError, _fsync_directory, _umask, read_manifest
from samctl.index.suffix_array import SAMPLES, SuffixArray

MANIFEST = "manifest.json"
FORMAT = "samctl-sharded-store"
FORMAT_VERSION = 1
MAX_SHARDS = 4096
_REBUILD = "rebuild it with `samctl build --shards N`"
_SHARD_KEYS = {"file": str, "documents": int, "tokens": int, "bytes": int, "crc32": int}


def shard_name(index: int, kind: str = "sam") -> str:
    return f"shard-{index:05d}.{kind}"


def plan_shards(doc_offsets: np.ndarray, n: int) -> np.ndarray:
    """Document boundaries of n shards ([n+1] int64, from 0 to d, strictly rising): shard i holds
    documents [b[i], b[i+1]), contiguous and in order, about total/n tokens each.

    doc_offsets: [d+1] int64 token offsets of d documents.
    """
    n_docs = len(doc_offsets) - 1
    if n < 1:
        raise ConfigError("{shards} must be >= 1, got {n}", n=n)
    if n > min(n_docs, MAX_SHARDS):
        raise ConfigError("{n} shards need at least {n} documents (the corpus has {docs}) and at most {most} shards: "
                          "pass a smaller {shards}", n=n, docs=n_docs, most=MAX_SHARDS)
    total = int(doc_offsets[-1])
    targets = np.arange(n + 1, dtype=np.float64) * total / n
    bounds = np.searchsorted(doc_offsets, targets, side="left").astype(np.int64)
    bounds[0], bounds[-1] = 0, n_docs
    for i in range(1, n):  # every shard keeps at least one document on each side
        bounds[i] = min(max(bounds[i], bounds[i - 1] + 1), n_docs - (n - i))
    return bounds


# ---------------------------------------------------------------------------------------------
# kernels: one pointer (state, length) per shard, all shards in one call


@njit(cache=True)
def shards_walk(states_t, edges_t, slots_t, st, ln, tokens, peeked_st, peeked_ln, use_peeked):
    # states_t/edges_t/slots_t: tuples of the shards' kernel arrays; st, ln: [N] int64 pointers,
    # moved in place over tokens ([k] int32) in every shard. With use_peeked, the step over
    # tokens[0] is taken from peeked_st/peeked_ln ([N] int64, what shards_peek computed for it
    # from this same pointer): a decode step then probes each shard once, not twice.
    start = 0
    if use_peeked:
        for i in range(len(st)):
            st[i], ln[i] = peeked_st[i], peeked_ln[i]
        start = 1
    for i in range(len(states_t)):
        s, m = st[i], ln[i]
        for j in range(start, len(tokens)):
            s, m = sam_step(states_t[i], edges_t[i], slots_t[i], s, m, tokens[j])
        st[i], ln[i] = s, m


@njit(cache=True)
def shards_peek(states_t, edges_t, slots_t, st, ln, t0, prefer_last, out_st, out_ln):
    # -> (shard, state, length) of the longest match after t0 without moving the pointers; ties
    # go to the lowest shard (first occurrence) or, with prefer_last, the highest (latest).
    # Every shard's moved pointer goes to out_st/out_ln ([N] int64).
    best, best_state, best_len = 0, 0, -1
    for i in range(len(states_t)):
        s, m = sam_step(states_t[i], edges_t[i], slots_t[i], st[i], ln[i], t0)
        out_st[i], out_ln[i] = s, m
        if m > best_len or (prefer_last and m == best_len):
            best, best_state, best_len = i, s, m
    return best, best_state, best_len


@njit(cache=True)
def children(states, edges, state):
    # -> (tokens [m] int32, counts [m] int64): every out-edge of state and its destination count
    n = 0
    e = states[state, HEAD]
    while e >= 0:
        n += 1
        e = edges[e, E_NEXT]
    tok = np.empty(n + 1, dtype=np.int32)
    cnt = np.empty(n + 1, dtype=np.int64)
    m = 0
    if states[state, EDGE_TOK] >= 0:
        tok[0], cnt[0] = states[state, EDGE_TOK], states[states[state, EDGE_DST], COUNT]
        m = 1
    e = states[state, HEAD]
    while e >= 0:
        tok[m], cnt[m] = edges[e, E_TOK], states[edges[e, E_DST], COUNT]
        m += 1
        e = edges[e, E_NEXT]
    return tok[:m], cnt[:m]


def _bound(kernel, *args):
    """The compiled entry point of a numba kernel for these arguments' types. Calling a dispatcher
    with tuples of arrays computes the tuples' types in Python on every call (about 1 µs per call
    with 8 shards); the entry point takes the same arguments without that. Arguments must keep
    these types (the callers pass contiguous int32 tokens and their own int64 pointers)."""
    return kernel.compile(tuple(numba.typeof(a) for a in args))


def _readonly(array: np.ndarray) -> np.ndarray:
    # one numba type for every shard (memory-mapped shards are read-only, built ones are not),
    # so the shards' arrays form a homogeneous tuple that kernels index at run time
    view = array.view()
    view.flags.writeable = False
    return view


class ShardedAutomaton:
    """Static suffix automata over disjoint document runs, queried through one pointer per shard."""

    def __init__(self, shards: list[SuffixAutomaton], occurrence: str = "first") -> None:
        if not shards:
            raise UserError("a sharded store needs at least one shard")
        self.shards = list(shards)
        self.occurrence = occurrence
        self._prefer_last = occurrence == "latest"
        arrays = [s.kernel_arrays for s in self.shards]
        self.states = tuple(_readonly(a.states) for a in arrays)
        self.edges = tuple(_readonly(a.edges) for a in arrays)
        self.slots = tuple(_readonly(a.slots) for a in arrays)
        self._peek_st = np.zeros(len(self.shards), dtype=np.int64)  # the last peek's moved pointer
        self._peek_ln = np.zeros(len(self.shards), dtype=np.int64)
        self._peeked_for: tuple[int, int] | None = None  # (id of the peeked pointer, its token)
        st, ln = np.zeros(len(self.shards), dtype=np.int64), np.zeros(len(self.shards), dtype=np.int64)
        self._walk = _bound(shards_walk, self.states, self.edges, self.slots, st, ln, np.zeros(1, dtype=np.int32),
                            self._peek_st, self._peek_ln, False)
        self._peek = _bound(shards_peek, self.states, self.edges, self.slots, st, ln, 0, False,
                            self._peek_st, self._peek_ln)

    def __len__(self) -> int:
        return len(self.shards)

    def pointer(self) -> tuple[np.ndarray, np.ndarray]:
        """A fresh pointer: ([N] int64 states, [N] int64 lengths) at every shard's root."""
        self._peeked_for = None
        return np.zeros(len(self.shards), dtype=np.int64), np.zeros(len(self.shards), dtype=np.int64)

    def match(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-shard longest suffix of tokens ([k] int32): a new pointer."""
        states, lengths = self.pointer()
        self.walk(states, lengths, tokens)
        return states, lengths

    def walk(self, states: np.ndarray, lengths: np.ndarray, tokens: np.ndarray) -> None:
        """Move the pointer over tokens ([k] int32) in every shard, in place."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        # the last peek's steps are reused when they were taken from this pointer, unmoved since
        # (every walk and new pointer clears the record), over this first token
        reuse = len(tokens) > 0 and self._peeked_for == (id(states), int(tokens[0]))
        self._peeked_for = None
        self._walk(self.states, self.edges, self.slots, states, lengths, tokens, self._peek_st, self._peek_ln, reuse)

    def peek(self, states: np.ndarray, lengths: np.ndarray, token: int) -> tuple[int, int, int]:
        """(shard, state, length) of the longest match once token follows; the pointer stays."""
        shard, state, length = self._peek(self.states, self.edges, self.slots, states, lengths, int(token),
                                          self._prefer_last, self._peek_st, self._peek_ln)
        self._peeked_for = (id(states), int(token))
        return int(shard), int(state), int(length)

    def best(self, states: np.ndarray, lengths: np.ndarray) -> tuple[int, int, int]:
        """(shard, state, length) of the pointer's longest match, ties as in `peek`."""
        order = np.arange(len(self.shards))[::-1] if self._prefer_last else np.arange(len(self.shards))
        shard = int(order[np.argmax(lengths[order])])
        return shard, int(states[shard]), int(lengths[shard])

    def continuation(self, shard: int, state: int, n: int) -> np.ndarray:
        return self.shards[shard].continuation(state, n)

    def lookup(self, context: np.ndarray, n: int, k: int) -> Lookup:
        """What `Datastore.lookup` answers for one store over all the shards' documents."""
        states, lengths = self.match(np.asarray(context, dtype=np.int32))
        shard, state, length = self.best(states, lengths)
        holders = [(self.shards[i].count(int(states[i])), *children(self.states[i], self.edges[i], int(states[i])))
                   for i in np.flatnonzero(lengths == length)]
        return merged_lookup(length, holders, self.continuation(shard, state, n), k)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_states(self) -> int:
        return sum(s.num_states for s in self.shards)

    @property
    def num_edges(self) -> int:
        return sum(s.num_edges for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)


class ShardedSuffixArray:
    """Suffix arrays over disjoint document runs; drafters follow one cursor per shard
    (index/cursor.py's ShardedSuffixArrayCursor)."""

    def __init__(self, shards: list[SuffixArray]) -> None:
        if not shards:
            raise UserError("a sharded store needs at least one shard")
        self.shards = list(shards)

    def __len__(self) -> int:
        return len(self.shards)

    def lookup(self, context: np.ndarray, n: int, k: int) -> Lookup:
        """What one suffix array over all the shards' documents answers (the continuation from the
        earliest occurrence: the lowest shard holding the longest match)."""
        found = [shard.lookup(context, n, SAMPLES) for shard in self.shards]  # every next token it samples
        length = max(f.match_length for f in found)
        holders = [f for f in found if f.match_length == length]
        return merged_lookup(length, [(f.count, f.next_tokens, f.next_counts) for f in holders],
                             holders[0].continuation, k)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)


def merged_lookup(length: int, holders: list[tuple[int, np.ndarray, np.ndarray]], continuation: np.ndarray,
                  k: int) -> Lookup:
    """One store's answer from its shards': `length` is the longest match of any shard; holders
    are (count, next tokens [m] int32, their counts [m] int) of each shard whose match is that long."""
    count = sum(c for c, _, _ in holders) if length else 0
    ids, inverse = np.unique(np.concatenate([t for _, t, _ in holders]), return_inverse=True)
    totals = np.zeros(len(ids), dtype=np.int64)
    np.add.at(totals, inverse, np.concatenate([c for _, _, c in holders]).astype(np.int64))
    order = np.lexsort((ids, -totals))[:k]  # count descending, then token ascending
    return Lookup(int(length), int(count), np.array(continuation), ids[order].astype(np.int32),
                  totals[order].astype(np.int32))


# ---------------------------------------------------------------------------------------------
# the store directory


@dataclass(frozen=True)
class ShardedDatastore:
    """A loaded store directory; the same surface as `Datastore` for the commands and drafters."""

    path: str
    kind: str
    structure: ShardedAutomaton | ShardedSuffixArray
    meta: StoreMeta
    shards: tuple[Any, ...]  # each shard's loaded store: a Datastore, or a directory kind's
    manifest: dict[str, Any]

    @property
    def format_version(self) -> int:
        return int(self.manifest["format_version"])

    @property
    def file_size(self) -> int:
        return sum(int(s["bytes"]) for s in self.manifest["shards"]) + os.path.getsize(
            os.path.join(self.path, MANIFEST))

    @property
    def sam(self) -> ShardedAutomaton | ShardedSuffixArray:
        return self.structure

    def verify(self) -> None:
        """Check every shard's crc32 against the manifest and every blob's or file's checksum."""
        for entry, shard in zip(self.manifest["shards"], self.shards):
            if _shard_crc32(shard.path) != entry["crc32"]:
                raise StoreError(f"{shard.path} does not match its checksum in {MANIFEST}: the shard is damaged, "
                                 f"{_REBUILD}")
            shard.verify()

    def lookup(self, context: np.ndarray, n: int, k: int = 8) -> Lookup:
        return self.structure.lookup(context, n, k)


def load_sharded(path: str | os.PathLike, verify: bool = False, occurrence: str = "first") -> ShardedDatastore:
    """Open a store directory; raises StoreError (one line) for anything damaged or inconsistent."""
    name = str(path)
    manifest = _read_manifest(name)
    meta = parse_meta(manifest, os.path.join(name, MANIFEST))
    kind = meta.build.kind
    if not KINDS[kind].shards:
        raise StoreError(f"{name}/{MANIFEST} declares kind {kind!r}: sharded stores hold suffix automata or "
                         f"suffix arrays, {_REBUILD}")
    shards = []
    for entry in manifest["shards"]:
        file = os.path.join(name, entry["file"])
        size = _shard_bytes(file)
        if size < 0:
            raise StoreError(f"{name} lacks shard {entry['file']} listed in {MANIFEST}: {_REBUILD}")
        if size != entry["bytes"]:
            raise StoreError(f"{file} has {size} bytes, {MANIFEST} says {entry['bytes']}: the shard is damaged "
                             f"or replaced, {_REBUILD}")
        shards.append(_load_shard(file, entry, meta, verify, occurrence))
    if sum(e["tokens"] for e in manifest["shards"]) != meta.corpus.tokens:
        raise StoreError(f"{name}/{MANIFEST}: the shards' token counts do not add up to the corpus's "
                         f"{meta.corpus.tokens}: {_REBUILD}")
    store = ShardedDatastore(path=name, kind=kind, meta=meta, manifest=manifest, shards=tuple(shards),
                             structure=KINDS[kind].sharded([s.structure for s in shards], occurrence))
    if verify:
        store.verify()
    return store


def _load_shard(file: str, entry: dict[str, Any], meta: StoreMeta, verify: bool, occurrence: str = "first"):
    """One shard as the manifest lists it, of the store's kind and tokenizer; a StoreError names the file."""
    kind = KINDS[meta.build.kind]
    if os.path.isdir(file) != kind.directory:
        raise StoreError(f"{file} is not a {kind.label} store: {_REBUILD}")
    shard = kind.load(file, verify=verify) if kind.directory else load_single(file, verify=verify, occurrence=occurrence)
    if shard.kind != kind.name or shard.meta.tokenizer_fingerprint != meta.tokenizer_fingerprint:
        raise StoreError(f"{file} is not a {kind.label} of the tokenizer {MANIFEST} names "
                         f"({meta.tokenizer_fingerprint}): {_REBUILD}")
    tokens = shard.structure.num_tokens
    if tokens != entry["tokens"] or shard.meta.corpus.tokens != entry["tokens"]:
        raise StoreError(f"{file} holds {tokens} tokens, {MANIFEST} says {entry['tokens']}: {_REBUILD}")
    return shard


def verify_sharded(path: str | os.PathLike) -> dict[str, Any]:
    """Check a store directory completely, one shard at a time (a shard's arrays are released
    before the next is read, so this needs the memory of one shard): everything `load_sharded`
    checks, plus every file's crc32 and every blob's checksum. Returns the manifest."""
    name = str(path)
    manifest = _read_manifest(name)
    meta = parse_meta(manifest, os.path.join(name, MANIFEST))
    for entry in manifest["shards"]:
        file = os.path.join(name, entry["file"])
        if _shard_bytes(file) != entry["bytes"] or _shard_crc32(file) != entry["crc32"]:
            raise StoreError(f"{file} is missing or does not match {MANIFEST}: {_REBUILD}")
        _load_shard(file, entry, meta, verify=True)  # released before the next is read
    return manifest


def _read_manifest(name: str) -> dict[str, Any]:
    file = os.path.join(name, MANIFEST)

    def bad(what: str) -> StoreError:
        return StoreError(f"{file} is damaged ({what}): {_REBUILD}")

    manifest = read_manifest(file, FORMAT, FORMAT_VERSION, "sharded-store", _REBUILD, 16 << 20,
                             missing=f"{name} is a directory without {MANIFEST}: pass a .sam file or a store "
                                     "directory written by `samctl build --shards N`")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not 1 <= len(shards) <= MAX_SHARDS:
        raise bad("no shard list")
    seen = set()
    for entry in shards:
        if not isinstance(entry, dict) or set(entry) != set(_SHARD_KEYS):
            raise bad("a shard entry has other fields than " + ", ".join(_SHARD_KEYS))
        for key, kind in _SHARD_KEYS.items():
            value = entry[key]
            if type(value) is not kind or (kind is int and value < 0):
                raise bad(f"shard field {key} is {value!r}")
        file_name = entry["file"]
        # the file name is untrusted: a plain name inside the directory, never a path
        if file_name in seen or os.path.basename(file_name) != file_name or file_name in ("", ".", "..") \
                or not file_name.endswith(f".{manifest.get('kind')}"):
            raise bad(f"shard file name {file_name!r}")
        seen.add(file_name)
    return manifest


def _file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _shard_bytes(path: str) -> int:
    """A shard file's size, or a shard directory's files' sum; -1 when it is missing."""
    try:
        if os.path.isdir(path):
            return sum(e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))
        return os.path.getsize(path)
    except OSError:
        return -1


def _shard_crc32(path: str) -> int:
    # a directory shard's manifest holds the crc32 of each of its files
    return _file_crc32(os.path.join(path, MANIFEST) if os.path.isdir(path) else path)


def shard_entry(path: str | os.PathLike, documents: int, tokens: int) -> dict[str, Any]:
    """The manifest entry of a written shard."""
    return {"file": os.path.basename(path), "documents": int(documents), "tokens": int(tokens),
            "bytes": _shard_bytes(str(path)), "crc32": _shard_crc32(str(path))}


class StoreDirectoryWriter:
    """Writes a store directory atomically: shards go into a temporary directory beside `path`;
    `commit` writes the manifest, fsyncs, and renames the directory into place (replacing an
    older store at `path`; any other directory there is refused). Leaving the `with` block without `commit` removes everything."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        # Only a store (directory with a manifest, or a file) is ever replaced: never a folder
        # that merely sits at the path, which the final swap would delete.
        if self.path.is_dir() and not (self.path / MANIFEST).is_file():
            raise UserError(f"{self.path} is a directory but not a samctl store (no {MANIFEST}): "
                            "choose another output path")
        parent = self.path.parent if str(self.path.parent) else Path(".")
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.tmp", dir=parent))
        except OSError as err:
            raise UserError(f"cannot write {self.path}: {err.strerror}: choose another output path") from err
        self.committed = False

    def __enter__(self) -> "StoreDirectoryWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.committed:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def shard_path(self, index: int, kind: str = "sam") -> Path:
        return self.tmp / shard_name(index, kind)

    def commit(self, meta: StoreMeta, entries: list[dict[str, Any]]) -> None:
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **meta.to_header(), "shards": entries}
        self.commit_manifest(manifest, [e["file"] for e in entries])

    def commit_manifest(self, manifest: dict[str, Any], files: list[str] | tuple[str, ...]) -> None:
        """Write `manifest`, drop every file but `files`, and swap the directory into place."""
        manifest_path = self.tmp / MANIFEST
        with open(manifest_path, "w", encoding="utf-8") as out:
            json.dump(manifest, out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        for leftover in set(os.listdir(self.tmp)) - {MANIFEST} - set(files):
            path = self.tmp / leftover
            shutil.rmtree(path) if path.is_dir() else os.unlink(path)
        _fsync_directory(self.tmp)
        os.chmod(self.tmp, 0o755 & ~_umask())
        self._swap()
        self.committed = True

    def _swap(self) -> None:
        old = None
        if self.path.exists() or self.path.is_symlink():
            old = self.path.parent / f".{self.path.name}.old{os.getpid()}"
            os.replace(self.path, old)
        try:
            os.replace(self.tmp, self.path)
        except OSError as err:
            if old is not None:
                os.replace(old, self.path)
            raise UserError(f"cannot write {self.path}: {err.strerror or err}") from err
        _fsync_directory(self.path.parent if str(self.path.parent) else Path("."))
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()


def build_shard(path: str | os.PathLike, tokens: np.ndarray, doc_offsets: np.ndarray, meta: StoreMeta,
                memory_limit: int | None = None) -> tuple[dict[str, Any], dict[str, int]]:
    """Build one shard of meta's kind over documents tokens[doc_offsets[i]:doc_offsets[i+1]] and
    write it to path (a file, or a directory kind's directory): its manifest entry and counts.
    `meta` is the whole store's: the shard keeps its tokenizer and build config, with its own
    corpus counts.

    tokens: [n] int32; doc_offsets: [d+1] int64 from 0; memory_limit: bytes a suffix sort may hold."""
    kind = KINDS[meta.build.kind]
    documents = len(doc_offsets) - 1
    shard = _shard_meta(path, meta, documents, len(tokens))
    structure = kind.build(tokens, doc_offsets, shard, BuildOptions(path=str(path), memory_limit=memory_limit))
    if not kind.directory:
        save_datastore(path, structure, shard)
    return shard_entry(path, documents, len(tokens)), kind.counts(structure)


def _shard_meta(path: str | os.PathLike, meta: StoreMeta, documents: int, tokens: int) -> StoreMeta:
    corpus = CorpusStats(documents=documents, tokens=tokens,
                         inputs=(f"shard {os.path.basename(path)} of {', '.join(meta.corpus.inputs)}",))
    return dataclasses.replace(meta, corpus=corpus)
