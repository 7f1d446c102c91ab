"""CPU matmul kernels (numba): y = x @ W.T with W stored in a ggml dtype.

W is [n_out, n_in] in its storage form (graphir/weights.py): float32, float16 (or its
uint16 bits), uint16 raw bf16 bits, or uint8 [n_out, row_bytes] ggml blocks. x is
float32 [..., n_in]; y is float32 [..., n_out]. `get_rows` dequantizes chosen rows
(token embeddings).

How it works
------------
Quantized blocks are read directly; the whole weight is never dequantized. The work
is split over threads (prange) by tiles of weight rows. A tile is dequantized into a
small float32 buffer, then multiplied with the tokens:
  * 1-3 tokens (decode): 4-row tiles (the buffer stays in L1).
  * more tokens (prefill): tiles of about 128 KiB of float32 (L2), so each
    dequantized block is reused by every token.
Both multiply with `_dot`: token pairs in a 4-row x 2-token register block, a lone token
(a decode step's) in an 8-row block; both keep 8 sums in an inner loop over n_in that
vectorizes to FMAs alike, so each token's sums are the same whatever the call's token
count (a speculative verify call's rows are the decode steps' bit for bit).
Accumulation is float32 from float32 activations, so results match an f32
dequantized reference to ~1e-6 of max|y|. The llama.cpp scheme (activations
quantized to 8 bits per 32-block, integer block dot products) was measured 2x
slower here: numba cannot emit vpmaddubsw, and the per-block integer reductions
cost more than the float conversions they save.

Why generated source: LLVM's SLP vectorizer (off by default in numba; switched on
only while this module compiles, see `_compile`) packs a block's unpacking into
SIMD only when all of the block's byte loads come before its float stores (numba
arrays carry no aliasing information). The dequantizers are therefore emitted as
straight-line "load everything, then store" code, and exec'd with this file as
their filename so numba's on-disk cache treats them like hand-written functions.

One kernel per (dtype, mode), mode "gemv" (few tokens), "tile" (prefill) or
"rows" (get_rows, the one serial kernel), each compiled when a weight first needs it: numba re-optimizes every
callee inside each parallel kernel that calls it, so the one kernel that used to serve
all 12 dtypes and 3 modes took 14 s to compile on two cores, while SmolLM2's prefill
needs two of these (q4_1 tile, q8_0 rows) at 1-4 s each. Each has exactly one signature
(weights typed read-only, so np.memmap weights and writeable arrays share the machine
code); a second process loads it from numba's cache in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
from numba import njit, prange  # noqa: F401  (prange is used by the generated kernel)
from numba.core import config as _nb_config
from numba.np.ufunc import parallel as numba_parallel

from graphir.errors import GraphError

from . import direct_call, precompile
from .lazy_table import LazyTable
from .stack_array import stack_f32  # noqa: F401  (used by the generated get_rows kernels)

CACHE_DEPENDS = ("stack_array.py",)  # compiled into the get_rows kernels

__all__ = ["matmul", "prepare_matmul", "get_rows", "SUPPORTED"]

# f16 bit pattern -> float32 (ggml keeps the same table).
_F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
# IQ4_NL / IQ4_XS non-linear 4-bit code book.
_KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)

# elements per block, bytes per block (as graphir.dtypes; the float types count as 1-element blocks)
_LAYOUT = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q8_0": (32, 34),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
    "iq4_xs": (256, 136),
}
SUPPORTED = tuple(_LAYOUT)
_STORAGE = {"f32": np.float32, "f16": np.uint16, "bf16": np.uint16}

MV_MAX_TOKENS = 3  # up to this many tokens take the GEMV path (measured crossover with the tiled path)
# rows per tile on the GEMV and get_rows paths (4 x n_in floats stay in L1). A decode step's 8-row block
# (_dot_octet) then sums 4 rows twice; 8-row tiles, which would not, measured slower for SmolLM2 F32 decode
# (2026-12-03, 4 rounds: 32.8-35.3 ms against 25.6-29.6 before _dot, where 4-row tiles gave 27.0-28.6)
GEMV_ROWS = 4
TILE_BYTES = 131072  # target float32 bytes of a prefill tile (L2-resident)


@njit(cache=True)
def _tile_rows(n_out, n_tok, n_in, nth):
    """Rows per tile on the tiled path: ~TILE_BYTES, at least two tiles per thread, a multiple of 4."""
    if n_tok <= 4:
        return 8
    rt = max(4, min(64, TILE_BYTES // 4 // n_in // 4 * 4))
    return max(4, min(rt, (n_out + 2 * nth - 1) // (2 * nth) // 4 * 4))


@njit(fastmath=True, cache=True)
def _dot_octet(buf, nr, x, y, r0, g, t):
    """y[t, r0+g : r0+g+8] = x[t] @ buf[g:g+8].T, rows past nr read as row nr - 1 and not written: 8 sums, as in
    _dot's 4-row x 2-token block."""
    xt = x[t]
    last = nr - 1
    b0 = buf[min(g, last)]
    b1 = buf[min(g + 1, last)]
    b2 = buf[min(g + 2, last)]
    b3 = buf[min(g + 3, last)]
    b4 = buf[min(g + 4, last)]
    b5 = buf[min(g + 5, last)]
    b6 = buf[min(g + 6, last)]
    b7 = buf[min(g + 7, last)]
    f0 = np.float32(0.0)
    a0 = f0
    a1 = f0
    a2 = f0
    a3 = f0
    a4 = f0
    a5 = f0
    a6 = f0
    a7 = f0
    for i in range(xt.shape[0]):
        u = xt[i]
        a0 += b0[i] * u
        a1 += b1[i] * u
        a2 += b2[i] * u
        a3 += b3[i] * u
        a4 += b4[i] * u
        a5 += b5[i] * u
        a6 += b6[i] * u
        a7 += b7[i] * u
    acc = (a0, a1, a2, a3, a4, a5, a6, a7)
    for k in range(min(8, nr - g)):
        y[t, r0 + g + k] = acc[k]


