"""Graph dumps: FileCheck-style text goldens, DOT structure, JSON round trips, the HTML page."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from graphir.models import llama
from graphir.models.presets import PRESETS

from graphir import GraphError, g, verify
from graphir.dump import (
    diff_graphs,
    dump,
    dump_dot,
    dump_html,
    dump_json,
    dump_text,
    fold_layers,
    load_json,
    node_layers,
    parse_layers,
)
from graphir.examples import build_example
from graphir.ir import Graph


def check_in_order(text: str, expected: list[str]) -> None:
    """FileCheck's CHECK lines: each expected substring appears after the previous one."""
    pos = 0
    for want in expected:
        i = text.find(want, pos)
        assert i >= 0, f"not found after offset {pos}: {want!r}\n--- dump ---\n{text}"
        pos = i + len(want)


def llama_graph(n_layers: int = 4, phase: str = "decode", eps: float = 1e-5) -> Graph:
    """llama-tiny's graph with more layers; like every llama graph its rms_norm nodes are unnamed."""
    config = dataclasses.replace(PRESETS["llama-tiny"][0], n_layers=n_layers, rms_eps=eps)
    return llama.build(config, phase)


def multi_output_graph() -> Graph:
    """ssm_conv returns (y, new_state); the new state is written back through an update."""
    x = g.input("x", (5, 8))
    conv_state = g.state("blk.0.conv_state", (3, 8))
    r = g.ssm_conv(x, conv_state, g.param("blk.0.conv.weight", (8, 4)), name="blk.0.conv")
    y = g.item(r, index=0, name="blk.0.conv_y")
    write = g.assign(conv_state, g.item(r, index=1), name="blk.0.conv_state_write")
    return verify(Graph({"y": y}, [write], meta={"model": "conv-test"}))


# ---------------------------------------------------------------- text
def test_text_golden_example() -> None:
    text = dump_text(build_example("prefill"))
    check_in_order(text, [
        '# graph model="example" n_layers=2 phase="prefill": 79 nodes (4 input, 21 param, 4 state); signature ',
        '= input [7] i32 "tokens"',
        '= get_rows(%1, %2) [7, 64] f32 "inp_embd"',
        '%6 = rms_norm(%3) [7, 64] f32 {eps=1e-05} "blk.0.attn_norm"',
        '%9 = mul_mat(%5, %8) [7, 64] f32 "blk.0.attn_q"',
        "%10 = reshape(%9) [7, 4, 16] f32 {shape=[7, 4, 16]}\n",
        '= rope(%10, %11) [7, 4, 16] f32 {freq_scale=1.0, mode="neox", n_dims=16, theta=10000.0} "blk.0.attn_q_rope"',
        '= state [128, 2, 16] f16 "blk.0.cache_k"',
        '= set_rows(%13, %17, %18) [128, 2, 16] f16 "blk.0.cache_k_write" ; writes "blk.0.cache_k" in place',
        '= flash_attn(%12, %19, %24, %11, %25) [7, 4, 16] f32 {scale=0.25, window=0} "blk.0.attn"',
        '= swiglu_split(%35, %37) [7, 128] f32 "blk.0.ffn_swiglu"',
        '"blk.1.attn_norm"',
        '%78 = mul_mat(%0, %77) [7, 256] f32 "result_output"',
        'output "logits" = %78',
    ])
    assert text.count("\n") == 1 + 79 + 1  # header, one line per node, one output


def test_text_is_deterministic() -> None:
    assert dump_text(build_example("decode")) == dump_text(build_example("decode"))
    assert "[1] i32" in dump_text(build_example("decode"))


def test_text_multi_output_and_updates() -> None:
    text = dump_text(multi_output_graph())
    check_in_order(text, [
        '= ssm_conv(%0, %1, %2) ([5, 8] f32, [3, 8] f32) "blk.0.conv"',
        '= item(%3) [5, 8] f32 {index=0} "blk.0.conv_y"',
        '= assign(%1, %5) [3, 8] f32 "blk.0.conv_state_write" ; writes "blk.0.conv_state" in place',
        'output "y" = %4',
        "update %6",
    ])


def test_long_const_values_are_elided() -> None:
    c = g.const(np.arange(20, dtype=np.float32), name="table")
    text = dump_text(Graph({"y": g.add(g.input("x", (20,)), c)}))
    assert '= const [20] f32 {value=[0.0, 1.0, 2.0, 3.0, ... (20 values)]} "table"' in text
    short = dump_text(Graph({"y": g.add(g.input("x", (2,)), g.const([1.5, 2.5]))}))
    assert "{value=[1.5, 2.5]}" in short


