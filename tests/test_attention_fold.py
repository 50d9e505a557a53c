"""Folded grouped-query attention (decode/engine/attention.py) against transformers' sdpa on the CPU."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from samctl.decode.engine.attention import NAME, folded_sdpa_attention
from samctl.decode.engine.target import TargetModel
from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.methods import make_drafter
from samctl.decode.tree import DraftTree, ancestor_matrix
from tests.test_decode_greedy import prompts
from tests.test_engine import tiny


@pytest.mark.parametrize("heads,kv_heads,q,k", [(8, 2, 9, 40), (8, 1, 5, 33), (4, 4, 6, 20), (8, 2, 1, 17), (6, 3, 64, 300)])
@pytest.mark.parametrize("masked", [True, False])
def test_folded_attention_equals_sdpa(heads, kv_heads, q, k, masked):
    gen = torch.Generator().manual_seed(heads * 100 + q)
    query = torch.randn(1, heads, q, 16, generator=gen)
    key, value = (torch.randn(1, kv_heads, k, 16, generator=gen) for _ in range(2))
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    mask = None
    if masked:  # a committed prefix plus a random tree over the last q keys
        parents = np.array([np.random.default_rng(q).integers(-1, i) for i in range(q - 1)], np.int32)
        block = torch.from_numpy(np.where(ancestor_matrix(parents), 0.0, torch.finfo(torch.float32).min)).float()
        mask = torch.zeros(1, 1, q, k)
        mask[0, 0, :, k - q :] = block
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    got, _ = folded_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    assert got.shape == expected.shape == (1, q, heads, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_folded_target_verifies_and_generates_as_sdpa(kv_heads, monkeypatch):
    plain, folded_model = tiny("llama", kv_heads), tiny("llama", kv_heads)
    plain_target, folded = TargetModel(plain, fold_groups=False), TargetModel(folded_model, fold_groups=True)
    assert folded_model.config._attn_implementation == NAME and plain.config._attn_implementation == "sdpa"
    rng = np.random.default_rng(0)
    prompt = torch.from_numpy(rng.integers(0, 96, 30))
    for t in (plain_target, folded):
        t.prefill(prompt)
    real, heads_seen = torch.nn.functional.scaled_dot_product_attention, []

    def spy(q, *args, **kwargs):
        heads_seen.append(q.shape[1])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    for k in (3, 12, 40):
        parents = np.array([rng.integers(-1, i) for i in range(k)], np.int32)
        tree = DraftTree(tokens=rng.integers(0, 96, k), parents=parents)
        a = plain_target.verify(plain_target.verify_input(5, tree), tree)
        b = folded.verify(folded.verify_input(5, tree), tree)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        for t in (plain_target, folded):
            t.keep(np.zeros(1, np.int64))
    assert heads_seen.count(kv_heads) == 3 * 2  # every folded verify, both layers, ran on the KV heads
    monkeypatch.undo()
    for method in ("recycle", "lookahead"):
        outs = [generate(TargetModel(m, fold_groups=f), make_drafter(method, vocab_size=96, device="cpu"),
                         prompts(96)[0], GenerationConfig(max_new_tokens=40)).tokens
                for m, f in ((plain, False), (folded_model, True))]
        assert outs[0] == outs[1], method