@njit(fastmath=True, cache=True)
def _dot(buf, nr, x, y, r0):
    """y[:, r0:r0+nr] = x @ buf[:nr].T: token pairs in a 4-row x 2-token register block, a lone token (a decode
    step's, an odd call's last) in an 8-row block, rows past the last multiple of 4 in 8-row blocks too.

    Both blocks keep 8 sums in their inner loop, which fastmath lets LLVM split into vector partials the same way
    for each: a token's sums never depend on how many tokens the call has, so a speculative verify call's rows
    are the decode steps' bit for bit (tests/test_cpu_matmul.py). A 4-sum loop for few tokens was split otherwise."""
    n_tok, n_in = x.shape
    f0 = np.float32(0.0)
    full = nr // 4 * 4
    if n_tok == 1:
        for g in range(0, nr, 8):
            _dot_octet(buf, nr, x, y, r0, g, 0)
        return
    g = 0
    while g < full:
        b0 = buf[g]
        b1 = buf[g + 1]
        b2 = buf[g + 2]
        b3 = buf[g + 3]
        o = r0 + g
        t = 0
        while t + 2 <= n_tok:
            x0 = x[t]
            x1 = x[t + 1]
            a00 = f0
            a01 = f0
            a02 = f0
            a03 = f0
            a10 = f0
            a11 = f0
            a12 = f0
            a13 = f0
            for i in range(n_in):
                u = x0[i]
                v = x1[i]
                c0 = b0[i]
                c1 = b1[i]
                c2 = b2[i]
                c3 = b3[i]
                a00 += c0 * u
                a01 += c1 * u
                a02 += c2 * u
                a03 += c3 * u
                a10 += c0 * v
                a11 += c1 * v
                a12 += c2 * v
                a13 += c3 * v
            y[t, o] = a00
            y[t, o + 1] = a01
            y[t, o + 2] = a02
            y[t, o + 3] = a03
            y[t + 1, o] = a10
            y[t + 1, o + 1] = a11
            y[t + 1, o + 2] = a12
            y[t + 1, o + 3] = a13
            t += 2
        g += 4
    if n_tok % 2:
        for g in range(0, full, 8):
            _dot_octet(buf, full, x, y, r0, g, n_tok - 1)
    if full < nr:
        for t in range(n_tok):
            _dot_octet(buf[full:], nr - full, x, y, r0 + full, 0, t)


