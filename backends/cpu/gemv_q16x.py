"""mul_mat_q16x on the CPU: x rounded to 16-bit blocks once a call, integer block dot products (q4_0, q4_1, q8_0).

gemv_q8x.py's GEMV with int16 codes of x (why: graphir/ops/fused.py, mul_mat_q16x): the same repacked weight
(gemv_q8x.repack, and its cache entry), the same float order, so its module docstring holds here with these changes:
  * x per row (`quantize_x`): gemv_q8x.quantize_blocks with qmax 32767, codes int16 [nblk2 * 32], each block
    stored evens then odds (element j at j // 2 + 16 (j % 2), WORDS_ORDER), the order the AVX2 path reads.
  * The weight's 32 bytes of a block pair read as 16 words ("words" layout): word i's nibbles, low to high,
    are element 2i of block b, 2i of block b + 1, 2i + 1 of b, 2i + 1 of b + 1, so shifts by 0 / 4 / 8 / 12 and
    a mask give four int16 vectors without widening (q4_0 then subtracts 8). `vpmaddwd` of codes by x's gives
    exact int32 pair sums: a block's sum is at most 32 * 15 * 32767 < 2^24 (q4_1; q4_0 32 * 8 * 32767), exact
    as f32 too. As many multiply-adds a block as q8x (two `vpmaddwd` for a `vpmaddubsw` and a `vpmaddwd`); the
    extra cost is the shift / mask work and twice x's bytes (BENCHMARKS.md, "int16 activations for q4_1":
    1.02-1.20x q8x's time at SmolLM2's shapes; zero-extending bytes instead, `vpmovzxbw`, measured 1.19-1.33x
    slower again and was dropped).
  * q8_0 (gemv_q8x's layout: a block's 32 signed bytes): read as 16 words, the low bytes (elements 2i, x's
    evens) sign-extended by a shift left and an arithmetic shift right by 8, the high bytes (odds) by the shift
    right alone, then `vpmaddwd` as above. A block's sum reaches 32 * 128 * 32767 < 2^27: exact in int32, but
    converted to f32 it is rounded once (the only rounding q4's path does not have; the tests' bound has one more
    2^-24 a term for it).
  * A quad's four block sums are reduced by unpacks and adds (`_quad_reduce`), not three `vphaddd`.
  * m > 1 rows of x (prompt chunks, speculative verify calls): a weight row's quads are unpacked once for a tile
    of up to 4 rows (`_rows_dot_avx2`, a tile over 16 weight rows at a time), each row with its own accumulators
    in the 1-row order, so row t is the 1-row kernel on x[t] bit for bit (issue 11: verify rows equal the decode
    steps); 1.2-1.45x faster at 2-16 rows than a row dot a row of x (BENCHMARKS.md, "Issue 11 on the cpu
    pipeline").
  * One row of x (a decode step): each thread prefetches the weight row _PREFETCH_ROWS ahead of the one it
    reads (codes and scales, `prefetcht0`; no arithmetic changes): SmolLM2's 121 products 4.30-4.40 -> 3.72-3.89
    ms a step replayed at 2 threads, where the hardware prefetchers alone wait on more misses (which ones was not
    measured; page boundaries and each GEMV's first rows are the likely ones). BENCHMARKS.md, "Prefetching the
    decode GEMV's weight rows".
The portable path (no AVX2) is gemv_q8x's row loop on int16 codes in element order: the same bits.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import gemv_q8x as GQ
from .prefetch import prefetch
from .stack_array import as_i32, bits_as_f32

__all__ = ["FORMATS", "quantize_x", "prepare", "block_isums", "AVX2", "WORDS_ORDER"]

# compiled into the kernels here: gemv_q8x's quantizer, row loop, emitters and (portable path) attention's f16
# widening; prefetch's intrinsic
CACHE_DEPENDS = ("gemv_q8x.py", "attention.py", "prefetch.py", "stack_array.py")
FORMATS = {"q4_0": 0, "q4_1": 1, "q8_0": 2}  # gemv_q8x's format codes
AVX2 = GQ.AVX2
Q16_MAX = np.float32(32767.0)
WORDS_ORDER = np.array([j // 2 + 16 * (j % 2) for j in range(32)])  # x's code of element j at WORDS_ORDER[j]
_I16, _I32, _I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V16I16, _V8I32, _V4F32 = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8), ir.VectorType(ir.FloatType(), 4)
# rows of x a pass over a weight row takes, accumulators in registers: 1.3-1.45x faster than row by row at 4-16 rows;
# 8 measured about as fast and compiled twice as long (5.5 s, 2.7 s the kernel with 4)
_TILE = 4
# weight rows a tile of x's rows passes over before the next tile, so the tile's codes stay in L1 (SmolLM2's ffn_down,
# 1536 inputs: 16 rows of x are 48 KB; 1.14-1.18x faster at 16 rows than all tiles a weight row)
_RBLOCK = 16


@njit(cache=True)
def _words_blocks(x, xq, dx, sx, full):
    """Whole blocks 0 .. full - 1 of one row x (1-D) in quantize_blocks' arithmetic with qmax 32767, stored evens then
    odds, in loops LLVM vectorizes: each block's max |x| on the f32 bits as integers (the same maximum for any x but
    NaN), the scales of all blocks in one loop (its divisions side by side; sx holds 1 / d until the codes are
    summed), the codes without branches, evens and odds as two strided streams. quantize_blocks' loop (a bounds test
    and a scatter through WORDS_ORDER an element) stays scalar."""
    bits = as_i32(x)  # x.view(np.int32) (stack_array.py: numba's view made loading this kernel import arrayobj)
    for b in range(full):
        top = np.int32(0)
        for j in range(32 * b, 32 * b + 32):
            top = max(top, bits[j] & np.int32(0x7FFFFFFF))
        dx[b] = bits_as_f32(np.int32(top)) / Q16_MAX
    for b in range(full):
        d = dx[b]
        sx[b] = np.float32(1.0) / d if d >= GQ.F32_TINY else np.float32(0.0)
    for b in range(full):
        xb, qb, inv = x[32 * b:32 * b + 32], xq[32 * b:32 * b + 32], sx[b]  # indices from 0: no negative-index fix-ups
        s = np.int32(0)
        for i in range(16):
            e, f = _code(xb[2 * i] * inv), _code(xb[2 * i + 1] * inv)
            qb[i], qb[16 + i] = e, f
            s = np.int32(s + e + f)  # int32 throughout (numba widens int32 sums to int64): 32 codes, < 2^21
        sx[b] = dx[b] * np.float32(s)


@njit(inline="always")
def _code(v):
    """quantize_blocks' rounding of v: to nearest, ties away from zero."""
    a = abs(v)
    f = np.floor(a)
    q = np.int32(np.int32(f) + np.int32(a - f >= np.float32(0.5)))
    return np.int32(-q) if v < 0 else q


