"""CPU linear backends: the model's nn.Linear layers swapped for faster kernels, once, at load.

`apply_cpu_linear(model, quantize, prepack)` replaces every `nn.Linear` of a CPU model (the output
head included) with one of:

- `PackedLinear` (float32): the weight reordered once into oneDNN's blocked layout, so a call
  with a few rows does not repack it (plain `F.linear` lets MKL repack every weight on every call;
  SmolLM2-135M's 210 layers, one thread: 22.5 ms for 1 row and 40 ms for 8 plain, 13.3 and 18.9
  prepacked). Float results differ from plain `F.linear` in the last bits (up to ~1e-5 here),
  as plain's own do between 1 row and 64.
- `Int8Linear`: per-output-channel symmetric int8 weights and a per-row (per-token) symmetric
  int8 scale for the activations, multiplied with integer accumulation (`torch._int_mm`):

      y[r, n] = (sum_k xq[r, k] * wq[n, k]) * sx[r] * sw[n],   xq[r] = round(x[r] / sx[r])

  Invariant: row r's output is a function of row r alone, bit for bit (the integer sum is
  exact in any order; the scales and the epilogue are elementwise), so a verify of 8 tokens
  runs each layer as 8 single steps would. Attention must then be exact per row too: int8 models
  switch to `samctl_rowwise` (decode/engine/attention.py).

It knows modules and tensors, not decoding. `linear_backend(model)` names what a model runs with,
so that measured costs can be kept per backend.
"""
from __future__ import annotations

import torch
from torch import nn

from samctl.decode.engine.attention import use_rowwise_attention
from samctl.index.errors import UserError

QUANTIZE = ("none", "int8")
_BACKEND_ATTR = "_samctl_linear"  # set on the model: "plain", "packed" or "int8"


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
        """The float32 weight [out, in] (for readers such as EAGLE's vocabulary rows), kept once asked."""
        if self._dense is None:
            with torch.inference_mode(False):  # a normal tensor, which autograd may save, even if first asked in inference
                self._dense = self.packed.to_dense()
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] float32 -> [..., out] float32
        if x.requires_grad and torch.is_grad_enabled():  # the oneDNN op has no backward (EAGLE training)
            return nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int8Linear(nn.Module):
    """nn.Linear as int8 weights (a scale per output channel) times int8 activations (a scale per row)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        qweight = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("qweight_t", qweight.t().contiguous())  # [in, out] int8, as _int_mm takes it
        self.register_buffer("scale", scale)  # [out] float32
        self.bias = linear.bias
        self._dense: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] float32 (the weights this layer really multiplies by)."""
        if self._dense is None:
            with torch.inference_mode(False):
                self._dense = self.qweight_t.t().float() * self.scale[:, None]
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] float -> [..., out] in x's dtype. Each op counts: a decode step runs this 211
        # times on one row (SmolLM2), where a call costs more than its arithmetic, so in-place ops
        # and no no-op casts.
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            rows = rows.float()
        # [r, 1]; vector_norm(inf) is 5x slower at 8 rows
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny).div_(127.0)
        # |rows / row_scale| <= 127 up to rounding, so no clamp is needed before the cast
        xq = torch.div(rows, row_scale).round_().to(torch.int8)
        y = torch.mul(torch._int_mm(xq, self.qweight_t), row_scale).mul_(self.scale)  # [r, out] float32
        if self.bias is not None:
            y = y.add_(self.bias)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def apply_cpu_linear(model: nn.Module, quantize: str = "none", prepack: bool = True) -> nn.Module:
    """Swap the model's nn.Linear layers in place for the chosen CPU backend; returns the model.
    quantize "int8": Int8Linear everywhere; "none" with prepack: PackedLinear (float32 models);
    otherwise the model is left as it is. Only on a CPU: elsewhere "int8" is refused."""
    if quantize not in QUANTIZE:
        raise UserError(f"--quantize {quantize!r}: choose one of {', '.join(QUANTIZE)}")
    device = next(model.parameters()).device
    if device.type != "cpu":
        if quantize != "none":
            raise UserError(f"--quantize {quantize} runs on the CPU only: drop it, or pass --device cpu")
        return model
    if quantize == "int8":
        backend, swap = "int8", Int8Linear
    elif prepack and next(model.parameters()).dtype == torch.float32 and torch.backends.mkldnn.is_available():
        backend, swap = "packed", PackedLinear
    else:
        return model
    _replace_linears(model, swap)
    if backend == "int8":
        # exact per row needs attention exact per row too (decode/engine/attention.py)
        use_rowwise_attention(model)
    setattr(model, _BACKEND_ATTR, backend)
    return model


def linear_backend(model: nn.Module) -> str:
    """"plain", "packed" or "int8": what the model's linear layers run with."""
    return getattr(model, _BACKEND_ATTR, "plain")


@torch.no_grad()
def _replace_linears(model: nn.Module, swap: type[nn.Module]) -> None:
    # Collected first: replacing children while iterating named_modules would skip some.
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, swap(child))
