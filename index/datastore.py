"""Datastores on disk: a structure of one kind (index/kinds.py) plus its `StoreMeta`, in a `.sam` file.

The header is untrusted: `parse_meta` type-checks every field, and `load_single` checks that every
token id the structure can draft is below the recorded vocabulary size, so a corrupt store cannot
feed the model an id it does not have. Header keys written here (besides the store format's own):
`kind`, `created_by`, `tokenizer`, `build`, `corpus` and, for a store over a model's own outputs
(`samctl distill`), `written_by`.

This module does not know text, tokenizers (only their recorded name and fingerprint), corpora
formats or the command line.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from samctl.index.errors import UserError
from samctl.index.kinds import KINDS
from samctl.index.lookup import Lookup
from samctl.index.ngram_config import NgramConfig
from samctl.index.store import StoreError, StoreFile, read_store, write_store

if TYPE_CHECKING:
    from samctl.index.automaton import SuffixAutomaton
    from samctl.index.ngram import NgramTable

# The structures' modules (and numba with them) are imported in index/kinds.py, not here: reading a
# store's header (`samctl info`) stays light.
Structure = Union["SuffixAutomaton", "NgramTable"]
_REBUILD = "rebuild it with samctl build"


def _created_by() -> str:
    try:
        return f"samctl {metadata.version('samctl')}"
    except metadata.PackageNotFoundError:
        return "samctl (unknown version)"


@dataclass(frozen=True)
class BuildConfig:
    """How a store was built; recorded in its header so `samctl info` can say."""

    kind: str = "sam"  # an entry of index/kinds.py's KINDS: "sam", "ngram" or "sa"
    max_n: int = 4  # n-gram only: longest context
    min_count: int = 2  # n-gram only: prune entries seen fewer times
    top_k: int = 8  # n-gram only: next tokens kept per context
    compress: bool = True  # zstd-compress blobs where it saves >= 10%
    append_eos: bool = True  # an EOS token after each document (when the tokenizer has one)
    include: tuple[str, ...] = ()  # folder globs that replace the default extension list
    exclude: tuple[str, ...] = ()  # folder globs left out
    fields: tuple[str, ...] = ()  # record fields read instead of the known shapes

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"unknown datastore kind {self.kind!r}: use one of {', '.join(KINDS)}")
        self.ngram_config()  # validates max_n, min_count, top_k
        for name in ("include", "exclude", "fields"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def ngram_config(self) -> NgramConfig:
        return NgramConfig(max_n=self.max_n, min_count=self.min_count, top_k=self.top_k)

    def to_dict(self) -> dict[str, Any]:
        return _as_dict(self)

    def settings(self) -> dict[str, Any]:
        """`to_dict` without the settings of the other kind (an automaton has no n-gram sizes)."""
        settings = self.to_dict()
        if self.kind != "ngram":
            for name in (f.name for f in dataclasses.fields(NgramConfig)):
                settings.pop(name, None)
        return settings


@dataclass(frozen=True)
class CorpusStats:
    """What went into a store."""

    documents: int  # non-empty documents
    tokens: int  # token ids stored, EOS separators included
    characters: int = 0
    files: int = 0
    empty_documents: int = 0  # dropped because blank
    skipped_files: int = 0  # binary or non-UTF-8 files left out of folders
    inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))

    def to_dict(self) -> dict[str, Any]:
        return _as_dict(self)


def _as_dict(config: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


@dataclass(frozen=True)
class StoreMeta:
    """Everything about a store except its structure."""

    tokenizer_name: str  # "bytes", "default" (the embedded model's), a folder or a model name
    tokenizer_fingerprint: str
    vocab_size: int
    eos_token_id: int | None
    build: BuildConfig
    corpus: CorpusStats
    created_by: str = field(default_factory=_created_by)
    written_by: dict[str, str] = field(default_factory=dict)  # model, decoding, prompts of a distilled store

    def to_header(self) -> dict[str, Any]:
        written = {"written_by": dict(self.written_by)} if self.written_by else {}
        tokenizer = {"name": self.tokenizer_name, "fingerprint": self.tokenizer_fingerprint,
                     "vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id}
        return {**written, "kind": self.build.kind, "created_by": self.created_by, "tokenizer": tokenizer,
                "build": self.build.to_dict(), "corpus": self.corpus.to_dict()}


@dataclass(frozen=True)
class Datastore:
    path: str
    kind: str
    structure: Structure
    meta: StoreMeta
    file: StoreFile

    @property
    def format_version(self) -> int:
        return self.file.format_version

    @property
    def file_size(self) -> int:
        return self.file.file_size

    @property
    def sam(self) -> SuffixAutomaton:
        if self.kind != "sam":
            raise UserError(f"{self.path} is an n-gram store, not a suffix automaton: "
                            "rebuild it with `samctl build --kind sam`")
        return self.structure

    @property
    def ngram(self) -> NgramTable:
        if self.kind != "ngram":
            raise UserError(f"{self.path} is a suffix automaton store, not an n-gram table: "
                            "rebuild it with `samctl build --kind ngram`")
        return self.structure

    def verify(self) -> None:  # raw blobs are not checked on load
        self.file.verify()

    def lookup(self, context: np.ndarray, n: int, k: int = 8) -> Lookup:
        """Longest suffix of context ([m] int32) in the store, then up to n tokens after it."""
        return KINDS[self.kind].lookup(self.structure, np.asarray(context, dtype=np.int32), n, k)


@dataclass(frozen=True)
class DirectoryStore:
    """A loaded store directory (index/suffix_array.py, index/sharded.py): the same surface as
    `Datastore` for the commands and drafters."""

    path: str
    kind: str
    structure: Any
    meta: StoreMeta
    manifest: dict[str, Any]

    @property
    def format_version(self) -> int:
        return int(self.manifest["format_version"])

    def lookup(self, context: np.ndarray, n: int, k: int = 8) -> Lookup:
        return self.structure.lookup(context, n, k)


def save_datastore(path: str | os.PathLike, structure: Structure, meta: StoreMeta,
                   compress: bool | None = None) -> None:
    if KINDS[meta.build.kind].directory:
        raise ValueError(f"a {meta.build.kind} store is a directory its builder writes, not a store file")
    compress = meta.build.compress if compress is None else compress
    write_store(path, meta.to_header(), structure.to_arrays(), compress=compress)


def load_single(path: str | os.PathLike, verify: bool = False, occurrence: str = "first") -> Datastore:
    """Read and validate one `.sam` file (index/load.py's `load_datastore` opens any store)."""
    store, meta = read_meta(path, verify=verify)
    arrays = store.arrays
    kind = KINDS[meta.build.kind]
    if kind.directory:
        raise StoreError(f"{store.path} declares kind {kind.name!r}, whose stores are directories: {_REBUILD}")
    try:
        structure: Structure = kind.from_arrays(arrays, meta, occurrence, verify)  # numba loads here
    except UserError as err:
        raise StoreError(f"{store.path}: {err}") from err
    _check_token_range(store.path, meta, arrays)
    return Datastore(path=store.path, kind=meta.build.kind, structure=structure, meta=meta, file=store)


def read_meta(path: str | os.PathLike, verify: bool = False) -> tuple[StoreFile, StoreMeta]:
    """The store file and its validated header, without loading the structure (`samctl info`)."""
    store = read_store(path, verify=verify)
    return store, parse_meta(store.header, store.path)


def structure_counts(store: StoreFile, kind: str) -> dict[str, int]:
    """The size of a store's structure from its arrays' shapes and counters, without loading it."""
    return KINDS[kind].file_counts(store.arrays)


def parse_meta(header: dict[str, Any], name: str) -> StoreMeta:
    """StoreMeta from an untrusted header map (a store's, or a sharded store's manifest)."""

    def bad(what: str) -> StoreError:
        return StoreError(f"{name} has a malformed header ({what}): {_REBUILD}")

    kind = header.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise bad(f"unknown kind {kind!r}")
    tokenizer = _typed_map(header.get("tokenizer"), "tokenizer", {
        "name": str, "fingerprint": str, "vocab_size": int, "eos_token_id": (int, type(None))}, bad)
    if not 0 < tokenizer["vocab_size"] < 2**31:
        raise bad(f"vocabulary size {tokenizer['vocab_size']}")
    build = _dataclass_from(BuildConfig, header.get("build"), "build", bad)
    if build.kind != kind:
        raise bad(f"kind {kind!r} disagrees with the build config's {build.kind!r}")
    corpus = _dataclass_from(CorpusStats, header.get("corpus"), "corpus", bad)
    created_by = header.get("created_by")
    if not isinstance(created_by, str):
        raise bad("created_by")
    written_by = header.get("written_by", {})
    if not isinstance(written_by, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in written_by.items()):
        raise bad("written_by is not a map of text")
    return StoreMeta(tokenizer_name=tokenizer["name"], tokenizer_fingerprint=tokenizer["fingerprint"],
                     vocab_size=tokenizer["vocab_size"], eos_token_id=tokenizer["eos_token_id"], build=build,
                     corpus=corpus, created_by=created_by, written_by=written_by)


_FIELD_TYPES = {"str": str, "int": int, "bool": bool, "tuple[str, ...]": list, "int | None": (int, type(None))}


def _dataclass_from(cls, data: Any, what: str, bad) -> Any:
    types = {f.name: _FIELD_TYPES[f.type] for f in dataclasses.fields(cls)}
    values = _typed_map(data, what, types, bad)
    for key, value in values.items():
        if isinstance(value, list):
            if not all(isinstance(item, str) for item in value):
                raise bad(f"{what}.{key} is not a list of strings")
            values[key] = tuple(value)
    try:
        return cls(**values)
    except UserError as err:
        raise bad(f"{what}: {err}") from err


def _typed_map(data: Any, what: str, types: dict[str, Any], bad) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise bad(f"{what} is not a map")
    values = {}
    for key, expected in types.items():
        if key not in data:
            raise bad(f"{what}.{key} is missing")
        value = data[key]
        # bool is an int subclass: keep true/false out of integer fields and vice versa
        if isinstance(value, bool) and expected is not bool:
            raise bad(f"{what}.{key} has type bool")
        if not isinstance(value, expected):
            raise bad(f"{what}.{key} has type {type(value).__name__}")
        values[key] = value
    return values


def _check_token_range(name: str, meta: StoreMeta, arrays: dict[str, np.ndarray]) -> None:
    columns = KINDS[meta.build.kind].token_columns(arrays)
    highest = max((int(c.max()) for c in columns if len(c)), default=-1)
    if highest >= meta.vocab_size:
        raise StoreError(f"{name} holds token id {highest}, outside its tokenizer's vocabulary of "
                         f"{meta.vocab_size}: the file is corrupt, {_REBUILD}")
