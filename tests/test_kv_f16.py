"""The kv-f16 pass (graphir/passes/kv_f16.py) and the cpu backend's f16 KV caches.

- Which States change: KV caches (row-written, read by attention) become f16 in every phase's graph, in
  either pass order; Qwen3.5's conv/ssm state and its per-token steps stay f32.
- What it computes: exactly the f32 graph with each K and V row rounded to f16 before its write (same
  inputs, same State rounded; reference backend); the cpu backend meets the reference; attention's change
  against f32 rows stays inside a bound derived from the rounding (below); generation agrees.
- The cpu runs it on its kernels (no numpy fallback for the cache writes or prefill attention).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _gpu_helpers import gpu_only
from graphir.backends.cpu import kv_f16 as KF
from graphir.backends.cpu import lowering_rules as LR
from graphir.backends.registry import get_backend

import graphir
from graphir import g
from graphir.builder import make
from graphir.check import F16_TOL, check, make_cases
from graphir.ir import Graph
from graphir.passes import coverage, run_pipeline
from graphir.passes.kv_f16 import _written_state, kv_cache_states
from graphir.passes.rewrite import rewrite

TINY = ("llama-tiny", "qwen3-tiny", "qwen35-tiny")
U = 2.0 ** -11  # f16's unit roundoff: |round(x) - x| <= U |x| in the normal range
TINY_ABS = 2.0 ** -25  # below it (subnormal halves) the error is at most half the spacing, 2^-25


def test_cpu_row_write_rounds_as_numpy_does():
    """set_rows_f16 against numpy's f32 -> f16 cast, as bits: every exponent with random mantissas, the
    halfway cases (ties to even) and their neighbours, both signs, inf, nan, random bit patterns."""
    rng = np.random.default_rng(0)
    top = (np.arange(256, dtype=np.uint32) << 23)[:, None]
    mant = rng.integers(0, 2 ** 23, (256, 500), dtype=np.uint32)
    tie = (mant & np.uint32(0x7FE000)) | np.uint32(0x1000)
    cases = np.concatenate([top | mant, top | tie, top | (tie - 1), top | (tie + 1)]).ravel()
    bits = np.concatenate([cases, cases | np.uint32(0x80000000),
                           rng.integers(0, 2 ** 32, 100_000, dtype=np.uint64).astype(np.uint32)])
    x = bits.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    dst = np.zeros((3, x.size), np.uint16)
    KF.set_rows_f16(dst, x[None], np.array([1], np.int32))
    assert np.array_equal(dst[1], want)
    assert not dst[0].any() and not dst[2].any()
    with pytest.raises(IndexError):
        KF.set_rows_f16(dst, x[None], np.array([-1], np.int32))


def _model(name: str, backend: str = "reference", passes: str = "default,kv-f16") -> graphir.Model:
    return graphir.load(f"random:{name}", backend=backend, passes=passes, ctx=64)


def _graphs(model: graphir.Model) -> list[Graph]:
    graphs = [model.graph("prefill", 8), model.graph("decode", 1)]
    if model.config.__class__.__name__.startswith("Qwen35"):  # speculative verify / commit: recurrent steps State
        graphs += [model.graph("verify", 4), model.graph("commit", 1)]
    return graphs


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("pipeline", ["default,kv-f16", "kv-f16,default"])
def test_kv_caches_become_f16_and_recurrent_state_stays_f32(name, pipeline):
    for graph in _graphs(_model(name)):
        passed = run_pipeline(graph, pipeline, verify_each=True)
        dtypes = {n.name: n.dtype for n in passed.states}
        kv = {k for k in dtypes if k.endswith(("k_cache", "v_cache"))}
        assert all(dtypes[k] == "f16" for k in kv), dtypes
        assert all(dt == "f32" for k, dt in dtypes.items() if k not in kv), dtypes
        assert kv_cache_states(passed) == kv
        assert run_pipeline(passed, "kv-f16").signature() == passed.signature()  # nothing left to change
        run_pipeline(passed, "replay-lint")


def test_steps_state_written_by_set_rows_is_reported_and_kept():
    verify_graph = _model("qwen35-tiny").graph("verify", 4)
    report = coverage(verify_graph, "kv-f16")["kv-f16"]
    assert any("conv_steps" in site and "not read by attention" in why for site, why in report.rejected)
    assert any("k_cache" in site for site in report.matched)


def _rounded_before_write(graph: Graph) -> Graph:
    """The f32 graph with each KV row rounded to f16 (and back) before set_rows writes it: kv-f16's meaning."""
    caches = kv_cache_states(graph)

    def match(n, rw):
        state = _written_state(n) if n.op == "set_rows" else None
        return n if state is not None and state.name in caches else None

    def rounded(n, rw):
        r = make("cast", make("cast", rw.new(n.src[1]), dtype="f16"), dtype="f32")
        return rw.make("set_rows", n.src[0], r, n.src[2], name=n.name)

    return rewrite(graph, [(match, rounded)])


