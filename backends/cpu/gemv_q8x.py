"""mul_mat_q8x on the CPU: x rounded to 8-bit blocks once a call, integer block dot products.

llama.cpp's AVX2 decode path, emitted explicitly: numba's own loops never became `vpmaddubsw`
(BENCHMARKS.md, "8-bit activations"), so the row's block loop is an @intrinsic written in LLVM IR.

Layouts, repacked once a weight (`repack`): codes padded with zero blocks to an even count (nblk2), scales
with zeros to a multiple of 4 (nblk4):
  * q4_0 / q4_1: qs uint8 [rows, nblk2 * 16], blocks paired as in gemv_repacked.py: byte j of pair k
    holds element j of block 2k in its low nibble and element j of block 2k + 1 in its high nibble,
    so one 32-byte load and a shift give both blocks' codes in x's order; d (and q4_1's m) [rows, nblk4].
  * q8_0: qs [rows, nblk2 * 32] (the int8 codes, stored as uint8), d [rows, nblk4].
  * d and m stay the file's f16 bits (uint16), widened in the kernel (`vcvtph2ps`, exact: the same f32 values as
    widening them once at repack). A decode step streams its weights from memory (SmolLM2's products: 114.1 MB
    with f32 scales, 97.7 MB with f16; L3 32 MB): on the 2-core EPYC at 2 threads its decode step went 7.34 -> 6.92
    ms and the products 5.21 -> 4.85 ms (medians of 8 alternated processes); with a weight hot in cache the 1-row
    q4_1 GEMV is 1-3% slower, the widening's cost (BENCHMARKS.md, "f16 scales in the repacked GEMV weights").
x per row (`quantize_x`, q8_blocks' arithmetic bit for bit): codes int8 [nblk2 * 32], dx f32 [nblk4], and
for q4_1 sx = fl(dx * sum q) f32 [nblk4].

Per block, the integer sum of code products, exact: `vpmaddubsw` takes unsigned x signed bytes, so q4_1
multiplies its nibbles c (0..15) by q; q4_0 (c - 8) and q8_0 (w) go in as |w| times q with w's sign
(`vpsignb`), llama.cpp's trick. No saturation: a pair of byte products is at most 2 * 128 * 127 = 32512 <
2^15. `vpmaddwd` with ones gives 8 partial sums a block, and three `vphaddd` plus one add reduce four
blocks' to one integer each (at most 32 * 128 * 127 < 2^24: exact as f32), so the float part sees n_in / 32
terms, not 8 times as many (llama.cpp keeps the 8 lanes in float).

The float order, the same in both paths (so they agree bit for bit), blocks b = 4i + e (e = 0..3):
  a_e = fma(f32(isum_b), fl(d_w[b] * d_x[b]), a_e) for i in order; q4_1: o_e = fma(m_w[b], sx[b], o_e);
  y = (a_0 + a_1) + (a_2 + a_3), plus ((o_0 + o_1) + (o_2 + o_3)) for q4_1.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import direct_call
from .attention import f16_to_f32
from .gemv_repacked import target_features
from .matmul import _num_threads

__all__ = ["FORMATS", "repack", "quantize_blocks", "quantize_x", "prepare", "AVX2"]

CACHE_DEPENDS = ("attention.py",)  # compiled into the portable kernel: its f16 widening
FORMATS = {"q4_0": 0, "q4_1": 1, "q8_0": 2}  # the kernels' format codes
_BLOCK = {"q4_0": (18, 2), "q4_1": (20, 4), "q8_0": (34, 2)}  # bytes per ggml block, offset of its codes
# what numba compiles for (NUMBA_CPU_FEATURES, else the host); F16C widens the scales (every AVX2 CPU has it)
AVX2 = {"+avx2", "+f16c"} <= set(target_features().split(","))


# ---------------------------------------------------------------- repacking and x's codes
def padded(nblk: int) -> tuple[int, int]:
    """(nblk2, nblk4): the block counts rounded up to 2 (codes) and to 4 (scales)."""
    return nblk + nblk % 2, -(-nblk // 4) * 4


def repack(w_raw: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(qs, d, m or None) of uint8 [rows, row_bytes] ggml blocks, in the layouts above (d, m: f16 bits)."""
    bb, off = _BLOCK[dtype]
    rows, nblk = w_raw.shape[0], w_raw.shape[1] // bb
    nblk2, nblk4 = padded(nblk)
    blk = np.zeros((rows, nblk4, bb), np.uint8)  # zero blocks (d = m = 0) pad
    blk[:, :nblk] = np.asarray(w_raw).reshape(rows, nblk, bb)
    d = np.ascontiguousarray(blk[:, :, 0:2].copy().view(np.uint16)[:, :, 0])
    m = np.ascontiguousarray(blk[:, :, 2:4].copy().view(np.uint16)[:, :, 0]) if dtype == "q4_1" else None
    raw = blk[:, :nblk2, off:]
    if dtype == "q8_0":
        return np.ascontiguousarray(raw).reshape(rows, -1), d, m
    v = np.concatenate([raw & 15, raw >> 4], axis=2)  # [rows, nblk2, 32] codes in element order
    qs = np.ascontiguousarray(v[:, 0::2] | (v[:, 1::2] << 4)).reshape(rows, -1)
    return qs, d, m


