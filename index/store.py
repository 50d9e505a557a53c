"""The `.sam` store file: a small msgpack header, then aligned, optionally compressed arrays.

Layout (all integers little-endian):

    offset 0   magic            8 bytes  b"\\x89SAMCTL\\n"
    offset 8   format version   uint32
    offset 12  header length    uint32   (H, at most MAX_HEADER_BYTES)
    offset 16  header crc32     uint32   (zlib.crc32 of the H header bytes)
    offset 20  reserved         uint32   (0)
    offset 24  header           H bytes of msgpack: a map with str keys
    then       blobs            one per array, each starting at a multiple of ALIGN bytes;
                                the file ends exactly where the last blob ends

The header holds the caller's keys plus this module's `format_version` and `arrays`: name ->
{dtype (little-endian numpy string, "<i4"), shape, offset, length (stored), raw_length (decoded),
codec ("raw" or "zstd"), checksum (zlib.crc32 of the stored bytes)}.

Reading treats the file as untrusted: every failed check raises a one-line `StoreError`, and
nothing else escapes `read_store`. Raw blobs are memory-mapped read-only; their checksums are
checked only with `verify=True`, since reading every page would cost the time the mmap saves and
the target model verifies every draft (a flipped bit can slow decoding, not change its output;
structure loaders still bound every index). Compressed blobs are read in full, so always checked.

Writing is atomic: a temporary file `<name>.tmp<pid>.<random>` beside the output, fsync, then
`os.replace`; an error or Ctrl-C leaves the previous file (or none) and no temporary file. Each
write first removes its output's temporaries left by killed writers (pid not running, on this machine).

This module does not know what the arrays mean, which kinds of datastore exist, or tokenizers.
"""
from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import shutil
import stat
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zstandard

from samctl.index.errors import UserError

MANIFEST = "manifest.json"  # a store directory's header (index/sharded.py, index/suffix_array.py)

MAGIC = b"\x89SAMCTL\n"
FORMAT_VERSION = 1
ALIGN = 64
MAX_HEADER_BYTES = 16 << 20
MAX_NDIM = 8
ZSTD_LEVEL = 3
MIN_SAVING = 0.10  # a blob is stored compressed only when that saves at least this fraction
COMPRESS_CHUNK = 16 << 20  # bytes handed to the zstd stream at a time

_PREAMBLE = struct.Struct("<8sIIII")
# Little-endian fixed-width numeric types only: no objects, strings or platform-dependent sizes.
ALLOWED_DTYPES = frozenset(["|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"])
_RESERVED_KEYS = ("format_version", "arrays")
_ENTRY_KEYS = ("dtype", "shape", "offset", "length", "raw_length", "codec", "checksum")
_CODECS = ("raw", "zstd")
_REBUILD = "rebuild it with samctl build"


class StoreError(UserError):
    """A store file that cannot be read: corrupt, truncated, foreign or too new."""


def missing_store(name: str) -> StoreError:
    return StoreError(f"{name} does not exist: build one with samctl build")


@dataclass(frozen=True)
class ArrayEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    raw_length: int
    codec: str
    checksum: int


@dataclass(frozen=True)
class StoreFile:
    """An opened store: its header (caller's keys plus `arrays`), read-only arrays, file facts."""

    path: str
    format_version: int
    header: dict[str, Any]
    arrays: dict[str, np.ndarray]
    entries: dict[str, ArrayEntry]
    file_size: int
    _buffer: mmap.mmap | None

    def verify(self) -> None:
        """Check the checksum of every blob, raw ones included."""
        if self._buffer is None:
            return
        for entry in self.entries.values():
            blob = memoryview(self._buffer)[entry.offset : entry.offset + entry.length]
            try:
                _check_checksum(self.path, entry, blob)
            finally:
                blob.release()


# ---------------------------------------------------------------------------------------------
# writing


def write_store(path: str | os.PathLike, header: dict[str, Any], arrays: dict[str, np.ndarray],
                compress: bool = True) -> None:
    """Write `arrays` and the msgpack-able `header` (without this module's keys) to `path` atomically."""
    for key in _RESERVED_KEYS:
        if key in header:
            raise ValueError(f"header key {key!r} is reserved for the store format")
    arrays = {name: _checked_array(name, array) for name, array in arrays.items()}
    _write_atomically(Path(path), header, arrays, compress)


