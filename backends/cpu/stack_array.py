"""Kernel scratch on the stack and 4-byte reinterpreting views, without numba's array overloads.

A kernel that allocates with `np.empty` or views an array as another dtype (`a.view(np.int32)`) calls overloads
defined in numba.np.arrayobj, and every process that loads such a kernel from numba's cache imports that module to
rebuild their environments, with numba.cpython.unicode, charseq and hashing: 0.025-0.035 s of a second process's
first token on the 2-core machine (get_rows, gemv_q16x's x quantizer and swiglu each had one). These intrinsics do
the same in the kernel's own code. A stack array also keeps what `np.empty` gave LLVM: memory no argument can
alias, so the loops that fill it vectorize without runtime alias checks (swiglu on a decode row: 3.2-3.7 us, as
with np.empty; the same scratch passed in as an argument took 4.6).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

_LLVM = {types.float32: ir.FloatType(), types.int32: ir.IntType(32)}


def _stack(dtype):
    def impl(typingctx, n):
        if not isinstance(n, types.IntegerLiteral) or n.literal_value <= 0:
            return None
        size, arrty = n.literal_value, types.Array(dtype, 1, "C")

        def codegen(context, builder, sig, args):
            ptr = cgutils.alloca_once(builder, _LLVM[dtype], size=size)  # in the entry block: once a call
            ary = context.make_array(arrty)(context, builder)
            intp = context.get_value_type(types.intp)
            context.populate_array(ary, data=ptr, shape=[ir.Constant(intp, size)], strides=[ir.Constant(intp, 4)],
                                   itemsize=ir.Constant(intp, 4), meminfo=None)
            return ary._getvalue()

        return arrty(n), codegen

    return impl


stack_f32 = intrinsic(_stack(types.float32))  # stack_f32(n): float32 [n] scratch (n a literal), uninitialized
stack_i32 = intrinsic(_stack(types.int32))


def _view(dtype):
    def impl(typingctx, a):
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype in _LLVM
                and a.dtype != dtype):
            return None
        arrty = types.Array(dtype, 1, "C", readonly=not a.mutable)

        def codegen(context, builder, sig, args):
            src = context.make_array(sig.args[0])(context, builder, args[0])
            ary = context.make_array(arrty)(context, builder)
            context.populate_array(ary, data=builder.bitcast(src.data, _LLVM[dtype].as_pointer()), shape=src.shape,
                                   strides=src.strides, itemsize=src.itemsize, meminfo=src.meminfo, parent=src.parent)
            return impl_ret_borrowed(context, builder, arrty, ary._getvalue())  # a new reference to a's memory

        return arrty(a), codegen

    return impl


as_f32 = intrinsic(_view(types.float32))  # as_f32(a): int32 [n] C as float32 [n], a.view(np.float32)
as_i32 = intrinsic(_view(types.int32))  # as_i32(a): float32 [n] C as int32 [n], a.view(np.int32)


@intrinsic
def bits_as_f32(typingctx, v):
    """np.int32(v).view(np.float32) for an int32 v (numba's scalar view is an overload of numba.cpython.numbers)."""
    if v != types.int32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(v), codegen
