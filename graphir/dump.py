"""Graph dumps: text (one line per node), Graphviz DOT, JSON (round-trips) and one-file HTML.

Text lines read like MLIR/ggml debug prints and are stable, so tests can FileCheck them:

    %12 = rms_norm(%11) [7, 64] f32 {eps=1e-05} "blk.0.attn_norm"

`%N` is the node's position in topological order (`Graph.ids()`), the same number the
verifier and backends use in their messages.

Layers: a node named `blk.<i>.…` belongs to layer i, any other named node to no layer. An unnamed
node belongs to the layer of the nodes that read it: llama's `mul(rms_norm(x), w) "blk.2.attn_norm"`
puts the unnamed rms_norm in blk.2, not in blk.1 where x comes from. When its readers disagree, an
unnamed op node takes the latest of their layers (a fused op ending one layer and starting the next
belongs to the next) and an unnamed leaf takes none; an unnamed node nobody reads takes the latest
layer among its sources. `layers="0..1"` folds every other layer out of text, DOT and HTML views:
one `# ... blk.2 .. blk.29: 980 nodes folded` line stands where they were, and a shown line that
reads a folded node says so: `rms_norm(%1055 (folded, blk.29))`.

Float params print as the shortest decimal that round-trips their float32 value (every kernel
computes in f32), so an eps read from a GGUF file as f32 prints `1e-05`, as the file's author wrote
it, not `9.999999747378752e-06`. JSON keeps the exact double, so graphs round-trip bit for bit.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphir.errors import GraphError
from graphir.ir import LEAF_OPS, Graph, Node
from graphir.ops import OPS

FORMATS = ("text", "dot", "json", "html")
MAX_SHOWN_VALUES = 8  # longer tuple params (const values) print their first 4 and a count
_LAYER_NAME = re.compile(r"^blk\.(\d+)(?:\.|$)")


# ---------------------------------------------------------------- layers
MAX_LAYER = 9999


def parse_layers(spec: str | None) -> set[int] | None:
    """`"0..1"` (inclusive), `"3"`, `"0,2,5"`, `"0..2,7"` -> layer numbers; `None`/`"all"` -> None (all)."""
    if spec is None or spec.strip() == "all":
        return None
    out: set[int] = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\.\.\s*(\d+)\s*)?", part)
        if not m:
            raise ValueError(f"bad layer spec {spec!r}: use N, A..B, a comma list of those, or 'all'")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi > MAX_LAYER:  # the largest models have ~100 layers; a typo's 0..100000000000 expanded for minutes
            raise ValueError(f"bad layer spec {spec!r}: layer numbers stop at {MAX_LAYER}")
        if hi < lo:
            raise ValueError(f"bad layer spec {spec!r}: range {lo}..{hi} is empty")
        out.update(range(lo, hi + 1))
    return out


def _name_layer(name: str) -> int | None:
    m = _LAYER_NAME.match(name)
    return int(m[1]) if m else None


def node_layers(graph: Graph) -> dict[int, int | None]:
    """id(node) -> its layer number, or None for nodes outside any `blk.<i>` layer (rules: module doc)."""
    nodes = graph.nodes()
    by_sources: dict[int, int | None] = {}  # only for unnamed nodes nobody reads
    for n in nodes:
        inherited = [by_sources[id(s)] for s in n.src if by_sources[id(s)] is not None]
        by_sources[id(n)] = _name_layer(n.name) if n.name is not None else max(inherited, default=None)
    users = graph.users()
    layers: dict[int, int | None] = {}
    for n in reversed(nodes):  # users come after their sources, so they are settled first
        readers = {layers[id(u)] for u in users[id(n)]}
        if n.name is not None:
            layers[id(n)] = _name_layer(n.name)
        elif not readers:
            layers[id(n)] = by_sources[id(n)]
        elif len(readers) == 1:
            layers[id(n)] = readers.pop()
        else:
            layers[id(n)] = None if n.op in LEAF_OPS else max(r for r in readers if r is not None)
    return layers


def check_layers(graph: Graph, layers: set[int] | None, of: dict[int, int | None] | None = None) -> None:
    """GraphError unless every asked-for layer exists in `graph` (`of`: its node_layers, if at hand)."""
    if layers is None:
        return
    present = {x for x in (of or node_layers(graph)).values() if x is not None}
    if not present:
        raise GraphError(f"layers {_ranges(sorted(layers))}: the graph has no blk.N layers to show or fold")
    n = max(present) + 1
    missing = sorted(layers - set(range(n)))
    if missing:
        raise GraphError(f"layers {_ranges(missing)} out of range: the graph has {n} layer{'s' * (n != 1)} "
                         f"({_blk_ranges(list(range(n)))})")


@dataclass
class Fold:
    """A run of hidden nodes, consecutive in topological order: one `# ...` line in a dump."""

    layers: list[int]
    nodes: list[Node]

    def line(self) -> str:
        return f"... {_blk_ranges(self.layers)}: {len(self.nodes)} nodes folded"


def fold_view(graph: Graph, layers: set[int] | None,
              of: dict[int, int | None] | None = None) -> list[Node | Fold]:
    """The graph's nodes in topological order with each run of hidden nodes replaced by one Fold.

    A leaf outside the layers (an input first read by a hidden layer) that sits inside a run moves ahead of the Fold:
    leaves read nothing, so the order stays topological and the run stays one line."""
    if layers is None:
        return list(graph.nodes())
    of = of if of is not None else node_layers(graph)
    check_layers(graph, layers, of)
    view: list[Node | Fold] = []
    run: list[Node] = []
    hoisted: list[Node] = []

    def close() -> None:
        view.extend(hoisted)
        if run:
            view.append(Fold(sorted({of[id(n)] for n in run}), list(run)))  # type: ignore[misc]
        run.clear()
        hoisted.clear()

    for n in graph.nodes():
        if of[id(n)] is not None and of[id(n)] not in layers:
            run.append(n)
        elif run and n.op in LEAF_OPS and of[id(n)] is None:
            hoisted.append(n)
        else:
            close()
            view.append(n)
    close()
    return view


def fold_layers(graph: Graph, layers: set[int] | None) -> tuple[list[Node], str | None]:
    """The nodes to show (topological order) and a one-line note on what was folded, if anything."""
    if layers is None:
        return graph.nodes(), None
    of = node_layers(graph)
    check_layers(graph, layers, of)
    kept = [n for n in graph.nodes() if of[id(n)] is None or of[id(n)] in layers]
    folded = sorted({of[id(n)] for n in graph.nodes() if of[id(n)] is not None} - layers)
    n_folded = len(graph) - len(kept)
    if not n_folded:
        return kept, None
    which = f"layer {folded[0]}" if len(folded) == 1 else f"{len(folded)} layers ({_ranges(folded)})"
    return kept, f"folded {n_folded} nodes of {which}; showing layers {_ranges(sorted(layers))}"


def _blk_ranges(xs: list[int]) -> str:
    """[2, 3, 4, 7] -> "blk.2 .. blk.4, blk.7"."""
    return ", ".join(" .. ".join(f"blk.{x}" for x in part.split("..")) for part in _ranges(xs).split(","))


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> "0..2,5"."""
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}..{xs[j]}")
        i = j + 1
    return ",".join(parts) or "none"