# --------------------------------------------------------------------------------------
# Dequantizer bodies (lists of source lines). Each writes one block -- or, for the float
# types, one whole row -- of `row` into `br`. In scope: row (the row's bytes), r16 (the
# row as uint16 words: every f16 field sits at an even offset), br (float32 output row),
# b (block index), tab (f16 -> f32 table), kv (iq4 code book), scr (float32[16] scratch),
# and the casts f32 / u8 / i8 / u32. Casting every integer result back to u8 keeps numba
# (which widens integer arithmetic to 64 bits) from producing 64-bit vector lanes.
# --------------------------------------------------------------------------------------


def _lo(v: str) -> str:
    return f"u8({v} & u8(15))"


def _hi(v: str) -> str:
    return f"u8({v} >> u8(4))"


def _body_q4(with_min: bool):
    """q4_0: d, qs[16], element d * q - 8 d; q4_1: d, m, qs[16], element d * q + m. Low nibbles are
    elements 0-15, high ones 16-31."""
    bb = 20 if with_min else 18
    L = [f"p = b * {bb}", "o = b * 32", f"d = tab[r16[b * {bb // 2}]]"]
    L.append(f"c = tab[r16[b * {bb // 2} + 1]]" if with_min else "c = np.float32(-8.0) * d")
    L += [f"q{j} = row[p + {bb - 16 + j}]" for j in range(16)]
    L += [f"br[o + {j}] = d * f32({_lo(f'q{j}')}) + c" for j in range(16)]
    L += [f"br[o + {16 + j}] = d * f32({_hi(f'q{j}')}) + c" for j in range(16)]
    return L


def _body_q5(with_min: bool):
    """q5_0: d, qh[4], qs[16]; q5_1: d, m, qh[4], qs[16]. Bit j of qh (LE uint32) is bit 4 of element j."""
    bb, qh = (24, 4) if with_min else (22, 2)
    L = [f"p = b * {bb}", "o = b * 32", f"d = tab[r16[b * {bb // 2}]]"]
    L.append(f"c = tab[r16[b * {bb // 2} + 1]]" if with_min else "c = np.float32(-16.0) * d")
    L += [f"h{k} = row[p + {qh + k}]" for k in range(4)]
    L += [f"q{j} = row[p + {qh + 4 + j}]" for j in range(16)]
    for j in range(16):
        bit = f"(((h{j >> 3} >> u8({j & 7})) & u8(1)) << u8(4))"  # element j: qh bit j
        L.append(f"br[o + {j}] = d * f32(u8({_lo(f'q{j}')} | {bit})) + c")
    for j in range(16):
        bit = f"(((h{2 + (j >> 3)} >> u8({j & 7})) & u8(1)) << u8(4))"  # element j + 16: qh bit j + 16
        L.append(f"br[o + {16 + j}] = d * f32(u8({_hi(f'q{j}')} | {bit})) + c")
    return L


def _body_q8_0():
    L = ["p = b * 34", "o = b * 32", "d = tab[r16[b * 17]]"]
    L += [f"q{j} = row[p + {2 + j}]" for j in range(32)]
    L += [f"br[o + {j}] = d * f32(i8(q{j}))" for j in range(32)]
    return L


def _kscales():
    """q4_k / q5_k: the 12 bytes at offset 4 pack 8 six-bit scales and mins -> scr[0:8] = d*sc, scr[8:16] = dmin*m."""
    L = [f"s{k} = row[p + {4 + k}]" for k in range(12)]
    for j in range(8):
        if j < 4:
            L.append(f"scr[{j}] = d * f32(u8(s{j} & u8(63)))")
            L.append(f"scr[{8 + j}] = dmin * f32(u8(s{j + 4} & u8(63)))")
        else:
            L.append(f"scr[{j}] = d * f32(u8((s{j + 4} & u8(15)) | ((s{j - 4} >> u8(6)) << u8(4))))")
            L.append(f"scr[{8 + j}] = dmin * f32(u8((s{j + 4} >> u8(4)) | ((s{j} >> u8(6)) << u8(4))))")
    return L


