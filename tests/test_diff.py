"""Structural diffs: a node a pass kept is the same node whatever its new id; only what changed is listed."""

from __future__ import annotations

import re
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_dump import llama_graph, smollm2_graph

from graphir import GraphError, g
from graphir.cli import main
from graphir.diff import diff_html, match_nodes
from graphir.dump import diff_graphs, format_node
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


# ---------------------------------------------------------------- html: side by side
Cell = tuple[str, str]  # (class, text): ("empty", "") where a side has no node


class DiffPage(HTMLParser):
    """A diff_html page read back: per <h2> heading, its table rows as (before cell, after cell), and the
    folded line. Entities are decoded (convert_charrefs), so cell texts compare to format_node's lines."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.sections: dict[str, list[tuple[Cell, Cell]]] = {}
        self.folded: list[str] = []
        self._row: list[list[str]] | None = None
        self._text: list[str] | None = None
        self._heading = ""
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr":
            self._row = []
        elif tag == "td":
            self._row.append([dict(attrs)["class"], ""])
        elif tag in ("h2", "p"):
            self._text = [] if tag == "h2" or dict(attrs).get("class") == "folded" else None

    def handle_data(self, data: str) -> None:
        if self._row:
            self._row[-1][1] += data
        elif self._text is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr" and self._row:
            before, after = (tuple(c) for c in self._row)
            self.sections[self._heading].append((before, after))
        if tag == "tr":
            self._row = None
        elif tag == "h2":
            self._heading = "".join(self._text).split(":")[0]
            self.sections[self._heading] = []
        elif tag == "p" and self._text is not None:
            self.folded.append("".join(self._text))
        if tag in ("h2", "p"):
            self._text = None


def without_ids(line: str) -> str:
    return re.sub(r"%\d+", "%", line)


def test_html_one_fusion_lands_in_the_right_cells() -> None:
    before = llama_graph(4)
    after = fuse_one_swiglu(before, "blk.1.ffn_act")
    ids_b, ids_a = before.ids(), after.ids()
    page = DiffPage(diff_html(before, after))
    assert list(page.sections) == ["blk.0", "blk.1", "blk.2", "blk.3", "outside the layers"] and not page.folded
    rows = [row for section in page.sections.values() for row in section]
    # every node shows once, on its side, as `graphir dump` prints it
    assert Counter(b[1] for b, _ in rows if b[0] != "empty") == Counter(format_node(n, ids_b) for n in before)
    assert Counter(a[1] for _, a in rows if a[0] != "empty") == Counter(format_node(n, ids_a) for n in after)
    act_b, act_a = by_name(before, "blk.1.ffn_act"), by_name(after, "blk.1.ffn_act")
    down_b, down_a = by_name(before, "blk.1.ffn_out"), by_name(after, "blk.1.ffn_out")
    silu = act_b.src[0]
    changed = [row for row in page.sections["blk.1"] if row[0][0] != "unchanged"]
    assert sorted(changed) == sorted([
        (("removed", format_node(silu, ids_b)), ("empty", "")),
        (("removed", format_node(act_b, ids_b)), ("empty", "")),
        (("empty", ""), ("new", format_node(act_a, ids_a))),
        (("rewired", format_node(down_b, ids_b)), ("rewired", format_node(down_a, ids_a))),
    ])
    for name, section in page.sections.items():
        if name != "blk.1":
            assert {(b[0], a[0]) for b, a in section} == {("unchanged", "unchanged")}, name


def test_html_kept_nodes_sit_beside_their_before_nodes() -> None:
    before = llama_graph(4)
    after = fuse_one_swiglu(before, "blk.1.ffn_act")
    ids_b, ids_a = before.ids(), after.ids()
    page = DiffPage(diff_html(before, after))
    kept = [(b[1], a[1]) for section in page.sections.values() for b, a in section if b[0] == "unchanged"]
    assert len(kept) == len(after) - 2
    assert all(without_ids(b) == without_ids(a) for b, a in kept)  # the same node, renumbered
    out_b, out_a = by_name(before, "blk.3.out"), by_name(after, "blk.3.out")
    assert ids_b[id(out_b)] != ids_a[id(out_a)]
    assert (format_node(out_b, ids_b), format_node(out_a, ids_a)) in kept
    for section in page.sections.values():  # the right column reads in after's order
        right = [int(a[1][1:a[1].index(" ")]) for _, a in section if a[0] != "empty"]
        assert right == sorted(right)


def test_html_layers_fold() -> None:
    before = llama_graph(4)
    after = run_pipeline(before, "default")
    page = DiffPage(diff_html(before, after, {1}))
    assert list(page.sections) == ["blk.1", "outside the layers"]
    (line,) = page.folded
    m = re.fullmatch(r"\.\.\. blk\.0, blk\.2 \.\. blk\.3: (\d+) nodes before, (\d+) after folded "
                     r"\((\d+) removed, (\d+) new, (\d+) rewired\)", line)
    assert m, line
    shown = [row for section in page.sections.values() for row in section]
    assert int(m[1]) + sum(b[0] != "empty" for b, _ in shown) == len(before)
    assert int(m[2]) + sum(a[0] != "empty" for _, a in shown) == len(after)
    whole = DiffPage(diff_html(before, after))
    assert whole.sections["blk.1"] == page.sections["blk.1"]
    hidden = [row for k in ("blk.0", "blk.2", "blk.3") for row in whole.sections[k]]
    assert [int(m[i]) for i in (3, 4, 5)] == [sum(b[0] == "removed" for b, _ in hidden),
                                               sum(a[0] == "new" for _, a in hidden),
                                               sum(b[0] == "rewired" for b, _ in hidden)]
    with pytest.raises(GraphError, match=r"4 layers \(blk\.0 \.\. blk\.3\)"):
        diff_html(before, after, {4})


def test_html_escapes_names() -> None:
    x = g.input("x<i>&\"", (2, 4))
    before = Graph({"y": g.scale(g.silu(x), s=2.0, name="</td><b>s</b>")})
    after = Graph({"y": g.scale(g.silu(x), s=3.0, name="</td><b>s</b>")})
    text = diff_html(before, after)
    assert "<b>" not in text and "<i>" not in text and "</td><b>" not in text
    page = DiffPage(text)
    (row,) = [row for row in page.sections["outside the layers"] if row[0][0] != "unchanged"]
    y_b, y_a = before.outputs["y"], after.outputs["y"]
    assert row == (("rewired", format_node(y_b, before.ids())), ("rewired", format_node(y_a, after.ids())))
    assert ("unchanged", format_node(x, before.ids())) in [b for b, _ in page.sections["outside the layers"]]


def test_cli_diff_writes_the_html_page(tmp_path: Path) -> None:
    out = tmp_path / "x.html"
    r = CliRunner().invoke(main, ["dump", "example", "--passes", "default", "--diff", "-o", str(out)])
    assert r.exit_code == 0, r.output
    page = DiffPage(out.read_text(encoding="utf-8"))
    assert list(page.sections) == ["blk.0", "blk.1", "outside the layers"]
    statuses = {b[0] for section in page.sections.values() for b, _ in section}
    assert {"removed", "rewired", "unchanged"} <= statuses
    r = CliRunner().invoke(main, ["dump", "example", "--passes", "default", "--diff", "--format", "html",
                                  "--layers", "1"])
    assert r.exit_code == 0 and list(DiffPage(r.stdout).sections) == ["blk.1", "outside the layers"]
    txt = tmp_path / "x.txt"
    assert CliRunner().invoke(main, ["dump", "example", "--passes", "default", "--diff", "-o", str(txt)]).exit_code == 0
    assert txt.read_text(encoding="utf-8").startswith("# before: ")  # any other name keeps the text diff
    r = CliRunner().invoke(main, ["dump", "example", "--passes", "default", "--diff", "--format", "dot"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "--diff writes text or html" in r.stderr
