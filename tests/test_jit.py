"""@graphir.jit traces once per input signature and reuses the Program; the reference backend checks inputs."""

from __future__ import annotations

import re

import numpy as np
import pytest
from graphir.backends import reference

import graphir
from graphir import g
from graphir.errors import InputError
from graphir.ir import Graph


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def test_traces_once_per_signature(rng):
    calls = []

    @graphir.jit
    def f(x, w):
        calls.append((x.shape, w.shape))
        return g.mul(g.rms_norm(x, eps=1e-6), w)

    x, w = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    out = f(x, w)
    np.testing.assert_allclose(out, _rms(x, 1e-6) * w, rtol=1e-5, atol=1e-6)
    assert len(calls) == 1
    program = next(iter(f.programs.values()))
    x2 = rng.standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(f(x2, w), _rms(x2, 1e-6) * w, rtol=1e-5, atol=1e-6)
    assert len(calls) == 1 and len(f.programs) == 1 and next(iter(f.programs.values())) is program
    x3 = rng.standard_normal((5, 8)).astype(np.float32)  # a new shape traces again
    np.testing.assert_allclose(f(x3, w), _rms(x3, 1e-6) * w, rtol=1e-5, atol=1e-6)
    assert calls == [((3, 8), (8,)), ((5, 8), (8,))] and len(f.programs) == 2
    f(x, w)  # the old shape reuses its program
    assert len(calls) == 2
    f(x.astype(np.float16), w)  # so does a new dtype trace
    assert len(calls) == 3


def test_graph_is_the_traced_graph(rng):
    @graphir.jit
    def f(a):
        return g.silu(a)

    a = rng.standard_normal((2, 3)).astype(np.float32)
    graph = f.graph(a)
    assert isinstance(graph, Graph) and [n.name for n in graph.inputs] == ["a"] and list(graph.outputs) == ["out"]
    assert f.graph(a) is graph
    assert f.__name__ == "f"


def test_dict_and_tuple_outputs(rng):
    @graphir.jit
    def both(a, b):
        return {"sum": g.add(a, b), "prod": g.mul(a, b)}

    @graphir.jit
    def pair(a, b):
        return g.add(a, b), g.sub(a, b)

    @graphir.jit
    def single_named_out(a):
        return {"out": g.neg(a)}

    a, b = rng.standard_normal((4,)).astype(np.float32), rng.standard_normal((4,)).astype(np.float32)
    d = both(a, b)
    assert set(d) == {"sum", "prod"}
    np.testing.assert_allclose(d["sum"], a + b)
    np.testing.assert_allclose(d["prod"], a * b)
    t = pair(a, b)
    assert isinstance(t, tuple) and len(t) == 2
    np.testing.assert_allclose(t[0], a + b)
    np.testing.assert_allclose(t[1], a - b)
    one = single_named_out(a)
    assert isinstance(one, dict) and list(one) == ["out"]


def test_jit_with_options_and_int_inputs(rng):
    @graphir.jit(backend="reference")
    def embed(table, ids):
        return g.get_rows(table, ids)

    table = rng.standard_normal((10, 3)).astype(np.float32)
    ids = np.array([9, 0, 9], np.int32)
    np.testing.assert_array_equal(embed(table, ids), table[[9, 0, 9]])


def test_bad_dtype_and_arity_raise_input_error():
    @graphir.jit
    def f(x):
        return g.neg(x)

    with pytest.raises(InputError, match=r"argument 'x' has dtype float64"):
        f(np.ones(3))
    with pytest.raises(InputError, match="takes 1 arrays, got 2"):
        f(np.ones(3, np.float32), np.ones(3, np.float32))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_scalar_input_stays_a_scalar(backend):
    """A numpy scalar (a 0-d Input) was made [1] by np.ascontiguousarray, and every op then failed as a backend
    bug: 'reference returned [1] float32, the op's rule gives [] f32'."""
    f = graphir.jit(lambda x: g.cont(g.neg(x)), backend=backend)
    y = f(np.float32(1.5))
    assert y.shape == () and y == -1.5


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_empty_tensors_run(backend):
    """A [0, 16] result on the cpu failed at binding with numpy's 'When changing to a larger dtype, its size must be a
    divisor of the total size in bytes': the memory plan gives an empty result 1 byte, viewed as f32."""
    x, w = np.zeros((0, 16), np.float32), np.ones((8, 16), np.float32)
    assert graphir.jit(lambda x: g.rms_norm(g.silu(x), eps=1e-6), backend=backend)(x).shape == (0, 16)
    assert graphir.jit(lambda w, x: g.mul_mat(w, x), backend=backend)(w, x).shape == (0, 8)
    assert graphir.jit(lambda w, i: g.get_rows(w, i), backend=backend)(w, np.zeros(0, np.int32)).shape == (0, 16)


def test_last_axis_ops_refuse_a_scalar():
    """top_k of a 0-d tensor was an IndexError from its shape rule; the norms named no rule."""
    for build in (lambda x: g.top_k(x, k=1), lambda x: g.rms_norm(x, eps=1e-6)):
        with pytest.raises(graphir.GraphError, match="needs at least one axis"):
            graphir.jit(build)(np.float32(1.5))


@pytest.mark.parametrize("result, got", [(None, "got None (a missing return?)"), (5, "got 5"),
                                         ("tuple", "got [Node, 3]"), ("empty", "got ()")])
