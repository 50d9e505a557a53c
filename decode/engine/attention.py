"""Grouped-query attention without `repeat_kv` for a masked verify at batch 1.

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