IN_ORDER = np.arange(32)  # quantize_blocks' order for x's codes as the kernels here read them
# 2^-126, a constant of the kernel: np.finfo inside it made every process that loads the kernel from numba's cache
# import numba's np.finfo implementation with numba.np.arraymath and numba.np.linalg (0.035 s of a first token)
F32_TINY = np.float32(np.finfo(np.float32).tiny)


@njit(cache=True)
def quantize_blocks(x, xq, dx, sx, qmax, order):
    """x f32 [m, n_in] -> integer codes xq [m, >= n_in] (element j of block b at 32 b + order[j]), dx, sx f32
    [m, >= n_in / 32] (zero past x's blocks): d = max |x| / qmax, q = roundf(x * (1 / d)) (1 / d = 0 below
    2^-126), sx = fl(d * sum q). With qmax 127: q8_blocks in f32."""
    tiny = F32_TINY
    m, n_in = x.shape
    for t in range(m):
        for b in range(dx.shape[1]):
            o = b * 32
            amax = np.float32(0.0)
            for j in range(min(32, max(0, n_in - o))):
                amax = max(amax, abs(x[t, o + j]))
            d = amax / qmax
            inv = np.float32(1.0) / d if d >= tiny else np.float32(0.0)
            s = 0
            for j in range(32):
                q = 0
                if o + j < n_in:
                    v = x[t, o + j] * inv
                    a = abs(v)
                    f = np.floor(a)
                    q = int(f) + (1 if a - f >= np.float32(0.5) else 0)
                    q = -q if v < 0 else q
                if o + order[j] < xq.shape[1]:
                    xq[t, o + order[j]] = q
                s += q
            dx[t, b] = d
            sx[t, b] = d * np.float32(s)


@njit(cache=True)
def quantize_x(x, xq, dx, sx):
    """x's int8 codes for the kernels here: quantize_blocks with qmax 127, in element order."""
    quantize_blocks(x, xq, dx, sx, np.float32(127.0), IN_ORDER)


# ---------------------------------------------------------------- the AVX2 row dot product, in LLVM IR
_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V32I8, _V16I16, _V8I32, _V4F32 = (ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8),
                                   ir.VectorType(_F32, 4))


