"""graphir.check: the default pipeline passes on the tiny models; a wrong pass is caught and the
first diverging tensor is named; inputs are valid and both runs see the same state."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache

import numpy as np
import pytest

import graphir
from graphir.builder import g, make
from graphir.check import DEFAULT_TOL, F16_TOL, check, compare, make_cases
from graphir.errors import GraphError
from graphir.ir import Graph, Node
from graphir.passes import PASSES, register_pass
from graphir.passes.rewrite import Rewriter, rewrite

MODELS = ("llama-tiny", "qwen3-tiny", "qwen2-tiny")


@cache
def tiny(name: str):
    return graphir.load(f"random:{name}")


# ---------------------------------------------------------------- wrong passes, registered for a test
@contextmanager
def temporary_pass(name: str, pattern: Callable[[Node, Rewriter], Node | None],
                   build: Callable[[Node, Rewriter], Node]) -> Iterator[str]:
    """Register a one-rule pass `name` for the duration of a `with` block."""
    register_pass(name, "a deliberately wrong pass (test)")(lambda graph: rewrite(graph, [(pattern, _recorded(build))]))
    try:
        yield name
    finally:
        PASSES.pop(name, None)


def _recorded(build: Callable[[Node, Rewriter], Node]) -> Callable[[Node, Rewriter], Node]:
    def rw_fn(n: Node, rw: Rewriter) -> Node:
        rw.matched(n, "wrong")
        return build(n, rw)

    return rw_fn


def _named(name: str) -> Callable[[Node, Rewriter], Node | None]:
    return lambda n, rw: n if n.name == name else None


def add_to_sub(name: str = "test-add-to-sub"):
    """blk.1.attn_res = a - b instead of a + b."""
    return temporary_pass(name, _named("blk.1.attn_res"),
                          lambda n, rw: make("sub", rw.new(n.src[0]), rw.new(n.src[1]), name=n.name))


def wrong_eps(name: str = "test-wrong-eps"):
    """The rms_norm under blk.1.ffn_norm with eps 1e-2 instead of 1e-5 (an unnamed node)."""
    def pattern(n: Node, rw: Rewriter) -> Node | None:
        return n if n.op == "rms_norm" and any(u.name == "blk.1.ffn_norm" for u in rw.users(n)) else None

    return temporary_pass(name, pattern, lambda n, rw: make("rms_norm", rw.new(n.src[0]), eps=1e-2))


def doubled_v_write(name: str = "test-doubled-v"):
    """blk.1's V rows written to the cache times 2."""
    def build(n: Node, rw: Rewriter) -> Node:
        v = rw.new(n.src[1])
        return make("set_rows", rw.new(n.src[0]), make("scale", v, s=2.0), rw.new(n.src[2]), name=n.name)

    return temporary_pass(name, _named("blk.1.v_cache_write"), build)


# ---------------------------------------------------------------- default keeps the math
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("model", MODELS)
def test_default_passes_check(model: str, phase: str) -> None:
    report = check(tiny(model), passes="default", phase=phase, n_tokens=7 if phase == "prefill" else None)
    assert report.ok, report.text()
    assert report.phase == phase and len(report.cases) == 2
    assert report.nodes_after < report.nodes_before
    for case in report.cases:
        assert case.compared > 10 and case.first_divergence is None
        assert [d.name for d in case.outputs] == ["logits"]
        assert {d.name for d in case.states} == {n.name for n in tiny(model).graph(phase).states}
        assert all(d.rel <= DEFAULT_TOL for d in case.outputs + case.states)
    assert sum(len(pc.matched) for pc in report.coverage.passes.values()) > 0
    assert report.summary().startswith("ok: pipeline 'default'")


def test_check_takes_a_graph_and_weights() -> None:
    m = tiny("llama-tiny")
    report = check(m.graph("prefill", 5), m.weights, "dce,cse,swiglu-split")
    assert report.ok and report.coverage["swiglu-split"].matched


# ---------------------------------------------------------------- wrong passes are caught
@pytest.mark.parametrize("wrong, first", [(add_to_sub, "blk.1.attn_res"), (wrong_eps, "blk.1.ffn_norm")])
def test_wrong_pass_names_the_first_diverging_tensor(wrong, first: str) -> None:
    with wrong() as name:
        report = check(tiny("llama-tiny"), passes=name, n_tokens=7)
    assert not report.ok
    assert report.first_divergence is not None and report.first_divergence.name == first
    assert all(c.first_divergence.name == first for c in report.cases)
    assert not report.cases[0].outputs[0].ok  # the error reaches the logits
    text = report.text(coverage=True)
    assert f"first diverging tensor: '{first}'" in text and "DIVERGES" in text
    assert f"{name}: 1 matched" in text
    assert report.summary().startswith(f"pipeline '{name}' changes the math")


def test_wrong_pass_after_default_fusions_is_caught_too() -> None:
    with wrong_eps() as name:  # fuse-add-rms-norm-mul took the norm: the wrong pass never fires
        assert check(tiny("llama-tiny"), passes=f"{name},default").first_divergence.name == "blk.1.ffn_norm"
        assert check(tiny("llama-tiny"), passes=f"default,{name}").ok


def test_state_buffers_are_compared() -> None:
    with doubled_v_write() as name:
        report = check(tiny("llama-tiny"), passes=name, phase="decode")
    bad = [d.name for d in report.cases[0].states if not d.ok]
    assert bad == ["blk.1.v_cache"]  # layer 1 writes its caches before its attention reads them
    assert report.first_divergence.name == "blk.1.v_cache_write"
    assert "state 'blk.1.v_cache'" in report.text()


