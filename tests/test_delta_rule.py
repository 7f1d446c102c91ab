"""The CPU recurrent kernels (backends/cpu/recurrent.py) against the op table's references, and the
chunked delta rule against the token-by-token recurrence at lengths around the chunk boundaries."""

from __future__ import annotations

import numpy as np
import pytest
from graphir.backends import cpu, reference
from graphir.backends.cpu import recurrent as R

from graphir import g
from graphir.ir import Graph
from graphir.ops import OPS
from graphir.weights import Weight, Weights

SCALE = 0.25


def _inputs(rng: np.random.Generator, n: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 12):
    def unit(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)  # the model l2-normalizes q and k

    q, k = unit((n, hk, dk)), unit((n, hk, dk))
    v = rng.standard_normal((n, hv, dv)).astype(np.float32)
    a_neg = -np.exp(rng.uniform(-4.0, 1.0, hv))  # per-head decay rates, some strong
    gate = (a_neg * np.logaddexp(0.0, rng.standard_normal((n, hv)))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((n, hv))))).astype(np.float32)
    s0 = (0.3 * rng.standard_normal((hv, dk, dv))).astype(np.float32)
    return q, k, v, gate, beta, s0


def _run(kernel, q, k, v, gate, beta, s0, *extra):
    o = np.full((q.shape[0],) + v.shape[1:], np.nan, np.float32)
    s = np.full_like(s0, np.nan)
    kernel(q, k, v, gate, beta, s0, np.float32(SCALE), *extra, o, s)
    return o, s


