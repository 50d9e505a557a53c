"""The native forward (decode/engine/native.py) against transformers' own, and its exactness rules."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from samctl.config import SessionConfig
from samctl.decode.drafters.base import NoDraft
from samctl.decode.engine.batched import BatchedTarget
from samctl.decode.engine.cpu_linear import apply_cpu_linear
from samctl.decode.engine.native import backend_name, native_of, native_refusal, use_backend
from samctl.decode.engine.target import TargetModel
from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.tree import DraftTree
from samctl.index.errors import ConfigError, UserError
from tests.test_cpu_linear import one_token_steps

CONFIGS = {
    "llama": LlamaConfig, "qwen2": Qwen2Config,
    "qwen3": lambda **kw: Qwen3Config(head_dim=16, **kw),  # per-head q/k norms
}


def tiny(family: str, seed: int = 0, **extra) -> torch.nn.Module:
    config = CONFIGS[family](vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked logits: greedy paths are stable
    return model


def tree_step(target: TargetModel, rng: np.random.Generator) -> torch.Tensor:
    # a 7-node tree after the committed tokens -> its logits [8, V]
    tree = DraftTree(tokens=rng.integers(0, 120, 7), parents=np.array([-1, 0, 0, 1, -1, 4, 3], dtype=np.int32))
    return target.verify(target.verify_input(int(rng.integers(0, 120)), tree), tree)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_native_logits_match_transformers(family):
    model = tiny(family)
    rng = np.random.default_rng(1)
    prompt = torch.from_numpy(rng.integers(0, 120, 30))
    got = {}
    for backend in ("hf", "native"):
        assert use_backend(model, backend) == backend
        target = TargetModel(model)
        prefill = target.prefill(prompt, all_logits=True)
        verify = tree_step(target, np.random.default_rng(2))
        target.keep(np.array([0, 1, 3]))
        step = tree_step(target, np.random.default_rng(3))
        got[backend] = torch.cat([prefill, verify, step])
    scale = got["hf"].abs().max()
    assert (got["native"] - got["hf"]).abs().max() <= 1e-4 * scale
    assert torch.equal(got["native"].argmax(-1), got["hf"].argmax(-1))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_native_greedy_matches_transformers_greedy(family):
    model = tiny(family, seed=4)
    prompt = np.random.default_rng(5).integers(0, 120, 12)
    tokens = {}
    for backend in ("hf", "native"):
        use_backend(model, backend)
        tokens[backend] = generate(TargetModel(model), NoDraft(), prompt, GenerationConfig(max_new_tokens=40)).tokens
    assert tokens["native"] == tokens["hf"]


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_native_int8_verify_rows_equal_one_token_steps_bit_for_bit(batched, family):
    # int8 linears and row-by-row attention (decode/engine/int8_forward.py): a verified row is what
    # a one-token step computes, whatever the block's width (1..40) and the other rows; and the
    # compiled layers compute the op-by-op forward's model (hf's int8 logits, up to float order)
    model = apply_cpu_linear(tiny(family, seed=6), "int8")
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 120, 20)
    chain = rng.integers(0, 120, 40)
    if not batched:
        assert use_backend(model, "hf") == "hf"
        ops = TargetModel(model)
        ops.prefill(torch.from_numpy(prompt))
        ops = ops.verify(torch.from_numpy(chain), DraftTree.chain(chain[1:]))
    assert use_backend(model, "native") == "native" and native_of(model).int8 is not None
    want = one_token_steps(TargetModel(model), prompt, chain)
    for width in (1, 16, 17, 40):
        if batched:
            target = BatchedTarget(model, 2, 128)
            target.prefill([0, 1], [prompt, rng.integers(0, 120, 9)], [False, False])
            logits, offsets = target.verify([torch.from_numpy(chain[:width]), torch.from_numpy(chain[:3])],
                                            [DraftTree.chain(chain[1:width]), DraftTree.chain(chain[1:3])])
            got = logits[offsets[0] : offsets[1]]
        else:
            target = TargetModel(model)
            target.prefill(torch.from_numpy(prompt))
            got = target.verify(torch.from_numpy(chain[:width]), DraftTree.chain(chain[1:width]))
        assert torch.equal(got, want[:width]), width
    if not batched:  # float ops in another order (silu's exp, a norm's sum) can move an activation
        # across an int8 rounding boundary: a row then differs by a quantization step, rarely
        off = (want - ops).abs().amax(-1) > 1e-4
        assert off.sum() <= len(chain) // 10 and torch.equal(want.argmax(-1), ops.argmax(-1))


def test_native_int8_on_split_kernels_verifies_rows_equal_to_one_token_steps(monkeypatch):
    # CPUs without VNNI run int8 rows as two 7-bit halves (cpu_linear.split_sums): the compiled
    # layers then take float32 codes; a verify still equals one-token steps bit for bit
    from samctl.decode.engine import cpu_linear

    if cpu_linear.OneDnnGemm.pack(torch.zeros(2, 2, dtype=torch.int8)) is None:
        pytest.skip("no oneDNN int8 kernels in this build")
    monkeypatch.setattr(cpu_linear, "int8_kernels", lambda: cpu_linear.Int8Kernels(False, True, True))
    model = apply_cpu_linear(tiny("qwen2", seed=2), "int8")
    assert use_backend(model, "native") == "native" and native_of(model).int8 is not None
    rng = np.random.default_rng(4)
    prompt, chain = rng.integers(0, 120, 16), rng.integers(0, 120, 9)
    want = one_token_steps(TargetModel(model), prompt, chain)
    target = TargetModel(model)
    target.prefill(torch.from_numpy(prompt))
    assert torch.equal(target.verify(torch.from_numpy(chain), DraftTree.chain(chain[1:])), want)


@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 32), (10, 2, 20), (3, 1, 7)])
def test_exact_attention_rows_are_one_token_steps_whatever_the_other_rows(heads, kv_heads, dim):
    # a tree's rows over a shared prefix, in two batch rows of different lengths, grouped heads
    # (more than the four a pass of the kernel takes; head sizes off its vectors, odd): each row
    # equals the same query attending its prefix and ancestors alone, as a one-token step does,
    # bit for bit; and sdpa within float tolerance
    from samctl.decode.engine.attention import exact_attention

    gen = torch.Generator().manual_seed(3)
    batch, capacity = 2, 96
    keys, values = torch.randn(2, batch, kv_heads, capacity, dim, generator=gen)
    parents = [-1, 0, 0, 1, 2, 4, -1]
    lengths = [50, 37]  # committed keys per batch row; the tree's keys follow them
    kv = max(lengths) + len(parents)
    mask = torch.zeros(batch, 1, len(parents), kv, dtype=torch.bool)
    paths = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        paths.append(path)
    for b, n in enumerate(lengths):
        keys[b, :, n : n + len(parents)], values[b, :, n : n + len(parents)] = keys[b, :, -len(parents):], \
            values[b, :, -len(parents):]
        mask[b, 0, :, :n] = True
        for i, path in enumerate(paths):
            mask[b, 0, i, [n + j for j in path]] = True
    query = torch.randn(batch, heads, len(parents), dim, generator=gen)
    got = exact_attention(query, keys.numpy(), values.numpy(), mask, kv)
    reference = torch.nn.functional.scaled_dot_product_attention(query, keys[:, :, :kv], values[:, :, :kv],
                                                                  attn_mask=mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)
    for b, n in enumerate(lengths):
        for i, path in enumerate(paths):
            seen = list(range(n)) + [n + j for j in path]
            alone_k, alone_v = torch.zeros(2, 1, kv_heads, capacity, dim)
            alone_k[0, :, : len(seen)], alone_v[0, :, : len(seen)] = keys[b][:, seen], values[b][:, seen]
            step = exact_attention(query[b : b + 1, :, i : i + 1].clone(), alone_k.numpy(), alone_v.numpy(), None,
                                   len(seen))
            assert torch.equal(step[0, 0], got[b, i]), (b, i)


def test_the_attention_kernels_exp_is_libms_within_one_unit():
    # exp_nonpositive (softmax's exp in attend_rows, vectorizable): within 1.5e-7 of exp in float64
    # over every exponent a softmax meets, exact at 0, and monotone
    from numba import njit

    from samctl.decode.engine.attention import exp_nonpositive

    @njit
    def each(x, out):
        for t in range(len(x)):
            out[t] = exp_nonpositive(x[t])

    spread = -np.sort(np.random.default_rng(0).random(20000)) * 87
    x = np.concatenate(([0.0, -1e-30, -0.5 * np.log(2.0), -87.0], spread))
    x = x.astype(np.float32)
    got = np.empty_like(x)
    each(x, got)
    want = np.exp(x.astype(np.float64))
    assert got[0] == 1.0 and got[1] == 1.0
    assert np.max(np.abs(got - want) / want) < 1.5e-7
    assert np.all(np.diff(got[4:]) <= 0)


def test_native_hidden_states_are_the_final_norms_output():
    model = tiny("llama", seed=8)
    prompt = torch.from_numpy(np.random.default_rng(9).integers(0, 120, 10))
    hidden = {}
    for backend in ("hf", "native"):
        use_backend(model, backend)
        target = TargetModel(model)
        target.capture_hidden(True)
        target.prefill(prompt)  # logits of the last position only; hidden states of every one
        hidden[backend] = target.hidden
    assert hidden["native"].shape == (10, 64)
    torch.testing.assert_close(hidden["native"], hidden["hf"], atol=1e-5, rtol=1e-5)


def test_unsupported_models_fall_back_or_are_refused_in_one_line():
    dynamic = tiny("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert "dynamic" in native_refusal(dynamic)
    assert use_backend(dynamic, "auto") == "hf" and native_of(dynamic) is None
    with pytest.raises(UserError, match="native backend cannot run this model.*use the hf backend") as err:
        use_backend(dynamic, "native")
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="choose one of auto, hf, native"):
        use_backend(dynamic, "fast")
    with pytest.raises(ConfigError):
        SessionConfig(backend="fast")


def test_backend_names_what_runs_and_auto_picks_native():
    model = tiny("qwen2")
    assert use_backend(model) == "native" and backend_name(model) == "native/plain"
    assert use_backend(model, "hf") == "hf" and backend_name(model) == "hf/plain"
    packed = apply_cpu_linear(copy.deepcopy(model), "none")
    use_backend(packed)
    assert backend_name(packed) == "native/packed"


def test_plain_weights_are_held_once_and_shared_with_transformers_modules():
    # the stacked q/k/v (and gate/up) weight is the projections' storage: no second copy, and a
    # weight changed in place reaches both backends
    model = tiny("llama", seed=10)
    use_backend(model, "native")
    attention = model.model.layers[0].self_attn
    stacked = native_of(model).layers[0].qkv.weight
    assert attention.k_proj.weight.data_ptr() == stacked[attention.q_proj.out_features :].data_ptr()
    prompt = torch.from_numpy(np.random.default_rng(11).integers(0, 120, 8))
    with torch.no_grad():
        attention.v_proj.weight.mul_(3.0)
    logits = {}
    for backend in ("hf", "native"):
        use_backend(model, backend)
        logits[backend] = TargetModel(model).prefill(prompt, all_logits=True)
    torch.testing.assert_close(logits["native"], logits["hf"], atol=1e-4, rtol=1e-4)
