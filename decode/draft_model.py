"""A draft model with its own KV cache, for drafters that run a small LM next to the target.

Contract: the cache always holds K/V for a token sequence the caller knows; `forward` appends the
given tokens and returns the next-token logits at the last one (and, on request, the post-norm last
hidden state there); `keep(n)` drops everything after the first n cached tokens. The caller decides
which tokens to feed; feeding only uncached tokens is what keeps drafting cheap.

The draft's vocabulary may differ from the target's: logits are sliced to the first
`vocab_limit` ids (the target's size), so the draft never proposes an id the target lacks.
Knows nothing of acceptance rules, the target, text or files.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from samctl.decode.engine.kv_cache import with_cache


class DraftModel:
    """Holds one draft LM and its cache for one sequence at a time (batch size 1)."""

    def __init__(self, model: torch.nn.Module, vocab_limit: int | None = None) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30) or (1 << 30))
        out_vocab = int(model.config.vocab_size)
        self.vocab = out_vocab if vocab_limit is None else min(out_vocab, int(vocab_limit))
        self.hidden_size = int(model.config.hidden_size)
        self.cache = DynamicCache(config=model.config)
        self.cached = 0  # tokens whose K/V are in the cache
        self.fed = 0  # tokens fed since construction (counts work; tests check nothing is fed twice)
        self.dropped = 0  # cache entries removed by `keep`

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.cached = 0

    def fork(self) -> "DraftModel":
        """Another holder of the same model with a cache of its own: one per sequence in flight
        (the batched engine's rows), the weights loaded once."""
        return DraftModel(self.model, self.vocab)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        # input_ids: [n] int64 on the draft's device, the tokens after the cached ones
        # -> (logits [vocab] float at the last input, hidden [H] post-norm state there or None)
        n = int(input_ids.shape[0])
        position_ids = torch.arange(self.cached, self.cached + n, device=self.device)[None]
        out = self.model(
            input_ids=input_ids[None],
            position_ids=position_ids,
            **with_cache(self.model, self.cache),
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states=hidden,
        )
        self.cached += n
        self.fed += n
        state = out.hidden_states[-1][0, -1] if hidden else None
        return out.logits[0, -1, : self.vocab], state

    @torch.inference_mode()
    def keep(self, n: int) -> None:
        """Keep the first n cached tokens."""
        assert 0 <= n <= self.cached, (n, self.cached)
        if n < self.cached:
            self.cache.crop(n - self.cached)  # transformers 5: a negative count removes tokens
            self.dropped += self.cached - n
            self.cached = n
