"""The rope kernels on the gpu (rope.cu) against the rotation written here in complex float64.

An attention layer's q rope, K cache write and V cache write, read in place from one stacked q|k|v
product (q and its gate interleaved per head for Qwen3.5), as the models lower them: one merged qkv_*
launch (lowering.merge_kv_writes), bitwise equal to its three kernels run one by one
(GRAPHIR_NO_KV_MERGE=1). The norm-rope kernels take a lane group of 32 per head row (a row a group,
8 groups a block), or at prefill sizes several rows a group (the _wide kernels, never merged: a block
then covers every head of its tokens), and a block's tokens' cos/sin table; the shapes below cover
head_dim 64, 128 and 256 (the register layout's limit: 1, 2 and 4 units a lane), 30, partial rotary
(n_dims < head_dim), neox and norm pairs, head counts that fill a block, leave rows idle, put 2-32
tokens in a block or need two blocks a token, and 1 to 1025 tokens at positions up to 8191. Each row's
arithmetic is the same in either geometry: the most rows a group (forced at 1-100 tokens, whatever the
launch's size) is bitwise a row a group. Wider heads take the unfused kernels; a KV row out of range is
an error.
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu_helpers import gpu_only
from graphir.backends.gpu import lowering
from graphir.backends.registry import get_backend

from graphir import g
from graphir.errors import BackendError
from graphir.ir import Graph
from graphir.weights import Weight, Weights

pytestmark = [pytest.mark.gpu, gpu_only]

EPS, THETA = 1e-6, 1e6


def _rotated(x: np.ndarray, pos: np.ndarray, n_dims: int, mode: str) -> np.ndarray:
    """Each pair (a, b) of the first n_dims of every head, as a + ib, times e^{i pos theta^(-2i/n_dims)}."""
    y = x.astype(np.float64).copy()
    half = n_dims // 2
    for i in range(half):
        rot = np.exp(1j * pos.astype(np.float64) * THETA ** (-2.0 * i / n_dims))[:, None]
        lo, hi = (2 * i, 2 * i + 1) if mode == "norm" else (i, i + half)
        z = (y[:, :, lo] + 1j * y[:, :, hi]) * rot
        y[:, :, lo], y[:, :, hi] = z.real, z.imag
    return y


def _normed(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS) * w


def _qkv_graph(m: int, hq: int, hkv: int, d: int, n_dims: int, mode: str, q_stride: int, cap: int, kv: str,
               norm: bool) -> Graph:
    """q out, K and V cache writes of one layer from y [m, row]: q heads hq (head stride q_stride * d),
    then hkv K heads, then hkv V heads."""
    qw = q_stride * d
    row = hq * qw + 2 * hkv * d
    y = g.input("y", (m, row))
    q = g.view(y, shape=(m, hq, d), strides=(row, qw, 1), offset=0)
    k = g.view(y, shape=(m, hkv, d), strides=(row, d, 1), offset=hq * qw)
    v = g.view(y, shape=(m, hkv, d), strides=(row, d, 1), offset=hq * qw + hkv * d)
    pos, rows = g.input("pos", (m,), "i32"), g.input("rows", (m,), "i32")
    rope = {"n_dims": n_dims, "mode": mode, "theta": THETA}
    kc, vc = g.state("k", (cap, hkv, d), kv), g.state("v", (cap, hkv, d), kv)
    if norm:
        q_out = g.rms_norm_mul_rope(q, g.param("qn", (d,)), pos, eps=EPS, **rope)
        k_write = g.rms_norm_mul_rope_set_rows(kc, k, g.param("kn", (d,)), pos, rows, eps=EPS, **rope)
    else:
        q_out, k_write = g.rope(q, pos, **rope), g.rope_set_rows(kc, k, pos, rows, **rope)
    return Graph({"q": q_out}, [k_write, g.set_rows(vc, v, rows)])


def _case(rng, m, hq, hkv, d, n_dims, mode, q_stride, kv, norm):
    """(graph, weights, inputs, state, q want, K cache want, V cache want)."""
    cap = m + 5
    graph = _qkv_graph(m, hq, hkv, d, n_dims, mode, q_stride, cap, kv, norm)
    qn, kn = (1 + 0.1 * rng.standard_normal((2, d))).astype(np.float32)
    weights = Weights({"qn": Weight("f32", (d,), qn), "kn": Weight("f32", (d,), kn)}) if norm else None
    yv = (rng.standard_normal((m, hq * q_stride * d + 2 * hkv * d)) * 2).astype(np.float32)
    pos = rng.integers(0, 8192, m).astype(np.int32)
    pos[0] = 8191
    rows = rng.permutation(cap)[:m].astype(np.int32)
    dt = np.float16 if kv == "f16" else np.float32
    state = {s: rng.standard_normal((cap, hkv, d)).astype(dt) for s in ("k", "v")}
    x_q = yv[:, :hq * q_stride * d].reshape(m, hq, q_stride, d)[:, :, 0]
    x_k = yv[:, hq * q_stride * d:][:, :hkv * d].reshape(m, hkv, d)
    x_v = yv[:, hq * q_stride * d + hkv * d:].reshape(m, hkv, d)
    q_want = _rotated(_normed(x_q, qn) if norm else x_q, pos, n_dims, mode)
    k_want, v_want = state["k"].astype(np.float64), state["v"].astype(np.float64)
    k_want[rows] = _rotated(_normed(x_k, kn) if norm else x_k, pos, n_dims, mode)
    v_want[rows] = x_v
    return graph, weights, {"y": yv, "pos": pos, "rows": rows}, state, q_want, k_want, v_want


def _run(graph, weights, inputs, state) -> tuple[dict, dict, list[str]]:
    prog = get_backend("gpu").lower(graph, weights)
    assert not prog.copies, "a strided view was gathered: the kernels' stride paths went untested"
    st = {k: v.copy() for k, v in state.items()}
    out = prog(inputs, st)
    return out, st, [s.name for s in prog._steps]


def _close(got, want, kv: str = "f32"):
    tol = 1e-3 if kv == "f16" else 1e-5  # f16: a unit roundoff of 2^-11
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


@pytest.fixture(params=["default", "packed"])
def geometry(request, monkeypatch):
    """The norm-rope launches' geometry: the default, or every lane group holding its most rows whatever
    the launch's size (the _wide kernels at any token count)."""
    if request.param == "packed":
        monkeypatch.setattr(lowering, "NORM_ROPE_FILL_BLOCKS", 0)
    return request.param


