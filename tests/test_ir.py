"""The IR itself: immutable nodes, hashable params, deep graphs, structural signatures, JSON records."""

from __future__ import annotations

import json

import numpy as np
import pytest
from graphir.backends import reference

from graphir import g
from graphir.errors import GraphError
from graphir.ir import Graph, Node, Params, toposort
from graphir.verify import verify


# ---------------------------------------------------------------- Node
def test_node_is_immutable():
    x = g.input("x", (3,))
    n = g.neg(x, name="n")
    for attr, value in [("op", "exp"), ("shape", (4,)), ("src", ()), ("name", "m"), ("params", Params()),
                        ("dtype", "f16"), ("brand_new", 1)]:
        with pytest.raises(AttributeError):
            setattr(n, attr, value)
    with pytest.raises(AttributeError):
        del n.name
    assert (n.op, n.shape, n.src, n.name) == ("neg", (3,), (x,), "n")


def test_node_replace_builds_a_new_node():
    x = g.input("x", (3,))
    n = g.scale(x, s=2.0, name="a")
    m = n.replace(name="b", params=Params({"s": 3.0, "b": 0.0}))
    assert m is not n and (n.name, n.params["s"]) == ("a", 2.0) and (m.name, m.params["s"]) == ("b", 3.0)
    assert m.src == n.src and m.shape == n.shape


def test_node_basics():
    n = g.input("x", (2, 3, 4))
    assert n.numel == 24 and n.is_leaf and not g.neg(n).is_leaf
    assert "input 'x' [2, 3, 4] f32" in repr(n)
    assert Node("input", "f32", (np.int64(2), 3), name="y").shape == (2, 3)


# ---------------------------------------------------------------- Params
def test_params_order_independent_and_hashable():
    a = Params({"b": 2, "a": 1.5, "c": "x"})
    b = Params([("c", "x"), ("a", 1.5), ("b", 2)])
    assert a == b and hash(a) == hash(b)
    assert {a: "v"}[b] == "v"
    assert list(a.as_dict()) == ["a", "b", "c"]  # canonical (sorted) order
    assert a["b"] == 2 and a.get("zz") is None and a.get("zz", 7) == 7
    with pytest.raises(KeyError):
        a["zz"]
    assert Params({"a": 1}) != Params({"a": 2}) and Params({"a": 1}) != Params({"b": 1})


def test_params_freeze_lists_and_numpy_scalars():
    p = Params({"shape": [2, [3, 4]], "k": np.int32(5), "s": np.float32(0.5)})
    assert p["shape"] == (2, (3, 4)) and isinstance(p["shape"], tuple)
    assert type(p["k"]) is int and type(p["s"]) is float
    hash(p)  # nested tuples hash


# ---------------------------------------------------------------- toposort
def test_toposort_deep_chain_has_no_recursion_limit():
    x = g.input("x", (2,))
    n = x
    chain = [x]
    for _ in range(20000):
        n = g.neg(n)
        chain.append(n)
    order = toposort([n])
    assert len(order) == 20001 and order == chain
    graph = Graph({"y": n})
    verify(graph)
    assert graph.signature() == Graph({"y": n}).signature()
    out = reference.lower(graph)({"x": np.array([1.0, -2.0], np.float32)})["y"]
    np.testing.assert_array_equal(out, [1.0, -2.0])  # an even number of negations
    rebuilt = Graph.from_records(graph.to_records())
    assert rebuilt == graph


def test_toposort_orders_sources_first_and_shares_nodes():
    x = g.input("x", (3,))
    a = g.neg(x)
    b = g.exp(a)
    c = g.add(a, b)
    order = toposort([c, b])
    pos = {id(n): i for i, n in enumerate(order)}
    assert len(order) == 4  # a is reached twice but listed once
    for n in order:
        assert all(pos[id(s)] < pos[id(n)] for s in n.src)


def test_toposort_detects_cycles():
    x = g.input("x", (3,))
    a = g.neg(x, name="a")
    b = g.neg(a, name="b")
    object.__setattr__(a, "src", (b,))
    with pytest.raises(GraphError, match="cycle"):
        toposort([b])


# ---------------------------------------------------------------- signatures
def _block(eps=1e-5, dim=8, name="x", out="y", scale_first=False):
    x = g.input(name, (4, dim))
    w = g.param("w", (dim,))
    h = g.mul(g.rms_norm(x, eps=eps), w)
    return Graph({out: g.add(h, x) if not scale_first else g.add(x, h)})


def test_signature_equal_for_structurally_equal_graphs():
    a, b = _block(), _block()
    assert a.signature() == b.signature() and a == b and hash(a) == hash(b)
    assert len({a, b}) == 1


@pytest.mark.parametrize("change", [{"eps": 1e-6}, {"dim": 16}, {"name": "h"}, {"out": "z"}, {"scale_first": True}])
def test_signature_changes_with_params_shapes_names_and_wiring(change):
    assert _block().signature() != _block(**change).signature()


