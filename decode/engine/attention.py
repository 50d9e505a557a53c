"""Two attention functions registered with transformers: folded grouped-query attention for a
masked verify on CUDA ("samctl_sdpa", `use_folded_gqa`), and attention exact per query row for
int8 models on the CPU ("samctl_rowwise", below, on float vectors the end of the module defines).

Folded GQA: transformers' sdpa path passes `enable_gqa` only when there is no mask, and packs head
groups only for a single query, so a tree verify (a 4D mask, many queries) copies K and V once per
query head (`repeat_kv`) in every layer. Here the n_rep query heads that share a KV head fold into
its query rows instead:

    query [1, H, q, D] -> [1, kv_heads, n_rep * q, D]   (head j * n_rep + r, row i -> group j, row r * q + i)
    mask  [1, 1, q, k] -> [1, 1, n_rep * q, k]          (row r * q + i = row i)

the same attention, copying the mask (n_rep * q * k elements) instead of K and V (2 * H * k * D).
Every other call (no mask, one query, batch > 1, MHA, softcap, ...) is transformers' own sdpa.
"""
from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from samctl.decode.engine.kv_cache import aligned
from samctl.decode.engine.vectors import llvm_call, load, pointer, shape_of, spread, store, zeros, zeros_like

NAME = "samctl_sdpa"


