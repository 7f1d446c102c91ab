"""Decode GEMV (1 token; the kernels accept more) on weights repacked once into plain arrays.

ggml blocks interleave f16 scales with packed nibbles (20-byte q4_1 blocks), which makes
LLVM unpack them with scalar code. Here each weight is repacked once, at lowering, into a
structure-of-arrays copy the size of the file's blocks (no float32 copy of the weights):

  * q4_0 / q4_1: d float32 [rows, nblk], c float32 [rows, nblk], qs uint8 [rows, n_in/2].
    A weight is d*q + c (c is the q4_1 min, or -8*d for q4_0). Blocks are paired: byte j
    (0..31) of pair k holds element j of block 2k in its low nibble and element j of block
    2k+1 in its high nibble, so 32 contiguous bytes meet 32 contiguous x values twice. An
    odd last block keeps ggml's order (low nibble: element j, high: element 16 + j).
  * q8_0: d float32 [rows, nblk], qs int8 [rows, n_in].

Per row: y = sum_b d_b * (q_b . x_b) + sum_b c_b * sx_b, where sx_b (the sum of x over
block b) is computed once a call, so the offset is one short dot product. The block body is
generated straight-line code with one float32 accumulator per SIMD lane carried across
blocks, reduced once per row: compiled with LLVM's SLP vectorizer on and the loop vectorizer
off (which otherwise vectorizes across rows with gathers), it becomes vector code with no
per-block horizontal sums. The lanes are 8 (one AVX2 register), or 16 (one AVX-512 register)
where the CPU numba compiles for has AVX-512F: LLVM keeps to 256-bit vectors on such CPUs
unless the code is 16 wide (its "prefer-256-bit" tuning; switching that off alone left this
kernel in ymm registers). Measured single-thread on [3072 x 576] q4_1: 3.6 ns per 32-block
with 8 lanes, against ~6 for matmul.py's dequantize-then-FMA kernel; on an AVX-512 Xeon
2.2 ns with 16 lanes against 2.8 with 8 (weight in cache; BENCHMARKS.md, issue 13). Each extra
token repeats the unpacking, so `prepare` takes only single-token calls by default.
"""

from __future__ import annotations

import contextlib

import numba
import numpy as np
from numba import njit, prange  # noqa: F401  (prange is used by the generated kernels)
from numba.core import config as _nb_config
from numba.core.codegen import get_host_cpu_features

from . import direct_call, precompile
from .matmul import _F16, _num_threads

__all__ = ["repack", "prepare"]

_SUPPORTED = {"q4_0": (18, 2), "q4_1": (20, 4), "q8_0": (34, 2)}  # bytes per block, qs offset
MAX_TOKENS = 1  # extra tokens repeat the unpacking; matmul.py's GEMV shares it (measured faster at 2+)
f32, u8, i8 = np.float32, np.uint8, np.int8  # short names used by the generated source


def repack(w_raw: np.ndarray, dtype: str):
    """(d, c, qs) for q4_0 / q4_1, (d, None, qs) for q8_0, from uint8 [rows, row_bytes] ggml blocks."""
    bb, off = _SUPPORTED[dtype]
    rows = w_raw.shape[0]
    nblk = w_raw.shape[1] // bb
    blk = np.asarray(w_raw).reshape(rows, nblk, bb)
    d = np.ascontiguousarray(_F16[blk[:, :, 0:2].copy().view(np.uint16)[:, :, 0]], np.float32)
    if dtype == "q8_0":
        qs = np.ascontiguousarray(blk[:, :, off:]).view(np.int8).reshape(rows, nblk * 32)
        return d, None, qs
    if dtype == "q4_1":
        c = np.ascontiguousarray(_F16[blk[:, :, 2:4].copy().view(np.uint16)[:, :, 0]], np.float32)
    else:
        c = np.ascontiguousarray(np.float32(-8.0) * d, np.float32)
    raw = blk[:, :, off:]  # [rows, nblk, 16]
    qs = np.empty((rows, nblk * 16), np.uint8)
    npair = nblk // 2
    if npair:
        v = np.concatenate([raw & 15, raw >> 4], axis=2)[:, : 2 * npair]  # [rows, 2*npair, 32] element values
        qs[:, : npair * 32] = (v[:, 0::2] | (v[:, 1::2] << 4)).reshape(rows, npair * 32)
    if nblk % 2:
        qs[:, npair * 32 :] = raw[:, nblk - 1]
    return d, c, qs