# ---------------------------------------------------------------- layers
def test_parse_layers() -> None:
    assert parse_layers("0..1") == {0, 1}
    assert parse_layers("3") == {3}
    assert parse_layers("0,2,5") == {0, 2, 5}
    assert parse_layers("0..2, 7") == {0, 1, 2, 7}
    assert parse_layers("all") is None and parse_layers(None) is None
    for bad in ("x", "1..", "3..1", "", "1;2"):
        with pytest.raises(ValueError, match="bad layer spec"):
            parse_layers(bad)
    # a typo's huge range is refused at once (0..100000000000 built a set of 1e11 ints: minutes, then out of memory)
    assert parse_layers("9999") == {9999}
    for bad in ("0..100000000000", "10000"):
        with pytest.raises(ValueError, match="layer numbers stop at 9999"):
            parse_layers(bad)


def test_unnamed_nodes_take_their_sources_layer() -> None:
    graph = build_example("prefill")
    of = node_layers(graph)
    reshapes = [of[id(n)] for n in graph if n.op == "reshape"]
    assert reshapes == [0, 0, 0, 0, 1, 1, 1, 1]
    assert of[id(graph.outputs["logits"])] is None  # the head is outside every layer
    assert {of[id(n)] for n in graph.inputs} == {None}


def test_layer_folding_counts() -> None:
    graph = build_example("prefill")
    # per layer: 9 weights, 2 caches, 19 named ops, 4 unnamed reshapes
    kept, note = fold_layers(graph, {0})
    assert len(kept) == len(graph) - 34
    assert note == "folded 34 nodes of layer 1; showing layers 0"
    assert fold_layers(graph, {0, 1}) == (graph.nodes(), None)
    assert fold_layers(graph, None) == (graph.nodes(), None)
    text = dump_text(graph, {1})
    assert "# folded 34 nodes of layer 0; showing layers 1\n" in text
    assert '"blk.0.' not in text and '"blk.1.attn_q"' in text and '"output_norm"' in text


def reference_layers(graph: Graph) -> list[int | None]:
    """Per node (topological position): blk.N from its name, or for an unnamed node the layer of the
    first named node down its users (in llama graphs that chain is unique)."""
    users = graph.users()
    out: list[int | None] = []
    for n in graph.nodes():
        while n.name is None:
            n = users[id(n)][0]
        m = re.match(r"blk\.(\d+)\.", n.name)
        out.append(int(m[1]) if m else None)
    return out


def check_folded_text(graph: Graph, layers: set[int], text: str) -> None:
    """Shown nodes are exactly those of `layers` or outside every layer; every reference to a hidden
    node says it is folded and in which layer; the fold lines count every hidden node."""
    ref = reference_layers(graph)
    shown = {int(i) for i in re.findall(r"^%(\d+) = ", text, re.M)}
    for i in range(len(graph)):
        assert (i in shown) == (ref[i] is None or ref[i] in layers), (i, ref[i], graph.nodes()[i].describe())
    for m in re.finditer(r"(?<!^)%(\d+)( \(folded, blk\.(\d+)\))?", text, re.M):
        i = int(m[1])
        if i not in shown:
            assert m[2] and int(m[3]) == ref[i], f"%{i} (blk.{ref[i]}) is hidden: {text[m.start():m.end() + 20]!r}"
    folded = [int(k) for k in re.findall(r"^# \.\.\. .*: (\d+) nodes folded", text, re.M)]
    assert sum(folded) == len(graph) - len(shown)


@pytest.mark.parametrize("layers", [{0, 1}, {1}, {0, 3}, {2}])
def test_folding_follows_layer_names(layers: set[int]) -> None:
    graph = llama_graph(4)
    check_folded_text(graph, layers, dump_text(graph, layers))


def test_fold_line_sits_where_layers_were() -> None:
    graph = llama_graph(4)
    ref = reference_layers(graph)
    n_hidden = sum(1 for r in ref if r in (2, 3))
    text = dump_text(graph, {0, 1})
    assert len(re.findall(r"^# \.\.\. ", text, re.M)) == 1
    check_in_order(text, ['"blk.1.out"', f"\n# ... blk.2 .. blk.3: {n_hidden} nodes folded\n", "= rms_norm(",
                          '"output_norm"', 'output "logits"'])
    assert re.search(r"^%\d+ = rms_norm\(%\d+ \(folded, blk\.3\)\)", text, re.M)  # the head's norm reads blk.3
    middle = dump_text(graph, {0, 3})
    check_in_order(middle, ['"blk.0.out"', "\n# ... blk.1 .. blk.2: ", '"blk.3.attn_norm"'])
    check_in_order(middle, ["= rms_norm(%", " (folded, blk.2)) ", '"blk.3.attn_norm"'])


