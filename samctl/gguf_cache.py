"""`.gguf` files as models: dequantized once by transformers (the `gguf` extra), then cached as an
ordinary folder (float32 safetensors, tokenizer, generation config) that `from_pretrained` loads.

Cache layout, under `cache_dir()`:
    models/<sha256 of the .gguf file>/     the folder, renamed into place only once complete
    stat/<key of path, size, mtime>        the file's sha256, so an unchanged file is not rehashed

The header is untrusted input: a bad, truncated or unsupported file, or a missing extra, is a
one-line UserError. This module knows files and transformers' loaders, not decoding.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from samctl.index.errors import UserError
from samctl.progress import progress_enabled

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SUFFIX = ".gguf"
SOURCE_FILE = "samctl-source.json"  # written last into a cached folder: where it came from
EXTRA_HINT = "pip install 'samctl[gguf]' (or: pip install gguf accelerate)"


def is_gguf(spec: str | None) -> bool:
    return spec is not None and spec.lower().endswith(SUFFIX)


def cache_dir() -> Path:
    """$SAMCTL_CACHE, else $XDG_CACHE_HOME/samctl, else ~/.cache/samctl."""
    if os.environ.get("SAMCTL_CACHE"):
        return Path(os.environ["SAMCTL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "samctl"


def cached_folder(spec: str) -> str | None:
    """The folder of a .gguf file already dequantized, else None (nothing is converted)."""
    path = Path(spec).expanduser()
    check_header(path)
    folder = cache_dir() / "models" / file_digest(path)
    return str(folder) if (folder / SOURCE_FILE).is_file() else None


def model_folder(spec: str) -> str:
    """The folder transformers should load for `spec`: `spec` itself unless it names a .gguf file."""
    if not is_gguf(spec):
        return spec
    path = Path(spec).expanduser()
    check_header(path)
    digest = file_digest(path)
    folder = cache_dir() / "models" / digest
    if (folder / SOURCE_FILE).is_file():
        return str(folder)
    require_extra()
    arch = supported_architecture(path)
    log.info(f"dequantizing {path.name} once (tens of seconds); later runs load the cached copy in {folder}")
    _convert(path, digest, arch, folder)
    return str(folder)


def check_header(path: Path) -> None:
    # before hashing or importing anything
    if not path.is_file():
        raise UserError(f"model file {path} does not exist: pass the path of a .gguf file "
                        "(`samctl fetch smollm2` fetches one) or a model folder")
    with path.open("rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise UserError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}): "
                        "pass a .gguf model file or a model folder")


def require_extra() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"loading a .gguf model needs {' and '.join(missing)} (the gguf extra): {EXTRA_HINT}")


def file_digest(path: Path) -> str:
    """sha256 of the file, remembered per (path, size, mtime)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    stamp = cache_dir() / "stat" / key
    if stamp.is_file():
        digest = stamp.read_text(encoding="ascii").strip()
        if len(digest) == 64:
            return digest
    digest = sha256_of(path)
    write_text_atomically(stamp, digest + "\n")
    return digest


def sha256_of(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            hasher.update(block)
    return hasher.hexdigest()


def supported_architecture(path: Path) -> str:
    """The file's `general.architecture`, which transformers must have a GGUF mapping for."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = _plain_reader()(path)  # parses every tensor's extent: a truncated file fails here
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
    except (ValueError, KeyError, IndexError, OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is a damaged or truncated GGUF file ({first_line(err)}): fetch it again "
                        "(`samctl fetch smollm2` checks the sha256)") from err
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise UserError(f"{path} holds a {arch} model, which transformers {transformers.__version__} cannot "
                        f"read from GGUF (it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}): "
                        "convert the model to a Hugging Face folder and pass that")
    return arch


def _convert(path: Path, digest: str, arch: str, folder: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}.", dir=folder.parent))
    try:
        try:
            with gguf_reading():
                tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
                quantized = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                 dtype=torch.float32)
        except (ValueError, KeyError, OSError, RuntimeError, NotImplementedError) as err:
            raise UserError(f"transformers cannot load {path} ({first_line(err)}): pass a model folder "
                            "instead, or a GGUF file of a supported architecture") from err
        # A model loaded from GGUF refuses save_pretrained ("quantized with gguf"); an unquantized
        # copy of its config with the same (already dequantized) weights saves normally.
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict())
        plain.generation_config = quantized.generation_config
        plain.save_pretrained(work)
        tokenizer.save_pretrained(work)
        source = {"gguf": str(path.resolve()), "sha256": digest, "architecture": arch,
                  "transformers": transformers.__version__}
        (work / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n", encoding="utf-8")
        try:
            work.rename(folder)
        except OSError:
            if not (folder / SOURCE_FILE).is_file():  # not another process winning the same race
                raise
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


@contextmanager
def gguf_reading() -> Iterator[None]:
    """transformers' per-tensor tqdm bar on terminals only (pipes and logs get no carriage
    returns), and gguf's reader over a plain array of the mapped file (`_plain_reader`)."""
    import gguf
    from tqdm.auto import tqdm
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    reader, saved = _plain_reader(), (gguf_utils.tqdm, gguf.GGUFReader)
    gguf_utils.tqdm = functools.partial(tqdm, disable=not progress_enabled(quiet=False), leave=False)
    gguf.GGUFReader = reader  # transformers imports it from gguf at each load
    try:
        yield
    finally:
        gguf_utils.tqdm, gguf.GGUFReader = saved


@functools.lru_cache(maxsize=1)
def _plain_reader() -> type:
    """gguf's GGUFReader over a plain ndarray view of its np.memmap, whose __getitem__ costs about
    2 µs more per index, a few per vocabulary string (SmolLM2: 3.2 s a reader, 1.1 s this way; a
    GGUF load makes three). The bytes read are the same."""
    import numpy as np
    from gguf import GGUFReader

    class PlainReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)

    return PlainReader


def write_text_atomically(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    with os.fdopen(handle, "w", encoding="ascii") as sink:
        sink.write(text)
    os.replace(temp, target)


def first_line(err: BaseException) -> str:
    """At most 200 characters, for a one-line message."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