def _body_k(with_qh: bool):
    """q4_k: d, dmin, scales[12], qs[128]; q5_k: d, dmin, scales[12], qh[32], qs[128]. 64-element chunk c
    uses qs[32c:32c+32], low nibbles then high; q5_k takes bits 2c and 2c+1 of qh as their bit 4."""
    bb = 176 if with_qh else 144
    L = [f"p = b * {bb}", "o = b * 256", f"d = tab[r16[b * {bb // 2}]]", f"dmin = tab[r16[b * {bb // 2} + 1]]"]
    L += _kscales()
    L += ["for c in range(4):"]
    C = ["d1 = scr[2 * c]", "m1 = scr[8 + 2 * c]", "d2 = scr[2 * c + 1]", "m2 = scr[9 + 2 * c]"]
    C += [f"pc = p + {48 if with_qh else 16} + 32 * c", "oc = o + 64 * c"]
    if with_qh:
        C += ["s1 = u8(2 * c)", "s2 = u8(2 * c + 1)"]
        C += [f"h{i} = row[p + {16 + i}]" for i in range(32)]
    C += [f"q{i} = row[pc + {i}]" for i in range(32)]
    for half, (nibble, scale, low, shift) in enumerate(((_lo, "d1", "m1", "s1"), (_hi, "d2", "m2", "s2"))):
        for i in range(32):
            q = nibble(f"q{i}")
            if with_qh:
                q = f"u8({q} | (((h{i} >> {shift}) & u8(1)) << u8(4)))"
            C.append(f"br[oc + {32 * half + i}] = {scale} * f32({q}) - {low}")
    return L + ["    " + c for c in C]


def _body_q6_k():
    """ql[128], qh[64], scales[16] (int8), d. Each 128-element half n uses ql[64n:], qh[32n:], scales[8n:];
    element i of its 32-group k (k = 0..3) is (ql nibble | 2 qh bits << 4) - 32, scale index i // 16 + 2k."""
    L = ["p = b * 210", "o = b * 256", "d = tab[r16[b * 105 + 104]]"]
    L += [f"scr[{k}] = d * f32(i8(row[p + {192 + k}]))" for k in range(16)]
    L += ["for it in range(4):"]  # it = 2 * half + g; g picks elements [16g, 16g + 16) of each 32-group
    C = ["n = it >> 1", "g = it & 1", "pa = p + 64 * n + 16 * g", "ph = p + 128 + 32 * n + 16 * g"]
    C += ["oc = o + 128 * n + 16 * g", "k0 = 8 * n + g"]
    C += [f"e{k} = scr[k0 + {2 * k}]" for k in range(4)]
    C += [f"c{k} = np.float32(-32.0) * e{k}" for k in range(4)]
    C += [f"a{i} = row[pa + {i}]" for i in range(16)]
    C += [f"z{i} = row[pa + {32 + i}]" for i in range(16)]
    C += [f"h{i} = row[ph + {i}]" for i in range(16)]
    for i in range(16):
        C.append(f"br[oc + {i}] = e0 * f32(u8({_lo(f'a{i}')} | ((h{i} & u8(3)) << u8(4)))) + c0")
    for i in range(16):
        C.append(f"br[oc + {32 + i}] = e1 * f32(u8({_lo(f'z{i}')} | (((h{i} >> u8(2)) & u8(3)) << u8(4)))) + c1")
    for i in range(16):
        C.append(f"br[oc + {64 + i}] = e2 * f32(u8({_hi(f'a{i}')} | (((h{i} >> u8(4)) & u8(3)) << u8(4)))) + c2")
    for i in range(16):
        C.append(f"br[oc + {96 + i}] = e3 * f32(u8({_hi(f'z{i}')} | ((h{i} >> u8(6)) << u8(4)))) + c3")
    return L + ["    " + c for c in C]


def _body_iq4_xs():
    """d, scales_h (uint16), scales_l[4], qs[128]; sub-block ib has a 6-bit scale - 32 and code-book nibbles."""
    L = ["p = b * 136", "o = b * 256", "d = tab[r16[b * 68]]", "sh = np.int64(r16[b * 68 + 1])"]
    L += ["for ib in range(8):"]
    C = ["sl = np.int64(row[p + 4 + (ib >> 1)])"]
    C += ["dl = d * f32((((sl >> (4 * (ib & 1))) & 15) | (((sh >> (2 * ib)) & 3) << 4)) - 32)"]
    C += ["pc = p + 8 + 16 * ib", "oc = o + 32 * ib"]
    C += [f"q{j} = row[pc + {j}]" for j in range(16)]
    C += [f"br[oc + {j}] = dl * kv[q{j} & u8(15)]" for j in range(16)]
    C += [f"br[oc + {16 + j}] = dl * kv[q{j} >> u8(4)]" for j in range(16)]
    return L + ["    " + c for c in C]