def test_folded_smollm2_decode() -> None:
    """The reported case: `graphir dump smollm2-135m --phase decode --layers 0..1`."""
    graph = smollm2_graph()
    text = dump_text(graph, {0, 1})
    check_folded_text(graph, {0, 1}, text)
    n_hidden = sum(1 for r in reference_layers(graph) if r is not None and r >= 2)
    check_in_order(text, ['"blk.1.out"', f"# ... blk.2 .. blk.29: {n_hidden} nodes folded\n", '"output_norm"'])
    with pytest.raises(GraphError, match=r"30 layers"):
        dump_text(graph, {99})


def smollm2_graph(phase: str = "decode") -> Graph:
    import graphir

    try:
        return graphir.load("smollm2-135m").graph(phase)
    except graphir.LoadError as e:
        pytest.skip(str(e))


def test_folded_updates_and_outputs_are_accounted() -> None:
    import graphir

    graph = graphir.load("random:qwen35-tiny").graph("decode")  # recurrent layers: State updates
    text = dump_text(graph, {1})
    shown = {int(i) for i in re.findall(r"^%(\d+) = ", text, re.M)}
    updates = [int(i) for i in re.findall(r"^update %(\d+)$", text, re.M)]
    assert updates and set(updates) <= shown
    assert f"# ... {len(graph.updates) - len(updates)} state updates in folded layers" in text


def test_out_of_range_layers_are_an_error() -> None:
    graph = llama_graph(4)
    for bad in ({99}, {3, 4}):
        for render in (dump_text, dump_dot, dump_html):
            with pytest.raises(GraphError, match=r"4 layers \(blk\.0 \.\. blk\.3\)"):
                render(graph, bad)
    with pytest.raises(GraphError, match="no blk.N layers"):
        dump_text(Graph({"y": g.silu(g.input("x", (2,)))}), {0})


# ---------------------------------------------------------------- numbers
def float32_graph() -> Graph:
    x = g.input("x", (2, 4))
    y = g.rms_norm(x, eps=float(np.float32(1e-5)), name="norm")
    y = g.scale(y, s=float(np.float32(0.1)), b=float(np.float32(1 / 3)), name="scaled")
    return Graph({"y": g.add(y, g.const(np.array([0.1, 2.5, 1e-7, 3e38], np.float32), name="c"))})


def test_float_params_print_their_float32_shortest_repr() -> None:
    graph = float32_graph()
    text = dump_text(graph)
    check_in_order(text, ['rms_norm(%0) [2, 4] f32 {eps=1e-05} "norm"', "{b=0.33333334, s=0.1}",
                          "{value=[0.1, 2.5, 1e-07, 3e+38]}"])
    dot = dump_dot(graph)
    assert "eps=1e-05" in dot and "b=0.33333334, s=0.1" in dot
    view = embedded(dump_html(graph), "graph-view")
    assert view["params"][1] == {"eps": "1e-05"} and view["params"][2] == {"b": "0.33333334", "s": "0.1"}
    # JSON is the lossless format: it keeps the exact value, so the graph (and its signature) round-trips.
    assert json.loads(dump_json(graph))["nodes"][1]["params"]["eps"] == float(np.float32(1e-5))


def test_float_repr_is_shortest_and_round_trips() -> None:
    from graphir.dump import format_value

    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(200), 10.0 ** rng.uniform(-40, 38, 200)]).astype(np.float32)
    for v in values:
        text = format_value(float(v))
        assert np.float32(float(text)) == v, (v, text)
        assert float(text) == float(np.format_float_scientific(v, unique=True)), (v, text)  # numpy's shortest
    assert format_value(float("inf")) == "inf" and format_value(-1e300) == "-1e+300"  # outside f32: as a double
    assert format_value(1e-5) == "1e-05" and format_value(0.1) == "0.1" and format_value(2.0) == "2.0"


# ---------------------------------------------------------------- dot
def check_dot(text: str) -> set[str]:
    """Structural DOT check without graphviz: balanced braces, every edge endpoint declared."""
    depth = 0
    for line in text.splitlines():
        unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', '""', line)
        depth += unquoted.count("{") - unquoted.count("}")
        assert depth >= 0, line
    assert depth == 0
    assert text.startswith("digraph graphir {")
    declared = set(re.findall(r"^\s*(\w+) \[label=", text, re.M))
    edges = re.findall(r"^\s*(\w+) -> (\w+);$", text, re.M)
    assert edges
    for a, b in edges:
        assert a in declared and b in declared, (a, b)
    assert len(edges) == len(set(edges)), "duplicate edges"
    return declared


