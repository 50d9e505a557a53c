"""The native forward's int8 steps on a CPU: each decoder layer as four integer matmuls with one
compiled call between each two, instead of some thirty torch ops and module calls of a few
microseconds each (at one row they cost as much as a SmolLM2 step's ~17 ms of matmuls). A layer is

    codes = quantize(rms_norm(x))                        `norm_codes`  (x += the last down's output first)
    s = Wqkv codes                                       integer sums (Int8Linear.integer_sums)
    q, k, v = rescale(s); rope; k, v -> the cache;       `attend_codes`
    a = attention (attend_rows); codes = quantize(a)
    s = Wo codes
    x += rescale(s); codes = quantize(rms_norm(x))       `norm_codes`
    s = Wgu codes
    codes = quantize(silu(g) * u), [g, u] = rescale(s)   `gated_codes`
    s = Wdown codes                                      (added to x by the next `norm_codes`)

and the final norm's output goes to the output head. Where every projection runs samctl's own
int8 kernel (decode/engine/int8_gemm.py), the whole layer loop is one compiled call (`own_layers`).
Every step is the op-by-op forward's formula, per row and in the same order, except silu
(`silu_times`, from exp(-|g|) so that it vectorizes: it may differ from torch's in the last bit):
a row's result depends on that row alone, so every verified row equals a one-token step bit for
bit. Prefills (no cached keys) stay on the op-by-op forward.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from samctl.decode.engine.attention import attend_rows, exp_nonpositive, visible_keys
from samctl.decode.engine.cpu_linear import CODE_FORMATS, Int8Linear, quantize_row, quantize_rows, rescale_row
from samctl.decode.engine.int8_gemm import KERNELS


class Int8Forward:
    """The layers of a NativeForward whose projections are all Int8Linear (see the module
    docstring); called by it for every forward over cached keys."""

    def __init__(self, native) -> None:
        self.native = native
        self.eps = np.float32(native.shape.eps)
        self.layers = [_Layer(layer) for layer in native.layers]
        self.norm = native.norm.detach().numpy()
        self.scaling = np.float32(native.scaling)
        self.stack = _Stack.of(self.layers)

    @staticmethod
    def supports(native) -> bool:
        return all(isinstance(p, Int8Linear) for layer in native.layers
                   for p in (layer.qkv, layer.o, layer.gate_up, layer.down))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                 cache) -> torch.Tensor:
        # x: [A, q, H] the embedded inputs (overwritten); cos, sin: [A, q, 1, D] (native._table);
        # mask: [A or 1, 1, q, kv] or None (causal); cache: a BatchedKVCache in write mode
        # -> the final norm's output [A * q, H]
        shape, eps = self.native.shape, self.eps
        rows, n, width = x.shape
        flat = x.reshape(-1, width).numpy()
        storage = cache.storage.numpy()  # [2, layers, B, Hkv, capacity, D]
        write = cache.write_positions.numpy()
        index, counts = visible_keys(mask, rows, n, cache.kv_length)
        cos, sin = cos.reshape(rows, n, -1).numpy(), sin.reshape(rows, n, -1).numpy()
        kernel = self.layers[0].projections[0].kernel(len(flat))  # every layer's: see Int8Linear.kernel
        dtype, zero = CODE_FORMATS[kernel]
        queries = np.empty((rows, shape.heads, n, shape.head_dim), dtype=np.float32)
        attended = np.empty((rows, n, shape.heads, shape.head_dim), dtype=np.float32)
        codes_x = np.empty((len(flat), width), dtype=dtype)  # each matmul's input codes
        codes_a = np.empty((len(flat), shape.heads * shape.head_dim), dtype=dtype)
        codes_i = np.empty((len(flat), self.layers[0].inner), dtype=dtype)
        # each row's scale: each kernel reads a row's scale before it writes that row's new one
        row_scale = np.empty(len(flat), dtype=np.float32)
        hidden = np.empty_like(flat)
        if kernel in KERNELS and self.stack is not None:  # every layer in one compiled call
            st = self.stack
            words = tuple(c.view(np.int32) for c in (codes_x, codes_a, codes_i))
            out = tuple(np.empty((len(flat), len(b[0])), dtype=np.int32) for b in st.base)
            own_layers(KERNELS[kernel].sums, words, st.packed, st.base, st.scale, st.bias, out, st.norms, st.qk_norms,
                       self.norm, eps, flat, hidden, (codes_x, codes_a, codes_i), row_scale, zero, storage, rows,
                       write, index, counts, cos, sin, self.scaling, queries, attended)
            return torch.from_numpy(hidden)
        sums_of = _Sums(self.layers[0], (codes_x, codes_a, codes_i), kernel)
        sums, (scale, bias) = _NONE, (_EMPTY, _EMPTY)  # the last down projection's, added to x next
        for i, layer in enumerate(self.layers):
            norm_codes(flat, sums, row_scale, scale, bias, layer.norm_in, eps, hidden, codes_x, row_scale, zero)
            attend_codes(sums_of(layer, 0), row_scale, *layer.scales[0], cos, sin,
                         layer.q_norm, layer.k_norm, eps, storage[0, i, :rows], storage[1, i, :rows], write, index,
                         counts, self.scaling, queries, attended, codes_a, row_scale, zero)
            norm_codes(flat, sums_of(layer, 1), row_scale, *layer.scales[1], layer.norm_post, eps,
                       hidden, codes_x, row_scale, zero)
            gated_codes(sums_of(layer, 2), row_scale, *layer.scales[2], codes_i, row_scale, zero)
            sums, (scale, bias) = sums_of(layer, 3), layer.scales[3]
        norm_codes(flat, sums, row_scale, scale, bias, self.norm, eps, hidden, codes_x[:0], row_scale, zero)
        return torch.from_numpy(hidden)


class _Layer:
    """One NativeLayer's int8 projections (qkv, o, gate_up, down: `projections`, their weights and
    `scales` in that order), with its norm weights as arrays."""

    def __init__(self, layer) -> None:
        self.projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
        self.weights = tuple(p.qweight for p in self.projections)
        self.scales = tuple(p.scales() for p in self.projections)
        self.inner = layer.down.in_features
        self.norm_in = layer.norm_in.detach().numpy()
        self.norm_post = layer.norm_post.detach().numpy()
        self.q_norm = _EMPTY if layer.q_norm is None else layer.q_norm.detach().numpy()
        self.k_norm = _EMPTY if layer.k_norm is None else layer.k_norm.detach().numpy()


class _Stack:
    """The layers' arrays stacked [layers, ...] for `own_layers`, where every projection has
    samctl's own kernel (int8_gemm.RowsGemm) with inputs a multiple of its block depth: per
    projection (qkv, o, gate_up, down) the packed weights, zero-point terms, scales and biases;
    the norm weights. Each RowsGemm's packed weight becomes a view of its row here (held once)."""

    def __init__(self, layers: list[_Layer]) -> None:
        gemms = [[p.rows_gemm for p in layer.projections] for layer in layers]
        self.packed = tuple(np.stack([g[j].packed for g in gemms]) for j in range(4))
        for i, g in enumerate(gemms):
            for j in range(4):
                g[j].packed = self.packed[j][i]
        self.base = tuple(np.stack([g[j].base for g in gemms]) for j in range(4))
        self.scale = tuple(np.stack([layer.scales[j][0] for layer in layers]) for j in range(4))
        self.bias = tuple(np.stack([layer.scales[j][1] for layer in layers]) for j in range(4))
        self.norms = (np.stack([layer.norm_in for layer in layers]), np.stack([layer.norm_post for layer in layers]))
        self.qk_norms = (np.stack([layer.q_norm for layer in layers]), np.stack([layer.k_norm for layer in layers]))

    @classmethod
    def of(cls, layers: list[_Layer]) -> _Stack | None:
        projections = [p for layer in layers for p in layer.projections]
        if all(p.rows_gemm is not None and p.rows_gemm.aligned for p in projections):
            return cls(layers)
        return None