def test_tolerance_is_applied() -> None:
    with wrong_eps() as name:
        loose = check(tiny("llama-tiny"), passes=name, tol=1.0)
    assert loose.ok and loose.tol == 1.0


# ---------------------------------------------------------------- inputs and state
def test_cases_hold_valid_inputs_at_two_positions() -> None:
    graph = tiny("qwen3-tiny").graph("prefill", 7)
    first, later = make_cases(graph, seed=3)
    n_vocab = next(p for p in graph.params if p.name == "token_embd.weight").shape[0]
    for case, start in ((first, 0), (later, 23)):
        assert case.inputs["tokens"].dtype == np.int32
        assert 0 <= case.inputs["tokens"].min() and case.inputs["tokens"].max() < n_vocab
        assert case.inputs["pos"].tolist() == list(range(start, start + 7))
        assert case.inputs["kv_idx"].tolist() == list(range(start, start + 7))
        assert case.inputs["kv_len"].tolist() == [start + 7]
    assert all(not v.any() for v in first.state.values())
    assert all(v.std() > 0.5 for v in later.state.values())


def test_later_case_fits_the_cache() -> None:
    m = graphir.load("random:llama-tiny", ctx=20)
    first, later = make_cases(m.graph("prefill", 8))
    assert later.inputs["pos"].tolist() == list(range(12, 20))
    assert [c.inputs["pos"][0] for c in make_cases(m.graph("prefill", 20))] == [0]  # no room for a second case


def test_both_runs_see_the_same_state_and_the_callers_is_untouched() -> None:
    m = tiny("llama-tiny")
    graph = m.graph("decode")
    rng = np.random.default_rng(0)
    state = {n.name: rng.standard_normal(n.shape).astype(np.float32) for n in graph.states}
    saved = {k: v.copy() for k, v in state.items()}
    inputs = {"tokens": np.array([5], np.int32), "pos": np.array([9], np.int32), "kv_idx": np.array([9], np.int32),
              "kv_len": np.array([10], np.int32)}
    report = check(graph, m.weights, "default", inputs=inputs, state=state)
    assert report.ok and [c.label for c in report.cases] == ["given inputs"]
    assert all(c.rel == 0.0 for c in report.cases[0].states)  # same state in, same rows written
    assert all(np.array_equal(state[k], saved[k]) for k in state)


def test_check_rejects_other_things() -> None:
    with pytest.raises(GraphError, match="expected a Graph or a loaded model"):
        check("random:llama-tiny")
    grid = g.input("grid", (2, 3), "i32")  # no role says what values are valid
    with pytest.raises(GraphError, match="input 'grid' \\[2, 3\\] i32.*pass inputs="):
        check(Graph({"y": g.cast(grid, dtype="f32")}))


@pytest.mark.parametrize("kw, rule", [({"tol": -1.0}, "tol must be a number >= 0, got -1.0"),
                                      ({"tol": "1e-3"}, "tol must be a number >= 0, got '1e-3'"),
                                      ({"tol": float("nan")}, "tol must be a number >= 0, got nan"),
                                      ({"seed": -1}, "seed must be an int >= 0, got -1"),
                                      ({"seed": 1.5}, "seed must be an int >= 0, got 1.5")])
def test_check_settings_are_checked(kw, rule) -> None:
    """tol=-1 reported 'changes the math beyond -1e+00: worst rel 0'; tol='1e-3' and seed=-1 were a TypeError from
    a comparison and numpy's 'expected non-negative integer'."""
    graph = Graph({"y": g.silu(g.input("x", (3, 4)))})
    with pytest.raises(GraphError, match=rule):
        check(graph, passes="dce", **kw)
    assert check(graph, passes="dce", tol=np.float32(1e-3), seed=np.int64(2)).ok


# ---------------------------------------------------------------- compare
def test_compare_is_relative_to_the_largest_value() -> None:
    a = np.array([100.0, 0.001], np.float32)
    d = compare("x", a, a + np.array([0.0, 0.005], np.float32))  # 5x the small element, 5e-5 of the max
    assert d.ok and d.max_abs == pytest.approx(0.005) and d.rel == pytest.approx(5e-5)
    assert not compare("x", a, a * 1.001).ok
    assert compare("x", np.zeros(3), np.zeros(3)).rel == 0.0
    assert compare("x", np.zeros(3), np.ones(3)).rel == float("inf")


def test_compare_integers_exact_f16_looser_mismatches_infinite() -> None:
    assert not compare("ids", np.array([1, 2], np.int32), np.array([1, 3], np.int32), tol=0.5).ok
    h = np.array([1.0, 2.0], np.float16)
    assert compare("h", h, h + np.float16(0.001)).tol == F16_TOL
    assert compare("h", h, np.nextafter(h, np.float16(3))).ok
    shape = compare("x", np.zeros((2, 3)), np.zeros((3, 2)))
    assert shape.rel == float("inf") and "[2, 3]" in shape.note
    nan = compare("x", np.array([np.nan, 1.0]), np.array([0.0, 1.0]))
    assert not nan.ok and "NaN" in nan.note
    assert compare("x", np.array([np.nan, 1.0]), np.array([np.nan, 1.0])).ok


def test_unmatched_names_are_listed_not_compared() -> None:
    m = tiny("llama-tiny")
    report = check(m, passes="fuse-rope-set-rows", phase="decode")
    case = report.cases[0]
    assert "blk.0.k_rope" in case.unmatched  # the rope now happens inside rope_set_rows
    assert report.ok


def test_check_runs_the_example_graph() -> None:
    from graphir.examples import build_example, example_weights

    graph = build_example("prefill")
    assert isinstance(graph, Graph)
    assert check(graph, example_weights(graph)).ok
