"""replay-lint: no per-step value may be baked into a graph that is cached and replayed.

Three checks. The pass (cheap, every pipeline) finds params holding a `graphir.taint.StepInt`, and
checks the bounds of every read of a KV cache (a State written by rows at run-time indices), which a
value that lost its taint (a logical length built in as a plain int) would otherwise slip past:
  - a view over KV spans every row of the pool (a window of it is sized from a build-time length);
  - a gather over KV (get_rows: a slot-mapped pool) takes its row ids from an Input (the slot map);
  - attention over KV takes its length bound (kv_len) and its query positions from Inputs, never a Const;
  - a write of KV rows takes its row indices from Inputs.
`replay_diff` (a test-time tool) builds a graph at two step values and lists the nodes whose
structure differs, which also catches values that lost their taint (shapes, consts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from graphir.errors import GraphError
from graphir.ir import Graph, Node
from graphir.ops import OPS
from graphir.passes import register_pass
from graphir.passes.report import record_reject
from graphir.taint import find_tainted


def tainted_params(graph: Graph) -> list[str]:
    """One message per node whose params hold a per-step value, naming node, param and origin."""
    ids = graph.ids()
    out = []
    for n in graph.nodes():
        for key, value in n.params.as_dict().items():
            for t in find_tainted(value):
                out.append(f"node %{ids[id(n)]} {n.describe()}: param {key}={int(t)} is built from the per-step "
                           f"value {t.origin}; feed it as an Input so the graph can be replayed")
                record_reject(n, f"param {key} holds per-step {t.origin}")
    return out


# in-place writes of rows at run-time indices: KV caches
ROW_WRITES = ("set_rows", "rope_set_rows", "rms_norm_mul_rope_set_rows")


def _kv_values(graph: Graph) -> dict[int, Node]:
    """id -> the KV State under every value that is a KV cache: States written by ROW_WRITES, those writes
    (chained), and views of them."""
    written = {id(n.src[0]) for n in graph.nodes() if n.op in ROW_WRITES and n.src[0].op == "state"}
    kv: dict[int, Node] = {}
    for n in graph.nodes():
        if n.op == "state" and id(n) in written:
            kv[id(n)] = n
        elif n.src and id(n.src[0]) in kv and (n.op in ROW_WRITES or OPS[n.op].view):
            kv[id(n)] = kv[id(n.src[0])]
    return kv


def _rows_spanned(view: Node, pool: Node) -> int:
    """Rows of the pool a view over its row-major elements touches."""
    p = view.params.as_dict()
    row = pool.numel // pool.shape[0]
    ends = [(d - 1) * st for d, st in zip(p["shape"], p["strides"], strict=True) if d > 0]
    lo, hi = p["offset"] + sum(min(e, 0) for e in ends), p["offset"] + sum(max(e, 0) for e in ends)
    return hi // row - lo // row + 1


def _from_inputs_only(n: Node) -> bool:
    stack, seen = [n], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if x.op in ("const", "param", "state"):
            return False
        stack.extend(x.src)
    return True


def kv_bound_problems(graph: Graph) -> list[str]:
    """One message per read of a KV cache bounded by something other than the pool or an Input."""
    ids, kv, out = graph.ids(), _kv_values(graph), []
    gathered = {id(n) for n in graph.nodes() if n.op == "get_rows" and id(n.src[0]) in kv}
    read = set(kv) | gathered  # KV values and what is gathered from them, through views
    for n in graph.nodes():
        if n.src and OPS[n.op].view and id(n.src[0]) in read:
            read.add(id(n))

    def say(n: Node, rule: str) -> None:
        if any(find_tainted(v) for v in n.params.as_dict().values()):
            return  # tainted_params names this node already, with the per-step value it holds
        out.append(f"node %{ids[id(n)]} {n.describe()}: {rule}")
        record_reject(n, rule)

    for n in graph.nodes():
        if n.op == "view" and id(n.src[0]) in kv and n.src[0].op in ("state", "reshape", *ROW_WRITES):
            pool = kv[id(n.src[0])]
            if (rows := _rows_spanned(n, pool)) < pool.shape[0]:
                say(n, f"a view over the KV cache {pool.name!r} spans {rows} of its {pool.shape[0]} rows: its extent "
                       f"is a build-time length; read the whole pool and bound it with an Input (kv_len, a slot map)")
        elif id(n) in gathered and n.src[1].op != "input":
            say(n, f"gathers KV rows by {n.src[1].describe()}, not by an Input (a slot map fed per call)")
        elif n.op.startswith("flash_attn") and any(id(s) in read for s in n.src[1:3]):
            if not _from_inputs_only(n.src[4]):
                say(n, f"its KV length bound {n.src[4].describe()} is not computed from Inputs alone")
            # a Const position (a decode step built at one position) passed the lint: every replay attends as that
            # position did, a causal mask and sliding window fixed at build time
            elif not _from_inputs_only(n.src[3]):
                say(n, f"its query positions {n.src[3].describe()} are not computed from Inputs alone")
        elif n.op in ROW_WRITES and id(n.src[0]) in kv and not _from_inputs_only(n.src[-1]):
            # the KV write row is the position's row: a Const one rewrites that row at every replayed step
            say(n, f"writes KV rows at {n.src[-1].describe()}, not at rows computed from Inputs alone")
    return out


@register_pass("replay-lint", "fail if any node's params hold a per-step value (graphir.taint.step), or a read of "
                              "a KV cache is bounded by a build-time length: a replayed graph would reuse it")
@dataclass(frozen=True)
class ReplayLint:
    strict: bool = True  # False: record the findings in the coverage report and return the graph

    def __call__(self, graph: Graph) -> Graph:
        problems = tainted_params(graph) + kv_bound_problems(graph)
        if problems and self.strict:
            raise GraphError("replay-lint: " + "; ".join(problems))
        return graph


def replay_diff(build_fn: Callable[[int], Graph], a: int, b: int) -> list[str]:
    """Build at step values a and b; describe every node whose structure differs (empty: replay-safe)."""
    ga, gb = build_fn(a), build_fn(b)
    ra, rb = ga.to_records(), gb.to_records()
    if len(ra["nodes"]) != len(rb["nodes"]):
        return [f"node count differs: {len(ra['nodes'])} at {a}, {len(rb['nodes'])} at {b}"]
    out = []
    for na, nb, node in zip(ra["nodes"], rb["nodes"], ga.nodes(), strict=True):
        fields = [k for k in ("op", "dtype", "shape", "src", "params", "name", "types") if na.get(k) != nb.get(k)]
        if fields:
            detail = ", ".join(f"{k} {na.get(k)} vs {nb.get(k)}" for k in fields)
            out.append(f"node %{na['id']} {node.describe()}: {detail} (built at {a} vs {b})")
    for k in ("outputs", "updates"):
        if ra[k] != rb[k]:
            out.append(f"{k} differ: {ra[k]} vs {rb[k]}")
    return out