def test_a_function_that_returns_no_nodes_is_named(result, got):
    """A missing return was "'NoneType' object is not iterable"; a number among the outputs "'int' object has no
    attribute 'src'"; no outputs at all 'unexpected inputs ['x']; the graph takes []'."""
    def f(x):
        return {"tuple": lambda: [g.neg(x), 3], "empty": lambda: ()}.get(result, lambda: result)()

    with pytest.raises(graphir.GraphError, match=r"f must return a graph node, or a dict, tuple or list of them"):
        graphir.jit(f)(np.ones(3, np.float32))
    with pytest.raises(graphir.GraphError, match=re.escape(got)):
        graphir.jit(f)(np.ones(3, np.float32))


# ---------------------------------------------------------------- reference backend input checks
def _program():
    x = g.input("tokens", (4,), "i32")
    h = g.input("hidden", (4, 8))
    s = g.state("acc", (4, 8))
    upd = g.assign(s, g.add(s, h))
    return reference.lower(Graph({"ids": g.cast(x, dtype="f32"), "acc": upd}))


def _feeds():
    return {"tokens": np.arange(4, dtype=np.int32), "hidden": np.ones((4, 8), np.float32)}


def test_reference_runs_with_good_inputs():
    state = {"acc": np.zeros((4, 8), np.float32)}
    out = _program()(_feeds(), state)
    np.testing.assert_array_equal(out["ids"], [0, 1, 2, 3])
    np.testing.assert_array_equal(state["acc"], 1.0)


def test_missing_input_is_named():
    feeds = _feeds()
    del feeds["hidden"]
    with pytest.raises(InputError, match=r"missing input 'hidden' \(\[4, 8\] f32\)"):
        _program()(feeds, {"acc": np.zeros((4, 8), np.float32)})


def test_wrong_shape_is_named():
    feeds = {**_feeds(), "tokens": np.arange(5, dtype=np.int32)}
    with pytest.raises(InputError, match=r"input 'tokens': shape \[5\], graph expects \[4\]"):
        _program()(feeds, {"acc": np.zeros((4, 8), np.float32)})


def test_wrong_dtype_is_named():
    feeds = {**_feeds(), "tokens": np.arange(4, dtype=np.float32)}
    with pytest.raises(InputError, match=r"input 'tokens': dtype float32, graph expects i32"):
        _program()(feeds, {"acc": np.zeros((4, 8), np.float32)})
    feeds = {**_feeds(), "hidden": np.ones((4, 8), np.int32)}
    with pytest.raises(InputError, match=r"input 'hidden': dtype int32, graph expects f32"):
        _program()(feeds, {"acc": np.zeros((4, 8), np.float32)})


def test_unexpected_input_and_bad_state_are_named():
    with pytest.raises(InputError, match=r"unexpected inputs \['extra'\]"):
        _program()({**_feeds(), "extra": np.ones(1, np.float32)}, {"acc": np.zeros((4, 8), np.float32)})
    with pytest.raises(InputError, match=r"missing state buffer 'acc'"):
        _program()(_feeds(), {})
    with pytest.raises(InputError, match=r"state 'acc': \[4, 7\] float32, graph expects \[4, 8\] f32"):
        _program()(_feeds(), {"acc": np.zeros((4, 7), np.float32)})


def test_reference_checks_each_value_against_the_rule(monkeypatch):
    import dataclasses

    from graphir.errors import BackendError
    from graphir.ops import OPS

    monkeypatch.setitem(OPS, "neg", dataclasses.replace(OPS["neg"], ref=lambda x: (-x).astype(np.float64)))
    prog = reference.lower(Graph({"o": g.neg(g.input("x", (3,)), name="n")}))
    with pytest.raises(BackendError, match=r"neg 'n'.*reference returned \[3\] float64, the op's rule gives \[3\] f32"):
        prog({"x": np.ones(3, np.float32)})


TWOS = np.full(8, 2.0, np.float32)


def test_keyword_arguments_and_defaults(rng):
    """Arrays passed by keyword were "Jitted.__call__() got an unexpected keyword argument 'x'"; a parameter left at
    its default was 'takes 2 arrays, got 1'. A default now reaches the function as the value it is (no Input), an
    array default as an Input; *args has no names to give the Inputs and is refused when decorated."""
    @graphir.jit
    def norm(x, w, eps=1e-6):
        return g.mul(g.rms_norm(x, eps=eps), w)

    x, w = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    want = _rms(x, 1e-6) * w
    np.testing.assert_allclose(norm(x, w), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm(w=w, x=x), want, rtol=1e-5, atol=1e-6)
    assert len(norm.programs) == 1 and [n.name for n in norm.graph(x, w).inputs] == ["x", "w"]

    @graphir.jit
    def scaled(x, s=TWOS):
        return g.mul(x, s)

    np.testing.assert_array_equal(scaled(x), x * 2)
    np.testing.assert_array_equal(scaled(x, s=np.ones(8, np.float32)), x)
    with pytest.raises(InputError, match=r"norm takes 3 arrays, got 1 and 'y' \(.*\)"):
        norm(x, y=w)
    with pytest.raises(graphir.GraphError, match=r"jit: f takes \*xs; name each array parameter instead"):
        @graphir.jit
        def f(*xs):
            return g.add(*xs)