@njit(cache=True)
def quantize_x(x, xq, dx, sx):
    """x's int16 codes as the AVX2 path reads them: quantize_blocks with qmax 32767, each block evens then odds, the
    same bytes for any x without NaN; whole blocks by _words_blocks (SmolLM2's 576 and 1536 inputs, one row, through
    the dispatcher: 2.7 -> 1.1 and 5.5 -> 1.7 us a call; its decode step's products 0.5-1.0 ms faster in alternated
    processes, more than those calls add up to: BENCHMARKS.md, "Prefetching the decode GEMV's weight rows")."""
    m, n_in = x.shape
    full = n_in // 32
    for t in range(m):
        _words_blocks(x[t], xq[t], dx[t], sx[t], full)
    if n_in % 32:  # a partial block, then padding
        GQ.quantize_blocks(x[:, 32 * full:], xq[:, 32 * full:], dx[:, full:], sx[:, full:], Q16_MAX, WORDS_ORDER)
    else:  # padding: codes and scales 0, as quantize_blocks leaves them
        xq[:, 32 * full:] = 0
        dx[:, full:] = 0
        sx[:, full:] = 0


@njit(cache=True)
def quantize_x_in_order(x, xq, dx, sx):
    """The same codes in element order (the portable path's)."""
    GQ.quantize_blocks(x, xq, dx, sx, Q16_MAX, GQ.IN_ORDER)


# ---------------------------------------------------------------- the AVX2 row dot product, in LLVM IR
def _c64(v: int):
    return ir.Constant(_I64, v)


def _words(builder, w, byte_offset):
    """<16 x i16>: the 32 bytes at w + byte_offset as words (any alignment)."""
    return builder.load(builder.bitcast(builder.gep(w, [byte_offset]), _V16I16.as_pointer()), align=1)


