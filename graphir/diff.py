"""What a pass pipeline changed: a structural diff of the graph before and after it.

Nodes are matched from the leaves up, so a node the pipeline kept is the same node whatever its
new %N (ids are topological positions: one fused node renumbers everything after it):
  - named inputs, params and states match by op and name;
  - any other node matches a before node with the same op, type, params, name and matched sources;
    such a node is unchanged and not listed;
  - failing that, a named op node matches the unmatched before node of the same op and name: the
    pipeline kept it but *rewired* it (it reads new sources, or its params or type changed).
Every other before node was removed, every other after node is new (a fused op, a view of one).

    # before: 81 nodes, after: 80 nodes
    # net ops removed: 2 mul, 2 silu              net op counts, then what matching found
    ## blk.0: 4 removed, 1 new, 1 rewired
    -%36 = silu(%35) [1, 96] f32                  before's ids, as `graphir dump` prints them
    +%35 = swiglu_split(%33, %34) [1, 96] f32 "blk.0.ffn_act"    after's ids (`dump --passes P`)
    ~%36 = mul_mat(%30, %35) [1, 64] f32 "blk.0.ffn_out" ; was %40 = mul_mat(%30, %39)

Changes are grouped per layer by graphir.dump's layer rules; `layers` lists only those layers
(and the changes outside every layer) and counts the rest on one `# ...` line.

`diff_html` shows the same matching as a static page: per layer, a two-column table with every node
before and after, a kept node on the same row as the before node it is, each cell classed by its status.
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from graphir.dump import _blk_ranges, check_layers, format_node, format_params, format_type, node_layers
from graphir.ir import Graph, Node

_NAMED_LEAVES = ("input", "param", "state")


@dataclass
class Matching:
    """The result of matching `after`'s nodes to `before`'s."""

    before_of: dict[int, Node] = field(default_factory=dict)  # id(after node) -> the before node it is
    rewired: list[Node] = field(default_factory=list)  # after nodes, kept but changed
    new: list[Node] = field(default_factory=list)  # after nodes matching nothing
    removed: list[Node] = field(default_factory=list)  # before nodes nothing matches


def _key(n: Node, sources: tuple[Any, ...]) -> tuple[Any, ...]:
    if n.op in _NAMED_LEAVES and n.name is not None:
        return (n.op, n.name)
    return (n.op, n.dtype, n.shape, n.types, n.params, n.name, sources)


def match_nodes(before: Graph, after: Graph) -> Matching:
    """Match after's nodes to before's from the leaves up (rules: module doc)."""
    exact: dict[tuple[Any, ...], list[Node]] = {}
    by_name: dict[tuple[str, str], list[Node]] = {}
    for b in before.nodes():
        exact.setdefault(_key(b, tuple(id(s) for s in b.src)), []).append(b)
        if b.name is not None:
            by_name.setdefault((b.op, b.name), []).append(b)
    taken: set[int] = set()
    m = Matching()

    def take(candidates: list[Node]) -> Node | None:
        b = next((b for b in candidates if id(b) not in taken), None)
        if b is not None:
            taken.add(id(b))
        return b

    for a in after.nodes():  # topological: a's sources are settled before a
        # an unmatched source is new, and new ids never equal a before node's id(): no exact match
        sources = tuple(id(m.before_of[id(s)]) if id(s) in m.before_of else ("new", id(s)) for s in a.src)
        b = take(exact.get(_key(a, sources), []))
        if b is not None and _same_type_and_params(a, b):
            m.before_of[id(a)] = b
            continue
        if b is None and a.name is not None:
            b = take(by_name.get((a.op, a.name), []))
        if b is None:
            m.new.append(a)
        else:
            m.before_of[id(a)] = b
            m.rewired.append(a)
    m.removed = [b for b in before.nodes() if id(b) not in taken]
    return m


def _same_type_and_params(a: Node, b: Node) -> bool:
    return (a.dtype, a.shape, a.types, a.params) == (b.dtype, b.shape, b.types, b.params)


def _was(a: Node, b: Node, ids_before: dict[int, int]) -> str:
    """What a rewired node was: its before id and sources, and its type or params where they differ."""
    head = f"%{ids_before[id(b)]} = {b.op}"
    if b.src:
        head += "(" + ", ".join(f"%{ids_before[id(s)]}" for s in b.src) + ")"
    parts = [head]
    if format_type(a) != format_type(b):
        parts.append(format_type(b))
    if a.params != b.params:
        parts.append(format_params(b) if b.params else "{}")
    return " ; was " + " ".join(parts)


@dataclass
class _Group:
    removed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)  # new and rewired, in after's order
    n_new: int = 0
    n_rewired: int = 0

    def header(self, title: str) -> str:
        return f"## {title}: {len(self.removed)} removed, {self.n_new} new, {self.n_rewired} rewired"

    def size(self) -> int:
        return len(self.removed) + len(self.added)


def _groups(before: Graph, after: Graph, m: Matching) -> dict[int | None, _Group]:
    """Layer (None: outside every layer) -> its listed lines."""
    ids_b, ids_a = before.ids(), after.ids()
    of_b, of_a = node_layers(before), node_layers(after)
    groups: dict[int | None, _Group] = {}
    for b in m.removed:
        groups.setdefault(of_b[id(b)], _Group()).removed.append("-" + format_node(b, ids_b))
    rewired = {id(a) for a in m.rewired}
    for a in after.nodes():
        if id(a) in rewired:
            gr = groups.setdefault(of_a[id(a)], _Group())
            gr.added.append("~" + format_node(a, ids_a) + _was(a, m.before_of[id(a)], ids_b))
            gr.n_rewired += 1
        elif id(a) not in m.before_of:
            gr = groups.setdefault(of_a[id(a)], _Group())
            gr.added.append("+" + format_node(a, ids_a))
            gr.n_new += 1
    return groups


def _op_count_lines(before: Graph, after: Graph) -> list[str]:
    """Net op counts: one line each for ops there are fewer and more of."""
    a, b = Counter(n.op for n in before), Counter(n.op for n in after)
    fewer, more = a - b, b - a
    lines = [f"# net ops {what}: " + ", ".join(f"{c} {op}" for op, c in sorted(d.items()))
             for what, d in (("removed", fewer), ("added", more)) if d]
    return lines or ["# op counts unchanged"]


def _counts(after: Graph, m: Matching) -> str:
    kept = len(after) - len(m.new) - len(m.rewired)
    return f"{len(m.removed)} removed, {len(m.new)} new, {len(m.rewired)} rewired, {kept} unchanged"


def diff_graphs(before: Graph, after: Graph, layers: set[int] | None = None) -> str:
    """Net op counts, then the removed, new and rewired nodes per layer; `layers` folds the other layers."""
    check_layers(before, layers)
    m = match_nodes(before, after)
    lines = [f"# before: {len(before)} nodes, after: {len(after)} nodes", *_op_count_lines(before, after),
             f"# {_counts(after, m)}; "
             f"'-' lines number nodes as the dump before the passes does, '+' and '~' as the dump after"]
    groups = _groups(before, after, m)
    hidden = sorted(k for k in groups if k is not None and layers is not None and k not in layers)
    for layer in sorted(k for k in groups if k is not None and k not in hidden):
        lines += [groups[layer].header(f"blk.{layer}"), *groups[layer].removed, *groups[layer].added]
    if hidden:
        n = sum(groups[k].size() for k in hidden)
        lines.append(f"# ... {_blk_ranges(hidden)}: {n} changed nodes folded")
    if None in groups:
        lines += [groups[None].header("outside the layers"), *groups[None].removed, *groups[None].added]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- html: before and after side by side
_STATUSES = ("removed", "new", "rewired", "unchanged")
_CSS = """body { font-family: sans-serif; margin: 1em; }
table { border-collapse: collapse; width: 100%; table-layout: fixed; margin-bottom: 1.5em; }
th { text-align: left; border-bottom: 1px solid #888; }
td { font-family: monospace; font-size: 12px; white-space: pre-wrap; word-break: break-all; vertical-align: top;
     padding: 1px 6px; width: 50%; }
td.removed { background: #ffd7d5; } td.new { background: #d4f7d4; } td.rewired { background: #fff3b0; }
td.unchanged { color: #555; } td.empty { background: #f4f4f4; }
.folded { font-style: italic; color: #555; }"""


@dataclass
class _Row:
    status: str  # one of _STATUSES
    before: str | None  # the before node's dump line, None for a new node
    after: str | None  # the after node's dump line, None for a removed node


def _removed_above(before: Graph, m: Matching) -> tuple[dict[int, list[Node]], list[Node]]:
    """Where removed nodes go: id(kept before node) -> the removed nodes just above it in before's order,
    and the removed nodes after the last kept one."""
    removed = {id(b) for b in m.removed}
    above: dict[int, list[Node]] = {}
    run: list[Node] = []
    for b in before.nodes():
        if id(b) in removed:
            run.append(b)
        elif run:
            above[id(b)], run = run, []
    return above, run


def _rows(before: Graph, after: Graph, m: Matching) -> dict[int | None, list[_Row]]:
    """Layer (None: outside every layer) -> its rows, in after's order, each removed node just above the
    kept node that follows it in before's order (so a fusion's removed inputs sit next to what replaced them)."""
    ids_b, ids_a = before.ids(), after.ids()
    of_b, of_a = node_layers(before), node_layers(after)
    rewired = {id(a) for a in m.rewired}
    above, tail = _removed_above(before, m)
    rows: dict[int | None, list[_Row]] = {}

    def add_removed(nodes: list[Node]) -> None:
        for r in nodes:
            rows.setdefault(of_b[id(r)], []).append(_Row("removed", format_node(r, ids_b), None))

    for a in after.nodes():
        b = m.before_of.get(id(a))
        if b is None:
            rows.setdefault(of_a[id(a)], []).append(_Row("new", None, format_node(a, ids_a)))
            continue
        add_removed(above.get(id(b), []))
        status = "rewired" if id(a) in rewired else "unchanged"
        rows.setdefault(of_a[id(a)], []).append(_Row(status, format_node(b, ids_b), format_node(a, ids_a)))
    add_removed(tail)
    return rows


def _cell(status: str, line: str | None) -> str:
    return '<td class="empty"></td>' if line is None else f'<td class="{status}">{html.escape(line)}</td>'


def _section(title: str, rows: list[_Row]) -> list[str]:
    n = Counter(r.status for r in rows)
    head = f"{title}: " + ", ".join(f"{n[s]} {s}" for s in _STATUSES)
    return [f'<h2 id="{html.escape(title)}">{html.escape(head)}</h2>', "<table>",
            "<tr><th>before</th><th>after</th></tr>",
            *(f'<tr class="{r.status}">{_cell(r.status, r.before)}{_cell(r.status, r.after)}</tr>' for r in rows),
            "</table>"]


def _fold_line(hidden: list[int], rows: dict[int | None, list[_Row]]) -> str:
    folded = [r for k in hidden for r in rows[k]]
    n_before = sum(r.before is not None for r in folded)
    n_after = sum(r.after is not None for r in folded)
    n = Counter(r.status for r in folded)
    return (f"... {_blk_ranges(hidden)}: {n_before} nodes before, {n_after} after folded "
            f"({n['removed']} removed, {n['new']} new, {n['rewired']} rewired)")


def diff_html(before: Graph, after: Graph, layers: set[int] | None = None) -> str:
    """One static page (no script, no network): per layer, before and after side by side, each line classed
    removed, new, rewired or unchanged; `layers` folds the other layers into one line, as diff_graphs does."""
    check_layers(before, layers)
    m = match_nodes(before, after)
    rows = _rows(before, after, m)
    hidden = sorted(k for k in rows if k is not None and layers is not None and k not in layers)
    body: list[str] = []
    for layer in sorted(k for k in rows if k is not None and k not in hidden):
        body += _section(f"blk.{layer}", rows[layer])
    if hidden:
        body.append(f'<p class="folded">{html.escape(_fold_line(hidden, rows))}</p>')
    if None in rows:
        body += _section("outside the layers", rows[None])
    summary = [f"before: {len(before)} nodes, after: {len(after)} nodes", *(s[2:] for s in _op_count_lines(
        before, after)), _counts(after, m) + "; the left column numbers nodes as `graphir dump` before the passes "
        "does, the right as the dump after"]
    title = "graphir diff: " + summary[0]
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>", f"<style>\n{_CSS}\n</style>", "</head>", "<body>",
        f"<h1>{html.escape(title)}</h1>", *(f'<p class="summary">{html.escape(s)}</p>' for s in summary[1:]),
        *body, "</body>", "</html>"]) + "\n"
