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
  runs each layer as 8 single steps would. What keeps a whole forward lossless beyond the
  linear layers (attention, norms) is the same as in float32.

It knows modules and tensors, not decoding. `linear_backend(model)` names what a model runs with,
so that measured costs can be kept per backend.
"""
from __future__ import annotations

import torch
from torch import nn

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
        # x: [..., in] float -> [..., out] in x's dtype
        rows = x.reshape(-1, self.in_features).float()
        amax = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True)  # [r, 1]
        row_scale = amax.clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        # |rows / row_scale| <= 127 up to rounding, so no clamp is needed before the cast
        xq = torch.round(rows / row_scale).to(torch.int8)
        y = torch._int_mm(xq, self.qweight_t).float().mul_(row_scale).mul_(self.scale)  # [r, out]
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


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
        _use_rowwise_attention(model)
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


# -- attention one query row at a time -------------------------------------------------------------
# The int8 linears are exact per row, but sdpa over q rows at once sums in another order than over
# one row, and a last-bit difference that crosses an int8 rounding boundary moves an activation by
# a whole quantization step (SmolLM2: verify logits off by up to 4 from single steps). Attending
# one query row at a time over exactly the keys it sees computes every row as a one-token step
# does, so the whole forward is exact per row. A prefill (no cached keys) runs batched, as the
# plain decoder's prefill does: both compute it the same way.
ROWWISE_ATTENTION = "samctl_rowwise"


def rowwise_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    # query: [B, Hq, q, D]; key, value: [B, Hkv, kv, D]; attention_mask: [B, 1, q, kv] bool (True =
    # attend) or additive float (0 = attend), or None (causal: row i sees the first kv - q + i + 1 keys)
    # -> ([B, q, Hq, D], None), as transformers' sdpa_attention_forward returns
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, kv = query.shape[2], key.shape[2]
    if q == kv and q > 1:  # a prefill (no cached keys): run as a plain greedy decoder's prefill runs it
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is not None and attention_mask.shape[0] != 1:
        raise UserError("int8 attention runs one sequence at a time: use batch size 1 with --quantize int8")
    rows = []
    for i in range(q):
        if attention_mask is None:
            keys = slice(0, kv - q + i + 1)
        else:
            seen = attention_mask[0, 0, i, :kv]
            seen = seen if seen.dtype == torch.bool else seen == 0
            index = torch.nonzero(seen)[:, 0]
            n = int(index.numel())
            keys = slice(0, n) if n == 0 or int(index[-1]) == n - 1 else index  # a prefix: a view, no copy
        k, v = key[:, :, keys], value[:, :, keys]
        out, _ = sdpa_attention_forward(module, query[:, :, i : i + 1], k, v, None, dropout=dropout,
                                        scaling=scaling, is_causal=False)
        rows.append(out)
    return torch.cat(rows, dim=1), None


def _use_rowwise_attention(model: nn.Module) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)
    AttentionMaskInterface.register(ROWWISE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(ROWWISE_ATTENTION)
