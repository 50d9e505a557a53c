"""Two attention functions registered with transformers: folded grouped-query attention for a
masked verify on CUDA ("samctl_sdpa"), and attention exact per query row for int8 models on the
CPU ("samctl_rowwise", at the end of this module).

Folded grouped-query attention: no `repeat_kv` for a masked verify at batch 1.

transformers' sdpa path passes `enable_gqa` only when there is no mask, and packs head groups only
for a single query; a tree verify has both a 4D mask and many queries, so it copies K and V once
per query head of each group (`repeat_kv`), over every key of every layer. Here the n_rep query
heads that share a KV head fold into its query rows instead:

    query [1, H, q, D] -> [1, kv_heads, n_rep * q, D]   (head j * n_rep + r, row i -> group j, row r * q + i)
    mask  [1, 1, q, k] -> [1, 1, n_rep * q, k]          (row r * q + i = row i)

Each row attends the same keys with its own query and mask row, so the result is the same
attention; what is copied per layer is the mask (n_rep * q * k elements), not K and V
(2 * H * k * D). Every other call (no mask, one query, batch > 1, MHA, softcap, position bias,
dropout) is transformers' own sdpa function unchanged.

Registered with transformers as "samctl_sdpa" (attention and mask functions); `use_folded_gqa`
switches a model to it.
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
# moves an activation by a whole quantization step (SmolLM2: verify logits off by up to 4 from one-
# token steps). So every query row attends through one compiled kernel (`attend_rows`) whose
# arithmetic for a row depends on that row's query and the keys it sees alone, in the order a
# one-token step sees them (the committed prefix, then its tree ancestors): each score a dot
# product over the head dimension, the softmax's sum over the row's visible keys, the output a
# sum of value rows in key order. A one-token step runs the same kernel, so every verified row
# (tree node or batch row) equals it bit for bit, whatever the other rows are, in one call for
# all rows and heads. A prefill (no cached keys) runs batched through sdpa, as the plain
# decoder's does.
ROWWISE = "samctl_rowwise"


@njit(cache=True, fastmath={"reassoc", "contract"}, error_model="numpy")
def attend_rows(query, key, value, index, counts, scale, out):
    """out[b, i, h] = softmax(scale * q . k_j) . v_j over the keys j = index[b', i, :counts[b', i]]
    (ascending) of row i (b' = b, or 0 when index has one batch row); head h reads KV head
    h // (Hq / Hkv). query [B, Hq, q, D], key and value [B, Hkv, >= kv, D], out [B, q, Hq, D],
    all float32 and contiguous. Keys go four at a time (four dot products in one pass over D, four
    value rows in one update of the output), and exp is `exp_nonpositive`, which vectorizes: the
    order of every sum depends on D and the count of keys, never on the other rows. Each KV head
    is read by all of its query rows in turn, while its keys are in cache."""
    batch, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scores = np.empty((group, index.shape[2]), dtype=np.float32)
    acc = np.empty((group, dim), dtype=np.float32)
    for b in range(batch):
        bi = b if index.shape[0] > 1 else 0
        for g in range(kv_heads):
            keys, values = key[b, g], value[b, g]
            for i in range(rows):
                n, seen = counts[bi, i], index[bi, i]
                for r in range(group):
                    row_scores(query[b, g * group + r, i], keys, seen, n, scale, scores[r])
                acc[:, :] = 0.0
                t = 0
                while t + 4 <= n:
                    v0, v1, v2, v3 = values[seen[t]], values[seen[t + 1]], values[seen[t + 2]], values[seen[t + 3]]
                    for r in range(group):
                        p0, p1, p2, p3 = scores[r, t], scores[r, t + 1], scores[r, t + 2], scores[r, t + 3]
                        a = acc[r]
                        for d in range(dim):
                            a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]
                    t += 4
                for t in range(t, n):
                    v0 = values[seen[t]]
                    for r in range(group):
                        p0, a = scores[r, t], acc[r]
                        for d in range(dim):
                            a[d] += p0 * v0[d]
                for r in range(group):
                    out[b, i, g * group + r] = acc[r]


@njit(cache=True, fastmath={"reassoc", "contract"}, error_model="numpy")
def row_scores(q, keys, seen, n, scale, weights):
    """weights[:n] = softmax(scale * q . keys[seen[t]]) over t < n: the dot products four keys at
    a time, then exp(s - max) and one division."""
    dim = q.shape[0]
    t = 0
    while t + 4 <= n:
        k0, k1, k2, k3 = keys[seen[t]], keys[seen[t + 1]], keys[seen[t + 2]], keys[seen[t + 3]]
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for d in range(dim):
            s0 += q[d] * k0[d]
            s1 += q[d] * k1[d]
            s2 += q[d] * k2[d]
            s3 += q[d] * k3[d]
        weights[t], weights[t + 1], weights[t + 2], weights[t + 3] = s0 * scale, s1 * scale, s2 * scale, s3 * scale
        t += 4
    for t in range(t, n):
        k0 = keys[seen[t]]
        s0 = np.float32(0.0)
        for d in range(dim):
            s0 += q[d] * k0[d]
        weights[t] = s0 * scale
    top = largest(weights[:n])
    total = np.float32(0.0)
    for t in range(n):
        weights[t] = exp_nonpositive(weights[t] - top)
        total += weights[t]
    inverse = np.float32(1.0) / total
    for t in range(n):
        weights[t] *= inverse


@njit(cache=True, error_model="numpy")
def largest(row, magnitude=False):
    """max row[k] (max |row[k]| with `magnitude`), exact in any order: kept in 16 lanes
    (elementwise maxima, which compile to vector instructions where a running maximum does not),
    then folded."""
    top = abs(row[0]) if magnitude else row[0]
    lanes = np.full(16, top, dtype=np.float32)
    body = row.shape[0] - row.shape[0] % 16
    for start in range(0, body, 16):
        for j in range(16):
            lanes[j] = max(lanes[j], abs(row[start + j]) if magnitude else row[start + j])
    for k in range(body, row.shape[0]):
        top = max(top, abs(row[k]) if magnitude else row[k])
    for j in range(16):
        top = max(top, lanes[j])
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
    """Switch a model to attention exact per query row (ROWWISE)."""
    AttentionInterface.register(ROWWISE, rowwise_attention)
    AttentionMaskInterface.register(ROWWISE, sdpa_mask)
    model.set_attn_implementation(ROWWISE)
