"""The `.sam` store file: round trips, memory mapping, atomic writes, and untrusted input."""
from __future__ import annotations

import mmap
import os
import struct
import zlib

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from samctl.index import store
from samctl.index.errors import UserError
from samctl.index.store import StoreError, read_store, write_store

ARRAYS = {
    "tokens": np.arange(1000, dtype=np.int32) % 17,
    "table": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    "empty": np.zeros(0, dtype=np.int64),
    "noise": np.random.default_rng(0).integers(0, 2**62, 50, dtype=np.int64),
    "flags": np.array([True, False, True]),
}
HEADER = {"kind": "test", "config": {"max_n": 4, "names": ["a", "b"]}, "stats": {"tokens": 1000}}


def _write(path, compress=True, arrays=ARRAYS, header=HEADER):
    write_store(path, header, arrays, compress=compress)
    return path


def _mapped(array: np.ndarray) -> bool:
    base = array
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.obj if isinstance(base, memoryview) else base.base
    return isinstance(base, mmap.mmap)


@pytest.mark.parametrize("compress", [True, False])
def test_round_trip(tmp_path, compress):
    path = _write(tmp_path / "s.sam", compress=compress)
    loaded = read_store(path, verify=True)
    assert loaded.format_version == store.FORMAT_VERSION
    assert {k: v for k, v in loaded.header.items() if k not in ("format_version", "arrays")} == HEADER
    assert loaded.file_size == os.path.getsize(path)
    assert set(loaded.arrays) == set(ARRAYS)
    for name, expected in ARRAYS.items():
        got = loaded.arrays[name]
        assert got.dtype == expected.dtype.newbyteorder("<")
        assert got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
        assert not got.flags.writeable
    codecs = {name: entry.codec for name, entry in loaded.entries.items()}
    if compress:
        assert codecs["tokens"] == "zstd"  # 17 distinct values repeat: compresses well
        assert codecs["noise"] == "raw"  # random bits do not: kept raw
    else:
        assert set(codecs.values()) == {"raw"}


def test_raw_arrays_are_memory_mapped_and_aligned(tmp_path):
    loaded = read_store(_write(tmp_path / "s.sam", compress=False))
    for name in ("tokens", "table", "noise"):
        assert _mapped(loaded.arrays[name]), name
        assert loaded.entries[name].offset % store.ALIGN == 0


def test_big_endian_input_is_stored_little_endian(tmp_path):
    arrays = {"x": np.arange(5, dtype=">i4")}
    loaded = read_store(_write(tmp_path / "s.sam", arrays=arrays))
    assert loaded.arrays["x"].dtype.str == "<i4"
    np.testing.assert_array_equal(loaded.arrays["x"], np.arange(5))


def test_write_rejects_reserved_keys_and_object_arrays(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        write_store(tmp_path / "a.sam", {"arrays": 1}, {})
    with pytest.raises(TypeError, match="dtype"):
        write_store(tmp_path / "b.sam", {}, {"x": np.array(["a"], dtype=object)})
    assert os.listdir(tmp_path) == []


def test_store_without_arrays(tmp_path):
    loaded = read_store(_write(tmp_path / "s.sam", arrays={}))
    assert loaded.arrays == {}
    assert loaded.header["kind"] == "test"


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError(28, "No space left on device")])
@pytest.mark.parametrize("had_old", [True, False])
def test_atomic_write_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch, failure, had_old):
    path = tmp_path / "s.sam"
    if had_old:
        _write(path)
    old = path.read_bytes() if had_old else None

    def fail(_fd):
        raise failure

    monkeypatch.setattr(store.os, "fsync", fail)
    expected = KeyboardInterrupt if failure is KeyboardInterrupt else UserError
    with pytest.raises(expected):
        write_store(path, {"kind": "new"}, {"x": np.arange(10**5, dtype=np.int32)})
    assert os.listdir(tmp_path) == (["s.sam"] if had_old else [])
    if had_old:
        assert path.read_bytes() == old


def test_write_to_missing_directory_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot write"):
        write_store(tmp_path / "nope" / "s.sam", {}, {})


# ---------------------------------------------------------------------------------------------
# untrusted input: each failure is one StoreError line that says what to do


def _reheader(data: bytes, mutate) -> bytes:
    """Re-encode the header after `mutate(header)` with a correct length and checksum.

    Blobs keep their absolute offsets: the zero padding between header and first blob absorbs
    the change in header size.
    """
    magic, version, length, _crc, reserved = struct.unpack_from("<8sIIII", data)
    header = msgpack.unpackb(data[24 : 24 + length], raw=False)
    mutate(header)
    encoded = msgpack.packb(header, use_bin_type=True)
    preamble = struct.pack("<8sIIII", magic, version, len(encoded), zlib.crc32(encoded), reserved)
    body = data[24 + length :]
    grow = len(encoded) - length
    return preamble + encoded + b"\0" * max(0, -grow) + body[max(0, grow) :]


