"""A prototype q4_1 decode GEMV with int16 activations, checked and timed against the f32 and q8x paths (issue 13).

    python benchmarks/bench_gemv_q16x.py [--reps 300] [--rounds 10] [--threads 1,2]
    python benchmarks/bench_gemv_q16x.py --check-only [--plant-bug drop-min|signed]   (the check must then fail)

Question: 12-bit block codes of x meet issue 13's greedy rule where 8-bit ones do not (BENCHMARKS.md, "q8-activations
against issue 13's greedy rule"); is a kernel with 16-bit codes fast enough to matter? Not library code: nothing
here is reachable from graphir.

Arithmetic (gemv_q8x.py's, with 16-bit codes). x per 32-block b: d = max |x| / 32767, q = round half away from
zero of x * (1 / d) (q8x's quantizer with 32767 for 127), sx = fl(d * sum q). Weight: gemv_q8x.repack's q4_1
layout as it is (32 bytes hold a pair of blocks: byte j's low nibble is element j of block 2k, its high nibble
element j of block 2k + 1). `vpmaddwd` of int16 nibbles c (0..15) with q gives int32 pair sums: exact, |pair| <=
2 * 15 * 32767 < 2^31, a block's sum <= 32 * 15 * 32767 = 15,728,160 < 2^24, so exact as f32 too. Two ways to get
the nibbles into int16 lanes:
  * "words": the 32 bytes loaded as 16 words; word i's nibbles, low to high, are element 2i of the first block,
    2i of the second, 2i + 1 of the first, 2i + 1 of the second, taken out by shifts of 0 / 4 / 8 / 12 and a mask:
    no widening. x's codes are stored to match, each block evens then odds (the quantizer's write order; free).
  * "zext": two 16-byte loads widened (`vpmovzxbw`), masked and shifted; x in element order.
Against q8x: x's codes twice the bytes; two `vpmaddwd` a block where q8x has a `vpmaddubsw` and a `vpmaddwd` (with
ones), so as many multiply-adds, and (words) 6 shift / mask ops a block pair against q8x's 3. The four-block
reduction and the float order are q8x's:
  a_e = fma(f32(isum_b), fl(d_w[b] * d_x[b]), a_e); o_e = fma(m_w[b], sx[b], o_e);
  y = (a_0 + a_1) + (a_2 + a_3) + ((o_0 + o_1) + (o_2 + o_3)).

The check (always run first): x's codes, d and sx equal a numpy quantizer's bit for bit; the kernel's integer block
sums (a second intrinsic over the same emitter) equal numpy's int64 ones; y within (nquad + 6) 2^-24 sum |terms|
of the same terms summed in float64 (the bound tests/test_cpu_gemv_q8x.py derives), at SmolLM2's q4_1 shapes and
odd block counts, for both layouts; every vpmaddwd of the GEMV is on ymm registers. --plant-bug builds the words
kernel with q4_1's min term dropped, or its top nibble shifted arithmetically (negative codes): the check fails.
"""

from __future__ import annotations

import argparse
import re

import numba
import numpy as np
from bench_gemv_q8x import best_ns
from graphir.backends.cpu import gemv_q8x as GQ
from graphir.backends.cpu import gemv_repacked as GR
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from graphir.quant import random_quantized

SHAPES = [("attn_qkv", 960, 576), ("attn_output", 576, 576), ("ffn_gate_up", 3072, 576), ("ffn_down", 576, 1536)]
ODD_SHAPES = [(7, 96), (3, 160), (5, 32)]  # 3 blocks (one quad), 5 (a quad and the tail pair), 1
LAYOUTS = ("words", "zext")  # how the nibbles become int16 lanes (module docstring)
BUGS = ("none", "drop-min", "signed")  # planted: no min term; the top nibble sign-extended (sext / ashr)
_I16, _I32 = ir.IntType(16), ir.IntType(32)
_V16I8, _V16I16, _V8I32, _V4F32 = (ir.VectorType(ir.IntType(8), 16), ir.VectorType(_I16, 16),
                                   ir.VectorType(_I32, 8), ir.VectorType(ir.FloatType(), 4))
_I64 = ir.IntType(64)