@njit(cache=True, error_model="numpy")
def own_layers(sums, words, packed, base, scale, bias, out, norms, qk_norms, final, eps, flat, hidden, codes,
               row_scale, zero, storage, rows, write, index, counts, cos, sin, softmax_scale, queries, attended):
    """`Int8Forward.__call__`'s layer loop in one compiled call, the integer sums by `sums`
    (int8_gemm.vnni_sums or avx2_sums) into out [4][rows, padded out]: no Python between the
    ~250 kernels of a step. Arrays as `_Stack` holds them; words: the codes as int32 words."""
    codes_x, codes_a, codes_i = codes
    width = (scale[0].shape[1], scale[1].shape[1], scale[2].shape[1], scale[3].shape[1])
    down = out[3][:, : width[3]]
    layers = packed[0].shape[0]
    for i in range(layers):  # the last down projection's sums are added to x first (none before layer 0)
        norm_codes(flat, down if i else down[:0], row_scale, scale[3][i - 1], bias[3][i - 1], norms[0][i], eps,
                   hidden, codes_x, row_scale, zero)
        sums(words[0], packed[0][i], base[0][i], out[0])
        attend_codes(out[0][:, : width[0]], row_scale, scale[0][i], bias[0][i], cos, sin, qk_norms[0][i],
                     qk_norms[1][i], eps, storage[0, i, :rows], storage[1, i, :rows], write, index, counts,
                     softmax_scale, queries, attended, codes_a, row_scale, zero)
        sums(words[1], packed[1][i], base[1][i], out[1])
        norm_codes(flat, out[1][:, : width[1]], row_scale, scale[1][i], bias[1][i], norms[1][i], eps, hidden,
                   codes_x, row_scale, zero)
        sums(words[0], packed[2][i], base[2][i], out[2])
        gated_codes(out[2][:, : width[2]], row_scale, scale[2][i], bias[2][i], codes_i, row_scale, zero)
        sums(words[2], packed[3][i], base[3][i], out[3])
    norm_codes(flat, down, row_scale, scale[3][layers - 1], bias[3][layers - 1], final, eps, hidden, codes_x[:0],
               row_scale, zero)