def _expect_error(path, data: bytes, match: str, verify=False):
    path.write_bytes(data)
    with pytest.raises(StoreError, match=match) as info:
        read_store(path, verify=verify)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_wrong_magic(tmp_path):
    data = _write(tmp_path / "s.sam").read_bytes()
    _expect_error(tmp_path / "x.sam", b"PK\x03\x04" + data[4:], "not a samctl store")
    _expect_error(tmp_path / "x.sam", b"hello", "not a samctl store")
    _expect_error(tmp_path / "x.sam", b"", "empty")


def test_newer_version(tmp_path):
    data = bytearray(_write(tmp_path / "s.sam").read_bytes())
    struct.pack_into("<I", data, 8, store.FORMAT_VERSION + 1)
    message = _expect_error(tmp_path / "x.sam", bytes(data), "format version")
    assert "upgrade samctl" in message


@pytest.mark.parametrize("cut", [5, 20, 100, -1, -100])
def test_truncated(tmp_path, cut):
    data = _write(tmp_path / "s.sam").read_bytes()
    message = _expect_error(tmp_path / "x.sam", data[:cut], "truncated|not a samctl store")
    assert "samctl build" in message


def test_trailing_bytes(tmp_path):
    data = _write(tmp_path / "s.sam").read_bytes()
    _expect_error(tmp_path / "x.sam", data + b"\0", "unexpected bytes")


def test_header_checksum(tmp_path):
    data = bytearray(_write(tmp_path / "s.sam").read_bytes())
    data[30] ^= 0x01
    _expect_error(tmp_path / "x.sam", bytes(data), "corrupt header")


def test_oversized_header_length(tmp_path):
    data = bytearray(_write(tmp_path / "s.sam").read_bytes())
    struct.pack_into("<I", data, 12, store.MAX_HEADER_BYTES + 1)
    _expect_error(tmp_path / "x.sam", bytes(data), "header")


