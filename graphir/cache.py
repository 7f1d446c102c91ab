"""The program cache: each (graph structure, input shapes, weights, backend, passes) is lowered once.

A model needs only a bounded set of graphs (one decode graph, a few prefill buckets), so a
cache is a small LRU dict. Its key is the graph's structural signature (ops, wiring, params,
shapes and dtypes, which covers the Input shapes), the weight store's identity, the backend
name and the pass pipeline. Positions, KV rows and lengths are Inputs, never part of the key,
so one decode Program serves every position.

A Program holds its weights, so each loaded model owns a ProgramCache (its Programs go when it
goes); `get_program` uses a process-wide one for everything else.

With GRAPHIR_DEBUG_CACHE=1 every miss prints which parts of the key differ from the closest
cached entry (input shapes, a param, the structure, node names, meta, the pass list, the
backend), which is how an accidental per-step rebuild shows up.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import OrderedDict
from typing import Any

from graphir import flags, graph_cache
from graphir.backends.registry import get_backend
from graphir.ir import Graph
from graphir.weights import Weights


def key_parts(graph: Graph, backend: str, passes: str) -> dict[str, str]:
    """The cache key split into named parts, each a short digest, so a miss can say what changed."""
    rec = graph.to_records()
    nodes = rec["nodes"]

    def digest(obj: Any) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]

    return {
        "inputs": digest([(n["name"], n["shape"], n["dtype"]) for n in nodes if n["op"] == "input"]),
        "states": digest([(n["name"], n["shape"], n["dtype"]) for n in nodes if n["op"] == "state"]),
        "params": digest([n["params"] for n in nodes]),
        "shapes": digest([(n["shape"], n["dtype"], n.get("types")) for n in nodes]),
        "structure": digest([(n["op"], n["src"]) for n in nodes] + [rec["outputs"], rec["updates"]]),
        # the rest of what graph.signature() hashes, so a miss never blames the weights wrongly
        "names": digest([n.get("name") for n in nodes]),  # Param names pick the weights
        "meta": digest(rec["meta"]),
        "passes": passes,
        "backend": backend,
    }


def _expanded(passes: str) -> str:
    """`passes` as the cache keys it: with GRAPHIR_NO_FUSION set, `default` (and cpu, gpu) expands to other passes
    (graphir.passes.default_pipeline, read when used), so a Program lowered before the flag was set was reused
    after it. The on-disk graph cache keys on the parsed pipeline for the same reason."""
    return f"{passes} (GRAPHIR_NO_FUSION)" if passes and flags.enabled("GRAPHIR_NO_FUSION") else passes


class ProgramCache:
    def __init__(self, max_entries: int = 16):
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._passed: dict[tuple[str, str], Graph] = {}  # (signature, passes) -> graph after them
        self._programs: OrderedDict[tuple[str, int, str, str], tuple[Weights | None, Any, dict[str, str]]] = \
            OrderedDict()

    def get_program(self, graph: Graph, weights: Weights | None, backend: str = "reference", passes: str = "") -> Any:
        """The Program for `graph` on `backend` after the pass pipeline `passes`, lowered on first use.
        Passes "auto" is the backend's pipeline, resolved here so that the key names it."""
        from graphir.passes import resolve_pipeline

        passes = resolve_pipeline(passes, backend)
        key = (graph.signature(), id(weights), backend, _expanded(passes))
        hit = self._programs.get(key)
        if hit is not None and hit[0] is weights:  # `is`: an id may be reused once a store is freed
            self.hits += 1
            self._programs.move_to_end(key)
            return hit[1]
        self.misses += 1
        parts = key_parts(graph, backend, _expanded(passes))
        if flags.enabled("GRAPHIR_DEBUG_CACHE"):
            print(f"graphir cache miss: {self.explain_miss(parts)}", file=sys.stderr)
        # the pipeline too: the cpu backend's precompile reads what the graph's decode sibling will call from it
        program = get_backend(backend).lower(self.passed(graph, passes), weights, pipeline=passes)
        self._programs[key] = (weights, program, parts)
        while len(self._programs) > self.max_entries:
            self._programs.popitem(last=False)
        return program

    def explain_miss(self, parts: dict[str, str]) -> str:
        """Which key parts differ from the closest cached entry ('first program' if none)."""
        best: list[str] | None = None
        for _, _, other in self._programs.values():
            diff = [k for k in parts if parts[k] != other.get(k)]
            if best is None or len(diff) < len(best):
                best = diff
        if best is None:
            return "first program"
        return "changed: " + ", ".join(best) if best else "same key parts, different weights"

    def passed(self, graph: Graph, passes: str) -> Graph:
        """`graph` after the pipeline `passes`, run once per graph structure: a model asks for its
        decode graph's States before the decode Program is lowered, and both read this result. A new
        process reads it from disk where an earlier one ran the same pipeline (graphir.graph_cache)."""
        if not passes:
            return graph
        key = (graph.signature(), _expanded(passes))
        if key not in self._passed:
            from graphir.passes import run_pipeline

            result = graph_cache.load(key[0], passes)  # an earlier process's result, if any
            if result is None:
                result = run_pipeline(graph, passes)
                graph_cache.store(key[0], passes, result)
            self._passed[key] = result
            while len(self._passed) > self.max_entries:
                self._passed.pop(next(iter(self._passed)))
        return self._passed[key]

    def clear(self) -> None:
        self._programs.clear()
        self._passed.clear()

    def __len__(self) -> int:
        return len(self._programs)


DEFAULT = ProgramCache()


def get_program(graph: Graph, weights: Weights | None, backend: str = "reference", passes: str = "") -> Any:
    """`DEFAULT.get_program`: the process-wide cache."""
    return DEFAULT.get_program(graph, weights, backend, passes)