class _Sums:
    """One forward's integer sums [rows, out] of a layer's projection j (as `_Layer` orders them) over
    its input codes. With `_int_mm` (one row) the int32 outputs and the input views are made once a
    forward, so each call is the matmul alone (converting around it cost ~10 us a call, 121 a step);
    other kernels go through Int8Linear.integer_sums."""

    INPUT = (0, 1, 0, 2)  # the codes each projection reads

    def __init__(self, first: _Layer, codes: tuple[np.ndarray, ...], kernel: str) -> None:
        self.codes, self.kernel = codes, kernel
        rows = len(codes[0])
        if kernel == "int_mm":
            self.inputs = [torch.from_numpy(c).t() for c in codes]  # [in, rows] views
            self.out = [torch.empty(p.out_features, rows, dtype=torch.int32) for p in first.projections]
            self.arrays = [o.numpy().T for o in self.out]  # [rows, out] views
        else:
            self.kernel = "general"

    def __call__(self, layer: _Layer, j: int) -> np.ndarray:
        if self.kernel == "int_mm":
            torch._int_mm(layer.weights[j], self.inputs[self.INPUT[j]], out=self.out[j])
            return self.arrays[j]
        return layer.projections[j].integer_sums(self.codes[self.INPUT[j]]).numpy()


_EMPTY = np.zeros(0, dtype=np.float32)
_NONE = np.zeros((0, 0), dtype=np.int32)


# error_model="numpy" as in cpu_linear: a division's zero check would keep its loop scalar
@njit(cache=True, error_model="numpy")
def rms_norm_rows(rows, weight, eps, out):
    """out[i] = rows[i] / sqrt(mean(rows[i]^2) + eps) * weight in float32, rows [r, n], each row's
    squares summed in order: a row's result never depends on the others. Four rows' sums run side
    by side, so that a row's adds overlap the others' instead of each waiting on the last."""
    last, n = rows.shape[0] - 1, rows.shape[1]
    for i in range(0, last + 1, 4):
        a, b, c, d = i, min(i + 1, last), min(i + 2, last), min(i + 3, last)  # the last row again past r
        ta = tb = tc = td = np.float32(0.0)
        for k in range(n):
            ta += rows[a, k] * rows[a, k]
            tb += rows[b, k] * rows[b, k]
            tc += rows[c, k] * rows[c, k]
            td += rows[d, k] * rows[d, k]
        totals = (ta, tb, tc, td)
        for j in range(i, min(i + 4, last + 1)):
            inverse = np.float32(1.0) / np.sqrt(totals[j - i] / np.float32(n) + eps)
            for k in range(n):
                out[j, k] = rows[j, k] * inverse * weight[k]


