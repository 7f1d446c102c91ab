"""The verifier rejects malformed graphs with a GraphError naming the node (%id, op, name) and the rule.

Bad nodes are built with Node(...) directly, bypassing the builder's checks, the way a buggy
pass would build them.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from graphir.backends import reference

from graphir import g
from graphir.errors import GraphError
from graphir.ir import Graph, Node, Params
from graphir.verify import verify


def rejects(graph: Graph, node: Node | None, *fragments: str) -> str:
    """verify(graph) raises; the message names `node` as %id and every fragment appears."""
    with pytest.raises(GraphError) as info:
        verify(graph)
    msg = str(info.value)
    if node is not None:
        nid = graph.ids()[id(node)]
        assert re.search(rf"%{nid}\b", msg), f"message does not name %{nid}: {msg}"
    for f in fragments:
        assert f in msg, f"{f!r} not in: {msg}"
    return msg


def x3(name: str = "x") -> Node:
    return g.input(name, (3,))


def test_a_sound_graph_passes_and_is_returned():
    x = x3()
    graph = Graph({"y": g.add(x, g.neg(x, name="n"))})
    assert verify(graph) is graph


def test_unknown_op():
    bad = Node("frobnicate", "f32", (3,), (x3(),), name="weird")
    rejects(Graph({"o": bad}), bad, "frobnicate", "'weird'", "unknown op")


def test_wrong_arity():
    bad = Node("add", "f32", (3,), (x3(),), name="half_add")
    rejects(Graph({"o": bad}), bad, "add 'half_add'", "takes 2..2 sources, has 1")


def test_bad_param_type():
    bad = Node("scale", "f32", (3,), (x3(),), Params({"s": "two"}), name="sc")
    rejects(Graph({"o": bad}), bad, "scale 'sc'", "param 's' must be float", "'two'")


def test_bool_is_not_an_int_param():
    bad = Node("top_k", "i32", (1,), (x3(),), Params({"k": True}), name="tk")
    rejects(Graph({"o": bad}), bad, "top_k 'tk'", "param 'k' must be int")


def test_unknown_param():
    bad = Node("neg", "f32", (3,), (x3(),), Params({"alpha": 1.0}), name="ng")
    rejects(Graph({"o": bad}), bad, "neg 'ng'", "unknown params ['alpha']")


def test_missing_param():
    bad = Node("rms_norm", "f32", (3,), (x3(),), Params(), name="norm0")
    rejects(Graph({"o": bad}), bad, "rms_norm 'norm0'", "missing required param 'eps'")


def test_wrong_shape():
    x, y = x3("x"), x3("y")
    bad = Node("add", "f32", (4,), (x, y), name="sum")
    rejects(Graph({"o": bad}), bad, "add 'sum' [4] f32", "the rule gives [3] f32")


def test_wrong_dtype():
    bad = Node("neg", "f16", (3,), (x3(),), name="n")
    rejects(Graph({"o": bad}), bad, "neg 'n'", "has [3] f16 but the rule gives [3] f32")


def test_shape_rule_violation_names_node_and_rule():
    a, b = g.input("a", (3, 4)), g.input("b", (5,))
    bad = Node("add", "f32", (3, 4), (a, b), name="bad_add")
    rejects(Graph({"o": bad}), bad, "add 'bad_add'", "b [5] does not broadcast onto a [3, 4]")


def test_unknown_dtype():
    bad = Node("input", "f64", (3,), name="x64")
    rejects(Graph({"o": g.neg(x3()), "p": bad}), bad, "input 'x64'", "unknown dtype 'f64'")


def test_view_out_of_bounds():
    x = x3()
    bad = Node("view", "f32", (2,), (x,), Params({"shape": (2,), "strides": (3,), "offset": 0}), name="v")
    rejects(Graph({"o": bad}), bad, "view 'v'", "view reaches element 3 but the source [3] has 3 elements")
    verify(Graph({"o": g.view(x, shape=(2,), strides=(2,), offset=0)}))  # elements 0 and 2 are in bounds
    bad = Node("view", "f32", (1,), (x,), Params({"shape": (1,), "strides": (1,), "offset": 3}), name="v2")
    rejects(Graph({"o": bad}), bad, "view 'v2'", "reaches element 3")
    with pytest.raises(GraphError, match=r"view 'v3'.*reaches element 4"):
        g.view(x, shape=(2,), strides=(4,), offset=0, name="v3")


def test_view_of_an_empty_tensor_reads_nothing():
    empty = g.input("e", (0,))
    with pytest.raises(GraphError, match="reaches element 0 but the source \\[0\\] has 0 elements"):
        g.view(empty, shape=(1,), strides=(1,), offset=0)
    assert g.view(empty, shape=(0,), strides=(1,), offset=0).shape == (0,)


def test_write_into_a_non_state():
    x, y = x3("x"), x3("y")
    bad = Node("assign", "f32", (3,), (x, y), name="w")
    rejects(Graph({}, [bad]), bad, "assign 'w'", "destination must be a State")
    with pytest.raises(GraphError, match=r"assign 'w2'.*first source must be a State"):
        g.assign(x, y, name="w2")


def test_state_update_that_writes_nothing():
    n = g.neg(x3(), name="n")
    rejects(Graph({}, [n]), n, "neg 'n'", "listed as a state update but neg writes nothing")


def test_two_unordered_writers_of_one_state():
    s = g.state("s", (3,))
    w1 = g.assign(s, x3("a"), name="w1")
    w2 = g.assign(s, x3("b"), name="w2")
    msg = rejects(Graph({}, [w1, w2]), None, "2 writes consume the same value of state 's'", "chain them")
    assert re.search(r"%\d+ assign 'w[12]'", msg)
    # chained, the order is defined
    verify(Graph({}, [g.assign(w1, x3("b"))]))


def test_reader_not_ordered_before_the_write():
    s = g.state("s", (3,))
    reader = g.cont(s, name="old")
    w = g.assign(s, x3(), name="w")
    msg = rejects(Graph({"old": reader}, [w]), reader, "cont 'old'", "is not ordered before the in-place write")
    assert f"%{Graph({'old': reader}, [w]).ids()[id(w)]} assign 'w'" in msg
    # reading first, then writing something that depends on the read, is legal
    verify(Graph({"new": g.assign(s, g.add(x3(), reader))}))


def test_reader_through_a_view_of_the_state_must_be_ordered_too():
    # reshape aliases the State's storage, so its consumers read the State as well
    s = g.state("s", (2, 3))
    alias = g.reshape(s, shape=(6,))
    used_by_write = g.rows(g.reshape(alias, shape=(2, 3)), 0, 2)
    late = g.cont(alias, name="late")
    w = g.assign(s, g.add(used_by_write, g.input("x", (2, 3))), name="w")
    graph = Graph({"late": late}, [w])
    rejects(graph, late, "cont 'late'", "not ordered before the in-place write")
    verify(Graph({"new": w}))


def test_a_write_that_also_reads_its_destination_is_one_writer():
    s = g.state("s", (3,))
    verify(Graph({"o": g.assign(s, s)}))


def test_cycle():
    x = x3()
    a = g.neg(x, name="a")
    b = g.exp(a, name="b")
    object.__setattr__(a, "src", (b,))  # a -> b -> a
    with pytest.raises(GraphError, match=r"cycle through node (neg 'a'|exp 'b')"):
        verify(Graph({"o": b}))


def test_self_cycle():
    a = g.neg(x3(), name="selfish")
    object.__setattr__(a, "src", (a,))
    with pytest.raises(GraphError, match="cycle through node neg 'selfish'"):
        verify(Graph({"o": a}))


def test_duplicate_leaf_names_with_different_shapes():
    a, b = g.input("x", (3,)), g.input("x", (4,))
    graph = Graph({"a": g.neg(a), "b": g.neg(b)})
    later = b if graph.ids()[id(b)] > graph.ids()[id(a)] else a
    rejects(graph, later, "input 'x'", "also appears as")
    # the same name and type twice is one leaf
    verify(Graph({"a": g.neg(g.input("x", (3,))), "b": g.neg(g.input("x", (3,)))}))
    p1, p2 = g.param("w", (3,)), g.param("w", (3,), "f16")
    rejects(Graph({"a": g.add(x3(), p1), "b": g.add(x3(), p2)}), None, "param 'w'", "also appears as")


def test_tuple_output_used_directly():
    x, s = g.input("x", (5, 4)), g.state("c", (2, 4))
    conv = g.ssm_conv(x, s, g.param("w", (4, 3)), name="conv")
    with pytest.raises(GraphError, match="output 'y' is a multi-output ssm_conv; output one item"):
        verify(Graph({"y": conv}))
    bad = Node("neg", "f32", (5, 4), (conv,), name="n")
    rejects(Graph({"o": bad}), bad, "neg 'n'", "source 0 is multi-output; read it through item")
    with pytest.raises(GraphError, match=r"neg.*source 0 is a multi-output ssm_conv; take one result with g.item"):
        g.neg(conv)


def test_item_index_out_of_range():
    conv = g.ssm_conv(g.input("x", (5, 4)), g.state("c", (2, 4)), g.param("w", (4, 3)))
    bad = Node("item", "f32", (5, 4), (conv,), Params({"index": 2}), name="it")
    rejects(Graph({"o": bad}), bad, "item 'it'", "item index 2 does not select a result of ssm_conv")
    with pytest.raises(GraphError, match="index 2 out of range for 2 results"):
        g.item(conv, index=2)
    bad = Node("item", "f32", (5, 5), (conv,), Params({"index": 0}), name="it0")
    rejects(Graph({"o": bad}), bad, "item 'it0'", "the rule gives [5, 4] f32")


def test_multi_output_types_must_match_the_rule():
    x, s, w = g.input("x", (5, 4)), g.state("c", (2, 4)), g.param("w", (4, 3))
    bad = Node("ssm_conv", "tuple", (), (x, s, w), name="conv", types=(((5, 4), "f32"), ((3, 4), "f32")))
    rejects(Graph({"o": g.item(bad, index=0)}), bad, "ssm_conv 'conv'", "result types")


def test_leaf_rules():
    nameless = Node("input", "f32", (3,))
    rejects(Graph({"o": g.neg(nameless)}), nameless, "needs a name")
    with_src = Node("param", "f32", (3,), (x3(),), name="p")
    rejects(Graph({"o": g.neg(with_src)}), with_src, "param 'p'", "has no sources")
    const = Node("const", "f32", (3,), (), Params({"value": (1.0, 2.0)}), name="c")
    rejects(Graph({"o": g.neg(const)}), const, "const holds 2 values for shape [3]")
    st = Node("state", "i32", (3,), name="s")
    rejects(Graph({"o": g.cast(st, dtype="f32")}), st, "State must be f32 or f16")


def test_params_must_be_canonical():
    bad = Node("concat", "f32", (6,), (x3("a"), x3("b")), Params({"axis": 0.0}), name="cc")
    rejects(Graph({"o": bad}), bad, "concat 'cc'", "param 'axis' must be int")


def test_verify_runs_before_the_reference_backend():
    bad = Node("add", "f32", (4,), (x3("x"), x3("y")), name="sum")
    with pytest.raises(GraphError, match="add 'sum'"):
        reference.lower(Graph({"o": bad}))


# ---------------------------------------------------------------- builder-level errors
def test_builder_add_mismatched_shapes_names_op_and_shapes():
    a, b = g.input("a", (3, 4)), g.input("b", (5,))
    with pytest.raises(GraphError) as info:
        g.add(a, b, name="resid")
    msg = str(info.value)
    for f in ("add 'resid'", "[3, 4]", "[5]", "does not broadcast"):
        assert f in msg, msg


def test_builder_errors():
    x = x3()
    with pytest.raises(GraphError, match=r"add\(input 'x' \[3\] f32\): add takes 2 sources, got 1"):
        g.add(x)
    with pytest.raises(GraphError, match=r"softmax takes 1\.\.2 sources, got 3"):
        g.softmax(x, x, x)
    with pytest.raises(GraphError, match=r"rms_norm.*missing required param 'eps'"):
        g.rms_norm(x)
    with pytest.raises(GraphError, match=r"unknown params \['epsilon'\]; rms_norm takes \['eps'\]"):
        g.rms_norm(x, epsilon=1e-5)
    with pytest.raises(GraphError, match=r"param 'eps' must be float, got '1e-5'"):
        g.rms_norm(x, eps="1e-5")
    with pytest.raises(GraphError, match="source 1 is ndarray, not a Node"):
        g.add(x, np.ones(3, np.float32))
    with pytest.raises(GraphError, match="a must be a float tensor"):
        g.add(g.input("i", (3,), "i32"), x)
    with pytest.raises(GraphError, match=r"inner sizes differ: w \[5, 4\] has n_in 4, x \[2, 3\] has 3"):
        g.mul_mat(g.param("w", (5, 4)), g.input("h", (2, 3)))
    with pytest.raises(GraphError, match=r"k=4 must be in 1\.\.3"):
        g.top_k(x, k=4)
    with pytest.raises(GraphError, match="mode must be 'norm' or 'neox'"):
        g.rope(g.input("q", (2, 1, 4)), g.input("p", (2,), "i32"), n_dims=4, mode="yarn")
    with pytest.raises(GraphError, match="n_dims=3 must be even"):
        g.rope(g.input("q", (2, 1, 4)), g.input("p", (2,), "i32"), n_dims=3)
    with pytest.raises(GraphError, match="q heads 3 must be a multiple of kv heads 2"):
        g.flash_attn(g.input("q", (1, 3, 4)), g.input("k", (5, 2, 4)), g.input("v", (5, 2, 4)),
                     g.input("p", (1,), "i32"), g.input("n", (1,), "i32"), scale=0.5)
    with pytest.raises(GraphError, match="build leaves with g.input"):
        from graphir.builder import make

        make("input")
    with pytest.raises(AttributeError, match="no op named 'frobnicate'"):
        g.frobnicate(x)


def test_builder_leaf_errors():
    with pytest.raises(GraphError, match="a name is required"):
        g.input("", (3,))
    with pytest.raises(GraphError, match="unknown dtype 'f64'"):
        g.input("x", (3,), "f64")
    with pytest.raises(GraphError, match=r"shape \[3, -1\] must be non-negative"):
        g.input("x", (3, -1))
    with pytest.raises(GraphError, match="q8_0 needs the last axis to be a multiple of 32"):
        g.param("w", (4, 33), "q8_0")
    with pytest.raises(GraphError, match="State must be f32 or f16"):
        g.state("s", (3,), "q8_0")
    with pytest.raises(GraphError, match="const.*dtype must be f32 or i32"):
        g.const([1.0], "f16")


def test_layout_params_hold_ints():
    """reshape (-7, -16) of [7, 16] built a [-7, -16] node (the sizes' product matched), a view of shape (2.5, 2)
    became [2, 2] without a word, and a string or float in strides or axes was a TypeError inside the rule."""
    x = g.input("x", (7, 16))
    with pytest.raises(GraphError, match=r"reshape\(input 'x'.*reshape shape \[-7, -16\] must hold non-negative ints"):
        g.reshape(x, shape=(-7, -16))
    with pytest.raises(GraphError, match=r"view shape \[2\.5, 2\] must hold non-negative ints, got 2\.5"):
        g.view(x, shape=(2.5, 2), strides=(16, 1))
    with pytest.raises(GraphError, match=r"view shape \[-2, -2\] must hold non-negative ints"):
        g.view(x, shape=(-2, -2), strides=(1, 1))
    with pytest.raises(GraphError, match=r"view strides \['a', 1\] must hold ints, got 'a'"):
        g.view(x, shape=(2, 2), strides=("a", 1))
    with pytest.raises(GraphError, match=r"permute axes \[1\.0, 0\] must hold non-negative ints"):
        g.permute(x, axes=(1.0, 0))
    with pytest.raises(GraphError, match=r"permute axes \['a', 1\] must hold non-negative ints"):
        g.permute(x, axes=("a", 1))
    assert g.reshape(x, shape=(np.int64(112),)).shape == (112,)  # numpy ints are ints
    bad = Node("reshape", "f32", (-7, -16), (x,), Params({"shape": (-7, -16)}))
    with pytest.raises(GraphError, match=r"node %1 reshape \[-7, -16\].*must hold non-negative ints"):
        verify(Graph({"y": bad}))


def test_builder_raw_python_errors_are_graph_errors():
    """Each of these was a raw exception from inside the builder or a shape rule: numpy's ValueError for a ragged
    const, "'int' object is not iterable" for an int shape, IndexError for rows of a 0-d tensor and set_rows of a
    0-d src, ZeroDivisionError for attention or a delta rule with 0 kv heads."""
    with pytest.raises(GraphError, match=r"const: value \[\[1, 2\], \[3\]\] is not a rectangular array of f32"):
        g.const([[1, 2], [3]])
    with pytest.raises(GraphError, match=r"const 'c': value \['a'\] is not a rectangular array of f32"):
        g.const(["a"], name="c")
    with pytest.raises(GraphError, match=r"const: value \[nan\] is not a rectangular array of i32"):
        g.const([float("nan")], "i32")
    with pytest.raises(GraphError, match=r"input 'x': shape must be a tuple of ints, got 5"):
        g.input("x", 5)
    with pytest.raises(GraphError, match=r"rows\(input 's' \[\] f32\): a 0-d tensor has no rows"):
        g.rows(g.input("s", ()), 0, 1)
    with pytest.raises(GraphError, match=r"set_rows.*src must have a row axis, got a 0-d tensor"):
        g.set_rows(g.state("c", (8, 4)), g.input("r", ()), g.input("i", (2,), "i32"))
    with pytest.raises(GraphError, match=r"q heads 2 must be a multiple of kv heads 0"):
        g.flash_attn(g.input("q", (1, 2, 8)), g.input("k", (4, 0, 8)), g.input("v", (4, 0, 8)),
                     g.input("p", (1,), "i32"), g.input("n", (1,), "i32"), scale=1.0)
    with pytest.raises(GraphError, match=r"v heads 2 must be a multiple of k heads 0"):
        g.gated_delta_net(g.input("q", (2, 0, 4)), g.input("k", (2, 0, 4)), g.input("v", (2, 2, 4)),
                          g.input("g", (2, 2)), g.input("b", (2, 2)), g.state("s", (2, 4, 4)), scale=1.0)


def test_index_picking_ops_need_values_to_pick_from():
    """argmax and sample over an empty last axis built, then failed at run time with numpy's 'attempt to get argmax
    of an empty sequence' (reference) or 'cannot reshape array of size 0 into shape (0)'."""
    x = g.input("x", (2, 0))
    with pytest.raises(GraphError, match=r"argmax\(input 'x'.*x \[2, 0\] has no values along its last axis"):
        g.argmax(x)
    with pytest.raises(GraphError, match=r"sample\(input 'x'.*logits \[2, 0\] has no values along its last axis"):
        g.sample(x, g.input("s", (2, 4)))
    assert g.argmax(g.input("y", (0, 3))).shape == (0,)  # no rows is fine: nothing to pick