# (q heads, KV heads, head_dim, n_dims, mode, q head stride in heads): Qwen3-8B (at prefill sizes a block
# takes one token's 32 q heads, or 4 tokens' 8 KV heads); Qwen3.5 (q|gate interleaved, a quarter rotated, 4
# KV heads: 2 tokens a block, 4 at prefill sizes); SmolLM2's 64-wide heads (9 q heads: 7 idle lane groups in
# the second block, 3 KV heads: 2 tokens a block); norm pairs with one KV head (8 tokens a block, 16 at
# prefill sizes); partial rotary in norm mode; an awkward width; 40 q heads (two blocks a token at prefill
# sizes, the second with 8 heads)
SHAPES = [(32, 8, 128, 128, "neox", 1), (16, 4, 256, 64, "neox", 2), (9, 3, 64, 64, "neox", 1),
          (5, 1, 256, 256, "norm", 1), (4, 2, 128, 96, "norm", 1), (3, 2, 30, 30, "neox", 1),
          (40, 8, 128, 128, "neox", 1)]
TOKENS = [1, 7, 33, 511, 1025]


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("hq,hkv,d,n_dims,mode,q_stride", SHAPES)
@pytest.mark.parametrize("norm", [True, False], ids=["norm_rope", "rope"])
def test_qkv_writes_equal_formula(norm, hq, hkv, d, n_dims, mode, q_stride, m, rng, monkeypatch):
    graph, weights, inputs, state, q_want, k_want, v_want = _case(rng, m, hq, hkv, d, n_dims, mode, q_stride, "f32",
                                                                  norm)
    monkeypatch.setenv("GRAPHIR_NO_KV_MERGE", "0")
    out, st, names = _run(graph, weights, inputs, state)
    wide = norm and any(lowering._norm_rope_geometry(m, h, d, n_dims)[0] for h in (hq, hkv))
    if wide:  # prefill sizes: the _wide kernels, launched on their own
        assert not any(nm.startswith("qkv_") for nm in names), names
        assert {"rms_norm_mul_rope_wide_f32", "rms_norm_mul_rope_set_rows_wide_f32"} & set(names), names
    else:
        assert ("qkv_norm_rope_f32" if norm else "qkv_rope_f32") in names, names
        assert not any(nm.startswith("set_rows") for nm in names), names
    _close(out["q"], q_want)
    _close(st["k"], k_want)
    np.testing.assert_array_equal(st["v"], v_want)
    monkeypatch.setenv("GRAPHIR_NO_KV_MERGE", "1")
    three, st3, names3 = _run(graph, weights, inputs, state)
    # V's 16-byte kernel wherever its rows are whole float4s (every shape here but d 30), merged or not
    assert ("set_rows_v4_f32" if d % 4 == 0 else "set_rows_f32") in names3, names3
    assert not any(nm.startswith("qkv_") for nm in names3), names3
    np.testing.assert_array_equal(out["q"], three["q"])  # the merged launch runs the three bodies
    for k in st:
        np.testing.assert_array_equal(st[k], st3[k])


