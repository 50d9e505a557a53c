"""Tokenizers for building and querying stores: a Hugging Face tokenizer or a byte-level one.

`load_tokenizer(spec)` takes None (the embedded default's, else bytes; a note says which),
"bytes" (ids 0-255 are UTF-8 bytes, 256 is EOS), "default", a local folder, a name the Hugging Face
cache already holds (never downloads), or a `.gguf` file. A fingerprint hashes the vocabulary
(every token -> id pair), so tokenizers that map text to the same ids share it whatever their name.
A tokenizer.json that `tokenizers` reads exactly as transformers would is loaded without
transformers and torch (FastTokenizer: seconds and hundreds of MB saved in `build` and `query`).
`tokenize_documents` cuts a long document, for a `split_safe` tokenizer only, where the
pre-tokenizer cuts anyway (`split_text`): no token changes and memory stays bounded (other
tokenizers, e.g. SentencePiece or Llama-3's, get each document whole).
This module does not know stores' file format or decoding.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np

from samctl.index.datastore import StoreMeta
from samctl.index.errors import ConfigError, Note, UserError
from samctl.gguf_cache import cached_folder, first_line, is_gguf, model_folder

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "models" / "default" / "target"
BYTES = "bytes"
DEFAULT = "default"
# tokenizer_config.json classes whose encoding is their tokenizer.json's, unchanged.
BACKEND_CLASSES = frozenset(["TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast"])


class Tokenizer(Protocol):
    name: str  # what a store records to find the tokenizer again
    fingerprint: str
    vocab_size: int  # ids are in [0, vocab_size)
    eos_token_ids: tuple[int, ...]
    split_safe: bool  # split_text's cuts leave every token unchanged (see the module docstring)

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """ConfigError without a chat template."""


def chat_ids(hf_tokenizer: Any, messages: list[dict[str, str]], owner: str) -> list[int]:
    """The conversation through a transformers chat template, the assistant's turn opened: the one
    chat encoding of generate, chat, bench and simulate."""
    if not getattr(hf_tokenizer, "chat_template", None):
        raise ConfigError("{owner} has no chat template: drop {chat}", owner=owner)
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:16]


def tokenizer_fingerprint(hf_tokenizer: Any) -> str:
    return _vocab_fingerprint(hf_tokenizer.get_vocab())


def _vocab_fingerprint(vocab: dict[str, int]) -> str:
    pairs = sorted(vocab.items(), key=lambda item: (item[1], item[0]))
    return _digest(json.dumps(pairs, ensure_ascii=False).encode("utf-8"))


def _backend_split_safe(backend: Any) -> bool:
    """Whether split_text's cuts are pre-tokenizer boundaries of this `tokenizers.Tokenizer`:
    byte-level BPE with the GPT-2 regex, no normalizer, no prefix space, and no added token that
    holds whitespace or strips it around itself."""
    from tokenizers import pre_tokenizers

    pre = backend.pre_tokenizer
    if backend.normalizer is not None or not isinstance(pre, pre_tokenizers.ByteLevel):
        return False
    added = backend.get_added_tokens_decoder().values()
    return pre.use_regex and not pre.add_prefix_space and not any(
        t.lstrip or t.rstrip or any(c.isspace() for c in t.content) for t in added)


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, EOS = 256; needs no files."""

    name = BYTES
    vocab_size = 257
    eos_token_ids = (256,)
    split_safe = True  # one id per byte: any cut is exact
    fingerprint = _digest(b"samctl byte-level tokenizer v1: ids 0-255 = bytes, 256 = eos")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_ids(None, messages, f"tokenizer {self.name}")


