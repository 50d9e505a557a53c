"""CPU linear backends: a CPU model's nn.Linear layers (the output head included) swapped once, at load.

- `PackedLinear` (float32): the weight prepacked once in oneDNN's blocked layout, so a call with a
  few rows does not repack it (plain `F.linear` lets MKL repack every weight on every call). Results
  differ from plain `F.linear` in the last bits, as plain's own do between 1 row and 64.
- `Int8Linear`: per-output-channel symmetric int8 weights times per-row (per-token) symmetric int8
  activations, with integer accumulation:

      y[r, n] = (sum_k xq[r, k] * wq[n, k]) * sx[r] * sw[n],   xq[r] = round(x[r] / sx[r])

  Invariant: row r's output is a function of row r alone, bit for bit (the integer sum is exact
  in any order; the scales and the epilogue are elementwise), so a verify of 8 tokens runs each
  layer as 8 single steps would. Attention must then be exact per row too: int8 models switch to
  `samctl_rowwise` (decode/engine/attention.py). Which kernel sums the integers is therefore free
  (`Int8Linear.kernel`); the int8 weight is held once per kernel that may run.
  Pitfall: without VNNI (AVX512-VNNI or AVX-VNNI) x86 multiplies int8 with `vpmaddubsw`, which
  saturates pairs of products at 16 bits, and both `_int_mm` and oneDNN's 8-bit GEMM return wrong
  sums. `int8_kernels()` probes this once; there every row runs as two 7-bit halves (`split_sums`:
  the same 8-bit model; 7-bit activations would be a coarser one), and where that is not exact
  either, int8 is refused.
- `FusedLinear`: projections of one input (q, k, v; gate, up) as one layer of their stacked weights,
  bit for bit the separate layers (int8), with one quantization and one matmul instead of three.

It knows modules and tensors, not decoding.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch
from numba import njit
from numba.core.errors import NumbaError
from torch import nn

from samctl.decode.engine import int8_gemm
from samctl.decode.engine.attention import largest, use_rowwise_attention
from samctl.index.errors import ConfigError

QUANTIZE = ("none", "int8")
_BACKEND_ATTR = "_samctl_linear"  # set on the model: "plain", "packed" or "int8"

# samctl's kernel runs on one core; torch's int8 GEMMs use every thread. At two threads (Zen 5, VNNI)
# samctl's was still faster at 1-8 rows (BENCHMARKS.md, 2026-11-28); with more, torch's may be: not measured.
OWN_KERNEL_THREADS = 2


class PackedLinear(nn.Module):
    """nn.Linear with its float32 weight prepacked for oneDNN (CPU only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # an opaque oneDNN tensor, not a buffer: it cannot be moved, saved or cast
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias
        self._dense: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        # [out, in] float32, for readers such as EAGLE's vocabulary rows; kept once asked
        if self._dense is None:
            with torch.inference_mode(False):  # a normal tensor, which autograd may save, even if first asked in inference
                self._dense = self.packed.to_dense()
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] float32 -> [..., out] float32
        if x.requires_grad and torch.is_grad_enabled():  # the oneDNN op has no backward (EAGLE training)
            return nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] float32 -> (qweight [out, in] int8, scale [out] float32), symmetric per
    output channel: each channel's largest |weight| maps to 127, so every channel spans the whole
    int8 range and |weight - qweight * scale| <= scale / 2 elementwise."""
    scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    return torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qweight, scale = quantize_weight(linear.weight.detach().float())
        self.register_buffer("qweight", qweight)  # [out, in] int8
        self.register_buffer("scale", scale)  # [out] float32
        self.bias = linear.bias
        self.kernels = int8_kernels()
        self.gemm = OneDnnGemm.pack(qweight) if self.kernels.onednn else None  # several rows (all, when split)
        # a few rows on one thread
        self.rows_gemm = int8_gemm.RowsGemm(qweight.numpy(), self.kernels.own) if self.kernels.own else None
        self._dense: torch.Tensor | None = None
        self._scales: tuple | None = None  # (the scale buffer, it and the bias as arrays), for `rescale`

    @property
    def weight(self) -> torch.Tensor:
        # [out, in] float32: the dequantized weight, the one this layer really multiplies by
        if self._dense is None:
            with torch.inference_mode(False):
                self._dense = self.qweight.float() * self.scale[:, None]
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] float -> [..., out] in x's dtype
        y = self._matmul(x.reshape(-1, self.in_features))
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        # rows [r, in] float -> [r, out] float32. A decode step runs this ~121 times on one row, where
        # a torch call costs more than its arithmetic: hence two compiled calls around the sums.
        rows = (rows if rows.dtype == torch.float32 else rows.float()).contiguous()
        dtype, zero = self.code_format(len(rows))
        codes = np.empty(rows.shape, dtype=dtype)
        row_scale = np.empty(len(rows), dtype=np.float32)
        quantize_rows(rows.numpy(), codes, row_scale, zero)
        y = torch.empty(len(rows), self.out_features)
        rescale(self.integer_sums(codes).numpy(), row_scale, *self.scales(), y.numpy())
        return y

    def kernel(self, rows: int) -> str:
        """The kernel that sums `rows` rows (a key of CODE_FORMATS): samctl's own for a few rows on
        up to OWN_KERNEL_THREADS threads, and where torch's would be the slow split (no VNNI) for a few
        rows or few threads; else `_int_mm` for one row (a memory-bound matrix-vector product), oneDNN's
        prepacked GEMM for several (8 rows cost ~1.3x one), the split where no VNNI. Decided by
        the probe, the row count and the thread count alone, so every layer of a forward takes one code format."""
        few, lean = rows <= int8_gemm.MAX_ROWS, torch.get_num_threads() <= OWN_KERNEL_THREADS
        if self.rows_gemm is not None and (few and lean or self.kernels.split and (few or lean)):
            return self.kernels.own
        if self.kernels.split:
            return "split"
        if self.gemm is None or (rows == 1 and self.kernels.gemv):
            return "int_mm"
        return "onednn"

    def code_format(self, rows: int) -> tuple[type, int]:
        """(dtype, zero point) of the codes `integer_sums` takes for `rows` rows."""
        return CODE_FORMATS[self.kernel(rows)]

    def integer_sums(self, codes: np.ndarray) -> torch.Tensor:
        """codes [r, in] as `code_format(r)` says -> [r, out]: sum_k xq[r, k] * wq[n, k], exact
        (int32, or float32 holding integers; possibly a transposed view)."""
        kernel = self.kernel(len(codes))
        if kernel in int8_gemm.KERNELS:
            return torch.from_numpy(self.rows_gemm(codes))
        rows = torch.from_numpy(codes)
        if kernel == "split":
            return split_sums(self.gemm, rows)
        if kernel == "int_mm":
            return torch._int_mm(self.qweight, rows.t()).t()  # [out, in] x [in, r]: int32, transposed
        return self.gemm(rows, 128)

    def scales(self) -> tuple[np.ndarray, np.ndarray]:
        # -> (scale [out], bias [out] or empty) float32 arrays for `rescale`, made once
        if self._scales is None or self._scales[0] is not self.scale:
            self._scales = (self.scale, self.scale.numpy(),
                            _NO_BIAS if self.bias is None else self.bias.detach().float().numpy())
        return self._scales[1:]


_NO_BIAS = np.zeros(0, dtype=np.float32)
# (dtype, zero point) of each kernel's codes: int8 for `_int_mm`; uint8 + 128 for oneDNN's u8 x s8
# GEMM and the VNNI kernel; int16 for the AVX2 kernel; float32 for the split halves
CODE_FORMATS = {"int_mm": (np.int8, 0), "onednn": (np.uint8, 128), "split": (np.float32, 0),
                **{k.name: (k.codes, k.zero) for k in int8_gemm.KERNELS.values()}}


# The compiled kernels of the int8 path take numpy's error model: under numba's default a float
# division checks for zero, and that branch keeps its loop from vectorizing (10x slower).
@njit(cache=True, error_model="numpy")
def quantize_rows(rows, out, row_scale, zero):
    # rows [r, in] float32 -> out [r, in] (any dtype that holds the codes), row_scale [r] float32
    for i in range(rows.shape[0]):
        row_scale[i] = quantize_row(rows[i], out[i], zero)


@njit(cache=True, error_model="numpy")
def quantize_row(row, out, zero):
    """row_scale = max |row| / 127 (at least the smallest normal float32 / 127), returned, and
    out[k] = round(row[k] / row_scale) + zero, half to even; |the quotient| <= 127 up to
    rounding, so no clamp. In one order."""
    scale = max(largest(row, True), np.float32(np.finfo(np.float32).tiny)) / np.float32(127.0)
    shift = np.int32(zero)
    for k in range(row.shape[0]):
        out[k] = np.int32(np.rint(row[k] / scale)) + shift
    return scale


@njit(cache=True, error_model="numpy")
def rescale(sums, row_scale, scale, bias, out):
    # sums [r, out] int32 or exact float32 (a transposed view reads as its own strides), row_scale [r], out [r, out]
    for i in range(out.shape[0]):
        rescale_row(sums[i], row_scale[i], scale, bias, out[i])


@njit(cache=True, error_model="numpy")
def rescale_row(sums, row_scale, scale, bias, out):
    """out[n] = float32(sums[n]) * row_scale * scale[n] (+ bias[n]), in that order: the epilogue
    of one row; bias empty for none (tested once, not per element)."""
    if len(bias):
        for n in range(out.shape[0]):
            out[n] = np.float32(sums[n]) * row_scale * scale[n] + bias[n]
    else:
        for n in range(out.shape[0]):
            out[n] = np.float32(sums[n]) * row_scale * scale[n]


class OneDnnGemm:
    """oneDNN's int8 GEMM over a prepacked copy of an int8 weight [out, in], called with unit
    scales, so that it returns the exact integer sums of int8 rows, as float32. The rows come as
    uint8 with a zero point (xq + 128, or 7-bit halves + 64): oneDNN's fast x86 kernels multiply
    u8 by s8 (its s8 x s8 path is 15x slower here); the zero point is subtracted in integers."""

    def __init__(self, packed: torch.Tensor, out_features: int) -> None:
        self.packed = packed
        self.ones = torch.ones(out_features)
        self.zeros = torch.zeros(out_features, dtype=torch.long)

    @classmethod
    def pack(cls, qweight: torch.Tensor) -> OneDnnGemm | None:
        try:
            return cls(torch.ops.onednn.qlinear_prepack(qweight, None), len(qweight))
        except (AttributeError, RuntimeError, NotImplementedError):  # no oneDNN (non-x86 builds)
            return None

    def __call__(self, xu: torch.Tensor, zero: int) -> torch.Tensor:
        # xu [r, in] uint8 (xq + zero) -> [r, out] float32: sum_k xq[r, k] * w[n, k]
        return torch.ops.onednn.qlinear_pointwise(xu, 1.0, zero, self.packed, self.ones, self.zeros, None, 1.0, 0,
                                                  torch.float32, "none", [None], "")


def split_sums(gemm: OneDnnGemm, xq: torch.Tensor) -> torch.Tensor:
    """xq [r, in] integer-valued in [-127, 127] -> [r, out] float32: its integer sums against the
    weight, with every row as two 7-bit halves h = floor(xq / 2) and xq - h (both within [-64, 64])
    in one call at zero point 64, so no pair of products reaches 2^15 (CPUs without VNNI)."""
    half = torch.div(xq, 2, rounding_mode="floor")
    sums = gemm(torch.cat([half, xq - half]).add_(64).to(torch.uint8), 64)
    return sums[: len(xq)].add_(sums[len(xq) :])


class FusedLinear(nn.Module):
    """Sibling projections as one `swap` layer of their stacked weights. int8: each output column is
    its own integer sum times its own scales, so bit for bit the separate layers; float32: summed as
    the one GEMM blocks them (last bits). `parts` replace the model's projections; the native
    forward (decode/engine/native.py) calls `layer` itself."""

    def __init__(self, linears: list[nn.Linear], swap: type[nn.Module]) -> None:
        super().__init__()
        first = linears[0]
        stacked = nn.Linear(first.in_features, sum(l.out_features for l in linears), bias=first.bias is not None,
                            dtype=first.weight.dtype)
        with torch.no_grad():
            stacked.weight.copy_(torch.cat([l.weight.detach() for l in linears]))
            if stacked.bias is not None:
                stacked.bias.copy_(torch.cat([l.bias.detach() for l in linears]))
        self.layer = swap(stacked)
        bounds = torch.tensor([0] + [l.out_features for l in linears]).cumsum(0).tolist()
        self.parts = [FusedPart(self, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        self._key: tuple | None = None  # (input, its version): the input `_output` was computed for
        self._output: torch.Tensor | None = None
        self._left = 0  # parts still to read `_output`

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked layer's output for `x`, computed once for all parts: the model calls each
        part with the same tensor, one after the other. Computed again for any other input, or
        one changed in place (inference tensors keep no version: the model does not change its
        input between the parts' calls, and nothing is held once every part has read)."""
        version = None if x.is_inference() else x._version
        if self._left == 0 or self._key[0] is not x or self._key[1] != version:
            self._key, self._output, self._left = (x, version), self.layer(x), len(self.parts)
        output = self._output
        self._left -= 1
        if self._left == 0:  # every part has its slice: hold no tensor between forwards
            self._key = self._output = None
        return output


