"""CPU linear backends: int8 rows are independent bit for bit, and decoding with either backend
stays lossless against plain greedy decoding of the same model (decode/engine/cpu_linear.py)."""
from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

from samctl.decode.engine import cpu_linear
from samctl.decode.engine.cpu_linear import (OWN_KERNEL_THREADS, Int8Linear, PackedLinear, apply_cpu_linear,
                                             linear_backend)
from samctl.decode.engine.int8_gemm import KERNELS, MAX_ROWS, RowsGemm, cpu_kernel
from samctl.decode.methods import EAGLE_METHODS, METHODS, uses_store
from samctl.index.automaton import SuffixAutomaton
from samctl.index.errors import ConfigError
from tests.planted_int8 import PLANTS, quantizer
from tests.test_decode_greedy import hf_greedy, prompts, run


@contextlib.contextmanager
def threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
        if layer.rows_gemm is not None:
            layer.rows_gemm = RowsGemm(layer.qweight.numpy(), layer.kernels.own)
    x = torch.randn(6, 3072)
    x[0] = 1.0  # every quantized value at the top level: sums past 2**24
    full = layer(x)
    assert int((127 * layer.qweight.long()).sum(1).min()) > 2**24  # row 0's integer sums
    for row in range(6):
        assert torch.equal(layer(x[row : row + 1])[0], full[row]), row
    if layer.rows_gemm is not None:  # up to OWN_KERNEL_THREADS: samctl's kernel; more: torch's
        with threads(OWN_KERNEL_THREADS + 1):
            assert torch.equal(layer(x), full) and torch.equal(layer(x[:1])[0], full[0])
    if layer.kernels.gemv:  # the _int_mm fallback for several rows gives the same numbers
        layer.gemm, layer.rows_gemm = None, None
        assert torch.equal(layer(x), full)


def exact_int8(layer, x: torch.Tensor) -> torch.Tensor:
    # the layer's formula with its integer sums taken in float64 (exact at these sizes), then the
    # layer's own float32 steps: (sum * sx) * sw
    sx = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    sums = (torch.round(x / sx).double() @ layer.qweight.double().t()).float()
    return torch.mul(sums, sx).mul_(layer.scale)


@pytest.mark.parametrize("kernels", [(True, True, False), (False, True, False), (True, False, False),
                                     (False, True, True), (True, True, False, "vnni"), (False, True, True, "avx2")],
                         ids=["int_mm+onednn", "onednn-only", "int_mm-only", "split", "vnni-kernel", "avx2-kernel"])
def test_int8_modes_are_exact_and_row_independent(monkeypatch, kernels):
    # every mode the probe can choose, forced: rows alone equal rows together and the formula

    chosen, probed = cpu_linear.Int8Kernels(*kernels), cpu_linear.int8_kernels()
    if chosen.onednn and cpu_linear.OneDnnGemm.pack(torch.zeros(2, 2, dtype=torch.int8)) is None:
        pytest.skip("no oneDNN int8 kernels in this build")
    # a mode is exact only where the probe found each of its kernels exact (AVX2 without VNNI:
    # oneDNN's 8-bit GEMM saturates; _int_mm does on some such CPUs and not on others)
    if chosen.gemv and not probed.gemv:
        pytest.skip(f"torch._int_mm does not sum int8 products exactly on this CPU (probe: {probed})")
    if chosen.onednn and not chosen.split and (probed.split or not probed.onednn):
        pytest.skip(f"oneDNN's 8-bit GEMM does not sum int8 products exactly on this CPU (probe: {probed})")
    if chosen.own and chosen.own not in (probed.own, "avx2" if probed.own else None):
        pytest.skip(f"no {chosen.own} kernel on this CPU (probe: {probed})")
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

    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: real(a, b).clamp(-32768, 32767))
    monkeypatch.setattr(cpu_linear.OneDnnGemm, "pack", classmethod(lambda cls, w: None))
    cpu_linear.int8_kernels.cache_clear()
    try:
        with pytest.raises(ConfigError, match="do not sum int8 products exactly") as err:
            cpu_linear.int8_kernels()
    finally:
        cpu_linear.int8_kernels.cache_clear()
    assert set(err.value.fields) == {"quantize"} and "use quantize= none" in str(err.value)


