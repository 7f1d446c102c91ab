"""Lowering a graph to a CPU Program: a flat list of bound kernel calls over one arena.

lower():  verify -> fold Param-only subgraphs (stacked weights) -> plan the arena by
liveness -> bind every node to a kernel with its input and output arrays fixed. Stacked and
repacked weights are kept on disk for later processes (weight_cache.py), written after binding.
A call then copies the Inputs in, runs the bound steps and copies the outputs out;
nothing is allocated or looked up per step, which is what makes replay cheap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from graphir.dtypes import numpy_dtype
from graphir.errors import BackendError, GraphirError
from graphir.ir import Graph, Node
from graphir.memplan import MemPlan, plan_memory, result_types
from graphir.ops import OPS
from graphir.run_inputs import check_inputs, check_state
from graphir.verify import verify
from graphir.weights import Weights

from . import direct_call, precompile, threads, weight_cache
from . import lowering_rules as rules


class CpuProgram:
    def __init__(self, graph: Graph, weights: Weights | None, pipeline: str | None = None):
        t0 = time.perf_counter()
        self.graph = verify(graph)
        self.pipeline = pipeline  # the passes graph came from: what its decode sibling calls (precompile)
        self.weights = weights if weights is not None else Weights()
        weight_cache.attach(self.weights)  # stacked and repacked weights: read back from disk where kept
        self.order = graph.nodes()
        self.ids = graph.ids()
        self.folded = rules.fold_params(graph, self.weights)
        self.copies = rules.views_needing_copy(graph)
        self.plan: MemPlan = plan_memory(graph, self.copies)
        self.arena = np.empty(max(self.plan.arena_bytes, 1), np.uint8)
        self.input_buffers = {n.name: np.empty(n.shape, numpy_dtype(n.dtype)) for n in graph.inputs}
        self._bound_state: tuple[int, ...] | None = None
        self._steps: list[Callable[[], None]] = []
        self._unwrapped = False  # whether the steps' KernelCalls have run and been replaced by their direct calls
        self._outputs: dict[str, np.ndarray] = {}
        self.lower_s = time.perf_counter() - t0

    # ---------------------------------------------------------------- binding
    def _slot_array(self, n: Node, k: int) -> np.ndarray:
        slot = self.plan.slots[(id(n), k)]
        shape, dt = result_types(n)[k]
        npd = numpy_dtype(dt)
        # the bytes the result needs, not slot.nbytes: the plan gives an empty result 1 byte, which no 4-byte view
        # can take (a [0, 16] tensor was numpy's 'When changing to a larger dtype, its size must be a divisor ...')
        nbytes = int(np.prod(shape)) * npd.itemsize
        return self.arena[slot.offset:slot.offset + nbytes].view(npd).reshape(shape)

    def _bind(self, state: Mapping[str, np.ndarray]) -> None:
        env: dict[int, Any] = {}
        steps: list[Callable[[], None]] = []
        step_nodes: list[str] = []
        for n in self.order:
            if n.op == "input":
                env[id(n)] = self.input_buffers[n.name]
            elif n.op == "state":
                env[id(n)] = state[n.name]
            elif n.op == "param":
                env[id(n)] = rules.ParamRef(n, self.weights)
            elif n.op == "const":
                env[id(n)] = np.asarray(n.params["value"], numpy_dtype(n.dtype)).reshape(n.shape)
            elif id(n) in self.folded:
                env[id(n)] = self.folded[id(n)]
            elif n.op == "item":
                env[id(n)] = env[id(n.src[0])][n.params["index"]]
            else:
                ins = [env[id(s)] for s in n.src]
                d = OPS[n.op]
                if (d.view and id(n) not in self.copies) or d.writes:
                    out = None
                else:
                    out = [self._slot_array(n, k) for k in range(len(result_types(n)))]
                value, step = rules.lower_node(n, ins, out)
                env[id(n)] = value
                if step is not None:
                    steps.append(step)
                    step_nodes.append(f"node %{self.ids[id(n)]} {n.describe()}")
        self._steps = steps
        self._step_nodes = step_nodes
        # an output that is a Param or a folded Param-only subgraph (a stacked weight) is a ParamRef: its f32
        # values, as the reference gives them (np.array of the ParamRef was a 0-d object array)
        self._outputs = {name: rules.val(env[id(n)]) for name, n in self.graph.outputs.items()}

    # ---------------------------------------------------------------- running
    def __call__(self, inputs: Mapping[str, np.ndarray], state: dict[str, np.ndarray] | None = None
                 ) -> dict[str, np.ndarray]:
        feeds = check_inputs(self.graph, inputs)
        threads.apply()  # auto: fewer threads while other programs keep cores busy (threads.py)
        state = state if state is not None else {}
        key = tuple(id(state.get(n.name)) for n in self.graph.states)
        if key != self._bound_state:  # new buffers: check them once, then bind kernels to them
            check_state(self.graph, state)
            rules.RECORD = []  # the kernels the steps call, for precompile
            try:
                self._bind(state)
                recorded = rules.RECORD
            finally:
                rules.RECORD = None
            self._bound_state = key
            self._unwrapped = False
            weight_cache.flush(self.weights)  # what the binding derived, one segment on disk for later processes
            precompile.prepare(recorded, self.pipeline)  # a cold numba cache: compile them with a helper process
        for name, arr in feeds.items():
            self.input_buffers[name][...] = arr
        i = 0
        try:
            for i, step in enumerate(self._steps):  # noqa: B007 (i names the failing step below)
                step()
        except (IndexError, ValueError, GraphirError) as e:  # bad runtime values (ids, rows) land here
            raise BackendError(f"cpu backend, {self._step_nodes[i]}: {e}") from None
        if not self._unwrapped:  # every step has run once: call the compiled kernels directly from now on
            self._steps = direct_call.unwrap(self._steps)
            self._unwrapped = True
        return {name: np.array(v, copy=True) for name, v in self._outputs.items()}

    def report(self) -> dict[str, float]:
        return {
            "nodes": len(self.order),
            "steps": len(self._steps),
            "arena_bytes": self.plan.arena_bytes,
            "unplanned_bytes": self.plan.naive_bytes,
            "lower_s": self.lower_s,
        }


def lower(graph: Graph, weights: Weights | None = None, **options: Any) -> CpuProgram:
    """`options["pipeline"]`: the passes `graph` came from (graphir.cache passes it)."""
    return CpuProgram(graph, weights, options.get("pipeline"))


__all__ = ["lower", "CpuProgram"]
