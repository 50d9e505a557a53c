"""The `native` backend: a Llama-family decoder forward in plain torch, over weights packed once.

transformers' modules dispatch through a dozen Python layers per decoder layer (module calls,
kwargs plumbing, mask builders, attention registries), which at one row on a CPU costs as much as
the arithmetic. This forward is the same model computed with few ops:

    x = embed(ids)                                                   # [A, q, H]
    per layer:  h = rms_norm(x) ; qkv = Wqkv h                       (q, k, v fused: one matmul)
                q, k = rope(q, k) at each input's position           (one cos/sin table, gathered)
                k, v -> the KV cache (the same cache object as the hf backend's, BatchedKVCache,
                        also under CUDA graphs), attention over what it returns
                x = x + Wo attn ; h = rms_norm(x) ; x = x + Wdown (silu(g) * u), [g, u] = Wgu h
    x = rms_norm(x) -> the lm_head on the rows asked for

Supported: Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms), SmolLM (Llama) with
the default, linear, llama3, yarn or longrope RoPE (any type whose cos/sin depend on the position
alone: the table is the model's own rotary module evaluated once). Others (dynamic RoPE, sliding
windows in use, softcaps, other families) fall back to `hf` (`native_refusal` says why).

Numerics: in float32 the fused matmuls and RMSNorm sum in another order than transformers'
separate ones, so logits differ from the hf backend's in the last bits (tested within 1e-4);
greedy decoding is exact with respect to this backend's own plain decoding. int8 models run every
forward over cached keys as decode/engine/int8_forward.py, so every verified row equals a
one-token step bit for bit; their prefills run the op-by-op forward here.

Knows nothing of drafts, trees or acceptance; the caller gives the mask and positions.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from samctl.decode.configs import BACKENDS
from samctl.decode.engine.attention import exact_rows
from samctl.decode.engine.cpu_linear import FusedLinear, linear_backend
from samctl.decode.engine.int8_forward import Int8Forward, rms_norm_rows
from samctl.index.errors import UserError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ATTR = "_samctl_native"  # the NativeForward attached to a model by use_backend
TABLE_GRANULE = 1024  # the RoPE table grows by this many positions at least


def native_refusal(model: nn.Module) -> str:
    """Why the native forward cannot run `model` ("" when it can)."""
    config = model.config
    family = getattr(config, "model_type", "")
    if family not in FAMILIES:
        return f"the native forward covers {', '.join(FAMILIES)}, not {family or 'this model'}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in ROPE_TYPES:
        return f"RoPE type {rope_type} changes with the sequence length"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act}"
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(model, "lm_head"):
        return "no model.model.layers / lm_head"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            return f"{name} is set"
    return ""


class NativeLayer:
    """One decoder layer's weights, packed: [q, k, v] and [gate, up] stacked (one matmul each)."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm_in = layer.input_layernorm.weight
        self.norm_post = layer.post_attention_layernorm.weight
        self.q_norm = getattr(getattr(attn, "q_norm", None), "weight", None)  # Qwen3: per-head RMSNorm
        self.k_norm = getattr(getattr(attn, "k_norm", None), "weight", None)
        self.qkv = _fused(attn, ("q_proj", "k_proj", "v_proj"))
        self.o = attn.o_proj
        self.gate_up = _fused(mlp, ("gate_proj", "up_proj"))
        self.down = mlp.down_proj


