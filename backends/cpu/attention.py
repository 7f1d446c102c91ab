"""Decode attention on the CPU: a few queries against a long KV cache, bound by reading K and V.

A decode token reads every visible K and V row once per layer: at 4096 keys on SmolLM2
(3 KV heads x 64) that is 6 MB a layer in f32, more than the layer's weights. So the kernel
is built around reading each row once, as fast as memory delivers it:

- one task per (query, KV head, chunk of keys): the group's q heads (3 on SmolLM2) are scored
  against a K row while it is in L1, and the V row is added into all of their sums;
- the keys are split into chunks so both threads stream, however few KV heads there are; each
  chunk leaves (max, sum of exp, V sum) per head and a serial merge rescales them into the output
  (the usual split-K / online-softmax combine);
- within a chunk, scores go to a per-thread scratch row, then exp, then the V sum: two passes
  over at most CHUNK keys, each a branch-free loop over head_dim that vectorizes;
- all scratch is bound once (DecodeScratch), so a replayed step allocates nothing.

f16 caches are read as their uint16 bits (numba has no float16) and widened chunk by chunk into
an L1/L2-sized f32 scratch, so the bytes read from memory are halved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
from numba import njit, prange

JIT = dict(cache=True, fastmath=True, nogil=True)
EXACT = dict(cache=True, nogil=True)  # bit manipulation of f16 (fast-math must not assume away inf/nan)

CHUNK = 256  # keys per task at most: the group's scores (3 x 1 KB) and a K/V chunk (64 KB f32) stay in L2
MIN_TASKS = 8  # split short contexts too, so that 2 threads get even shares of a few KV heads
DECODE_MAX_QUERIES = 8  # more queries (prefill) go to kernels.attention, which reuses nothing across queries

_F16_SCALE = np.float32(2.0 ** 112)  # f16 bits shifted into an f32's place are the value times 2^-112


@dataclass(frozen=True)
class DecodeScratch:
    """Per-binding buffers: partial results per chunk and per-thread scratch (never per call)."""
    max_: np.ndarray  # [n_q, hq, splits] f32: running max of each chunk's scores
    sum_: np.ndarray  # [n_q, hq, splits] f32: sum of exp(score - max)
    acc: np.ndarray  # [n_q, hq, splits, dv] f32: V rows weighted by exp(score - max)
    scores: np.ndarray  # [threads, group, CHUNK] f32
    k_bits: np.ndarray  # [threads, CHUNK, 1, d] u32 (f16 caches only; else [threads, 0, 1, d])
    v_bits: np.ndarray  # [threads, CHUNK, 1, dv] u32 (same)


def max_splits(capacity: int) -> int:
    """The most chunks one (query, KV head) is cut into for a cache of `capacity` rows."""
    return max(-(-capacity // CHUNK), MIN_TASKS)


def make_scratch(n_q: int, hq: int, hk: int, d: int, dv: int, capacity: int, f16: bool) -> DecodeScratch:
    """Buffers for decode_attention(_f16) over a cache of `capacity` rows (numba's pool: one scratch each)."""
    splits, threads, rows = max_splits(capacity), numba.config.NUMBA_NUM_THREADS, CHUNK if f16 else 0
    return DecodeScratch(np.empty((n_q, hq, splits), np.float32), np.empty((n_q, hq, splits), np.float32),
                         np.empty((n_q, hq, splits, dv), np.float32),
                         np.empty((threads, hq // hk, CHUNK), np.float32),
                         np.empty((threads, rows, 1, d), np.uint32), np.empty((threads, rows, 1, dv), np.uint32))


@njit(**JIT)
def _splits(n_q, hk, length, capacity_splits):
    """Chunks per (query, KV head): no chunk longer than CHUNK, at least MIN_TASKS tasks in all."""
    by_length = (length + CHUNK - 1) // CHUNK
    by_tasks = (MIN_TASKS + n_q * hk - 1) // (n_q * hk)
    return max(1, min(capacity_splits, max(by_length, by_tasks)))


@njit(**JIT)
def _key_range(p, length, window):
    """Keys [start, stop) query position p sees: causal, within kv_len, within the window if any."""
    stop = min(length, p + 1)
    start = max(0, p - window + 1) if window > 0 else 0
    return start, max(start, stop)


def _make_chunk(d: int, dv: int):
    """_chunk for head dims d (q, k) and dv (v) fixed at compile time: with constant trip counts LLVM
    keeps a row in vector registers (SmolLM2, 4096 keys, 1 thread: 12 ms a token against 22 with
    the dims read from the arrays)."""

    @njit(**JIT)
    def _chunk(q, t, h0, k, v, kh, j0, j1, scale, s, c, max_, sum_, acc):
        """Partial attention of q heads h0.. (one group) over key rows j0..j1 of k[:, kh], v[:, kh]."""
        group, n = s.shape[0], j1 - j0
        for g in range(group):
            qr, sg = q[t, h0 + g], s[g]
            for j in range(n):  # the chunk's K rows come from memory once, for the group's first head
                kr = k[j0 + j, kh]
                dot = np.float32(0.0)
                for i in range(d):
                    dot += qr[i] * kr[i]
                sg[j] = dot * scale
        for g in range(group):
            sg = s[g]
            m = sg[0]  # not -inf: fast-math assumes no infinities
            for j in range(1, n):
                m = max(m, sg[j])
            total = np.float32(0.0)
            for j in range(n):
                e = np.float32(np.exp(sg[j] - m))
                sg[j] = e
                total += e
            max_[t, h0 + g, c] = m
            sum_[t, h0 + g, c] = total
            a = acc[t, h0 + g, c]
            for i in range(dv):
                a[i] = 0.0
            for j in range(n):  # likewise V: from memory for the first head, from L2 for the others
                w, vr = sg[j], v[j0 + j, kh]
                for i in range(dv):
                    a[i] += w * vr[i]
    return _chunk


@njit(**JIT)
def _task(task, n_q, hk, splits, pos, length, window):
    """(query, KV head, chunk index, first key, end key) of a task; an empty chunk has j0 == j1."""
    c = task % splits
    kh = (task // splits) % hk
    t = task // (splits * hk)
    start, stop = _key_range(pos[t], length, window)
    j0 = start + (stop - start) * c // splits
    j1 = start + (stop - start) * (c + 1) // splits
    return t, kh, c, j0, j1


@njit(**JIT)
def _mark_empty(sum_, t, h0, group, c):
    for g in range(group):
        sum_[t, h0 + g, c] = 0.0  # a chunk with keys has a sum >= 1 (its max term is exp(0))


@njit(**JIT)
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
                    top = max_[t, h, c] if not seen else max(top, max_[t, h, c])
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


@njit(**EXACT)
def _widen_f16(src, kh, j0, j1, bits):
    """bits[r, 0] = the f32 bit pattern of f16 row src[j0 + r, kh], times 2^-112 (the caller rescales).

    Shifting sign, exponent and mantissa into place is exact for normal and subnormal halves; an
    all-ones exponent (inf / nan) is kept all ones."""
    for r in range(j1 - j0):
        for i in range(src.shape[2]):
            h = np.uint32(src[j0 + r, kh, i])
            b = ((h & np.uint32(0x8000)) << np.uint32(16)) | ((h & np.uint32(0x7FFF)) << np.uint32(13))
            if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):
                b |= np.uint32(0x7F800000)
            bits[r, 0, i] = b


@njit(**EXACT)
def _rescale(f, rows):
    for r in range(rows):
        for i in range(f.shape[2]):
            f[r, 0, i] *= _F16_SCALE


def _make_kernels(d: int) -> tuple:
    """(f32-cache kernel, f16-cache kernel) for head_dim d, named decode_attention[_f16]_d<d> (module
    globals, so precompile.py's helper process finds them by name; numba caches each apart)."""
    _chunk = _make_chunk(d, d)

    def decode_attention(q, k, v, pos, kv_len, scale, window, max_, sum_, acc, scores, out):
        """flash_attn for a few queries over an f32 cache k, v [capacity, hk, d]; see the module doc."""
        n_q, hq, _ = q.shape
        hk = k.shape[1]
        group = hq // hk
        length = kv_len[0]
        splits = _splits(n_q, hk, length, max_.shape[2])
        for task in prange(n_q * hk * splits):
            t, kh, c, j0, j1 = _task(task, n_q, hk, splits, pos, length, window)
            if j1 <= j0:
                _mark_empty(sum_, t, kh * group, group, c)
            else:
                me = numba.get_thread_id()
                _chunk(q, t, kh * group, k, v, kh, j0, j1, scale, scores[me], c, max_, sum_, acc)
        _merge(max_, sum_, acc, splits, out)

    def decode_attention_f16(q, k, v, pos, kv_len, scale, window, max_, sum_, acc, scores, k_bits, v_bits, out):
        """decode_attention over an f16 cache given as its uint16 bits: k, v [capacity, hk, d] u16."""
        n_q, hq, _ = q.shape
        hk = k.shape[1]
        group = hq // hk
        length = kv_len[0]
        splits = _splits(n_q, hk, length, max_.shape[2])
        for task in prange(n_q * hk * splits):
            t, kh, c, j0, j1 = _task(task, n_q, hk, splits, pos, length, window)
            if j1 <= j0:
                _mark_empty(sum_, t, kh * group, group, c)
                continue
            me = numba.get_thread_id()
            kf, vf = k_bits[me].view(np.float32), v_bits[me].view(np.float32)
            _widen_f16(k, kh, j0, j1, k_bits[me])
            _widen_f16(v, kh, j0, j1, v_bits[me])
            _rescale(kf, j1 - j0)
            _rescale(vf, j1 - j0)
            _chunk(q, t, kh * group, kf, vf, 0, 0, j1 - j0, scale, scores[me], c, max_, sum_, acc)
        _merge(max_, sum_, acc, splits, out)

    made = []
    for f in (decode_attention, decode_attention_f16):
        f.__name__ = f.__qualname__ = f"{f.__name__}_d{d}"
        made.append(njit(parallel=True, **JIT)(f))
    return tuple(made)


HEAD_DIMS = (64, 128, 256)  # the head dims with a decode kernel (SmolLM2 / Llama, Qwen3, Qwen3.5 and Gemma 3)
KERNELS = {d: _make_kernels(d) for d in HEAD_DIMS}
for _d, (_f32, _f16) in KERNELS.items():
    globals()[_f32.py_func.__name__], globals()[_f16.py_func.__name__] = _f32, _f16


def bind_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, kv_len: np.ndarray,
                scale: np.float32, window: int, out: np.ndarray) -> tuple[object, tuple]:
    """(kernel, args) of decode attention for these bound arrays: f32 or f16 caches, scratch made once."""
    f16 = k.dtype == np.float16
    sc = make_scratch(q.shape[0], q.shape[1], k.shape[1], k.shape[2], v.shape[2], k.shape[0], f16)
    common = (pos, kv_len, scale, window, sc.max_, sc.sum_, sc.acc, sc.scores)
    f32_kernel, f16_kernel = KERNELS[k.shape[2]]
    if f16:
        return f16_kernel, (q, k.view(np.uint16), v.view(np.uint16), *common, sc.k_bits, sc.v_bits, out)
    return f32_kernel, (q, k, v, *common, out)


def supports(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> bool:
    """Whether decode attention takes these arrays: few f32 queries, f32 or f16 caches alike, C-contiguous,
    a head dim in HEAD_DIMS (q, k and v alike)."""
    arrays = (q, k, v)
    return (q.shape[0] <= DECODE_MAX_QUERIES and q.dtype == np.float32 and k.dtype == v.dtype
            and k.shape[2] == v.shape[2] and k.shape[2] in HEAD_DIMS
            and k.dtype in (np.float32, np.float16) and all(a.flags.c_contiguous for a in arrays)
            and math.prod(q.shape) > 0)