@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize("hq,hkv,d,n_dims,mode,q_stride", SHAPES[:3])
def test_norm_rope_into_an_f16_cache(hq, hkv, d, n_dims, mode, q_stride, m, geometry, rng, monkeypatch):
    monkeypatch.setenv("GRAPHIR_NO_KV_MERGE", "0")
    graph, weights, inputs, state, q_want, k_want, v_want = _case(rng, m, hq, hkv, d, n_dims, mode, q_stride, "f16",
                                                                  True)
    out, st, names = _run(graph, weights, inputs, state)
    if geometry == "packed":
        assert "rms_norm_mul_rope_set_rows_wide_f16" in names, names
    else:
        assert "qkv_norm_rope_f16" in names and not any(nm.startswith("set_rows") for nm in names), names
    _close(out["q"], q_want)
    _close(st["k"], k_want, "f16")
    _close(st["v"], v_want, "f16")


@pytest.mark.parametrize("d,n_dims", [(512, 512), (384, 128)])
def test_norm_rope_wider_than_the_registers_takes_the_unfused_kernels(d, n_dims, rng):
    graph, weights, inputs, state, q_want, k_want, v_want = _case(rng, 7, 4, 2, d, n_dims, "neox", 1, "f32", True)
    prog = get_backend("gpu").lower(graph, weights)
    st = {k: v.copy() for k, v in state.items()}
    out = prog(inputs, st)
    assert not any(s.name.startswith(("qkv_", "rms_norm_mul_rope")) for s in prog._steps)
    _close(out["q"], q_want)
    _close(st["k"], k_want)
    np.testing.assert_array_equal(st["v"], v_want)


@pytest.mark.parametrize("bad", [-1, 12])
@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("norm", [True, False], ids=["norm_rope", "rope"])
def test_kv_row_out_of_range_is_an_error(norm, merge, bad, geometry, rng, monkeypatch):
    monkeypatch.setenv("GRAPHIR_NO_KV_MERGE", "0" if merge else "1")
    graph, weights, inputs, state, *_ = _case(rng, 7, 32, 8, 128, 128, "neox", 1, "f32", norm)  # cap 12
    inputs["rows"][3] = bad
    with pytest.raises(BackendError, match=rf"row index out of range 0\.\.11 \(got {bad}"):
        _run(graph, weights, inputs, state)


@pytest.mark.parametrize("m", [1, 7, 33, 100])
@pytest.mark.parametrize("hq,hkv,d,n_dims,mode,q_stride", SHAPES)
def test_norm_rope_rows_per_group_bitwise(hq, hkv, d, n_dims, mode, q_stride, m, rng, monkeypatch):
    """Several rows a lane group (the _wide kernels: a block over all heads of 1-32 tokens) give the bits of
    a row a group: each row's arithmetic is the same, whichever group and block hold it."""
    graph, weights, inputs, state, q_want, k_want, v_want = _case(rng, m, hq, hkv, d, n_dims, mode, q_stride, "f32",
                                                                  True)
    monkeypatch.setenv("GRAPHIR_NO_KV_MERGE", "1")
    monkeypatch.setattr(lowering, "NORM_ROPE_FILL_BLOCKS", 1 << 30)  # a row a group
    one, st1, names1 = _run(graph, weights, inputs, state)
    monkeypatch.setattr(lowering, "NORM_ROPE_FILL_BLOCKS", 0)  # the most rows a group
    out, st, names = _run(graph, weights, inputs, state)
    assert not any("_wide" in nm for nm in names1), names1
    assert {"rms_norm_mul_rope_wide_f32", "rms_norm_mul_rope_set_rows_wide_f32"} <= set(names), names
    _close(out["q"], q_want)
    _close(st["k"], k_want)
    np.testing.assert_array_equal(out["q"], one["q"])
    np.testing.assert_array_equal(st["k"], st1["k"])
    np.testing.assert_array_equal(st["v"], v_want)
