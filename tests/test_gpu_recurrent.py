"""GPU recurrent ops (backends/gpu/recurrent.cu): ssm_conv, ssm_conv_silu, gated_delta_net and
gated_delta_net_raw against the reference backend, with the state carried across two calls
through the graph's `assign` write-back; the rules called directly (specializations the
backend-path cases do not reach, broadcast gate shapes, errors); and the random Qwen3.5 preset's
logits on gpu against the reference backend."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _gpu_helpers import assert_rel_close, host
from graphir.backends.registry import get_backend

import graphir
from graphir import g
from graphir.errors import BackendError
from graphir.ir import Graph
from graphir.ops import OPS
from graphir.weights import Weight, Weights

try:
    from graphir.backends.gpu.device import available
except ImportError:  # pragma: no cover - the gpu package itself failed to import
    def available() -> bool:
        return False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(), reason="no CUDA/HIP device")]

GDN_REL = 1e-5  # issue 12's bound for f32, over each tensor (o, the state): _gpu_helpers.assert_rel_close
CONV_RTOL, CONV_ATOL = 1e-5, 1e-6  # at most k products per output: only FMA contraction differs


def normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def unit_rows(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Rows of unit L2 norm over the last axis, as the model's l2_norm feeds q and k (a delta rule
    with |k| >> 1 is unstable: I - beta k k^T has eigenvalues far below -1)."""
    x = rng.standard_normal(shape)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def f32_weights(**arrays: np.ndarray) -> Weights:
    return Weights({k: Weight("f32", a.shape, a.astype(np.float32)) for k, a in arrays.items()})


def both(graph: Graph, weights: Weights | None, inputs: dict, states: dict[str, dict]) -> dict[str, dict]:
    """One call of `graph` on gpu and on reference, each on its own state dict (updated in place)."""
    out = {}
    for name in ("gpu", "reference"):
        res = get_backend(name).lower(graph, weights)(inputs, states[name])
        out[name] = {k: host(v) for k, v in res.items()}
    return out


def check_states(states: dict[str, dict], rel: float | None) -> None:
    """Every State on gpu against reference: bit-exact (rel None) or within rel of its largest value."""
    for key, want in states["reference"].items():
        got = host(states["gpu"][key])
        if rel is None:
            np.testing.assert_array_equal(got, want, err_msg=f"state {key}")
        else:
            assert_rel_close(got, want, rel, f"state {key}")


# ---------------------------------------------------------------- ssm_conv through the backend
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("channels", [1, 7, 511, 1025])
def test_ssm_conv_carries_state(channels, kernel, n, silu, rng):
    w = normal(rng, (channels, kernel))
    init = normal(rng, (kernel - 1, channels))
    states = {b: {"conv": init.copy()} for b in ("gpu", "reference")}
    op = g.ssm_conv_silu if silu else g.ssm_conv
    for m in (n, 1 if n > 1 else 5):  # a prefill then a decode step (or the reverse) on the carried state
        s = g.state("conv", (kernel - 1, channels))
        res = op(g.input("x", (m, channels)), s, g.param("w", w.shape))
        graph = Graph({"y": g.item(res, index=0)}, [g.assign(s, g.item(res, index=1))])
        out = both(graph, f32_weights(w=w), {"x": normal(rng, (m, channels))}, states)
        assert out["gpu"]["y"].dtype == np.float32
        np.testing.assert_allclose(out["gpu"]["y"], out["reference"]["y"], rtol=CONV_RTOL, atol=CONV_ATOL)
        check_states(states, None)  # the new state is a copy of inputs: bit-exact


# ---------------------------------------------------------------- gated delta rule through the backend
def _gdn_graph(n: int, hk: int, hv: int, dk: int, dv: int, raw: bool) -> Graph:
    s = g.state("S", (hv, dk, dv))
    q, k, v = g.input("q", (n, hk, dk)), g.input("k", (n, hk, dk)), g.input("v", (n, hv, dv))
    if raw:
        res = g.gated_delta_net_raw(q, k, v, g.input("alpha", (n, hv)), g.input("b", (n, hv)),
                                    g.param("a_neg", (hv,)), g.param("dt", (hv,)), s, scale=1 / math.sqrt(dk))
    else:
        res = g.gated_delta_net(q, k, v, g.input("g", (n, hv)), g.input("beta", (n, hv)), s,
                                scale=1 / math.sqrt(dk))
    return Graph({"o": g.item(res, index=0)}, [g.assign(s, g.item(res, index=1))])


