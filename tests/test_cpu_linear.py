"""CPU linear backends: int8 rows are independent bit for bit, and decoding with either backend
stays lossless against plain greedy decoding of the same model (decode/engine/cpu_linear.py)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from samctl.decode.engine.cpu_linear import Int8Linear, PackedLinear, apply_cpu_linear, linear_backend
from samctl.decode.methods import EAGLE_METHODS, METHODS, uses_store
from samctl.index.automaton import SuffixAutomaton
from samctl.index.errors import UserError
from tests.test_decode_greedy import hf_greedy, prompts, run


def int8_layer(in_features: int, out_features: int, seed: int = 0, bias: bool = False) -> Int8Linear:
    torch.manual_seed(seed)
    return Int8Linear(nn.Linear(in_features, out_features, bias=bias))


@pytest.mark.parametrize("shape", [(32, 64), (48, 96), (64, 7)])
def test_int8_row_alone_equals_row_among_64(shape):
    layer = int8_layer(*shape)
    x = torch.randn(64, shape[0]) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different scales
    full = layer(x)
    for width in range(1, 65):  # verify widths 1..64: the first `width` rows alone
        assert torch.equal(layer(x[:width]), full[:width]), width
    for row in (0, 17, 63):
        assert torch.equal(layer(x[row : row + 1])[0], full[row]), row


def test_int8_one_row_kernel_equals_many_row_kernel():
    # one row runs torch._int_mm, several oneDNN's GEMM (or _int_mm where oneDNN is missing): the
    # same exact integer sums, converted to float32 once, so rows agree bit for bit, even where a
    # sum is past float32's 2**24 (3072 products of 127 x 127: every step of the sum exact)
    layer = int8_layer(3072, 40, seed=5)
    with torch.no_grad():
        layer.qweight.fill_(127)
        layer.qweight[:, ::7] = 126
        if layer.gemm is not None:
            layer.gemm = type(layer.gemm).pack(layer.qweight)
    x = torch.randn(6, 3072)
    x[0] = 1.0  # every quantized value at the top level: sums past 2**24
    full = layer(x)
    assert int((127 * layer.qweight.long()).sum(1).min()) > 2**24  # row 0's integer sums
    for row in range(6):
        assert torch.equal(layer(x[row : row + 1])[0], full[row]), row
    if layer.kernels.gemv:  # the _int_mm fallback for several rows gives the same numbers
        layer.gemm = None
        assert torch.equal(layer(x), full)


def exact_int8(layer, x: torch.Tensor) -> torch.Tensor:
    # the layer's formula with its integer sums taken in float64 (exact at these sizes), then the
    # layer's own float32 steps: (sum * sx) * sw
    sx = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    sums = (torch.round(x / sx).double() @ layer.qweight.double().t()).float()
    return torch.mul(sums, sx).mul_(layer.scale)


@pytest.mark.parametrize("kernels", [(True, True, False), (False, True, False), (True, False, False),
                                     (False, True, True)], ids=["vnni", "onednn-only", "int_mm-only", "split"])
def test_int8_modes_are_exact_and_row_independent(monkeypatch, kernels):
    # every mode the probe can choose, forced: rows alone equal rows together and the formula
    from samctl.decode.engine import cpu_linear

    chosen = cpu_linear.Int8Kernels(*kernels)
    if not chosen.split and cpu_linear.int8_kernels().split:
        pytest.skip("this CPU does not sum 8-bit int8 products exactly (the probe split them)")
    if chosen.onednn and cpu_linear.OneDnnGemm.pack(torch.zeros(2, 2, dtype=torch.int8)) is None:
        pytest.skip("no oneDNN int8 kernels in this build")
    monkeypatch.setattr(cpu_linear, "int8_kernels", lambda: chosen)
    layer = int8_layer(512, 48, seed=7)
    x = torch.randn(9, 512) * torch.logspace(-3, 2, 9)[:, None]
    x[0] = 3.0  # every activation at the top level
    x[1, ::2] = -3.0
    full = layer(x)
    assert torch.equal(full, exact_int8(layer, x))
    for row in range(9):
        assert torch.equal(layer(x[row : row + 1])[0], full[row]), row


def test_int8_probe_refuses_a_cpu_without_exact_int8(monkeypatch):
    # a CPU whose int8 products saturate (x86 without VNNI, where oneDNN's 7-bit path also fails)
    from samctl.decode.engine import cpu_linear

    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: real(a, b).clamp(-32768, 32767))
    monkeypatch.setattr(cpu_linear.OneDnnGemm, "pack", classmethod(lambda cls, w: None))
    cpu_linear.int8_kernels.cache_clear()
    try:
        with pytest.raises(UserError, match="do not sum int8 products exactly"):
            cpu_linear.int8_kernels()
    finally:
        cpu_linear.int8_kernels.cache_clear()


def test_int8_without_vnni_splits_rows_and_stays_exact():
    # oneDNN held to AVX2 (no VNNI) multiplies with vpmaddubsw, which saturates 8-bit products:
    # the probe must see it and split rows into 7-bit halves, still exact and row independent
    code = (
        "import torch\n"
        "from torch import nn\n"
        "from samctl.decode.engine.cpu_linear import Int8Linear, int8_kernels\n"
        "from tests.test_cpu_linear import exact_int8\n"
        "torch.manual_seed(0)\n"
        "layer = Int8Linear(nn.Linear(512, 40, bias=False))\n"
        "x = torch.randn(6, 512) * 10\n"
        "x[0] = 1.0\n"
        "full = layer(x)\n"
        "assert torch.equal(full, exact_int8(layer, x))\n"
        "assert all(torch.equal(layer(x[i : i + 1])[0], full[i]) for i in range(6))\n"
        "print(int8_kernels().split)\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    if platform.machine() in ("x86_64", "AMD64") and torch.backends.mkldnn.is_available():
        assert done.stdout.split()[-1] == "True"  # 8-bit sums saturate under AVX2: rows split


def test_int8_batch_rows_are_independent():
    layer = int8_layer(32, 64, bias=True)
    x = torch.randn(8, 9, 32)  # [B, q, H]: batch rows 1..8, each a verify of 9 tokens
    full = layer(x)
    for b in range(1, 9):
        assert torch.equal(layer(x[:b]), full[:b]), b
        assert torch.equal(layer(x[b - 1]), full[b - 1]), b


def test_int8_is_the_integer_formula():
    # y[r, n] = (sum_k xq[r, k] wq[n, k]) sx[r] sw[n], with the integer sum taken naively
    layer = int8_layer(40, 24, seed=3)
    x = torch.randn(5, 40)
    sx = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True) / 127.0
    xq = torch.round(x / sx).long()
    wq = layer.qweight.long()
    expected = (xq @ wq.t()).float() * sx * layer.scale
    assert torch.equal(layer(x), expected)
    # and close to the float layer it quantizes (a few quantization steps at most)
    assert torch.allclose(layer(x), x @ layer.weight.t(), atol=0.05 * float(x.abs().max()))


def test_packed_matches_linear_closely():
    torch.manual_seed(0)
    linear = nn.Linear(48, 96)
    packed = PackedLinear(linear)
    x = torch.randn(64, 48)
    with torch.no_grad():
        assert torch.allclose(packed(x), linear(x), atol=1e-5)
        full = packed(x)
        # oneDNN is not bitwise row independent, as plain F.linear is not either: only last bits move
        assert max((packed(x[:w]) - full[:w]).abs().max().item() for w in range(1, 65)) < 1e-5
    assert torch.equal(packed.weight, linear.weight.detach())
    y = packed(torch.randn(3, 48, requires_grad=True))  # readers that train through it (EAGLE) get a graph
    assert y.requires_grad


def test_apply_swaps_every_linear_and_names_the_backend(tiny_llama):
    import copy

    plain = copy.deepcopy(tiny_llama)
    assert linear_backend(plain) == "plain"
    for quantize, kind, name in (("int8", Int8Linear, "int8"), ("none", PackedLinear, "packed")):
        model = apply_cpu_linear(copy.deepcopy(tiny_llama), quantize)
        assert linear_backend(model) == name
        assert not any(type(m) is nn.Linear for m in model.modules())
        assert isinstance(model.lm_head, kind)
    unpacked = apply_cpu_linear(copy.deepcopy(tiny_llama), "none", prepack=False)
    assert linear_backend(unpacked) == "plain"
    with pytest.raises(UserError, match="--quantize"):
        apply_cpu_linear(plain, "int4")


def test_int8_fused_projections_equal_separate_layers_bit_for_bit(tiny_llama, monkeypatch):
    # q/k/v and gate/up run as one stacked int8 layer: the logits equal those of the model whose
    # projections run separately, bit for bit, and no input or output is held between forwards.
    import copy

    from samctl.decode.engine import cpu_linear

    fused = apply_cpu_linear(copy.deepcopy(tiny_llama), "int8")
    monkeypatch.setattr(cpu_linear, "FUSED_GROUPS", ())
    separate = apply_cpu_linear(copy.deepcopy(tiny_llama), "int8")
    assert not any(isinstance(m, cpu_linear.FusedLinear) for m in separate.modules())
    groups = [m for m in fused.modules() if isinstance(m, cpu_linear.FusedLinear)]
    assert len(groups) == 2 * tiny_llama.config.num_hidden_layers
    ids = torch.tensor(np.random.default_rng(0).integers(3, 96, (3, 21)))
    with torch.inference_mode():
        assert torch.equal(fused(ids).logits, separate(ids).logits)
    assert all(g._output is None and g._key is None for g in groups)
    # each part is its rows of the stacked weight, and reads as its own layer does
    attention = fused.model.layers[0].self_attn
    assert torch.equal(attention.k_proj.weight, separate.model.layers[0].self_attn.k_proj.weight)
    x = torch.randn(4, tiny_llama.config.hidden_size)
    q = attention.q_proj(x)
    x.mul_(2)  # changed in place: the next part computes again
    assert torch.equal(attention.k_proj(x), separate.model.layers[0].self_attn.k_proj(x))
    assert not torch.equal(q, attention.q_proj(x))


def _load(folder, quantize: str, prepack: bool = True):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return apply_cpu_linear(model, quantize, prepack)


@pytest.mark.parametrize("method", METHODS + EAGLE_METHODS)
def test_int8_greedy_equals_its_own_plain_greedy(tiny_model_dir, method):
    model = _load(tiny_model_dir, "int8")
    for prompt in prompts(model.config.vocab_size)[:2]:
        expected = hf_greedy(model, prompt, 48, eos=None)
        # store methods draft from the continuation's first half, so their drafts are long and accepted
        store = SuffixAutomaton.build(np.asarray(expected[:24], dtype=np.int32), np.array([0, 24])) \
            if uses_store(method) else None
        assert run(model, method, prompt, 48, static=store).tokens == expected, (method, prompt)


@pytest.mark.parametrize("method", ["ar", "pld", "adaptive", "recycle", "eagle"])
def test_packed_greedy_equals_plain_greedy(tiny_model_dir, method):
    plain, packed = _load(tiny_model_dir, "none", prepack=False), _load(tiny_model_dir, "none")
    for prompt in prompts(plain.config.vocab_size):
        expected = hf_greedy(plain, prompt, 48, eos=None)
        assert hf_greedy(packed, prompt, 48, eos=None) == expected
        assert run(packed, method, prompt, 48).tokens == expected, (method, prompt)


def test_int8_verify_equals_single_steps_bit_for_bit(tiny_llama):
    # The whole int8 forward is exact per row (int8 linears + one-row attention): verifying n
    # tokens gives the logits of n one-token steps, bit for bit, for chains of 1..64 and a tree.
    import copy

    from samctl.decode.engine.target import TargetModel
    from samctl.decode.tree import DraftTree

    target = TargetModel(apply_cpu_linear(copy.deepcopy(tiny_llama), "int8"))
    rng = np.random.default_rng(0)
    prompt = torch.tensor(rng.integers(3, 96, 20))
    ids = torch.tensor(rng.integers(3, 96, 64))

    def steps(tokens: torch.Tensor) -> torch.Tensor:
        target.prefill(prompt)
        out = []
        for tok in tokens:
            out.append(target.verify(tok[None], DraftTree.chain(np.zeros(0, dtype=np.int64))))
            target.keep(np.zeros(1, dtype=np.int64))
        return torch.cat(out)

    expected = steps(ids)
    for n in (1, 2, 7, 8, 33, 64):
        target.prefill(prompt)
        assert torch.equal(target.verify(ids[:n], DraftTree.chain(ids[1:n].numpy())), expected[:n]), n
    # a tree: the root t0 with children a and b, b with child c; the path t0 -> b -> c equals its steps
    tree = DraftTree(tokens=np.array([5, 6, 7]), parents=np.array([-1, -1, 1], dtype=np.int32))
    target.prefill(prompt)
    logits = target.verify(torch.tensor([4, 5, 6, 7]), tree)
    assert torch.equal(logits[[0, 2, 3]], steps(torch.tensor([4, 6, 7])))


def test_int8_batched_rows_equal_batch1_bit_for_bit(tiny_llama):
    # Batched engine, int8: a row's prefill and verify logits equal the batch-1 engine's bit for
    # bit, whatever the other rows hold (prompt lengths, widths 1..64, trees, padding), batch sizes 1..8.
    import copy

    from samctl.decode.engine.batched import BatchedTarget
    from samctl.decode.engine.target import TargetModel
    from samctl.decode.tree import DraftTree

    model = apply_cpu_linear(copy.deepcopy(tiny_llama), "int8")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 96, n) for n in (9, 30, 4, 17, 23, 11, 40, 6)]
    widths = [1, 64, 7, 2, 33, 12, 5, 20]  # t0 plus width - 1 nodes
    trees = []
    for i, w in enumerate(widths):
        tokens = rng.integers(3, 96, w - 1)
        if i % 2 and w > 2:  # a tree: every node hangs under a random earlier one (or t0)
            parents = np.array([rng.integers(-1, j) for j in range(w - 1)], dtype=np.int32)
            trees.append(DraftTree(tokens=tokens, parents=parents))
        else:
            trees.append(DraftTree.chain(tokens))
    single = TargetModel(model)
    want_prefill, want_verify = [], []
    for p, tree in zip(prompts, trees):
        want_prefill.append(single.prefill(torch.from_numpy(p)))
        want_verify.append(single.verify(single.verify_input(int(p[-1]), tree), tree))
    for rows in range(1, 9):
        target = BatchedTarget(model, rows, 128)
        got = target.prefill(list(range(rows)), prompts[:rows], [False] * rows)
        for b in range(rows):
            assert torch.equal(got[b], want_prefill[b]), (rows, b)
        inputs = [torch.from_numpy(np.concatenate(([p[-1]], t.tokens)).astype(np.int64))
                  for p, t in zip(prompts[:rows], trees[:rows])]
        logits, offsets = target.verify(inputs, trees[:rows])
        for b in range(rows):
            assert torch.equal(logits[offsets[b] : offsets[b + 1]], want_verify[b]), (rows, b)


@pytest.fixture(scope="module")
def default_int8():
    from samctl.tokenizer import DEFAULT_MODEL_DIR

    if not DEFAULT_MODEL_DIR.is_dir():
        pytest.skip("the embedded default model is not installed")
    return _load(DEFAULT_MODEL_DIR, "int8")


@pytest.mark.parametrize("method", ["ar", "pld", "sam", "adaptive", "rest", "recycle", "lookahead", "sam+recycle"])
def test_int8_batched_greedy_equals_its_own_plain_greedy(default_int8, method):
    # Every batched method on the int8 embedded model: each record's output equals plain greedy
    # decoding of the same int8 model, at batch sizes 1, 3 and 6 (wide drafts: up to 32 inputs a row;
    # widths to 64 and batch sizes 1..8 bit for bit: test_int8_batched_rows_equal_batch1_bit_for_bit).
    from samctl.decode.batch import generate_batch
    from samctl.decode.loop import GenerationConfig
    from samctl.decode.methods import make_drafter
    from tests.test_decode_greedy import EAGER

    model, new = default_int8, 16
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = []
    for i in range(6):  # mixed lengths, most repeating a span so that drafts are accepted in some rows
        base = rng.integers(3, vocab, 5 + 6 * i).tolist()
        prompts.append(base + base[: 4 + i] if i % 3 else base)
    expected = [hf_greedy(model, p, new, eos=None) for p in prompts]
    corpus = np.concatenate([np.asarray(r, dtype=np.int32) for r in expected])
    static = SuffixAutomaton.build(corpus, np.concatenate(([0], np.cumsum([len(r) for r in expected]))))

    def make():
        return make_drafter(method, vocab_size=vocab, device=torch.device("cpu"), eos_token_ids=(),
                            static=static if uses_store(method) else None, config=EAGER)

    cheap = 1.0 + 0.02 * np.arange(1, 513)  # drafting nearly free: wide trees, ragged acceptance
    for batch_size in (1, 3, 6):
        results = generate_batch(model, make, prompts, GenerationConfig(max_new_tokens=new), batch_size,
                                 cost_ms=cheap, max_width=32)
        for r, want in zip(results, expected):
            assert r.tokens == want, (method, batch_size, r.index)