def fn(builder, name: str, ret, args):
    """The LLVM function (an intrinsic: "llvm.x86...") `name` of type ret(args), declared in builder's module."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _load32(builder, base, offset):
    """32 bytes at base + offset (any alignment)."""
    p = builder.bitcast(builder.gep(base, [offset]), _V32I8.as_pointer())
    return builder.load(p, align=1)


def _block_isum(builder, fmt: int, w, xq):
    """<8 x i32>: lane l = the sum over elements 4l..4l+3 of the block's weight codes times x's (exact)."""
    maddubs = fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [_V32I8, _V32I8])
    madd = fn(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
    if fmt == 1:  # q4_1: the nibbles are the unsigned operand as they are
        pairs = builder.call(maddubs, [w, xq])
    else:  # q4_0 (w = c - 8), q8_0: |w| times q with w's sign
        sign = fn(builder, "llvm.x86.avx2.psign.b", _V32I8, [_V32I8, _V32I8])
        absf = fn(builder, "llvm.abs.v32i8", _V32I8, [_V32I8, ir.IntType(1)])
        pairs = builder.call(maddubs, [builder.call(absf, [w, ir.Constant(ir.IntType(1), 0)]),
                                       builder.call(sign, [xq, w])])
    return builder.call(madd, [pairs, ir.Constant(_V16I16, [1] * 16)])


def quad_reduce(builder, sums: list):
    """<4 x i32>: lane e = the sum of the 8 lanes of sums[e] (2 or 4 <8 x i32>; missing ones count 0)."""
    sums = sums + [ir.Constant(_V8I32, [0] * 8)] * (4 - len(sums))
    hadd = fn(builder, "llvm.x86.avx2.phadd.d", _V8I32, [_V8I32, _V8I32])
    # [s0 01, s0 23, s1 01, s1 23 | s0 45, ...], then [s0 0123, s1 0123, s2 .., s3 .. | s0 4567, ...]
    h = builder.call(hadd, [builder.call(hadd, sums[:2]), builder.call(hadd, sums[2:])])
    half = lambda lo: builder.shuffle_vector(h, h, ir.Constant(ir.VectorType(_I32, 4), list(range(lo, lo + 4))))  # noqa: E731
    return builder.add(half(0), half(4))


def _quad_isums(builder, fmt: int, w, x, b0, blocks: int):
    """<4 x i32>: the integer sums of blocks b0 .. b0 + 3 (only the first `blocks`, 2 or 4, read; the rest 0)."""
    i64 = ir.IntType(64)
    c = lambda v: ir.Constant(i64, v)  # noqa: E731
    sums = []
    for p in range(blocks // 2):  # a pair of blocks
        b = builder.add(b0, c(2 * p))
        if fmt == 2:
            codes = [_load32(builder, w, builder.mul(builder.add(b, c(e)), c(32))) for e in range(2)]
        else:  # low nibbles block b, high nibbles block b + 1
            v = _load32(builder, w, builder.mul(b, c(16)))
            m15 = ir.Constant(_V32I8, [15] * 32)
            codes = [builder.and_(v, m15), builder.and_(builder.lshr(v, ir.Constant(_V32I8, [4] * 32)), m15)]
            if fmt == 0:
                codes = [builder.sub(cv, ir.Constant(_V32I8, [8] * 32)) for cv in codes]
        sums += [_block_isum(builder, fmt, codes[e], _load32(builder, x, builder.mul(builder.add(b, c(e)), c(32))))
                 for e in range(2)]
    return quad_reduce(builder, sums)


def _load4f(builder, base, b0):
    p = builder.bitcast(builder.gep(base, [b0]), _V4F32.as_pointer())
    return builder.load(p, align=4)


def load4h(builder, base, b0):
    """<4 x f32>: the f16 bits at base[b0 .. b0 + 3] (a uint16 pointer) widened, exactly."""
    p = builder.bitcast(builder.gep(base, [b0]), ir.VectorType(_I16, 4).as_pointer())
    return builder.fpext(builder.bitcast(builder.load(p, align=2), ir.VectorType(ir.HalfType(), 4)), _V4F32)


def for_quads(builder, nblk2, body) -> None:
    """body(b0, blocks) for each quad of blocks b0 .. b0 + 3 (blocks 4), then for the last pair (blocks 2) where
    nblk2 % 4 == 2."""
    i64 = ir.IntType(64)
    nquad = builder.udiv(nblk2, ir.Constant(i64, 4))
    with cgutils.for_range(builder, nquad) as loop:
        body(builder.mul(loop.index, ir.Constant(i64, 4)), 4)
    with builder.if_then(builder.icmp_unsigned("!=", builder.urem(nblk2, ir.Constant(i64, 4)), ir.Constant(i64, 0))):
        body(builder.mul(nquad, ir.Constant(i64, 4)), 2)  # the last pair: scales padded with zeros to 4


def emit_row_dot(builder, fmt: int, quad_isums, w, x, dw, dx, mw, sx, nblk2):
    """The row's dot product over nblk2 blocks (pointers to its bytes, x's codes, the four scale rows: the weight's
    f16 bits, x's f32) in the module docstring's float order; quad_isums(builder, fmt, w, x, b0, blocks) gives four
    blocks' integer sums."""
    fma4 = fn(builder, "llvm.fma.v4f32", _V4F32, [_V4F32, _V4F32, _V4F32])
    zero4 = ir.Constant(_V4F32, [0.0] * 4)
    acc, off = cgutils.alloca_once_value(builder, zero4), cgutils.alloca_once_value(builder, zero4)

    def quad(b0, blocks: int) -> None:
        isum = builder.sitofp(quad_isums(builder, fmt, w, x, b0, blocks), _V4F32)
        dd = builder.fmul(load4h(builder, dw, b0), _load4f(builder, dx, b0))
        builder.store(builder.call(fma4, [isum, dd, builder.load(acc)]), acc)
        if fmt == 1:
            builder.store(builder.call(fma4, [load4h(builder, mw, b0), _load4f(builder, sx, b0), builder.load(off)]),
                          off)

    for_quads(builder, nblk2, quad)
    return row_total(builder, fmt, builder.load(acc), builder.load(off))