def test_int8_probed_kernels_are_exact_at_the_extremes():
    # whichever kernels the probe chose, sums at the extremes (a row of 127s) are exact and rows
    # independent; under oneDNN held to AVX2 (vpmaddubsw saturates 8-bit pairs), oneDNN's 8-bit
    # GEMM must not be among them: the probe takes _int_mm where that is exact, else the split
    from samctl.decode.engine.cpu_linear import int8_kernels

    layer = int8_layer(512, 40)
    x = torch.randn(6, 512) * 10
    x[0] = 1.0
    full = layer(x)
    assert torch.equal(full, exact_int8(layer, x))
    assert all(torch.equal(layer(x[i : i + 1])[0], full[i]) for i in range(6))
    kernels = int8_kernels()
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2" and platform.machine() in ("x86_64", "AMD64"):
        assert kernels.split or not kernels.onednn, kernels


@pytest.mark.skipif(not cpu_kernel(), reason="no AVX2 on this CPU")
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("shape", [(64, 32), (576, 960), (36, 48), (30, 7), (1, 16)], ids=str)
def test_own_kernel_sums_equal_int64_sums(kernel, shape):
    # decode/engine/int8_gemm.py against a naive reference: every row count through its groups of
    # 8, products at the extremes (+-127 codes against +-127 weights), shapes off the blocks
    if kernel == "vnni" and cpu_kernel() != "vnni":
        pytest.skip("no AVX512-VNNI on this CPU")
    rng = np.random.default_rng(sum(shape))
    depth, out = shape
    weight = rng.integers(-127, 128, (out, depth)).astype(np.int8)
    weight[0] = 127
    gemm = RowsGemm(weight, kernel)
    for rows in (1, 2, 3, 5, 8, 9, 16, 17):
        xq = rng.integers(-127, 128, (rows, depth)).astype(np.int64)
        xq[0] = 127
        xq[rows // 2, ::2] = -127
        got = gemm((xq + gemm.kernel.zero).astype(gemm.kernel.codes))
        assert got.dtype == np.int32 and np.array_equal(got, xq @ weight.astype(np.int64).T), rows


def test_own_kernel_follows_a_numba_target_set_by_the_user(monkeypatch):
    # NUMBA_CPU_NAME=generic (a portable cache) must not get AVX-512 instructions numba would not
    # compile for it: the kernel follows NUMBA_CPU_FEATURES there, not the CPU
    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", "generic")
    monkeypatch.setattr(config, "CPU_FEATURES", "")
    assert cpu_kernel() == ""
    monkeypatch.setattr(config, "CPU_NAME", "haswell")
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma,-avx512f")
    assert cpu_kernel() == "avx2"


def test_own_kernel_serves_a_few_rows_on_one_thread_only():
    # samctl's kernel for up to MAX_ROWS rows on one thread; with more rows torch's kernels,
    # which block for cache, and with more threads too, unless they are the split: then samctl's
    # serves any row count on one thread, and a few rows on any thread count; the same numbers
    # either way
    kernels = cpu_linear.int8_kernels()
    if not kernels.own:
        pytest.skip(f"the probe chose no kernel of samctl's here: {kernels}")
    torch_kernel = "split" if kernels.split else "onednn"
    layer = int8_layer(96, 48, seed=3)
    x = torch.randn(MAX_ROWS + 1, 96)
    with threads(1):
        many = kernels.own if kernels.split else torch_kernel
        assert [layer.kernel(r) for r in (1, MAX_ROWS, MAX_ROWS + 1)] == [kernels.own, kernels.own, many]
        alone = layer(x[:MAX_ROWS])
    with threads(OWN_KERNEL_THREADS):
        assert layer.kernel(2) == kernels.own
    with threads(OWN_KERNEL_THREADS + 1):  # where torch's kernel is the split, samctl's serves any thread count
        assert layer.kernel(2) == (kernels.own if kernels.split else torch_kernel)
        assert layer.kernel(MAX_ROWS + 1) == torch_kernel
        assert torch.equal(layer(x[:MAX_ROWS]), alone)
        assert torch.equal(layer(x)[:MAX_ROWS], alone)
    assert torch.equal(layer(x)[:MAX_ROWS], alone)


HASWELL = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,+lzcnt,+mmx,+movbe,+pclmul,"
           "+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt")  # numba's target features