def folded_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    # query [B, H, q, D]; key, value [B, kv_heads, k, D]; attention_mask [B, 1, q, k] or None
    # -> attention output [B, q, H, D], as transformers' attention functions return it
    n_rep = int(getattr(module, "num_key_value_groups", 1))
    batch, heads, q, dim = query.shape
    if (n_rep == 1 or batch != 1 or q == 1 or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.shape[:2] != (1, 1) or dropout or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None or key.shape[-1] != value.shape[-1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kv_heads, k = key.shape[1], key.shape[2]
    folded = query.reshape(1, kv_heads, n_rep * q, dim)
    # rows at an aligned stride: the fused kernels pad (allocate and copy) a bias whose stride isn't
    rows = attention_mask.new_empty(n_rep, q, aligned(k))[..., :k]
    rows.copy_(attention_mask[0, 0].expand(n_rep, q, k))
    mask = rows.view(1, 1, n_rep * q, k)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(1, heads, q, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, folded_sdpa_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_folded_gqa(model: torch.nn.Module) -> bool:
    """Switch a model on sdpa attention with grouped KV heads to the folded variant; True if it was."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads or heads == kv_heads:
        return False
    try:
        model.set_attn_implementation(NAME)
    except (AttributeError, ValueError, ImportError):  # a transformers without custom attention names
        return False  # its own sdpa stays: correct, with repeat_kv's copies
    return getattr(model.config, "_attn_implementation", None) == NAME


# -- attention exact per query row (int8 models on the CPU) ------------------------------------------
# int8 linears are exact per row (decode/engine/cpu_linear.py), but sdpa over q query rows sums in
# another order than over one, and a last-bit difference that crosses an int8 rounding boundary
# moves an activation by a whole quantization step (SmolLM2: verify logits off by up to 4). So every
# query row attends through `attend_rows`, whose arithmetic for a row depends on that row's query
# and visible keys alone, in the order a one-token step sees them (the committed prefix, then its
# tree ancestors): every verified row (tree node or batch row) equals a one-token step bit for bit.
# A prefill (no cached keys) runs batched through sdpa, as the plain decoder's does.
ROWWISE = "samctl_rowwise"


@njit(cache=True, error_model="numpy")
def attend_rows(query, key, value, index, counts, scale, out):
    """out[b, i, h] = softmax(scale * q . k_j) . v_j over the keys j = index[b', i, :counts[b', i]]
    (ascending) of row i (b' = b, or 0 when index has one batch row); head h reads KV head
    h // (Hq / Hkv). query [B, Hq, q, D], key and value [B, Hkv, >= kv, D], out [B, q, Hq, D],
    all float32 and contiguous. Every sum's order depends on D and the row's keys alone:

        q . k  = (sum over d < D/2 of q[d] k[d]) + (sum over D/2 <= d < D), each in order, fused
        out[d] = sum over the keys in order of p_j v_j[d], fused

    computed in vectors of `lanes` floats (16 where D allows): the scores of keys by position,
    `lanes` at once from their keys transposed (`transpose`) once for every query head and row, then
    moved to each row's own order (its ancestors after its prefix: only a tree's keys move); the
    weighted sum of values for up to four query heads at once."""
    if query.shape[3] >= 16:
        _attend(query, key, value, index, counts, scale, out, zeros("f32x16"))
    elif query.shape[3] >= 4:
        _attend(query, key, value, index, counts, scale, out, zeros("f32x4"))
    else:
        _attend(query, key, value, index, counts, scale, out, zeros("f32x1"))


@njit(cache=True, error_model="numpy")
def _attend(query, key, value, index, counts, scale, out, like):
    batch, heads, rows, dim = query.shape
    group = heads // key.shape[1]
    lanes = shape_of(like)[0]
    pair, span = 2 * lanes, dim * lanes  # the scores of two blocks of `lanes` keys at a time
    weights = np.empty((group, rows, -(-index.shape[2] // pair) * pair), dtype=np.float32)
    totals = np.empty((group, rows), dtype=np.float32)  # 1 / the sum of a query's weights
    kt = np.empty(2 * span, dtype=np.float32)  # two blocks of keys, transposed: kt[s * span + d * lanes + j] = k_j[d]
    offsets = np.empty(lanes, dtype=np.int64)
    reach = np.empty(rows, dtype=np.int64)  # 1 + a row's last visible key
    moved = np.empty(rows, dtype=np.int64)  # a row's first visible key not at its own position
    for b in range(batch):
        bi = b if index.shape[0] > 1 else 0
        for i in range(rows):
            seen, n = index[bi, i], counts[bi, i]
            reach[i] = seen[n - 1] + 1 if n else 0
            low, high = 0, n  # seen ascends, so seen[t] == t holds for a prefix of t: its end
            while low < high:
                mid = (low + high) // 2
                low, high = (mid + 1, high) if seen[mid] == mid else (low, mid)
            moved[i] = low
        longest = reach.max()
        for g in range(key.shape[1]):
            keys, values = key[b, g], value[b, g]
            for first in range(0, longest, pair):  # keys by position, each block transposed once for every row
                for s in range(2):
                    for j in range(lanes):  # past the last key: the last again (scores never read)
                        offsets[j] = min(first + s * lanes + j, longest - 1) * dim
                    for c in range(-(-dim // lanes)):
                        start = min(c * lanes, dim - lanes)
                        transpose(keys, offsets, start, kt, s * span + start * lanes, like)
                for r in range(0, group, 4):
                    block_dots(query[b], g * group + r, min(4, group - r), reach, kt, weights, r, first, like)
            for r in range(group):
                for i in range(rows):
                    seen, n, row = index[bi, i], counts[bi, i], weights[r, i]
                    for t in range(moved[i], n):  # the scores of the row's keys, in its order (seen[t] >= t)
                        row[t] = row[seen[t]]
                    totals[r, i] = softmax(row[:n], scale)
            for r in range(0, group, 4):
                weighted_sums(weights, totals, r, min(4, group - r), values, index[bi], counts[bi], out[b], g * group + r,
                              like)


@njit(cache=True, error_model="numpy")
def block_dots(query, h, count, reach, kt, weights, r, first, like):
    """weights[r + u, i, first:first + 2 lanes] = the scores of query heads h + u (u < count <= 4)
    of every row i that sees keys from `first` on (first < reach[i]) against the two blocks of keys
    kt holds, two chains each (d < D/2 and the rest): twice the chains of one block, so that the
    multiply-adds run at the core's rate, not at one chain's latency (scores past a row's keys are
    never read)."""
    lanes, dim = shape_of(like)[0], query.shape[2]
    half, span = dim // 2, dim * lanes
    for i in range(query.shape[1]):
        if first >= reach[i]:
            continue
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = zeros_like(like)
        c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = a0
        for d in range(half):
            low, high = load(kt, d * lanes, like), load(kt, (d + half) * lanes, like)
            low2, high2 = load(kt, span + d * lanes, like), load(kt, span + (d + half) * lanes, like)
            q, p = splat(query[h, i, d], like), splat(query[h, i, d + half], like)
            a0, b0, c0, e0 = fma(q, low, a0), fma(p, high, b0), fma(q, low2, c0), fma(p, high2, e0)
            if count > 1:
                q, p = splat(query[h + 1, i, d], like), splat(query[h + 1, i, d + half], like)
                a1, b1, c1, e1 = fma(q, low, a1), fma(p, high, b1), fma(q, low2, c1), fma(p, high2, e1)
            if count > 2:
                q, p = splat(query[h + 2, i, d], like), splat(query[h + 2, i, d + half], like)
                a2, b2, c2, e2 = fma(q, low, a2), fma(p, high, b2), fma(q, low2, c2), fma(p, high2, e2)
            if count > 3:
                q, p = splat(query[h + 3, i, d], like), splat(query[h + 3, i, d + half], like)
                a3, b3, c3, e3 = fma(q, low, a3), fma(p, high, b3), fma(q, low2, c3), fma(p, high2, e3)
        if dim % 2:
            last, last2 = load(kt, (dim - 1) * lanes, like), load(kt, span + (dim - 1) * lanes, like)
            q = splat(query[h, i, dim - 1], like)
            b0, e0 = fma(q, last, b0), fma(q, last2, e0)
            q = splat(query[h + min(1, count - 1), i, dim - 1], like)
            b1, e1 = fma(q, last, b1), fma(q, last2, e1)
            q = splat(query[h + min(2, count - 1), i, dim - 1], like)
            b2, e2 = fma(q, last, b2), fma(q, last2, e2)
            q = splat(query[h + min(3, count - 1), i, dim - 1], like)
            b3, e3 = fma(q, last, b3), fma(q, last2, e3)
        store(weights[r, i], first, add(a0, b0))
        store(weights[r, i], first + lanes, add(c0, e0))
        if count > 1:
            store(weights[r + 1, i], first, add(a1, b1))
            store(weights[r + 1, i], first + lanes, add(c1, e1))
        if count > 2:
            store(weights[r + 2, i], first, add(a2, b2))
            store(weights[r + 2, i], first + lanes, add(c2, e2))
        if count > 3:
            store(weights[r + 3, i], first, add(a3, b3))
            store(weights[r + 3, i], first + lanes, add(c3, e3))


@njit(cache=True, fastmath={"reassoc", "contract"}, error_model="numpy")
def softmax(weights, scale):
    """weights = exp(scale * weights - max) in place -> 1 / their sum (the softmax's division,
    left to `weighted_sums`). max(scale * s) is scale * max(s) exactly: scale > 0, rounding is monotone."""
    top = largest(weights) * scale
    total = np.float32(0.0)
    for t in range(weights.shape[0]):
        weights[t] = exp_nonpositive(weights[t] * scale - top)
        total += weights[t]
    return np.float32(1.0) / total


@njit(cache=True, error_model="numpy")
def weighted_sums(weights, totals, r, count, values, index, counts, out, h, like):
    """out[i, h + u] = totals[r + u, i] x the sum over t < n, in order, of weights[r + u, i, t] *
    values[seen[t]], fused, for u < count <= 4, for every row i (its keys seen = index[i], n =
    counts[i]): `lanes` of D at once, four chunks of them a pass over the keys (a chunk past D
    starts at D - lanes: lanes it shares with the one before get the same sums again)."""
    lanes, dim = shape_of(like)[0], out.shape[2]
    for i in range(counts.shape[0]):
        seen, n, row = index[i], counts[i], out[i]
        u1, u2, u3 = r + min(1, count - 1), r + min(2, count - 1), r + min(3, count - 1)
        w0, w1, w2, w3 = weights[r, i], weights[u1, i], weights[u2, i], weights[u3, i]
        zero = zeros_like(like)
        for c in range(0, -(-dim // lanes), 4):
            o0, o1, o2, o3 = (min(c * lanes, dim - lanes), min((c + 1) * lanes, dim - lanes),
                              min((c + 2) * lanes, dim - lanes), min((c + 3) * lanes, dim - lanes))
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = zero
            for t in range(n):
                at = seen[t] * dim
                x, y = load(values, at + o0, like), load(values, at + o1, like)
                z, v = load(values, at + o2, like), load(values, at + o3, like)
                p = splat(w0[t], like)
                a0, b0, c0, e0 = fma(p, x, a0), fma(p, y, b0), fma(p, z, c0), fma(p, v, e0)
                if count > 1:
                    p = splat(w1[t], like)
                    a1, b1, c1, e1 = fma(p, x, a1), fma(p, y, b1), fma(p, z, c1), fma(p, v, e1)
                if count > 2:
                    p = splat(w2[t], like)
                    a2, b2, c2, e2 = fma(p, x, a2), fma(p, y, b2), fma(p, z, c2), fma(p, v, e2)
                if count > 3:
                    p = splat(w3[t], like)
                    a3, b3, c3, e3 = fma(p, x, a3), fma(p, y, b3), fma(p, z, c3), fma(p, v, e3)
            for u, (a, b, f, e) in enumerate(((a0, b0, c0, e0), (a1, b1, c1, e1), (a2, b2, c2, e2), (a3, b3, c3, e3))):
                if u < count:
                    total = splat(totals[r + u, i], like)
                    store(row[h + u], o0, fma(a, total, zero))
                    store(row[h + u], o1, fma(b, total, zero))
                    store(row[h + u], o2, fma(f, total, zero))
                    store(row[h + u], o3, fma(e, total, zero))


@njit(cache=True, error_model="numpy")
def largest(row, magnitude=False):
    """max row[k] (max |row[k]| with `magnitude`) of a contiguous row, exact in any order: two
    vectors of running maxima over 32 values at a time, then the rest one by one."""
    top = abs(row[0]) if magnitude else row[0]
    body = row.shape[0] - row.shape[0] % 32
    if body:
        like = zeros("f32x16")
        m0 = m1 = splat(top, like)
        for s in range(0, body, 32):
            x, y = load(row, s, like), load(row, s + 16, like)
            if magnitude:  # tested here, not per value: the loop then compiles without branches
                m0, m1 = bigger(m0, absolute(x)), bigger(m1, absolute(y))
            else:
                m0, m1 = bigger(m0, x), bigger(m1, y)
        top = widest(bigger(m0, m1))
    for k in range(body, row.shape[0]):
        top = max(top, abs(row[k]) if magnitude else row[k])
    return top


@njit(cache=True, inline="always")
def exp_nonpositive(x):
    """exp(x) for x <= 0 in float32, within one unit in the last place of libm's (Cephes' expf:
    x = n ln 2 + r, |r| <= ln 2 / 2, e^r by a degree-7 polynomial), times 2^n, whose float32 bits
    are (n + 127) << 23 (n >= -126 here: exact); below -87 it gives e^-87. Plain float and integer
    operations, so a loop of it vectorizes where a call to libm does not."""
    v = max(x, np.float32(-87.0))
    n = np.floor(v * np.float32(1.4426950408889634) + np.float32(0.5))
    r = (v - n * np.float32(0.693359375)) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    return p * float_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))


@intrinsic
def float_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 `bits`."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


# The last forward's visible keys: (mask, (B, q, kv), index, counts), replaced in one assignment
# so that a thread never reads one mask's rows under another's key. Holding the mask keeps its id
# from being reused by another mask while it is cached.
_last_visible: tuple | None = None


def visible_keys(mask: torch.Tensor | None, batch: int, q: int, kv: int) -> tuple[np.ndarray, np.ndarray]:
    """The keys each query row sees, read from one forward's mask once and reused by every layer.
    mask: [B or 1, 1, q, kv] bool (True = attend) or additive float (0 = attend), or None (causal:
    row i sees the first kv - q + i + 1 keys); a mask edited in place between forwards must come as
    a new tensor object (the engines' views do).

    -> (index [B or 1, q, kv] int64: row i's visible keys ascending, then the others; counts
    [B or 1, q] int64: how many it sees)"""
    global _last_visible
    last = _last_visible
    if last is not None and last[0] is mask and last[1] == (batch, q, kv):
        return last[2], last[3]
    if mask is None:
        index = np.ascontiguousarray(np.broadcast_to(np.arange(kv, dtype=np.int64), (1, q, kv)))
        counts = (kv - q + 1 + np.arange(q, dtype=np.int64))[None]
    else:
        seen = mask[:, 0, :, :kv]
        seen = seen if seen.dtype == torch.bool else seen == 0
        counts = seen.sum(-1).numpy()
        index = torch.argsort(~seen, dim=-1, stable=True).numpy()  # visible first, each part ascending
    _last_visible = (mask, (batch, q, kv), index, counts)
    return index, counts


def _whole(cache: torch.Tensor) -> torch.Tensor:
    """A [B, H, kv, D] view of a KV cache as the contiguous [B, H, capacity, D] block it lies in
    (no copy), or a contiguous copy when it lies otherwise."""
    batch, heads, _, dim = cache.shape
    head = cache.stride(1)
    if (cache.stride(3) == 1 and cache.stride(2) == dim and head % dim == 0 and cache.stride(0) == heads * head
            and cache.untyped_storage().nbytes() >= (cache.storage_offset() + batch * heads * head) * cache.element_size()):
        return torch.as_strided(cache, (batch, heads, head // dim, dim), cache.stride())
    return cache.contiguous()


def exact_attention(query: torch.Tensor, keys: np.ndarray, values: np.ndarray, mask: torch.Tensor | None, kv: int,
                    scaling: float | None = None) -> torch.Tensor:
    """Attention exact per query row (`attend_rows`): query [B, Hq, q, D] float32 on the CPU; keys,
    values [B, Hkv, >= kv, D] contiguous float32 arrays (a KV cache's whole block: its first kv
    keys are attended); mask as `visible_keys` reads it -> [B, q, Hq, D]."""
    batch, heads, q, dim = query.shape
    index, counts = visible_keys(mask, batch, q, kv)
    out = query.new_empty(batch, q, heads, dim)
    attend_rows(query.contiguous().numpy(), keys, values, index, counts,
                np.float32(dim ** -0.5 if scaling is None else scaling), out.numpy())
    return out


def rowwise_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    # query: [B, Hq, q, D]; key, value: [B, Hkv, kv, D]; attention_mask: [B or 1, 1, q, kv] bool or
    # additive float, or None (causal: row i sees the first kv - q + i + 1 keys)
    # -> ([B, q, Hq, D], None), as transformers' sdpa_attention_forward returns
    q, kv = query.shape[2], key.shape[2]
    if q == kv and q > 1:  # a prefill (no cached keys): run as a plain greedy decoder's prefill runs it
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return exact_attention(query, _whole(key).numpy(), _whole(value).numpy(), attention_mask, kv, scaling), None


def exact_rows(model: torch.nn.Module) -> bool:
    """True when the model attends with ROWWISE: a batched engine must then prefill each prompt
    as batch 1 does (a padded batch prefill sums in another order)."""
    return getattr(model.config, "_attn_implementation", None) == ROWWISE


def use_rowwise_attention(model: torch.nn.Module) -> None:
    AttentionInterface.register(ROWWISE, rowwise_attention)
    AttentionMaskInterface.register(ROWWISE, sdpa_mask)
    model.set_attn_implementation(ROWWISE)


# -- operations on attention's float vectors (decode/engine/vectors.py), each written out: no sum is
# reordered


@intrinsic
def splat(typingctx, x, like):
    """The float32 x in every lane of `like`."""

    def codegen(context, builder, sig, args):
        return spread(builder, args[0], like.vector)

    return like(types.float32, like), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c lane by lane, rounded once (`llvm.fma`)."""

    def codegen(context, builder, sig, args):
        return llvm_call(builder, f"llvm.fma.v{a.count}f32", a.vector, args)

    return a(a, a, a), codegen


def _indices(lanes: list[int]) -> ir.Constant:
    # a shufflevector mask: lane j of the result is lane lanes[j] of the two inputs end to end
    return ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes)


@intrinsic
def add(typingctx, a, b):
    """a + b lane by lane."""

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])

    return a(a, a), codegen