class HFTokenizer:
    """A transformers tokenizer as a Tokenizer (no special tokens added)."""

    def __init__(self, hf_tokenizer: Any, name: str) -> None:
        self.hf = hf_tokenizer
        self.name = name
        self.fingerprint = tokenizer_fingerprint(hf_tokenizer)
        self.vocab_size = len(hf_tokenizer)
        eos = hf_tokenizer.eos_token_id
        self.eos_token_ids = () if eos is None else (int(eos),)
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self.split_safe = backend is not None and _backend_split_safe(backend)
        # None: not yet known whether the Rust backend alone gives the same ids as __call__.
        self._backend_ok: bool | None = None if hasattr(hf_tokenizer, "backend_tokenizer") else False

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The backend's batch encoder is about twice as fast as __call__; it is used once it gave
        the same ids as __call__ on a first batch (wrappers may preprocess)."""
        texts = list(texts)
        if self._backend_ok:
            return self._backend_batch(texts)
        ids = self.hf(texts, add_special_tokens=False, verbose=False)["input_ids"]
        if self._backend_ok is None and texts:
            self._backend_ok = self._backend_batch(texts) == ids
        return ids

    def _backend_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_ids(self.hf, messages, f"tokenizer {self.name}")


class FastTokenizer:
    """A tokenizer.json read by `tokenizers` alone: the same ids, vocabulary, EOS and fingerprint as
    HFTokenizer gives for the classes in BACKEND_CLASSES."""

    def __init__(self, backend: Any, name: str, eos_token: str | None, folder: str) -> None:
        self.backend = backend
        self.name = name
        self.folder = folder
        self.fingerprint = _vocab_fingerprint(backend.get_vocab(with_added_tokens=True))
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        eos = backend.token_to_id(eos_token) if eos_token is not None else None
        self.eos_token_ids = () if eos is None else (int(eos),)
        self.split_safe = _backend_split_safe(backend)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self._transformers.encode_chat(messages)

    @functools.cached_property
    def _transformers(self) -> HFTokenizer:
        # Chat templates are rendered by transformers alone: only a chat loads it.
        return _load_hf(self.folder, self.name, fast=False)


def _load_fast(folder: str, name: str) -> FastTokenizer | None:
    """None unless transformers would encode and decode with the file's pipeline unchanged."""
    files = Path(folder) / "tokenizer.json", Path(folder) / "tokenizer_config.json"
    if not all(f.is_file() for f in files):
        return None
    try:
        config = json.loads(files[1].read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # transformers will say what is wrong with it
    if not isinstance(config, dict) or config.get("tokenizer_class") not in BACKEND_CLASSES:
        return None
    if config.get("clean_up_tokenization_spaces"):  # transformers' decode would rewrite spaces
        return None
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is not None and not isinstance(eos, str):
        return None
    try:
        from tokenizers import Tokenizer as RustTokenizer

        backend = RustTokenizer.from_file(str(files[0]))
    except Exception:  # noqa: BLE001 - any failure falls back to transformers, which reports it
        return None
    if not _same_backend_as_transformers(backend, config):
        return None
    return FastTokenizer(backend, name, eos, folder)


def _same_backend_as_transformers(backend: Any, config: dict) -> bool:
    """Whether transformers would encode and decode with `backend` unchanged. GPT2Tokenizer keeps
    the file's vocabulary and merges but sets its own pre-tokenizer (ByteLevel with the GPT-2 regex
    and the config's add_prefix_space) and ByteLevel decoder; the other BACKEND_CLASSES keep the
    file's pipeline, and a config's add_prefix_space is taken as a request to rewrite the
    pre-tokenizer (older transformers did) unless the file's ByteLevel already has that value."""
    from tokenizers import decoders, pre_tokenizers

    pre = backend.pre_tokenizer
    byte_level = isinstance(pre, pre_tokenizers.ByteLevel)
    if config.get("tokenizer_class") in ("GPT2Tokenizer", "GPT2TokenizerFast"):
        return (byte_level and pre.use_regex and backend.normalizer is None
                and pre.add_prefix_space == bool(config.get("add_prefix_space", False))
                and isinstance(backend.decoder, decoders.ByteLevel))
    if "add_prefix_space" in config:
        return byte_level and pre.add_prefix_space == bool(config["add_prefix_space"])
    return True


def load_tokenizer(spec: str | None, light: bool = False) -> Tokenizer | None:
    """UserError when it cannot be found. With `light` (`query --ids`, where the text is a
    courtesy), None where loading it would take transformers or dequantizing a .gguf file."""
    if spec is None:
        if DEFAULT_MODEL_DIR.is_dir():
            log.info(Note("using the embedded default tokenizer ({folder}); pass {tokenizer} to choose another",
                          folder=DEFAULT_MODEL_DIR))
            return _load_hf(str(DEFAULT_MODEL_DIR), DEFAULT, light)
        log.info(Note("using the byte-level tokenizer (no embedded default model is installed); pass {tokenizer} to "
                      "choose another"))
        return ByteTokenizer()
    if spec == BYTES:
        return ByteTokenizer()
    if spec == DEFAULT:
        if not DEFAULT_MODEL_DIR.is_dir():
            raise ConfigError("the embedded default model is not installed ({folder} is missing): pass {tokenizer} "
                              "with a local tokenizer folder", folder=DEFAULT_MODEL_DIR)
        return _load_hf(str(DEFAULT_MODEL_DIR), DEFAULT, light)
    path = Path(spec).expanduser()
    if is_gguf(spec):
        folder = cached_folder(spec) if light else model_folder(spec)
        return _load_hf(folder, str(path.resolve()), light) if folder is not None else None
    if path.is_dir():
        return _load_hf(str(path), str(path.resolve()), light)
    if path.exists() or is_path_like(spec):
        raise UserError(f"tokenizer folder {spec} does not exist (or is not a folder): pass a "
                        "folder holding tokenizer.json or tokenizer_config.json")
    return _load_hf(spec, spec, light)


def is_path_like(spec: str) -> bool:
    """Whether a model or tokenizer name can only be a local path, never a hub name (`org/name`)."""
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1 or is_gguf(spec)


def _load_hf(source: str, name: str, light: bool = False, fast: bool = True) -> HFTokenizer | FastTokenizer | None:
    if fast and os.path.isdir(source):
        fast = _load_fast(source, name)
        if fast is not None:
            return fast
    if light:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise UserError(f"loading tokenizer {name} needs transformers: pip install transformers") from err
    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, ImportError, KeyError) as err:
        where = "folder" if os.path.isdir(source) else "name"
        raise UserError(f"tokenizer {name} not found locally (offline) or not loadable "
                        f"({first_line(err)}): pass a local tokenizer {where} that transformers "
                        "can load, e.g. one written by save_pretrained") from err
    return HFTokenizer(hf_tokenizer, name)