def _checked_array(name: Any, array: np.ndarray) -> np.ndarray:
    if not isinstance(name, str):
        raise TypeError(f"array names must be str, got {name!r}")
    array = np.ascontiguousarray(array, dtype=np.asarray(array).dtype.newbyteorder("<"))
    if array.dtype.str not in ALLOWED_DTYPES:
        raise TypeError(f"array {name!r} has dtype {array.dtype.str}, not a fixed-width numeric type")
    return array


def _header_bytes(header: dict[str, Any], table: dict[str, dict[str, Any]]) -> bytes:
    full = {**header, "format_version": FORMAT_VERSION, "arrays": table}
    header_bytes = msgpack.packb(full, use_bin_type=True)
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ValueError(f"store header is {len(header_bytes)} bytes, over {MAX_HEADER_BYTES}")
    return header_bytes


def _data_start(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> int:
    # After the largest header these arrays can have: blobs are streamed (compressed on the way)
    # before the header is known; msgpack sizes grow with the value, so a table of maximal
    # integers and the longer codec name bounds the real one.
    most = 2**63 - 1
    table = {name: {"dtype": a.dtype.str, "shape": [int(d) for d in a.shape], "offset": most,
                    "length": most, "raw_length": most, "codec": "zstd", "checksum": 2**32 - 1}
             for name, a in arrays.items()}
    return _align(_PREAMBLE.size + len(_header_bytes(header, table)))


class _ChecksummedWriter:
    """File writes that keep the crc32 and the length of what went through (a streamed blob)."""

    def __init__(self, out) -> None:
        self.out, self.crc, self.length = out, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.length += len(data)
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()


def _write_blobs(out, arrays: dict[str, np.ndarray], compress: bool, offset: int) -> dict[str, dict[str, Any]]:
    """Write each array's blob at the next aligned offset from `offset`; return the array table.
    A blob is compressed as it is written (no compressed copy is held whole), and kept only when
    that saves MIN_SAVING; otherwise the raw bytes overwrite it."""
    table: dict[str, dict[str, Any]] = {}
    for name, array in arrays.items():
        raw = memoryview(array.reshape(-1).view(np.uint8))
        out.write(b"\0" * (offset - out.tell()))
        codec, length, checksum = "raw", len(raw), None
        if compress and array.nbytes > 0:
            sink = _ChecksummedWriter(out)
            compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1, write_content_size=True)
            with compressor.stream_writer(sink, size=array.nbytes, closefd=False) as stream:
                for start in range(0, len(raw), COMPRESS_CHUNK):
                    stream.write(raw[start : start + COMPRESS_CHUNK])
            if sink.length <= (1.0 - MIN_SAVING) * array.nbytes:
                codec, length, checksum = "zstd", sink.length, sink.crc
            else:
                out.seek(offset)
                out.truncate()
        if codec == "raw":
            out.write(raw)
            checksum = zlib.crc32(raw)
        table[name] = {"dtype": array.dtype.str, "shape": [int(d) for d in array.shape], "offset": offset,
                       "length": length, "raw_length": int(array.nbytes), "codec": codec, "checksum": checksum}
        offset = _align(offset + length)
    return table


def _write_atomically(path: Path, header: dict[str, Any], arrays: dict[str, np.ndarray], compress: bool) -> None:
    """Zeros up to the data start, the blobs, then preamble and header over the zeros."""
    directory = path.parent
    _remove_stale_temporaries(path)
    data_start = _data_start(header, arrays)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f"{path.name}.tmp{os.getpid()}.", dir=directory)
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror}: choose another output path") from err
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(b"\0" * data_start)
            table = _write_blobs(out, arrays, compress, data_start)
            end = out.tell() if table else 0  # the file ends where the last blob ends
            header_bytes = _header_bytes(header, table)
            assert _PREAMBLE.size + len(header_bytes) <= data_start, (len(header_bytes), data_start)
            out.seek(0)
            out.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header_bytes), zlib.crc32(header_bytes), 0))
            out.write(header_bytes)
            out.truncate(max(end, out.tell()))
            out.flush()
            os.fsync(out.fileno())
        usual_mode(tmp_name)
        os.replace(tmp_name, path)
    except BaseException as err:
        # BaseException on purpose: Ctrl-C must not leave the temporary file behind either.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        if isinstance(err, OSError):
            raise UserError(f"cannot write {path}: {err.strerror or err}: "
                            "check the disk space and permissions") from err
        raise
    _fsync_directory(directory)