def _run(backend: str, graph: Graph, weights, inputs: dict, state: dict) -> tuple[np.ndarray, dict]:
    from graphir.dtypes import numpy_dtype

    st = {n.name: state[n.name].astype(numpy_dtype(n.dtype)) for n in graph.states}
    return get_backend(backend).lower(graph, weights)(inputs, st)["logits"], st


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_logits_are_the_f32_graph_with_rows_rounded_and_cpu_meets_reference(name, phase):
    """Unfused graphs (so every cache write is a set_rows to round before), both check cases: position 0 on a
    zeroed cache and later positions on a random one (rounded to f16 for every graph, as the f16 cache holds)."""
    model = _model(name)
    graph = model.graph(phase, 8 if phase == "prefill" else 1)
    f16_graph = run_pipeline(graph, "kv-f16")
    for case in make_cases(graph):
        state = {k: (v.astype(np.float16).astype(np.float32) if k in kv_cache_states(graph) else v)
                 for k, v in case.state.items()}
        want, _ = _run("reference", _rounded_before_write(graph), model.weights, case.inputs, state)
        got, _ = _run("reference", f16_graph, model.weights, case.inputs, state)
        scale = float(np.abs(want).max())
        assert np.abs(got - want).max() <= 1e-6 * scale, case.label  # the same f32 arithmetic on the same rows
        fused = run_pipeline(graph, "default,kv-f16")
        cpu, _ = _run("cpu", fused, model.weights, case.inputs, state)
        assert np.abs(cpu - want).max() <= 1e-4 * scale, case.label  # backends' tolerance (tests/test_shard_tp.py)
        exact, _ = _run("reference", graph, model.weights, case.inputs, case.state)
        assert np.abs(exact - got).max() > 1e-7 * scale  # the rounding happened


def _attention(n_q: int, kvdtype: str, hq: int = 4, hk: int = 2, d: int = 64, cap: int = 300) -> Graph:
    node = g.flash_attn(g.input("q", (n_q, hq, d)), g.state("k", (cap, hk, d), kvdtype),
                        g.state("v", (cap, hk, d), kvdtype), g.input("pos", (n_q,), "i32"),
                        g.input("len", (1,), "i32"), scale=1 / math.sqrt(d), name="attn")
    return Graph({"out": node})


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("n_q", [1, 4, 40])  # the decode kernel (<= 8 queries) and prefill (f16 rows widened)
def test_attention_over_f16_rows_stays_inside_the_rounding_bound(backend, n_q):
    """Derived bound. With k' = round(k), |k'_i - k_i| <= U |k_i| + TINY_ABS, each score moves by at most
    eps = scale * sum_i |q_i| (U |k_i| + TINY_ABS); softmax weights then move by a factor in [e^-2eps, e^2eps],
    so sum_j |p'_j - p_j| <= e^(2 eps) - 1, and |o' - o| <= max|v' - v| + (e^(2 eps) - 1) max|v|
    (+ f32 arithmetic, 1e-6 max|v|)."""
    rng = np.random.default_rng(n_q)
    q = rng.standard_normal((n_q, 4, 64), dtype=np.float32)
    k = rng.standard_normal((300, 2, 64), dtype=np.float32) * 2
    v = rng.standard_normal((300, 2, 64), dtype=np.float32)
    pos = np.arange(250 - n_q, 250, dtype=np.int32)
    feeds = {"q": q, "pos": pos, "len": np.array([250], np.int32)}
    exact = get_backend("reference").lower(_attention(n_q, "f32"))(feeds, {"k": k, "v": v})["out"]
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    got = get_backend(backend).lower(_attention(n_q, "f16"))(feeds, {"k": k16, "v": v16})["out"]
    kq = np.repeat(U * np.abs(k) + TINY_ABS, 2, axis=1)  # [keys, q heads, d]: each q head's K row error bound
    eps = float(np.einsum("qhd,khd->qhk", np.abs(q), kq).max()) / math.sqrt(64)
    vmax = float(np.abs(v).max())
    bound = float(np.abs(v16.astype(np.float32) - v).max()) + math.expm1(2 * eps) * vmax + 1e-6 * vmax
    err = float(np.abs(got - exact).max())
    assert 0 < err <= bound, (err, bound)


