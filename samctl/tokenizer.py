"""Tokenizers for building and querying stores: a Hugging Face tokenizer or a byte-level one.

`load_tokenizer(spec)` resolves what the user named:
- None: the embedded default model's tokenizer (samctl/models/default/target) when it is
  installed, else the byte-level tokenizer; either way one line on stderr says so;
- "bytes": the byte-level tokenizer (ids 0-255 are UTF-8 bytes, 256 is EOS);
- "default": the embedded default model's tokenizer;
- a local tokenizer folder, or a name the Hugging Face cache already holds (never downloads);
- a `.gguf` model file: its tokenizer, from the folder samctl/gguf_cache.py dequantizes it to.

A tokenizer's fingerprint is a hash of its vocabulary (every token -> id pair, added and special
tokens included), so two tokenizers that map text to the same ids share it whatever their name.
Stores record name and fingerprint; `load_store_tokenizer` loads the tokenizer a store names and
refuses one whose fingerprint differs, and `check_store_tokenizer` does the same for a tokenizer
the caller already holds (the model's, in `generate`).

transformers is imported only when a Hugging Face tokenizer is loaded: the byte-level path stays
light. This module does not know stores' file format or decoding.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import click
import numpy as np

from index.datastore import StoreMeta
from index.errors import UserError
from samctl.gguf_cache import is_gguf, model_folder

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "models" / "default" / "target"
BYTES = "bytes"
DEFAULT = "default"


class Tokenizer(Protocol):
    name: str  # what a store records to find the tokenizer again
    fingerprint: str
    vocab_size: int  # ids are in [0, vocab_size)
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:16]


def tokenizer_fingerprint(hf_tokenizer: Any) -> str:
    """Stable hash of a Hugging Face tokenizer's vocabulary, added and special tokens included."""
    pairs = sorted(hf_tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return _digest(json.dumps(pairs, ensure_ascii=False).encode("utf-8"))


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, EOS = 256. Needs no files; used when no model is at hand."""

    name = BYTES
    vocab_size = 257
    eos_token_ids = (256,)
    fingerprint = _digest(b"samctl byte-level tokenizer v1: ids 0-255 = bytes, 256 = eos")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer seen through the Tokenizer protocol (no special tokens added)."""

    def __init__(self, hf_tokenizer: Any, name: str) -> None:
        self.hf = hf_tokenizer
        self.name = name
        self.fingerprint = tokenizer_fingerprint(hf_tokenizer)
        self.vocab_size = len(hf_tokenizer)
        eos = hf_tokenizer.eos_token_id
        self.eos_token_ids = () if eos is None else (int(eos),)
        # None: not yet known whether the Rust backend alone gives the same ids as __call__.
        self._backend_ok: bool | None = None if hasattr(hf_tokenizer, "backend_tokenizer") else False

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text. The backend's batch encoder is about twice as fast as __call__; it is
        used once it gave the same ids as __call__ on a first batch (wrappers may preprocess)."""
        texts = list(texts)
        if self._backend_ok:
            return self._backend_batch(texts)
        ids = self.hf(texts, add_special_tokens=False, verbose=False)["input_ids"]
        if self._backend_ok is None and texts:
            self._backend_ok = self._backend_batch(texts) == ids
        return ids

    def _backend_batch(self, texts: list[str]) -> list[list[int]]:
        backend = self.hf.backend_tokenizer
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids))


def load_tokenizer(spec: str | None) -> Tokenizer:
    """The tokenizer `spec` names (see the module docstring); UserError when it cannot be found."""
    if spec is None:
        if DEFAULT_MODEL_DIR.is_dir():
            click.echo(f"samctl: using the embedded default tokenizer ({DEFAULT_MODEL_DIR}); "
                       "pass --tokenizer to choose another", err=True)
            return _load_hf(str(DEFAULT_MODEL_DIR), DEFAULT)
        click.echo("samctl: using the byte-level tokenizer (no embedded default model is "
                   "installed); pass --tokenizer to choose another", err=True)
        return ByteTokenizer()
    if spec == BYTES:
        return ByteTokenizer()
    if spec == DEFAULT:
        if not DEFAULT_MODEL_DIR.is_dir():
            raise UserError(f"the embedded default model is not installed ({DEFAULT_MODEL_DIR} "
                            "is missing): pass --tokenizer with a local tokenizer folder")
        return _load_hf(str(DEFAULT_MODEL_DIR), DEFAULT)
    path = Path(spec).expanduser()
    if is_gguf(spec):
        return _load_hf(model_folder(spec), str(path.resolve()))
    if path.is_dir():
        return _load_hf(str(path), str(path.resolve()))
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise UserError(f"tokenizer folder {spec} does not exist (or is not a folder): pass a "
                        "folder holding tokenizer.json or tokenizer_config.json")
    return _load_hf(spec, spec)


def _load_hf(source: str, name: str) -> HFTokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise UserError(f"loading tokenizer {name} needs transformers: pip install transformers") from err
    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, ImportError, KeyError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = "folder" if os.path.isdir(source) else "name"
        raise UserError(f"tokenizer {name} not found locally (offline) or not loadable "
                        f"({reason[:200]}): pass a local tokenizer {where} that transformers "
                        "can load, e.g. one written by save_pretrained") from err
    return HFTokenizer(hf_tokenizer, name)


def check_store_tokenizer(meta: StoreMeta, store_path: str, fingerprint: str, name: str) -> None:
    """Refuse a tokenizer whose ids differ from the store's: drafts would be other tokens."""
    if fingerprint != meta.tokenizer_fingerprint:
        raise UserError(
            f"{store_path} was built with tokenizer {meta.tokenizer_name} (fingerprint "
            f"{meta.tokenizer_fingerprint}), but {name} has fingerprint {fingerprint}: use the "
            f"store's tokenizer, or rebuild the store with --tokenizer {name}")


def load_store_tokenizer(meta: StoreMeta, store_path: str, spec: str | None = None) -> Tokenizer:
    """The tokenizer a store was built with: `spec` if given, else the one the store names."""
    if spec is None:
        try:
            tokenizer = load_tokenizer(meta.tokenizer_name)
        except UserError as err:
            raise UserError(f"{store_path} was built with tokenizer {meta.tokenizer_name}, which "
                            "cannot be loaded here: pass --tokenizer with a local copy of it "
                            f"(fingerprint {meta.tokenizer_fingerprint})") from err
    else:
        tokenizer = load_tokenizer(spec)
    check_store_tokenizer(meta, store_path, tokenizer.fingerprint, tokenizer.name)
    return tokenizer


def tokenize_documents(
    texts: Iterable[str],
    tokenizer: Tokenizer,
    append_eos: bool = True,
    on_tokens: Callable[[int], None] | None = None,
    batch_chars: int = 1 << 20,
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize documents in batches of about `batch_chars` characters.

    Returns tokens [n] int32 (documents concatenated, each followed by the tokenizer's first EOS
    id when `append_eos` and it has one) and doc_offsets [d+1] int64 (document i is
    tokens[doc_offsets[i]:doc_offsets[i+1]]). `on_tokens(k)` reports progress after each batch.
    """
    if tokenizer.vocab_size > np.iinfo(np.int32).max:
        raise UserError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, over int32")
    eos = [tokenizer.eos_token_ids[0]] if append_eos and tokenizer.eos_token_ids else []
    chunks: list[np.ndarray] = []
    lengths: list[int] = []

    def flush(batch: list[str]) -> None:
        ids = tokenizer.encode_batch(batch)
        sizes = [len(x) + len(eos) for x in ids]
        flat = itertools.chain.from_iterable(x + eos for x in ids) if eos else itertools.chain.from_iterable(ids)
        chunks.append(np.fromiter(flat, dtype=np.int32, count=sum(sizes)))
        lengths.extend(sizes)
        if on_tokens is not None:
            on_tokens(int(sum(sizes)))

    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= batch_chars:
            flush(batch)
            batch, size = [], 0
    if batch:
        flush(batch)
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    doc_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=doc_offsets[1:])
    return tokens, doc_offsets
