"""The q16-activations pass and its op mul_mat_q16x on the CPU side (kernel: tests/test_cpu_gemv_q16x.py).

The pass is q8-activations' rules with mul_mat_q16x: it rewrites decode matmuls (at most max_rows rows of x) of
q4_0 / q4_1 / q8_0 weights, says why it leaves the others (e.g. q5_0: no 16-bit GEMV), and splits a
stacked gate|up activation into the product and swiglu_split. The op's formula test is tests/test_ops.py's; here a
model decodes through the pass on the reference and cpu backends, near the f32 path. The real SmolLM2 graph's
sites: tests/test_cpu_gemv_q16x.py (slow).
"""

from __future__ import annotations

import numpy as np
import pytest

import graphir
from graphir import g
from graphir.ir import Graph
from graphir.passes import coverage, run_pipeline


def _ops(graph: Graph) -> list[str]:
    return sorted(n.op for n in graph.nodes() if not n.is_leaf)


def _matmul(wtype: str, rows: int, n_in: int = 64) -> Graph:
    return Graph({"y": g.mul_mat(g.param("w", (24, n_in), wtype), g.input("x", (rows, n_in)), name="proj")})


@pytest.mark.parametrize("wtype", ["q4_0", "q4_1", "q8_0"])
def test_rewrites_decode_matmuls_of_integer_code_weights(wtype):
    assert _ops(run_pipeline(_matmul(wtype, 1), "q16-activations")) == ["mul_mat_q16x"]


@pytest.mark.parametrize("wtype,rows,why", [
    ("q4_1", 7, "7 rows of x > max_rows=1: not a decode GEMV, kept in f32"),
    ("q5_0", 1, "weight dtype q5_0 has no 16-bit-activation GEMV (only q4_0, q4_1, q8_0): kept in f32"),
    ("f32", 1, "weight dtype f32 has no 16-bit-activation GEMV"),
])
def test_rejects_prefill_and_other_weights_with_the_reason(wtype, rows, why):
    graph = _matmul(wtype, rows, 256)
    report = coverage(graph, "q16-activations")
    assert _ops(run_pipeline(graph, "q16-activations")) == ["mul_mat"]
    (site, reason), = report["q16-activations"].rejected
    assert "proj" in site and why in reason


def test_max_rows_option_takes_verify_calls():
    assert _ops(run_pipeline(_matmul("q4_1", 7), "q16-activations{max_rows=8}")) == ["mul_mat_q16x"]


def test_stacked_gate_up_splits_into_the_q16x_product_and_its_activation():
    w = g.param("w", (2 * 40, 64), "q4_1")
    out = run_pipeline(Graph({"act": g.mul_mat_swiglu(w, g.input("x", (1, 64)), name="ffn_act")}), "q16-activations")
    assert _ops(out) == ["mul_mat_q16x", "swiglu_split", "view", "view"]


def _decode(backend: str, passes: str, n: int = 20) -> np.ndarray:
    model = graphir.load("random:qwen3-tiny", backend=backend, passes=passes, dtype="q4_0", ctx=64)
    model.reset()
    return np.concatenate([model.feed([t]) for t in np.random.default_rng(1).integers(0, 256, n)])


def test_model_decode_through_the_pass():
    """random:qwen3-tiny (q4_0) decoding 20 tokens one a call: the pass fires on every projection and the LM head;
    the cpu kernel meets the reference backend (the op's numpy formula) within 4e-4 of the largest logit, measured
    6.7e-5 (the f32 path's backends: 2.1e-6; q8-activations': 2.7e-7): where the backends' f32 ops differ by an ulp,
    an x value on a rounding boundary takes the neighbouring code, a 16-bit step far more often than an 8-bit one
    (the cpu with the op's reference instead of the kernel: 6.6e-5, the same). The logits stay near the
    f32-activation path: NMSE measured 6.3e-9 (8-bit x: 4.8e-4)."""
    model = graphir.load("random:qwen3-tiny", backend="reference", passes="", dtype="q4_0")
    report = coverage(model.graph("decode"), "default,q16-activations")["q16-activations"]
    assert len(report.matched) == 9 and not report.rejected  # 2 x (q|k|v, o, gate|up, down) + the LM head
    ref = _decode("reference", "default,q16-activations")
    cpu = _decode("cpu", "default,q16-activations")
    exact = _decode("reference", "default")
    assert np.abs(cpu - ref).max() <= 4e-4 * np.abs(ref).max()
    nmse = ((ref - exact) ** 2).sum() / (exact ** 2).sum()
    assert 1e-12 < nmse <= 1e-7, nmse  # the rounding happened, at 16 bits' size