def test_dot_structure() -> None:
    graph = build_example("prefill")
    text = dump_dot(graph)
    declared = check_dot(text)
    assert len(declared) == len(graph) + 1  # every node plus the output
    assert "subgraph cluster_blk0 {" in text and "subgraph cluster_blk1 {" in text
    assert 'n13 [label="%13 state\\n[128, 2, 16] f16\\nblk.0.cache_k", shape=cylinder' in text
    assert "n2 [label=\"%2 input" in text and "shape=invhouse" in text
    assert "n78 -> out0;" in text


def test_dot_folded_and_multi_output() -> None:
    folded = dump_dot(build_example("prefill"), {0})
    declared = check_dot(folded)
    assert "folded0" in declared and "cluster_blk1" not in folded
    assert "folded0 -> n75;" in folded  # the head reads the folded layer's residual
    text = dump_dot(multi_output_graph())
    check_dot(text)
    assert "upd0" in text and "([5, 8] f32, [3, 8] f32)" in text


def dot_clusters(text: str) -> dict[int, int | None]:
    """Node id -> the blk cluster its declaration sits in (None: outside every cluster)."""
    out: dict[int, int | None] = {}
    cluster = None
    for line in text.splitlines():
        if m := re.match(r"\s*subgraph cluster_blk(\d+) \{", line):
            cluster = int(m[1])
        elif line.strip() == "}":
            cluster = None
        elif m := re.match(r"\s*n(\d+) \[label=", line):
            out[int(m[1])] = cluster
    return out


@pytest.mark.parametrize("layers", [None, {0, 1}, {2}])
def test_dot_boxes_hold_exactly_their_layers(layers: set[int] | None) -> None:
    graph = llama_graph(4)
    ref = reference_layers(graph)
    text = dump_dot(graph, layers)
    check_dot(text)
    where = dot_clusters(text)
    expected = {i: r for i, r in enumerate(ref) if layers is None or r is None or r in layers}
    assert where == expected


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz not installed")
def test_dot_renders_with_graphviz(tmp_path: Path) -> None:
    for text in (dump_dot(build_example()), dump_dot(build_example(), {1}), dump_dot(multi_output_graph())):
        r = subprocess.run(["dot", "-Tsvg"], input=text, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "<svg" in r.stdout


# ---------------------------------------------------------------- json
@pytest.mark.parametrize("make", [lambda: build_example("prefill"), lambda: build_example("decode"),
                                  multi_output_graph])
def test_json_round_trip(make) -> None:
    graph = make()
    text = dump_json(graph)
    assert json.loads(text) == json.loads(json.dumps(graph.to_records()))
    back = load_json(text)
    assert back == graph
    assert dump_text(back) == dump_text(graph)
    assert verify(back) is back
    assert load_json(json.dumps(graph.to_records())) == graph


def test_load_json_errors() -> None:
    with pytest.raises(GraphError, match="not valid JSON"):
        load_json("{nope")
    with pytest.raises(GraphError, match="not a graphir graph record"):
        load_json('{"nodes": [{"id": 0}]}')


# ---------------------------------------------------------------- html
def embedded(html: str, block: str):
    m = re.search(rf'<script type="application/json" id="{block}">(.*?)</script>', html, re.S)
    assert m, block
    return json.loads(m.group(1))


def test_html_is_self_contained_and_round_trips() -> None:
    graph = build_example("prefill")
    html = dump_html(graph)
    assert "http://" not in html and "https://" not in html
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)  # nothing loaded from elsewhere
    assert "__GRAPH_JSON__" not in html and "__VIEW_JSON__" not in html
    assert Graph.from_records(embedded(html, "graph-json")) == graph
    view = embedded(html, "graph-view")
    assert len(view["layers"]) == len(graph) and view["open"] is None
    assert view["docs"]["rms_norm"].startswith("x / sqrt")
    assert embedded(dump_html(graph, {1}), "graph-view")["open"] == [1]


def test_html_escapes_names_that_close_script() -> None:
    x = g.input("</script><b>", (2,))
    graph = Graph({"y": g.silu(x, name="a&b")})
    html = dump(graph, "html")
    assert html.count("</script>") == 3  # the two JSON blocks and the code, nothing from names
    assert Graph.from_records(embedded(html, "graph-json")) == graph