def row_total(builder, fmt: int, acc, off):
    """y = (a_0 + a_1) + (a_2 + a_3), plus ((o_0 + o_1) + (o_2 + o_3)) for q4_1 (<4 x f32> acc, off)."""
    def total(v):
        e = [builder.extract_element(v, ir.Constant(_I32, i)) for i in range(4)]
        return builder.fadd(builder.fadd(e[0], e[1]), builder.fadd(e[2], e[3]))

    y = total(acc)
    return builder.fadd(y, total(off)) if fmt == 1 else y


@intrinsic
def _row_dot_avx2(typingctx, fmt, w, x, dw, dx, mw, sx):
    """float32 row dot product (module docstring's order): fmt a literal format code; w the weight row's
    bytes, x the codes (nblk2 * 32), dw / mw the row's scales (f16 bits), dx / sx x's (nblk4; 1-D C arrays)."""
    if not isinstance(fmt, types.IntegerLiteral):
        return None
    code = fmt.literal_value

    def codegen(context, builder, sig, args):
        ptrs = [cgutils.create_struct_proxy(t)(context, builder, value=a).data
                for t, a in zip(sig.args[1:], args[1:])]
        n = cgutils.create_struct_proxy(sig.args[2])(context, builder, value=args[2]).nitems
        return emit_row_dot(builder, code, _quad_isums, *ptrs, builder.udiv(n, ir.Constant(n.type, 32)))

    return types.float32(fmt, w, x, dw, dx, mw, sx), codegen