# What must hold on every CPU class, run again on an AVX2 CPU without VNNI, emulated here: ATen's
# AVX2 kernels (sdpa, elementwise ops) and oneDNN's (int8 GEMM) in a fresh process.
ON_ANY_CPU = ("row_alone or one_row_kernel or modes_are_exact or probed_kernels or own_kernel or batch_rows_are or "
              "batched_rows_equal or integer_formula or single_steps or exact_kernel")


@pytest.mark.slow
def test_int8_exact_per_row_on_an_emulated_avx2_cpu():
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 emulation needs an x86 CPU")
    # numba compiles for Haswell too, so that samctl's own int8 kernel is the AVX2 one, as on such a CPU
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "NUMBA_CPU_NAME": "haswell",
           "NUMBA_CPU_FEATURES": HASWELL}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", __file__,
                           "-k", ON_ANY_CPU], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-3000:]


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


# -- int8 against the float model -------------------------------------------------------------------
# The checks above compare int8 with its own formula; these compare it with the float32 layer and
# model it quantizes, and show their power: each must fail under each planted quantizer.

def uses_full_range(layer: Int8Linear) -> bool:
    """Every output channel's largest |qweight| is 127 (a channel of zeros aside)."""
    top = layer.qweight.abs().amax(dim=1)
    return bool(((top == 127) | (layer.scale <= torch.finfo(torch.float32).tiny)).all())


def error_against_float(linear: nn.Linear, x: torch.Tensor) -> tuple[float, float]:
    """Int8Linear(linear)(x) [r, out] against the float layer, in float64; -> (worst, rms): the
    largest error over its guaranteed bound, and the RMS error over its expected size.

    With the weight scale sw[n] = max_k |W[n, k]| / 127 and the row scale sx[r] = max_k |x[r, k]| / 127,
    rounding leaves |W - sw wq| <= sw / 2 and |x - sx xq| <= sx / 2 elementwise, so
        y_float - y_int8 = sum_k (W - sw wq) x + sw wq (x - sx xq)
        |error[r, n]| <= sw[n] / 2 sum_k |x[r, k]| + sx[r] / 2 sum_k (|W[n, k]| + sw[n] / 2)  (+ float32 steps)
    and, as independent errors uniform within a step, E error^2 = sw^2 / 12 sum x^2 + sx^2 / 12 sum W^2."""
    w, xd = linear.weight.detach().double(), x.double()
    expected = xd @ w.t() + (0.0 if linear.bias is None else linear.bias.detach().double())
    error = (Int8Linear(linear)(x).double() - expected).abs()
    sw, sx = w.abs().amax(dim=1) / 127, xd.abs().amax(dim=1, keepdim=True) / 127
    bound = sw / 2 * xd.abs().sum(1, keepdim=True) + sx / 2 * (w.abs().sum(1) + w.shape[1] * sw / 2)
    bound += 1e-6 * expected.abs()  # float32's few rounding steps
    variance = sw**2 / 12 * xd.pow(2).sum(1, keepdim=True) + sx**2 / 12 * w.pow(2).sum(1)
    return float((error / bound).max()), float((error.pow(2).mean() / variance.mean()).sqrt())


def float_layer(in_features: int, out_features: int, seed: int) -> nn.Linear:
    # weights of a trained layer's kind: Gaussian, channels of norms a hundredfold apart
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05).mul_(torch.logspace(-1, 1, out_features)[:, None])
    return linear.requires_grad_(False)