def check_store_tokenizer(meta: StoreMeta, store_path: str, fingerprint: str, name: str, model: bool = False) -> None:
    """Refuse a tokenizer whose ids differ from the store's: drafts would be other tokens. With
    `model` (`name` is the model about to run), a store built with a model's tokenizer (a .gguf
    file or a model folder found here) says to run that model."""
    if fingerprint == meta.tokenizer_fingerprint:
        return
    built = meta.tokenizer_name
    mismatch = (f"{store_path} was built with tokenizer {built} (fingerprint {meta.tokenizer_fingerprint}), "
                f"but {name} has fingerprint {fingerprint}")
    if model and (Path(built).is_file() if is_gguf(built) else (Path(built) / "config.json").is_file()):
        raise ConfigError("{mismatch}: pass {model} {built} (the model it was built with), or rebuild the store "
                          "with `samctl build --tokenizer {name}`", mismatch=mismatch, built=built, name=name)
    raise UserError(f"{mismatch}: use the store's tokenizer, or rebuild the store with `samctl build --tokenizer {name}`")


def load_store_tokenizer(meta: StoreMeta, store_path: str, spec: str | None = None,
                         light: bool = False) -> Tokenizer | None:
    """`spec`, else the tokenizer the store names, refused if its fingerprint differs; with `light`,
    None where only transformers could load it."""
    if spec is None:
        try:
            tokenizer = load_tokenizer(meta.tokenizer_name, light=light)
        except UserError as err:
            raise ConfigError("{path} was built with tokenizer {name}, which cannot be loaded here: pass {tokenizer} "
                              "with a local copy of it (fingerprint {fingerprint})", path=store_path,
                              name=meta.tokenizer_name, fingerprint=meta.tokenizer_fingerprint) from err
    else:
        tokenizer = load_tokenizer(spec, light=light)
    if tokenizer is None:
        return None
    check_store_tokenizer(meta, store_path, tokenizer.fingerprint, tokenizer.name)
    return tokenizer