def _gdn_inputs(rng, n: int, hk: int, hv: int, dk: int, dv: int, raw: bool) -> dict[str, np.ndarray]:
    ins = {"q": unit_rows(rng, (n, hk, dk)), "k": unit_rows(rng, (n, hk, dk)), "v": normal(rng, (n, hv, dv))}
    if raw:
        ins |= {"alpha": normal(rng, (n, hv)), "b": normal(rng, (n, hv))}
    else:
        ins |= {"g": (-np.logaddexp(0, normal(rng, (n, hv)))).astype(np.float32),  # log of a decay in (0, 1)
                "beta": (1 / (1 + np.exp(-normal(rng, (n, hv))))).astype(np.float32)}
    return ins


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("n", [1, 5, 64])
@pytest.mark.parametrize("dk,dv", [(8, 6), (128, 128)])
@pytest.mark.parametrize("hk,ratio", [(1, 1), (2, 2), (2, 3)])
def test_gated_delta_net_carries_state(hk, ratio, dk, dv, n, raw, rng):
    hv = hk * ratio
    s0 = normal(rng, (hv, dk, dv), 0.3)
    states = {b: {"S": s0.copy()} for b in ("gpu", "reference")}
    weights = f32_weights(a_neg=-np.exp(normal(rng, (hv,), 0.5)), dt=normal(rng, (hv,))) if raw else None
    for m in (n, 1 if n > 1 else 3):
        out = both(_gdn_graph(m, hk, hv, dk, dv, raw), weights, _gdn_inputs(rng, m, hk, hv, dk, dv, raw), states)
        assert out["gpu"]["o"].dtype == np.float32
        assert_rel_close(out["gpu"]["o"], out["reference"]["o"], GDN_REL, "o")
        check_states(states, GDN_REL)


# ---------------------------------------------------------------- the rules called directly
def _lowering():
    from graphir.backends.gpu.launch import Lowering

    return Lowering(None)


def _run_rule(rule, ins: list[np.ndarray], out_shapes: list[tuple[int, ...]], p: dict) -> list[np.ndarray]:
    import cupy as cp

    d_ins = [cp.asarray(a) for a in ins]
    outs = [cp.full(s, np.nan, np.float32) for s in out_shapes]  # unwritten elements show up as NaN
    for step in rule(_lowering(), None, d_ins, outs, p):
        step()
    for a, d in zip(ins, d_ins):  # inputs, the state included, are read only
        np.testing.assert_array_equal(host(d), a)
    return [host(o) for o in outs]


@pytest.mark.parametrize("kernel", [3, 5, 8, 9, 16])
@pytest.mark.parametrize("silu", [False, True])
def test_ssm_conv_rule_wide_kernels(kernel, silu, rng):
    """The k8 and k16 specializations (the model and the backend cases use k <= 4), across token runs."""
    from graphir.backends.gpu import recurrent as R

    channels, n = 130, 19
    x, state, w = normal(rng, (n, channels)), normal(rng, (kernel - 1, channels)), normal(rng, (channels, kernel))
    rule = R.lower_ssm_conv_silu if silu else R.lower_ssm_conv
    y, new = _run_rule(rule, [x, state, w], [(n, channels), (kernel - 1, channels)], {})
    want_y, want_new = OPS["ssm_conv_silu" if silu else "ssm_conv"].ref(x, state, w)
    np.testing.assert_allclose(y, want_y, rtol=CONV_RTOL, atol=CONV_ATOL)
    np.testing.assert_array_equal(new, want_new)


def test_ssm_conv_rule_short_prefill_keeps_old_state_rows(rng):
    """n < kernel - 1: part of the new state still comes from the old state."""
    from graphir.backends.gpu import recurrent as R

    channels, kernel, n = 9, 8, 3
    x, state, w = normal(rng, (n, channels)), normal(rng, (kernel - 1, channels)), normal(rng, (channels, kernel))
    y, new = _run_rule(R.lower_ssm_conv, [x, state, w], [(n, channels), (kernel - 1, channels)], {})
    np.testing.assert_array_equal(new, np.concatenate([state, x])[n:])
    np.testing.assert_allclose(y, OPS["ssm_conv"].ref(x, state, w)[0], rtol=CONV_RTOL, atol=CONV_ATOL)


@pytest.mark.parametrize("dk", [16, 33, 64, 200, 256])
def test_gated_delta_net_rule_row_specializations(dk, rng):
    """Every register-tile size (dk up to 256), odd dk and dv (padding rows and dead columns)."""
    from graphir.backends.gpu import recurrent as R

    n, hk, hv, dv = 4, 2, 4, 37
    ins = _gdn_inputs(rng, n, hk, hv, dk, dv, raw=False)
    s0 = normal(rng, (hv, dk, dv), 0.3)
    args = [ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], s0]
    o, s1 = _run_rule(R.lower_gated_delta_net, args, [(n, hv, dv), (hv, dk, dv)], {"scale": 0.3})
    want_o, want_s = OPS["gated_delta_net"].ref(*args, scale=0.3)
    assert_rel_close(o, want_o, GDN_REL, "o")
    assert_rel_close(s1, want_s, GDN_REL, "state")