def _pair_codes(builder, fmt: int, w, b):
    """codes[e][h] <16 x i16>: block b + e's codes meeting x's words 16h .. 16h + 15 (evens, then odds)."""
    const = lambda n: ir.Constant(_V16I16, [n] * 16)  # noqa: E731
    if fmt == 2:  # q8_0: word i of a block holds element 2i (low byte) and 2i + 1 (high), both signed
        words = [_words(builder, w, builder.mul(builder.add(b, _c64(e)), _c64(32))) for e in range(2)]
        return [[builder.ashr(builder.shl(v, const(8)), const(8)), builder.ashr(v, const(8))] for v in words]
    v = _words(builder, w, builder.mul(b, _c64(16)))
    nib = lambda s: builder.and_(builder.lshr(v, const(s)), const(15)) if s < 12 else builder.lshr(v, const(s))  # noqa: E731
    codes = [[nib(0), nib(8)], [nib(4), nib(12)]]  # block b: shifts 0 (evens), 8 (odds); block b + 1: 4, 12
    if fmt == 0:  # q4_0: w = c - 8
        codes = [[builder.sub(c, const(8)) for c in pair] for pair in codes]
    return codes


def _pair_isums(builder, codes, x, b):
    """[<8 x i32>] * 2: blocks b and b + 1 (b even) of _pair_codes' codes by x's, lane l the sum of 4 of the block's
    code x code products."""
    madd = GQ.fn(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])

    def xload(e: int, h: int):
        off = builder.add(builder.mul(builder.add(b, _c64(e)), _c64(32)), _c64(16 * h))
        return builder.load(builder.bitcast(builder.gep(x, [off]), _V16I16.as_pointer()), align=2)

    return [builder.add(*[builder.call(madd, [codes[e][h], xload(e, h)]) for h in range(2)]) for e in range(2)]