@njit(cache=True, error_model="numpy")
def norm_codes(x, sums, sums_scale, scale, bias, weight, eps, hidden, codes, row_scale, zero):
    """Per row i: x[i] += rescale_row(sums[i]) when sums has rows; hidden[i] = rms_norm(x[i]);
    codes[i], row_scale[i] = its int8 codes when codes has rows."""
    add = np.empty(x.shape[1], dtype=np.float32)
    for i in range(sums.shape[0]):
        rescale_row(sums[i], sums_scale[i], scale, bias, add)
        for k in range(x.shape[1]):
            x[i, k] = x[i, k] + add[k]
    rms_norm_rows(x, weight, eps, hidden)
    quantize_rows(hidden[: codes.shape[0]], codes, row_scale, zero)


@njit(cache=True, error_model="numpy")
def attend_codes(sums, sums_scale, scale, bias, cos, sin, q_norm, k_norm, eps, keys, values, write, index, counts,
                 softmax_scale, queries, attended, codes, row_scale, zero):
    """The attention block of rows [A * q] of q, k, v integer sums: each rescaled, q and k
    normalized per head when their norms are given (Qwen3) and rotated (x * cos + rotate_half(x)
    * sin, sin's first half negated), k and v written to the cache at `write` [A, q], then every
    row attends (`attend_rows`: keys [A, Hkv, capacity, D]) and its output [Hq * D] is quantized."""
    rows, n, heads, dim = attended.shape
    kv_heads = keys.shape[1]
    half = dim // 2
    qkv = np.empty(sums.shape[1], dtype=np.float32)
    head = np.empty(dim, dtype=np.float32)
    for b in range(rows):
        for i in range(n):
            r = b * n + i
            rescale_row(sums[r], sums_scale[r], scale, bias, qkv)
            for h in range(heads + 2 * kv_heads):
                part = qkv[h * dim : (h + 1) * dim]
                if h >= heads + kv_heads:  # v, copied in a loop (an array assignment costs more than the copy)
                    value = values[b, h - heads - kv_heads, write[b, i]]
                    for d in range(dim):
                        value[d] = part[d]
                    continue
                norm = q_norm if h < heads else k_norm
                if len(norm):
                    rms_norm_rows(part[None], norm, eps, head[None])
                    part = head
                out = queries[b, h, i] if h < heads else keys[b, h - heads, write[b, i]]
                for d in range(half):  # two loops, not an index mod dim: they vectorize
                    out[d] = part[d] * cos[b, i, d] + part[d + half] * sin[b, i, d]
                for d in range(half, dim):
                    out[d] = part[d] * cos[b, i, d] + part[d - half] * sin[b, i, d]
    attend_rows(queries, keys, values, index, counts, softmax_scale, attended)
    quantize_rows(attended.reshape(rows * n, heads * dim), codes, row_scale, zero)


@njit(cache=True, error_model="numpy")
def gated_codes(sums, sums_scale, scale, bias, codes, row_scale, zero):
    """Per row: [g, u] = rescale_row(sums), codes = quantize(silu(g) * u)."""
    inner = codes.shape[1]
    gate_up = np.empty(sums.shape[1], dtype=np.float32)
    act = np.empty(inner, dtype=np.float32)
    for r in range(sums.shape[0]):
        rescale_row(sums[r], sums_scale[r], scale, bias, gate_up)
        silu_times(gate_up[:inner], gate_up[inner:], act)
        row_scale[r] = quantize_row(act, codes[r], zero)


@njit(cache=True, error_model="numpy")
def silu_times(g, u, out):
    """out = silu(g) * u, silu(g) = g / (1 + exp(-g)) computed from e = exp(-|g|): g / (1 + e) for
    g >= 0, g e / (1 + e) below. e comes from `exp_nonpositive` in a loop of its own, which
    vectorizes (in one loop with the selects it does not: 8x slower than libm's exp)."""
    for k in range(g.shape[0]):
        out[k] = exp_nonpositive(-abs(g[k]))
    for k in range(g.shape[0]):
        e = out[k]
        out[k] = (g[k] if g[k] >= np.float32(0.0) else g[k] * e) / (np.float32(1.0) + e) * u[k]