def _row_f32():
    return ["rf = row.view(np.float32)", "for i in range(br.shape[0]):", "    br[i] = rf[i]"]


def _row_f16():
    """f16 bits -> f32 by placing sign, exponent and mantissa, then scaling by 2**112 (exact for normal and
    subnormal values); exponent 31 (inf / nan) is forced to an all-ones f32 exponent first."""
    return [
        "bu = br.view(np.uint32)",
        "for i in range(br.shape[0]):",
        "    h = u32(r16[i])",
        "    em = h & u32(0x7FFF)",
        "    special = u32(0x7F800000) if em >= u32(0x7C00) else u32(0)",
        "    bu[i] = ((h & u32(0x8000)) << u32(16)) | (em << u32(13)) | special",
        "for i in range(br.shape[0]):",
        "    br[i] = br[i] * np.float32(5.192296858534828e+33)",
    ]


def _row_bf16():
    return ["bu = br.view(np.uint32)", "for i in range(br.shape[0]):", "    bu[i] = u32(r16[i]) << u32(16)"]


_BODIES = {
    "f32": _row_f32,
    "f16": _row_f16,
    "bf16": _row_bf16,
    "q4_0": lambda: _body_q4(False),
    "q4_1": lambda: _body_q4(True),
    "q5_0": lambda: _body_q5(False),
    "q5_1": lambda: _body_q5(True),
    "q8_0": _body_q8_0,
    "q4_k": lambda: _body_k(False),
    "q5_k": lambda: _body_k(True),
    "q6_k": _body_q6_k,
    "iq4_xs": _body_iq4_xs,
}


def _deq_source(name: str) -> str:
    """Source of `_deq_<name>(w, w16, r0, nr, ids, buf, tab, kv, scr)`.

    Dequantizes weight rows r0..r0+nr-1 (rows ids[r0..r0+nr-1] when ids is not empty)
    into buf[0..nr-1]. One call covers a whole tile: numba passes each array as about
    ten scalars, and a call per row cost as much as a small row's work.
    """
    bs, _ = _LAYOUT[name]
    body = _BODIES[name]()
    if bs > 1:
        body = [f"for b in range(br.shape[0] // {bs}):"] + ["    " + s for s in body]
    head = [
        "@njit(fastmath=True, cache=True)",
        f"def _deq_{name}(w, w16, r0, nr, ids, buf, tab, kv, scr):",
        "    for k in range(nr):",
        "        src = ids[r0 + k] if ids.shape[0] else r0 + k",
        "        row = w[src]",
        "        r16 = w16[src]",
        "        br = buf[k]",
    ]
    return "\n".join(head + ["        " + s for s in body]) + "\n\n"


MODES = ("gemv", "tile", "rows")  # few tokens; the tiled GEMM; get_rows (y[k] = W[ids[k]], x unused)

_KERNEL = """
@njit(fastmath=True, {parallel}cache=True)
def _kernel_{name}_{mode}(w, w16, x, y, ids, tab, kv, nth):
    # w / w16: the weight rows as bytes / as uint16 words.
    n_out = {n_out}
    n_in = {n_in}
    rt = {rt}
    nunits = (n_out + rt - 1) // rt
    nsup = max(1, min(nunits, nth))
    per = (nunits + nsup - 1) // nsup
    for s in prange(nsup):
{scratch}
        for u in range(s * per, min(nunits, (s + 1) * per)):
            r0 = u * rt
            nr = min(rt, n_out - r0)
            _deq_{name}(w, w16, r0, nr, ids, {dst}, tab, kv, scr)
{then}
"""

_ALLOCATED = """\
        buf = np.empty((rt, n_in), np.float32)
        scr = np.empty(16, np.float32)"""