class FusedPart(nn.Module):
    """Columns lo:hi of a FusedLinear layer: what one of its projections computes."""

    def __init__(self, fused: FusedLinear, lo: int, hi: int) -> None:
        super().__init__()
        self.lo, self.hi = lo, hi
        self.in_features, self.out_features = fused.layer.in_features, hi - lo
        self._fused = [fused]  # in a list: not a submodule, so the weights are listed once

    @property
    def weight(self) -> torch.Tensor:
        # [out, in] float32 (dequantized for int8)
        return self._fused[0].layer.weight[self.lo : self.hi]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0].output(x)[..., self.lo : self.hi]


# Projections that read the same input in the models transformers ships (Llama, Mistral, Qwen,
# SmolLM, ...): fused by FusedLinear where a module has all of a group as plain nn.Linear.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Int8Kernels(NamedTuple):
    """Which kernels sum int8 products exactly on this CPU (`int8_kernels`)."""

    gemv: bool  # one row through torch._int_mm(weight, row^T)
    onednn: bool  # several rows (every row, when split) through oneDNN's prepacked GEMM
    split: bool  # no VNNI: every row as two 7-bit halves through oneDNN, their sums added
    own: str = ""  # samctl's kernel for a few rows (int8_gemm.KERNELS; Int8Linear.kernel), "" if none


