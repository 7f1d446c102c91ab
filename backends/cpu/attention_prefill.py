"""Prefill attention on the CPU: many queries at once, computed as small matrix products.

kernels.attention (one task per query and head, a horizontal dot product per key) took 544 ms of
a 1.74 s SmolLM2 prefill of 512 tokens (2 threads, Xeon, profile_decode.py --tokens 512): ~17 GFLOP/s;
this kernel took 18 ms a layer where that one took 21 (1 thread, 512 queries, a loaded machine; the
machine was too noisy to tell block sizes 8..32 and chunks 64..128 apart).

Here a task is a block of QUERY_BLOCK queries of one KV head with all of its GQA group's q heads
(rows = queries x group), and keys go by chunks of CHUNK, flash-attention style:

- scores: each K row of the chunk is read once and dotted with 4 rows at a time (as the decode
  kernel does with a GQA group), the loads of the row shared by the four dot products;
- per row, an online softmax over the chunks: running max m and sum den, the output O rescaled by
  exp(m_old - m_new) when the max grows; exp is attention._exp_in_place (vectorized);
- O[r, :] += p[r, j] * V[j, :] over head_dim in SIMD lanes, 4 V rows at a time (a quarter of the
  loads and stores of O);
- each row sees only its own keys [start, stop) (causal, kv_len, sliding window): a chunk's keys
  outside them get weight 0, and a row with no key at all gives 0, as the reference.

Tasks are dealt round-robin to the threads: causal blocks late in the prompt have more keys, and
numba's prange would give one thread all the long ones. One kernel per head_dim (a constant, so
the inner loops have fixed trip counts), named prefill_attention_d<d>, a module global so that
precompile.py's helper finds it.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .attention import DECODE_MAX_QUERIES, HEAD_DIMS, _exp_in_place, _key_range

JIT = dict(cache=True, fastmath=True, nogil=True)
QUERY_BLOCK = 16  # queries per task: 16 x 3 (SmolLM2's GQA group) = 48 rows share every K and V row read
CHUNK = 64  # keys per chunk: KT [d, 64], S [rows, 64] and O [rows, d] stay in L1 / L2
MIN_QUERIES = DECODE_MAX_QUERIES + 1  # fewer queries go to the decode kernel


@njit(**JIT)
def _rescale_and_exp(s, r, cn, a, b, m, den, o, pow2_bits):
    """Row r of the chunk's scores s[r, :cn], of which keys [a, b) are visible: the online-softmax step.
    Updates m[r], den[r] (the running sum) and rescales o[r]; leaves s[r, :cn] = exp(score - m[r]) on
    [a, b), 0 elsewhere."""
    sr = s[r]
    top = sr[a]
    for j in range(a + 1, b):
        top = max(top, sr[j])
    if den[r] == 0.0:  # the row's first visible key
        m[r] = top
    elif top > m[r]:
        f = np.float32(np.exp(m[r] - top))
        den[r] *= f
        orow = o[r]
        for i in range(orow.shape[0]):
            orow[i] *= f
        m[r] = top
    for j in range(a):
        sr[j] = 0.0
    den[r] += _exp_in_place(sr[a:b], m[r], pow2_bits, pow2_bits.view(np.float32))
    for j in range(b, cn):
        sr[j] = 0.0


def _make_kernel(d: int):
    """The prefill kernel for head_dim d (a compile-time constant; see the module doc)."""

    def prefill_attention(q, k, v, pos, kv_len, scale, window, nth, out):
        """flash_attn for many queries q [n, hq, d] over a cache k, v [capacity, hk, d]."""
        n, hq = q.shape[0], q.shape[1]
        hk = k.shape[1]
        group = hq // hk
        length = kv_len[0]
        blocks = (n + QUERY_BLOCK - 1) // QUERY_BLOCK
        tasks = blocks * hk
        workers = max(1, min(nth, tasks))
        for wkr in prange(workers):
            rows_max = QUERY_BLOCK * group
            qs = np.zeros((rows_max + 3, d), np.float32)  # rows past a block's own stay 0: scored in fours
            live = np.empty(rows_max, np.bool_)
            s = np.empty((rows_max, CHUNK), np.float32)
            o = np.empty((rows_max, d), np.float32)
            m = np.empty(rows_max, np.float32)
            den = np.empty(rows_max, np.float32)
            lo = np.empty(rows_max, np.int64)
            hi = np.empty(rows_max, np.int64)
            pow2_bits = np.empty(CHUNK, np.int32)
            for task in range(wkr, tasks, workers):
                kh = task % hk
                t0 = (task // hk) * QUERY_BLOCK
                nt = min(QUERY_BLOCK, n - t0)
                rows = nt * group
                rows4 = (rows + 3) // 4 * 4
                k0, k1 = length, 0  # the block's key range: the union of its rows'
                for r in range(rows):
                    t = t0 + r // group
                    h = kh * group + r % group
                    a, b = _key_range(pos[t], length, window)
                    lo[r], hi[r] = a, b
                    if b > a:
                        k0, k1 = min(k0, a), max(k1, b)
                    for i in range(d):
                        qs[r, i] = q[t, h, i] * scale
                        o[r, i] = 0.0
                    m[r], den[r] = 0.0, 0.0
                for r in range(rows, rows4):
                    for i in range(d):
                        qs[r, i] = 0.0
                for j0 in range(k0, k1, CHUNK):
                    cn = min(CHUNK, k1 - j0)
                    for j in range(cn):  # each K row once, scored against 4 rows at a time (shared loads)
                        kr = k[j0 + j, kh]
                        for r in range(0, rows4, 4):
                            q0, q1, q2, q3 = qs[r], qs[r + 1], qs[r + 2], qs[r + 3]
                            a0 = a1 = a2 = a3 = np.float32(0.0)
                            for i in range(d):
                                x = kr[i]
                                a0 += q0[i] * x
                                a1 += q1[i] * x
                                a2 += q2[i] * x
                                a3 += q3[i] * x
                            s[r, j], s[r + 1, j], s[r + 2, j], s[r + 3, j] = a0, a1, a2, a3
                    for r in range(rows):
                        a, b = max(lo[r], j0) - j0, min(hi[r], j0 + cn) - j0
                        live[r] = b > a
                        if live[r]:
                            _rescale_and_exp(s, r, cn, a, b, m, den, o, pow2_bits)
                    c4 = cn - cn % 4
                    for j in range(0, c4, 4):  # V rows 4 at a time: a quarter of the loads and stores of o
                        v0, v1, v2, v3 = v[j0 + j, kh], v[j0 + j + 1, kh], v[j0 + j + 2, kh], v[j0 + j + 3, kh]
                        for r in range(rows):
                            if live[r]:
                                w0, w1, w2, w3, orow = s[r, j], s[r, j + 1], s[r, j + 2], s[r, j + 3], o[r]
                                for i in range(d):
                                    orow[i] += (w0 * v0[i] + w1 * v1[i]) + (w2 * v2[i] + w3 * v3[i])
                    for j in range(c4, cn):
                        vr = v[j0 + j, kh]
                        for r in range(rows):
                            if live[r]:
                                w, orow = s[r, j], o[r]
                                for i in range(d):
                                    orow[i] += w * vr[i]
                for r in range(rows):
                    t = t0 + r // group
                    h = kh * group + r % group
                    inv = np.float32(1.0) / den[r] if den[r] > 0.0 else np.float32(0.0)
                    for i in range(d):
                        out[t, h, i] = o[r, i] * inv

    name = f"prefill_attention_d{d}"
    prefill_attention.__name__ = prefill_attention.__qualname__ = name
    return njit(parallel=True, **JIT)(prefill_attention)


KERNELS = {d: _make_kernel(d) for d in HEAD_DIMS}
for _kernel in KERNELS.values():
    globals()[_kernel.py_func.__name__] = _kernel


def supports(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> bool:
    """Whether the prefill kernel takes these arrays: MIN_QUERIES or more f32 queries over f32 caches, all
    C-contiguous, one head dim in HEAD_DIMS for q, k and v, whole GQA groups."""
    return (q.shape[0] >= MIN_QUERIES and q.dtype == k.dtype == v.dtype == np.float32
            and q.shape[2] == k.shape[2] == v.shape[2] and k.shape[2] in HEAD_DIMS
            and q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1]
            and all(a.flags.c_contiguous for a in (q, k, v)))