# get_rows writes into y and needs only the 16 floats: on the stack (stack_array.py), as np.empty made every process
# that loads the kernel from numba's cache import numba.np.arrayobj (0.025 s of a first token)
_STACK = "        scr = stack_f32(16)"
_MODE_PARTS = {  # what differs between the modes: sizes, scratch, the dequantized tile's destination, the product
    "gemv": dict(n_out="w.shape[0]", n_in="x.shape[1]", rt="GEMV_ROWS", scratch=_ALLOCATED, dst="buf",
                 then="            _dot(buf, nr, x, y, r0)"),
    "tile": dict(n_out="w.shape[0]", n_in="x.shape[1]", rt="_tile_rows(n_out, x.shape[0], n_in, nth)",
                 scratch=_ALLOCATED, dst="buf", then="            _dot(buf, nr, x, y, r0)"),
    "rows": dict(n_out="ids.shape[0]", n_in="y.shape[1]", rt="GEMV_ROWS", scratch=_STACK, dst="y[r0:r0 + nr]",
                 then=""),
}
# get_rows is serial (prange runs as range): a prompt's embedding rows are a few microseconds of copying, a decode
# step's one row less without a thread launch, and a parallel kernel took 1.8-1.9 s to compile against 1.0-1.3 s, on the
# first run's way to its first token (q8_0 rows, SmolLM2's embedding; the same values, one multiply an element)
_PARALLEL = {"gemv": "parallel=True, ", "tile": "parallel=True, ", "rows": ""}

f32, u8, i8, u32 = np.float32, np.uint8, np.int8, np.uint32  # short names used by the generated source


def _dtype_source(name: str) -> str:
    """Source of `_deq_<name>` and its kernels `_kernel_<name>_<mode>` for each of MODES."""
    return _deq_source(name) + "".join(_KERNEL.format(name=name, mode=m, parallel=_PARALLEL[m], **_MODE_PARTS[m])
                                       for m in MODES)


def _kernel_source() -> str:
    """The generated source of every dtype, in _LAYOUT's order: the lines its functions are defined at."""
    return "".join(_dtype_source(n) for n in _LAYOUT)


def _dtype_kernels(key: tuple[str, str]) -> dict:
    """Every mode's kernel of key's dtype: its source exec'd at the lines it has in _kernel_source(). numba's cache
    names an entry by the function's name and first line, so a kernel defined alone finds the entries the whole
    source made, and the other way round. Compiling the source of all 12 dtypes and making their 48 dispatchers
    took 0.05 s of every process's import, for the 2 dtypes a model uses."""
    dtype, names = key[0], list(_LAYOUT)
    lines = sum(_dtype_source(n).count("\n") for n in names[:names.index(dtype)])
    exec(compile("\n" * lines + _dtype_source(dtype), __file__, "exec"), globals())
    return {(dtype, m): globals()[f"_kernel_{dtype}_{m}"] for m in MODES}


_KERNELS = LazyTable(lambda k: k[0] in _LAYOUT and k[1] in MODES, _dtype_kernels)  # (dtype, mode) -> kernel
_NO_IDS = np.zeros(0, np.int64)
_NO_X = np.zeros((0, 0), np.float32)


def _signature():
    """Every dtype's kernel has this one signature. Inputs are typed read-only, so writeable arrays and
    read-only ones (np.memmap mode "r", as GGUF files are mapped) share the same machine code."""
    t = numba.types
    ro = lambda dt, nd: t.Array(dt, nd, "C", readonly=True)
    return (ro(t.uint8, 2), ro(t.uint16, 2), ro(t.float32, 2), t.Array(t.float32, 2, "C"),
            ro(t.int64, 1), ro(t.float32, 1), ro(t.float32, 1), t.int64)  # fmt: skip