# ---------------------------------------------------------------- x's 16-bit codes
# gemv_q8x.quantize_blocks with qmax 32767; "words" stores each block's codes evens then odds
# (element j at j // 2 + 16 (j % 2)), the order its kernel reads them in.
WORDS_ORDER = np.array([j // 2 + 16 * (j % 2) for j in range(32)])
Q16_MAX = np.float32(32767.0)


# ---------------------------------------------------------------- the AVX2 row dot product, in LLVM IR
def _c64(v: int):
    return ir.Constant(_I64, v)


def _pair_codes(builder, w, b, layout: str, bug: str):
    """codes[e][h] <16 x i16>: block b + e's codes that meet x's 16 codes at block positions 16h .. 16h + 15."""
    if layout == "words":  # word k = byte 2k | byte 2k+1 << 8, its nibbles elements 2k (b), 2k (b+1), 2k+1 (b), (b+1)
        p = builder.bitcast(builder.gep(w, [builder.mul(b, _c64(16))]), _V16I16.as_pointer())
        v = builder.load(p, align=1)
        m15 = ir.Constant(_V16I16, [15] * 16)
        sh = lambda n: ir.Constant(_V16I16, [n] * 16)
        top = builder.ashr(v, sh(12)) if bug == "signed" else builder.lshr(v, sh(12))
        return [[builder.and_(v, m15), builder.and_(builder.lshr(v, sh(8)), m15)],
                [builder.and_(builder.lshr(v, sh(4)), m15), top]]
    widen = builder.sext if bug == "signed" else builder.zext
    codes = [[], []]  # low nibbles block b, high nibbles block b + 1, elements in order
    for h in range(2):
        p = builder.bitcast(builder.gep(w, [builder.add(builder.mul(b, _c64(16)), _c64(16 * h))]), _V16I8.as_pointer())
        v = widen(builder.load(p, align=1), _V16I16)
        codes[0].append(builder.and_(v, ir.Constant(_V16I16, [15] * 16)))
        codes[1].append(builder.lshr(v, ir.Constant(_V16I16, [4] * 16)))
    return codes


def _pair_isums16(builder, w, x, b, layout: str, bug: str):
    """[<8 x i32>] * 2: blocks b and b + 1 (b even), lane l = the sum over 4 of the block's nibble * x code products."""
    madd = GQ._fn(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
    codes = _pair_codes(builder, w, b, layout, bug)

    def xload(e, h):
        off = builder.add(builder.mul(builder.add(b, _c64(e)), _c64(32)), _c64(16 * h))
        return builder.load(builder.bitcast(builder.gep(x, [off]), _V16I16.as_pointer()), align=2)

    return [builder.add(*[builder.call(madd, [codes[e][h], xload(e, h)]) for h in range(2)]) for e in range(2)]


def _quad_isums16(builder, w, x, b0, blocks: int, variant: tuple[str, str]):
    """<4 x i32>: the integer sums of blocks b0 .. b0 + 3 (the first `blocks`, 2 or 4, read; the rest 0)."""
    sums = []
    for p in range(blocks // 2):
        sums += _pair_isums16(builder, w, x, builder.add(b0, _c64(2 * p)), *variant)
    sums += [ir.Constant(_V8I32, [0] * 8)] * (4 - len(sums))
    hadd = GQ._fn(builder, "llvm.x86.avx2.phadd.d", _V8I32, [_V8I32, _V8I32])
    h = builder.call(hadd, [builder.call(hadd, sums[:2]), builder.call(hadd, sums[2:])])  # as gemv_q8x._quad_isums
    half = lambda lo: builder.shuffle_vector(h, h, ir.Constant(ir.VectorType(_I32, 4), list(range(lo, lo + 4))))
    return builder.add(half(0), half(4))


def _for_quads(builder, w, x, nblk2, variant: tuple[str, str], body) -> None:
    """body(b0, <4 x i32> isums) for each quad of blocks, then for the last pair (nblk2 % 4 == 2)."""
    nquad = builder.udiv(nblk2, _c64(4))
    with cgutils.for_range(builder, nquad) as loop:
        b0 = builder.mul(loop.index, _c64(4))
        body(b0, _quad_isums16(builder, w, x, b0, 4, variant))
    with builder.if_then(builder.icmp_unsigned("!=", builder.urem(nblk2, _c64(4)), _c64(0))):
        b0 = builder.mul(nquad, _c64(4))
        body(b0, _quad_isums16(builder, w, x, b0, 2, variant))


def _emit_row_dot16(builder, variant: tuple[str, str], w, x, dw, dx, mw, sx, nblk2):
    fma4 = GQ._fn(builder, "llvm.fma.v4f32", _V4F32, [_V4F32] * 3)
    zero4 = ir.Constant(_V4F32, [0.0] * 4)
    acc, off = cgutils.alloca_once_value(builder, zero4), cgutils.alloca_once_value(builder, zero4)

    def body(b0, isum):
        dd = builder.fmul(GQ._load4f(builder, dw, b0), GQ._load4f(builder, dx, b0))
        builder.store(builder.call(fma4, [builder.sitofp(isum, _V4F32), dd, builder.load(acc)]), acc)
        if variant[1] != "drop-min":
            mterm = [GQ._load4f(builder, mw, b0), GQ._load4f(builder, sx, b0), builder.load(off)]
            builder.store(builder.call(fma4, mterm), off)

    _for_quads(builder, w, x, nblk2, variant, body)

    def total(v):
        e = [builder.extract_element(v, ir.Constant(_I32, i)) for i in range(4)]
        return builder.fadd(builder.fadd(e[0], e[1]), builder.fadd(e[2], e[3]))

    return builder.fadd(total(builder.load(acc)), total(builder.load(off)))


def _data(context, builder, ty, val):
    return cgutils.create_struct_proxy(ty)(context, builder, value=val)


@intrinsic
def _row_dot16(typingctx, variant, w, x, dw, dx, mw, sx):
    """float32 row dot product: variant a literal (variant_code), w the row's bytes, x the int16 codes (nblk2 * 32),
    dw / mw the row's scales, dx / sx x's (nblk4; 1-D C arrays)."""
    if not isinstance(variant, types.IntegerLiteral):
        return None
    v = variant_of(variant.literal_value)

    def codegen(context, builder, sig, args):
        ptrs = [_data(context, builder, t, a).data for t, a in zip(sig.args[1:], args[1:])]
        n = _data(context, builder, sig.args[2], args[2]).nitems
        return _emit_row_dot16(builder, v, *ptrs, builder.udiv(n, ir.Constant(n.type, 32)))

    return types.float32(variant, w, x, dw, dx, mw, sx), codegen


@intrinsic
def _row_isums16(typingctx, variant, w, x, out):
    """out int32 [nblk4] = the row's integer block sums, from the same emitter as _row_dot16."""
    if not isinstance(variant, types.IntegerLiteral):
        return None
    v = variant_of(variant.literal_value)

    def codegen(context, builder, sig, args):
        wp, xp, op = [_data(context, builder, t, a).data for t, a in zip(sig.args[1:], args[1:])]
        nblk2 = builder.udiv(_data(context, builder, sig.args[2], args[2]).nitems, _c64(32))

        def body(b0, isum):
            p = builder.bitcast(builder.gep(op, [b0]), ir.VectorType(_I32, 4).as_pointer())
            builder.store(isum, p, align=4)

        _for_quads(builder, wp, xp, nblk2, v, body)
        return context.get_dummy_value()

    return types.none(variant, w, x, out), codegen


# ---------------------------------------------------------------- the GEMV: output rows split over threads
def variant_code(layout: str, bug: str = "none") -> int:
    return LAYOUTS.index(layout) * len(BUGS) + BUGS.index(bug)


def variant_of(code: int) -> tuple[str, str]:
    return LAYOUTS[code // len(BUGS)], BUGS[code % len(BUGS)]


def make_gemv(code: int):
    """The GEMV of variant `code` (a closure constant, so the intrinsics see it as a literal)."""
    order = WORDS_ORDER if variant_of(code)[0] == "words" else GQ.IN_ORDER

    @njit(parallel=True)
    def gemv(x, qs, dw, mw, xq, dx, sx, y, nth):
        GQ.quantize_blocks(x, xq, dx, sx, Q16_MAX, order)  # serially here, as gemv_q8x: one dispatch a GEMV
        n_out, m = qs.shape[0], xq.shape[0]
        nsup = max(1, min(n_out, nth))
        per = (n_out + nsup - 1) // nsup
        for s in prange(nsup):
            for r in range(s * per, min(n_out, (s + 1) * per)):
                for t in range(m):
                    y[t, r] = _row_dot16(code, qs[r], xq[t], dw[r], dx[t], mw[r], sx[t])

    @njit
    def isums(qs, xq, out):
        """out int32 [m, n_out, nblk4]: every row's integer block sums against every x row's codes."""
        for r in range(qs.shape[0]):
            for t in range(xq.shape[0]):
                _row_isums16(code, qs[r], xq[t], out[t, r])

    return gemv, isums


_KERNELS: dict[int, tuple] = {}


def kernels(code: int) -> tuple:
    if code not in _KERNELS:
        _KERNELS[code] = make_gemv(code)
    return _KERNELS[code]


class Q16x:
    """The prototype bound to one q4_1 weight and one x / y pair (as gemv_q8x.prepare, without its checks)."""

    def __init__(self, w_raw: np.ndarray, x2: np.ndarray, out2: np.ndarray, code: int = 0):
        self.qs, self.dw, self.mw = GQ.repack(w_raw, "q4_1")
        m, n_in = x2.shape
        nblk2, nblk4 = GQ.padded(n_in // 32)
        self.xq = np.zeros((m, nblk2 * 32), np.int16)
        self.dx, self.sx = np.zeros((m, nblk4), np.float32), np.zeros((m, nblk4), np.float32)
        self.x2, self.out2 = x2, out2
        self.gemv, self.isum_kernel = kernels(code)
        self.words = variant_of(code)[0] == "words"

    def __call__(self) -> None:
        self.gemv(self.x2, self.qs, self.dw, self.mw, self.xq, self.dx, self.sx, self.out2,
                  numba.get_num_threads())

    def isums(self) -> np.ndarray:
        """int32 [m, n_out, nblk4] of the last call's x codes."""
        out = np.zeros((self.xq.shape[0], self.qs.shape[0], self.dx.shape[1]), np.int32)
        self.isum_kernel(self.qs, self.xq, out)
        return out


# ---------------------------------------------------------------- the numpy formula of the same arithmetic
def numpy_quantize16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int64 [m, nblk, 32], d f32 [m, nblk], sx f32 [m, nblk]): gemv_q8x.quantize_blocks' arithmetic
    (qmax 32767) in numpy f32."""
    m, n_in = x.shape
    xb = x.reshape(m, n_in // 32, 32)
    d = np.abs(xb).max(axis=-1) / np.float32(32767)
    with np.errstate(divide="ignore"):
        inv = np.where(d >= np.finfo(np.float32).tiny, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = xb * inv[..., None]
    a = np.abs(v)
    f = np.floor(a)
    q = (f.astype(np.int64) + (a - f >= np.float32(0.5))) * np.where(v < 0, -1, 1)
    return q, d, d * q.sum(-1).astype(np.float32)


def numpy_q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d f32 [rows, nblk], m f32 [rows, nblk], codes int64 [rows, nblk, 32]) from ggml's 20-byte q4_1 blocks."""
    b = raw.reshape(raw.shape[0], -1, 20)
    f16 = lambda lo: b[..., lo:lo + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:].astype(np.int64)
    return f16(0), f16(2), np.concatenate([qs & 15, qs >> 4], axis=-1)


def check(n_out: int, n_in: int, m: int, code: int, rng: np.random.Generator) -> dict:
    """Assert the kernel against the numpy formula on one random weight; return its errors (see module doc)."""
    raw = random_quantized(rng, "q4_1", (n_out, n_in))
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    x[0, -1] = 40.0  # an outlier
    if n_in >= 64:
        x[-1, 32:64] = 0.0  # a block with scale 0
    if m > 1:  # rounding cases in a block whose max is 32767 (scale 1)
        x[1, :7] = [32767.0, 2.5, -2.5, 0.5, -0.5, 0.49999997, -32766.5]
    y = np.full((m, n_out), np.nan, np.float32)
    k = Q16x(raw, x, y, code)
    k()
    nblk, nquad = n_in // 32, -(-n_in // 128)
    q, d, sx = numpy_quantize16(x)
    stored = k.xq[:, :n_in].reshape(q.shape)
    if k.words:
        stored = stored[..., np.arange(32) // 2 + 16 * (np.arange(32) % 2)]  # element j at j // 2 + 16 (j % 2)
    assert np.array_equal(stored, q) and not k.xq[:, n_in:].any(), "x codes"
    assert np.array_equal(k.dx[:, :nblk], d) and np.array_equal(k.sx[:, :nblk], sx), "x scales"
    dw, mw, c = numpy_q4_1(raw)
    isum = np.einsum("obi,tbi->tob", c, q)  # [m, n_out, nblk], exact
    assert np.array_equal(k.isums()[..., :nblk], isum), "integer block sums"
    terms = isum * (dw[None] * d[:, None]).astype(np.float64) + (mw[None] * sx[:, None]).astype(np.float64)
    ref = terms.sum(-1)
    err = np.abs(y - ref)
    bound = (nquad + 6) * 2.0 ** -24 * np.abs(terms).sum(-1)
    assert np.all(err <= bound), f"y: max error / bound {np.max(err / bound):.3g}"
    exact = x.astype(np.float64) @ (dw[..., None] * c + mw[..., None]).reshape(n_out, n_in).T.astype(np.float64)
    y8 = np.empty_like(y)
    GQ.prepare(raw, "q4_1", x, y8, path="avx2")()
    rel = lambda v: float(np.linalg.norm(v[0] - exact[0]) / np.linalg.norm(exact[0]))  # row 0: no 32767s
    return {"err_over_bound": float(np.max(err / bound)), "rel_q16x": rel(y), "rel_q8x": rel(y8)}


def check_all(code: int) -> None:
    print(f"check {variant_of(code)}:")
    rng = np.random.default_rng(1)
    for n_out, n_in in [s[1:] for s in SHAPES] + ODD_SHAPES:
        for m in (1, 2):
            r = check(n_out, n_in, m, code, rng)
            print(f"check [{n_out} x {n_in}] m={m}: ok, max |y - ref| / bound {r['err_over_bound']:.3f}, "
                  f"row 0's rel L2 error vs the f32-x product {r['rel_q16x']:.1e} (q8x: {r['rel_q8x']:.1e})")


def check_asm(code: int) -> None:
    """vpmaddwd on ymm registers only, in numba's assembly of the GEMV (compiled above; the row loop read by eye)."""
    text = "\n".join(kernels(code)[0].inspect_asm().values())
    ymm = re.findall(r"vpmaddwd\s+[^\n]*%ymm", text)
    xmm = re.findall(r"vpmaddwd\s+[^\n]*%xmm", text)
    print(f"asm {variant_of(code)}: {len(ymm)} vpmaddwd on ymm, {len(xmm)} on xmm, {text.count('vpmovzxbw')} vpmovzxbw")
    assert ymm and not xmm, "vpmaddwd on 256-bit registers"


# ---------------------------------------------------------------- timing
def time_shapes(reps: int, rounds: int, threads: list[int]) -> None:
    rng = np.random.default_rng(0)
    print("| shape | threads | f32 path | q8x | q16x words | q16x zext | words / q8x | f32 / words |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, n_out, n_in in SHAPES:
        raw = random_quantized(rng, "q4_1", (n_out, n_in))
        x = rng.standard_normal((1, n_in)).astype(np.float32)
        ys = [np.empty((1, n_out), np.float32) for _ in range(4)]
        runs = {"f32": GR.prepare(raw, "q4_1", x, ys[0]), "q8x": GQ.prepare(raw, "q4_1", x, ys[1], path="avx2"),
                "words": Q16x(raw, x, ys[2], variant_code("words")), "zext": Q16x(raw, x, ys[3], variant_code("zext"))}
        blocks = n_out * n_in // 32
        for th in threads:
            numba.set_num_threads(th)
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(rounds):  # interleaved: a slow spell of the machine lands on all four
                for k, run in runs.items():
                    best[k] = min(best[k], best_ns(run, max(1, reps // rounds)) / blocks)
            a, b, c, z = best["f32"], best["q8x"], best["words"], best["zext"]
            print(f"| {name} [{n_out} x {n_in}] | {th} | {a:.2f} | {b:.2f} | {c:.2f} | {z:.2f} | {c / b:.2f} "
                  f"| {a / c:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--plant-bug", choices=BUGS[1:], help="in the words layout (the check must then fail)")
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    assert GQ.AVX2, "the prototype is AVX2 only"
    codes = [variant_code("words", args.plant_bug)] if args.plant_bug else [variant_code(lo) for lo in LAYOUTS]
    for code in codes:
        check_all(code)
        check_asm(code)
    if not args.check_only:
        time_shapes(args.reps, args.rounds, [int(t) for t in args.threads.split(",")])


if __name__ == "__main__":
    main()