# ---------------------------------------------------------------- text
def format_float(v: float) -> str:
    """The shortest decimal that round-trips v's float32 value, as Python prints it: 1e-05, 0.1, 2.0."""
    with np.errstate(over="ignore"):
        f32 = np.float32(v)
    if np.isfinite(v) and not np.isfinite(f32):  # beyond f32's range: the double is what there is
        return repr(v)
    for digits in range(1, 10):  # 9 significant digits always round-trip a float32
        text = f"{float(f32):.{digits}g}"
        if np.float32(text) == f32:
            return repr(float(text))
    return repr(float(f32))  # nan


def format_value(v: Any) -> str:
    if isinstance(v, float):
        return format_float(v)
    if isinstance(v, tuple):
        shown = [format_value(x) for x in v[:4]] if len(v) > MAX_SHOWN_VALUES else [format_value(x) for x in v]
        tail = f", ... ({len(v)} values)" if len(v) > MAX_SHOWN_VALUES else ""
        return "[" + ", ".join(shown) + tail + "]"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def format_type(n: Node) -> str:
    if n.types is not None:  # multi-output: one (shape, dtype) per result
        return "(" + ", ".join(f"{list(s)} {d}" for s, d in n.types) + ")"
    return f"{list(n.shape)} {n.dtype}"


def format_params(n: Node) -> str:
    return "{" + ", ".join(f"{k}={format_value(v)}" for k, v in n.params.as_dict().items()) + "}"


def format_ref(n: Node, ids: dict[int, int], folded: dict[int, int] | None = None) -> str:
    """`%N`, or `%N (folded, blk.L)` for a node a folded dump does not show."""
    if folded and id(n) in folded:
        return f"%{ids[id(n)]} (folded, blk.{folded[id(n)]})"
    return f"%{ids[id(n)]}"