@pytest.mark.parametrize("n", [1, 7, 63, 64, 65, 130])
def test_chunked_equals_recurrence(n, rng):
    q, k, v, gate, beta, s0 = _inputs(rng, n)
    want_o, want_s = OPS["gated_delta_net"].ref(q, k, v, gate, beta, s0, scale=SCALE)
    rec_o, rec_s = _run(R.gdn_recurrent, q, k, v, gate, beta, s0)
    chk_o, chk_s = _run(R.gdn_chunked, q, k, v, gate, beta, s0, 64)
    for o, s in ((rec_o, rec_s), (chk_o, chk_s)):
        np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=2e-6)
        np.testing.assert_allclose(s, want_s, rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(chk_o, rec_o, rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunk_size_does_not_change_the_result(chunk, rng):
    q, k, v, gate, beta, s0 = _inputs(rng, 33, hk=1, hv=3, dk=8, dv=8)
    rec_o, rec_s = _run(R.gdn_recurrent, q, k, v, gate, beta, s0)
    chk_o, chk_s = _run(R.gdn_chunked, q, k, v, gate, beta, s0, chunk)
    np.testing.assert_allclose(chk_o, rec_o, rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(chk_s, rec_s, rtol=1e-4, atol=2e-6)


def test_chunked_continues_from_a_carried_state(rng):
    """Two prefill calls (the second starting from the first's state) equal one call."""
    q, k, v, gate, beta, s0 = _inputs(rng, 100)
    whole_o, whole_s = _run(R.gdn_chunked, q, k, v, gate, beta, s0, 64)
    o1, s1 = _run(R.gdn_chunked, q[:37], k[:37], v[:37], gate[:37], beta[:37], s0, 64)
    o2, s2 = _run(R.gdn_chunked, q[37:], k[37:], v[37:], gate[37:], beta[37:], s1, 64)
    np.testing.assert_allclose(np.concatenate([o1, o2]), whole_o, rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(s2, whole_s, rtol=1e-4, atol=2e-6)


def test_strong_decay_underflows_to_zero_not_nan(rng):
    q, k, v, gate, beta, s0 = _inputs(rng, 70)
    gate[:] = -80.0  # e^(G) underflows inside a chunk
    o, s = _run(R.gdn_chunked, q, k, v, gate, beta, s0, 64)
    want_o, want_s = OPS["gated_delta_net"].ref(q, k, v, gate, beta, s0, scale=SCALE)
    assert np.isfinite(o).all() and np.isfinite(s).all()
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("n,silu", [(1, False), (7, True), (2, True)])
def test_ssm_conv_kernel(n, silu, rng):
    channels, kernel = 10, 4
    x = rng.standard_normal((n, channels)).astype(np.float32)
    state = rng.standard_normal((kernel - 1, channels)).astype(np.float32)
    w = rng.standard_normal((channels, kernel)).astype(np.float32)
    y, new = np.empty_like(x), np.empty_like(state)
    R.ssm_conv(x, state, w, silu, y, new)
    ref = OPS["ssm_conv_silu" if silu else "ssm_conv"].ref(x, state, w)
    np.testing.assert_allclose(y, ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new, ref[1])


def test_gates_kernel(rng):
    alpha, b = (rng.standard_normal((5, 4)) * 20).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    a_neg, dt = -np.exp(rng.standard_normal(4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    gate, beta = np.empty_like(alpha), np.empty_like(alpha)
    R.gdn_gates(alpha, b, a_neg, dt, gate, beta)
    np.testing.assert_allclose(gate, a_neg * np.logaddexp(0.0, alpha.astype(np.float64) + dt), rtol=1e-6)
    np.testing.assert_allclose(beta, 1 / (1 + np.exp(-b.astype(np.float64))), rtol=1e-6)


@pytest.mark.parametrize("n", [1, 20])
def test_fused_ops_cpu_equal_reference(n, rng):
    """ssm_conv_silu -> l2_norm -> gated_delta_net_raw, with state write-backs, on both backends."""
    hk, hv, dk, dv, kernel = 2, 4, 8, 6, 4
    cdim = 2 * hk * dk + hv * dv
    conv_s, rec_s = g.state("conv", (kernel - 1, cdim)), g.state("S", (hv, dk, dv))
    conv = g.ssm_conv_silu(g.input("x", (n, cdim)), conv_s, g.param("w", (cdim, kernel)))
    y = g.item(conv, index=0)
    q = g.l2_norm(g.view(y, shape=(n, hk, dk), strides=(cdim, dk, 1), offset=0), eps=1e-6)
    k = g.l2_norm(g.view(y, shape=(n, hk, dk), strides=(cdim, dk, 1), offset=hk * dk), eps=1e-6)
    v = g.view(y, shape=(n, hv, dv), strides=(cdim, dv, 1), offset=2 * hk * dk)
    res = g.gated_delta_net_raw(q, k, v, g.input("a", (n, hv)), g.input("b", (n, hv)), g.param("a_neg", (hv,)),
                                g.param("dt", (hv,)), rec_s, scale=dk ** -0.5)
    graph = Graph({"o": g.item(res, index=0)},
                  [g.assign(conv_s, g.item(conv, index=1)), g.assign(rec_s, g.item(res, index=1))])
    f32 = lambda a: Weight("f32", a.shape, a.astype(np.float32))  # noqa: E731
    weights = Weights({"w": f32(rng.standard_normal((cdim, kernel))), "a_neg": f32(-np.exp(rng.standard_normal(hv))),
                       "dt": f32(rng.standard_normal(hv))})
    init = {"conv": rng.standard_normal((kernel - 1, cdim)).astype(np.float32),
            "S": (0.3 * rng.standard_normal((hv, dk, dv))).astype(np.float32)}
    inputs = {"x": rng.standard_normal((n, cdim)).astype(np.float32),
              "a": rng.standard_normal((n, hv)).astype(np.float32),
              "b": rng.standard_normal((n, hv)).astype(np.float32)}
    outs = []
    for backend in (reference, cpu):
        program, state = backend.lower(graph, weights), {k: a.copy() for k, a in init.items()}
        outs.append((program(inputs, state)["o"], state))
    (ro, rs), (co, cs) = outs
    np.testing.assert_allclose(co, ro, rtol=1e-4, atol=1e-5)
    for name in init:
        np.testing.assert_allclose(cs[name], rs[name], rtol=1e-4, atol=1e-5)
