"""The program cache: each (graph structure, weights, backend, passes) is lowered once.

A model needs only a bounded set of graphs (one decode graph, a few prefill buckets), so a
cache is a small LRU dict keyed by the graph's structural signature, the weight store's
identity, the backend name and the pass pipeline string. A Program holds its weights, so
each loaded model owns a ProgramCache (its Programs go when it goes); `get_program` uses a
process-wide one for everything else.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from graphir.ir import Graph
from graphir.weights import Weights


class ProgramCache:
    def __init__(self, max_entries: int = 16):
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._programs: OrderedDict[tuple[str, int, str, str], tuple[Weights | None, Any]] = OrderedDict()

    def get_program(self, graph: Graph, weights: Weights | None, backend: str = "reference", passes: str = "") -> Any:
        """The Program for `graph` on `backend` after the pass pipeline `passes`, lowered on first use."""
        key = (graph.signature(), id(weights), backend, passes)
        hit = self._programs.get(key)
        if hit is not None and hit[0] is weights:  # `is`: an id may be reused once a store is freed
            self.hits += 1
            self._programs.move_to_end(key)
            return hit[1]
        self.misses += 1
        program = _lower(graph, weights, backend, passes)
        self._programs[key] = (weights, program)
        while len(self._programs) > self.max_entries:
            self._programs.popitem(last=False)
        return program

    def clear(self) -> None:
        self._programs.clear()

    def __len__(self) -> int:
        return len(self._programs)


def _lower(graph: Graph, weights: Weights | None, backend: str, passes: str) -> Any:
    from graphir.backends.registry import get_backend

    if passes:
        from graphir.passes import run_pipeline

        graph = run_pipeline(graph, passes)
    return get_backend(backend).lower(graph, weights)


DEFAULT = ProgramCache()


def get_program(graph: Graph, weights: Weights | None, backend: str = "reference", passes: str = "") -> Any:
    """`DEFAULT.get_program`: the process-wide cache."""
    return DEFAULT.get_program(graph, weights, backend, passes)