def is_store_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a regular file that starts with the store magic (a damaged store counts:
    replacing it loses nothing that could be read)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False  # never open a FIFO or a device to look: it could block
        with open(path, "rb") as handle:
            return handle.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary files of `path` left by writers that no longer run."""
    pattern = re.compile(re.escape(path.name) + r"\.tmp(\d+)\.\w+")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return  # the write that follows reports an unusable directory
    for name in names:
        match = pattern.fullmatch(name)
        if match and not _running(int(match.group(1))):
            with contextlib.suppress(OSError):  # another writer removed it first, or it is not ours
                os.unlink(path.parent / name)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process; an impossible id is left alone too
    return True


def usual_mode(path: str | os.PathLike) -> None:
    """Give a file 0644 and a folder 0755, less the umask: what mkstemp's and mkdtemp's private
    0600 and 0700 would be had the file been opened plainly."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o755 if os.path.isdir(path) else 0o644) & ~mask)


def _fsync_directory(directory: Path) -> None:
    # makes a rename durable; some filesystems refuse to open or fsync a directory, which is fine
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def file_crc32(path: str | os.PathLike) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def path_bytes(path: str) -> int:
    """A file's size, or a directory's files' sum (a sharded store's directory shard); -1 when it is missing."""
    try:
        if os.path.isdir(path):
            return sum(e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))
        return os.path.getsize(path)
    except OSError:
        return -1


def _align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


# ---------------------------------------------------------------------------------------------
# reading


