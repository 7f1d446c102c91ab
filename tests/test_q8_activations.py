"""The q8-activations pass and its op mul_mat_q8x on the CPU side (kernels: tests/test_gpu_gemv_q8x.py).

The pass rewrites decode matmuls (at most max_rows rows of x) of q4_0 / q4_1 / q8_0 weights and says why it leaves the
others; a stacked gate|up activation becomes the q8x product and swiglu_split of its halves. The op's formula
test is tests/test_ops.py's (gguf's own q8_0 codes of x); here its rounding helper is checked against C's
roundf cases, and a model decoding through the pass on the reference and cpu backends stays near the f32 path.
"""

from __future__ import annotations

import numpy as np
import pytest

import graphir
from graphir import g
from graphir.ir import Graph
from graphir.ops.fused import q8_blocks
from graphir.passes import coverage, run_pipeline


def _ops(graph: Graph) -> list[str]:
    return sorted(n.op for n in graph.nodes() if not n.is_leaf)


def _matmul(wtype: str, rows: int, n_in: int = 64) -> Graph:
    return Graph({"y": g.mul_mat(g.param("w", (24, n_in), wtype), g.input("x", (rows, n_in)), name="proj")})


@pytest.mark.parametrize("wtype", ["q4_0", "q4_1", "q8_0"])
def test_rewrites_decode_matmuls_of_block_quantized_weights(wtype):
    assert _ops(run_pipeline(_matmul(wtype, 1), "q8-activations")) == ["mul_mat_q8x"]


@pytest.mark.parametrize("wtype,rows,why", [
    ("q4_0", 7, "7 rows of x > max_rows=1: not a decode GEMV, kept in f32"),
    ("f32", 1, "weight dtype f32 has no integer-code GEMV (only q4_0, q4_1, q8_0): kept in f32"),
    ("q4_k", 1, "weight dtype q4_k has no integer-code GEMV"),
])
def test_rejects_prefill_and_other_weights_with_the_reason(wtype, rows, why):
    graph = _matmul(wtype, rows, 256)
    report = coverage(graph, "q8-activations")
    assert _ops(run_pipeline(graph, "q8-activations")) == ["mul_mat"]
    (site, reason), = report["q8-activations"].rejected
    assert "proj" in site and why in reason


def test_max_rows_option_takes_verify_calls():
    assert _ops(run_pipeline(_matmul("q8_0", 7), "q8-activations{max_rows=8}")) == ["mul_mat_q8x"]


def test_activations_of_weights_are_left_alone():
    a = g.input("a", (24, 64))
    out = run_pipeline(Graph({"y": g.mul_mat(a, g.input("x", (1, 64)))}), "q8-activations")
    assert _ops(out) == ["mul_mat"]


def test_stacked_gate_up_splits_into_the_q8x_product_and_its_activation(rng):
    from graphir.backends.registry import get_backend

    from graphir.quant import random_quantized
    from graphir.weights import Weight, Weights

    w = g.param("w", (2 * 40, 64), "q4_0")
    graph = Graph({"act": g.mul_mat_swiglu(w, g.input("x", (1, 64)), name="ffn_act")})
    out = run_pipeline(graph, "q8-activations")
    assert _ops(out) == ["mul_mat_q8x", "swiglu_split", "view", "view"]
    weights = Weights({"w": Weight("q4_0", (80, 64), random_quantized(rng, "q4_0", (80, 64)))})
    x = rng.standard_normal((1, 64)).astype(np.float32)
    ref = get_backend("reference")
    got = ref.lower(out, weights)({"x": x}, {})["act"]
    q8x = ref.lower(Graph({"y": g.mul_mat_q8x(w, g.input("x", (1, 64)))}), weights)({"x": x}, {})["y"]
    gate, up = q8x[:, :40].astype(np.float64), q8x[:, 40:].astype(np.float64)
    np.testing.assert_allclose(got, gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)


def test_q8_blocks_rounds_half_away_from_zero_exactly():
    """Codes are C's roundf of x / d (d = 1 here: the block's max is 127): ties away from zero, 0.49999997 down
    (floor(v + 0.5) in f32 rounds it up); a block of zeros has scale 0; one below 127 * 2^-126 gets codes 0."""
    x = np.zeros((3, 32), np.float32)
    x[0, :9] = [127, 2.5, -2.5, 0.5, -0.5, 0.49999997, -0.49999997, 126.49999, -1.5]
    x[2, :2] = [1e-37, -3e-38]
    q, d = q8_blocks(x)
    assert q[0, :9].tolist() == [127, 3, -3, 1, -1, 0, 0, 126, -2] and d.tolist() == [[1.0], [0.0],
                                                                                      [np.float32(1e-37) / 127]]
    assert not q[1:].any()
    x64 = np.random.default_rng(0).standard_normal((4, 128)) * 3
    q, d = q8_blocks(x64.astype(np.float32))
    assert np.abs(q).max() == 127 and np.abs(q.reshape(4, 4, 32) * d[..., None] - x64.reshape(4, 4, 32)).max() \
        <= d.max() / 2 * 1.001  # every value within half a step


def _decode(backend: str, passes: str, dtype: str, n: int = 20) -> np.ndarray:
    model = graphir.load("random:qwen3-tiny", backend=backend, passes=passes, dtype=dtype, ctx=64)
    model.reset()
    return np.concatenate([model.feed([t]) for t in np.random.default_rng(1).integers(0, 256, n)])


@pytest.mark.parametrize("dtype", ["q4_0", "q8_0"])
def test_model_decode_through_the_pass(dtype):
    """random:qwen3-tiny decoding 20 tokens one a call: the pass fires on every projection and the LM head; the
    cpu backend (the op's reference, run by its fallback) meets the reference backend (measured 2e-7 of the
    largest logit); the logits stay near the f32-activation path: NMSE measured 4.8e-4 (q4_0), 5.2e-4 (q8_0), the
    ~3e-5 a product of test_passes.py grown through two layers of random weights, about 4x bf16 activations'."""
    model = graphir.load("random:qwen3-tiny", backend="reference", passes="", dtype=dtype)
    report = coverage(model.graph("decode"), "default,q8-activations")["q8-activations"]
    assert len(report.matched) == 9 and not report.rejected  # 2 x (q|k|v, o, gate|up, down) + the LM head
    ref = _decode("reference", "default,q8-activations", dtype)
    cpu = _decode("cpu", "default,q8-activations", dtype)
    exact = _decode("reference", "default", dtype)
    assert np.abs(cpu - ref).max() <= 1e-4 * np.abs(ref).max()
    nmse = ((ref - exact) ** 2).sum() / (exact ** 2).sum()
    assert 1e-6 < nmse <= 2e-3, nmse  # the rounding happened, and cost little