@pytest.mark.parametrize("shape_of", ["hv", "1,hv", "n,hv", "scalar", "n,1", "1"])
def test_gated_delta_net_raw_rule_broadcast_gates(shape_of, rng):
    """a_neg and dt_bias in every shape the op's infer accepts (broadcast onto [tokens, v_heads])."""
    from graphir.backends.gpu import recurrent as R

    n, hk, hv, dk, dv = 6, 1, 3, 8, 6
    shape = {"hv": (hv,), "1,hv": (1, hv), "n,hv": (n, hv), "scalar": (), "n,1": (n, 1), "1": (1,)}[shape_of]
    ins = _gdn_inputs(rng, n, hk, hv, dk, dv, raw=True)
    a_neg, dt = -np.exp(normal(rng, shape, 0.5)), normal(rng, shape)
    s0 = normal(rng, (hv, dk, dv), 0.3)
    args = [ins["q"], ins["k"], ins["v"], ins["alpha"], ins["b"], a_neg, dt, s0]
    o, s1 = _run_rule(R.lower_gated_delta_net_raw, args, [(n, hv, dv), (hv, dk, dv)], {"scale": 0.5})
    want_o, want_s = OPS["gated_delta_net_raw"].ref(*args, scale=0.5)
    assert_rel_close(o, want_o, GDN_REL, "o")
    assert_rel_close(s1, want_s, GDN_REL, "state")


def test_rules_reject_what_they_cannot_run(rng):
    from graphir.backends.gpu import recurrent as R

    c = 5
    with pytest.raises(BackendError, match="conv kernel width 17"):
        _run_rule(R.lower_ssm_conv, [normal(rng, (2, c)), normal(rng, (16, c)), normal(rng, (c, 17))],
                  [(2, c), (16, c)], {})
    n, hv, dk, dv = 1, 2, 257, 4
    gdn = [normal(rng, (n, 1, dk)), normal(rng, (n, 1, dk)), normal(rng, (n, hv, dv)), normal(rng, (n, hv)),
           normal(rng, (n, hv)), normal(rng, (hv, dk, dv))]
    with pytest.raises(BackendError, match="d_k 257"):
        _run_rule(R.lower_gated_delta_net, gdn, [(n, hv, dv), (hv, dk, dv)], {"scale": 1.0})
    dk = 8
    raw = [normal(rng, (n, 1, dk)), normal(rng, (n, 1, dk)), normal(rng, (n, hv, dv)), normal(rng, (n, hv)),
           normal(rng, (n, hv)), normal(rng, (2 * hv,)), normal(rng, (hv,)), normal(rng, (hv, dk, dv))]
    with pytest.raises(BackendError, match="a_neg"):
        _run_rule(R.lower_gated_delta_net_raw, raw, [(n, hv, dv), (hv, dk, dv)], {"scale": 1.0})


# ---------------------------------------------------------------- the whole random Qwen3.5 preset
@pytest.mark.parametrize("passes", ["", "default"])  # unfused ops, and the fused ssm_conv_silu / _raw
def test_qwen35_tiny_gpu_equals_reference(passes):
    gpu = graphir.load("random:qwen35-tiny", backend="gpu", passes=passes, ctx=64)
    ref = graphir.load("random:qwen35-tiny", backend="reference", passes="", ctx=64)
    ids = list(np.random.default_rng(0).integers(0, 256, 21))
    checks = [("prefill", gpu.logits(ids), ref.logits(ids))]
    for t in (7, 200, 65):  # decode steps continue the conv and recurrent states (and the KV cache)
        checks.append((f"decode at {gpu.n_past}", gpu.feed([t]), ref.feed([t])))
    for what, ours, want in checks:
        ours = host(ours)
        assert ours.shape == want.shape, what
        err, scale = float(np.abs(ours - want).max()), float(np.abs(want).max())
        assert err <= 1e-3 * scale, f"{what}: max |diff| {err:.3g} > 1e-3 * max |logit| {scale:.3g}"


def test_qwen35_decode_writes_recurrent_states_in_place():
    """The decode Program hands each conv and delta-rule kernel its State as the new-state output and
    skips the assigns (2 per DeltaNet layer); a 21-token prefill keeps the copies (its kernels are not
    in-place safe: several token runs read the conv state)."""
    from graphir.passes import run_pipeline

    model = graphir.load("random:qwen35-tiny", backend="gpu", passes="default", ctx=64)
    gpu = get_backend("gpu")
    decode = gpu.lower(run_pipeline(model.graph("decode"), "default"), model.weights)
    prefill = gpu.lower(run_pipeline(model.graph("prefill", 21), "default"), model.weights)
    n_delta = sum(1 for n in decode.graph.nodes() if n.op == "gated_delta_net_raw")
    assert n_delta == 3
    assert len(decode._skip_assign) == 2 * n_delta == len(decode._inplace)
    assert not prefill._skip_assign and not prefill._inplace


