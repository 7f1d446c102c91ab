"""A software prefetch for the numba kernels: `prefetch(a, i, off)` asks for the cache line of byte `off` of a[i].

The decode kernels stream data the hardware prefetchers pick up late: a decode GEMV's weight rows (gemv_q16x.py)
and attention's V rows, which a task reads only after all its K rows (attention.py). Measured on the 2-core EPYC
(BENCHMARKS.md, "Prefetching the decode GEMV's weight rows"), SmolLM2's decode step replayed at 2 threads: the
121 products 4.30-4.40 -> 3.72-3.89 ms, flash_attn at 256 keys 1.47-1.55 -> 1.22-1.24 ms. A prefetch never
faults and changes no value, so the kernels' bits stay as they were.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["prefetch"]

_I32 = ir.IntType(32)


@intrinsic
def prefetch(typingctx, a, i, off):
    """Prefetch for reading, into L1 (`prefetcht0`), the line holding byte `off` of a[i] (a C-contiguous array of
    any rank; i indexes its first axis); an address past the array is harmless, as for any prefetch."""
    if not isinstance(a, types.Array) or a.layout != "C" or not all(isinstance(t, types.Integer) for t in (i, off)):
        return None

    def codegen(context, builder, sig, args):
        ary = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0])
        row = cgutils.unpack_tuple(builder, ary.strides, sig.args[0].ndim)[0]
        ii, oo = [context.cast(builder, v, t, types.int64) for v, t in zip(args[1:], sig.args[1:])]
        p = builder.gep(builder.bitcast(ary.data, ir.IntType(8).as_pointer()), [builder.add(builder.mul(ii, row), oo)])
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [p.type, _I32, _I32, _I32]),
                                           "llvm.prefetch.p0")
        builder.call(f, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])  # read, L1, data
        return context.get_dummy_value()

    return types.none(a, i, off), codegen