# A few lines of DOM, enough to run the page's script under node and click through it.
DOM_SHIM = r"""
const fs = require("fs");
const html = fs.readFileSync(process.argv[2], "utf8");
const all = [];
class El {
  constructor(tag) { this.tagName = tag; this.children = []; this.listeners = {}; this.dataset = {};
    this._cls = new Set(); this.textContent = ""; this.value = ""; this.open = false; all.push(this);
    const s = this;
    this.classList = { add: c => s._cls.add(c), remove: c => s._cls.delete(c), contains: c => s._cls.has(c),
      toggle: (c, on) => { if (on === undefined) on = !s._cls.has(c); if (on) s._cls.add(c); else s._cls.delete(c); } };
  }
  set className(v) { this._cls = new Set(v.split(/\s+/).filter(Boolean)); }
  get className() { return [...this._cls].join(" "); }
  appendChild(c) { this.children.push(c); return c; }
  replaceChildren() { this.children = []; }
  addEventListener(t, f) { (this.listeners[t] = this.listeners[t] || []).push(f); }
  fire(t) { (this.listeners[t] || []).forEach(f => f({ preventDefault() {}, key: "" })); }
  scrollIntoView() {}
  focus() {}
  text() { return this.textContent + this.children.map(c => c.text()).join(""); }
}
const byId = {};
for (const m of html.matchAll(/<(\w+)[^>]*\sid="([^"]+)"[^>]*>/g)) byId[m[2]] = new El(m[1]);
for (const m of html.matchAll(/<script type="application\/json" id="([^"]+)">([\s\S]*?)<\/script>/g))
  byId[m[1]].textContent = m[2];
global.document = { getElementById: id => byId[id], createElement: t => new El(t), activeElement: {},
  addEventListener() {},
  querySelectorAll: sel => all.filter(e => sel.split(".").filter(Boolean).every(c => e._cls.has(c))) };
global.history = { replaceState() {} };
global.location = { hash: "" };
eval(html.match(/<script>([\s\S]*?)<\/script>/)[1]);
const out = { count: byId["count"].textContent, rows: all.filter(e => e._cls.has("row")).length };
out.groups = all.filter(e => e.tagName === "details").map(d => [d.children[0].textContent, d.open]);
byId["search"].value = "attn_q";
byId["search"].fire("input");
out.filtered = byId["count"].textContent;
all.find(e => e._cls.has("row") && !e._cls.has("hidden") && e.text().includes("mul_mat")).fire("click");
out.detail = byId["detail"].text();
console.log(JSON.stringify(out));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed")
def test_html_script_runs(tmp_path: Path) -> None:
    page, shim = tmp_path / "graph.html", tmp_path / "shim.js"
    page.write_text(dump_html(build_example("prefill"), {0}))
    shim.write_text(DOM_SHIM)
    r = subprocess.run(["node", str(shim), str(page)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["count"] == "79 / 79 nodes" and out["rows"] == 79
    assert out["groups"] == [["inputs, weights and states outside the layers ", True], ["before the layers ", True],
                             ["blk.0 ", True], ["blk.1 ", False], ["after the layers ", True]]
    assert out["filtered"] == "6 / 79 nodes"  # weight, matmul and rope of attn_q, in 2 layers
    check_in_order(out["detail"], ["%9 = mul_mat", "blk.0.attn_q", "sources (2)", "%5 param", "%8 mul",
                                   "users (1)", "%10 reshape"])


# ---------------------------------------------------------------- diff and dispatch
def test_diff_graphs() -> None:
    before = build_example("decode")
    logits = before.outputs["logits"]
    after = Graph({"logits": g.scale(g.silu(logits), s=2.0)})
    text = diff_graphs(before, after)  # the structural diff of graphir/diff.py: tests/test_diff.py
    check_in_order(text, ["# before: 79 nodes, after: 81 nodes\n", "# net ops added: 1 scale, 1 silu\n",
                          "# 0 removed, 2 new, 0 rewired, 79 unchanged;", "## outside the layers: 0 removed, 2 new",
                          "+%79 = silu(%78)", "+%80 = scale(%79)"])
    assert "# op counts unchanged" in diff_graphs(before, build_example("decode"))


def test_dump_dispatch() -> None:
    graph = build_example("decode")
    assert dump(graph, "text") == dump_text(graph)
    assert dump(graph, "json") == dump_json(graph)
    assert dump(graph, "dot", {0}) == dump_dot(graph, {0})
    assert dump(graph, "html").startswith("<!DOCTYPE html>")
    with pytest.raises(ValueError, match="unknown dump format"):
        dump(graph, "svg")