@pytest.mark.parametrize("name", TINY)
def test_check_passes_at_one_f16_ulp(name):
    """graphir check with the pass: the model's outputs within F16_TOL (one f16 ulp of max |value|) of f32
    KV, both cases; the default 1e-4 would fail (the pass changes the math by design)."""
    for phase in ("prefill", "decode"):
        assert check(_model(name, passes="default"), passes="default,kv-f16", tol=F16_TOL, phase=phase).ok
    assert not check(_model("llama-tiny", passes="default"), passes="default,kv-f16").ok


@pytest.mark.parametrize("name", TINY)
def test_greedy_generation_equal_on_reference_and_cpu(name):
    prompt = list(np.random.default_rng(1).integers(3, 200, 19))
    ids = {b: list(_model(name, b).generate(prompt, 24)) for b in ("reference", "cpu")}
    assert ids["cpu"] == ids["reference"]
    model = _model(name, "cpu")
    model._ensure_state()
    assert {str(a.dtype) for k, a in model._state.items() if k.endswith("_cache")} == {"float16"}


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_slot_pool_and_speculative_verify_with_f16_caches(name):
    """A KV slot pool (the cache read through a gather) and speculative verify calls (more queries per call,
    rollback by length) over f16 caches give plain greedy decoding's ids on the cpu."""
    from graphir import speculative

    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 200, 21)] * 2  # repeats: lookup drafts
    plain = list(_model(name, "cpu").generate(prompt, 20))
    pooled = graphir.load(f"random:{name}", backend="cpu", passes="default,kv-f16", ctx=64, kv_slots=80)
    assert list(pooled.generate(prompt, 20)) == plain
    assert list(speculative.generate(_model(name, "cpu"), "lookup", prompt, 20, draft_len=7)) == plain


def test_cpu_runs_f16_caches_on_its_kernels(monkeypatch):
    """f16 caches send no more ops to the numpy-reference fallback than f32 caches do (prefill and decode):
    the cache writes and attention have kernels for them. (Qwen3's q/k norm + rope over a strided view takes
    the fallback either way.)"""
    fell_back = {"default": set(), "default,kv-f16": set()}
    original = LR._fallback
    for passes, ops in fell_back.items():
        monkeypatch.setattr(LR, "_fallback", lambda n, ins, out, ops=ops: ops.add(n.op) or original(n, ins, out))
        model = _model("qwen3-tiny", "cpu", passes)
        model.logits(list(range(3, 43)))  # prefill chunks of more than 8 tokens: the prefill kernel
        model.feed([5])
    assert fell_back["default,kv-f16"] == fell_back["default"]
    assert "flash_attn" not in fell_back["default"] and "set_rows" not in fell_back["default"]


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("name", TINY)
def test_gpu_meets_reference_with_f16_caches(name):
    """The gpu's f16 cache writes and f16 attention classes (tests/test_gpu_attention.py) inside a model."""
    ids = list(np.random.default_rng(0).integers(3, 200, 40))
    got = _model(name, "gpu").logits(ids)
    want = _model(name, "reference").logits(ids)
    assert np.abs(got - want).max() <= 1e-4 * float(np.abs(want).max())
