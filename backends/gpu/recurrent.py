"""Lowering rules for the recurrent ops of Gated DeltaNet layers (recurrent.cu).

ssm_conv / ssm_conv_silu: one thread per (channel, run of CONV_TOKENS tokens), a register window
of the kernel's K-1 taps. gated_delta_net / gated_delta_net_raw: the f32 state stays in
registers for the whole call (read once, written once), a token loop inside the kernel (the
`_step` kernels for a few tokens, the `_r{ROWS}` ones otherwise, delta_chunked for prefill); the raw
variant computes g = a_neg * softplus(alpha + dt_bias) and beta = sigmoid(b) in the kernel.
Every rule writes the new state into its output. The program (program.py) may hand a rule the
State buffer itself as that output when the graph only assigns it back (`inplace_state`): for the
token-loop kernels that is safe, as each thread reads its state elements before it writes them
(recurrent.cu), and it saves the assign's copy and a second pass over the state.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphir.errors import BackendError

from . import delta_chunked
from .launch import Launch, Lowering, cdiv, dev, f32, i32

SOURCE = "recurrent.cu"
CONV_BLOCK = 128  # recurrent.cu CONV_BLOCK
CONV_TOKENS = 8  # recurrent.cu CONV_TOKENS
CONV_KMAX = (4, 8, 16)  # ssm_conv_k{KMAX} specializations: the kernel width k <= KMAX
GDN_BLOCK = 64  # recurrent.cu GDN_BLOCK
GDN_TILE = 16  # state columns per block (GDN_BLOCK / GDN_SPLIT)
GDN_SPLIT = 4  # threads per state column
GDN_ROWS = (2, 4, 8, 16, 32, 64)  # gated_delta_net_r{ROWS}: dk <= ROWS * GDN_SPLIT
# Few tokens (decode, verify: n <= FEW_TOKENS), dv % 4 == 0, 16-byte aligned state/v/o:
# gated_delta_net(_raw)_step_d{DK}, 256 threads per 16 columns of a head, float4 state (recurrent.cu)
GDS_THREADS, GDS_COLS, GDS_DK = 256, 16, (64, 128)


NULL = np.uint64(0)  # a null pointer kernel argument
FEW_TOKENS = 16  # decode and verify calls: the token-loop kernels (not delta_chunked), which may write in place
_STATE_INPUT = {"ssm_conv": 1, "ssm_conv_silu": 1, "gated_delta_net": 5, "gated_delta_net_raw": 7}


def inplace_state(node: Any) -> int | None:
    """The source index of the State that `node`'s kernel may overwrite with its result 1 (the new
    state), or None. The conv kernel is in-place safe only with one token run in its grid."""
    j = _STATE_INPUT.get(node.op)
    if j is None:
        return None
    n = node.src[0].shape[0]
    limit = CONV_TOKENS if node.op.startswith("ssm_conv") else FEW_TOKENS
    return j if n <= limit else None


def _f32(node: Any, what: str, a: Any) -> Any:
    """`a` as a C-contiguous float32 device array, or a BackendError naming the node."""
    a = dev(a)
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise BackendError(f"{_name(node)}: {what} must be a C-contiguous float32 array on the gpu backend, "
                           f"got {a.dtype} (contiguous: {a.flags.c_contiguous})")
    return a


def _name(node: Any) -> str:
    return f"{getattr(node, 'op', 'node')} {getattr(node, 'name', '') or ''}".strip()


# ---------------------------------------------------------------- ssm_conv
def _conv(lw: Lowering, node: Any, ins: list, outs: list, silu: bool) -> list:
    x, state, w = (_f32(node, nm, a) for nm, a in zip(("x", "state", "w"), ins))
    y, new_state = (_f32(node, nm, a) for nm, a in zip(("y", "new_state"), outs))
    n, channels = x.shape
    k = w.shape[1]
    if w.shape[0] != channels or state.shape != (k - 1, channels) or k < 2:
        raise BackendError(f"{_name(node)}: x {list(x.shape)}, state {list(state.shape)}, w {list(w.shape)} "
                           f"are not [n, C], [K-1, C], [C, K] with K >= 2")
    kmax = next((m for m in CONV_KMAX if k <= m), None)
    if kmax is None:
        raise BackendError(f"{_name(node)}: conv kernel width {k} > {CONV_KMAX[-1]}, the largest the gpu "
                           f"backend's ssm_conv supports")
    if channels == 0:
        return []
    name = f"ssm_conv{'_silu' if silu else ''}_k{kmax}"
    # n == 0 still runs one token run: it copies state into new_state.
    grid = (cdiv(channels, CONV_BLOCK), max(1, cdiv(n, CONV_TOKENS)))
    return [Launch(SOURCE, name, grid, CONV_BLOCK, (x, state, w, y, new_state, i32(n), i32(channels), i32(k)))]


def lower_ssm_conv(lw: Lowering, node: Any, ins: list, outs: list, p: dict) -> list:
    return _conv(lw, node, ins, outs, silu=False)


def lower_ssm_conv_silu(lw: Lowering, node: Any, ins: list, outs: list, p: dict) -> list:
    return _conv(lw, node, ins, outs, silu=True)


# ---------------------------------------------------------------- gated delta rule
def _broadcast_strides(node: Any, what: str, a: Any, n: int, hv: int) -> tuple[np.int32, np.int32]:
    """Element strides (per token, per v-head) of `a` broadcast onto [n, hv]: 0 on axes of size 1."""
    shape = (1,) * (2 - a.ndim) + tuple(a.shape) if a.ndim <= 2 else None
    if shape is None or shape[0] not in (1, n) or shape[1] not in (1, hv):
        raise BackendError(f"{_name(node)}: {what} {list(a.shape)} does not broadcast onto [tokens, v_heads]="
                           f"{[n, hv]}")
    return i32(shape[1] if shape[0] == n and n > 1 else 0), i32(1 if shape[1] == hv and hv > 1 else 0)


def _gdn(lw: Lowering, node: Any, q: Any, k: Any, v: Any, gate0: Any, gate1: Any, a_neg: Any, dt_bias: Any,
         state: Any, outs: list, p: dict, raw: bool) -> list:
    o, new_state = (_f32(node, nm, a) for nm, a in zip(("o", "new_state"), outs))
    steps = _f32(node, "steps", outs[2]) if p.get("steps") else None
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != n or hk == 0 or hv % hk or state.shape != (hv, dk, dv):
        raise BackendError(f"{_name(node)}: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, state "
                           f"{list(state.shape)} are not [n, hk, dk], [n, hk, dk], [n, hv, dv], [hv, dk, dv] "
                           f"with hv a multiple of hk")
    for what, a in (("g" if not raw else "alpha", gate0), ("beta" if not raw else "b", gate1)):
        if a.shape != (n, hv):
            raise BackendError(f"{_name(node)}: {what} {list(a.shape)} must be [tokens, v_heads]={[n, hv]}")
    rows = next((r for r in GDN_ROWS if dk <= r * GDN_SPLIT), None)
    if rows is None:
        raise BackendError(f"{_name(node)}: d_k {dk} > {GDN_ROWS[-1] * GDN_SPLIT}, the largest the gpu "
                           f"backend's gated_delta_net keeps in registers")
    if hv == 0 or dv == 0 or dk == 0:
        return []
    if raw:
        a_st, a_sh = _broadcast_strides(node, "a_neg", a_neg, n, hv)
        d_st, d_sh = _broadcast_strides(node, "dt_bias", dt_bias, n, hv)
    else:  # unused by the plain kernel: any valid pointers
        a_neg, dt_bias = gate0, gate0
        a_st = a_sh = d_st = d_sh = i32(0)
    name = f"gated_delta_net{'_raw' if raw else ''}_r{rows}"
    l2_eps = p.get("l2_eps")
    if steps is None and n >= delta_chunked.CHUNKED_MIN_TOKENS and delta_chunked.supports(dk):
        return delta_chunked.chunked_launches(lw, node, q, k, v, gate0, gate1, a_neg, dt_bias, a_st, a_sh, d_st, d_sh,
                                              state, o, new_state, n, hk, hv, dk, dv, p["scale"], raw, l2_eps)
    args = (q, k, v, gate0, gate1, a_neg, dt_bias, state, o, new_state, i32(n), i32(hk), i32(hv), i32(dk), i32(dv),
            f32(p["scale"]), a_st, a_sh, d_st, d_sh, i32(l2_eps is not None), f32(l2_eps or 0.0),
            steps if steps is not None else NULL)
    aligned = all(a.data.ptr % 16 == 0 for a in (state, new_state, v, o, *(() if steps is None else (steps,))))
    if n <= FEW_TOKENS and dk <= GDS_DK[-1] and dv % 4 == 0 and aligned:
        name = f"gated_delta_net{'_raw' if raw else ''}_step_d{next(d for d in GDS_DK if dk <= d)}"
        return [Launch(SOURCE, name, (cdiv(dv, GDS_COLS), hv), GDS_THREADS, args)]
    return [Launch(SOURCE, name, (cdiv(dv, GDN_TILE), hv), GDN_BLOCK, args)]


def lower_gated_delta_net(lw: Lowering, node: Any, ins: list, outs: list, p: dict) -> list:
    names = ("q", "k", "v", "g", "beta", "state")
    q, k, v, g, beta, state = (_f32(node, nm, a) for nm, a in zip(names, ins))
    return _gdn(lw, node, q, k, v, g, beta, None, None, state, outs, p, raw=False)


def lower_gated_delta_net_raw(lw: Lowering, node: Any, ins: list, outs: list, p: dict) -> list:
    names = ("q", "k", "v", "alpha", "b", "a_neg", "dt_bias", "state")
    q, k, v, alpha, b, a_neg, dt_bias, state = (_f32(node, nm, a) for nm, a in zip(names, ins))
    return _gdn(lw, node, q, k, v, alpha, b, a_neg, dt_bias, state, outs, p, raw=True)