# A cut position p in a text: a space that starts a word after a non-space ("foo| bar"), or a
# position after a newline that follows a non-space and precedes one ("foo\n|bar"). Under the
# GPT-2 pre-tokenizer regex no pre-token spans such a position (none holds a non-space followed by
# a space, or a newline followed by a non-space), and the one that starts there is matched the same
# from the cut as from the document's start, so tokenizing the pieces gives the document's tokens.
_CUT = re.compile(r"(?<=\S)(?= [^\W\d_])|(?<=\S\n)(?=\S)")


def split_text(text: str, max_chars: int) -> Iterator[str]:
    """`text` in pieces of at most about `max_chars` characters, each cut at the last _CUT
    position of its window (or, when a window has none, the first one after it: a text without
    any cut stays whole). "".join(pieces) == text; an empty text gives one empty piece."""
    if max_chars < 2:
        raise ValueError(f"max_chars must be >= 2, got {max_chars}")
    start = 0
    while len(text) - start > max_chars:
        end = start + max_chars
        cut = None
        for match in _CUT.finditer(text, start + 1, end + 1):
            cut = match.start()
        if cut is None:
            match = _CUT.search(text, end)
            if match is None:
                break
            cut = match.start()
        yield text[start:cut]
        start = cut
    yield text[start:]


def tokenize_documents(texts: Iterable[str], tokenizer: Tokenizer, append_eos: bool = True,
                       on_batch: Callable[[int, int], None] | None = None, batch_chars: int = 1 << 20,
                       piece_chars: int = 1 << 16) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [n] int32: documents concatenated, each followed by the first EOS id when
    `append_eos`; doc_offsets [d+1] int64: document i is tokens[doc_offsets[i]:doc_offsets[i+1]]).
    `on_batch(documents, tokens)`: progress since the last call, after each batch."""
    if tokenizer.vocab_size > np.iinfo(np.int32).max:
        raise UserError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, over int32")
    eos = [tokenizer.eos_token_ids[0]] if append_eos and tokenizer.eos_token_ids else []
    chunks: list[np.ndarray] = []
    lengths: list[int] = []  # tokens per document, EOS included
    batch: list[tuple[str, int, bool]] = []  # (piece, its document's index, last piece of it)
    size = 0

    def flush() -> None:
        ids = tokenizer.encode_batch([piece for piece, _, _ in batch])
        count = 0
        for x, (_, doc, last) in zip(ids, batch):
            if last:
                x.extend(eos)
            lengths[doc] += len(x)
            count += len(x)
        chunks.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=count))
        if on_batch is not None:
            on_batch(sum(last for _, _, last in batch), count)
        batch.clear()

    def add(piece: str, last: bool) -> None:
        nonlocal size
        batch.append((piece, len(lengths) - 1, last))
        size += len(piece)
        if size >= batch_chars:
            flush()
            size = 0

    for text in texts:
        lengths.append(0)
        pieces = split_text(text, piece_chars) if tokenizer.split_safe else iter((text,))
        piece = next(pieces)
        for following in pieces:
            add(piece, last=False)
            piece = following
        add(piece, last=True)
    if batch:
        flush()
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    chunks.clear()  # the copies are in `tokens` now
    return tokens, np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).astype(np.int64)