@pytest.mark.parametrize("plant", [None, *PLANTS])
def test_int8_layers_use_the_full_range_and_stay_within_the_bound_of_float(plant):
    with quantizer(plant):
        layers = [float_layer(256, 128, seed) for seed in range(2)]
    x = torch.randn(64, 256) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different scales
    with quantizer(plant):
        ranges = [uses_full_range(Int8Linear(linear)) for linear in layers]
        errors = [error_against_float(linear, x) for linear in layers]
    worst, rms = max(e[0] for e in errors), max(e[1] for e in errors)
    # measured: worst 0.12 of the bound, RMS 1.00 of the expected size
    if plant is None:
        assert all(ranges) and worst <= 1.0 and rms <= 1.25, (ranges, worst, rms)
        return
    # each check alone catches the plant (RMS: 7-bit weights 1.51, one scale per tensor 2.65); the
    # guaranteed bound, a worst case, is loose enough for 7-bit weights (0.20) but not for one
    # scale per tensor (7.8: small channels off by more than their own half step allows)
    assert not any(ranges) and rms > 1.25, (plant, ranges, rms)
    assert (worst > 1.0) == (plant == "per_tensor"), (plant, worst)


@torch.inference_mode()
def greedy_agreement(float_model: nn.Module, int8_model: nn.Module, ids: torch.Tensor, new: int) -> float:
    """Teacher-forced top-1 agreement of int8 with float32's greedy output (ids [n, p] int64 prompts)."""
    out = float_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    choice = int8_model(out).logits[:, ids.shape[1] - 1 : -1].argmax(-1)
    return float((choice == out[:, ids.shape[1] :]).double().mean())


@pytest.mark.parametrize("plant", [None, *PLANTS])
def test_int8_greedy_agreement_with_float32_is_pinned(tiny_llama, plant):
    # the tiny test model, 32 prompts x 32 greedy tokens of float32: int8 picks the same top-1 at
    # 0.992 of them (1016 of 1024, measured here and under the AVX2 emulation); planted 7-bit
    # weights 0.979, one scale per tensor 0.979
    import copy

    ids = torch.tensor(np.random.default_rng(0).integers(3, 96, (32, 12)))
    with quantizer(plant):
        int8_model = apply_cpu_linear(copy.deepcopy(tiny_llama), "int8")
    agreement = greedy_agreement(tiny_llama, int8_model, ids, 32)
    assert (agreement >= 0.985) == (plant is None), (plant, agreement)


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
    with pytest.raises(ConfigError, match="quantize= 'int4': choose one of none, int8"):
        apply_cpu_linear(plain, "int4")


def test_int8_fused_projections_equal_separate_layers_bit_for_bit(tiny_llama, monkeypatch):
    # q/k/v and gate/up run as one stacked int8 layer: the logits equal those of the model whose
    # projections run separately, bit for bit, and no input or output is held between forwards.
    import copy


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


@pytest.fixture(scope="module")
def int8_llama(tiny_llama):
    """The tiny Llama with int8 linears, shared by the tests that only read it."""
    import copy

    return apply_cpu_linear(copy.deepcopy(tiny_llama), "int8")


def _load(folder, quantize: str, prepack: bool = True):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return apply_cpu_linear(model, quantize, prepack)


@pytest.fixture(scope="module")
def int8_greedy(tiny_model_dir):
    """Per architecture: the int8 tiny model and its plain greedy continuations of two prompts
    (computed once, read by every method's test)."""
    model = _load(tiny_model_dir, "int8")
    cases = [(p, hf_greedy(model, p, 48, eos=None)) for p in prompts(model.config.vocab_size)[:2]]
    return model, cases


