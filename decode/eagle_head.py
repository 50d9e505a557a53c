"""The EAGLE draft head (Li et al. 2024; EAGLE-1's architecture, which EAGLE-2 reuses).

The head predicts the target's next feature from the current one and the next token:

    f̂_{i+1} = Layer(fc([embed(x_{i+1}), f_i]))        q(x_{i+2}) = softmax(lm_head(f̂_{i+1}))

where f_i is the target's last hidden state at position i (post-final-norm, the lm_head input),
`fc` maps 2H -> H and `Layer` is one decoder layer of the target's own architecture (its class and
rotary embedding taken from the target, with the target's sizes). `embed` and `lm_head` are the
target's, frozen and never stored with the head: `bind` points the head at them. Pair i sits at
position i, so the head's rotary positions are the target's.

Optional draft vocabulary (`vocab`, FR-Spec style): the ids of the N tokens the head may draft,
stored with the head. q is then a softmax over those N rows of lm_head only, making the output
layer V / N times cheaper; the target still verifies with its full vocabulary, so this costs
acceptance, never correctness.

Knows tensors and the target's modules; never files, text or the decode loop (the drafter that
runs it is decode/drafters/eagle.py, the head file samctl/heads.py).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from samctl.decode.engine.kv_cache import StaticKVCache, with_cache
from samctl.index.errors import UserError


def head_config(target_config):
    """The target's config reduced to one layer under sdpa: the head's layer is built from it."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    if hasattr(config, "layer_types") and config.layer_types:
        config.layer_types = list(config.layer_types[:1])
    config._attn_implementation = "sdpa"
    return config


class EagleHead(nn.Module):
    def __init__(self, target: nn.Module, vocab: torch.Tensor | None = None) -> None:
        # vocab: [N] int64 draft token ids, or None for the target's whole vocabulary
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
        if vocab is not None:
            vocab = torch.as_tensor(vocab, dtype=torch.int64)
            if vocab.ndim != 1 or len(vocab) == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= int(config.vocab_size):
                raise UserError(f"EAGLE head draft vocabulary must hold ids in [0, {config.vocab_size}): retrain the head")
            self.register_buffer("vocab", vocab)
        else:
            self.vocab = None
        self._rows: tuple | None = None  # (weight [N, H], bias) of lm_head at the vocab, cached per device/dtype
        self.bind(target)

    def bind(self, target: nn.Module) -> None:
        # The target's embedding and lm_head, kept in a tuple so that nn.Module does not register
        # them: they are never saved, moved or trained with the head.
        self._target_parts = (target.get_input_embeddings(), target.get_output_embeddings())
        self._rows = None

    target_embed = property(lambda self: self._target_parts[0])
    target_lm_head = property(lambda self: self._target_parts[1])

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                cache: StaticKVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        # features: [B, n, H] target (or predicted) features f_i; tokens: [B, n] int64 x_{i+1};
        # positions: [B, n] int64; mask: [B, 1, n, past + n] additive or None (causal, no cache)
        # -> predicted next features [B, n, H]
        x = self.fc(torch.cat((self.target_embed(tokens).to(features.dtype), features), dim=-1))
        position_embeddings = self.rotary(x, position_ids=positions)
        return self.layer(x, attention_mask=mask, position_ids=positions, **with_cache(self.layer, cache),
                          use_cache=cache is not None, position_embeddings=position_embeddings)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        # features: [..., H] -> [..., N] through the target's lm_head rows of the draft vocabulary
        # (N = V without one); token_ids maps indices of the last axis back to token ids
        lm_head = self.target_lm_head
        if self.vocab is None:
            return lm_head(features)
        weight = lm_head.weight
        if self._rows is None or self._rows[0].device != weight.device or self._rows[0].dtype != weight.dtype:
            bias = getattr(lm_head, "bias", None)
            vocab = self.vocab.to(weight.device)
            self._rows = (weight.detach()[vocab].contiguous(), None if bias is None else bias.detach()[vocab])
        return nn.functional.linear(features, *self._rows)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        # index: [...] int64 into the last axis of `logits` -> token ids [...]
        return index if self.vocab is None else self.vocab[index]


# -- training (EAGLE-1's objective; the tool is `samctl train eagle`) ------------------------------


@torch.inference_mode()
def target_features(model: nn.Module, ids: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    # ids: [n] int64 -> (features [n, H] float32: the target's post-norm last hidden states,
    # choices [n] int64: argmax of its logits, the target's greedy next token at each position).
    # One forward; the logits are formed `chunk` rows at a time (a [n, V] block is large).
    hidden = model.get_decoder()(input_ids=ids[None]).last_hidden_state[0].float()
    lm_head = model.get_output_embeddings()
    choices = torch.cat([lm_head(hidden[i : i + chunk].to(lm_head.weight.dtype)).argmax(-1)
                         for i in range(0, len(hidden), chunk)])
    return hidden, choices


def eagle_loss(head: EagleHead, features: torch.Tensor, tokens: torch.Tensor, choices: torch.Tensor,
               weights: torch.Tensor, noise: float = 0.2, ce_weight: float = 0.1) -> tuple[torch.Tensor, dict]:
    # features: [B, n, H] target features f_0..f_{n-1}; tokens: [B, n] x_0..x_{n-1};
    # choices: [B, n] the target's argmax at each position; weights: [B, n] 1 where the prediction of
    # pair j (position j + 1's feature) counts, 0 elsewhere (padding, prompt).
    # Pair j = (f_j + noise, x_{j+1}) -> f̂_{j+1}; loss = SmoothL1(f̂, f_{j+1}) + ce_weight * CE(lm_head(f̂),
    # choice_{j+1}), the CE against the target's own next token (EAGLE uses its soft distribution).
    inputs = features[:, :-1]
    if noise > 0:
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * noise
    positions = torch.arange(inputs.shape[1], device=inputs.device)[None].expand(inputs.shape[0], -1)
    predicted = head(inputs, tokens[:, 1:], positions)  # [B, n-1, H]
    w = weights[:, 1:]
    total = w.sum().clamp_min(1.0)
    regression = (nn.functional.smooth_l1_loss(predicted, features[:, 1:], reduction="none").mean(-1) * w).sum() / total
    logits = head.logits(predicted)
    labels = choices[:, 1:]
    if head.vocab is not None:  # CE over the draft vocabulary; a choice outside it has no CE term
        slot = torch.full((int(head.target_lm_head.weight.shape[0]),), -100, dtype=torch.int64, device=labels.device)
        slot[head.vocab] = torch.arange(len(head.vocab), device=labels.device)
        labels = slot[labels]
    ce = (nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100)
          * w.flatten()).sum() / total
    hits = ((head.token_ids(logits.argmax(-1)) == choices[:, 1:]).float() * w).sum()
    return regression + ce_weight * ce, {"regression": float(regression.detach()), "ce": float(ce.detach()),
                                         "top1_hits": float(hits), "count": float(w.sum())}
