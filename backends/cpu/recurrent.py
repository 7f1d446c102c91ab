"""numba kernels for recurrent (linear-attention) layers: the causal conv step and the gated delta rule.

The gated delta rule, per value head h with key head kh (v head h reads k head h // (hv / hk)):
    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = q_t^T S_t
with a_t = exp(g_t) and q already scaled. `gdn_recurrent` runs it token by token (decode).

`gdn_chunked` (prefill) is the same recurrence, C tokens at a time, in the WY/UT form. Within a
chunk let G_t = g_1 + ... + g_t (cumulative log decay), gamma_t = exp(G_t), S_0 the entry state:
    u_t = beta_t v_t - beta_t gamma_t S_0^T k_t - sum_{j<t} beta_t e^{G_t - G_j} (k_t . k_j) u_j
i.e. (I + A) U = diag(beta) V - diag(beta gamma) K S_0, A strictly lower with
A_tj = beta_t e^{G_t-G_j} (k_t . k_j). With T = (I + A)^-1 (unit lower triangular, by forward
substitution on the C x C matrix):
    U   = T diag(beta) V - (T diag(beta gamma) K) S_0
    O   = diag(gamma) Q S_0 + (M o e^{G_t-G_j} o Q K^T) U        M: j <= t
    S_C = gamma_C S_0 + (diag(e^{G_C - G_t}) K)^T U
Every exponent is G_t - G_j with j <= t (<= 0), so nothing overflows. All but the C x C solve
are matmuls (numpy's batched BLAS over heads), so a chunk is parallel across its tokens; only the
chunks run in sequence. Measured at Qwen3.5-0.8B shapes (16 heads, d 128, 2 cores): a 64-token
chunk's matmuls take ~4 ms with OPENBLAS_NUM_THREADS=1 but 40-150 ms when OpenBLAS's threads
contend with numba's.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

# Serial kernels: at Qwen3.5-0.8B shapes one decode step of gdn_recurrent takes 0.26 ms serially and
# 3.5-8 ms with prange on 2 shared cores (the thread wake-up costs more than the work).
JIT = dict(cache=True, fastmath=False, nogil=True)
CHUNK = 64  # tokens per chunk in gdn_chunked (the fla / HF default)
CHUNKED_MIN_TOKENS = 16  # below this a prefill runs the token-by-token recurrence


# ---------------------------------------------------------------- conv
@njit(**JIT)
def ssm_conv(x, state, w, apply_silu, y, new_state):
    """y[t, c] = sum_j w[c, j] * [state; x][t + j, c] (then silu); new_state = last K-1 rows of [state; x].

    x, y [n, C]; state, new_state [K-1, C]; w [C, K]."""
    n, channels = x.shape
    k = w.shape[1]
    hist = k - 1
    for c in range(channels):
        for t in range(n):
            acc = np.float32(0.0)
            for j in range(k):
                r = t + j
                v = state[r, c] if r < hist else x[r - hist, c]
                acc += w[c, j] * v
            if apply_silu:
                acc = acc / (np.float32(1.0) + np.exp(-acc))
            y[t, c] = acc
        for r in range(hist):
            s = n + r
            new_state[r, c] = state[s, c] if s < hist else x[s - hist, c]


# ---------------------------------------------------------------- small helpers
@njit(**JIT)
def l2_norm(x, eps, out):
    """out = x / sqrt(sum(x^2) + eps) over the last axis of [a, b, d] arrays (strided views allowed)."""
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            acc = np.float32(0.0)
            for d in range(x.shape[2]):
                acc += x[i, j, d] * x[i, j, d]
            inv = np.float32(1.0) / np.sqrt(acc + np.float32(eps))
            for d in range(x.shape[2]):
                out[i, j, d] = x[i, j, d] * inv


@njit(**JIT)
def gdn_gates(alpha, b, a_neg, dt_bias, g_out, beta_out):
    """g = a_neg * softplus(alpha + dt_bias), beta = sigmoid(b); alpha, b, g_out, beta_out [n, hv]."""
    for t in range(alpha.shape[0]):
        for h in range(alpha.shape[1]):
            z = np.float64(alpha[t, h]) + np.float64(dt_bias[h])
            sp = z if z > 30.0 else math.log1p(math.exp(z))
            g_out[t, h] = np.float32(a_neg[h] * sp)
            beta_out[t, h] = np.float32(1.0 / (1.0 + math.exp(-np.float64(b[t, h]))))


# ---------------------------------------------------------------- token by token
@njit(**JIT)
def gdn_recurrent(q, k, v, g, beta, state, scale, o, new_state):
    """q, k [n, hk, dk]; v [n, hv, dv]; g, beta [n, hv]; state, new_state [hv, dk, dv]; o [n, hv, dv]."""
    gdn_recurrent_steps(q, k, v, g, beta, state, scale, o, new_state, np.empty((0, 0, 0, 0), np.float32))


@njit(**JIT)
def gdn_recurrent_steps(q, k, v, g, beta, state, scale, o, new_state, steps):
    """gdn_recurrent, also writing the state after token t to steps[t] when steps [n, hv, dk, dv] has rows
    (a speculative verify call's per-token states; an empty steps writes none)."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    rep = hv // hk
    for h in range(hv):
        kh = h // rep
        s = new_state[h]
        s[:, :] = state[h]
        mem = np.empty(dv, np.float32)
        for t in range(n):
            a = np.float32(math.exp(g[t, h]))
            mem[:] = 0.0
            for i in range(dk):
                ki = k[t, kh, i]
                for j in range(dv):
                    sij = s[i, j] * a
                    s[i, j] = sij
                    mem[j] += ki * sij
            bt = beta[t, h]
            for j in range(dv):
                mem[j] = bt * (v[t, h, j] - mem[j])  # now the update u_t
            for j in range(dv):
                o[t, h, j] = 0.0
            for i in range(dk):
                ki = k[t, kh, i]
                qi = q[t, kh, i] * np.float32(scale)
                for j in range(dv):
                    sij = s[i, j] + ki * mem[j]
                    s[i, j] = sij
                    o[t, h, j] += qi * sij
            if steps.shape[0] > 0:
                steps[t, h] = s


# ---------------------------------------------------------------- chunked (WY / UT transform)
@njit(**JIT)
def unit_lower_inverse(a, t_out):
    """t_out[h] = (I + a[h])^-1 for strictly lower a [H, L, L], by forward substitution: row r of T
    is e_r - sum_{m<r} a[r, m] T[m] (T[m] is zero right of m). Serial: 16 heads of 64 x 64 take
    0.6 ms, and prange's wake-up cost more than that (8 ms measured on 2 busy cores)."""
    heads, size = a.shape[0], a.shape[1]
    for h in range(heads):
        t = t_out[h]
        t[:, :] = 0.0
        for r in range(size):
            t[r, r] = 1.0
            for m in range(r):
                arm = a[h, r, m]
                if arm != 0.0:
                    for j in range(m + 1):
                        t[r, j] -= arm * t[m, j]


def gdn_chunked(q, k, v, g, beta, state, scale, chunk, o, new_state) -> None:
    """gdn_recurrent's result computed `chunk` tokens at a time (see the module doc): batched BLAS
    matmuls over heads for everything but the C x C triangular inverse (numba)."""
    n, hk, _ = q.shape
    hv = v.shape[1]
    rep = hv // hk
    # Head-major contiguous copies: numpy's batched matmul only reaches BLAS for contiguous matrices.
    qh = np.ascontiguousarray(np.repeat(q, rep, axis=1).transpose(1, 0, 2)) * np.float32(scale)  # [hv, n, dk]
    kh = np.ascontiguousarray(np.repeat(k, rep, axis=1).transpose(1, 0, 2))  # [hv, n, dk]
    vh = np.ascontiguousarray(np.asarray(v, np.float32).transpose(1, 0, 2))  # [hv, n, dv]
    gh, bh = np.ascontiguousarray(np.asarray(g, np.float64).T), np.ascontiguousarray(np.asarray(beta, np.float32).T)
    s = np.array(state, np.float32)  # [hv, dk, dv]
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        size = c1 - c0
        kc, qc, vc, bc = kh[:, c0:c1], qh[:, c0:c1], vh[:, c0:c1], bh[:, c0:c1]
        cum = np.cumsum(gh[:, c0:c1], axis=1)  # [hv, L] log decay from the chunk start
        causal = np.tril(np.ones((size, size), bool))
        with np.errstate(under="ignore"):
            decay = np.exp(np.where(causal, cum[:, :, None] - cum[:, None, :], -np.inf)).astype(np.float32)
            gamma = np.exp(cum).astype(np.float32)  # [hv, L]
            tail = np.exp(cum[:, -1:] - cum).astype(np.float32)  # e^{G_C - G_t}
        kt = kc.transpose(0, 2, 1)
        a = np.tril(bc[:, :, None] * decay * (kc @ kt), -1)  # [hv, L, L]
        tinv = np.empty_like(a)
        unit_lower_inverse(a, tinv)
        u = tinv @ (bc[:, :, None] * vc) - (tinv @ ((bc * gamma)[:, :, None] * kc)) @ s  # [hv, L, dv]
        out = gamma[:, :, None] * (qc @ s) + ((qc @ kt) * decay) @ u  # [hv, L, dv]
        o[c0:c1] = out.transpose(1, 0, 2)
        s = np.exp(cum[:, -1]).astype(np.float32)[:, None, None] * s + (kc * tail[:, :, None]).transpose(0, 2, 1) @ u
    new_state[...] = s


def gated_delta_net(q, k, v, g, beta, state, scale, o, new_state, chunk: int = CHUNK,
                    steps: np.ndarray | None = None) -> None:
    """The kernel for n tokens: chunked for prefill, token by token below CHUNKED_MIN_TOKENS. `steps`
    [n, hv, dk, dv] (a verify call's per-token states, n <= 16) runs token by token and keeps each."""
    if steps is not None:
        gdn_recurrent_steps(q, k, v, g, beta, state, np.float32(scale), o, new_state, steps)
    elif q.shape[0] >= CHUNKED_MIN_TOKENS:
        gdn_chunked(q, k, v, g, beta, state, scale, chunk, o, new_state)
    else:
        gdn_recurrent(q, k, v, g, beta, state, np.float32(scale), o, new_state)