@intrinsic
def transpose(typingctx, source, offsets, start, target, at, like):
    """target[at + l * lanes + j] = source[offsets[j] + start + l] for l, j < lanes: `lanes` rows of
    `lanes` floats, each from its own offset in a contiguous float32 array, stored as columns (by
    log2(lanes) rounds of shuffles in registers)."""

    def codegen(context, builder, sig, args):
        count, vector, i64 = like.count, like.vector, ir.IntType(64)
        where = context.make_array(sig.args[1])(context, builder, args[1]).data
        rows = []
        for j in range(count):
            offset = builder.add(builder.load(builder.gep(where, [i64(j)])), args[2])
            rows.append(builder.load(pointer(context, builder, sig.args[0], args[0], offset, vector), align=4))
        step = 1
        while step < count:  # swap the off-diagonal step x step blocks of every 2step x 2step block
            for j in range(count):
                if j & step:
                    continue
                x, y = rows[j], rows[j + step]
                low = [lane if not lane & step else count + lane - step for lane in range(count)]
                high = [lane + step if not lane & step else count + lane for lane in range(count)]
                rows[j], rows[j + step] = builder.shuffle_vector(x, y, _indices(low)), \
                    builder.shuffle_vector(x, y, _indices(high))
            step *= 2
        for j, row in enumerate(rows):
            builder.store(row, pointer(context, builder, sig.args[3], args[3], builder.add(args[4], i64(j * count)),
                                        vector), align=4)
        return context.get_dummy_value()

    return types.void(source, offsets, types.intp, target, types.intp, like), codegen


@intrinsic
def bigger(typingctx, a, b):
    """The larger of a and b lane by lane."""

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])

    return a(a, a), codegen


@intrinsic
def absolute(typingctx, a):
    """|a| lane by lane (`llvm.fabs`)."""

    def codegen(context, builder, sig, args):
        return llvm_call(builder, f"llvm.fabs.v{a.count}f32", a.vector, args)

    return a(a), codegen


@intrinsic
def widest(typingctx, a):
    """The largest of a's lanes."""

    def codegen(context, builder, sig, args):
        lanes = [builder.extract_element(args[0], ir.IntType(32)(j)) for j in range(a.count)]
        while len(lanes) > 1:
            lanes = [builder.select(builder.fcmp_ordered(">", x, y), x, y) for x, y in zip(lanes[::2], lanes[1::2])]
        return lanes[0]

    return types.float32(a), codegen
