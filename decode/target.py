"""The target model behind one interface: prefill, verify a draft tree, keep the accepted path.

Works with any Hugging Face causal LM that takes a 4D additive attention mask, explicit
`position_ids` and a `DynamicCache` (Llama, Qwen2, Mistral, GPT-NeoX families). Knows nothing
of drafters or acceptance rules: it runs forwards and edits the KV cache.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from decode.tree import DraftTree, tree_attention_mask


class TargetModel:
    """Holds the model and its KV cache for one sequence at a time (batch size 1)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30) or (1 << 30))
        self.cache: DynamicCache | None = None
        self.cached = 0  # tokens whose K/V are in the cache and committed

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        # prompt_ids: [n] int64 on device -> logits [n, V] of every prompt position
        self.cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=prompt_ids[None], past_key_values=self.cache, use_cache=True)
        self.cached = int(prompt_ids.shape[0])
        return out.logits[0]

    @torch.inference_mode()
    def verify(self, input_ids: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        # input_ids: [q] int64 = [t0, nodes...] on device -> logits [q, V].
        # Appends q entries to the cache; `keep` must follow before the next call.
        q = int(input_ids.shape[0])
        past = self.cached
        depths = np.concatenate(([0], tree.depths())) if len(tree) else np.zeros(1, dtype=np.int32)
        position_ids = torch.from_numpy(past + depths.astype(np.int64)).to(self.device)[None]
        if tree.is_chain:
            mask = None  # the model's own causal mask is exactly the chain's tree mask
        else:
            mask = tree_attention_mask(tree.parents, past, self.dtype, self.device)
        out = self.model(
            input_ids=input_ids[None],
            position_ids=position_ids,
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
        )
        assert self.cache.get_seq_length() == past + q, (self.cache.get_seq_length(), past, q)
        return out.logits[0]

    @torch.inference_mode()
    def keep(self, path: np.ndarray) -> None:
        # path: [a+1] input indices of the accepted path of the last verify, root (0) first.
        # Chain-shaped paths (0, 1, ..., a) only crop; others move the accepted K/V entries to
        # the front of the verified block, then crop. RoPE stays right because every entry was
        # computed at its true position.
        past = self.cached
        total = self.cache.get_seq_length()
        n = len(path)
        if not np.array_equal(path, np.arange(n)):
            src = torch.from_numpy(past + path).to(self.device)
            for layer in self.cache.layers:
                layer.keys[..., past : past + n, :] = layer.keys.index_select(-2, src)
                layer.values[..., past : past + n, :] = layer.values.index_select(-2, src)
        if total > past + n:
            self.cache.crop(past + n - total)  # transformers 5: a negative count removes tokens
        self.cached = past + n