@pytest.mark.parametrize("method", METHODS + EAGLE_METHODS)
def test_int8_greedy_equals_its_own_plain_greedy(int8_greedy, method):
    model, cases = int8_greedy
    accepted = 0
    for prompt, expected in cases:
        # store methods draft from the continuation's first half, so their drafts are long and accepted
        store = SuffixAutomaton.build(np.asarray(expected[:24], dtype=np.int32), np.array([0, 24])) \
            if uses_store(method) else None
        result = run(model, method, prompt, 48, static=store)
        assert result.tokens == expected, (method, prompt)
        accepted += result.metrics.accepted
    assert (accepted > 0) == (method != "ar"), (method, accepted)  # drafts were verified, and some kept


@pytest.fixture(scope="module")
def packed_greedy(tiny_model_dir):
    """Per architecture: the prepacked tiny model and plain float32's greedy continuations of
    three prompts, which prepacked greedy decoding (transformers' own loop) must reproduce."""
    plain, packed = _load(tiny_model_dir, "none", prepack=False), _load(tiny_model_dir, "none")
    cases = []
    for prompt in prompts(plain.config.vocab_size):
        expected = hf_greedy(plain, prompt, 48, eos=None)
        assert hf_greedy(packed, prompt, 48, eos=None) == expected, prompt
        cases.append((prompt, expected))
    return packed, cases


@pytest.mark.parametrize("method", ["ar", "pld", "adaptive", "recycle", "eagle"])
def test_packed_greedy_equals_plain_greedy(packed_greedy, method):
    packed, cases = packed_greedy
    accepted = 0
    for prompt, expected in cases:
        result = run(packed, method, prompt, 48)
        assert result.tokens == expected, (method, prompt)
        accepted += result.metrics.accepted
    assert (accepted > 0) == (method != "ar"), (method, accepted)  # drafts were verified, and some kept


def one_token_steps(target, prompt: np.ndarray, tokens: np.ndarray) -> torch.Tensor:
    """The logits of `tokens` fed one at a time behind `prompt` (batch 1): what plain greedy decoding computes."""
    from samctl.decode.tree import DraftTree

    target.prefill(torch.from_numpy(prompt))
    out = []
    for tok in tokens:
        out.append(target.verify(torch.tensor([tok]), DraftTree.chain(np.zeros(0, dtype=np.int64))))
        target.keep(np.zeros(1, dtype=np.int64))
    return torch.cat(out)


def test_int8_verify_equals_single_steps_bit_for_bit(int8_llama):
    # The whole int8 forward is exact per row (int8 linears + one-row attention): verifying n
    # tokens gives the logits of n one-token steps, bit for bit, for chains of 1..64 and a tree.
    from samctl.decode.engine.target import TargetModel
    from samctl.decode.tree import DraftTree

    target = TargetModel(int8_llama)
    rng = np.random.default_rng(0)
    prompt, ids = rng.integers(3, 96, 20), rng.integers(3, 96, 64)
    expected = one_token_steps(target, prompt, ids)
    for n in (1, 2, 7, 8, 16, 33, 64):
        target.prefill(torch.from_numpy(prompt))
        got = target.verify(torch.from_numpy(ids[:n]), DraftTree.chain(ids[1:n]))
        assert torch.equal(got, expected[:n]), n
    # a tree: the root t0 with children a and b, b with child c; the path t0 -> b -> c equals its steps
    tree = DraftTree(tokens=np.array([5, 6, 7]), parents=np.array([-1, -1, 1], dtype=np.int32))
    target.prefill(torch.from_numpy(prompt))
    logits = target.verify(torch.tensor([4, 5, 6, 7]), tree)
    assert torch.equal(logits[[0, 2, 3]], one_token_steps(target, prompt, np.array([4, 6, 7])))