@intrinsic
def _fma32(typingctx, a, b, c):
    """fma(a, b, c) in f32, one rounding (llvm.fma.f32: the instruction where there is one, else libm's fmaf)."""
    if not all(t == types.float32 for t in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        return builder.call(fn(builder, "llvm.fma.f32", _F32, [_F32] * 3), list(args))

    return types.float32(a, b, c), codegen


# ---------------------------------------------------------------- the same arithmetic without vectors
@njit(cache=True)
def _row_dot_portable(fmt, w, x, dw, dx, mw, sx):
    acc, off = np.zeros(4, np.float32), np.zeros(4, np.float32)
    nblk2 = len(x) // 32
    for b0 in range(0, nblk2, 4):
        for e in range(4):
            b, isum = b0 + e, 0
            for j in range(32 if b < nblk2 else 0):  # blocks past the codes: 0 (their scales are 0 too)
                if fmt == 2:
                    c = np.int32(w[32 * b + j])
                    c = c - 256 if c > 127 else c
                else:
                    v = np.int32(w[32 * (b // 2) + j])
                    c = (v & 15) if b % 2 == 0 else (v >> 4)
                    c = c - 8 if fmt == 0 else c
                isum += c * np.int32(x[32 * b + j])
            acc[e] = _fma32(np.float32(isum), f16_to_f32(dw[b]) * dx[b], acc[e])
            if fmt == 1:
                off[e] = _fma32(f16_to_f32(mw[b]), sx[b], off[e])
    y = (acc[0] + acc[1]) + (acc[2] + acc[3])
    return y + ((off[0] + off[1]) + (off[2] + off[3])) if fmt == 1 else y


# ---------------------------------------------------------------- the GEMV: output rows split over threads
@njit(parallel=True, cache=True)
def _gemv_avx2(fmt, x, qs, dw, mw, xq, dx, sx, y, nth):
    quantize_x(x, xq, dx, sx)  # x quantized serially here: one numba dispatch a GEMV, not two
    n_out, m = qs.shape[0], xq.shape[0]
    nsup = max(1, min(n_out, nth))
    per = (n_out + nsup - 1) // nsup
    for s in prange(nsup):
        for r in range(s * per, min(n_out, (s + 1) * per)):
            for t in range(m):  # the weight row stays in L1 across x's rows
                if fmt == 0:
                    y[t, r] = _row_dot_avx2(0, qs[r], xq[t], dw[r], dx[t], mw[r], sx[t])
                elif fmt == 1:
                    y[t, r] = _row_dot_avx2(1, qs[r], xq[t], dw[r], dx[t], mw[r], sx[t])
                else:
                    y[t, r] = _row_dot_avx2(2, qs[r], xq[t], dw[r], dx[t], mw[r], sx[t])


@njit(parallel=True, cache=True)
def _gemv_portable(fmt, x, qs, dw, mw, xq, dx, sx, y, nth):
    quantize_x(x, xq, dx, sx)
    n_out, m = qs.shape[0], xq.shape[0]
    nsup = max(1, min(n_out, nth))
    per = (n_out + nsup - 1) // nsup
    for s in prange(nsup):
        for r in range(s * per, min(n_out, (s + 1) * per)):
            for t in range(m):
                y[t, r] = _row_dot_portable(fmt, qs[r], xq[t], dw[r], dx[t], mw[r], sx[t])


KERNELS = {"avx2": _gemv_avx2, "portable": _gemv_portable}


def gemv_shape(w_raw, dtype: str, x2, out2, formats) -> tuple[int, int, int] | None:
    """(rows, n_in, m) where w_raw (uint8 [rows, row_bytes] ggml blocks of dtype, one of `formats`), x2 (f32 C
    [m, n_in]) and out2 (f32 C [m, rows], writeable) make a GEMV the kernels here take, else None."""
    if dtype not in formats or not isinstance(w_raw, np.ndarray) or w_raw.ndim != 2 or w_raw.dtype != np.uint8:
        return None
    for a in (x2, out2):
        if not isinstance(a, np.ndarray) or a.ndim != 2 or a.dtype != np.float32 or not a.flags.c_contiguous:
            return None
    bb, _ = _BLOCK[dtype]
    rows, nbytes = w_raw.shape
    n_in, m = nbytes // bb * 32, x2.shape[0]
    if nbytes % bb or x2.shape[1] != n_in or out2.shape != (m, rows) or not out2.flags.writeable:
        return None
    return rows, n_in, m


def repacked(w_raw, dtype: str, cache: dict | None, key) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(qs, d, m) of `repack`, kept in `cache` under ("gemv_q8x", dtype) + key (weight_cache.py keeps those on
    disk); m is d where the format has none (the kernels read it for q4_1 only)."""
    ck = ("gemv_q8x", dtype) + tuple(key or ())
    packed = cache.get(ck) if cache is not None and key else None
    if packed is None:
        packed = repack(w_raw, dtype)
        if cache is not None and key:
            cache[ck] = packed
    qs, dw, mw = packed
    return qs, dw, dw if mw is None else mw


def prepare(w_raw, dtype: str, x2: np.ndarray, out2: np.ndarray, cache: dict | None = None, key=None,
            path: str | None = None):
    """A zero-argument callable writing out2 = mul_mat_q8x(w, x2) in place, or None where unsupported.

    w_raw: uint8 [rows, row_bytes] ggml blocks of `dtype`; x2 float32 C-contiguous [m, n_in] (read at each
    call); out2 float32 C-contiguous [m, rows]. The repacked weight is cached in `cache` under
    ("gemv_q8x", dtype) + key. `path`: "avx2" or "portable" (default: avx2 where numba compiles for it).
    """
    shape = gemv_shape(w_raw, dtype, x2, out2, FORMATS)
    if shape is None:
        return None
    rows, n_in, m = shape
    qs, dw, mw = repacked(w_raw, dtype, cache, key)
    nblk2, nblk4 = padded(n_in // 32)
    xq, dx, sx = np.zeros((m, nblk2 * 32), np.int8), np.zeros((m, nblk4), np.float32), np.zeros((m, nblk4), np.float32)
    kernel, fmt = KERNELS[path or ("avx2" if AVX2 else "portable")], FORMATS[dtype]
    return bound_gemv(kernel, fmt, (x2, qs, dw, mw, xq, dx, sx, out2), m * rows)


def bound_gemv(kernel, fmt: int, arrays: tuple, work: int):
    """The step `kernel(fmt, *arrays, threads)` (this module's and gemv_q16x's kernels), a no-op where `work` is 0:
    through numba's dispatcher the first time, then the compiled overload's entry point (direct_call.py)."""
    call: list = []

    def run() -> None:
        if work == 0:
            return
        if call:
            call[0](fmt, *arrays, _num_threads())
            return
        call.append(direct_call.first_call(kernel, fmt, *arrays, _num_threads()))

    return run


def asm(path: str = "avx2") -> str:
    """The assembly of `path`'s kernel for the signature it was first called with: compiled afresh (a few
    seconds), as numba keeps no assembly for kernels loaded from its cache."""
    k = KERNELS[path]
    fresh = njit(parallel=True)(k.py_func)
    fresh.compile(k.signatures[0])
    return "\n".join(fresh.inspect_asm().values())
