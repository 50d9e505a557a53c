"""samctl's own exact int8 GEMM for a few rows at once: one pass over the weight for 8 rows.

A verify step multiplies 2-16 rows by every weight of the model; oneDNN's int8 GEMM costs ~15 us of
setup per call beside a ~5 us kernel, 121 calls a step (~2.5 ms of a ~6 ms one-row step), and on
CPUs without VNNI neither it nor `_int_mm` is exact. These kernels are the loop such GEMMs run
inside, compiled by numba with no setup. The weight is packed once into blocks of one vector
(columns x depth inputs, `vectors.VECTORS`), and for each block and each row r < 8

    acc[r] = base                                    (VNNI: -128 * sum_k w[n, k], the zero point)
    acc[r] += block x (the row's `depth` codes, broadcast)     for every `depth` inputs

so a block is loaded once for up to 8 rows, while the weight `AHEAD` bytes on is asked for
(`prefetch`). Two kernels, one loop (`_group`), the lanes' type picking the instructions:

- `vnni`: AVX512-VNNI's `vpdpbusd` on 16 x int32 lanes, blocks of 16 columns x 4 inputs; codes
  are uint8 (xq + 128, as oneDNN takes them), sums of 4 products of at most 255 x 127 a lane.
- `avx2`: AVX2's `vpmaddwd` on 8 x int32 lanes, blocks of 8 columns x 2 inputs held as int8 and
  sign-extended to int16 in the register; codes are int16 (xq). Pairs of 127 x 127 products
  never saturate 32 bits, so the sums are exact on CPUs where 8-bit products are not.

Either way the int32 sums are exact, so a row's result does not depend on the kernel. They run on
one thread; `Int8Linear.kernel` says when torch's kernels are used instead.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from samctl.decode.engine.vectors import VECTORS, Lanes, llvm_call, load, pointer, shape_of, spread, store, zeros

GROUP = 8  # rows a block serves per pass over the weight
# Bytes of the weight asked for ahead of the block being multiplied (`prefetch`): a model's weight
# is read once a step, in order, from memory, and at 8 rows the arithmetic left the hardware's
# prefetcher too few requests in flight (SmolLM2's 8-row int8 verify: 11 -> 9 ms on one thread).
AHEAD = 16384
MAX_ROWS = 16  # beyond this many rows torch's GEMMs, which block for cache, are used (where not the split)


_WORDS = ir.VectorType(ir.IntType(16), 16)  # a ymm register as 16 int16


@intrinsic
def load_block(typingctx, packed, offset, like):
    """The packed weight block at byte `offset` of a 1-d contiguous int8 array: 64 bytes as they
    are (16 lanes), or 16 bytes sign-extended to 16 int16 (8 lanes: lane j the pair 2j, 2j + 1)."""

    def codegen(context, builder, sig, args):
        if like.count == 16:
            return builder.load(pointer(context, builder, sig.args[0], args[0], args[1], like.vector), align=1)
        bytes16 = ir.VectorType(ir.IntType(8), 16)
        loaded = builder.load(pointer(context, builder, sig.args[0], args[0], args[1], bytes16), align=1)
        return builder.bitcast(builder.sext(loaded, _WORDS), like.vector)

    return like(packed, types.intp, like), codegen


@intrinsic
def prefetch(typingctx, packed, offset):
    """A hint that the cache line at byte `offset` of a 1-d contiguous int8 array is read soon."""

    def codegen(context, builder, sig, args):
        address = pointer(context, builder, sig.args[0], args[0], args[1], ir.IntType(8))
        i32 = ir.IntType(32)
        # a read (0), kept in every cache level (3), of data (1)
        llvm_call(builder, "llvm.prefetch.p0", ir.VoidType(), [address, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(packed, types.intp), codegen


@intrinsic
def dot(typingctx, acc, codes, block):
    """acc[j] += the products of one word of codes (in every lane) with lane j of the block:
    16 lanes, `vpdpbusd` (4 uint8 codes x 4 int8 weights); 8 lanes, `vpmaddwd` then an add
    (2 int16 codes x 2 int16 weights)."""

    def codegen(context, builder, sig, args):
        words = spread(builder, args[1], acc.vector)
        if acc.count == 16:
            return llvm_call(builder, "llvm.x86.avx512.vpdpbusd.512", acc.vector, [args[0], words, args[2]])
        pairs = llvm_call(builder, "llvm.x86.avx2.pmadd.wd", acc.vector,
                          [builder.bitcast(words, _WORDS), builder.bitcast(args[2], _WORDS)])
        return builder.add(args[0], pairs)

    return acc(acc, types.int32, acc), codegen


@njit(cache=True)
def vnni_sums(words, packed, base, out):
    """words [r, in / 4] int32 (uint8 codes xq + 128, four to a word); packed: the weight as
    `pack_weight(w, 16, 4)` lays it out; base [out] int32 = -128 * the weight's row sums
    -> out [r, out] int32 = sum_k xq[r, k] * w[n, k]."""
    _sums(words, packed, base, out, zeros("vnni"))


@njit(cache=True)
def avx2_sums(words, packed, base, out):
    """words [r, in / 2] int32 (int16 codes xq, two to a word); packed: the weight as
    `pack_weight(w, 8, 2)` lays it out; base [out] int32 zeros (no zero point) -> out [r, out]
    int32 = sum_k xq[r, k] * w[n, k]."""
    _sums(words, packed, base, out, zeros("avx2"))


@njit(cache=True)
def _sums(words, packed, base, out, like):
    # The loop of both kernels, `like`'s lanes picking the instructions: rows in groups of 8, one
    # weight pass each.
    for first in range(0, words.shape[0], GROUP):
        _group(words, packed, base, out, like, first, min(GROUP, words.shape[0] - first))


@njit(cache=True)
def _group(words, packed, base, out, like, first, count):
    # rows first .. first + count - 1 (count <= 8): eight accumulators, the unused ones idle
    columns, depth = shape_of(like)
    size = columns * depth  # bytes of a block
    inputs = words.shape[1]
    for block in range(out.shape[1] // columns):
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = load(base, block * columns, like)
        start = block * inputs * size
        for k in range(inputs):
            w = load_block(packed, start + k * size, like)
            prefetch(packed, start + k * size + AHEAD)
            a0 = dot(a0, words[first, k], w)
            if count > 1:
                a1 = dot(a1, words[first + 1, k], w)
            if count > 2:
                a2 = dot(a2, words[first + 2, k], w)
            if count > 3:
                a3 = dot(a3, words[first + 3, k], w)
            if count > 4:
                a4 = dot(a4, words[first + 4, k], w)
            if count > 5:
                a5 = dot(a5, words[first + 5, k], w)
            if count > 6:
                a6 = dot(a6, words[first + 6, k], w)
            if count > 7:
                a7 = dot(a7, words[first + 7, k], w)
        for r, acc in enumerate((a0, a1, a2, a3, a4, a5, a6, a7)):
            if r < count:
                store(out[first + r], block * columns, acc)


class Kernel(NamedTuple):
    name: str
    lanes: Lanes  # a block: lanes.count output columns x lanes.depth inputs (codes to a word)
    codes: type  # dtype of the codes it takes
    zero: int  # their zero point
    sums: object  # the njit function (words, packed, base, out)


KERNELS = {"vnni": Kernel("vnni", VECTORS["vnni"], np.uint8, 128, vnni_sums),
           "avx2": Kernel("avx2", VECTORS["avx2"], np.int16, 0, avx2_sums)}


def pack_weight(qweight: np.ndarray, columns: int, depth: int) -> np.ndarray:
    """qweight [out, in] int8, out a multiple of `columns` and in of `depth` -> [out * in] int8:
    block (n / columns, k / depth) holds w[n..n+columns-1, k..k+depth-1] column by column, the
    layout the kernels load one vector at a time."""
    out, inputs = qweight.shape
    blocks = qweight.reshape(out // columns, columns, inputs // depth, depth).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(blocks).reshape(-1)


def cpu_kernel() -> str:
    """The kernel numba compiles for here: "vnni", "avx2" or "" (neither), by LLVM's reading of this
    CPU, or of the features NUMBA_CPU_FEATURES names where NUMBA_CPU_NAME sets another target (a
    cache built for a generic CPU must not meet an instruction that target lacks)."""
    from llvmlite import binding
    from numba.core import config

    if config.CPU_NAME and config.CPU_NAME != "host":
        named = [f for f in (config.CPU_FEATURES or "").split(",") if f]
        features = {f[1:]: f[0] == "+" for f in named}
    else:
        features = binding.get_host_cpu_features()
    if all(features.get(name, False) for name in ("avx512vnni", "avx512f", "avx512bw")):
        return "vnni"
    return "avx2" if features.get("avx2", False) else ""


class RowsGemm:
    """One int8 weight [out, in] packed for a kernel, with its zero-point term. A shape off the
    blocks is padded with zero weights, and codes whose width is off are copied into a row padded
    with the zero point (a zero code)."""

    def __init__(self, qweight: np.ndarray, kernel: str) -> None:
        self.kernel = KERNELS[kernel]
        columns, depth = self.kernel.lanes.count, self.kernel.lanes.depth
        out, inputs = qweight.shape
        self.out_features, self.in_features = out, inputs
        padded = np.zeros((-(-out // columns) * columns, -(-inputs // depth) * depth), dtype=np.int8)
        padded[:out, :inputs] = qweight
        self.packed = pack_weight(padded, columns, depth)
        self.base = (-self.kernel.zero * padded.astype(np.int32).sum(axis=1)).astype(np.int32)

    @property
    def aligned(self) -> bool:
        """Whether codes [r, in] are taken as they are (in a multiple of the block depth)."""
        return self.in_features % self.kernel.lanes.depth == 0

    def words(self, codes: np.ndarray) -> np.ndarray:
        # codes [r, in] of the kernel's dtype, C-contiguous -> [r, padded in / depth] int32 view
        if not self.aligned:
            wide = np.full((len(codes), len(self.packed) // len(self.base)), self.kernel.zero, dtype=codes.dtype)
            wide[:, : self.in_features] = codes
            codes = wide
        return codes.view(np.int32)

    def __call__(self, codes: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        # codes [r, in] of the kernel's format; out [r, padded out] int32 or None
        # -> [r, out] int32 (a view of out): the exact sums
        if out is None:
            out = np.empty((len(codes), len(self.base)), dtype=np.int32)
        self.kernel.sums(self.words(codes), self.packed, self.base, out)
        return out[:, : self.out_features]
