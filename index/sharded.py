"""Sharded stores: a directory of shards of one kind plus a manifest, queried as one store.

Layout of a store directory (conventionally named `*.samd`):

    manifest.json     {"format": "samctl-sharded-store", "format_version": 1, "kind": "sam" | "sa",
                       "created_by", "tokenizer", "build", "corpus"  (as in a .sam header),
                       "shards": [{"file", "documents", "tokens", "bytes", "crc32"}, ...]}
    shard-00000.sam   one `.sam` store file per shard (index/store.py), same tokenizer and build
                      config; or shard-00000.sa, one suffix-array store directory per shard
                      (index/suffix_array.py). A directory shard's bytes are its files' sum, its
                      crc32 its manifest's (which holds its files' crc32s).

Shards hold contiguous runs of whole documents in corpus order (`plan_shards`). Since no match
crosses a document, for any text:
    the longest suffix found in the union = the longest found in any shard (length L);
    its count = the sum of its counts over the shards whose match has length L;
    its first occurrence lies in the lowest such shard, its latest in the highest;
    the counts of its next tokens add up over those shards in the same way.
So a lookup answers exactly what one store over the same corpus answers, and so does a `sam`
draft (from the shard holding the longest match); tree drafters (`rest`, `adaptive`) rank next
tokens by that shard's counts only.

The manifest is untrusted input, like a store header: any inconsistency with the shards raises a
one-line StoreError; whole-file crc32s are checked with `verify=True`. Writing
(`StoreDirectoryWriter`) is atomic, as index/store.py's DirectoryWriter.

This module knows store files, automata and suffix arrays, not tokenizers, text, processes or Ray.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from samctl.index.datastore import CorpusStats, DirectoryStore, StoreMeta, load_single, parse_meta, save_datastore
from samctl.index.kinds import KINDS, BuildOptions
from samctl.index.errors import ConfigError
from samctl.index.store import MANIFEST, DirectoryWriter, StoreError, file_crc32, path_bytes, read_manifest
from samctl.index.shard_structures import ShardedAutomaton, ShardedSuffixArray, children  # noqa: F401 (re-exported)

FORMAT = "samctl-sharded-store"
FORMAT_VERSION = 1
MAX_SHARDS = 4096
_REBUILD = "rebuild it with `samctl build --shards N`"
_SHARD_KEYS = {"file": str, "documents": int, "tokens": int, "bytes": int, "crc32": int}


def plan_shards(doc_offsets: np.ndarray, n: int) -> np.ndarray:
    """Document boundaries b of n shards ([n+1] int64, from 0 to d, strictly rising): shard i holds
    documents [b[i], b[i+1]), about total/n tokens each. doc_offsets: [d+1] int64."""
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
# the store directory


@dataclass(frozen=True)
class ShardedDatastore(DirectoryStore):
    shards: tuple[Any, ...]  # each shard's loaded store: a Datastore, or a directory kind's

    @property
    def file_size(self) -> int:
        return sum(int(s["bytes"]) for s in self.manifest["shards"]) + os.path.getsize(
            os.path.join(self.path, MANIFEST))

    @property
    def sam(self) -> ShardedAutomaton | ShardedSuffixArray:
        return self.structure

    def verify(self) -> None:
        for entry, shard in zip(self.manifest["shards"], self.shards):
            if _shard_crc32(shard.path) != entry["crc32"]:
                raise StoreError(f"{shard.path} does not match its checksum in {MANIFEST}: the shard is damaged, "
                                 f"{_REBUILD}")
            shard.verify()


def load_sharded(path: str | os.PathLike, verify: bool = False, occurrence: str = "first") -> ShardedDatastore:
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
        size = path_bytes(file)
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
    """Everything `load_sharded` checks with verify=True, one shard at a time (in the memory of one
    shard); returns the manifest."""
    name = str(path)
    manifest = _read_manifest(name)
    meta = parse_meta(manifest, os.path.join(name, MANIFEST))
    for entry in manifest["shards"]:
        file = os.path.join(name, entry["file"])
        if path_bytes(file) != entry["bytes"] or _shard_crc32(file) != entry["crc32"]:
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


def _shard_crc32(path: str) -> int:
    # a directory shard's manifest holds the crc32 of each of its files
    return file_crc32(os.path.join(path, MANIFEST) if os.path.isdir(path) else path)


class StoreDirectoryWriter(DirectoryWriter):
    def shard_path(self, index: int, kind: str = "sam") -> Path:
        return self.tmp / f"shard-{index:05d}.{kind}"

    def commit(self, meta: StoreMeta, entries: list[dict[str, Any]]) -> None:
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **meta.to_header(), "shards": entries}
        self.commit_manifest(manifest, [e["file"] for e in entries])


def build_shard(path: str | os.PathLike, tokens: np.ndarray, doc_offsets: np.ndarray, meta: StoreMeta,
                memory_limit: int | None = None) -> tuple[dict[str, Any], dict[str, int]]:
    """Build and write one shard over documents tokens[doc_offsets[i]:doc_offsets[i+1]] (tokens [n]
    int32, doc_offsets [d+1] int64): its manifest entry and counts. `meta` is the whole store's."""
    kind = KINDS[meta.build.kind]
    documents = len(doc_offsets) - 1
    inputs = (f"shard {os.path.basename(path)} of {', '.join(meta.corpus.inputs)}",)
    shard = dataclasses.replace(meta, corpus=CorpusStats(documents=documents, tokens=len(tokens), inputs=inputs))
    structure = kind.build(tokens, doc_offsets, shard, BuildOptions(path=str(path), memory_limit=memory_limit))
    if not kind.directory:
        save_datastore(path, structure, shard)
    entry = {"file": os.path.basename(path), "documents": int(documents), "tokens": int(len(tokens)),
             "bytes": path_bytes(str(path)), "crc32": _shard_crc32(str(path))}
    return entry, kind.counts(structure)

