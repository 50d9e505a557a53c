"""Suffix-array stores: a token array plus a suffix array, memory-mapped, built by infini-gram's indexer.

A store directory (conventionally `*.sa`) in infini-gram's v4 layout, under samctl's manifest:

    manifest.json  {"format": "samctl-sa-store", "format_version": 1, "kind": "sa",
                    "created_by", "tokenizer", "build", "corpus"  (as in a .sam header),
                    "sa": {"token_width", "pointer_width", "documents", "tokens",
                           "files": {name: {"bytes", "crc32"}}}}
    tokenized.0    each document preceded by a separator (0xFFFF), token ids little-endian,
                   token_width (2) bytes each
    table.0        the suffix array: one pointer_width-byte little-endian byte offset into
                   tokenized.0 per token, sorted by the suffixes' bytes
    offset.0       each document's separator's byte offset (uint64), infini-gram's

The sort is infini-gram's Rust indexer (`pip install samctl[sa]`); queries and drafting are numba
over the memory-mapped files.

Byte order. The indexer sorts suffixes by their bytes, so a token compares by its *key*, the
big-endian reading of its little-endian bytes (`_key`). Within a range [lo, hi) of suffixes that
share a pattern of L tokens, the keys at token L are non-decreasing: a next token is a run.

Invariants the queries keep, for a text T and its match (lo, hi, L):
    L = max{l : T[-l:] occurs in one document}   (the separator is no token id: matches stay inside)
    [lo, hi) = the suffixes starting with T[-L:];  count = hi - lo
    continuation = the tokens after the earliest occurrence (min pointer), up to the document end
These equal the suffix automaton's match length, count, first-occurrence continuation and
next-token counts (tests/test_suffix_array.py), with caps that only bite at scale: a match that
breaks is re-searched over at most MAX_MATCH tokens; the earliest occurrence is taken among the
first FIRST_SCAN pointers of a range; next tokens are found at SAMPLES suffixes of a larger range,
so a next token rarer than 1 in SAMPLES may be missed (the counts of those found are exact).

This module knows files, numpy and numba; not tokenizers, text or the command line.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from samctl.index.best_first import CNT, DEPTH, REF, tree_buffers, tree_push, tree_take
from samctl.index.datastore import DirectoryStore, StoreMeta, parse_meta
from samctl.index.lookup import Lookup
from samctl.index.sa_layout import FILES
from samctl.index.errors import ConfigError, UserError
from samctl.index.store import MANIFEST, DirectoryWriter, StoreError, file_crc32, path_bytes, read_manifest

FORMAT = "samctl-sa-store"
FORMAT_VERSION = 1
MAX_MATCH = 32  # tokens a broken match is re-searched over (the automaton has no cap; drafters read <= 16)
FIRST_SCAN = 4096  # pointers scanned for the earliest occurrence
SAMPLES = 64  # suffixes sampled per node for its next tokens (all of them in a smaller range)
_REBUILD = "rebuild it with `samctl build --kind sa`"
_SA_KEYS = {"token_width": int, "pointer_width": int, "documents": int, "tokens": int, "files": dict}


# ---------------------------------------------------------------------------------------------
# Kernels: data [bytes] uint8 (tokenized.0), table [bytes] uint8 (table.0); w = token width,
# p = pointer width, both in bytes. Positions are byte offsets into data.


@njit(cache=True)
def _pointer(table, i, p):
    v = np.int64(0)
    for j in range(p - 1, -1, -1):
        v = (v << 8) | table[i * p + j]
    return v


@njit(cache=True)
def _key(data, pos, w):
    # -> the byte-order key of the token at pos; -1 past the end (a shorter suffix sorts first)
    if pos + w > len(data):
        return np.int64(-1)
    v = np.int64(0)
    for j in range(w):
        v = (v << 8) | data[pos + j]
    return v


@njit(cache=True)
def _token(data, pos, w):
    v = np.int64(0)
    for j in range(w - 1, -1, -1):
        v = (v << 8) | data[pos + j]
    return v


@njit(cache=True)
def token_key(token, w):
    v = np.int64(0)
    for j in range(w):
        v = (v << 8) | ((token >> (8 * j)) & 0xFF)
    return v


@njit(cache=True)
def _compare(data, pos, w, keys, start, stop):
    # -> -1, 0, 1: the suffix at byte pos sorts below keys[start:stop], starts with it, sorts above
    for j in range(start, stop):
        k = _key(data, pos, w)
        if k != keys[j]:
            return -1 if k < keys[j] else 1
        pos += w
    return 0


@njit(cache=True)
def sa_search(data, table, w, p, lo, hi, offset, keys, start, stop, bounds=True):
    """[lo', hi'): the suffixes of [lo, hi) (which share their first `offset` tokens) whose tokens
    from `offset` on start with keys[start:stop]; (x, x) when none.

    Each probe compares the whole pattern, so a search costs O(log(hi - lo)) probes whatever its
    length: one binary search until a probe starts with the pattern, then one for each end.
    bounds=False returns (probe, probe + 1) there: whether the pattern occurs, at half the cost."""
    a, b = lo, hi
    mid = lo
    while a < b:
        mid = (a + b) // 2
        c = _compare(data, _pointer(table, mid, p) + offset * w, w, keys, start, stop)
        if c < 0:
            a = mid + 1
        elif c > 0:
            b = mid
        else:
            break
    if a >= b:
        return a, a
    if not bounds:
        return mid, mid + 1
    top = b
    b = mid  # the first that starts with the pattern is in [a, mid]
    while a < b:
        m = (a + b) // 2
        if _compare(data, _pointer(table, m, p) + offset * w, w, keys, start, stop) < 0:
            a = m + 1
        else:
            b = m
    low = a
    a, b = mid + 1, top  # the first above the pattern is in [mid + 1, top]
    while a < b:
        m = (a + b) // 2
        if _compare(data, _pointer(table, m, p) + offset * w, w, keys, start, stop) == 0:
            a = m + 1
        else:
            b = m
    return low, a


PAIR_SLOTS = 1 << 16  # sa_find's cache of two-token ranges (direct-mapped)


def range_cache(token_width: int) -> np.ndarray:
    """sa_find's cache, empty: [2^(8w) + PAIR_SLOTS, 3] int64. Row t < 2^(8w): token key t's range
    (lo, hi; -1 = not searched yet). Row 2^(8w) + slot: a two-token pattern's range and its key."""
    return np.full(((1 << (8 * token_width)) + PAIR_SLOTS, 3), -1, dtype=np.int64)


