"""Structural diffs: a node a pass kept is the same node whatever its new id; only what changed is listed."""

from __future__ import annotations

import re

import pytest
from test_dump import llama_graph, smollm2_graph

from graphir import GraphError, g
from graphir.diff import match_nodes
from graphir.dump import diff_graphs
from graphir.ir import Graph, Node
from graphir.passes import run_pipeline
from graphir.passes.rewrite import Rewriter, rewrite


def by_name(graph: Graph, name: str) -> Node:
    (node,) = [n for n in graph if n.name == name]
    return node


def diff_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:1] in "-+~"]


def summary(text: str) -> dict[str, int]:
    m = re.search(r"^# (\d+) removed, (\d+) new, (\d+) rewired, (\d+) unchanged;", text, re.M)
    assert m, text
    return dict(zip(("removed", "new", "rewired", "unchanged"), map(int, m.groups()), strict=True))


def fuse_one_swiglu(graph: Graph, name: str) -> Graph:
    """mul(silu(a), b) -> swiglu_split(a, b) at the one node called `name`."""
    def match(n: Node, rw: Rewriter) -> Node | None:
        return n if n.name == name else None

    def fuse(n: Node, rw: Rewriter) -> Node:
        silu, up = n.src
        return g.swiglu_split(rw.new(silu.src[0]), rw.new(up), name=n.name)

    return rewrite(graph, [(match, fuse)])


def test_one_fused_site_is_one_small_diff() -> None:
    before = llama_graph(4)
    after = fuse_one_swiglu(before, "blk.1.ffn_act")
    ids_b, ids_a = before.ids(), after.ids()
    assert ids_a[id(by_name(after, "blk.3.out"))] != ids_b[id(by_name(before, "blk.3.out"))]  # everything after moved
    act_b, act_a = by_name(before, "blk.1.ffn_act"), by_name(after, "blk.1.ffn_act")
    down_a = by_name(after, "blk.1.ffn_out")
    silu, up = act_b.src
    text = diff_graphs(before, after)
    assert summary(text) == {"removed": 2, "new": 1, "rewired": 1, "unchanged": len(after) - 2}
    assert re.findall(r"^## .*$", text, re.M) == ["## blk.1: 2 removed, 1 new, 1 rewired"]
    assert diff_lines(text) == [
        f"-%{ids_b[id(silu)]} = silu(%{ids_b[id(silu.src[0])]}) [1, 96] f32",
        f'-%{ids_b[id(act_b)]} = mul(%{ids_b[id(silu)]}, %{ids_b[id(up)]}) [1, 96] f32 "blk.1.ffn_act"',
        f'+%{ids_a[id(act_a)]} = swiglu_split(%{ids_a[id(act_a.src[0])]}, %{ids_a[id(act_a.src[1])]}) [1, 96] f32 '
        '"blk.1.ffn_act"',
        f'~%{ids_a[id(down_a)]} = mul_mat(%{ids_a[id(down_a.src[0])]}, %{ids_a[id(act_a)]}) [1, 64] f32 '
        f'"blk.1.ffn_out" ; was %{ids_b[id(by_name(before, "blk.1.ffn_out"))]} = '
        f'mul_mat(%{ids_b[id(by_name(before, "blk.1.ffn_down.weight"))]}, %{ids_b[id(act_b)]})',
    ]


def test_renumbering_alone_is_no_change() -> None:
    graph = llama_graph(2)
    mid = by_name(graph, "blk.0.out")
    before = Graph({"logits": graph.outputs["logits"], "h": mid})
    after = Graph({"h": mid, "logits": graph.outputs["logits"]})  # other root order: other ids
    assert before.ids()[id(mid)] != after.ids()[id(mid)]
    text = diff_graphs(before, after)
    assert summary(text) == {"removed": 0, "new": 0, "rewired": 0, "unchanged": len(before)}
    assert "# op counts unchanged" in text and not diff_lines(text)
    copy = Graph.from_records(after.to_records())  # equal, but not one Node object in common
    assert summary(diff_graphs(before, copy)) == {"removed": 0, "new": 0, "rewired": 0, "unchanged": len(before)}


def test_changed_params_are_a_rewired_node() -> None:
    x = g.input("x", (2, 4))
    before = Graph({"y": g.scale(g.silu(x), s=2.0, name="s")})
    after = Graph({"y": g.scale(g.silu(x), s=3.0, name="s")})
    assert diff_lines(diff_graphs(before, after)) == ["~%2 = scale(%1) [2, 4] f32 {b=0.0, s=3.0} \"s\" ; was %2 = "
                                                       "scale(%1) {b=0.0, s=2.0}"]


def test_default_pipeline_keeps_named_nodes_matched() -> None:
    before = llama_graph(4)
    after = run_pipeline(before, "default")
    m = match_nodes(before, after)
    removed = {(n.op, n.name) for n in m.removed if n.name is not None}
    new = {(n.op, n.name) for n in m.new if n.name is not None}
    assert not removed & new, "a node the pass kept is listed as removed and re-added"
    text = diff_graphs(before, after)
    s = summary(text)
    assert s["removed"] + s["rewired"] + s["unchanged"] == len(before)
    assert s["new"] + s["rewired"] + s["unchanged"] == len(after)
    # every layer is built alike, so layers 1 and 2 (neither touches the head) change alike
    h1, h2 = (re.search(rf"^## blk\.{i}: (.*)$", text, re.M)[1] for i in (1, 2))
    assert h1 == h2


def test_layers_fold_the_diff() -> None:
    before = llama_graph(4)
    after = run_pipeline(before, "default")
    whole, one = diff_graphs(before, after), diff_graphs(before, after, {1})
    assert re.findall(r"^## blk\.\d+", one, re.M) == ["## blk.1"]
    folded = int(re.search(r"^# \.\.\. blk\.0, blk\.2 \.\. blk\.3: (\d+) changed nodes folded$", one, re.M)[1])
    assert len(diff_lines(whole)) == len(diff_lines(one)) + folded
    with pytest.raises(GraphError, match=r"4 layers \(blk\.0 \.\. blk\.3\)"):
        diff_graphs(before, after, {4})


def test_smollm2_default_diff_of_one_layer_fits_a_screen() -> None:
    before = smollm2_graph()
    after = run_pipeline(before, "default")
    text = diff_graphs(before, after, {0})
    assert len(text.splitlines()) <= 60, text
    assert re.findall(r"^## .*?:", text, re.M) == ["## blk.0:", "## outside the layers:"]
    assert '"blk.0.attn"' in text and '"blk.1.' not in text
    with pytest.raises(GraphError, match="30 layers"):
        diff_graphs(before, after, {99})
