"""The EAGLE draft head (Li et al. 2024; EAGLE-1's architecture, which EAGLE-2 reuses).

The head predicts the target's next feature from the current one and the next token:

    f̂_{i+1} = Layer(fc([embed(x_{i+1}), f_i]))        q(x_{i+2}) = softmax(lm_head(f̂_{i+1}))

where f_i is the target's last hidden state at position i (post-final-norm, the lm_head input),
`fc` maps 2H -> H and `Layer` is one decoder layer of the target's own architecture (its class and
rotary embedding taken from the target, with the target's sizes). `embed` and `lm_head` are the
target's, frozen and never stored with the head: `bind` points the head at them. Pair i sits at
position i, so the head's rotary positions are the target's.

Knows tensors and the target's modules; never files, text or the decode loop (the drafter that
runs it is decode/drafters/eagle.py, the head file samctl/eagle_heads.py).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from decode.kv_cache import StaticKVCache
from index.errors import UserError


def head_config(target_config):
    """The target's config reduced to one layer under sdpa: the head's layer is built from it."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    if hasattr(config, "layer_types") and config.layer_types:
        config.layer_types = list(config.layer_types[:1])
    config._attn_implementation = "sdpa"
    return config


class EagleHead(nn.Module):
    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        decoder = target.get_decoder()
        layers, rotary = getattr(decoder, "layers", None), getattr(decoder, "rotary_emb", None)
        if layers is None or rotary is None:
            raise UserError(f"{target.config.model_type}: an EAGLE head needs a decoder with `layers` and "
                            "`rotary_emb` (Llama, Qwen2, Mistral families): use another method")
        config = head_config(target.config)
        self.hidden_size = int(config.hidden_size)
        self.fc = nn.Linear(2 * self.hidden_size, self.hidden_size, bias=True)
        self.layer = type(layers[0])(config, layer_idx=0)
        self.rotary = type(rotary)(config=config)
        self.bind(target)

    def bind(self, target: nn.Module) -> None:
        # The target's embedding and lm_head, kept in a tuple so that nn.Module does not register
        # them: they are never saved, moved or trained with the head.
        self._target_parts = (target.get_input_embeddings(), target.get_output_embeddings())

    @property
    def target_embed(self) -> nn.Module:
        return self._target_parts[0]

    @property
    def target_lm_head(self) -> nn.Module:
        return self._target_parts[1]

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                cache: StaticKVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        # features: [B, n, H] target (or predicted) features f_i; tokens: [B, n] int64 x_{i+1};
        # positions: [B, n] int64; mask: [B, 1, n, past + n] additive or None (causal, no cache)
        # -> predicted next features [B, n, H]
        x = self.fc(torch.cat((self.target_embed(tokens).to(features.dtype), features), dim=-1))
        position_embeddings = self.rotary(x, position_ids=positions)
        return self.layer(x, attention_mask=mask, position_ids=positions, past_key_values=cache,
                          use_cache=cache is not None, position_embeddings=position_embeddings)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        # features: [..., H] -> [..., V] through the target's lm_head
        return self.target_lm_head(features)
