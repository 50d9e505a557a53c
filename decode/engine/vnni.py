"""Exact int8 sums for a few rows at once on CPUs with AVX512-VNNI, one pass over the weight.

A verify step multiplies 2-16 rows by every weight of the model. oneDNN's int8 GEMM does that at
the memory bound, but each call costs ~15 us of setup beside a ~5 us kernel (SmolLM2's 576 x 576
projection at 2 rows), and a step makes 121 of them: ~2 ms of a ~7 ms one-row step. This kernel is
the loop such GEMMs run inside, compiled by numba with no setup: the weight is packed once into
blocks of 16 output columns x 4 inputs (64 bytes, one vector), and for each block

    acc[r] = -128 * sum_k w[n, k]                        (the zero point of the codes, folded)
    acc[r] += vpdpbusd(u8 codes[r, 4k..4k+3] broadcast, w block)   for every 4 inputs, r < 8 rows

so a block is loaded once for up to 8 rows, and the int32 sums are exact (products of at most
255 x 127, four to a lane, never saturate; the zero point is subtracted in integers). The codes are
the uint8 ones oneDNN takes (xq + 128), so a layer's code format does not depend on the kernel.

`vpdpbusd` comes from LLVM's x86 intrinsic through a numba `intrinsic` on a 16 x int32 vector
type, so the kernel runs only where `has_vnni()` (cpu_linear's probe also checks its sums). One
thread: with more, torch's own kernels split the work and are used instead (`Int8Linear.kernel`).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

ROWS = 8  # rows a block serves per pass over the weight
COLUMNS, DEPTH = 16, 4  # a packed block: 16 output columns x 4 inputs, 64 bytes
MAX_ROWS = 16  # beyond this many rows oneDNN's GEMM, which blocks for cache, is used instead


class _Lanes(types.Type):
    """16 int32 lanes in one AVX-512 register (LLVM's <16 x i32>)."""

    def __init__(self) -> None:
        super().__init__(name="lanes16i32")


lanes = _Lanes()
_VECTOR = ir.VectorType(ir.IntType(32), 16)


@register_model(_Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, _VECTOR)


@intrinsic
def load_lanes(typingctx, array, offset):
    """64 bytes of a 1-d contiguous array from element `offset` on, as 16 int32 lanes."""

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), _VECTOR.as_pointer())
        return builder.load(pointer, align=1)

    return lanes(array, types.intp), codegen


@intrinsic
def store_lanes(typingctx, array, offset, value):
    """16 int32 lanes into a 1-d contiguous int32 array from element `offset` on."""

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), _VECTOR.as_pointer())
        builder.store(args[2], pointer, align=4)
        return context.get_dummy_value()

    return types.void(array, types.intp, lanes), codegen


@intrinsic
def dot_bytes(typingctx, acc, codes, block):
    """acc[j] += sum_i u8(codes byte i) * s8(block byte 4j + i), i < 4: vpdpbusd with the four
    codes (one int32) broadcast to every lane."""

    def codegen(context, builder, sig, args):
        acc, word, block = args
        spread = builder.insert_element(ir.Constant(_VECTOR, None), word, ir.Constant(ir.IntType(32), 0))
        spread = builder.shuffle_vector(spread, ir.Constant(_VECTOR, None), ir.Constant(_VECTOR, [0] * 16))
        kind = ir.FunctionType(_VECTOR, [_VECTOR, _VECTOR, _VECTOR])
        function = cgutils.get_or_insert_function(builder.module, kind, "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(function, [acc, spread, block])

    return lanes(lanes, types.int32, lanes), codegen


@njit(cache=True)
def vnni_sums(words, packed, base, out):
    """words [r, in / 4] int32 (the uint8 codes xq + 128, four to a word); packed: the weight as
    `pack_weight` lays it out; base [out] int32 = -128 * the weight's row sums -> out [r, out]
    int32 = sum_k xq[r, k] * w[n, k], exact. Rows in groups of ROWS, each group one weight pass."""
    rows, depth = words.shape
    for first in range(0, rows, ROWS):
        _group(words, packed, base, out, first, min(ROWS, rows - first), depth)


@njit(cache=True)
def _group(words, packed, base, out, first, count, depth):
    # rows first .. first + count - 1 (count <= 8): eight accumulators, the unused ones idle
    for block in range(out.shape[1] // COLUMNS):
        column = block * COLUMNS
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = load_lanes(base, column)
        start = block * depth * COLUMNS * DEPTH
        for k in range(depth):
            w = load_lanes(packed, start + k * COLUMNS * DEPTH)
            a0 = dot_bytes(a0, words[first, k], w)
            if count > 1:
                a1 = dot_bytes(a1, words[first + 1, k], w)
            if count > 2:
                a2 = dot_bytes(a2, words[first + 2, k], w)
            if count > 3:
                a3 = dot_bytes(a3, words[first + 3, k], w)
            if count > 4:
                a4 = dot_bytes(a4, words[first + 4, k], w)
            if count > 5:
                a5 = dot_bytes(a5, words[first + 5, k], w)
            if count > 6:
                a6 = dot_bytes(a6, words[first + 6, k], w)
            if count > 7:
                a7 = dot_bytes(a7, words[first + 7, k], w)
        for r, acc in enumerate((a0, a1, a2, a3, a4, a5, a6, a7)):
            if r < count:
                store_lanes(out[first + r], column, acc)


def pack_weight(qweight: np.ndarray) -> np.ndarray:
    """qweight [out, in] int8, out a multiple of 16 and in of 4 -> [out / 16 * in / 4 * 64] int8:
    block (n / 16, k / 4) holds w[n..n+15, k..k+3] column by column, the layout `vnni_sums` loads
    one vector at a time."""
    out, depth = qweight.shape
    blocks = qweight.reshape(out // COLUMNS, COLUMNS, depth // DEPTH, DEPTH).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(blocks).reshape(-1)


def has_vnni() -> bool:
    """Whether this CPU runs AVX512-VNNI (and AVX-512 registers), by LLVM's reading of it."""
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    return all(features.get(name, False) for name in ("avx512vnni", "avx512f", "avx512bw"))


class VnniGemm:
    """One int8 weight [out, in] packed for `vnni_sums`, with its zero-point term. A shape off
    the blocks is padded with zero weights (out to a multiple of 16, in to one of 4), and codes
    whose width is off are copied into a row padded with the zero point."""

    def __init__(self, qweight: np.ndarray) -> None:
        out, depth = qweight.shape
        self.out_features, self.in_features = out, depth
        padded = np.zeros((-(-out // COLUMNS) * COLUMNS, -(-depth // DEPTH) * DEPTH), dtype=np.int8)
        padded[:out, :depth] = qweight
        self.packed = pack_weight(padded)
        self.base = (-128 * padded.astype(np.int32).sum(axis=1)).astype(np.int32)

    @property
    def aligned(self) -> bool:
        """Whether codes [r, in] are taken as they are (in a multiple of 4), with no copy."""
        return self.in_features % DEPTH == 0

    def __call__(self, codes: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        # codes [r, in] uint8 (xq + 128), C-contiguous; out [r, padded out] int32 or None
        # -> [r, out] int32 (a view of out): the exact sums
        if out is None:
            out = np.empty((len(codes), len(self.base)), dtype=np.int32)
        if not self.aligned:
            wide = np.full((len(codes), len(self.packed) // len(self.base)), 128, dtype=np.uint8)
            wide[:, : self.in_features] = codes
            codes = wide
        vnni_sums(codes.view(np.int32), self.packed, self.base, out)
        return out[:, : self.out_features]
