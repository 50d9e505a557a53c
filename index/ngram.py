"""N-gram table over token ids: contexts of 1..max_n tokens -> their most frequent next tokens.

Contract. Built from documents of int32 token ids (>= 0); a context and its next token always lie
inside one document. For each order n and each context c of n tokens, the table keeps the next
tokens t with count(c t) >= min_count, at most top_k of them, by count descending then token
ascending, plus total(c) = the number of occurrences of c followed by any token (before pruning),
which turns counts into probabilities. A context with no kept next token is dropped.

Layout (flat arrays, little-endian fixed width; C contexts over all orders, E entries):
    keys        [C] uint64    hash of the context tokens, sorted within each order's block
    ctx         [sum n*C_n] int32  the context tokens (lookups verify them: no false matches)
    order_start [max_n+1] int64    contexts of order n are [order_start[n-1], order_start[n])
    ctx_start   [max_n+1] int64    their tokens start at ctx_start[n-1], n per context
    offsets     [C+1] int64   entries of context i are [offsets[i], offsets[i+1])
    next        [E] int32     next tokens
    counts      [E] int32     count(c t)
    totals      [C] int32     total(c)
    config      [3] int64     max_n, min_count, top_k

It does NOT know text, tokenizers, files (index/store.py writes `to_arrays()`), or when a
decoder should prefer it over a suffix automaton.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from samctl.index.automaton import checked_corpus
from samctl.index.errors import UserError
from samctl.index.ngram_config import NgramConfig  # re-exported: index.ngram.NgramConfig

_HASH_SEED = np.uint64(0x243F6A8885A308D3)
_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)


# ---------------------------------------------------------------------------------------------
# Kernels


@njit(cache=True)
def _hash(tokens, start, n):
    h = _HASH_SEED
    for i in range(start, start + n):
        h = (h ^ np.uint64(np.uint32(tokens[i]))) * _HASH_MUL
        h ^= h >> np.uint64(31)
    return h


@njit(cache=True)
def _positions(tokens, doc_offsets, n):
    # -> every (context hash, next token, context start) with context and next in one document
    total = 0
    for d in range(len(doc_offsets) - 1):
        total += max(0, doc_offsets[d + 1] - doc_offsets[d] - n)
    keys = np.empty(total, dtype=np.uint64)
    nxt = np.empty(total, dtype=np.int32)
    start = np.empty(total, dtype=np.int32)  # build() checked n < 2**31
    j = 0
    for d in range(len(doc_offsets) - 1):
        for s in range(doc_offsets[d], doc_offsets[d + 1] - n):
            keys[j] = _hash(tokens, s, n)
            nxt[j] = tokens[s + n]
            start[j] = s
            j += 1
    return keys, nxt, start


@njit(cache=True)
def _same(ctx, a, b):
    for q in range(ctx.shape[1]):
        if ctx[a, q] != ctx[b, q]:
            return False
    return True


@njit(cache=True)
def _select(run_tok, run_cnt, r, min_count, top_k, out_next, out_counts, e):
    # appends the kept runs (count >= min_count, best top_k by count desc, token asc) at e
    kept = 0
    for i in range(r):
        if run_cnt[i] >= min_count:
            run_tok[kept] = run_tok[i]
            run_cnt[kept] = run_cnt[i]
            kept += 1
    if kept <= 1:
        if kept == 1:
            out_next[e] = run_tok[0]
            out_counts[e] = run_cnt[0]
        return kept
    sort_key = np.empty(kept, dtype=np.int64)
    for i in range(kept):  # count descending, then token ascending
        sort_key[i] = (np.int64(0x7FFFFFFF - run_cnt[i]) << 32) | np.int64(run_tok[i])
    order = np.argsort(sort_key)
    m = min(kept, top_k)
    for i in range(m):
        out_next[e + i] = run_tok[order[i]]
        out_counts[e + i] = run_cnt[order[i]]
    return m


@njit(cache=True)
def _count_order(keys, nxt, ctx, min_count, top_k):
    """Group positions sorted by (key, [context,] next) (keys [p], nxt [p], ctx [p, n]) into pruned
    contexts: (keys, ctx tokens, offsets, next, counts, totals, collided); collided: two contexts
    share a hash and interleave, and the caller re-sorts by the context tokens too."""
    p, n = ctx.shape
    out_keys = np.empty(p, dtype=np.uint64)
    out_ctx = np.empty(p * n, dtype=np.int32)
    out_off = np.empty(p + 1, dtype=np.int64)
    out_next = np.empty(p, dtype=np.int32)
    out_counts = np.empty(p, dtype=np.int32)
    out_totals = np.empty(p, dtype=np.int32)
    run_tok = np.empty(p, dtype=np.int32)
    run_cnt = np.empty(p, dtype=np.int32)
    c = 0
    e = 0
    out_off[0] = 0
    i = 0
    while i < p:
        # 1) the group of positions with the same context
        j = i + 1
        while j < p and keys[j] == keys[i] and _same(ctx, j, i):
            j += 1
        if j < p and keys[j] == keys[i]:
            # same hash, different context: fine only if this context does not come back
            k = j
            while k < p and keys[k] == keys[i]:
                if _same(ctx, k, i) and not _same(ctx, k - 1, i):
                    return out_keys[:0], out_ctx[:0], out_off[:1], out_next[:0], out_counts[:0], out_totals[:0], True
                k += 1
        if j - i < min_count:  # most groups: no next token can reach min_count
            i = j
            continue
        # 2) runs of equal next tokens within the group (sorted by next)
        r = 0
        for g in range(i, j):
            t = nxt[g]
            if r > 0 and run_tok[r - 1] == t:
                run_cnt[r - 1] += 1
            else:
                run_tok[r] = t
                run_cnt[r] = 1
                r += 1
        # 3) prune; keep the context if anything is left
        m = _select(run_tok, run_cnt, r, min_count, top_k, out_next, out_counts, e)
        if m > 0:
            out_keys[c] = keys[i]
            for q in range(n):
                out_ctx[c * n + q] = ctx[i, q]
            out_totals[c] = j - i
            e += m
            c += 1
            out_off[c] = e
        i = j
    return (out_keys[:c].copy(), out_ctx[: c * n].copy(), out_off[: c + 1].copy(),
            out_next[:e].copy(), out_counts[:e].copy(), out_totals[:c].copy(), False)


@njit(cache=True)
def ngram_find(keys, ctx, order_start, ctx_start, context, end, max_n):
    """Longest suffix of context[:end] (<= max_n tokens) in the table: (length, context index);
    (0, -1) if none."""
    for n in range(min(max_n, end), 0, -1):
        h = _hash(context, end - n, n)
        lo, hi = order_start[n - 1], order_start[n]
        i = lo + np.searchsorted(keys[lo:hi], h)
        while i < hi and keys[i] == h:
            base = ctx_start[n - 1] + (i - lo) * n
            same = True
            for q in range(n):
                if ctx[base + q] != context[end - n + q]:
                    same = False
                    break
            if same:
                return n, i
            i += 1
    return 0, -1


@njit(cache=True)
def ngram_continuation(keys, ctx, order_start, ctx_start, offsets, nxt, context, n, max_n):
    # greedy chain: append the most frequent next token of the longest matching suffix
    keep = min(len(context), max_n)
    work = np.empty(keep + n, dtype=np.int32)
    work[:keep] = context[len(context) - keep :]
    m = 0
    while m < n:
        length, i = ngram_find(keys, ctx, order_start, ctx_start, work, keep + m, max_n)
        if length == 0:
            break
        work[keep + m] = nxt[offsets[i]]
        m += 1
    return work[keep : keep + m].copy()


class NgramArrays(NamedTuple):
    keys: np.ndarray
    ctx: np.ndarray
    order_start: np.ndarray
    ctx_start: np.ndarray
    offsets: np.ndarray
    next: np.ndarray
    counts: np.ndarray
    totals: np.ndarray
    max_n: int


# ---------------------------------------------------------------------------------------------
# The table

_DTYPES = {"keys": "<u8", "ctx": "<i4", "order_start": "<i8", "ctx_start": "<i8", "offsets": "<i8", "next": "<i4",
           "counts": "<i4", "totals": "<i4", "config": "<i8"}


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise UserError(f"corrupt n-gram table: {what}: rebuild the store with `samctl build`")


def _contexts(tokens: np.ndarray, start: np.ndarray, n: int) -> np.ndarray:
    # -> [p, n] int32: each position's context tokens, gathered so that the counting pass streams
    ctx = np.empty((len(start), n), dtype=np.int32)
    for q in range(n):  # column by column: a [p, n] int64 index array would double the peak
        ctx[:, q] = tokens[start + q]
    return ctx


def _group(tokens: np.ndarray, positions: list[np.ndarray], n: int, config: NgramConfig) -> tuple:
    """Sort positions by (hash, next) and count; on a hash collision that interleaves two
    contexts, by (hash, context tokens, next). positions: `_positions`' arrays, emptied here so
    that each is freed as its sorted copy replaces it."""
    keys, nxt, start = positions
    positions.clear()
    order = np.lexsort((nxt, keys))
    keys, nxt = keys[order], nxt[order]
    ctx = _contexts(tokens, start[order], n)
    del order, start
    out = _count_order(keys, nxt, ctx, config.min_count, config.top_k)
    if out[-1]:
        order = np.lexsort((nxt, *(ctx[:, q] for q in range(n - 1, -1, -1)), keys))
        out = _count_order(keys[order], nxt[order], ctx[order], config.min_count, config.top_k)
        assert not out[-1], f"contexts still split after an exact sort (order {n})"
    return out[:-1]


class NgramTable:
    def __init__(self, arrays: dict[str, np.ndarray], config: NgramConfig) -> None:
        self._a = arrays
        self.config = config
        self._args = tuple(arrays[k] for k in ("keys", "ctx", "order_start", "ctx_start"))

    @classmethod
    def build(cls, tokens: np.ndarray, doc_offsets: np.ndarray, config: NgramConfig = NgramConfig()) -> "NgramTable":
        # tokens: [n] int32 >= 0, documents concatenated; doc_offsets: [d+1] int64 from 0 to n
        tokens, doc_offsets = checked_corpus(tokens, doc_offsets)
        if len(tokens) >= 2**31:
            raise UserError(f"{len(tokens)} tokens overflow int32 counts: split the corpus")
        parts = [_group(tokens, list(_positions(tokens, doc_offsets, n)), n, config)
                 for n in range(1, config.max_n + 1)]
        keys, ctx, offsets, nxt, counts, totals = zip(*parts)  # each: one array per order
        sizes = np.array([len(k) for k in keys], dtype=np.int64)
        order_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        ctx_start = np.concatenate([[0], np.cumsum(sizes * np.arange(1, config.max_n + 1))]).astype(np.int64)
        entry_base = np.concatenate([[0], np.cumsum([len(t) for t in nxt])]).astype(np.int64)
        offsets = np.concatenate([[0]] + [o[1:] + entry_base[i] for i, o in enumerate(offsets)]).astype(np.int64)
        arrays = {"keys": np.concatenate(keys), "ctx": np.concatenate(ctx), "order_start": order_start,
                  "ctx_start": ctx_start, "offsets": offsets, "next": np.concatenate(nxt),
                  "counts": np.concatenate(counts), "totals": np.concatenate(totals),
                  "config": np.array([config.max_n, config.min_count, config.top_k], dtype=np.int64)}
        return cls(arrays, config)

    # -- queries -----------------------------------------------------------------------------

    def lookup(self, context: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """Longest suffix of context ([k] int32) in the table, <= max_n tokens:
        (length, next tokens [m] int32 by count descending, counts [m] int32); (0, empty, empty)
        if none. The arrays are views into the table."""
        context = np.asarray(context, dtype=np.int32)
        length, i = ngram_find(*self._args, context, len(context), self.config.max_n)
        a = self._a
        if length == 0:
            return 0, a["next"][:0], a["counts"][:0]
        lo, hi = a["offsets"][i], a["offsets"][i + 1]
        return length, a["next"][lo:hi], a["counts"][lo:hi]

    @property
    def kernel_arrays(self) -> NgramArrays:
        a = self._a
        return NgramArrays(a["keys"], a["ctx"], a["order_start"], a["ctx_start"], a["offsets"], a["next"],
                           a["counts"], a["totals"], self.config.max_n)

    def continuation(self, context: np.ndarray, n: int) -> np.ndarray:
        context = np.asarray(context, dtype=np.int32)
        a = self._a
        return ngram_continuation(*self._args, a["offsets"], a["next"], context, max(n, 0), self.config.max_n)

    @property
    def num_contexts(self) -> int:
        return len(self._a["keys"])

    @property
    def num_entries(self) -> int:
        return len(self._a["next"])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._a.values())

    # -- arrays ------------------------------------------------------------------------------

    def to_arrays(self) -> dict[str, np.ndarray]:
        return dict(self._a)

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], config: NgramConfig | None = None) -> "NgramTable":
        """Table over `to_arrays()` output (zero-copy), checked so that no kernel reads out of
        bounds; `config`, if given, must equal the stored one."""
        a = {}
        for name, dtype in _DTYPES.items():
            _check(name in arrays, f"array {name!r} is missing")
            x = np.asarray(arrays[name])
            _check(x.dtype == np.dtype(dtype) and x.ndim == 1, f"array {name!r} has {x.dtype} {x.shape}")
            _check(x.flags.c_contiguous, f"array {name!r} is not contiguous")
            a[name] = x
        _check(len(a["config"]) == 3, "config has the wrong length")
        try:
            stored = NgramConfig(*(int(v) for v in a["config"]))
        except UserError as err:
            raise UserError(f"corrupt n-gram table: {err}") from None
        if config is not None and config != stored:
            raise UserError(f"n-gram table was built with {stored}, not {config}")
        _validate(a, stored.max_n)
        return cls(a, stored)


def _validate(a: dict[str, np.ndarray], max_n: int) -> None:
    n_ctx, n_ent = len(a["keys"]), len(a["next"])
    order_start, ctx_start, offsets = a["order_start"], a["ctx_start"], a["offsets"]
    _check(len(order_start) == max_n + 1 and len(ctx_start) == max_n + 1, "order tables have the wrong length")
    _check(order_start[0] == 0 and order_start[-1] == n_ctx and bool(np.all(np.diff(order_start) >= 0)), "order_start")
    sizes = np.diff(order_start)
    expected = np.concatenate([[0], np.cumsum(sizes * np.arange(1, max_n + 1))])
    _check(bool(np.array_equal(ctx_start, expected)) and ctx_start[-1] == len(a["ctx"]), "ctx_start")
    _check(len(offsets) == n_ctx + 1 and offsets[0] == 0 and offsets[-1] == n_ent, "offsets length")
    _check(bool(np.all(np.diff(offsets) >= 0)), "offsets do not rise")
    _check(len(a["counts"]) == n_ent and len(a["totals"]) == n_ctx, "count arrays have the wrong length")
    _check(bool(np.all(a["next"] >= 0)) and bool(np.all(a["counts"] >= 0)) and bool(np.all(a["totals"] >= 0)),
           "negative token or count")
    keys = a["keys"]
    for n in range(max_n):
        block = keys[order_start[n] : order_start[n + 1]]
        _check(bool(np.all(block[1:] >= block[:-1])), f"keys of order {n + 1} are not sorted")