def _fused(module: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """The projections `names` of `module` as one layer of their stacked weights. CPU backends
    already hold it (FusedLinear, decode/engine/cpu_linear.py); plain layers (CUDA, bfloat16,
    unpacked float32) are stacked here, and their own weights become views of the stack, so that
    the weights are held once and both backends read the same values."""
    for child in module.children():
        if isinstance(child, FusedLinear) and len(child.parts) == len(names):
            return child.layer
    linears = [getattr(module, name) for name in names]
    if not all(type(l) is nn.Linear for l in linears):
        raise UserError(f"{type(module).__name__}: projections {', '.join(names)} are "
                        f"{', '.join(sorted({type(l).__name__ for l in linears}))}, which the native forward does not stack")
    weight = torch.cat([l.weight.detach() for l in linears])
    # skip_init: no random initialisation (the weights are copied in next; on a GPU it would also
    # draw from the device's generator, which must not move during a graph capture)
    stacked = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=linears[0].bias is not None,
                                 device=weight.device, dtype=weight.dtype)
    stacked.requires_grad_(False)
    with torch.no_grad():
        stacked.weight.copy_(weight)
        if stacked.bias is not None:
            stacked.bias.copy_(torch.cat([l.bias.detach() for l in linears]))
    lo = 0
    for l in linears:  # each projection's weight: its rows of the stack
        hi = lo + l.out_features
        l.weight = nn.Parameter(stacked.weight[lo:hi], requires_grad=l.weight.requires_grad)
        if stacked.bias is not None:
            l.bias = nn.Parameter(stacked.bias[lo:hi], requires_grad=l.bias.requires_grad)
        lo = hi
    return stacked


