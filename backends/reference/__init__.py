"""The numpy reference backend: runs any verified graph by calling each op's reference.

It is the oracle every other backend and every pass is tested against, so it favours
plainness over speed: float32 math, weights dequantized once per Program.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from graphir.dtypes import numpy_dtype
from graphir.errors import BackendError, GraphError
from graphir.ir import Graph, Node
from graphir.ops import OPS
from graphir.quant import dequantize
from graphir.run_inputs import check_inputs, check_state
from graphir.verify import verify
from graphir.weights import Weights


class ReferenceProgram:
    def __init__(self, graph: Graph, weights: Weights | None):
        self.graph = verify(graph)
        self.weights = weights if weights is not None else Weights()
        self._params: dict[str, np.ndarray] = {}

    def param(self, node: Node) -> np.ndarray:
        if node.name not in self._params:
            w = self.weights[node.name]
            if tuple(w.shape) != node.shape:
                raise BackendError(f"param {node.name!r}: weight is {list(w.shape)}, graph expects {list(node.shape)}")
            if w.dtype != node.dtype:
                raise BackendError(f"param {node.name!r}: weight is {w.dtype}, graph expects {node.dtype}")
            # one f32 copy per weight store, shared by every Program (prefill buckets, decode)
            key = ("f32", "param", node.name)
            if key not in self.weights.derived:
                self.weights.derived[key] = np.ascontiguousarray(dequantize(w.data, w.dtype, w.shape), np.float32)
            self._params[node.name] = self.weights.derived[key]
        return self._params[node.name]

    def __call__(self, inputs: Mapping[str, np.ndarray], state: dict[str, np.ndarray] | None = None,
                 trace: dict[int, Any] | None = None) -> dict[str, np.ndarray]:
        """Run once. `state` buffers are updated in place. `trace`, if given, receives every value by node id."""
        feeds = check_inputs(self.graph, inputs)
        state = state if state is not None else {}
        check_state(self.graph, state)
        env: dict[int, Any] = {}
        ids = self.graph.ids()
        for n in self.graph.nodes():
            env[id(n)] = self._eval(n, env, feeds, state, ids)
        if trace is not None:
            trace.update({ids[k]: v for k, v in env.items()})
        return {name: np.asarray(env[id(n)]).copy() for name, n in self.graph.outputs.items()}

    def _eval(self, n: Node, env, feeds, state, ids) -> Any:
        if n.op == "input":
            return feeds[n.name]
        if n.op == "param":
            return self.param(n)
        if n.op == "state":
            return state[n.name]
        if n.op == "const":
            return np.asarray(n.params["value"], dtype=np.float32 if n.dtype == "f32" else np.int32).reshape(n.shape)
        args = [env[id(s)] for s in n.src]
        try:
            value = OPS[n.op].ref(*args, **n.params.as_dict())
        except GraphError as e:
            raise BackendError(f"node %{ids[id(n)]} {n.describe()}: {e}") from None
        multi = n.types is not None
        for v, (shape, dtype) in zip(value if multi else (value,), n.types if multi else ((n.shape, n.dtype),),
                                     strict=True):
            _check_value(n, ids, np.asarray(v), tuple(shape), dtype)
        return value


def _check_value(n: Node, ids: dict[int, int], v: np.ndarray, shape: tuple[int, ...], dtype: str) -> None:
    """The oracle checks itself: a reference must return the type the op's rule promised.

    Values derived from f16/bf16 Params may be float32 (Params are dequantized), never float64.
    """
    want = numpy_dtype(dtype)
    if v.shape != shape or not (v.dtype == want or (want.kind == "f" and v.dtype == np.float32)):
        raise BackendError(f"node %{ids[id(n)]} {n.describe()}: reference returned {list(v.shape)} {v.dtype}, "
                           f"the op's rule gives {list(shape)} {dtype}")


def lower(graph: Graph, weights: Weights | None = None, **options: Any) -> ReferenceProgram:
    return ReferenceProgram(graph, weights)
