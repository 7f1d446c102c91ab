"""The attn-bf16 pass and its op flash_attn_bf16 on the CPU side (the GPU kernel: test_gpu_attention_prefill.py).

The pass rewrites attention of more than max_decode_queries queries and nothing else; the op's reference
is flash_attn on bf16-rounded q, k, v up to the rounding of its softmax weights (formula test:
tests/test_ops.py); the reference and cpu backends run it, alone and inside a model.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from graphir.backends.registry import get_backend

import graphir
from graphir import g
from graphir.ir import Graph
from graphir.ops import OPS
from graphir.ops.fused import bf16_round
from graphir.passes import coverage, run_pipeline


def _attention(n_q: int, hq: int = 4, hk: int = 2, d: int = 16, dv: int = 8, cap: int = 40, kvdtype: str = "f32",
               window: int = 0) -> Graph:
    node = g.flash_attn(g.input("q", (n_q, hq, d)), g.state("k", (cap, hk, d), kvdtype),
                        g.state("v", (cap, hk, dv), kvdtype), g.input("pos", (n_q,), "i32"),
                        g.input("len", (1,), "i32"), scale=1 / math.sqrt(d), window=window, name="attn")
    return Graph({"out": node})


def _ops(graph: Graph) -> list[str]:
    return [n.op for n in graph.nodes() if n.op.startswith("flash_attn")]


# ---------------------------------------------------------------- the pass
@pytest.mark.parametrize("n_q,want", [(1, "flash_attn"), (16, "flash_attn"), (17, "flash_attn_bf16"),
                                      (31, "flash_attn_bf16"), (512, "flash_attn_bf16")])
def test_pass_rewrites_only_more_than_sixteen_queries(n_q, want):
    graph = _attention(n_q, window=3)
    out = run_pipeline(graph, "attn-bf16")
    assert _ops(out) == [want]
    node = out.outputs["out"]
    assert node.name == "attn" and node.params == graph.outputs["out"].params  # scale, window kept
    assert [s.name for s in node.src] == [s.name for s in graph.outputs["out"].src]


def test_pass_option_and_rejection_reason():
    assert _ops(run_pipeline(_attention(7), "attn-bf16{max_decode_queries=8}")) == ["flash_attn"]
    assert _ops(run_pipeline(_attention(7), "attn-bf16{max_decode_queries=4}")) == ["flash_attn_bf16"]
    report = coverage(_attention(3), "attn-bf16")
    (site, why), = report["attn-bf16"].rejected
    assert site == "flash_attn 'attn'" and "3 queries <= max_decode_queries=16" in why


@pytest.mark.parametrize("spec", ["random:llama-tiny", "random:qwen3-tiny"])
def test_pass_on_model_graphs(spec):
    """After the default pipeline: every layer's prefill attention becomes flash_attn_bf16, decode stays f32."""
    model = graphir.load(spec, backend="reference", passes="")
    prefill = run_pipeline(model.graph("prefill", 17), "default,attn-bf16")
    decode = run_pipeline(model.graph("decode"), "default,attn-bf16")
    n_layers = model.config.n_layers
    assert _ops(prefill) == ["flash_attn_bf16"] * n_layers
    assert _ops(decode) == ["flash_attn"] * n_layers


# ---------------------------------------------------------------- the op
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
@pytest.mark.parametrize("window", [0, 4])
def test_reference_is_flash_attn_on_bf16_inputs_up_to_the_weights_rounding(kvdtype, window):
    """Rounding each weight to bf16 (relative error <= 2^-9) moves a weighted mean of v by at most
    2^-9 / (1 - 2^-9) * max |v_j - out| <= 2^-8 * max |v| (v as rounded)."""
    rng = np.random.default_rng(window)
    n_q, hq, hk, d, dv, cap, kv_len = 33, 8, 2, 32, 24, 64, 50
    npdt = np.float32 if kvdtype == "f32" else np.float16
    q = (rng.standard_normal((n_q, hq, d)) * 2).astype(np.float32)
    k, v = rng.standard_normal((cap, hk, d)).astype(npdt), rng.standard_normal((cap, hk, dv)).astype(npdt)
    pos = np.arange(kv_len - n_q, kv_len, dtype=np.int32)
    pos[3] = -1  # sees nothing: 0 in both
    length = np.array([kv_len], np.int32)
    scale = 1 / math.sqrt(d)
    got = OPS["flash_attn_bf16"].ref(q, k, v, pos, length, scale=scale, window=window)
    rounded = [bf16_round(a.astype(np.float32)) for a in (q, k, v)]
    want = OPS["flash_attn"].ref(*rounded, pos, length, scale=scale, window=window)
    diff = np.abs(got - want).max()
    assert 0 < diff <= 2 ** -8 * np.abs(rounded[2][:kv_len]).max()
    np.testing.assert_array_equal(got[3], 0.0)
    assert np.abs(got - OPS["flash_attn"].ref(q, k, v, pos, length, scale=scale, window=window)).max() > diff


@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
def test_reference_and_cpu_backends_run_it(kvdtype):
    """As a State-reading node of a Graph, f16 caches included (the cpu backend runs the op's reference)."""
    graph = run_pipeline(_attention(21, cap=40, kvdtype=kvdtype, window=6), "attn-bf16")
    assert _ops(graph) == ["flash_attn_bf16"]
    rng = np.random.default_rng(1)
    npdt = np.float32 if kvdtype == "f32" else np.float16
    inputs = {"q": rng.standard_normal((21, 4, 16)).astype(np.float32), "pos": np.arange(9, 30, dtype=np.int32),
              "len": np.array([30], np.int32)}
    state = {"k": rng.standard_normal((40, 2, 16)).astype(npdt), "v": rng.standard_normal((40, 2, 8)).astype(npdt)}
    want = OPS["flash_attn_bf16"].ref(inputs["q"], state["k"], state["v"], inputs["pos"], inputs["len"],
                                      scale=0.25, window=6)
    for backend in ("reference", "cpu"):
        out = get_backend(backend).lower(graph, None)(inputs, {k: a.copy() for k, a in state.items()})["out"]
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6, err_msg=backend)


def test_model_logits_with_the_pass_on_cpu():
    """random:qwen3-tiny over 100 tokens (prompt chunks of more than 4): the cpu backend with the pass meets the
    reference with it (f32 rounding only), and the pass costs about bf16's rounding (measured: NMSE 2e-5,
    max 8.5e-3 of max |logit|; test_passes.py bounds NMSE by 1e-4)."""
    ids = list(np.random.default_rng(0).integers(0, 256, 100))
    cpu = graphir.load("random:qwen3-tiny", backend="cpu", passes="default,attn-bf16", ctx=256).logits(ids)
    ref = graphir.load("random:qwen3-tiny", backend="reference", passes="default,attn-bf16", ctx=256).logits(ids)
    exact = graphir.load("random:qwen3-tiny", backend="reference", passes="default", ctx=256).logits(ids)
    scale = float(np.abs(ref).max())
    assert np.abs(cpu - ref).max() <= 1e-3 * scale
    assert ((ref - exact) ** 2).sum() / (exact * exact).sum() <= 1e-4
    assert np.abs(ref - exact).max() > 1e-3 * scale  # the roundings happened