def read_manifest(file: str, format: str, max_version: int, kind: str, rebuild: str, limit: int = 1 << 20,
                  missing: str | None = None) -> dict[str, Any]:
    """A store directory's manifest: a JSON object of `format` at a version this samctl reads, else a
    one-line StoreError ending in what to do (`rebuild`; `missing`: the whole message when the file
    is absent)."""
    try:
        with open(file, "rb") as handle:
            raw = handle.read(limit)
    except OSError as err:
        if missing and isinstance(err, FileNotFoundError):
            raise StoreError(missing) from err
        raise StoreError(f"cannot read {file}: {err.strerror or err}") from err
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StoreError(f"{file} is damaged (not JSON: {getattr(err, 'msg', type(err).__name__)}): {rebuild}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != format:
        raise StoreError(f"{file} is damaged (format is not {format!r}): {rebuild}")
    version = manifest.get("format_version")
    if type(version) is not int or version < 1:
        raise StoreError(f"{file} is damaged (format version {version!r}): {rebuild}")
    if version > max_version:
        raise StoreError(f"{file} has {kind} format version {version}, this samctl reads up to {max_version}: "
                         f"upgrade samctl or {rebuild}")
    return manifest


def read_store(path: str | os.PathLike, verify: bool = False) -> StoreFile:
    """Open a store; raw arrays are read-only views of a memory map. StoreError for anything invalid."""
    name = str(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            version, header_bytes = _read_preamble(name, handle, size)
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    except FileNotFoundError as err:
        raise missing_store(name) from err
    except IsADirectoryError as err:
        raise StoreError(f"{name} is a directory, not a store file: pass a .sam file") from err
    except OSError as err:
        raise StoreError(f"cannot read {name}: {err.strerror or err}") from err
    header = _decode_header(name, header_bytes, version)
    entries = _parse_table(name, header["arrays"], _PREAMBLE.size + len(header_bytes), size)
    assert buffer is not None, "a file with a valid header is not empty"
    store = StoreFile(path=name, format_version=version, header=header, entries=entries, file_size=size,
                      arrays={e.name: _open_array(name, buffer, e) for e in entries.values()}, _buffer=buffer)
    if verify:
        store.verify()
    return store


def _read_preamble(name: str, handle, size: int) -> tuple[int, bytes]:
    if size == 0:
        raise StoreError(f"{name} is empty: {_REBUILD}")
    preamble = handle.read(_PREAMBLE.size)
    if not MAGIC.startswith(preamble[: len(MAGIC)]):
        raise StoreError(f"{name} is not a samctl store (wrong magic bytes): pass a file written by samctl build")
    if len(preamble) < _PREAMBLE.size:
        raise StoreError(f"{name} is truncated (expected at least {_PREAMBLE.size} bytes, found {size}): {_REBUILD}")
    _magic, version, header_length, header_crc, _reserved = _PREAMBLE.unpack(preamble)
    if version > FORMAT_VERSION:
        raise StoreError(f"{name} has store format version {version}, this samctl reads up to "
                         f"{FORMAT_VERSION}: upgrade samctl or {_REBUILD}")
    if version < 1:
        raise StoreError(f"{name} has an invalid store format version ({version}): {_REBUILD}")
    if header_length > MAX_HEADER_BYTES:
        raise StoreError(f"{name} declares a {header_length}-byte header, over the "
                         f"{MAX_HEADER_BYTES}-byte limit: the file is corrupt, {_REBUILD}")
    if _PREAMBLE.size + header_length > size:
        raise StoreError(f"{name} is truncated (expected at least "
                         f"{_PREAMBLE.size + header_length} bytes, found {size}): {_REBUILD}")
    header_bytes = handle.read(header_length)
    if zlib.crc32(header_bytes) != header_crc:
        raise StoreError(f"{name} has a corrupt header (checksum mismatch): {_REBUILD}")
    return version, header_bytes


def _decode_header(name: str, header_bytes: bytes, version: int) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(header_bytes, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as err:
        raise StoreError(f"{name} has a malformed header ({type(err).__name__}): {_REBUILD}") from err
    if not isinstance(header, dict):
        raise StoreError(f"{name} has a malformed header (not a map): {_REBUILD}")
    if header.get("format_version") != version:
        raise StoreError(f"{name} has a malformed header (format version "
                         f"{header.get('format_version')!r} disagrees with {version}): {_REBUILD}")
    if not isinstance(header.get("arrays"), dict):
        raise StoreError(f"{name} has a malformed header (no array table): {_REBUILD}")
    return header


def _parse_table(name: str, table: dict[Any, Any], header_end: int, size: int) -> dict[str, ArrayEntry]:
    entries = [_parse_entry(name, key, value, header_end) for key, value in table.items()]
    end = _align(header_end)
    # Zero-length arrays may share an offset with the next array: sort them first.
    for entry in sorted(entries, key=lambda e: (e.offset, e.length)):
        if entry.offset < end:
            raise StoreError(f"{name} has overlapping arrays (array {entry.name!r} at "
                             f"{entry.offset}): the file is corrupt, {_REBUILD}")
        end = entry.offset + entry.length
    expected = max([header_end] + [e.offset + e.length for e in entries])
    if size < expected:
        raise StoreError(f"{name} is truncated (expected {expected} bytes, found {size}): {_REBUILD}")
    if size > expected:
        raise StoreError(f"{name} has {size - expected} unexpected bytes after its last array "
                         f"(expected {expected} bytes, found {size}): the file is corrupt, {_REBUILD}")
    return {e.name: e for e in entries}


def _parse_entry(name: str, key: Any, value: Any, header_end: int) -> ArrayEntry:
    def bad(what: str) -> StoreError:
        return StoreError(f"{name} has a malformed array table ({what}): the file is corrupt, {_REBUILD}")

    if not isinstance(key, str) or not isinstance(value, dict):
        raise bad("an entry is not a named map")
    if set(value) != set(_ENTRY_KEYS):
        raise bad(f"array {key!r} has fields {sorted(map(str, value))}")
    dtype, shape, codec = value["dtype"], value["shape"], value["codec"]
    ints = {k: value[k] for k in ("offset", "length", "raw_length", "checksum")}
    if any(type(v) is not int or v < 0 for v in ints.values()):
        raise bad(f"array {key!r} has a negative or non-integer offset, length or checksum")
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
        raise bad(f"array {key!r} has unknown dtype {dtype!r}")
    if codec not in _CODECS:
        raise bad(f"array {key!r} has unknown codec {codec!r}")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or any(type(d) is not int or d < 0 for d in shape)):
        raise bad(f"array {key!r} has invalid shape {shape!r}")
    if math.prod(shape) * np.dtype(dtype).itemsize != ints["raw_length"]:
        raise bad(f"array {key!r} has shape {shape} but {ints['raw_length']} bytes")
    if codec == "raw" and ints["length"] != ints["raw_length"]:
        raise bad(f"raw array {key!r} stores {ints['length']} of {ints['raw_length']} bytes")
    if ints["offset"] % ALIGN or ints["offset"] < header_end:
        raise bad(f"array {key!r} has a misplaced offset {ints['offset']}")
    if ints["checksum"] > 0xFFFFFFFF:
        raise bad(f"array {key!r} has an out-of-range checksum")
    return ArrayEntry(name=key, dtype=dtype, shape=tuple(shape), codec=codec, **ints)


def _open_array(name: str, buffer: mmap.mmap, entry: ArrayEntry) -> np.ndarray:
    dtype = np.dtype(entry.dtype)
    if entry.raw_length == 0:
        array = np.empty(entry.shape, dtype=dtype)
    elif entry.codec == "raw":
        array = np.frombuffer(buffer, dtype=dtype, count=entry.raw_length // dtype.itemsize,
                              offset=entry.offset).reshape(entry.shape)
    else:
        blob = memoryview(buffer)[entry.offset : entry.offset + entry.length]
        try:
            _check_checksum(name, entry, blob)
            array = _decompress(name, entry, blob).view(dtype).reshape(entry.shape)
        finally:
            blob.release()
    array.flags.writeable = False
    return array


def _check_checksum(name: str, entry: ArrayEntry, blob: memoryview) -> None:
    if zlib.crc32(blob) != entry.checksum:
        raise StoreError(f"{name} is corrupt (checksum mismatch in array {entry.name!r}): {_REBUILD}")


def _decompress(name: str, entry: ArrayEntry, blob: memoryview) -> np.ndarray:
    # Streaming into a preallocated buffer bounds the work by what the blob really holds: a header
    # that claims a huge raw length for a tiny blob fails after decoding the little it contains.
    def corrupt(what: str) -> StoreError:
        return StoreError(f"{name} is corrupt (array {entry.name!r}: {what}): {_REBUILD}")

    try:
        out = np.empty(entry.raw_length, dtype=np.uint8)
    except (MemoryError, ValueError) as err:
        raise corrupt(f"{entry.raw_length} bytes do not fit in memory") from err
    view = memoryview(out)
    filled = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=False)
        while filled < entry.raw_length:
            got = reader.readinto(view[filled:])
            if got == 0:
                break
            filled += got
        extra = reader.read(1)
    except zstandard.ZstdError as err:
        raise corrupt(f"zstd: {err}") from err
    finally:
        view.release()
    if filled != entry.raw_length or extra:
        raise corrupt(f"decodes to {'more than ' if extra else ''}{filled} bytes, expected {entry.raw_length}")
    return out


class DirectoryWriter:
    """Writes a store directory atomically: its files go into `tmp` beside `path`; `commit_manifest`
    renames it into place (replacing an older store). Leaving `with` without a commit removes it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        # Only a store (directory with a manifest, or a file) is ever replaced: never a folder
        # that merely sits at the path, which the final swap would delete.
        if self.path.is_dir() and not (self.path / MANIFEST).is_file():
            raise UserError(f"{self.path} is a directory but not a samctl store (no {MANIFEST}): "
                            "choose another output path")
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.tmp", dir=self.path.parent))
        except OSError as err:
            raise UserError(f"cannot write {self.path}: {err.strerror}: choose another output path") from err
        self.committed = False

    def __enter__(self) -> "DirectoryWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.committed:
            shutil.rmtree(self.tmp, ignore_errors=True)

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
        usual_mode(self.tmp)
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
        _fsync_directory(self.path.parent)
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()