def format_node(n: Node, ids: dict[int, int], folded: dict[int, int] | None = None) -> str:
    """One dump line; `folded` (id(node) -> layer) marks the sources a folded dump hides."""
    head = f"%{ids[id(n)]} = {n.op}"
    if n.src:
        head += "(" + ", ".join(format_ref(s, ids, folded) for s in n.src) + ")"
    parts = [head, format_type(n)]
    if n.params:
        parts.append(format_params(n))
    if n.name is not None:
        parts.append(json.dumps(n.name))
    if OPS[n.op].writes:
        dst = n.src[0]
        while OPS[dst.op].writes:
            dst = dst.src[0]
        parts.append(f"; writes {json.dumps(dst.name)} in place")
    return " ".join(parts)


def graph_summary(graph: Graph) -> str:
    kinds = Counter(n.op for n in graph.nodes() if n.op in LEAF_OPS)
    leaves = ", ".join(f"{kinds[k]} {k}" for k in LEAF_OPS if kinds[k])
    meta = " ".join(f"{k}={format_value(v)}" for k, v in sorted(graph.meta.items()))
    return f"graph {meta + ': ' if meta else ''}{len(graph)} nodes ({leaves}); signature {graph.signature()}"


def _hidden(view: list[Node | Fold], of: dict[int, int | None]) -> dict[int, int]:
    """id(node) -> layer, for every node a folded view hides."""
    return {id(n): of[id(n)] for e in view if isinstance(e, Fold) for n in e.nodes}  # type: ignore[misc]


def dump_text(graph: Graph, layers: set[int] | None = None) -> str:
    """One line per node in topological order, then outputs and state updates."""
    ids, of = graph.ids(), node_layers(graph)
    view = fold_view(graph, layers, of)
    hidden = _hidden(view, of)
    _, note = fold_layers(graph, layers)
    lines = ["# " + graph_summary(graph)] + (["# " + note] if note else [])
    lines += ["# " + e.line() if isinstance(e, Fold) else format_node(e, ids, hidden) for e in view]
    lines += [f"output {json.dumps(k)} = {format_ref(v, ids, hidden)}" for k, v in graph.outputs.items()]
    lines += [f"update %{ids[id(u)]}" for u in graph.updates if id(u) not in hidden]
    n_folded_updates = sum(id(u) in hidden for u in graph.updates)
    if n_folded_updates:
        lines.append(f"# ... {n_folded_updates} state updates in folded layers")
    return "\n".join(lines) + "\n"


def diff_graphs(before: Graph, after: Graph, layers: set[int] | None = None) -> str:
    """What a pass pipeline changed, node by node: see graphir/diff.py."""
    from graphir.diff import diff_graphs as structural_diff  # diff.py builds on this module's lines

    return structural_diff(before, after, layers)


# ---------------------------------------------------------------- dot
_DOT_STYLE = {  # leaves by kind; op nodes default to rounded boxes
    "input": 'shape=invhouse, style=filled, fillcolor="#cfe8ff"',
    "param": 'shape=box, style=filled, fillcolor="#eeeeee"',
    "state": 'shape=cylinder, style=filled, fillcolor="#ffd9a8"',
    "const": 'shape=ellipse, style=filled, fillcolor="#ffffff"',
}


def _dot_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_label(n: Node, ids: dict[int, int]) -> str:
    params = f"\n{format_params(n)}" if n.params and n.op != "const" else ""
    return f"%{ids[id(n)]} {n.op}\n{format_type(n)}" + params + (f"\n{n.name}" if n.name else "")