def _quad_codes(builder, fmt: int, w, b0, blocks: int) -> list:
    """_pair_codes of each pair of blocks b0 .. b0 + blocks - 1 (blocks 2 or 4)."""
    return [_pair_codes(builder, fmt, w, builder.add(b0, _c64(2 * p))) for p in range(blocks // 2)]


def _quad_isums_of(builder, codes: list, x, b0):
    """<4 x i32>: the integer sums of blocks b0 .. b0 + 3 from _quad_codes' codes (blocks past them 0)."""
    sums = []
    for p, pair in enumerate(codes):
        sums += _pair_isums(builder, pair, x, builder.add(b0, _c64(2 * p)))
    return _quad_reduce(builder, sums)


def _quad_reduce(builder, sums: list):
    """<4 x i32>: lane e = the sum of the 8 lanes of sums[e] (2 or 4 <8 x i32>; missing ones count 0), by unpacks
    and adds where gemv_q8x.quad_reduce takes three `vphaddd` (1.02-1.2x faster GEMVs at 1-16 rows of x; integer
    sums, so the same bits)."""
    sums = sums + [ir.Constant(_V8I32, [0] * 8)] * (4 - len(sums))
    shuf = lambda u, v, idx: builder.shuffle_vector(u, v, ir.Constant(ir.VectorType(_I32, len(idx)), idx))  # noqa: E731
    # per 128-bit half: [s0 02, s1 02, s0 13, s1 13] (and s2, s3's), then [s0 0123, s1 .., s2 .., s3 ..]
    pairs = [builder.add(shuf(sums[i], sums[i + 1], [0, 8, 1, 9, 4, 12, 5, 13]),
                         shuf(sums[i], sums[i + 1], [2, 10, 3, 11, 6, 14, 7, 15])) for i in (0, 2)]
    h = builder.add(shuf(pairs[0], pairs[1], [0, 1, 8, 9, 4, 5, 12, 13]),
                    shuf(pairs[0], pairs[1], [2, 3, 10, 11, 6, 7, 14, 15]))
    return builder.add(shuf(h, h, [0, 1, 2, 3]), shuf(h, h, [4, 5, 6, 7]))


def _quad_isums(builder, fmt: int, w, x, b0, blocks: int):
    """<4 x i32>: the integer sums of blocks b0 .. b0 + 3 (the first `blocks`, 2 or 4, read; the rest 0)."""
    return _quad_isums_of(builder, _quad_codes(builder, fmt, w, b0, blocks), x, b0)


def _data(context, builder, ty, val):
    return cgutils.create_struct_proxy(ty)(context, builder, value=val)


@intrinsic
def _row_dot_avx2(typingctx, fmt, w, x, dw, dx, mw, sx):
    """float32 row dot product (gemv_q8x's float order): fmt a literal format code; w the weight row's bytes, x the
    int16 codes (nblk2 * 32, WORDS_ORDER), dw / mw the row's scales, dx / sx x's (nblk4; 1-D C arrays)."""
    if not isinstance(fmt, types.IntegerLiteral):
        return None
    code = fmt.literal_value

    def codegen(context, builder, sig, args):
        ptrs = [_data(context, builder, t, a).data for t, a in zip(sig.args[1:], args[1:])]
        nblk2 = builder.udiv(_data(context, builder, sig.args[2], args[2]).nitems, _c64(32))
        return GQ.emit_row_dot(builder, code, _quad_isums, *ptrs, nblk2)

    return types.float32(fmt, w, x, dw, dx, mw, sx), codegen


@intrinsic
def _row_isums_avx2(typingctx, fmt, w, x, out):
    """out int32 [nblk4] = the row's integer block sums, from _row_dot_avx2's emitter (for the tests)."""
    if not isinstance(fmt, types.IntegerLiteral):
        return None
    code = fmt.literal_value

    def codegen(context, builder, sig, args):
        wp, xp, op = [_data(context, builder, t, a).data for t, a in zip(sig.args[1:], args[1:])]
        nblk2 = builder.udiv(_data(context, builder, sig.args[2], args[2]).nitems, _c64(32))

        def body(b0, blocks: int) -> None:
            p = builder.bitcast(builder.gep(op, [b0]), ir.VectorType(_I32, 4).as_pointer())
            builder.store(_quad_isums(builder, code, wp, xp, b0, blocks), p, align=4)

        GQ.for_quads(builder, nblk2, body)
        return context.get_dummy_value()

    return types.none(fmt, w, x, out), codegen


def _emit_rows_dot(builder, fmt: int, qs, x, dw, dx, mw, sx, y, r0, r1, m, qrow, xrow, srow, n_out) -> None:
    """y[t * n_out + r] = weight row r's dot product with x's row t (emit_row_dot's arithmetic), for t < m and r0 <=
    r < r1: x's rows (int16, xrow codes apart; dx / sx rows srow apart) in tiles of _TILE, then a pair and a single
    row as m leaves them; each tile passes over the weight rows (qrow bytes, scales srow apart) unpacking each
    quad's codes once, while its x rows stay in L1. Each row of x keeps its own accumulators, updated in the 1-row
    order, so its result is that row's alone."""
    fma4 = GQ.fn(builder, "llvm.fma.v4f32", _V4F32, [_V4F32] * 3)
    zero4 = ir.Constant(_V4F32, [0.0] * 4)
    nblk2 = builder.udiv(xrow, _c64(32))

    def rows(t0, nt: int) -> None:  # rows t0 .. t0 + nt - 1, nt a constant: their accumulators in registers
        ts = [builder.add(t0, _c64(t)) for t in range(nt)]
        xs = [builder.gep(x, [builder.mul(t, xrow)]) for t in ts]
        dxs, sxs = [[builder.gep(p, [builder.mul(t, srow)]) for t in ts] for p in (dx, sx)]
        acc = [cgutils.alloca_once(builder, _V4F32) for _ in ts]
        off = [cgutils.alloca_once(builder, _V4F32) for _ in ts]
        with cgutils.for_range_slice(builder, r0, r1, _c64(1)) as (r, _):
            w = builder.gep(qs, [builder.mul(r, qrow)])
            dwr, mwr = [builder.gep(p, [builder.mul(r, srow)]) for p in (dw, mw)]
            for a in acc + off:
                builder.store(zero4, a)

            def quad(b0, blocks: int) -> None:
                codes = _quad_codes(builder, fmt, w, b0, blocks)  # once for the tile's rows
                dwq = GQ.load4h(builder, dwr, b0)
                mwq = GQ.load4h(builder, mwr, b0) if fmt == 1 else None  # widened once for the tile's rows, as d
                for t in range(nt):
                    isum = builder.sitofp(_quad_isums_of(builder, codes, xs[t], b0), _V4F32)
                    dd = builder.fmul(dwq, GQ._load4f(builder, dxs[t], b0))
                    builder.store(builder.call(fma4, [isum, dd, builder.load(acc[t])]), acc[t])
                    if fmt == 1:
                        mo = [mwq, GQ._load4f(builder, sxs[t], b0), builder.load(off[t])]
                        builder.store(builder.call(fma4, mo), off[t])

            GQ.for_quads(builder, nblk2, quad)
            for t in range(nt):
                v = GQ.row_total(builder, fmt, builder.load(acc[t]), builder.load(off[t]))
                builder.store(v, builder.gep(y, [builder.add(builder.mul(ts[t], n_out), r)]))

    tiles = builder.udiv(m, _c64(_TILE))
    with cgutils.for_range(builder, tiles) as tile:
        rows(builder.mul(tile.index, _c64(_TILE)), _TILE)
    left = builder.urem(m, _c64(_TILE))  # a pair and a single row, not a body for each of 1 .. 3 rows: compile time
    with builder.if_then(builder.icmp_unsigned(">=", left, _c64(2))):
        rows(builder.mul(tiles, _c64(_TILE)), 2)
    with builder.if_then(builder.trunc(left, ir.IntType(1))):
        rows(builder.sub(m, _c64(1)), 1)


@intrinsic
def _rows_dot_avx2(typingctx, fmt, qs, x, dw, dx, mw, sx, y, r0, r1):
    """y[t, r] = _row_dot_avx2(fmt, qs[r], x[t], dw[r], dx[t], mw[r], sx[t]) bit for bit for every row t of x and r0
    <= r < r1, each weight quad unpacked once for up to _TILE rows: the arrays 2-D C, r0 / r1 integers."""
    if not isinstance(fmt, types.IntegerLiteral) or any(a.layout != "C" for a in (qs, x, dw, dx, mw, sx, y)):
        return None
    code = fmt.literal_value

    def codegen(context, builder, sig, args):
        arys = [_data(context, builder, t, a) for t, a in zip(sig.args[1:8], args[1:8])]
        qrow = cgutils.unpack_tuple(builder, arys[0].shape, 2)[1]
        m, xrow = cgutils.unpack_tuple(builder, arys[1].shape, 2)
        srow = cgutils.unpack_tuple(builder, arys[3].shape, 2)[1]
        n_out = cgutils.unpack_tuple(builder, arys[6].shape, 2)[1]
        r0, r1 = [context.cast(builder, v, t, types.int64) for v, t in zip(args[8:], sig.args[8:])]
        _emit_rows_dot(builder, code, *[a.data for a in arys], r0, r1, m, qrow, xrow, srow, n_out)
        return context.get_dummy_value()

    return types.none(fmt, qs, x, dw, dx, mw, sx, y, r0, r1), codegen


# ---------------------------------------------------------------- the GEMV: output rows split over threads
# weight rows a decode step's thread prefetches ahead of the row it reads (288-768 bytes a row at SmolLM2's shapes):
# 4-8 measured best, 16 and 32 nearer no prefetch, prefetchnta as fast as prefetcht0 (BENCHMARKS.md)
_PREFETCH_ROWS = 8


@njit(parallel=True, cache=True)
def _gemv_avx2(fmt, x, qs, dw, mw, xq, dx, sx, y, nth):
    quantize_x(x, xq, dx, sx)  # serially here: one numba dispatch a GEMV, as gemv_q8x
    n_out, m = qs.shape[0], xq.shape[0]
    nsup = max(1, min(n_out, nth))
    per = (n_out + nsup - 1) // nsup
    for s in prange(nsup):
        lo, hi = s * per, min(n_out, (s + 1) * per)
        if m == 1:  # a decode step: the row dot alone, without the tiles' setup (2-3% of its ~25 ns a row)
            for r in range(lo, hi):
                if r + _PREFETCH_ROWS < hi:  # a row's lines (consecutive rows cover a line two rows share) and scales
                    for o in range(0, qs.shape[1], 64):
                        prefetch(qs, r + _PREFETCH_ROWS, o)
                    prefetch(dw, r + _PREFETCH_ROWS, 0)
                    if fmt == 1:
                        prefetch(mw, r + _PREFETCH_ROWS, 0)
                if fmt == 0:
                    y[0, r] = _row_dot_avx2(0, qs[r], xq[0], dw[r], dx[0], mw[r], sx[0])
                elif fmt == 1:
                    y[0, r] = _row_dot_avx2(1, qs[r], xq[0], dw[r], dx[0], mw[r], sx[0])
                else:
                    y[0, r] = _row_dot_avx2(2, qs[r], xq[0], dw[r], dx[0], mw[r], sx[0])
            continue
        for r0 in range(lo, hi, _RBLOCK):
            r1 = min(hi, r0 + _RBLOCK)
            if fmt == 0:
                _rows_dot_avx2(0, qs, xq, dw, dx, mw, sx, y, r0, r1)
            elif fmt == 1:
                _rows_dot_avx2(1, qs, xq, dw, dx, mw, sx, y, r0, r1)
            else:
                _rows_dot_avx2(2, qs, xq, dw, dx, mw, sx, y, r0, r1)


@njit(parallel=True, cache=True)
def _gemv_portable(fmt, x, qs, dw, mw, xq, dx, sx, y, nth):
    quantize_x_in_order(x, xq, dx, sx)
    n_out, m = qs.shape[0], xq.shape[0]
    nsup = max(1, min(n_out, nth))
    per = (n_out + nsup - 1) // nsup
    for s in prange(nsup):
        for r in range(s * per, min(n_out, (s + 1) * per)):
            for t in range(m):
                y[t, r] = GQ._row_dot_portable(fmt, qs[r], xq[t], dw[r], dx[t], mw[r], sx[t])


@njit(cache=True)
def _isums_avx2(fmt, qs, xq, out):
    for r in range(qs.shape[0]):
        for t in range(xq.shape[0]):
            if fmt == 0:
                _row_isums_avx2(0, qs[r], xq[t], out[t, r])
            elif fmt == 1:
                _row_isums_avx2(1, qs[r], xq[t], out[t, r])
            else:
                _row_isums_avx2(2, qs[r], xq[t], out[t, r])


KERNELS = {"avx2": _gemv_avx2, "portable": _gemv_portable}


def block_isums(w_raw: np.ndarray, dtype: str, xq: np.ndarray) -> np.ndarray:
    """int32 [m, rows, nblk4]: the AVX2 path's integer block sums of w_raw's codes by xq (int16 [m, nblk2 * 32] in
    WORDS_ORDER, as quantize_x leaves them); blocks past the weight's are 0."""
    qs, _, _ = GQ.repack(w_raw, dtype)
    out = np.zeros((xq.shape[0], qs.shape[0], GQ.padded(qs.shape[1] // 16)[1]), np.int32)
    _isums_avx2(FORMATS[dtype], qs, np.ascontiguousarray(xq), out)
    return out


def prepare(w_raw, dtype: str, x2: np.ndarray, out2: np.ndarray, cache: dict | None = None, key=None,
            path: str | None = None):
    """A zero-argument callable writing out2 = mul_mat_q16x(w, x2) in place, or None where unsupported
    (gemv_q8x.prepare's arguments; the repacked weight is gemv_q8x's, under its cache key)."""
    shape = GQ.gemv_shape(w_raw, dtype, x2, out2, FORMATS)
    if shape is None:
        return None
    rows, n_in, m = shape
    qs, dw, mw = GQ.repacked(w_raw, dtype, cache, key)
    nblk2, nblk4 = GQ.padded(n_in // 32)
    xq = np.zeros((m, nblk2 * 32), np.int16)
    dx, sx = np.zeros((m, nblk4), np.float32), np.zeros((m, nblk4), np.float32)
    kernel, fmt = KERNELS[path or ("avx2" if AVX2 else "portable")], FORMATS[dtype]
    return GQ.bound_gemv(kernel, fmt, (x2, qs, dw, mw, xq, dx, sx, out2), m * rows)


def asm(path: str = "avx2") -> str:
    """The assembly of `path`'s kernel for the signature it was first called with, compiled afresh (numba keeps
    no assembly for kernels loaded from its cache)."""
    k = KERNELS[path]
    fresh = njit(parallel=True)(k.py_func)
    fresh.compile(k.signatures[0])
    return "\n".join(fresh.inspect_asm().values())