@pytest.mark.parametrize("compress", [True, False])
def test_blob_checksum(tmp_path, compress):
    path = _write(tmp_path / "s.sam", compress=compress)
    entry = read_store(path).entries["tokens"]
    data = bytearray(path.read_bytes())
    data[entry.offset + entry.length // 2] ^= 0x10
    if compress:  # compressed blobs are always checked
        _expect_error(tmp_path / "x.sam", bytes(data), "checksum mismatch in array 'tokens'")
    else:  # raw blobs only on request
        (tmp_path / "x.sam").write_bytes(bytes(data))
        loaded = read_store(tmp_path / "x.sam")
        with pytest.raises(StoreError, match="checksum mismatch in array 'tokens'"):
            loaded.verify()
        _expect_error(tmp_path / "x.sam", bytes(data), "checksum", verify=True)


def _set(path_in_header, value):
    def mutate(header):
        target = header
        for key in path_in_header[:-1]:
            target = target[key]
        target[path_in_header[-1]] = value
    return mutate


@pytest.mark.parametrize(
    "mutate, match",
    [
        (_set(["arrays", "tokens", "dtype"], "|O"), "unknown dtype"),
        (_set(["arrays", "tokens", "dtype"], ">i4"), "unknown dtype"),
        (_set(["arrays", "tokens", "shape"], [-1]), "invalid shape"),
        (_set(["arrays", "tokens", "shape"], [3, 7]), "bytes"),
        (_set(["arrays", "tokens", "shape"], [1] * 9), "invalid shape"),
        (_set(["arrays", "tokens", "codec"], "lz4"), "unknown codec"),
        (_set(["arrays", "tokens", "offset"], 1 << 40), "truncated"),
        (_set(["arrays", "tokens", "offset"], 65), "misplaced offset"),
        (_set(["arrays", "tokens", "offset"], 0), "misplaced offset"),
        (_set(["arrays", "tokens", "length"], -3), "negative"),
        (_set(["arrays", "tokens", "checksum"], 1 << 33), "checksum"),
        (_set(["arrays", "tokens", "extra"], 1), "fields"),
        (_set(["arrays", "tokens"], [1, 2]), "named map"),
        (_set(["arrays"], None), "no array table"),
        (_set(["format_version"], 99), "disagrees"),
    ],
)
def test_malformed_array_table(tmp_path, mutate, match):
    data = _write(tmp_path / "s.sam").read_bytes()
    _expect_error(tmp_path / "x.sam", _reheader(data, mutate), match)


def test_overlapping_arrays(tmp_path):
    path = _write(tmp_path / "s.sam", compress=False)
    entries = read_store(path).entries
    data = _reheader(path.read_bytes(),
                     _set(["arrays", "table", "offset"], entries["tokens"].offset))
    _expect_error(tmp_path / "x.sam", data, "overlapping")


def test_zstd_bomb_is_refused(tmp_path):
    """A tiny blob that claims a huge raw size fails after decoding what it really holds."""
    path = _write(tmp_path / "s.sam", arrays={"x": np.zeros(4096, dtype=np.int32)})
    huge = 1 << 38

    def mutate(header):
        header["arrays"]["x"].update(shape=[huge // 4], raw_length=huge)

    _expect_error(tmp_path / "x.sam", _reheader(path.read_bytes(), mutate),
                  "decodes to|do not fit")


def test_malformed_msgpack(tmp_path):
    data = _write(tmp_path / "s.sam").read_bytes()
    length = struct.unpack_from("<I", data, 12)[0]
    garbage = b"\xc1" + data[25 : 24 + length]  # 0xc1 is never used in msgpack
    preamble = struct.pack("<8sIIII", store.MAGIC, 1, length, zlib.crc32(garbage), 0)
    _expect_error(tmp_path / "x.sam", preamble + garbage + data[24 + length :], "malformed header")


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        read_store(tmp_path / "nope.sam")
    with pytest.raises(StoreError, match="directory"):
        read_store(tmp_path)


# ---------------------------------------------------------------------------------------------
# fuzzing: whatever the bytes, read_store raises StoreError or returns, and never hangs

_FUZZ_ARRAYS = {
    "a": np.arange(300, dtype=np.int32) % 5,
    "b": np.random.default_rng(1).integers(0, 1000, (7, 3)).astype(np.int64),
    "c": np.zeros(0, dtype=np.uint8),
}


@pytest.fixture(scope="module")
def fuzz_seeds(tmp_path_factory):
    seeds = []
    for compress in (True, False):
        path = tmp_path_factory.mktemp("seed") / "s.sam"
        write_store(path, {"kind": "fuzz", "n": [1, 2]}, _FUZZ_ARRAYS, compress=compress)
        seeds.append(path.read_bytes())
    return seeds


def _try_read(path, data: bytes, verify: bool) -> None:
    path.write_bytes(data)
    try:
        loaded = read_store(path, verify=verify)
    except StoreError as err:
        assert "\n" not in str(err)
        return
    for array in loaded.arrays.values():
        assert array.nbytes <= len(data) * 40_000  # read what the file holds, nothing more
        array.sum()  # touching every page of a mapped array must not crash


_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("overwrite"), st.integers(0, 10**6), st.binary(min_size=1, max_size=8)),
)


def _apply(data: bytes, mutation) -> bytes:
    kind, position = mutation[0], mutation[1] % (len(data) + 1)
    if kind == "flip":
        if position == len(data):
            return data
        return data[:position] + bytes([data[position] ^ (1 << mutation[2])]) + data[position + 1 :]
    if kind == "truncate":
        return data[:position]
    if kind == "insert":
        return data[:position] + mutation[2] + data[position:]
    return data[:position] + mutation[2] + data[position + len(mutation[2]) :]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1), mutations=st.lists(_mutation, min_size=1, max_size=4),
       verify=st.booleans())
def test_fuzz_bytes(tmp_path, fuzz_seeds, seed, mutations, verify):
    data = fuzz_seeds[seed]
    for mutation in mutations:
        data = _apply(data, mutation)
    _try_read(tmp_path / "f.sam", data, verify)


_json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=5)
    | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10,
)
_fields = st.sampled_from(["dtype", "shape", "offset", "length", "raw_length", "codec", "checksum"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1), array=st.sampled_from(["a", "b", "c", "zz"]), field=_fields,
       value=_json_like | st.integers(0, 5000) | st.lists(st.integers(0, 400), max_size=3),
       verify=st.booleans())
def test_fuzz_header(tmp_path, fuzz_seeds, seed, array, field, value, verify):
    """Well-formed msgpack with a valid checksum but hostile values in the array table."""

    def mutate(header):
        header["arrays"].setdefault(array, dict(header["arrays"]["a"]))[field] = value

    _try_read(tmp_path / "f.sam", _reheader(fuzz_seeds[seed], mutate), verify)


# ---------------------------------------------------------------------------------------------
# the full load path: header fields and structure arrays are untrusted too