@lru_cache(maxsize=1)
def int8_kernels() -> Int8Kernels:
    """Probe the int8 kernels once with products at the extremes (+-127 weights against +-127
    activations, in runs of equal signs, where a saturating pair sum shows) against float64 sums,
    which are exact here. Raises ConfigError (naming `quantize`) when no kernel sums exactly."""
    weight = torch.full((16, 512), 127, dtype=torch.int8)
    weight[1::2] = -127
    weight[2::4, ::3] = -127
    x = torch.full((4, 512), 127, dtype=torch.int8)
    x[1] = -127
    x[2, ::2] = -127
    x[3, 100:] = -127
    expected = x.double() @ weight.double().t()

    def exact(kernel) -> bool:
        try:
            return all(torch.equal(kernel(x[:m]).double(), expected[:m]) for m in (1, 2, 4))
        except (AttributeError, RuntimeError, NotImplementedError, NumbaError):  # a kernel this build lacks
            return False

    gemm = OneDnnGemm.pack(weight)
    gemv = exact(lambda rows: torch._int_mm(weight, rows.t()).t())  # the call Int8Linear makes
    onednn = gemm is not None and exact(lambda rows: gemm((rows.int() + 128).to(torch.uint8), 128))
    own = int8_gemm.cpu_kernel()
    if own:
        rows_gemm, (dtype, zero) = int8_gemm.RowsGemm(weight.numpy(), own), CODE_FORMATS[own]
        own = own if exact(lambda rows: torch.from_numpy(rows_gemm((rows.int() + zero).numpy().astype(dtype)))) else ""
    if gemv or onednn:
        return Int8Kernels(gemv, onednn, False, own)
    if gemm is not None and exact(lambda rows: split_sums(gemm, rows.int())):
        return Int8Kernels(False, True, True, own)
    raise ConfigError("{quantize} int8: this CPU's int8 kernels do not sum int8 products exactly (no VNNI, "
                      "and oneDNN's 7-bit path failed too), so int8 results would be wrong: use {quantize} none")