def _compile(dtype: str, mode: str):
    """The kernel for weights of `dtype` in `mode` (MODES), compiled (or loaded from numba's cache) with
    LLVM's SLP vectorizer on.

    One kernel per dtype and mode, compiled when a weight of that dtype is first bound for that mode:
    a model compiles only the dequantizers and products it uses (SmolLM2's prefill: the q4_1 tiled
    GEMM and q8_0 get_rows). numba re-optimizes every callee inside each parallel kernel that calls
    it, so one kernel over all 12 dtypes and 3 modes took 14 s to compile on 2 cores, and this one
    about 2 s. numba leaves SLP off by default and reads the flag while it optimizes, so switching
    it on around this compile affects only these kernels. Later compiles are disabled: every call
    has the one signature (matmul and get_rows normalize their inputs to it).
    """
    kernel = _KERNELS[dtype, mode]
    if (dtype, mode) in _READY:
        return kernel
    precompile.wait(f"matmul:{dtype}:{mode}")  # the helper process may be compiling it: then load it
    old = _nb_config.SLP_VECTORIZE
    _nb_config.SLP_VECTORIZE = 1
    try:
        try:
            kernel.compile(_signature())
        except Exception:
            # A cache entry numba cannot load (a truncated file, or one from another numba build):
            # drop this kernel's entries and compile afresh. (A second module name for this file can
            # no longer write one: backends/cpu/__init__.py makes `backends.cpu.*` the installed modules.)
            for d in (_tile_rows, _dot, _dot_octet, globals()[f"_deq_{dtype}"], kernel):
                d._cache.flush()
            kernel.compile(_signature())
    finally:
        _nb_config.SLP_VECTORIZE = old
    kernel.disable_compile()
    _READY.add((dtype, mode))
    return kernel


_READY: set[tuple[str, str]] = set()  # (dtype, mode) kernels compiled


def mode_for(n_tok: int) -> str:
    """The product mode for x of n_tok rows: GEMV up to MV_MAX_TOKENS, then the tiled GEMM."""
    return "gemv" if n_tok <= MV_MAX_TOKENS else "tile"

# The ctypes function behind numba.get_num_threads: 0.26 us a call instead of 2.07 (numba 0.68.1, 2-core EPYC).
# numba defines it when it launches its threads, so it is looked up after the first get_num_threads, not at
# import: imported here it was missing, and every GEMV paid the 2 us (122 calls a SmolLM2 decode token).
_raw_num_threads = None


def _num_threads() -> int:
    """The calling thread's numba thread count (numba.get_num_threads()), through numba's ctypes function."""
    n = _raw_num_threads() if _raw_num_threads is not None else 0
    return n if n > 0 else _num_threads_first()


def _num_threads_first() -> int:
    global _raw_num_threads
    n = numba.get_num_threads()  # launches numba's threads, which defines parallel._get_num_threads
    _raw_num_threads = getattr(numba_parallel, "_get_num_threads", None)
    return n


def _check_w(w: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray, int]:
    """The weight rows as bytes and as uint16 words (C-contiguous views), and n_in."""
    try:
        bs, bb = _LAYOUT[dtype]
    except KeyError:
        raise GraphError(f"matmul: unsupported weight dtype {dtype!r}; supported: {', '.join(SUPPORTED)}") from None
    if w.ndim != 2:
        raise GraphError(f"matmul: weight must be 2-D [n_out, n_in or row_bytes], got shape {w.shape}")
    if bs == 1:
        want = _STORAGE[dtype]
        if w.dtype != want and not (dtype == "f16" and w.dtype == np.float16):
            raise GraphError(f"matmul: {dtype} weight must be stored as {np.dtype(want).name}, got {w.dtype}")
        n_in = w.shape[1]
    else:
        if w.dtype != np.uint8:
            raise GraphError(f"matmul: {dtype} weight must be uint8 ggml blocks, got {w.dtype}")
        if w.shape[1] % bb:
            raise GraphError(f"matmul: {dtype} rows of {w.shape[1]} bytes are not whole {bb}-byte blocks")
        n_in = w.shape[1] // bb * bs
    if not w.flags.c_contiguous:
        w = np.ascontiguousarray(w)
    w8 = w.view(np.uint8)
    return w8, w8.view(np.uint16), n_in


def _prepare(w: np.ndarray, dtype: str, x: np.ndarray, out: np.ndarray | None):
    """Validated kernel arguments (without the thread count) and the output array."""
    w, w16, n_in = _check_w(w, dtype)
    n_out = w.shape[0]
    shape = x.shape
    if shape[-1:] != (n_in,):
        raise GraphError(f"matmul: x has shape {shape}, expected last axis {n_in} for a {dtype} weight of {n_out} rows")
    if x.ndim != 2:
        x = x.reshape(-1, n_in)
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    oshape = shape[:-1] + (n_out,)
    if out is None:
        out = np.empty(oshape, np.float32)
    elif out.shape != oshape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise GraphError(f"matmul: out must be C-contiguous float32 {oshape}, got {out.dtype} {out.shape}")
    y = out if out.ndim == 2 else out.reshape(-1, n_out)
    return mode_for(x.shape[0]), (w, w16, x, y, _NO_IDS, _F16, _KVALUES), out