@pytest.fixture(scope="module")
def datastore_seeds(tmp_path_factory):
    from samctl.index.automaton import SuffixAutomaton
    from samctl.index.datastore import BuildConfig, CorpusStats, StoreMeta, save_datastore
    from samctl.index.ngram import NgramTable

    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 6, 120).astype(np.int32)
    offsets = np.array([0, 50, 50, 120], dtype=np.int64)
    seeds = []
    for kind in ("sam", "ngram"):
        config = BuildConfig(kind=kind, max_n=3, min_count=1)
        structure = (SuffixAutomaton.build(tokens, offsets) if kind == "sam"
                     else NgramTable.build(tokens, offsets, config.ngram_config()))
        meta = StoreMeta("bytes", "f" * 16, 257, 256, config, CorpusStats(3, 120))
        for compress in (False, True):
            path = tmp_path_factory.mktemp("ds") / "s.sam"
            save_datastore(path, structure, meta, compress=compress)
            seeds.append(path.read_bytes())
    return seeds


def _try_load(path, data: bytes, queries) -> None:
    from samctl.index.load import load_datastore

    path.write_bytes(data)
    try:
        store = load_datastore(path)
    except UserError as err:
        assert "\n" not in str(err)
        return
    # A store that loads must answer queries without crashing or hanging.
    for query in queries:
        found = store.lookup(np.array(query, dtype=np.int32), n=8, k=4)
        assert 0 <= found.match_length <= len(query)
        assert all(0 <= t < store.meta.vocab_size for t in found.continuation)
        assert all(0 <= t < store.meta.vocab_size for t in found.next_tokens)
        if store.kind == "sam":
            state, _length = store.sam.match(np.array(query, dtype=np.int32))
            store.sam.topk_next(state, 3)
        else:
            store.ngram.continuation(np.array(query, dtype=np.int32), 10)


_queries = st.lists(st.lists(st.integers(0, 8), max_size=6), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 3), mutations=st.lists(_mutation, min_size=1, max_size=3), queries=_queries)
def test_fuzz_datastore_bytes(tmp_path, datastore_seeds, seed, mutations, queries):
    data = datastore_seeds[seed]
    for mutation in mutations:
        data = _apply(data, mutation)
    _try_load(tmp_path / "f.sam", data, queries)


_meta_paths = st.sampled_from([
    ("kind",), ("created_by",), ("tokenizer",), ("tokenizer", "name"), ("tokenizer", "vocab_size"),
    ("tokenizer", "eos_token_id"), ("build",), ("build", "kind"), ("build", "max_n"),
    ("build", "include"), ("build", "compress"), ("corpus", "documents"), ("corpus", "inputs"),
])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 3), path=_meta_paths,
       value=_json_like | st.integers(-3, 300) | st.sampled_from(["sam", "ngram"]), queries=_queries)
def test_fuzz_datastore_header(tmp_path, datastore_seeds, seed, path, value, queries):
    _try_load(tmp_path / "f.sam", _reheader(datastore_seeds[seed], _set(list(path), value)), queries)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.sampled_from([0, 2]), array=st.sampled_from(
           ["states", "edges", "slots", "tokens", "meta", "keys", "ctx", "order_start", "ctx_start",
            "offsets", "next", "counts", "totals", "config"]),
       position=st.integers(0, 10**6), value=st.integers(-(2**31), 2**31 - 1), queries=_queries)
def test_fuzz_datastore_array_values(tmp_path, datastore_seeds, seed, array, position, value, queries):
    """Overwrite one element of a raw array (no checksum checked on load) with any int32."""
    data = bytearray(datastore_seeds[seed])
    loaded = read_store(_write_bytes(tmp_path / "seed.sam", bytes(data)))
    if array not in loaded.entries:
        return
    entry = loaded.entries[array]
    itemsize = np.dtype(entry.dtype).itemsize
    if entry.length < itemsize:
        return
    at = entry.offset + (position % (entry.length // itemsize)) * itemsize
    data[at : at + itemsize] = np.array([value]).astype(entry.dtype).tobytes()
    _try_load(tmp_path / "f.sam", bytes(data), queries)


def _write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


def test_structure_counts_from_the_file_equal_the_loaded_structures(datastore_seeds, tmp_path):
    # `samctl info` reads a store's size without loading it; it must say what loading would find.
    from samctl.index.datastore import read_meta, structure_counts
    from samctl.index.load import load_datastore

    for i, data in enumerate(datastore_seeds):
        path = tmp_path / f"s{i}.sam"
        path.write_bytes(data)
        file, meta = read_meta(path)
        loaded = load_datastore(path).structure
        expected = ({"states": loaded.num_states, "edges": loaded.num_edges} if meta.build.kind == "sam"
                    else {"contexts": loaded.num_contexts, "entries": loaded.num_entries})
        assert structure_counts(file, meta.build.kind) == expected and expected[next(iter(expected))] > 0
        settings = meta.build.settings()
        assert ("max_n" in settings) == (meta.build.kind == "ngram") and settings["kind"] == meta.build.kind
