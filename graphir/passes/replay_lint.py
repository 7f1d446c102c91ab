"""replay-lint: no per-step value may be baked into a graph that is cached and replayed.

Two checks. The pass (cheap, every pipeline) finds params holding a `graphir.taint.StepInt`.
`replay_diff` (a test-time tool) builds a graph at two step values and lists the nodes whose
structure differs, which also catches values that lost their taint (shapes, consts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from graphir.errors import GraphError
from graphir.ir import Graph
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


@register_pass("replay-lint", "fail if any node's params hold a per-step value (graphir.taint.step): "
                              "a replayed graph would reuse it at every position")
@dataclass(frozen=True)
class ReplayLint:
    strict: bool = True  # False: record the findings in the coverage report and return the graph

    def __call__(self, graph: Graph) -> Graph:
        problems = tainted_params(graph)
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