def test_int8_batched_verify_equals_single_steps_bit_for_bit(int8_llama):
    # The batched engine at verify widths >= 16: each row's logits are those of one-token steps of
    # batch 1, bit for bit, whatever the other rows hold; chains, then trees whose deepest path is checked.
    from samctl.decode.engine.batched import BatchedTarget
    from samctl.decode.engine.target import TargetModel
    from samctl.decode.tree import DraftTree

    single, batched = TargetModel(int8_llama), BatchedTarget(int8_llama, 3, 100)  # 100: not a multiple of 64
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 96, n) for n in (20, 9, 31)]
    widths = (16, 33, 64)
    chains = [rng.integers(3, 96, w) for w in widths]
    batched.prefill([0, 1, 2], prompts, [False] * 3)
    logits, offsets = batched.verify([torch.from_numpy(c) for c in chains], [DraftTree.chain(c[1:]) for c in chains])
    for b, (p, c) in enumerate(zip(prompts, chains)):
        assert torch.equal(logits[offsets[b] : offsets[b + 1]], one_token_steps(single, p, c)), (b, len(c))
    # trees of `width` inputs: node j hangs under node j - 2 (two interleaved chains), so rows see
    # the shared prefix and then ancestors that are not contiguous in the block
    trees = [DraftTree(tokens=c[1:], parents=np.arange(-2, len(c) - 3, dtype=np.int32).clip(-1)) for c in chains]
    batched.prefill([0, 1, 2], prompts, [False] * 3)
    logits, offsets = batched.verify([torch.from_numpy(c) for c in chains], trees)
    for b, (p, c) in enumerate(zip(prompts, chains)):
        path = np.concatenate(([0], np.arange(2, len(c), 2)))  # t0 -> node 1 -> node 3 -> ... (inputs 0, 2, 4, ...)
        assert torch.equal(logits[offsets[b] : offsets[b + 1]][path], one_token_steps(single, p, c[path])), b


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_int8_steps_and_verify_rows_attend_in_the_exact_kernel_not_sdpa(int8_llama, tiny_llama, monkeypatch, backend):
    # Exact per row on every CPU: a row's attention must not depend on how a library kernel blocks
    # a call (an AVX2 EPYC's sdpa rounded a strided query row differently from a step's own), so
    # one-token steps and verified rows (chains, trees, batched, padded) attend through
    # attend_rows alone (hf: called per layer; native: inside Int8Forward's compiled layers, one
    # call per forward); sdpa sees prefills only.
    import copy

    from samctl.decode.engine import attention
    from samctl.decode.engine.batched import BatchedTarget
    from samctl.decode.engine.int8_forward import Int8Forward
    from samctl.decode.engine.native import use_backend
    from samctl.decode.engine.target import TargetModel
    from samctl.decode.tree import DraftTree

    model = apply_cpu_linear(copy.deepcopy(tiny_llama), "int8") if backend == "native" else int8_llama
    assert use_backend(model, backend) == backend
    sdpa_rows, kernel_calls = [], []
    real_sdpa, real_kernel, real_int8 = F.scaled_dot_product_attention, attention.attend_rows, Int8Forward.__call__

    def sdpa(query, key, *args, **kwargs):
        sdpa_rows.append(query.shape[2] < key.shape[2])  # a query with cached keys: not a prefill
        return real_sdpa(query, key, *args, **kwargs)

    def kernel(*args):
        kernel_calls.append(args[0].shape)
        return real_kernel(*args)

    def int8_forward(self, *args):
        kernel_calls.extend([None] * len(self.layers))
        return real_int8(self, *args)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(attention, "attend_rows", kernel)
    monkeypatch.setattr(Int8Forward, "__call__", int8_forward)
    rng = np.random.default_rng(3)
    prompt, ids = rng.integers(3, 96, 20), rng.integers(3, 96, 24)
    single = TargetModel(model)
    one_token_steps(single, prompt, ids[:2])
    chain, tree = DraftTree.chain(ids[1:]), DraftTree(ids[1:], np.arange(-2, 21, dtype=np.int32).clip(-1))
    for draft in (chain, tree):
        single.prefill(torch.from_numpy(prompt))
        single.verify(torch.from_numpy(ids), draft)
    batched = BatchedTarget(model, 2, 100)
    for draft in (chain, tree):
        batched.prefill([0, 1], [prompt, prompt[:9]], [False, False])
        batched.verify([torch.from_numpy(ids)] * 2, [draft] * 2)
    layers = model.config.num_hidden_layers
    assert not any(sdpa_rows) and len(kernel_calls) == layers * (2 + 2 + 2), (sdpa_rows, len(kernel_calls))


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


