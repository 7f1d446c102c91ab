"""graphir/memplan.py, the arena plan every compiling backend binds: values live at the same step never share bytes,
and a graph's outputs stay live to the end (the Program copies them out after its last step)."""

from __future__ import annotations

import numpy as np
import pytest
from graphir.backends.registry import get_backend

import graphir
from graphir.builder import g
from graphir.ir import Graph
from graphir.memplan import plan_memory, storage_of
from graphir.passes import run_pipeline


def early_output_graph() -> Graph:
    """An output that nothing reads, computed first, then a chain of values of its size: a plan that let its slot
    go after its own step would give it to the chain."""
    x = g.input("x", (7, 33))
    early = g.mul(x, x, name="early")
    y = x
    for i in range(4):
        y = g.add(g.silu(y), x, name=f"chain{i}")
    return Graph({"early": early, "late": y})


def assert_sound(graph: Graph) -> None:
    plan = plan_memory(graph)
    slots = list(plan.slots.values())
    for i, a in enumerate(slots):
        for b in slots[i + 1:]:
            if a.first <= b.last and b.first <= a.last:  # live at one step
                assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset, (a, b)
    end = len(graph.nodes())
    for name, out in graph.outputs.items():
        key = storage_of(out, plan.alias)  # an output that is a view or item lives in its base's slot
        if key in plan.slots:
            assert plan.slots[key].last == end, f"output {name} is not live to the end"


@pytest.mark.parametrize("spec", ["random:llama-tiny", "random:qwen35-tiny"])
def test_model_graphs_plan_no_overlap_and_keep_outputs(spec):
    m = graphir.load(spec, backend="reference")
    for graph in (m.graph("decode"), m.graph("prefill", 8)):
        assert_sound(graph)
        assert_sound(run_pipeline(graph, "default"))
    assert_sound(early_output_graph())


def test_an_early_output_is_not_overwritten_by_later_values():
    x = np.random.default_rng(3).standard_normal((7, 33)).astype(np.float32)
    graph = early_output_graph()
    out = get_backend("cpu").lower(graph, None)({"x": x}, {})
    np.testing.assert_array_equal(out["early"], x * x)
