"""The chunked gated delta rule for prefill on the GPU (delta_chunked.cu), for gated_delta_net and
gated_delta_net_raw at n >= CHUNKED_MIN_TOKENS (recurrent.py `_gdn` picks it).

Two launches per node: gdn_chunk_prep, parallel over every (chunk, v-head), computes what depends
only on q, k and the gates (the UT transform T = (I + A)^-1, the decayed causal q.k matrix P and
per-token row factors) into a record scratch; gdn_chunk_scan then walks the chunks in order per
(v-head, GDC_TILE state columns) with the state tile on chip. So the token-by-token dependency
becomes a chunk-by-chunk one, CHUNK x fewer sequential steps, each a set of small matrix products.
The math is the cpu backend's (backends/cpu/recurrent.py module doc), with q and k normalized (with
l2_eps) and scaled through the row factors rather than rewritten.

Scratch: one record of RECORD floats per (chunk, v-head), allocated at lowering: 4.5 KiB per 32
tokens per v-head, e.g. 18 MiB for 4096 tokens at 32 v-heads.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphir.errors import BackendError

from .launch import Launch, Lowering, cdiv, f32, i32

SOURCE = "delta_chunked.cu"
CHUNK = 32  # delta_chunked.cu GDC_L: tokens per chunk
THREADS = 128  # GDC_THREADS
TILE = 16  # GDC_TILE: state columns per scan block
RECORD = CHUNK * CHUNK + 4 * CHUNK + 4  # GDC_REC: floats per (chunk, v-head)
DK_CLASSES = (64, 128)  # gdn_chunk_*_d{DK} specializations: d_k <= DK
# Below this many tokens the token-loop kernel (recurrent.cu) runs. An estimate, not yet measured:
# one chunk (two launches, a serial 32-row substitution, one scan step) against 32 latency-bound
# token steps; benchmarks/bench_gpu_delta_chunked.py prints the measured crossover. Both paths may
# write the state in place, so the threshold is free to move.
CHUNKED_MIN_TOKENS = 32


def supports(dk: int) -> bool:
    """Whether the chunked kernels handle head dim d_k (the token loop covers larger ones)."""
    return dk <= DK_CLASSES[-1]


def record_floats(n: int, hv: int) -> int:
    """Size of the record scratch for n tokens and hv v-heads."""
    return cdiv(n, CHUNK) * hv * RECORD


def chunked_launches(lw: Lowering, node: Any, q: Any, k: Any, v: Any, gate0: Any, gate1: Any, a_neg: Any,
                     dt_bias: Any, a_st: np.int32, a_sh: np.int32, d_st: np.int32, d_sh: np.int32, state: Any,
                     o: Any, new_state: Any, n: int, hk: int, hv: int, dk: int, dv: int, scale: float, raw: bool,
                     l2_eps: float | None) -> list[Launch]:
    """The launches of one gated_delta_net(_raw) node in chunks. Arguments as recurrent.py `_gdn`
    has them after its checks: f32 C-contiguous device arrays q, k [n, hk, dk], v [n, hv, dv],
    gate0/gate1 (g/beta, or alpha/b when raw) [n, hv], a_neg/dt_bias with their element strides per
    token and per v-head (any valid arrays and 0 when not raw), state and new_state [hv, dk, dv]
    (new_state may be state itself), o [n, hv, dv]."""
    dk_class = next((d for d in DK_CLASSES if dk <= d), None)
    if dk_class is None:
        raise BackendError(f"{_name(node)}: d_k {dk} > {DK_CLASSES[-1]}, the largest the chunked gated delta "
                           f"rule supports (use the token loop)")
    if hv == 0 or dv == 0 or dk == 0:
        return []
    n_chunks = cdiv(n, CHUNK)
    steps = []
    rec = state  # never read without chunks
    if n_chunks:
        rec = lw.scratch((record_floats(n, hv),))
        name = f"gdn_chunk_prep{'_raw' if raw else ''}_d{dk_class}"
        args = (q, k, gate0, gate1, a_neg, dt_bias, rec, i32(n), i32(hk), i32(hv), i32(dk), f32(scale),
                a_st, a_sh, d_st, d_sh, i32(l2_eps is not None), f32(l2_eps or 0.0))
        steps.append(Launch(SOURCE, name, (n_chunks, hv), THREADS, args))
    args = (q, k, v, rec, state, o, new_state, i32(n), i32(hk), i32(hv), i32(dk), i32(dv))
    steps.append(Launch(SOURCE, f"gdn_chunk_scan_d{dk_class}", (cdiv(dv, TILE), hv), THREADS, args))
    return steps


def _name(node: Any) -> str:
    return f"{getattr(node, 'op', 'node')} {getattr(node, 'name', '') or ''}".strip()