def matmul(w: np.ndarray, dtype: str, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y = x @ W.T for W [n_out, n_in] stored as `dtype`; x float32 [..., n_in] -> y float32 [..., n_out]."""
    mode, args, out = _prepare(w, dtype, x, out)
    if out.size:
        _compile(dtype, mode)(*args, _num_threads())
    return out


def prepare_matmul(w: np.ndarray, dtype: str, x: np.ndarray, out: np.ndarray | None = None):
    """A zero-argument callable doing `matmul(w, dtype, x, out)` on these very buffers, and `out`.

    For a runtime with fixed buffers: validation and views happen once here, so a call costs
    ~3.5 us instead of ~10 us (decode makes ~200 matmul calls a token). `x` must be float32
    C-contiguous with at most 2 dims (it is read in place, so refill it rather than rebind it),
    and `out` is written in place.
    """
    if x.dtype != np.float32 or not x.flags.c_contiguous or x.ndim > 2:
        raise GraphError("prepare_matmul: x must be a C-contiguous float32 array of 1 or 2 dims (it is read in place)")
    mode, args, out = _prepare(w, dtype, x, out)
    if not out.size:
        return (lambda: None), out
    kernel: list = []  # compiled at the first call, not here: a Program binds every step before it
    # compiles their kernels in step order, sharing them with precompile.py's helper

    def run() -> None:
        if not kernel:
            kernel.append(_compile(dtype, mode))
        kernel[0](*args, _num_threads())

    return run, out


def prepare_get_rows(w: np.ndarray, dtype: str, ids: np.ndarray, out: np.ndarray) -> Callable[[], None] | None:
    """A zero-argument callable doing `get_rows(w, dtype, ids, out)` on these very buffers (ids read at each call),
    or None where ids cannot be read in place (not contiguous).

    The weight's views, the checks of `out` and the kernel's lookup happen once here. In a decode step get_rows
    comes right after the head, whose weights (28 MB for SmolLM2) have pushed everything else out of the
    caches: there get_rows' per-call views (np.memmap's Python code), numpy reductions and the dispatcher
    took 240-330 us (35 us when timed alone, hot). An id outside the weight's rows raises IndexError.
    """
    w8, w16, n_in = _check_w(w, dtype)
    shape = ids.shape + (n_in,)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise GraphError(f"get_rows: out must be C-contiguous float32 {shape}, got {out.dtype} {out.shape}")
    try:
        ids1 = ids.reshape(-1, copy=False)
    except ValueError:
        return None
    if not ids1.size or not n_in:
        return lambda: None
    n_rows = w8.shape[0]
    flat = np.empty(ids1.size, np.int64)  # the kernel's id type; ids are copied in at each call
    args = [w8, w16, _NO_X, out.reshape(-1, n_in), flat, _F16, _KVALUES]
    kernel: list = []  # compiled at the first call (as prepare_matmul), then its entry point (direct_call.py)

    def run() -> None:
        listed = ids1.tolist()
        if min(listed) < 0 or max(listed) >= n_rows:
            bad = next(i for i in listed if not 0 <= i < n_rows)
            raise IndexError(f"get_rows: id {bad} out of range 0..{n_rows - 1}")
        flat[:] = listed
        if kernel:
            kernel[0](*args, _num_threads())
            return
        kernel.append(direct_call.first_call(_compile(dtype, "rows"), *args, _num_threads()))

    return run


def get_rows(w: np.ndarray, dtype: str, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Dequantize rows `ids` of W (token embeddings) -> float32 [*ids.shape, n_in]."""
    w, w16, n_in = _check_w(w, dtype)
    ids = np.asarray(ids)
    flat = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= w.shape[0]):
        raise GraphError(f"get_rows: ids out of range [0, {w.shape[0]})")
    shape = ids.shape + (n_in,)
    if out is None:
        out = np.empty(shape, np.float32)
    elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise GraphError(f"get_rows: out must be C-contiguous float32 {shape}, got {out.dtype} {out.shape}")
    if flat.size and n_in:
        _compile(dtype, "rows")(w, w16, _NO_X, out.reshape(-1, n_in), flat, _F16, _KVALUES, _num_threads())
    return out