def test_qwen35_prefill_past_the_chunk_threshold_runs_the_chunked_kernels():
    """A whole-model prefill of CHUNKED_MIN_TOKENS tokens or more takes the chunked delta rule (two launches
    a DeltaNet layer), a shorter one the token loop, and both agree with the reference (issue 12: long prompts
    do not fall back to the recurrence)."""
    from graphir.backends.gpu.delta_chunked import CHUNKED_MIN_TOKENS

    for n, chunked in ((CHUNKED_MIN_TOKENS + 13, True), (CHUNKED_MIN_TOKENS - 1, False)):
        gpu = graphir.load("random:qwen35-tiny", backend="gpu", passes="default", ctx=128)
        ref = graphir.load("random:qwen35-tiny", backend="reference", passes="", ctx=128)
        ids = list(np.random.default_rng(n).integers(0, 256, n))
        ours, want = host(gpu.logits(ids)), ref.logits(ids)
        names = [s.name for e in gpu.programs._programs.values() for s in getattr(e[1], "_steps", [])
                 if hasattr(s, "name")]
        scans = [x for x in names if x.startswith("gdn_chunk_scan")]
        assert len(scans) == (3 if chunked else 0), (n, sorted(set(names)))
        err, scale = float(np.abs(ours - want).max()), float(np.abs(want).max())
        assert err <= 1e-3 * scale, f"{n} tokens: max |diff| {err:.3g} > 1e-3 * max |logit| {scale:.3g}"


def test_bench_reports_the_deltanet_share_and_floor_on_the_gpu():
    """`graphir bench` on the gpu: the Gated DeltaNet kernels' share of a decode step and their state-traffic
    fraction for a hybrid model (both in (0, 1]: tiny states are far from any floor), none for a model
    without recurrent State."""
    from graphir.bench import bench

    sizes = dict(prefill_tokens=16, prompt_tokens=8, decode_tokens=8, repeats=1, llama_cpp=False)
    r = bench("random:qwen35-tiny", backend="gpu", passes="default", **sizes)
    assert 0.0 < r["deltanet_share"] < 1.0 and 0.0 < r["deltanet_floor_fraction"] <= 1.0, r
    r = bench("random:qwen3-tiny", backend="gpu", passes="default", **sizes)
    assert r["deltanet_share"] == 0.0 == r["deltanet_floor_fraction"] and r["state_bytes"] == 0


def test_qwen35_tiny_greedy_gpu_equals_cpu():
    ids = list(range(30, 50))
    got = list(graphir.load("random:qwen35-tiny", backend="gpu", passes="default", ctx=128).generate(
        ids, 32, stop_at_eos=False))
    want = list(graphir.load("random:qwen35-tiny", backend="cpu", passes="default", ctx=128).generate(
        ids, 32, stop_at_eos=False))
    assert got == want


@pytest.mark.parametrize("hk,hv,dk,dv,n", [(16, 32, 128, 128, 1), (2, 4, 64, 64, 16), (1, 1, 100, 36, 3),
                                           (1, 3, 16, 12, 2)])
@pytest.mark.parametrize("l2_eps", [None, 1e-6])
def test_few_token_step_kernel_equals_token_loop_and_reference(hk, hv, dk, dv, n, l2_eps, monkeypatch, rng):
    """The `_step` kernels (decode and verify sizes, 256 threads per 16 columns, float4 state) against
    the op's reference and against the `_r{ROWS}` token loop they replace there."""
    from graphir.backends.gpu import recurrent as R

    qk = 2.0 if l2_eps else dk ** -0.5
    raw = [normal(rng, (n, hk, dk), qk), normal(rng, (n, hk, dk), qk), normal(rng, (n, hv, dv)),
           normal(rng, (n, hv)), normal(rng, (n, hv)), -np.exp(normal(rng, (hv,))), normal(rng, (hv,)),
           normal(rng, (hv, dk, dv), 0.3)]
    p = {"scale": dk ** -0.5, "l2_eps": l2_eps}
    shapes = [(n, hv, dv), (hv, dk, dv)]
    step_o, step_s = _run_rule(R.lower_gated_delta_net_raw, raw, shapes, p)
    monkeypatch.setattr(R, "GDS_DK", (0,))  # no _step kernel fits: the token loop runs
    loop_o, loop_s = _run_rule(R.lower_gated_delta_net_raw, raw, shapes, p)
    want_o, want_s = OPS["gated_delta_net_raw"].ref(*raw, **p)
    for got, want, what in ((step_o, want_o, "o"), (step_s, want_s, "state"), (loop_o, want_o, "loop o")):
        assert_rel_close(got, want, GDN_REL, what)
    assert_rel_close(step_o, loop_o, GDN_REL, "step o against loop o")