def test_signature_sees_dtype_and_updates():
    s = g.state("s", (3,))
    a = Graph({}, [g.assign(s, g.input("x", (3,)))])
    b = Graph({}, [g.assign(s, g.input("x", (3,), "f16"))])
    assert a != b
    assert Graph({"o": g.neg(g.input("x", (3,)))}) != Graph({"o": g.neg(g.input("x", (3,), "f16"))})


# ---------------------------------------------------------------- records
def _recurrent_graph() -> Graph:
    x, s = g.input("x", (5, 4)), g.state("conv", (2, 4))
    conv = g.ssm_conv(x, s, g.param("w", (4, 3)), name="conv")
    y = g.item(conv, index=0, name="y")
    upd = g.assign(s, g.item(conv, index=1))
    v = g.view(y, shape=(2, 2), strides=(4, 1), offset=1)
    c = g.const([[1.0, 2.0], [3.0, 4.0]])
    return Graph({"y": g.add(g.silu(y), g.const([0.5] * 4)), "v": g.mul(v, c)}, [upd], meta={"family": "test", "n": 3})


def test_records_round_trip_through_json():
    graph = _recurrent_graph()
    verify(graph)
    rec = json.loads(json.dumps(graph.to_records()))
    back = Graph.from_records(rec)
    assert back == graph and back.signature() == graph.signature()
    assert back.to_records() == graph.to_records()
    assert back.meta == {"family": "test", "n": 3}
    conv = next(n for n in back if n.op == "ssm_conv")
    assert conv.dtype == "tuple" and conv.types == (((5, 4), "f32"), ((2, 4), "f32"))
    verify(back)
    # and it runs the same
    rng = np.random.default_rng(0)
    from graphir.weights import Weight, Weights

    w = rng.standard_normal((4, 3)).astype(np.float32)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    weights = Weights({"w": Weight("f32", (4, 3), w)})
    s1, s2 = {"conv": np.ones((2, 4), np.float32)}, {"conv": np.ones((2, 4), np.float32)}
    o1 = reference.lower(graph, weights)({"x": x}, s1)
    o2 = reference.lower(back, weights)({"x": x}, s2)
    for k in o1:
        np.testing.assert_array_equal(o1[k], o2[k])
    np.testing.assert_array_equal(s1["conv"], s2["conv"])
    np.testing.assert_array_equal(s1["conv"], x[-2:])


def test_records_reject_bad_ids():
    rec = _recurrent_graph().to_records()
    rec["nodes"][1]["src"] = [5]
    with pytest.raises(GraphError, match="ids must be 0..N-1 in topological order"):
        Graph.from_records(rec)


def test_graph_views():
    graph = _recurrent_graph()
    assert [n.name for n in graph.inputs] == ["x"]
    assert [n.name for n in graph.params] == ["w"]
    assert [n.name for n in graph.states] == ["conv"]
    users = graph.users()
    conv = next(n for n in graph if n.op == "ssm_conv")
    assert sorted(u.params["index"] for u in users[id(conv)]) == [0, 1]
    ids = graph.ids()
    assert sorted(ids.values()) == list(range(len(graph)))
    assert "outputs ['y', 'v']" in repr(graph)


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["outputs"].update(y=-1), r"output 'y': -1 is not the id of an earlier node"),
    (lambda r: r["nodes"][1].update(src=[-1]), r"node 1 src: -1 is not the id of an earlier node \(0\.\.0\)"),
    (lambda r: r["updates"].append(99), r"update: 99 is not the id of an earlier node"),
    (lambda r: r["nodes"][1].pop("shape"), r"node 1: missing field 'shape'"),
    (lambda r: r.update(outputs=[1]), r"'outputs' must map names to node ids"),
])
def test_records_name_the_bad_field(edit, message):
    """A negative id indexed from the end, so an output of -1 silently loaded as the last node (a graph that then
    verified); a list of outputs was an AttributeError; a missing field named neither node nor field."""
    rec = json.loads(json.dumps(_recurrent_graph().to_records()))
    rec["outputs"] = {"y": rec["outputs"][next(iter(rec["outputs"]))]}
    edit(rec)
    with pytest.raises(GraphError, match=message):
        Graph.from_records(rec)


@pytest.mark.parametrize("make, message", [
    (lambda x: Graph({"y": 3}), r"Graph output 'y' is a int: outputs map str names to nodes"),
    (lambda x: Graph({0: g.neg(x)}), r"Graph output name 0 is a int: outputs map str names to nodes"),
    (lambda x: Graph([g.neg(x)]), r"Graph outputs must map names to nodes, got a list"),
    (lambda x: Graph({"y": x}, updates=g.assign(g.state("s", (3,)), x)),
     r"Graph updates must be a list of State writes, got one node \(assign"),
    (lambda x: Graph({"y": x}, updates=[None]), r"Graph updates must be State write nodes, got a NoneType"),
])
def test_graph_checks_its_outputs_and_updates(make, message):
    """A number among the outputs failed in toposort as "'int' object has no attribute 'src'", a list of outputs as
    "cannot convert dictionary update sequence element #0", one update node as "'Node' object is not iterable"."""
    with pytest.raises(GraphError, match=message):
        make(g.input("x", (3,)))
