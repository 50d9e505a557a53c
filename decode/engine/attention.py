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

import torch
import torch.nn.functional as F
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
# token steps). So every query row attends in its own sdpa call over exactly the keys it sees, in
# the order a one-token step sees them (the committed prefix, then its tree ancestors):
#
#     out[b, i] = sdpa(query[b, :, i], keys(b, i), values(b, i))      one call shape per row
#
# which is what a one-token step of the same model computes, bit for bit, whatever the other rows
# (verified tokens or batch rows) are. Why not one call for all rows: the CPU kernels' arithmetic
# for a row depends on the number of rows and keys in the call (gemm blocking, the vector/scalar
# split of the softmax sum), so no shared call keeps a row exact. What is vectorized is everything
# around the calls: which keys each row sees is read from the mask once per forward (not once per
# layer), prefix rows read a view of the cache, and tree rows copy only their ancestors behind one
# shared copy of the prefix. A prefill (no cached keys) runs batched, as the plain decoder's does.
ROWWISE = "samctl_rowwise"


# The last forward's visible keys: (mask, (B, q, kv), rows, shared), replaced in one assignment so
# that a thread never reads one mask's rows under another's key. Holding the mask keeps its id
# from being reused by another mask while it is cached.
_last_visible: tuple | None = None


def _visible_keys(mask: torch.Tensor, batch: int, q: int, kv: int) -> tuple[list, list]:
    """The keys each query row sees, read from one forward's mask once and reused by every layer.
    mask: [B or 1, 1, q, kv] bool (True = attend) or additive float (0 = attend); a mask edited in
    place between forwards must come as a new tensor object (the engines' views do).

    -> (rows, shared): rows[b][i] is an int n (row i of batch row b sees keys [0, n)) or a tensor
    of key indices >= shared[b][i] (it sees [0, shared[b][i]) and those); shared[b][i] is one
    value per batch row, or 0."""
    global _last_visible
    last = _last_visible
    if last is not None and last[0] is mask and last[1] == (batch, q, kv):
        return last[2], last[3]
    seen = mask[:, 0, :, :kv]
    seen = seen if seen.dtype == torch.bool else seen == 0
    seen = seen.expand(batch, q, kv)
    counts = seen.sum(-1)  # [B, q]
    lead = seen.cumprod(-1).sum(-1)  # the leading run of visible keys
    prefix = (lead == counts).tolist()
    counts, lead = counts.tolist(), lead.tolist()
    rows, shared = [], []
    for b in range(batch):
        # rows that see no prefix at all (a batched verify's padding inputs see only themselves)
        # take their keys alone, so that they do not shorten the prefix the others share
        start = min((lead[b][i] for i in range(q) if not prefix[b][i] and lead[b][i]), default=0)
        rows.append([counts[b][i] if prefix[b][i] else
                     torch.nonzero(seen[b, i, start if lead[b][i] else 0 :])[:, 0] + (start if lead[b][i] else 0)
                     for i in range(q)])
        shared.append([0 if prefix[b][i] or not lead[b][i] else start for i in range(q)])
    _last_visible = (mask, (batch, q, kv), rows, shared)
    return rows, shared


def _row_query(query: torch.Tensor) -> torch.Tensor:
    """query [1, Hq, 1, D] as a one-token step's own: a tensor of its own, strides (Hq * D, D, D, 1).
    A row sliced from a verify's query is a view at an offset whose strides (q * Hq * D, D, Hq * D, 1)
    say "contiguous" yet reach the kernel as other leading dimensions: on an AVX2 CPU (an AMD EPYC,
    issue 42) sdpa rounded the two differently, 1.5e-8 in layer 0 at every verify width >= 16."""
    _, heads, _, dim = query.shape
    if query.storage_offset() == 0 and query.stride() == (heads * dim, dim, dim, 1):
        return query
    return query.clone(memory_format=torch.contiguous_format)


def rowwise_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    # query: [B, Hq, q, D]; key, value: [B, Hkv, kv, D]; attention_mask: [B or 1, 1, q, kv] bool or
    # additive float, or None (causal: row i sees the first kv - q + i + 1 keys)
    # -> ([B, q, Hq, D], None), as transformers' sdpa_attention_forward returns
    batch, heads, q, dim = query.shape
    kv = key.shape[2]
    if q == kv and q > 1:  # a prefill (no cached keys): run as a plain greedy decoder's prefill runs it
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = heads != key.shape[1]
    if attention_mask is None and q == 1 and batch == 1:  # a one-token step: the loop's one call, without the loop
        out = F.scaled_dot_product_attention(_row_query(query), key, value, dropout_p=dropout, scale=scaling,
                                             enable_gqa=gqa)
        return out.transpose(1, 2), None
    if attention_mask is None:
        rows, shared = [[kv - q + i + 1 for i in range(q)]] * batch, [[0] * q] * batch
    else:
        rows, shared = _visible_keys(attention_mask, batch, q, kv)
    out = query.new_empty(batch, q, heads, dim)
    for b in range(batch):
        keys, values = key[b : b + 1], value[b : b + 1]
        scratch = None
        for i, seen in enumerate(rows[b]):
            start = shared[b][i]
            if isinstance(seen, int):  # a prefix: a view of the cache
                k, v = keys.narrow(2, 0, seen), values.narrow(2, 0, seen)
            elif not start:  # no prefix: its few keys alone
                k, v = keys.index_select(2, seen), values.index_select(2, seen)
            else:  # the shared prefix, then this row's own keys copied behind it
                if scratch is None:
                    width = start + max(int(s.numel()) for s in rows[b] if not isinstance(s, int))
                    # the cache's own head stride (its capacity), so these keys lie as a step's do
                    scratch = keys.new_empty(2, 1, keys.shape[1], max(width, keys.stride(1) // dim), dim)
                    scratch[0, :, :, :start] = keys[:, :, :start]
                    scratch[1, :, :, :start] = values[:, :, :start]
                n = int(seen.numel())
                scratch[0, :, :, start : start + n] = keys.index_select(2, seen)
                scratch[1, :, :, start : start + n] = values.index_select(2, seen)
                k, v = scratch[0, :, :, : start + n], scratch[1, :, :, : start + n]
            row = F.scaled_dot_product_attention(_row_query(query[b : b + 1, :, i : i + 1]), k, v,
                                                 dropout_p=dropout, scale=scaling, enable_gqa=gqa)  # [1, Hq, 1, D]
            out[b, i] = row[0, :, 0]
    return out, None


def exact_rows(model: torch.nn.Module) -> bool:
    """True when the model attends with ROWWISE: a batched engine must then prefill each prompt
    as batch 1 does (a padded batch prefill sums in another order)."""
    return getattr(model.config, "_attn_implementation", None) == ROWWISE


def use_rowwise_attention(model: torch.nn.Module) -> None:
    """Switch a model to attention exact per query row (ROWWISE)."""
    AttentionInterface.register(ROWWISE, rowwise_attention)
    AttentionMaskInterface.register(ROWWISE, sdpa_mask)
    model.set_attn_implementation(ROWWISE)