@pytest.fixture(scope="module")
def default_int8_case(default_int8):
    """Six prompts of mixed lengths, most repeating a span so that drafts are accepted in some
    rows, their plain greedy continuations by the int8 embedded model, and a store of those."""
    vocab = default_int8.config.vocab_size
    rng = np.random.default_rng(0)
    cases = []
    for i in range(6):
        base = rng.integers(3, vocab, 5 + 6 * i).tolist()
        cases.append(base + base[: 4 + i] if i % 3 else base)
    expected = [hf_greedy(default_int8, p, 16, eos=None) for p in cases]
    corpus = np.concatenate([np.asarray(r, dtype=np.int32) for r in expected])
    static = SuffixAutomaton.build(corpus, np.concatenate(([0], np.cumsum([len(r) for r in expected]))))
    return cases, expected, static


@pytest.mark.parametrize("method", ["ar", "pld", "sam", "adaptive", "rest", "recycle", "lookahead", "sam+recycle"])
def test_int8_batched_greedy_equals_its_own_plain_greedy(default_int8, default_int8_case, method):
    # Every batched method on the int8 embedded model: each record's output equals plain greedy
    # decoding of the same int8 model, at batch size 1 and at 4 (6 prompts: rows leave and newcomers
    # join mid-run; wide drafts: up to 32 inputs a row; widths to 64 and batch sizes 1..8 bit for
    # bit: test_int8_batched_rows_equal_batch1_bit_for_bit).
    from samctl.decode.loop import generate_batch
    from samctl.decode.loop import GenerationConfig
    from samctl.decode.methods import make_drafter
    from tests.test_decode_greedy import EAGER

    model, (inputs, expected, static) = default_int8, default_int8_case

    def make():
        return make_drafter(method, vocab_size=model.config.vocab_size, device=torch.device("cpu"),
                            eos_token_ids=(), static=static if uses_store(method) else None, config=EAGER)

    cheap = 1.0 + 0.02 * np.arange(1, 513)  # drafting nearly free: wide trees, ragged acceptance
    accepted = {}
    for batch_size in (1, 4):
        results = generate_batch(model, make, inputs, GenerationConfig(max_new_tokens=16), batch_size,
                                 cost=cheap, max_width=32)
        for r, want in zip(results, expected):
            assert r.tokens == want, (method, batch_size, r.index)
        accepted[batch_size] = sum(r.metrics.accepted for r in results)
    # drafts were verified and some kept (recycle's, at 4 rows, are budgeted down to a few, all rejected)
    assert (sum(accepted.values()) > 0) == (method != "ar"), (method, accepted)


def test_a_cost_curve_is_keyed_by_the_int8_kernels_that_run(tiny_llama, monkeypatch):
    # one CPU held to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, NUMBA_CPU_NAME) verifies at
    # other costs than the same CPU with VNNI: a curve measured one way must not price the other
    import copy
    from types import SimpleNamespace

    from samctl import costs
    from samctl.decode.engine.target import TargetModel

    model = apply_cpu_linear(copy.deepcopy(tiny_llama), "int8")
    engine = SimpleNamespace(name="tiny", model=model, device=torch.device("cpu"), target=TargetModel(model))
    keys = []
    for kernels in (cpu_linear.Int8Kernels(True, True, False, "vnni"), cpu_linear.Int8Kernels(False, True, True, "avx2")):
        monkeypatch.setattr(costs, "int8_kernels", lambda: kernels)
        keys.append(costs.curve_key(engine))
    assert keys[0] != keys[1] and keys[1]["int8_kernels"]["own"] == "avx2"
    plain = SimpleNamespace(name="tiny", model=tiny_llama, device=torch.device("cpu"), target=TargetModel(tiny_llama))
    assert costs.curve_key(plain)["int8_kernels"] == {}  # a float model probes nothing
