"""Decode attention on the CPU: a few queries against a long KV cache, bound by reading K and V.

A decode token reads every visible K and V row once per layer: at 4096 keys on SmolLM2
(3 KV heads x 64) that is 6 MB a layer in f32, more than the layer's weights. So the kernel
is built around reading each row once, in address order, as fast as memory delivers it:

- one task per (query, chunk of keys): a cache row [kv_heads, head_dim] is read once, whole and
  in order, and scored against every q head (each KV head against its GQA group);
- the keys are split into chunks so both threads stream, however few KV heads there are; each
  chunk leaves (max, sum of exp, V sum) per head and a serial merge rescales them into the output
  (the usual split-K / online-softmax combine);
- within a chunk: scores into a per-thread scratch [q heads, CHUNK], then a vectorized exp, then
  the V sum; every inner loop runs over head_dim, a compile-time constant (one kernel per head dim
  and GQA block);
- while a chunk's K rows are scored, each one's V row is prefetched (prefetch.py): the V sums start on rows
  already on the way (SmolLM2, 256 keys, decode step replayed at 2 threads: 1.47-1.55 -> 1.22-1.24 ms a token);
- all scratch is bound once (DecodeScratch), so a replayed step allocates nothing;
- a query's chunks follow from its own position only (_splits), so each row of a call of up to 16 (a
  speculative verify call) is bitwise the decode step at that position.

f16 caches (the kv-f16 pass) are read as their uint16 bits (numba has no float16) and widened with
integer ops and one multiply, branch-free, so the loops stay vectorized: K inside the dot products,
V four rows at a time into an L1-sized f32 scratch that the f32 path's sums then read. In isolation
(SmolLM2 shapes, 30 layers, 2 threads, AVX2) f32 -> f16 rows: 4.27 -> 3.84 ms a token at 1024 keys,
19.5 -> 14.5 at 3968 (the old per-row widening, a branch per element: slower than f32).

Measured (SmolLM2-135M, 3968 keys, profile_decode.py, 1 thread): flash_attn 46 ms a token with
kernels.attention (a task per q head), 24 ms with this; tasks per (KV head, chunk), reading a third
of each row, got ~5.5 GB/s. Decode at 4k on 2 threads: 2.5x. Details in BENCHMARKS.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numba
import numpy as np
from numba import njit, prange

from .lazy_table import LazyTable
from .prefetch import prefetch

CACHE_DEPENDS = ("prefetch.py",)  # compiled into the decode kernels

JIT = dict(cache=True, fastmath=True, nogil=True)
EXACT = dict(cache=True, nogil=True)  # bit manipulation of f16 (fast-math must not assume away inf/nan)
# Cold compile time (issue 13: SmolLM2's decode_attention_d64_g3 is on a first run's path): helpers called from
# compiled code only build no CPython or C wrapper (each is a function of its own to lower and optimize), and scalar
# min / max are written as comparisons (each is a numba overload, every signature of it a function compiled apart).
HELPER = dict(JIT, no_cpython_wrapper=True, no_cfunc_wrapper=True)

CHUNK = 256  # keys per task at most: the scores of a chunk (q heads x 1 KB) stay in L1/L2
MIN_TASKS = 8  # split short contexts too, so that 2 threads get even shares
# speculative verify calls (graphir/speculative.py VERIFY_BUCKETS, up to 16 rows) stay here: their rows then equal
# decode steps bit for bit; more queries (prefill) go to attention_prefill.py, which shares K and V reads across them
DECODE_MAX_QUERIES = 16
HEAD_DIMS = (16, 32, 64, 128, 256)  # with a decode kernel: the random tiny presets, SmolLM2, Qwen3, Qwen3.5 / Gemma 3

_F16_SCALE = np.float32(2.0 ** 112)  # f16 bits shifted into an f32's place are the value times 2^-112


@dataclass(frozen=True)
class DecodeScratch:
    """Per-binding buffers: partial results per chunk and per-thread scratch (never per call)."""
    max_: np.ndarray  # [n_q, hq, splits] f32: the max of each chunk's scores
    sum_: np.ndarray  # [n_q, hq, splits] f32: sum of exp(score - max); 0 for a chunk without keys
    acc: np.ndarray  # [n_q, hq, splits, dv] f32: V rows weighted by exp(score - max)
    scores: np.ndarray  # [threads, hq, CHUNK] f32
    pow2_bits: np.ndarray  # [threads, CHUNK] i32: the 2^n factors of exp, built as f32 bit patterns
    v_rows: np.ndarray  # [threads, 4, hk, dv] f32: four widened f16 V rows (f16 caches only; else 0 heads)


def max_splits(capacity: int) -> int:
    """The most chunks one query's keys are cut into for a cache of `capacity` rows."""
    return max(-(-capacity // CHUNK), MIN_TASKS)


def make_scratch(n_q: int, hq: int, hk: int, d: int, dv: int, capacity: int, f16: bool) -> DecodeScratch:
    """Buffers for a decode kernel over a cache of `capacity` rows (numba's pool: one scratch each)."""
    splits, threads, heads = max_splits(capacity), numba.config.NUMBA_NUM_THREADS, hk if f16 else 0
    return DecodeScratch(np.empty((n_q, hq, splits), np.float32), np.empty((n_q, hq, splits), np.float32),
                         np.empty((n_q, hq, splits, dv), np.float32), np.empty((threads, hq, CHUNK), np.float32),
                         np.empty((threads, CHUNK), np.int32), np.empty((threads, 4, heads, dv), np.float32))


@njit(**HELPER)
def _splits(length, capacity_splits):
    """Chunks of a query whose keys end at `length`: none longer than CHUNK, at least MIN_TASKS. The query's
    own count, whatever the call's other queries: a verify call's row then sums its keys in the chunks of a
    decode step at its position, and equals it bit for bit (with 16-bit x, q16-activations, a last-bit
    difference here grew to 2e-3 in SmolLM2's logits: greedy speculative output could leave plain decoding's)."""
    by_length = (length + CHUNK - 1) // CHUNK
    n = MIN_TASKS if MIN_TASKS > by_length else by_length
    n = capacity_splits if capacity_splits < n else n
    return n if n > 1 else 1


@njit(**HELPER)
def _key_range(p, length, window):
    """Keys [start, stop) query position p sees: causal, within kv_len, within the window if any."""
    stop = p + 1 if p + 1 < length else length
    start = 0
    if window > 0 and p - window + 1 > 0:
        start = p - window + 1
    return start, stop if stop > start else start


# _task's copy, inlined in numba's IR: one library fewer to compile for the decode kernel (prefill calls the original)
_key_range_inlined = njit(inline="always", **JIT)(_key_range.py_func)


@njit(**HELPER)
def _task(task, splits, pos, length, window, capacity_splits):
    """(query, chunk index, first key, end key) of a task; an empty chunk has j0 == j1. `splits`: the most
    chunks of any query (the call's length); query t has its own, _splits of its last key, and no more."""
    c = task % splits
    t = task // splits
    start, stop = _key_range_inlined(pos[t], length, window)
    own = _splits(pos[t] + 1 if pos[t] + 1 < length else length, capacity_splits)
    if c >= own:
        return t, c, start, start
    return t, c, start + (stop - start) * c // own, start + (stop - start) * (c + 1) // own


@njit(inline="always")
def f16_to_f32(h):
    """The f16 with bits h (a uint16) as f32, exactly, without branches (a select), so loops of it vectorize.

    Exponent and mantissa shifted into an f32's place are the value times 2^-112, exactly for normal and
    subnormal halves and zero (f32 has the range), so one multiply by 2^112 rescales them; an all-ones
    exponent (inf / nan, payload kept) becomes all ones instead; the sign is ORed in last, so -0 stays -0.
    Inlined: the caller's fast-math flags reach the multiply, which only ever sees finite values."""
    b = np.uint32(h)  # numba widens uint32 arithmetic to 64 bits: each result is cut back before a view
    mag = np.uint32((b & np.uint32(0x7FFF)) << np.uint32(13))
    scaled = np.float32(mag.view(np.float32) * _F16_SCALE).view(np.uint32)
    special = (b & np.uint32(0x7C00)) == np.uint32(0x7C00)
    out = np.uint32(mag | np.uint32(0x7F800000)) if special else scaled
    return np.uint32(out | ((b & np.uint32(0x8000)) << np.uint32(16))).view(np.float32)


@njit(inline="always")
def _widen_rows(src, j, count, dst):
    """dst[:count] = f16 rows src[j:j + count] ([., hk, d] uint16) as f32."""
    for r in range(count):
        for kh in range(src.shape[1]):
            for i in range(src.shape[2]):
                dst[r, kh, i] = f16_to_f32(src[j + r, kh, i])


@njit(**EXACT)
def widen_f16(src, dst):
    """dst = the f16 bits src as f32, elementwise (1-D); the tests check it on every half."""
    for i in range(src.shape[0]):
        dst[i] = f16_to_f32(src[i])


@njit(**EXACT)
def widen_f16_rows(src, n, dst):
    """dst[:n] = f16 rows src[:n] ([capacity, heads, d] uint16) as f32: prefill over an f16 cache reads
    the f32 kernel's rows (n = kv_len: only the rows attention can see). One thread: 512 SmolLM2 rows
    take ~70 us, where a parallel region measured slower whenever the other core was busy."""
    _widen_rows(src, 0, n, dst)


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)  # ln 2 split so that n * _LN2_HI is exact for |n| < 2^8
_LN2_LO = np.float32(1.4286067653302226e-06)


@njit(inline="always")
def exp_parts(z):
    """exp(z) for z in [-87, 88] as (p, bits): p * the f32 whose bits are `bits`. exp = 2^k * e^r, |r| <= ln2 / 2,
    with a degree-7 Taylor polynomial (error < 1e-8 relative) and 2^k built in the exponent bits, so a loop
    of it vectorizes where libm's expf is a call per element. Inlined into the loops that use it."""
    k = np.floor(z * _LOG2E + np.float32(0.5))
    r = z - k * _LN2_HI - k * _LN2_LO
    p = np.float32(1.0) + r * (np.float32(1.0) + r * (np.float32(1 / 2) + r * (np.float32(1 / 6) + r * (
        np.float32(1 / 24) + r * (np.float32(1 / 120) + r * (np.float32(1 / 720) + r * np.float32(1 / 5040)))))))
    return p, (np.int32(k) + np.int32(127)) << np.int32(23)


@njit(**HELPER)
def _exp_in_place(x, top, pow2_bits, pow2):
    """x[j] = exp(x[j] - top) for x[j] <= top, returns the sum; pow2_bits / pow2: one scratch row as
    int32 / f32. libm's expf is a call per element; exp_parts keeps both loops vectorized (SmolLM2 at
    4096 keys: ~2.8 ms of exp a token with expf, 1 thread)."""
    n = x.shape[0]
    for j in range(n):
        z = x[j] - top
        x[j], pow2_bits[j] = exp_parts(np.float32(-87.0) if np.float32(-87.0) > z else z)  # e^-87: 2^k stays normal
    total = np.float32(0.0)
    for j in range(n):
        e = x[j] * pow2[j]
        x[j] = e
        total += e
    return total


@njit(**HELPER)
def _merge(max_, sum_, acc, splits, out):
    """out[t, h] = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) sum_c over the chunks with keys; a query
    with no key gets 0. (Emptiness is read from the sums, not from -inf maxima: fast-math assumes no inf.)"""
    n_q, hq, dv = out.shape
    for t in range(n_q):
        for h in range(hq):
            for i in range(dv):
                out[t, h, i] = 0.0
            top, seen = np.float32(0.0), False
            for c in range(splits):
                if sum_[t, h, c] > 0.0:
                    x = max_[t, h, c]
                    top = x if not seen or x > top else top
                    seen = True
            if not seen:
                continue
            denom = np.float32(0.0)
            for c in range(splits):
                if sum_[t, h, c] > 0.0:
                    f = np.float32(np.exp(max_[t, h, c] - top))
                    denom += f * sum_[t, h, c]
                    for i in range(dv):
                        out[t, h, i] += f * acc[t, h, c, i]
            inv = np.float32(1.0) / denom
            for i in range(dv):
                out[t, h, i] *= inv


def _make_kernel(d: int, block: int, f16: bool):
    """The decode kernel for head_dim d, scoring `block` (1..4) q heads of a GQA group per pass over a K
    row, over an f32 cache or (f16) the uint16 bits of an f16 one; named decode_attention[_f16]_d<d>_g<block>,
    a module global, so precompile.py's helper process finds it by name.

    d, block and f16 are compile-time constants: constant trip counts keep a row in vector registers and
    a block's dot products share the K loads (SmolLM2, 4096 keys, in cache, 1 thread: scores 5.7 ms a
    token one head at a time, 3.5 with a group's 3 heads together; head dims read from the arrays took
    twice as long again). It is one function on purpose: numba keys a closure's cache entry on its cell
    contents, which must be plain constants (a captured dispatcher pickles differently in every
    process, so every process would compile again); its helpers are module globals."""

    def decode_attention(q, k, v, pos, kv_len, scale, window, max_, sum_, acc, scores, pow2_bits, pow2, v_rows, out):
        """flash_attn for a few queries over a cache k, v [capacity, hk, d]; see the module doc."""
        hq, hk = q.shape[1], k.shape[1]
        group = hq // hk
        length = np.int64(kv_len[0])
        splits = _splits(length, max_.shape[2])
        for task in prange(q.shape[0] * splits):
            t, c, j0, j1 = _task(np.int64(task), splits, pos, length, window, max_.shape[2])
            if j1 <= j0:
                for h in range(sum_.shape[1]):
                    sum_[t, h, c] = 0.0  # a chunk with keys has a sum >= 1 (its max term is exp(0))
                continue
            me = numba.get_thread_id()
            s, vw = scores[me], v_rows[me]
            n, qt, at = j1 - j0, q[t], acc[t]
            for j in range(n):  # each K row once, in address order, for every q head
                kr = k[j0 + j]
                for o in range(0, v.strides[0], 64):  # V row j, read after the K rows: its lines on the way now
                    prefetch(v, j0 + j, o)
                for kh in range(hk):
                    kv, last = kr[kh], kh * group + group - 1
                    for g0 in range(0, group, block):  # past the group's end: its last head again
                        h0 = kh * group + g0
                        h1 = h0 + 1 if h0 + 1 < last else last
                        h2 = h0 + 2 if h0 + 2 < last else last
                        h3 = h0 + 3 if h0 + 3 < last else last
                        q0, q1, q2, q3 = qt[h0], qt[h1], qt[h2], qt[h3]
                        a0 = a1 = a2 = a3 = np.float32(0.0)
                        for i in range(d):
                            if f16:  # a constant: numba prunes the other branch
                                x = f16_to_f32(kv[i])  # widened in registers, inside the dot products
                            else:
                                x = kv[i]
                            a0 += q0[i] * x
                            if block > 1:  # a constant: LLVM drops the unused accumulators
                                a1 += q1[i] * x
                            if block > 2:
                                a2 += q2[i] * x
                            if block > 3:
                                a3 += q3[i] * x
                        s[h0, j] = a0 * scale
                        if block > 1:
                            s[h1, j] = a1 * scale
                        if block > 2:
                            s[h2, j] = a2 * scale
                        if block > 3:
                            s[h3, j] = a3 * scale
            for h in range(hq):
                sh = s[h]
                m = sh[0]  # not -inf: fast-math assumes no infinities
                for j in range(1, n):
                    m = sh[j] if sh[j] > m else m
                max_[t, h, c] = m
                sum_[t, h, c] = _exp_in_place(sh[:n], m, pow2_bits[me], pow2[me])
                for i in range(d):
                    at[h, c, i] = 0.0
            # each V row once, in address order, into every q head's sum; f32 rows 4 at a time, a quarter
            # of the loads and stores of the sums (in cache, 1 thread: 4.8 ms a token against 6.9)
            # (f16: the 4 rows widened into scratch once, not once per q head of the group)
            n4 = n - n % 4
            for j in range(0, n4, 4):
                if f16:
                    _widen_rows(v, j0 + j, 4, vw)
                    r0, r1, r2, r3 = vw[0], vw[1], vw[2], vw[3]
                else:
                    r0, r1, r2, r3 = v[j0 + j], v[j0 + j + 1], v[j0 + j + 2], v[j0 + j + 3]
                for kh in range(hk):
                    x0, x1, x2, x3 = r0[kh], r1[kh], r2[kh], r3[kh]
                    for h in range(kh * group, kh * group + group):
                        w0, w1, w2, w3, a = s[h, j], s[h, j + 1], s[h, j + 2], s[h, j + 3], at[h, c]
                        for i in range(d):
                            a[i] += (w0 * x0[i] + w1 * x1[i]) + (w2 * x2[i] + w3 * x3[i])
            for j in range(n4, n):
                if f16:
                    _widen_rows(v, j0 + j, 1, vw)
                    vr = vw[0]
                else:
                    vr = v[j0 + j]
                for kh in range(hk):
                    vh = vr[kh]
                    for h in range(kh * group, kh * group + group):
                        w, a = s[h, j], at[h, c]
                        for i in range(d):
                            a[i] += w * vh[i]
        _merge(max_, sum_, acc, splits, out)

    name = f"decode_attention{'_f16' if f16 else ''}_d{d}_g{block}"
    decode_attention.__name__ = decode_attention.__qualname__ = name
    return njit(parallel=True, no_cfunc_wrapper=True, **JIT)(decode_attention)


BLOCKS = (1, 2, 3, 4)  # q heads scored together: min(group, 4); numba compiles only the ones used


def _made(key: tuple[int, int, bool]) -> dict:
    """The decode kernel of (head dim, block, f16), also kept as a module global of its name (numba's cache and
    precompile.py's helper find it by that name)."""
    kernel = _make_kernel(key[0], key[1], bool(key[2]))
    globals()[kernel.py_func.__name__] = kernel
    return {key: kernel}


# (head dim, block, f16) -> its decode kernel, made at first lookup: making all 40 dispatchers at import took
# 0.02-0.03 s of every process, which uses one or two
KERNELS = LazyTable(lambda k: k[0] in HEAD_DIMS and k[1] in BLOCKS and k[2] in (False, True), _made)


def __getattr__(name: str) -> object:
    """decode_attention[_f16]_d<d>_g<block> by name (precompile.py's helper process asks so), made if not yet."""
    m = re.fullmatch(r"decode_attention(_f16)?_d(\d+)_g(\d+)", name)
    if m is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return KERNELS[int(m[2]), int(m[3]), m[1] is not None]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def bind_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, kv_len: np.ndarray,
                scale: np.float32, window: int, out: np.ndarray) -> tuple[object, tuple]:
    """(kernel, args) of decode attention for these bound arrays: f32 or f16 caches, scratch made once."""
    f16 = k.dtype == np.float16
    sc = make_scratch(q.shape[0], q.shape[1], k.shape[1], k.shape[2], v.shape[2], k.shape[0], f16)
    kv = (k.view(np.uint16), v.view(np.uint16)) if f16 else (k, v)
    kernel = KERNELS[k.shape[2], min(q.shape[1] // k.shape[1], BLOCKS[-1]), f16]
    return kernel, (q, *kv, pos, kv_len, scale, window, sc.max_, sc.sum_, sc.acc, sc.scores, sc.pow2_bits,
                    sc.pow2_bits.view(np.float32), sc.v_rows, out)


def supports(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> bool:
    """Whether decode attention takes these arrays: few f32 queries, f32 or f16 caches alike, C-contiguous,
    a head dim in HEAD_DIMS (q, k and v alike)."""
    return (q.shape[0] <= DECODE_MAX_QUERIES and q.dtype == np.float32 and k.dtype == v.dtype
            and k.shape[2] == v.shape[2] and k.shape[2] in HEAD_DIMS
            and k.dtype in (np.float32, np.float16) and all(a.flags.c_contiguous for a in (q, k, v))
            and q.size > 0)
