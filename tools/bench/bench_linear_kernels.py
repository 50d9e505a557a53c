"""CPU kernels for SmolLM2-135M's 210 linear layers (random weights of its shapes), one thread.

For each candidate: the largest difference between a row computed alone (or among 3, 8, 17 rows)
and the same row among 64 (0 = bitwise row independent), and the time of all 210 layers at
1, 8, 16 and 64 rows (fastest of 5). Candidates: plain F.linear (MKL), oneDNN prepacked float32
(`mkldnn._linear_pointwise`), MKL prepacked (`mkl._mkl_linear`), int8 with per-row activation
scales through `torch._int_mm` or oneDNN's `qlinear_pointwise`, weight-only int8
(`_weight_int8pack_mm`), fbgemm's dynamic int8 (per-tensor activation scale), `_int_mm` with the
weight on the left (`int_mm_gemv`: weight [out, in] times rows^T) and samctl's own `Int8Linear`
(`samctl_int8`: that gemv for one row, oneDNN's GEMM for several).

    python tools/bench/bench_linear_kernels.py [layers=30] [candidates=plain,mkldnn_pp,...] [fused]

`fused`: the shapes an int8 SmolLM2 runs (q/k/v and gate/up stacked, as `FusedLinear` runs them)
and its output head (49152 x 576), instead of the model's 7 separate projections.
"""
from __future__ import annotations

import sys
import time

import torch

H, I = 576, 1536
SHAPES = [(H, H), (192, H), (192, H), (H, H), (I, H), (I, H), (H, I)]  # q, k, v, o, gate, up, down
FUSED = [(H + 2 * 192, H), (H, H), (2 * I, H), (H, I)]  # qkv, o, gate+up, down
HEAD = (49152, H)


def q_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.abs().amax(1).clamp_min(1e-12) / 127
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s


def q_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(x / s).clamp(-127, 127).to(torch.int8), s


def plain(w):
    return lambda x: torch.nn.functional.linear(x, w)


def mkldnn_pp(w):
    p = torch.ops.mkldnn._reorder_linear_weight(w, None)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")


def mkl_pp(w):
    p = torch.ops.mkl._mkl_reorder_linear_weight(w, 8)
    return lambda x: torch.ops.mkl._mkl_linear(x, p, w, None, 8)


def int_mm(w):
    wq, s = q_weight(w)
    wt = wq.t().contiguous()

    def f(x):
        xq, xs = q_rows(x)
        return torch._int_mm(xq, wt).float() * xs * s
    return f


def int_mm_gemv(w):
    wq, s = q_weight(w)

    def f(x):
        xq, xs = q_rows(x)
        return torch._int_mm(wq, xq.t()).t().float() * xs * s
    return f


def samctl_int8(w):
    from samctl.decode.engine.cpu_linear import Int8Linear

    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data = w
    return Int8Linear(linear)


def onednn_q(w):
    wq, s = q_weight(w)
    p = torch.ops.onednn.qlinear_prepack(wq, None)
    ones, zeros = torch.ones_like(s), torch.zeros(s.shape, dtype=torch.long)

    def f(x):  # u8 activations with a shared zero point 128: still one scale per row
        xq, xs = q_rows(x)
        xu = (xq.to(torch.int16) + 128).to(torch.uint8)
        acc = torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, p, ones, zeros, None, 1.0, 0, torch.float32,
                                                 "none", [], "")
        return acc * xs * s
    return f


def w8pack(w):
    wq, s = q_weight(w)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, wq, s)


def fbgemm_dyn(w):
    torch.backends.quantized.engine = "fbgemm"
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w
    return torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)


@torch.inference_mode()
def timing(fns, weights, rows: int, reps: int = 5) -> float:
    xs = {k: torch.randn(rows, k) for k in (H, I)}
    for f, w in zip(fns, weights):
        f(xs[w.shape[1]])
    best = float("inf")
    for _ in range(reps):
        tic = time.perf_counter()
        for f, w in zip(fns, weights):
            f(xs[w.shape[1]])
        best = min(best, time.perf_counter() - tic)
    return best * 1e3


@torch.inference_mode()
def row_difference(fns, weights) -> float:
    torch.manual_seed(1)
    worst = 0.0
    for f, w in list(zip(fns, weights))[:8]:
        x = torch.randn(64, w.shape[1])
        full = f(x)
        for r in (0, 5, 63):
            for m in (1, 3, 8, 17):
                lo = max(0, r - m + 1)
                worst = max(worst, (f(x[lo : lo + m])[r - lo] - full[r]).abs().max().item())
    return worst


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else \
        ["plain", "mkldnn_pp", "mkl_pp", "int_mm", "onednn_q", "fbgemm_dyn"]  # w8pack: ~10x slower
    fused = len(sys.argv) > 3 and sys.argv[3] == "fused"
    shapes = FUSED if fused else SHAPES
    weights = [torch.randn(n, k) * 0.05 for _ in range(layers) for (n, k) in shapes]
    if fused:
        weights.append(torch.randn(*HEAD) * 0.05)
    for name in names:
        fns = [globals()[name](w) for w in weights]
        t = [timing(fns, weights, m) for m in (1, 8, 16, 64)]
        print(f"{name:11s} row diff {row_difference(fns, weights):.3g}  t(1) {t[0]:.1f}  t(8) {t[1]:.1f}  "
              f"t(16) {t[2]:.1f}  t(64) {t[3]:.1f} ms  t(8)/t(1) {t[1] / t[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
