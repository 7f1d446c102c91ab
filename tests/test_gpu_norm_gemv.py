"""fuse-norm-gemv on model graphs, and the gpu's fused GEMVs (gemv1nm_ / gemv1swnm_ / gemv1rs_) against float64
formulas in every m == 1 geometry and in whole decode steps. The ops' formulas on every backend: tests/test_ops.py."""

from __future__ import annotations

import numpy as np
import pytest
from _gpu_helpers import assert_rel_close, gpu_only, host

import graphir
from graphir.builder import g
from graphir.ir import Graph
from graphir.passes import coverage, run_pipeline

PIPELINE = "default,fuse-norm-gemv"
MODELS = {"random:qwen3-tiny": 2, "random:llama-tiny": 2, "random:qwen35-tiny": 4}  # spec -> layers


def _graph(spec: str, phase: str, passes: str) -> Graph:
    return run_pipeline(graphir.load(spec, backend="reference").graph(phase), passes)


@pytest.mark.parametrize("spec", sorted(MODELS))
def test_every_decode_norm_moves_into_gemvs(spec):
    """Each layer's two norms and the output norm are read inside GEMVs, each residual add is a GEMV's epilogue;
    no norm kernel is left in the decode step, and prefill is left alone."""
    layers = MODELS[spec]
    ops = [n.op for n in _graph(spec, "decode", PIPELINE).nodes()]
    assert "add_rms_norm_mul" not in ops and "rms_norm" not in ops and "add" not in ops, sorted(set(ops))
    assert ops.count("rms_norm_mul_mat") + ops.count("rms_norm_mul_mat_swiglu") == 2 * layers + 1
    assert ops.count("mul_mat_add") == 2 * layers
    report = coverage(graphir.load(spec, backend="reference").graph("decode"), PIPELINE)["fuse-norm-gemv"]
    assert not report.rejected, report
    assert _graph(spec, "prefill", PIPELINE).signature() == _graph(spec, "prefill", "default").signature()


def test_quantized_weights_keep_the_fused_add_and_norm():
    """SmolLM2's Q4_1 GEMVs have no fused variant: every add + norm stays, each rejection says why."""
    report = coverage(graphir.load("random:llama-tiny", backend="reference", dtype="q8_0").graph("decode"),
                      PIPELINE)["fuse-norm-gemv"]
    assert not report.matched and report.rejected
    assert all("q8_0" in why or "decode GEMV" in why for _, why in report.rejected), report.rejected


# ---------------------------------------------------------------- gpu
CONFIGS = ("g32r2", "g32r4", "g64r2", "g128r1")  # matmul.GEMV1_CONFIGS


def _weight(rng, dtype: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    w32 = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    if dtype == "f32":
        return w32, w32.astype(np.float64)
    bits = (w32.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("kind", ["rms_norm_mul_mat", "rms_norm_mul_mat_swiglu", "mul_mat_add"])
def test_gpu_fused_gemv_every_geometry(kind, cfg, dtype, monkeypatch):
    """515 outputs of 1032 columns (a partial last block in every geometry) in each m == 1 geometry: the fused
    kernel runs (its name in the Program) and meets the float64 formula."""
    from graphir.backends.gpu import matmul
    from graphir.backends.registry import get_backend
    from test_ops import weights_of

    monkeypatch.setitem(matmul.GEMV1_KERNEL, dtype, cfg)
    rng = np.random.default_rng(hash((kind, cfg, dtype)) % 2**32)
    n_out, n_in, eps = 515, 1032, 1e-3
    rows = 2 * n_out if kind == "rms_norm_mul_mat_swiglu" else n_out
    raw, wf = _weight(rng, dtype, (rows, n_in))
    x = (rng.standard_normal((1, n_in)) * 0.05 + 0.02).astype(np.float32)
    nw = (1.0 + rng.standard_normal(n_in) * 0.5).astype(np.float32)
    r = (rng.standard_normal((1, n_out)) * 3).astype(np.float32)
    w = g.param("w", (rows, n_in), dtype)
    if kind == "mul_mat_add":
        node, feeds = g.mul_mat_add(w, g.input("x", x.shape), g.input("r", r.shape)), {"x": x, "r": r}
        want = r + x.astype(np.float64) @ wf.T
    else:
        node, feeds = getattr(g, kind)(w, g.input("x", x.shape), g.param("nw", (n_in,)), eps=eps), {"x": x}
        x64 = x.astype(np.float64)
        y = (x64 / np.sqrt((x64 * x64).mean() + eps) * nw) @ wf.T
        want = y if kind == "rms_norm_mul_mat" else y[:, :n_out] / (1 + np.exp(-y[:, :n_out])) * y[:, n_out:]
    weights = weights_of(w=(dtype, raw, (rows, n_in)), nw=("f32", nw, (n_in,)))
    program = get_backend("gpu").lower(Graph({"y": node}), weights)
    prefix = {"rms_norm_mul_mat": "gemv1nm_", "rms_norm_mul_mat_swiglu": "gemv1swnm_", "mul_mat_add": "gemv1rs_"}[kind]
    assert [s.name for s in program._steps] == [f"{prefix}{dtype}_{cfg}"]
    got = host(program(feeds, {})["y"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("spec", sorted(MODELS))
def test_gpu_decode_with_the_pass_meets_the_reference(spec):
    """A 37-token prompt, then 24 decode steps one token at a time (one captured graph replayed at 24 positions):
    the gpu's logits with the pass meet the reference's without it at every step, and the decode step runs the
    fused GEMVs, two kernels a layer fewer than without the pass."""
    rng = np.random.default_rng(5)
    ids = [int(t) for t in rng.integers(0, 256, 37 + 24)]
    logits, steps = {}, {}
    for backend, passes in (("gpu", PIPELINE), ("gpu", "default"), ("reference", "default")):
        model = graphir.load(spec, backend=backend, passes=passes, ctx=256)
        out = [host(model.feed(ids[:37], last_only=True))]
        out += [host(model.feed([t], last_only=True)) for t in ids[37:]]
        logits[backend, passes] = np.stack(out)
        if backend == "gpu":
            steps[passes] = [s.name for s in model._program(1, True)._steps]
    fused = steps[PIPELINE]
    assert any(n.startswith("gemv1nm_") for n in fused) and any(n.startswith("gemv1rs_") for n in fused), fused
    assert not any(n.startswith("add_rms_norm_mul") for n in fused), fused
    assert len(steps["default"]) - len(fused) == 2 * MODELS[spec], (steps["default"], fused)
    want = logits["reference", "default"]
    assert_rel_close(logits["gpu", PIPELINE], want, 1e-4, f"{spec} with {PIPELINE}")
    assert_rel_close(logits["gpu", "default"], want, 1e-4, f"{spec} with default")
