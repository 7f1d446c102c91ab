"""gemm-bf16-out: prefill gate and up products rounded to bf16 (mul_mat_bf16_rounded), and the gpu's bf16 storage
of them (matmul.bf16_stored_products; swiglu_split_bf16in_v8_* read it). The op's formula: tests/test_ops.py."""

from __future__ import annotations

import numpy as np
import pytest
from _gpu_helpers import gpu_only, host
from graphir.backends.registry import get_backend

import graphir
from graphir.builder import g
from graphir.ir import Graph
from graphir.ops.fused import bf16_round
from graphir.passes import coverage, run_pipeline
from graphir.run_inputs import new_state

PIPELINE = "default,gemm-bf16,attn-bf16,gemm-bf16-out"


def _prefill(n: int, passes: str = PIPELINE, spec: str = "random:qwen3-tiny") -> Graph:
    model = graphir.load(spec, backend="reference")
    return run_pipeline(model.graph("prefill", n, last_only=True), passes)


def test_pass_rounds_gate_and_up_only():
    """On a prefill it rewrites each layer's gate and up products (read only by swiglu_split) and rejects the
    others with the reason; a decode graph (no bf16 products) is left alone."""
    graph = _prefill(37)
    rounded = [n for n in graph.nodes() if n.op == "mul_mat_bf16_rounded"]
    swiglus = [n for n in graph.nodes() if n.op == "swiglu_split"]
    assert len(rounded) == 4 and len(swiglus) == 2  # 2 layers
    assert {id(s) for n in swiglus for s in n.src} == {id(n) for n in rounded}
    assert all(n.src[0].params == n.src[1].params and n.src[0].src[1] is n.src[1].src[1] for n in swiglus)
    report = coverage(_prefill(37, "default,gemm-bf16,attn-bf16"), "gemm-bf16-out")["gemm-bf16-out"]
    assert len(report.matched) == 4 and report.rejected  # q, k, v, o, down: kept f32
    assert all("swiglu_split" in why for _, why in report.rejected)
    decode = graphir.load("random:qwen3-tiny", backend="reference").graph("decode")
    assert run_pipeline(decode, PIPELINE).signature() == run_pipeline(decode, "default,gemm-bf16,attn-bf16").signature()


def test_model_logits_cost_bf16_rounding_only():
    """random:qwen3-tiny over 100 tokens: the pass moves the logits by about one more bf16 rounding (NMSE well
    under test_passes.py's 3e-5 for its case), and it moves them (the roundings happened)."""
    ids = list(np.random.default_rng(0).integers(0, 256, 100))
    with_pass = graphir.load("random:qwen3-tiny", backend="reference", passes=PIPELINE, ctx=256).logits(ids)
    without = graphir.load("random:qwen3-tiny", backend="reference", passes="default,gemm-bf16,attn-bf16",
                           ctx=256).logits(ids)
    nmse = ((with_pass - without) ** 2).sum() / (without * without).sum()
    assert 0 < nmse <= 3e-5, nmse


def test_gpu_stores_gate_and_up_as_bf16_only_for_swiglu():
    """matmul.bf16_stored_products (no GPU needed): a prefill's rounded gate and up; not a rounded product that is
    a graph output, nor one whose swiglu_split partner is stored as f32."""
    from graphir.backends.gpu.matmul import bf16_stored_products
    graph = _prefill(37)
    stored = bf16_stored_products(graph)
    assert stored == {id(n) for n in graph.nodes() if n.op == "mul_mat_bf16_rounded"} and len(stored) == 4
    x = g.input("x", (20, 32))
    w = [g.param(f"w{i}", (24, 32)) for i in range(4)]
    a, b, shown, partner = (g.mul_mat_bf16_rounded(wi, x) for wi in w)
    graph = Graph({"y": g.swiglu_split(a, b), "z": g.swiglu_split(shown, partner), "shown": shown})
    stored = bf16_stored_products(graph)
    assert stored == {id(a), id(b)}


# ---------------------------------------------------------------- on the GPU
def _ffn_graph(m: int, n_in: int, d_ff: int, output_products: bool = False) -> Graph:
    x = g.input("x", (m, n_in))
    gate = g.mul_mat_bf16_rounded(g.param("gate", (d_ff, n_in)), x)
    up = g.mul_mat_bf16_rounded(g.param("up", (d_ff, n_in)), x)
    outs = {"act": g.swiglu_split(gate, up)}
    if output_products:
        outs |= {"gate": gate, "up": up}
    return Graph(outs)


def _weights(rng: np.random.Generator, n_in: int, d_ff: int):
    from graphir.weights import Weight, Weights
    weights = Weights()
    for name in ("gate", "up"):
        weights.add(name, Weight("f32", (d_ff, n_in), (rng.standard_normal((d_ff, n_in)) / np.sqrt(n_in))
                                 .astype(np.float32)))
    return weights


