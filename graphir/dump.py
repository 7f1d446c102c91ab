"""Graph dumps: text (one line per node), Graphviz DOT, JSON (round-trips) and one-file HTML.

Text lines read like MLIR/ggml debug prints and are stable, so tests can FileCheck them:

    %12 = rms_norm(%11) [7, 64] f32 {eps=1e-05} "blk.0.attn_norm"

`%N` is the node's position in topological order (`Graph.ids()`), the same number the
verifier and backends use in their messages.

Layers: a node named `blk.<i>.…` belongs to layer i; an unnamed node belongs to the
latest layer among its sources (so an unnamed reshape inside a block stays in it).
`layers="0..1"` folds every other layer out of text, DOT and HTML views.
"""

from __future__ import annotations

import difflib
import json
import re
from collections import Counter
from importlib import resources
from typing import Any

from graphir.errors import GraphError
from graphir.ir import LEAF_OPS, Graph, Node
from graphir.ops import OPS

FORMATS = ("text", "dot", "json", "html")
MAX_SHOWN_VALUES = 8  # longer tuple params (const values) print their first 4 and a count
_LAYER_NAME = re.compile(r"^blk\.(\d+)(?:\.|$)")


# ---------------------------------------------------------------- layers
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
        if hi < lo:
            raise ValueError(f"bad layer spec {spec!r}: range {lo}..{hi} is empty")
        out.update(range(lo, hi + 1))
    return out


def node_layers(graph: Graph) -> dict[int, int | None]:
    """id(node) -> its layer number, or None for nodes outside any `blk.<i>` layer."""
    layers: dict[int, int | None] = {}
    for n in graph.nodes():
        m = _LAYER_NAME.match(n.name) if n.name else None
        if m:
            layers[id(n)] = int(m[1])
        elif n.name is None and n.src:
            inherited = [layers[id(s)] for s in n.src if layers[id(s)] is not None]
            layers[id(n)] = max(inherited) if inherited else None
        else:
            layers[id(n)] = None
    return layers


def fold_layers(graph: Graph, layers: set[int] | None) -> tuple[list[Node], str | None]:
    """The nodes to show (topological order) and a one-line note on what was folded, if anything."""
    if layers is None:
        return graph.nodes(), None
    of = node_layers(graph)
    kept = [n for n in graph.nodes() if of[id(n)] is None or of[id(n)] in layers]
    folded = sorted({of[id(n)] for n in graph.nodes() if of[id(n)] is not None} - layers)
    n_folded = len(graph) - len(kept)
    if not n_folded:
        return kept, None
    which = f"layer {folded[0]}" if len(folded) == 1 else f"{len(folded)} layers ({_ranges(folded)})"
    return kept, f"folded {n_folded} nodes of {which}; showing layers {_ranges(sorted(layers))}"


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
def format_value(v: Any) -> str:
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


def format_node(n: Node, ids: dict[int, int]) -> str:
    head = f"%{ids[id(n)]} = {n.op}"
    if n.src:
        head += "(" + ", ".join(f"%{ids[id(s)]}" for s in n.src) + ")"
    parts = [head, format_type(n)]
    if n.params:
        parts.append("{" + ", ".join(f"{k}={format_value(v)}" for k, v in n.params.as_dict().items()) + "}")
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


def dump_text(graph: Graph, layers: set[int] | None = None) -> str:
    """One line per node in topological order, then outputs and state updates."""
    ids = graph.ids()
    kept, note = fold_layers(graph, layers)
    lines = ["# " + graph_summary(graph)]
    if note:
        lines.append("# " + note)
    lines += [format_node(n, ids) for n in kept]
    lines += [f"output {json.dumps(k)} = %{ids[id(v)]}" for k, v in graph.outputs.items()]
    lines += [f"update %{ids[id(u)]}" for u in graph.updates]
    return "\n".join(lines) + "\n"