@njit(cache=True)
def sa_find(data, table, w, p, first, keys, start, stop, bounds=True):
    """Range of the suffixes that start with keys[start:stop]; (x, x) when none; bounds as in
    `sa_search`. first: the range cache (`range_cache`), filled here: the ranges of a pattern's
    first token and first two are the widest searches, asked for again and again."""
    k0 = keys[start]
    if first[k0, 0] < 0:
        first[k0, 0], first[k0, 1] = sa_search(data, table, w, p, 0, len(table) // p, 0, keys, start, start + 1)
    lo, hi = first[k0, 0], first[k0, 1]
    i = start + 1
    if i < stop and lo < hi:
        pair = (k0 << 32) | keys[i]
        h = k0 * 0x9E3779B1 + keys[i]
        slot = (1 << (8 * w)) + ((h ^ (h >> 16)) & (PAIR_SLOTS - 1))
        if first[slot, 2] != pair:
            first[slot, 0], first[slot, 1] = sa_search(data, table, w, p, lo, hi, 1, keys, i, i + 1)
            first[slot, 2] = pair
        lo, hi = first[slot, 0], first[slot, 1]
        i += 1
    if i < stop and lo < hi:
        lo, hi = sa_search(data, table, w, p, lo, hi, i - start, keys, i, stop, bounds)
    return lo, hi


@njit(cache=True)
def sa_step(data, table, w, p, first, keys, i, lo, hi, length):
    """Match (lo, hi, length) of keys[:i] -> the match of keys[:i + 1]: grown by one token inside
    its range when it can; else the longest suffix that occurs (of at most MAX_MATCH tokens) is
    found by searching lengths (a suffix of a suffix that occurs occurs)."""
    n = len(table) // p
    if length == 0:
        a, b = sa_find(data, table, w, p, first, keys, i, i + 1)
        return (a, b, 1) if a < b else (0, n, 0)
    a, b = sa_search(data, table, w, p, lo, hi, length, keys, i, i + 1)
    if a < b:
        return a, b, length + 1
    # After a break the match is usually short: gallop up (1, 2, 4, ...) to the first length that
    # does not occur, then bisect below it.
    cap = min(length, MAX_MATCH, i + 1)  # the answer lies in [0, cap]
    best, short, long_ = 0, 1, cap
    probe = 1
    while probe <= cap:
        a, b = sa_find(data, table, w, p, first, keys, i + 1 - probe, i + 1, False)
        if a == b:
            long_ = probe - 1
            break
        best, short = probe, probe + 1
        probe *= 2
    while short <= long_:
        mid = (short + long_) // 2
        a, b = sa_find(data, table, w, p, first, keys, i + 1 - mid, i + 1, False)
        if a < b:
            best, short = mid, mid + 1
        else:
            long_ = mid - 1
    if best == 0:
        return 0, n, 0
    a, b = sa_find(data, table, w, p, first, keys, i + 1 - best, i + 1)
    return a, b, best


@njit(cache=True)
def sa_follow(data, table, w, p, first, keys, state, tokens, t0):
    """A cursor's move in one call: follow `tokens` (committed since the last call; [k] int), then
    peek t0 (-1: none). Returns (length, lo, hi): the peeked match (the text's, without a peek);
    the text's last keys are then keys[:state[3]], t0's key keys[state[3]].

    state [8] int64, in place (`follow_state`): the text's match (lo, hi, length), n, and the last
    peek's t0 and match (lo, hi, length), reused when the next call's first token is that t0.
    keys [MAX_MATCH + 1] int64: a broken match is searched again over them."""
    n, k = state[3], len(tokens)
    text = np.empty(n + k + 1, dtype=np.int64)
    text[:n] = keys[:n]
    for j in range(k):
        text[n + j] = token_key(tokens[j], w)
    lo, hi, length = state[0], state[1], state[2]
    start = n
    if k > 0 and tokens[0] == state[4]:
        lo, hi, length = state[5], state[6], state[7]
        start += 1
    for i in range(start, n + k):
        lo, hi, length = sa_step(data, table, w, p, first, text, i, lo, hi, length)
    m = min(n + k, MAX_MATCH)
    keys[:m] = text[n + k - m:n + k]
    state[0], state[1], state[2], state[3], state[4] = lo, hi, length, m, -1
    if t0 < 0:
        return length, lo, hi
    keys[m] = token_key(t0, w)
    lo, hi, length = sa_step(data, table, w, p, first, keys, m, lo, hi, length)
    state[4], state[5], state[6], state[7] = t0, lo, hi, length
    return length, lo, hi


def follow_state() -> np.ndarray:
    return np.array([0, 0, 0, 0, -1, 0, 0, 0], dtype=np.int64)


@njit(cache=True)
def sa_first(table, p, lo, hi):
    """The earliest occurrence's byte offset among the first FIRST_SCAN of [lo, hi); -1 if empty."""
    best = np.int64(-1)
    for i in range(lo, min(hi, lo + FIRST_SCAN)):
        v = _pointer(table, i, p)
        if best < 0 or v < best:
            best = v
    return best


@njit(cache=True)
def sa_continuation(data, table, w, p, first, vocab, lo, hi, length, n):
    """Up to n token ids ([m] int32) after the earliest occurrence; stops at the document end
    (the separator, like any id >= vocab, is never drafted)."""
    out = np.empty(max(n, 0), dtype=np.int32)
    if length <= 0 or lo >= hi:
        return out[:0]
    pos = sa_first(table, p, lo, hi) + length * w
    m = 0
    while m < n and pos + w <= len(data):
        t = _token(data, pos, w)
        if t >= vocab:
            break
        out[m] = t
        m += 1
        pos += w
    return out[:m]


@njit(cache=True)
def sa_children(data, table, w, p, first, vocab, lo, hi, offset, k, out_tok, out_lo, out_hi):
    """The (up to) k most frequent next tokens after the first `offset` tokens of [lo, hi), by
    count descending then token ascending, with their exact ranges, into out_*; returns how many.

    The next tokens are runs of keys at `offset`, found at SAMPLES evenly spaced suffixes, each
    run's exact range by a binary search between the samples around it; a run missed holds fewer
    than (hi - lo) / SAMPLES suffixes."""
    n = hi - lo
    one = np.empty(1, dtype=np.int64)  # sa_search's pattern: the run's key
    step = max(1.0, n / SAMPLES)
    count = min(n, SAMPLES)
    m = 0
    j = 0
    while j < count:
        i = lo + int(j * step)
        key = _key(data, _pointer(table, i, p) + offset * w, w)
        if key < 0:  # the suffix ends with the pattern (the end of the data)
            j += 1
            continue
        left = lo + int((j - 1) * step) + 1 if j > 0 else lo
        while j + 1 < count and _key(data, _pointer(table, lo + int((j + 1) * step), p) + offset * w, w) == key:
            j += 1
        right = lo + int((j + 1) * step) if j + 1 < count else hi
        one[0] = key
        a, b = sa_search(data, table, w, p, left, right, offset, one, 0, 1)
        token = _token(data, _pointer(table, i, p) + offset * w, w)
        j += 1
        if token >= vocab:  # the separator: the pattern ends a document
            continue
        cnt = b - a
        r = m
        while r > 0:  # insertion into the sorted top-k
            pc = out_hi[r - 1] - out_lo[r - 1]
            if pc > cnt or (pc == cnt and out_tok[r - 1] < token):
                break
            r -= 1
        if r >= k:
            continue
        q = min(m, k - 1)
        while q > r:
            out_tok[q], out_lo[q], out_hi[q] = out_tok[q - 1], out_lo[q - 1], out_hi[q - 1]
            q -= 1
        out_tok[r], out_lo[r], out_hi[r] = token, a, b
        if m < k:
            m += 1
    return m


@njit(cache=True)
def sa_topk_next(data, table, w, p, first, vocab, lo, hi, offset, k):
    out_tok = np.empty(max(k, 0), dtype=np.int32)
    out_lo = np.empty(max(k, 0), dtype=np.int64)
    out_hi = np.empty(max(k, 0), dtype=np.int64)
    m = sa_children(data, table, w, p, first, vocab, lo, hi, offset, k, out_tok, out_lo, out_hi) if k > 0 else 0
    return out_tok[:m].copy(), (out_hi[:m] - out_lo[:m]).astype(np.int32)


@njit(cache=True)
def sa_tree(data, table, w, p, first, vocab, lo, hi, length, num_nodes, max_depth):
    """Top continuation prefixes after the match (lo, hi, length) by count, best first: the same
    tree as the automaton's `sam_frequent_tree`, by the same argument (index/best_first.py)."""
    out_tok, out_par, cand, taken = tree_buffers(num_nodes)
    kid_tok = np.empty(num_nodes, dtype=np.int32)
    kid_lo = np.empty(num_nodes, dtype=np.int64)
    kid_hi = np.empty(num_nodes, dtype=np.int64)
    n_cand, m, node_lo, node_hi, depth = 0, 0, lo, hi, 0
    while m < num_nodes:
        if depth < max_depth:
            kids = sa_children(data, table, w, p, first, vocab, node_lo, node_hi, length + depth, num_nodes - m,
                               kid_tok, kid_lo, kid_hi)
            for j in range(kids):
                n_cand = tree_push(cand, n_cand, kid_hi[j] - kid_lo[j], kid_lo[j], kid_tok[j], m - 1, depth + 1)
        best = tree_take(cand, taken, n_cand, out_tok, out_par, m)
        if best < 0:
            break
        node_lo, node_hi, depth = cand[REF, best], cand[REF, best] + cand[CNT, best], cand[DEPTH, best]
        m += 1
    return out_tok[:m], out_par[:m]


# ---------------------------------------------------------------------------------------------
# The structure


class SuffixArray:
    def __init__(self, data: np.ndarray, table: np.ndarray, token_width: int, pointer_width: int,
                 vocab_size: int, documents: int) -> None:
        # data: [bytes] uint8; table: [tokens * pointer_width] uint8
        self.data, self.table = data, table
        self.token_width, self.pointer_width = token_width, pointer_width
        self.vocab_size, self.num_documents = vocab_size, documents
        self.first = range_cache(token_width)  # sa_find's cache

    @property
    def kernel_arrays(self) -> tuple[np.ndarray, np.ndarray, int, int, np.ndarray, int]:
        # what every kernel takes first (the searches the first five)
        return self.data, self.table, self.token_width, self.pointer_width, self.first, self.vocab_size

    @property
    def num_tokens(self) -> int:
        # separators left out
        return len(self.data) // self.token_width - self.num_documents

    def match(self, tokens: np.ndarray) -> tuple[int, int, int]:
        """(lo, hi, length) of the longest suffix of tokens ([k] int) found in one document."""
        keys = np.zeros(MAX_MATCH + 1, dtype=np.int64)
        length, lo, hi = sa_follow(*self.kernel_arrays[:5], keys, follow_state(), np.asarray(tokens), -1)
        return lo, hi, length

    def continuation(self, lo: int, hi: int, length: int, n: int) -> np.ndarray:
        return sa_continuation(*self.kernel_arrays, lo, hi, length, n)

    def topk_next(self, lo: int, hi: int, length: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        return sa_topk_next(*self.kernel_arrays, lo, hi, length, k)

    def tree(self, lo: int, hi: int, length: int, num_nodes: int, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
        return sa_tree(*self.kernel_arrays, lo, hi, length, num_nodes, max_depth)

    def documents(self) -> tuple[np.ndarray, np.ndarray]:
        """The stored documents as `build_suffix_array` takes them: tokens [n] int32, doc_offsets [d+1] int64."""
        ids = np.frombuffer(self.data, dtype="<u2")
        starts = np.flatnonzero(ids == 0xFFFF)  # each document's separator
        if len(starts) != self.num_documents:
            raise StoreError(f"the token array holds {len(starts)} documents, its manifest {self.num_documents}: "
                             f"{_REBUILD}")
        lengths = np.diff(np.append(starts, len(ids))) - 1
        return ids[ids != 0xFFFF].astype(np.int32), np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)

    def lookup(self, context: np.ndarray, n: int, k: int = 8) -> Lookup:
        lo, hi, length = self.match(context)
        next_tokens, next_counts = self.topk_next(lo, hi, length, k) if length else (np.zeros(0, np.int32),) * 2
        return Lookup(int(length), int(hi - lo) if length else 0, self.continuation(lo, hi, length, n),
                      next_tokens, next_counts)


class SuffixArrayDatastore(DirectoryStore):
    @property
    def file_size(self) -> int:
        return sum(f["bytes"] for f in self.manifest["sa"]["files"].values()) + os.path.getsize(
            os.path.join(self.path, MANIFEST))

    def verify(self) -> None:
        for name, entry in self.manifest["sa"]["files"].items():
            if file_crc32(os.path.join(self.path, name)) != entry["crc32"]:
                raise StoreError(f"{self.path}/{name} does not match its checksum in {MANIFEST}: the store is "
                                 f"damaged, {_REBUILD}")


# ---------------------------------------------------------------------------------------------
# Building


def token_width(vocab_size: int) -> int:
    # every id and the separator (0xFFFF) fit in 16 bits (the format and the kernels take 4, but
    # infini-gram 2.6's indexer allocates 32 GiB for 4-byte tokens)
    if vocab_size >= 0xFFFF:
        raise UserError(f"a suffix-array store holds 16-bit token ids, and this tokenizer has {vocab_size:,}: "
                        "build a sam or ngram store")
    return 2


MIN_SORT_MEMORY = 64 << 20  # the least memory_limit the indexer is given


def check_memory_limit(memory_limit: int) -> int:
    if memory_limit < MIN_SORT_MEMORY:
        raise ConfigError("{memory_limit} is {value} bytes: give the indexer at least 64 MiB", value=memory_limit)
    return memory_limit


def default_memory_limit() -> int:
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        free = 2 << 30
    return max(256 << 20, free // 2)


def build_suffix_array(path: str | os.PathLike, tokens: np.ndarray, doc_offsets: np.ndarray, meta: StoreMeta,
                       memory_limit: int | None = None, threads: int = 1) -> SuffixArrayDatastore:
    """Write a store directory over documents tokens[doc_offsets[i]:doc_offsets[i+1]] and return it
    loaded. tokens: [n] int32 in [0, meta.vocab_size); doc_offsets: [d+1] int64 rising from 0 to n."""
    indexer = _indexer()
    memory_limit = check_memory_limit(default_memory_limit() if memory_limit is None else memory_limit)
    width = token_width(meta.vocab_size)
    doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
    if len(tokens) and int(tokens.max()) >= meta.vocab_size:
        raise UserError(f"token id {int(tokens.max())} is outside the vocabulary of {meta.vocab_size}")
    with DirectoryWriter(path) as writer:
        # 1) the token array, infini-gram's layout: a separator before each document
        documents = len(doc_offsets) - 1
        data_path = writer.tmp / FILES[0]
        _write_tokens(data_path, tokens, doc_offsets, width)
        starts = (doc_offsets[:-1] + np.arange(documents)) * width
        starts.astype("<u8").tofile(writer.tmp / FILES[2])
        size = os.path.getsize(data_path)
        pointer = max(1, int(np.ceil(np.log2(max(size, 2)) / 8)))
        # 2) the suffix array: parts sorted in memory, merged on disk, concatenated
        _run_indexer(indexer, writer.tmp, data_path, writer.tmp / FILES[1], size, pointer, width, memory_limit, threads)
        # 3) the manifest, then the directory into place
        files = {name: {"bytes": os.path.getsize(writer.tmp / name), "crc32": file_crc32(writer.tmp / name)}
                 for name in FILES}
        sa = {"token_width": width, "pointer_width": pointer, "documents": documents, "tokens": int(len(tokens)),
              "files": files}
        writer.commit_manifest({"format": FORMAT, "format_version": FORMAT_VERSION, **meta.to_header(), "sa": sa},
                               FILES)
    return load_suffix_array(path)


def _write_tokens(path: Path, tokens: np.ndarray, doc_offsets: np.ndarray, width: int) -> None:
    dtype = np.dtype("<u2" if width == 2 else "<u4")
    separator = np.array([np.iinfo(dtype).max], dtype=dtype)
    with open(path, "wb") as out:
        for d in range(len(doc_offsets) - 1):
            out.write(separator.tobytes())
            out.write(tokens[doc_offsets[d]:doc_offsets[d + 1]].astype(dtype).tobytes())


def _indexer() -> Path:
    try:
        import infini_gram
    except ImportError as err:
        raise UserError("suffix-array stores are built by infini-gram's indexer: pip install 'samctl[sa]'") from err
    binary = Path(infini_gram.__file__).parent / "rust_indexing"
    if not os.access(binary, os.X_OK):
        raise UserError(f"infini-gram's indexer {binary} is missing or not executable: reinstall infini-gram")
    return binary


# infini-gram's make-part reads up to HACK bytes past its part, so that suffixes near a part's end
# sort by their full (well, first 100,000 bytes') content; merge takes the same size.
_HACK = 100_000


def _run_indexer(binary: Path, tmp: Path, data: Path, out: Path, size: int, pointer: int, width: int,
                 memory_limit: int, threads: int) -> None:
    # Parts small enough that `threads` of them sort within memory_limit (infini-gram's own sizing:
    # about 8 bytes of working memory a byte of text, 12 at one-byte tokens).
    per_byte = 12 if width == 1 else 8
    batches = 1
    while batches * (memory_limit // per_byte) < size:
        batches *= 2
    jobs = batches * threads
    part = -(-size // jobs)
    part += (width - part % width) % width
    parts, merged = tmp / "parts", tmp / "merged"
    parts.mkdir()
    merged.mkdir()
    common = ["--ratio", str(pointer), "--token-width", str(width)]
    for first in range(0, jobs, threads):
        running = [subprocess.Popen([str(binary), "make-part", "--data-file", str(data), "--parts-dir", str(parts),
                                     "--start-byte", str(i * part), "--end-byte", str(min((i + 1) * part + _HACK, size)),
                                     *common], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                   for i in range(first, min(first + threads, jobs)) if i * part < size]
        for proc in running:
            _check_indexer(proc.communicate()[1], proc.returncode, "make-part")
    for step, args in (("merge", ["--parts-dir", str(parts), "--merged-dir", str(merged), "--hacksize", str(_HACK)]),
                       ("concat", ["--merged-dir", str(merged), "--merged-file", str(out)])):
        proc = subprocess.run([str(binary), step, "--data-file", str(data), *args, "--num-threads", str(threads),
                               *common], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _check_indexer(proc.stderr, proc.returncode, step)
    shutil.rmtree(parts)
    shutil.rmtree(merged)


def _check_indexer(stderr: bytes, code: int, step: str) -> None:
    if code != 0:
        last = (stderr.decode("utf-8", "replace").strip().splitlines() or ["no message"])[-1]
        raise UserError(f"infini-gram's indexer failed in {step} (exit status {code}): {last}")


# ---------------------------------------------------------------------------------------------
# Loading: the manifest and the files' sizes are untrusted


def load_suffix_array(path: str | os.PathLike, verify: bool = False) -> SuffixArrayDatastore:
    name = str(path)
    manifest = _read_manifest(name)
    meta = parse_meta(manifest, os.path.join(name, MANIFEST))
    sa = manifest["sa"]
    width, pointer, documents, tokens = sa["token_width"], sa["pointer_width"], sa["documents"], sa["tokens"]
    if meta.build.kind != "sa" or meta.vocab_size >= 0xFFFF or width != 2 or not 1 <= pointer <= 8:
        raise StoreError(f"{name}/{MANIFEST} has kind {meta.build.kind!r}, token width {width}, pointer width "
                         f"{pointer}: not a suffix-array store of its vocabulary, {_REBUILD}")
    for file in FILES:
        entry = sa["files"].get(file)
        actual = path_bytes(os.path.join(name, file))
        if not isinstance(entry, dict) or type(entry.get("bytes")) is not int or type(entry.get("crc32")) is not int:
            raise StoreError(f"{name}/{MANIFEST} has no valid entry for {file}: {_REBUILD}")
        if actual != entry["bytes"]:
            raise StoreError(f"{name}/{file} has {actual} bytes, {MANIFEST} says {entry['bytes']}: the store is "
                             f"damaged or truncated, {_REBUILD}")
    units = tokens + documents
    if sa["files"][FILES[0]]["bytes"] != units * width or sa["files"][FILES[1]]["bytes"] != units * pointer \
            or sa["files"][FILES[2]]["bytes"] != documents * 8 or tokens != meta.corpus.tokens or units == 0:
        raise StoreError(f"{name}/{MANIFEST}: file sizes disagree with {tokens} tokens in {documents} documents: "
                         f"{_REBUILD}")
    data = np.memmap(os.path.join(name, FILES[0]), dtype=np.uint8, mode="r")
    table = np.memmap(os.path.join(name, FILES[1]), dtype=np.uint8, mode="r")
    store = SuffixArrayDatastore(path=name, kind="sa", meta=meta, manifest=manifest,
                                 structure=SuffixArray(data, table, width, pointer, meta.vocab_size, documents))
    if verify:
        store.verify()
    return store


def _read_manifest(name: str) -> dict[str, Any]:
    file = os.path.join(name, MANIFEST)

    def bad(what: str) -> StoreError:
        return StoreError(f"{file} is damaged ({what}): {_REBUILD}")

    manifest = read_manifest(file, FORMAT, FORMAT_VERSION, "suffix-array", _REBUILD,
                             missing=f"{file} is missing: {_REBUILD}")
    sa = manifest.get("sa")
    if not isinstance(sa, dict):
        raise bad("no sa section")
    for key, kind in _SA_KEYS.items():
        if type(sa.get(key)) is not kind or (kind is int and sa[key] < 0):
            raise bad(f"sa.{key} is {sa.get(key)!r}")
    return manifest