def _run(backend: str, graph: Graph, weights, x: np.ndarray):
    program = get_backend(backend).lower(graph, weights)
    return {k: host(v) for k, v in program({"x": x}, new_state(graph)).items()}, program


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("m,n_in,d_ff", [(17, 64, 43), (33, 1025, 96), (511, 576, 1536), (15, 7, 1)])
def test_gpu_swiglu_reads_the_bf16_products(m, n_in, d_ff):
    """gate and up stored as bf16, read by swiglu_split_bf16in_v8_f32 (element counts with a tail of 0, 3 and 7;
    d_ff 1), against the formula in float64: gate and up the bf16 roundings of the bf16 operands' products. cuBLAS
    sums in another order than float64, which moves a product's rounding by one bf16 step where it lies near a
    boundary (a few elements); each element may differ by what such a step of gate and of up changes."""
    rng = np.random.default_rng(m)
    weights, x = _weights(rng, n_in, d_ff), rng.standard_normal((m, n_in)).astype(np.float32)
    got, program = _run("gpu", _ffn_graph(m, n_in, d_ff), weights, x)
    names = [s.name for s in program._steps]
    assert "swiglu_split_bf16in_v8_f32" in names and "round_bf16_f32" not in names, names
    xb = bf16_round(x).astype(np.float64)
    wb = {k: bf16_round(weights[k].data).astype(np.float64) for k in ("gate", "up")}
    gate, up = (bf16_round((xb @ wb[k].T).astype(np.float32)).astype(np.float64) for k in ("gate", "up"))
    want = _silu(gate) * up
    # how far cuBLAS's gate and up may be from these: one bf16 step, plus the f32 sum's own error (random-walk
    # sized, sqrt(n_in) 2^-24 sum |terms|), which is more than a step for small products of much cancellation
    dg, du = (np.ldexp(1.0, np.frexp(np.abs(v))[1] - 8) + np.sqrt(n_in) * 2.0 ** -24 * (np.abs(xb) @ np.abs(wb[k]).T)
              for v, k in ((gate, "gate"), (up, "up")))
    moved = np.maximum(np.abs(_silu(gate + dg) - _silu(gate)), np.abs(_silu(gate - dg) - _silu(gate)))
    bound = moved * (np.abs(up) + du) + np.abs(_silu(gate)) * du + 1e-6 * np.abs(want) + 1e-7
    err = np.abs(got["act"] - want)
    assert np.all(err <= bound), float((err / bound).max())
    assert (err > 1e-6 * np.abs(want) + 1e-7).mean() <= 0.02


@pytest.mark.gpu
@gpu_only
def test_gpu_rounded_product_read_elsewhere_is_rounded_in_place():
    """Where a rounded product is also a graph output it stays f32 (round_bf16_f32 in place): its values are bf16
    values, and swiglu_split reads them through the f32 kernels."""
    graph = _ffn_graph(40, 96, 52, output_products=True)
    rng = np.random.default_rng(5)
    weights, x = _weights(rng, 96, 52), rng.standard_normal((40, 96)).astype(np.float32)
    got, program = _run("gpu", graph, weights, x)
    want, _ = _run("reference", graph, weights, x)
    names = [s.name for s in program._steps]
    assert names.count("round_bf16_f32") == 2 and "swiglu_split_bf16in_v8_f32" not in names, names
    for k in ("gate", "up"):
        np.testing.assert_array_equal(got[k], bf16_round(got[k]), err_msg=k)
        ulp = np.ldexp(1.0, np.frexp(np.maximum(np.abs(got[k]), np.abs(want[k])))[1] - 8)
        assert np.all(np.abs(got[k] - want[k]) <= ulp + 1e-6), k
        assert (got[k] != want[k]).mean() < 0.01, k
    gate, up = (got[k].astype(np.float64) for k in ("gate", "up"))
    np.testing.assert_allclose(got["act"], _silu(gate) * up, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("spec", ["random:qwen3-tiny", "random:llama-tiny"])
def test_gpu_model_with_the_pass_meets_the_reference(spec):
    """A whole prefill (37 tokens, then 513 in one call) with gate and up stored as bf16 and the activation writing
    the down GEMM's bf16 x: the gpu meets the reference running the same passes as closely as without the pass
    (f32 differences and rare rounding flips), and its logits moved (the rounding reached the gpu)."""
    ids = list(np.random.default_rng(2).integers(0, 256, 37))
    long = list(np.random.default_rng(3).integers(0, 256, 513))
    out, plan = {}, None
    for backend in ("gpu", "reference"):
        for passes in (PIPELINE, "default,gemm-bf16,attn-bf16"):
            model = graphir.load(spec, backend=backend, passes=passes, ctx=1024)
            # one chunk plan on both backends: chunks of <= 16 tokens keep f32 products, so two plans would
            # round differently and the comparison would measure the plans
            plan = plan or (model.prefill_buckets, model.call_cost)
            model.prefill_buckets, model.call_cost = plan
            out[backend, passes] = [host(model.logits(ids)), host(model.feed(long))]
            if backend == "gpu" and passes == PIPELINE:
                names = {s.name for _, prog, _ in model.programs._programs.values() for s in prog._steps}
                assert "swiglu_split_bf16in_v8_bf16" in names, names
                assert "swiglu_split_v4_bf16" not in names and "round_bf16_f32" not in names, names
    for i in range(2):
        got, want = out["gpu", PIPELINE][i], out["reference", PIPELINE][i]
        base = np.abs(out["gpu", "default,gemm-bf16,attn-bf16"][i] - out["reference", "default,gemm-bf16,attn-bf16"][i])
        scale = float(np.abs(want).max())
        assert np.abs(got - want).max() <= max(2 * float(base.max()), 2e-3 * scale), i
        assert np.abs(got - out["gpu", "default,gemm-bf16,attn-bf16"][i]).max() > 1e-5 * scale, i
