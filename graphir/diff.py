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
"""

from __future__ import annotations

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


def diff_graphs(before: Graph, after: Graph, layers: set[int] | None = None) -> str:
    """Net op counts, then the removed, new and rewired nodes per layer; `layers` folds the other layers."""
    check_layers(before, layers)
    m = match_nodes(before, after)
    kept = len(after) - len(m.new) - len(m.rewired)
    lines = [f"# before: {len(before)} nodes, after: {len(after)} nodes", *_op_count_lines(before, after),
             f"# {len(m.removed)} removed, {len(m.new)} new, {len(m.rewired)} rewired, {kept} unchanged; "
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