def dump_dot(graph: Graph, layers: set[int] | None = None) -> str:
    """Graphviz source: one box per node (op, type, params, name), layers as clusters, edges src -> user.

    Each folded run is one `foldedK` note; edges into or out of hidden nodes end at their run's note."""
    ids, of = graph.ids(), node_layers(graph)
    view = fold_view(graph, layers, of)
    folds = [e for e in view if isinstance(e, Fold)]
    place = {id(n): f"n{ids[id(n)]}" for n in graph.nodes()}
    place.update({id(n): f"folded{k}" for k, f in enumerate(folds) for n in f.nodes})
    out = ["digraph graphir {", '  rankdir=TB; node [fontname="monospace", fontsize=10];',
           f"  label={_dot_str(graph_summary(graph))}; labelloc=t;"]
    clusters: dict[int | None, list[str]] = {}
    for n in (e for e in view if isinstance(e, Node)):
        style = _DOT_STYLE.get(n.op, 'shape=box, style="rounded,filled", fillcolor="#ffffff"')
        if OPS[n.op].writes:
            style += ', color="#c00000", penwidth=2'
        clusters.setdefault(of[id(n)], []).append(f"n{ids[id(n)]} [label={_dot_str(_dot_label(n, ids))}, {style}];")
    for layer, decls in clusters.items():
        if layer is None:
            out += ["  " + d for d in decls]
        else:
            out += [f"  subgraph cluster_blk{layer} {{", f'    label="blk.{layer}"; style=dashed;']
            out += ["    " + d for d in decls] + ["  }"]
    updates = {id(u) for u in graph.updates}
    for k, f in enumerate(folds):
        n_upd = sum(id(n) in updates for n in f.nodes)
        label = f.line() + (f"\n{n_upd} state updates" if n_upd else "")
        out.append(f"  folded{k} [label={_dot_str(label)}, shape=note, style=dashed];")
    edges = [f"  {place[id(s)]} -> {place[id(n)]};" for n in graph.nodes() for s in n.src
             if place[id(s)] != place[id(n)]]  # duplicates (several folded sources) dropped below
    for i, (name, node) in enumerate(graph.outputs.items()):
        out.append(f"  out{i} [label={_dot_str('output ' + name)}, shape=doubleoctagon];")
        edges.append(f"  {place[id(node)]} -> out{i};")
    for i, u in enumerate(u for u in graph.updates if place[id(u)].startswith("n")):
        out.append(f'  upd{i} [label="update", shape=octagon, color="#c00000"];')
        edges.append(f"  {place[id(u)]} -> upd{i};")
    return "\n".join(out + list(dict.fromkeys(edges)) + ["}"]) + "\n"


# ---------------------------------------------------------------- json
def dump_json(graph: Graph) -> str:
    """`graph.to_records()` as JSON, one node per line so dumps diff well."""
    rec = graph.to_records()
    nodes = ",\n".join("    " + json.dumps(n) for n in rec["nodes"])
    rest = "".join(f",\n  {json.dumps(k)}: {json.dumps(v)}" for k, v in rec.items() if k != "nodes")
    return '{\n  "nodes": [\n' + nodes + "\n  ]" + rest + "\n}\n"


def load_json(text: str) -> Graph:
    """Inverse of dump_json (any JSON of `to_records()` works); the result is structurally equal."""
    try:
        rec = json.loads(text)
        return Graph.from_records(rec)
    except json.JSONDecodeError as e:
        raise GraphError(f"graph JSON: not valid JSON ({e})") from None
    except GraphError as e:  # from_records names the node and field
        raise GraphError(f"graph JSON: not a graphir graph record ({e})") from None
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise GraphError(f"graph JSON: not a graphir graph record ({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------- html
def _script_json(obj: Any) -> str:
    # "<" only occurs inside JSON strings, and \u003c is the same string, so a name can never
    # close the <script> element early.
    return json.dumps(obj, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e").replace(
        "&", "\\u0026")


def dump_html(graph: Graph, layers: set[int] | None = None, title: str = "graphir graph") -> str:
    """One self-contained page (inline CSS/JS, no network) to browse the graph.

    The graph is embedded as `to_records()` JSON in `<script id="graph-json">`; the view data
    (layer and printed params per node, op docs, which layer groups start open) sits beside it in
    `graph-view`.
    """
    of = node_layers(graph)
    check_layers(graph, layers, of)
    ops = sorted({n.op for n in graph.nodes()})
    view = {
        "title": title,
        "summary": graph_summary(graph),
        "layers": [of[id(n)] for n in graph.nodes()],
        "params": [{k: format_value(v) for k, v in n.params.as_dict().items()} for n in graph.nodes()],
        "open": None if layers is None else sorted(layers),
        "docs": {op: OPS[op].doc for op in ops if op in OPS},
        "writes": [op for op in ops if op in OPS and OPS[op].writes],
    }
    from importlib import resources  # here, not at import: it pulls in tempfile and shutil (4 ms of `graphir run`)

    template = resources.files("graphir").joinpath("dump_template.html").read_text(encoding="utf-8")
    return (template.replace("__TITLE__", _html_escape(title))
            .replace("__GRAPH_JSON__", _script_json(graph.to_records()))
            .replace("__VIEW_JSON__", _script_json(view)))


def _html_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def dump(graph: Graph, fmt: str = "text", layers: set[int] | None = None) -> str:
    """Dispatch on format name; `layers` folds text, DOT and HTML (JSON is always the whole graph)."""
    if fmt == "text":
        return dump_text(graph, layers)
    if fmt == "dot":
        return dump_dot(graph, layers)
    if fmt == "json":
        return dump_json(graph)
    if fmt == "html":
        return dump_html(graph, layers, title=f"graphir: {graph_summary(graph).split(';')[0]}")
    raise ValueError(f"unknown dump format {fmt!r}; known: {', '.join(FORMATS)}")