def diff_graphs(before: Graph, after: Graph) -> str:
    """What a pipeline changed: op counts removed/added, then a unified diff of the text dumps."""
    a, b = Counter(n.op for n in before), Counter(n.op for n in after)
    removed, added = a - b, b - a
    lines = [f"# before: {len(before)} nodes, after: {len(after)} nodes"]
    lines += [f"-{c} {op}" for op, c in sorted(removed.items())]
    lines += [f"+{c} {op}" for op, c in sorted(added.items())]
    if not removed and not added:
        lines.append("# op counts unchanged")
    body = difflib.unified_diff(dump_text(before).splitlines()[1:], dump_text(after).splitlines()[1:],
                                "before", "after", n=1, lineterm="")
    return "\n".join(lines + list(body)) + "\n"


# ---------------------------------------------------------------- dot
_DOT_STYLE = {  # leaves by kind; op nodes default to rounded boxes
    "input": 'shape=invhouse, style=filled, fillcolor="#cfe8ff"',
    "param": 'shape=box, style=filled, fillcolor="#eeeeee"',
    "state": 'shape=cylinder, style=filled, fillcolor="#ffd9a8"',
    "const": 'shape=ellipse, style=filled, fillcolor="#ffffff"',
}


def _dot_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dump_dot(graph: Graph, layers: set[int] | None = None) -> str:
    """Graphviz source: one box per node (op, type, name), layers as clusters, edges src -> user."""
    ids = graph.ids()
    kept, note = fold_layers(graph, layers)
    kept_ids = {id(n) for n in kept}
    of = node_layers(graph)
    out = ["digraph graphir {", '  rankdir=TB; node [fontname="monospace", fontsize=10];',
           f"  label={_dot_str(graph_summary(graph))}; labelloc=t;"]
    clusters: dict[int | None, list[str]] = {}
    for n in kept:
        label = f"%{ids[id(n)]} {n.op}\n{format_type(n)}" + (f"\n{n.name}" if n.name else "")
        style = _DOT_STYLE.get(n.op, 'shape=box, style="rounded,filled", fillcolor="#ffffff"')
        if OPS[n.op].writes:
            style += ', color="#c00000", penwidth=2'
        clusters.setdefault(of[id(n)], []).append(f"n{ids[id(n)]} [label={_dot_str(label)}, {style}];")
    for layer, decls in clusters.items():
        if layer is None:
            out += ["  " + d for d in decls]
        else:
            out += [f"  subgraph cluster_blk{layer} {{", f'    label="blk.{layer}"; style=dashed;']
            out += ["    " + d for d in decls] + ["  }"]
    if note:
        out.append(f"  folded [label={_dot_str('... ' + note)}, shape=note, style=dashed];")
    edges: list[str] = []
    for n in kept:
        for s in n.src:
            src = f"n{ids[id(s)]}" if id(s) in kept_ids else "folded"
            edges.append(f"  {src} -> n{ids[id(n)]};")  # duplicates (several folded sources) dropped below
    if note:  # kept values read by folded nodes, so the placeholder sits where the layers were
        edges += [f"  n{ids[id(s)]} -> folded;" for n in graph.nodes() if id(n) not in kept_ids
                  for s in n.src if id(s) in kept_ids]
    for i, (name, node) in enumerate(graph.outputs.items()):
        out.append(f"  out{i} [label={_dot_str('output ' + name)}, shape=doubleoctagon];")
        edges.append(f"  {f'n{ids[id(node)]}' if id(node) in kept_ids else 'folded'} -> out{i};")
    for i, u in enumerate(graph.updates):
        out.append(f'  upd{i} [label="update", shape=octagon, color="#c00000"];')
        edges.append(f"  {f'n{ids[id(u)]}' if id(u) in kept_ids else 'folded'} -> upd{i};")
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
    (layer per node, op docs, which layer groups start open) sits beside it in `graph-view`.
    """
    of = node_layers(graph)
    ops = sorted({n.op for n in graph.nodes()})
    view = {
        "title": title,
        "summary": graph_summary(graph),
        "layers": [of[id(n)] for n in graph.nodes()],
        "open": None if layers is None else sorted(layers),
        "docs": {op: OPS[op].doc for op in ops if op in OPS},
        "writes": [op for op in ops if op in OPS and OPS[op].writes],
    }
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