def _lane_sum(cvt, q0: int, x0: int, n: int, lanes: int = 8) -> str:
    """Lane n's share of one 32-element block: sum over m of cvt(q{q0 + n + L*m}) * x{x0 + n + L*m}, L lanes."""
    return " + ".join(f"f32({cvt(f'q{q0 + n + lanes * m}')}) * x{x0 + n + lanes * m}" for m in range(32 // lanes))


def lanes_for(features: str) -> int:
    """Accumulator lanes for an LLVM feature string: 16 (one zmm) with +avx512f, else 8 (one ymm)."""
    return 16 if "+avx512f" in features.split(",") else 8


def target_features() -> str:
    """The features numba's JIT compiles for: a user's NUMBA_CPU_FEATURES (or NUMBA_CPU_NAME=generic's
    empty string), else the host's, as numba's codegen picks them."""
    return _nb_config.CPU_FEATURES if _nb_config.CPU_FEATURES is not None else get_host_cpu_features()


LANES = lanes_for(target_features())


def _tree(terms: list[str]) -> str:
    """A pairwise sum: ((A0 + A1) + (A2 + A3)) + ..."""
    while len(terms) > 1:
        terms = [f"({terms[i]} + {terms[i + 1]})" for i in range(0, len(terms), 2)]
    return terms[0]


def _kernel_source(lanes: int = LANES) -> str:
    """Source of `_gemv_q4(d, c, qs, xt, st, y, nth)` and `_gemv_q8(d, qs, xt, y, nth)` (one token each).

    A0..A{L-1} are the L lanes of one vector register (8: AVX2, 16: AVX-512): lane n accumulates
    elements n, n+L, ... of every block, scaled per block, and the lanes are summed once per row.
    """
    lo = lambda v: f"u8({v} & u8(15))"
    hi = lambda v: f"u8({v} >> u8(4))"
    i8_ = lambda v: f"i8({v})"
    I3, I4 = " " * 12, " " * 16  # the row loop's body, and one level deeper
    head = [
        "    n_out, nblk = d.shape",
        "    nsup = max(1, min(n_out, nth))",
        "    per = (n_out + nsup - 1) // nsup",
        "    for s in prange(nsup):",
        "        for r in range(s * per, min(n_out, (s + 1) * per)):",
        I3 + "dr = d[r]",
        I3 + "qr = qs[r]",
    ] + [I3 + f"A{n} = f32(0.0)" for n in range(lanes)]
    red = _tree([f"A{n}" for n in range(lanes)])

    # q4: a pair of blocks per step (low nibbles: block 2k, high nibbles: block 2k + 1)
    P = ["p = k * 32", "o = k * 64", "d0 = dr[2 * k]", "d1 = dr[2 * k + 1]"]
    P += [f"q{j} = qr[p + {j}]" for j in range(32)]
    P += [f"x{j} = xt[o + {j}]" for j in range(64)]
    P += [f"A{n} += d0 * ({_lane_sum(lo, 0, 0, n, lanes)}) + d1 * ({_lane_sum(hi, 0, 32, n, lanes)})"
          for n in range(lanes)]
    # an odd last block (ggml order), in its own pass: inside the row loop it kept LLVM from vectorizing the body
    T = [
        "b = nblk - 1",
        "p = b * 16",
        "o = b * 32",
        "a = f32(0.0)",
        "for j in range(16):",
        "    q = qr[p + j]",
        f"    a += f32({lo('q')}) * xt[o + j] + f32({hi('q')}) * xt[o + 16 + j]",
        "y[r] += d[r, b] * a",
    ]
    q4 = ["@njit(fastmath=True, parallel=True, cache=True)", "def _gemv_q4(d, c, qs, xt, st, y, nth):"] + head
    q4 += [I3 + "cr = c[r]", I3 + "for k in range(nblk // 2):"] + [I4 + s for s in P]
    q4 += [I3 + "off = f32(0.0)", I3 + "for b in range(nblk):", I4 + "off += cr[b] * st[b]"]
    q4 += [I3 + f"y[r] = {red} + off"]
    q4 += ["        if nblk % 2:", "            for r in range(s * per, min(n_out, (s + 1) * per)):"]
    q4 += [I4 + "qr = qs[r]"] + [I4 + s for s in T]

    # q8: one block per step
    B = ["o = b * 32", "db = dr[b]"]
    B += [f"q{j} = qr[o + {j}]" for j in range(32)]
    B += [f"x{j} = xt[o + {j}]" for j in range(32)]
    B += [f"A{n} += db * ({_lane_sum(i8_, 0, 0, n, lanes)})" for n in range(lanes)]
    q8 = ["@njit(fastmath=True, parallel=True, cache=True)", "def _gemv_q8(d, qs, xt, y, nth):"] + head
    q8 += [I3 + "for b in range(nblk):"] + [I4 + s for s in B]
    q8 += [I3 + f"y[r] = {red}"]
    return "\n".join(q4) + "\n\n\n" + "\n".join(q8) + "\n"


@njit(fastmath=True, cache=True)
def _block_sums(x, sx):
    n_tok, n_in = x.shape
    for t in range(n_tok):
        for b in range(n_in // 32):
            s = np.float32(0.0)
            for j in range(32):
                s += x[t, b * 32 + j]
            sx[t, b] = s


exec(compile(_kernel_source(), __file__, "exec"), globals())
_gemv_q4 = globals()["_gemv_q4"]
_gemv_q8 = globals()["_gemv_q8"]
_KERNELS = {"q4": _gemv_q4, "q8": _gemv_q8}


def kind_of(dtype: str) -> str | None:
    """Which kernel serves weights of `dtype` ("q4", "q8"), or None where this module does not."""
    return "q8" if dtype == "q8_0" else "q4" if dtype in _SUPPORTED else None
_READY: set[str] = set()  # "q4" / "q8": kernels compiled


@contextlib.contextmanager
def slp_only():
    """numba compiles with LLVM's SLP vectorizer on and its loop vectorizer off inside this block."""
    old = _nb_config.SLP_VECTORIZE, _nb_config.LOOP_VECTORIZE
    _nb_config.SLP_VECTORIZE, _nb_config.LOOP_VECTORIZE = 1, 0
    try:
        yield
    finally:
        _nb_config.SLP_VECTORIZE, _nb_config.LOOP_VECTORIZE = old


def _compile(kind: str) -> None:
    """Compile `kind`'s kernel ("q4" or "q8"; or load it from numba's cache) with SLP on and the loop
    vectorizer off, then freeze it. Each compiles when a weight of its kind is first bound, so a model
    without q8_0 weights never compiles the q8 kernel (~1.5 s on 2 cores)."""
    if kind in _READY:
        return
    precompile.wait(f"gemv:{kind}")  # the helper process may be compiling it: then load it from the cache
    t = numba.types
    a2 = lambda dt: t.Array(dt, 2, "C")  # noqa: E731
    f1 = t.Array(t.float32, 1, "C")
    k, sig = {
        "q4": (_gemv_q4, (a2(t.float32), a2(t.float32), a2(t.uint8), f1, f1, f1, t.int64)),
        "q8": (_gemv_q8, (a2(t.float32), a2(t.int8), f1, f1, t.int64)),
    }[kind]
    with slp_only():
        try:
            k.compile(sig)
        except Exception:  # a stale or foreign cache entry: drop it and compile afresh
            k._cache.flush()
            k.compile(sig)
        k.disable_compile()
    if kind == "q4":
        _block_sums.compile((a2(t.float32), a2(t.float32)))
    _READY.add(kind)


def prepare(w_raw, dtype, x2, out2, cache: dict | None = None, key=None, max_tokens: int = MAX_TOKENS):
    """A zero-argument callable writing out2 = x2 @ W.T in place, or None where unsupported.

    w_raw: uint8 [rows, row_bytes] ggml blocks of `dtype`; x2: float32 C-contiguous writeable
    [n_tok <= max_tokens, n_in] (read in place at each call); out2: float32 C-contiguous
    [n_tok, rows]. The repacked weight is cached in `cache` under ("gemv_soa", dtype) + key.
    """
    if dtype not in _SUPPORTED or not isinstance(w_raw, np.ndarray) or w_raw.ndim != 2 or w_raw.dtype != np.uint8:
        return None
    if not isinstance(x2, np.ndarray) or not isinstance(out2, np.ndarray) or x2.ndim != 2 or out2.ndim != 2:
        return None
    if x2.dtype != np.float32 or out2.dtype != np.float32 or not x2.flags.c_contiguous or not out2.flags.c_contiguous:
        return None
    if not x2.flags.writeable or not out2.flags.writeable:
        return None
    bb, _ = _SUPPORTED[dtype]
    rows, nbytes = w_raw.shape
    if nbytes % bb or nbytes == 0 or rows == 0:
        return None
    n_in = nbytes // bb * 32
    n_tok = x2.shape[0]
    if not 1 <= n_tok <= max_tokens or x2.shape[1] != n_in or out2.shape != (n_tok, rows):
        return None
    if not key:  # no stable identity for this weight: repack it privately
        cache = None
    ck = ("gemv_soa", dtype) + tuple(key or ())
    packed = cache.get(ck) if cache is not None else None
    if packed is None:
        packed = repack(w_raw, dtype)
        if cache is not None:
            cache[ck] = packed
    d, c, qs = packed
    xs, ys = list(x2), list(out2)  # per-token row views of the very buffers (read / written in place)
    # the kernels compile at the first call, not here (as in matmul.prepare_matmul); from then on `ready` holds the
    # compiled overloads' entry points (direct_call.py: no dispatcher between the step and the kernel)
    ready: list = []
    if dtype == "q8_0":

        def run() -> None:
            if not ready:
                _compile("q8")
                ready.append(direct_call.entry_point(_gemv_q8, (d, qs, xs[0], ys[0], 1)) or _gemv_q8)
            gemv, nth = ready[0], _num_threads()
            for xt, yt in zip(xs, ys):
                gemv(d, qs, xt, yt, nth)

        return run
    sx = np.empty((n_tok, n_in // 32), np.float32)
    ss = list(sx)

    def run() -> None:
        if not ready:
            _compile("q4")
            ready.append(direct_call.entry_point(_block_sums, (x2, sx)) or _block_sums)
            ready.append(direct_call.entry_point(_gemv_q4, (d, c, qs, xs[0], ss[0], ys[0], 1)) or _gemv_q4)
        block_sums, gemv = ready
        nth = _num_threads()
        block_sums(x2, sx)
        for xt, st, yt in zip(xs, ss, ys):
            gemv(d, c, qs, xt, st, yt, nth)

    return run
