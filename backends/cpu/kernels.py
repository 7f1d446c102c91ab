"""numba kernels for the CPU backend (everything but the matmuls, which live in matmul.py).

Every kernel writes into a preallocated `out` so a replayed step allocates nothing.
Rows are the last axis; callers pass 2-D [rows, n] views (3-D for attention and rope).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .attention import exp_parts
from .stack_array import as_f32, stack_f32, stack_i32

CACHE_DEPENDS = ("attention.py", "stack_array.py")  # compiled into the kernels: exp_parts, the stack scratch

JIT = dict(cache=True, fastmath=True, nogil=True)


@njit(**JIT)
def _inv_rms(row, eps):
    acc = np.float32(0.0)
    for i in range(row.shape[0]):
        acc += row[i] * row[i]
    return np.float32(1.0) / np.sqrt(acc / row.shape[0] + np.float32(eps))


@njit(**JIT)
def rms_norm(x, eps, out):
    for r in range(x.shape[0]):
        inv = _inv_rms(x[r], eps)
        for i in range(x.shape[1]):
            out[r, i] = x[r, i] * inv


@njit(**JIT)
def rms_norm_mul(x, w, eps, out):
    """out = rms_norm(x) * w, w broadcast over rows."""
    for r in range(x.shape[0]):
        inv = _inv_rms(x[r], eps)
        for i in range(x.shape[1]):
            out[r, i] = x[r, i] * inv * w[i]


@njit(**JIT)
def rms_norm_mul_gate(x, w, z, eps, out):
    """out = rms_norm(x) * w * silu(z) over the last axis of [n, heads, d] (Qwen3.5's gated output norm, per
    head), w broadcast. 3-D so that z, a column slice of a stacked projection, needs no copy at any n: a
    verify call's rows then take this kernel, as a decode step's do."""
    for t in range(x.shape[0]):
        for r in range(x.shape[1]):
            inv = _inv_rms(x[t, r], eps)
            for i in range(x.shape[2]):
                g = z[t, r, i]
                out[t, r, i] = x[t, r, i] * inv * w[i] * (g / (np.float32(1.0) + np.exp(-g)))


@njit(**JIT)
def add_rms_norm_mul(a, b, w, eps, out_norm, out_sum):
    """out_sum = a + b (the residual the next layer reads); out_norm = rms_norm(out_sum) * w."""
    for r in range(a.shape[0]):
        acc = np.float32(0.0)
        for i in range(a.shape[1]):
            s = a[r, i] + b[r, i]
            out_sum[r, i] = s
            acc += s * s
        inv = np.float32(1.0) / np.sqrt(acc / a.shape[1] + np.float32(eps))
        for i in range(a.shape[1]):
            out_norm[r, i] = out_sum[r, i] * inv * w[i]


@njit(**JIT)
def silu(x, out):
    for r in range(x.shape[0]):
        for i in range(x.shape[1]):
            v = x[r, i]
            out[r, i] = v / (np.float32(1.0) + np.exp(-v))


SWIGLU_PIECE = 512  # elements per pass: the polynomial and 2^k scratch rows stay in L1


@njit(**JIT)
def _swiglu_piece(a, b, out, r, c0, c1):
    """out[r, c0:c1] = silu(a) * b, exp(-a) by attention.exp_parts: both loops vectorize, where libm's expf
    is a call per element (SmolLM2 prefill-512: swiglu 65 ms with expf, 2 threads). exp(-a) is clamped to
    [e^-87, e^88], inside f32 and far past where silu is a or 0 in f32."""
    n = c1 - c0
    poly = stack_f32(SWIGLU_PIECE)  # scratch on the stack (stack_array.py: np.empty made every process loading
    bits = stack_i32(SWIGLU_PIECE)  # this kernel import numba.np.arrayobj; 0.03 s of a first token)
    pow2 = as_f32(bits)
    for i in range(n):
        poly[i], bits[i] = exp_parts(min(max(-a[r, c0 + i], np.float32(-87.0)), np.float32(88.0)))
    for i in range(n):
        out[r, c0 + i] = a[r, c0 + i] / (np.float32(1.0) + poly[i] * pow2[i]) * b[r, c0 + i]


@njit(**JIT)
def swiglu(a, b, out):
    """out = silu(a) * b on the calling thread: a decode row (1536 wide) takes ~9 us, and a parallel
    region around it cost ~4 us more than it saved (2 cores, quiet)."""
    for r in range(a.shape[0]):
        for c0 in range(0, a.shape[1], SWIGLU_PIECE):
            _swiglu_piece(a, b, out, r, c0, min(a.shape[1], c0 + SWIGLU_PIECE))


@njit(parallel=True, **JIT)
def swiglu_split(a, b, out):
    """out = silu(a) * b, split into SWIGLU_PIECE-wide pieces so the threads share even a few rows."""
    rows, cols = a.shape
    pieces = (cols + SWIGLU_PIECE - 1) // SWIGLU_PIECE
    for task in prange(rows * pieces):
        r = task // pieces
        c0 = (task % pieces) * SWIGLU_PIECE
        _swiglu_piece(a, b, out, r, c0, min(cols, c0 + SWIGLU_PIECE))


@njit(**JIT)
def _rope_token(x, dst, p, inv_freq, n_dims, neox):
    """One token: x, dst [heads, head_dim] (may be the same array: each pair is read, then written)."""
    half = n_dims // 2
    heads, hd = x.shape
    for j in range(half):
        ang = p * inv_freq[j]
        c = np.float32(math.cos(ang))
        s = np.float32(math.sin(ang))
        i0 = j if neox else 2 * j
        i1 = j + half if neox else 2 * j + 1
        for h in range(heads):
            a = x[h, i0]
            b = x[h, i1]
            dst[h, i0] = a * c - b * s
            dst[h, i1] = a * s + b * c
    for h in range(heads):
        for i in range(n_dims, hd):
            dst[h, i] = x[h, i]


@njit(**JIT)
def rope(x, pos, inv_freq, n_dims, neox, freq_scale, out):
    """x, out: [n, heads, head_dim]; rotates the first n_dims of each head; the rest is copied."""
    for t in range(x.shape[0]):
        _rope_token(x[t], out[t], np.float64(pos[t]) * freq_scale, inv_freq, n_dims, neox)


@njit(**JIT)
def set_rows(dst, src, idx):
    for r in range(src.shape[0]):
        row = idx[r]
        if row < 0 or row >= dst.shape[0]:
            raise IndexError("set_rows: row index out of range")
        for i in range(src.shape[1]):
            dst[row, i] = src[r, i]


@njit(parallel=True, **JIT)
def attention(q, k, v, pos, kv_len, scale, window, out):
    """Causal GQA attention: one (query, head) pair per task; scores, then softmax, then the sum.

    Used for decode and prefill alike. Two passes over the keys (scores into a scratch row,
    then exp and the weighted sum of V) keep both inner loops branch-free, so they vectorize.
    numba rather than numpy BLAS: OpenBLAS's threads spin between calls and starve numba's
    pool on 2 cores (SmolLM2, 512 tokens, 30 layers: 7 s with BLAS, 0.7 s with numba).
    """
    n, hq, d = q.shape
    hk = k.shape[1]
    dv = v.shape[2]
    group = hq // hk
    length = kv_len[0]
    for task in prange(n * hq):
        t = task // hq
        h = task % hq
        kh = h // group
        stop = min(length, pos[t] + 1)
        start = max(0, pos[t] - window + 1) if window > 0 else 0
        if stop <= start:
            for i in range(dv):
                out[t, h, i] = 0.0
            continue
        s = np.empty(stop - start, np.float32)
        m = np.float32(-np.inf)
        for j in range(start, stop):
            dot = np.float32(0.0)
            for i in range(d):
                dot += q[t, h, i] * k[j, kh, i]
            dot *= scale
            s[j - start] = dot
            m = max(m, dot)
        denom = np.float32(0.0)
        for j in range(stop - start):
            e = np.float32(np.exp(s[j] - m))
            s[j] = e
            denom += e
        acc = np.zeros(dv, np.float32)
        for j in range(start, stop):
            p = s[j - start]
            for i in range(dv):
                acc[i] += p * v[j, kh, i]
        inv = np.float32(1.0) / denom
        for i in range(dv):
            out[t, h, i] = acc[i] * inv


@njit(**JIT)
def rope_set_rows(cache, x, pos, idx, inv_freq, n_dims, neox, freq_scale):
    """cache[idx[t]] = rope(x)[t]: roped K goes straight into its KV-cache row."""
    for t in range(x.shape[0]):
        row = idx[t]
        if row < 0 or row >= cache.shape[0]:
            raise IndexError("rope_set_rows: row index out of range")
        _rope_token(x[t], cache[row], np.float64(pos[t]) * freq_scale, inv_freq, n_dims, neox)
