"""A deterministic causal LM that continues text by copying, for engine tests without weights.

After context ... a b it predicts the token that followed the most recent earlier "a b", else
(7 b + 3) mod V. It reads its context only through the KV cache and the 4D mask the engine
passes, and asserts that the visible positions are exactly 0..n-1, so a wrong mask, wrong
position ids or a wrong KV rollback changes its output or fails loudly.

For EAGLE heads it also has the parts a head binds to: a tiny Llama decoder (embedding, one layer,
rotary, final norm) and lm_head, never used for its logits. Its "last hidden state" is the final
norm of the predicted token's embedding, so a hook on that norm sees one row per input.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def copy_rule(context: list[int], vocab: int) -> int:
    for j in range(len(context) - 3, -1, -1):
        if context[j] == context[-2] and context[j + 1] == context[-1]:
            return context[j + 2]
    return (7 * context[-1] + 3) % vocab


class CopyLM(torch.nn.Module):
    def __init__(self, vocab: int = 32, peak: float = 20.0) -> None:
        super().__init__()
        self.vocab = vocab
        self.peak = peak  # logit of the predicted token (others 0): large = near-deterministic
        self.config = LlamaConfig(
            vocab_size=vocab, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1, intermediate_size=8, max_position_embeddings=4096,
            # An SDSAT section, so `sdsat` runs on it too: the copy rule reads the SAT id like any token.
            sdsat={"sat_token_id": vocab - 1, "sat_count": 3},
        )
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the module a device and dtype
        with torch.random.fork_rng():  # building the parts must not move the caller's random state
            torch.manual_seed(0)
            self.parts = LlamaForCausalLM(self.config)

    def get_decoder(self) -> torch.nn.Module:
        return self.parts.model

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.parts.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.parts.lm_head

    def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None, use_cache=True, **_):
        # input_ids: [rows, q]; one cache row per input row (batch 1's DynamicCache, or the batched
        # engine's cache, whose mask row b shows row b its own committed entries and tree block)
        rows, q = input_ids.shape
        if position_ids is None:
            past = past_key_values.get_seq_length()
            position_ids = torch.arange(past, past + q)[None]
        keys, values = past_key_values.update(input_ids.float()[:, None, :, None],
                                              position_ids.expand(rows, q).float()[:, None, :, None], 0)
        logits = torch.zeros(rows, q, self.vocab)
        for b in range(rows):
            tokens = keys[b, 0, :, 0].long().numpy()
            positions = values[b, 0, :, 0].long().numpy()
            kv = len(tokens)
            if attention_mask is None:  # causal after the cached entries
                visible = np.arange(kv)[None, :] <= kv - q + np.arange(q)[:, None]
            else:
                visible = (attention_mask[min(b, attention_mask.shape[0] - 1), 0] == 0).numpy()  # [q, kv]
            # each input must see exactly the positions 0..k-1 (k = what it sees), each once
            at_row, cols = np.nonzero(visible)
            seen, at = visible.sum(1), positions[cols]
            ok = (at < seen[at_row]).all() and len(np.unique(at_row * len(positions) + at)) == len(at_row)
            assert ok, [positions[v].tolist() for v in visible]
            text = np.empty(visible.shape, dtype=np.int64)
            text[at_row, at] = tokens[cols]  # each input's visible tokens in position order
            for i in range(q):
                logits[b, i, copy_rule(text[i, : seen[i]].tolist(), self.vocab)] = self.peak
        decoder = self.parts.model
        decoder.norm(decoder.embed_tokens(logits.argmax(-1)))  # the "last hidden state": [rows, q, 8]
        return SimpleNamespace(logits=logits)

    def reference(self, prompt: list[int], n: int) -> list[int]:
        """Greedy continuation computed on the full text, no cache."""
        text = list(prompt)
        for _ in range(n):
            text.append(copy_rule(text, self.vocab))
        return text[len(prompt) :]