def apply_cpu_linear(model: nn.Module, quantize: str = "none", prepack: bool = True) -> nn.Module:
    """Swap the model's nn.Linear layers in place for the chosen CPU backend; returns the model.
    quantize "int8": Int8Linear everywhere; "none" with prepack: PackedLinear (float32 models);
    otherwise the model is left as it is. Only on a CPU: elsewhere "int8" is refused."""
    if quantize not in QUANTIZE:
        raise ConfigError("{quantize} {value!r}: choose one of {choices}", value=quantize, choices=", ".join(QUANTIZE))
    device = next(model.parameters()).device
    if device.type != "cpu":
        if quantize != "none":
            raise ConfigError("{quantize} {value} runs on the CPU only: use {quantize} none, or {device} cpu",
                              value=quantize)
        return model
    if quantize == "int8":
        backend, swap = "int8", Int8Linear
    elif prepack and next(model.parameters()).dtype == torch.float32 and torch.backends.mkldnn.is_available():
        backend, swap = "packed", PackedLinear
    else:
        return model
    _fuse_groups(model, swap)
    _replace_linears(model, swap)
    if backend == "int8":
        # exact per row needs attention exact per row too (decode/engine/attention.py)
        use_rowwise_attention(model)
    setattr(model, _BACKEND_ATTR, backend)
    return model


def linear_backend(model: nn.Module) -> str:
    """"plain", "packed" or "int8": what the model's linear layers run with (costs are kept per backend)."""
    return getattr(model, _BACKEND_ATTR, "plain")


@torch.no_grad()
def _replace_linears(model: nn.Module, swap: type[nn.Module]) -> None:
    # Collected first: replacing children while iterating named_modules would skip some.
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, swap(child))


@torch.no_grad()
def _fuse_groups(model: nn.Module, swap: type[nn.Module]) -> None:
    for module in list(model.modules()):
        for names in FUSED_GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if not all(type(l) is nn.Linear for l in linears):
                continue
            if len({(l.in_features, l.bias is not None) for l in linears}) != 1:
                continue
            fused = FusedLinear(linears, swap)
            module.add_module("_samctl_" + "_".join(names), fused)
            for name, part in zip(names, fused.parts):
                setattr(module, name, part)