class NativeForward:
    """The forward of a supported model (see the module docstring); holds no state between calls
    but the RoPE table. Called in place of `model(...)` by the targets."""

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        decoder = model.model
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        self.shape = SimpleNamespace(heads=heads, kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                                     head_dim=head_dim, eps=float(config.rms_norm_eps))
        self.embed = decoder.embed_tokens
        self.layers = [NativeLayer(layer) for layer in decoder.layers[: config.num_hidden_layers]]
        self.norm = decoder.norm.weight
        self.head = model.lm_head
        self.rotary = decoder.rotary_emb
        self.scaling = head_dim ** -0.5
        # int8 (exact rows): every forward over cached keys runs as decode/engine/int8_forward.py
        self.int8 = Int8Forward(self) if exact_rows(model) and Int8Forward.supports(self) else None
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype if param.is_floating_point() else torch.float32
        self._cos = self._sin = torch.empty(0, head_dim, dtype=self.dtype, device=self.device)

    # -- pieces -------------------------------------------------------------------------------

    def _table(self, positions: torch.Tensor, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [A, q] int64 -> cos, sin [A, q, 1, D]: rows of the model's own rotary module,
        # evaluated once for positions [0, n) (cos/sin of position * inv_freq are elementwise, so a
        # table row is bit for bit what the module computes for that position in any forward).
        # sin's first half is stored negated: rope() then needs no negation (exact: a sign flip)
        if upto > self._cos.shape[0]:
            n = -(-upto // TABLE_GRANULE) * TABLE_GRANULE
            probe = torch.empty(1, dtype=self.dtype, device=self.device)
            cos, sin = self.rotary(probe, torch.arange(n, device=self.device)[None])
            half = sin.shape[-1] // 2
            self._cos, self._sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return self._cos[positions][:, :, None], self._sin[positions][:, :, None]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.shape.eps)
        # on a CPU one compiled call: torch's rms_norm is several ops, 25-80 µs at one row
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape)
        rms_norm_rows(rows.numpy(), weight.detach().numpy(), np.float32(self.shape.eps), out.numpy())
        return out.view(x.shape)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [A, q, h, D]; cos, sin: [A, q, 1, D] (sin's first half negated) -> x rotated:
        # x * cos + rotate_half(x) * sin, transformers' convention, rotate_half(x) = [-x2, x1]
        half = x.shape[-1] // 2
        return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # q: [A, Hq, q, D]; k, v: [A, Hkv, kv, D]; mask: [A or 1, 1, q, kv] additive or bool, or None
        # (causal, the inputs being the last q of the kv keys) -> [A, q, Hq * D]
        rows, _, n, _ = q.shape
        # no mask and several inputs: a prefill (n == kv); chains after a cache come with a mask (__call__)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and n > 1,
                                             scale=self.scaling, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).reshape(rows, n, -1)

    # -- the forward --------------------------------------------------------------------------

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask: torch.Tensor | None,
                cache) -> torch.Tensor:
        # x: [A, q, H] embedded inputs; the rest as __call__ takes them -> the last layer's output [A, q, H]
        shape = self.shape
        rows, n, _ = x.shape
        for index, layer in enumerate(self.layers):
            h = self._norm(x, layer.norm_in)
            qkv = layer.qkv(h).view(rows, n, shape.heads + 2 * shape.kv_heads, shape.head_dim)
            if layer.q_norm is None:  # q and k rotated together: one set of ops for both
                qk = self._rope(qkv[:, :, : shape.heads + shape.kv_heads], cos, sin)
                q, k = qk[:, :, : shape.heads], qk[:, :, shape.heads :]
            else:  # Qwen3: each normalized by its own weight first
                q = self._rope(self._norm(qkv[:, :, : shape.heads], layer.q_norm), cos, sin)
                k = self._rope(self._norm(qkv[:, :, shape.heads : shape.heads + shape.kv_heads], layer.k_norm), cos, sin)
            q = q.transpose(1, 2).contiguous()  # [A, Hq, q, D]
            k = k.transpose(1, 2)
            v = qkv[:, :, shape.heads + shape.kv_heads :].transpose(1, 2)
            keys, values = cache.layers[index].update(k, v)
            kv = keys.shape[2]
            if attention_mask is None and 1 < n < kv:  # a chain after cached keys
                # the causal mask, built once per forward: every layer attends the same keys
                attention_mask = torch.ones(n, kv, dtype=torch.bool, device=keys.device).tril_(kv - n)
            x = x + layer.o(self._attend(q, keys, values, attention_mask))
            h = self._norm(x, layer.norm_post)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return x

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 cache, keep: torch.Tensor | int | None = None, upto: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # input_ids, position_ids: [A, q] int64; attention_mask: [A or 1, 1, q, kv] or None (causal);
        # cache: a transformers Cache whose layers[i].update(k [A, Hkv, q, D], v) stores the new
        # entries and returns every key/value the inputs attend; keep: [N] flat indices into
        # A * q of the rows whose logits are wanted, an int n (the last n of each row: 0 = all)
        # or None (all); upto: a bound on the positions, known on the host (None: read from
        # position_ids, a host sync that a CUDA graph cannot hold)
        # -> (logits [N, V], hidden [A * q, H] post-final-norm at every input)
        rows, n = input_ids.shape
        cos, sin = self._table(position_ids, upto if upto is not None else int(position_ids.max()) + 1)
        x = self.embed(input_ids)  # [A, q, H]
        if self.int8 is not None and cache.prefill_rows is None:
            hidden = self.int8(x, cos, sin, attention_mask, cache).view(rows, n, -1)
        else:
            hidden = self._norm(self._layers(x, cos, sin, attention_mask, cache), self.norm)
        if isinstance(keep, int) and keep:
            kept = hidden[:, -keep:].reshape(-1, hidden.shape[-1])
        else:
            kept = hidden.reshape(-1, hidden.shape[-1])
            kept = kept if keep is None or isinstance(keep, int) else kept.index_select(0, keep)
        return self.head(kept), hidden.reshape(-1, hidden.shape[-1])


def use_backend(model: nn.Module, backend: str = "auto") -> str:
    """Attach the forward `backend` asks for to `model` and return the one that runs: "native"
    where supported (auto) or required (native: refused in one line where unsupported), else "hf"."""
    if backend not in BACKENDS:
        raise UserError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    setattr(model, _ATTR, None)
    if backend == "hf":
        return "hf"
    why = native_refusal(model)
    if why:
        if backend == "native":
            raise UserError(f"the native backend cannot run this model ({why}): use the hf backend")
        return "hf"
    setattr(model, _ATTR, NativeForward(model))
    return "native"


def native_of(model: nn.Module) -> NativeForward | None:
    """The native forward attached to `model` by use_backend, or None (the hf backend)."""
    return getattr(model, _ATTR, None)


def backend_name(model: nn.Module) -> str:
    """"native" or "hf", with the linear backend: what a cost curve and a run output are keyed by."""
    return ("native" if native_of(model) is not None else "hf") + "/" + linear_backend(model)
