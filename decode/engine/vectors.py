"""LLVM vector types in numba kernels, through `intrinsic`s: the CPU kernels' one way to name
their registers (decode/engine/int8_gemm.py's int32 lanes, decode/engine/attention.py's floats).

A `Lanes` type is one LLVM vector; a kernel picks its kind by a constant name (`zeros("vnni")`)
and passes the value on, so that the functions it calls are compiled for that kind (`shape_of`,
`zeros_like`), and moves it to and from contiguous arrays by element offsets (`load`, `store`).
Operations on vectors are LLVM's own instructions, written out: no fast-math flag reorders them.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model


class Lanes(types.Type):
    """`count` lanes of `element` in one vector; a kernel's block is `count` output columns x
    `depth` inputs (the int8 kernels' codes of one int32 word; 1 for floats)."""

    def __init__(self, element: ir.Type, count: int, depth: int = 1) -> None:
        self.count, self.depth = count, depth
        self.vector = ir.VectorType(element, count)
        super().__init__(name=f"lanes_{element}x{count}x{depth}")


@register_model(Lanes)
class VectorModel(models.PrimitiveModel):
    """A Lanes value is held as its LLVM vector."""

    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, fe_type.vector)


VECTORS = {
    "vnni": Lanes(ir.IntType(32), 16, 4),  # zmm: the VNNI kernel's (16 columns x 4 uint8 codes)
    "avx2": Lanes(ir.IntType(32), 8, 2),  # ymm: the AVX2 kernel's (8 columns x 2 int16 codes)
    **{f"f32x{count}": Lanes(ir.FloatType(), count) for count in (16, 4, 1)},  # attention's
}


def pointer(context, builder, array_type, array, offset, vector):
    # the address of element `offset` of a contiguous array, as a pointer to `vector`
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), vector.as_pointer())


def llvm_call(builder, name, result, args):
    # a call of the LLVM intrinsic `name` (declared in the module on first use) returning `result`
    kind = ir.FunctionType(result, [arg.type for arg in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, kind, name), args)


def spread(builder, value, vector):
    # `value` (of the vector's element type) in every lane of `vector`
    i32 = ir.IntType(32)
    one = builder.insert_element(ir.Constant(vector, None), value, i32(0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(i32, vector.count), [0] * vector.count))


@intrinsic
def zeros(typingctx, name):
    """Zeros in the lanes VECTORS[name] names (a constant)."""
    if not isinstance(name, types.StringLiteral):
        return None  # numba types the call again with the constant as a literal
    kind = VECTORS[name.literal_value]

    def codegen(context, builder, sig, args):
        return ir.Constant(kind.vector, None)

    return kind(name), codegen


@intrinsic
def zeros_like(typingctx, like):
    """Zeros in the lanes of `like`."""

    def codegen(context, builder, sig, args):
        return ir.Constant(like.vector, None)

    return like(like), codegen


@intrinsic
def shape_of(typingctx, like):
    """(count, depth) of `like`'s lanes: a block's columns and inputs."""

    def codegen(context, builder, sig, args):
        return context.make_tuple(builder, sig.return_type, [context.get_constant(types.intp, like.count),
                                                             context.get_constant(types.intp, like.depth)])

    return types.UniTuple(types.intp, 2)(like), codegen


@intrinsic
def load(typingctx, array, offset, like):
    """`like`'s count of elements from a contiguous array of its element type, from element
    `offset` on."""

    def codegen(context, builder, sig, args):
        return builder.load(pointer(context, builder, sig.args[0], args[0], args[1], like.vector), align=4)

    return like(array, types.intp, like), codegen


@intrinsic
def store(typingctx, array, offset, value):
    """The lanes into a contiguous array of their element type from element `offset` on."""

    def codegen(context, builder, sig, args):
        builder.store(args[2], pointer(context, builder, sig.args[0], args[0], args[1], value.vector), align=4)
        return context.get_dummy_value()

    return types.void(array, types.intp, value), codegen
