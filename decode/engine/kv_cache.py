"""KV caches samctl owns: preallocated storage behind transformers' cache-layer protocol, so any
model that calls `past_key_values.update(k, v, layer_idx)` works unchanged (`OwnedLayer`; the
target's cache, decode/engine/batched.py, builds on it).

`StaticKVCache` is the one-sequence cache of an EAGLE head: storage [2, layers, 1, kv_heads,
capacity, head_dim], allocated at the first `update` from the shapes the model produces, every
layer holding `length` valid entries; `update` writes behind them and returns views of
[0, length + q), exactly what a DynamicCache returns. Knows nothing of drafts or acceptance.
"""
from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from samctl.index.errors import UserError

ALIGN = 64  # capacity granule: mask rows of `capacity` elements keep 16-byte aligned strides


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@functools.lru_cache(maxsize=None)
def _cache_name(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def with_cache(module: torch.nn.Module, cache: Cache | None) -> dict:
    """The keyword argument that hands `cache` to `module`'s forward: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name goes in 5.40), earlier versions know only the old."""
    return {_cache_name(type(module).forward): cache}


class OwnedLayer(CacheLayerMixin):
    """One layer's view of storage its cache owns (transformers' cache-layer protocol); the
    single-sequence and the batched cache (decode/engine/batched.py) both build on it."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: Cache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.length = 0
        self.is_initialized = True  # storage is the owner's; nothing to initialise lazily

    def get_max_length(self) -> int:
        return self.owner.capacity


class StaticLayer(OwnedLayer):
    is_croppable = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner.allocate_like(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [1, kv_heads, q, head_dim] -> keys, values [1, kv_heads, n, head_dim]
        owner = self.owner
        if owner.storage is None:
            owner.allocate_like(key_states, value_states)
        keys, values = owner.storage[0, self.index], owner.storage[1, self.index]
        start = self.length
        end = start + key_states.shape[-2]
        assert end <= keys.shape[-2], ("KV cache overflow: reserve before the forward", end, keys.shape)
        keys.narrow(2, start, end - start).copy_(key_states)  # narrow: cheaper than slice indexing
        values.narrow(2, start, end - start).copy_(value_states)
        self.length = end
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        self.length = self.length - tokens_to_remove if tokens_to_remove >= 0 else self.length + tokens_to_remove

    def reset(self) -> None:
        self.length = 0


class StaticKVCache(Cache):
    def __init__(self, num_layers: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(layers=[StaticLayer(self, i) for i in range(num_layers)])
        self.dtype, self.device = dtype, device
        self.storage: torch.Tensor | None = None
        self.min_capacity = 0

    @property
    def capacity(self) -> int:
        return 0 if self.storage is None else int(self.storage.shape[-2])

    def allocate_like(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # key_states: [1, kv_heads, q, head_dim] from layer 0's first forward
        if key_states.shape != value_states.shape:
            raise UserError(f"keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} differ in shape: "
                            "samctl's KV cache supports standard multi-head/grouped-query attention only")
        _, heads, q, dim = key_states.shape
        capacity = aligned(max(self.min_capacity, q))
        shape = (2, len(self.layers), 1, heads, capacity, dim)
        # zeros, not empty: unused slots are read under a blocked mask, and a NaN there would
        # poison every row (0 * NaN in the attention's weighted sum)
        self.storage = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)

    def reserve(self, n: int) -> None:
        """Make room for n entries, keeping the valid ones; doubles so that growth is rare, and
        rounds up to ALIGN."""
        self.min_capacity = max(self.min_capacity, aligned(n))
        if self.storage is None or n <= self.capacity:
            return
        old, valid = self.storage, self.get_seq_length()
        shape = list(old.shape)
        shape[-2] = aligned(max(n, 2 * old.shape[-2]))
        self.storage = torch.zeros(shape, dtype=old.dtype, device=old.device)
        self.storage[..., :valid, :] = old[..., :valid, :]

    def set_length(self, n: int) -> None:
        for layer in self.layers:
            layer.length = n
