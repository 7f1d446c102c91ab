"""What every compiling backend does to Params before binding kernels.

`ParamRef` is a weight as stored (raw blocks for quantized types); `fold_params` evaluates the
Param-only subgraphs (stacked QKV / gate|up concats) once at lowering, keeping quantized stacks
quantized. Both are shared by the cpu and gpu backends, so a stacked weight is built once per
weight store and every backend sees the same one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphir.errors import BackendError
from graphir.ir import Graph, Node
from graphir.ops import OPS
from graphir.quant import dequantize
from graphir.weights import Weights


class ParamRef:
    """A weight as stored (raw blocks for quantized types) with a cached f32 copy on demand."""

    def __init__(self, node: Node | None, weights: Weights | None, raw: np.ndarray | None = None,
                 dtype: str | None = None, shape: tuple[int, ...] | None = None, key: tuple = ()):
        if node is not None:
            w = weights[node.name]
            if tuple(w.shape) != node.shape or w.dtype != node.dtype:
                raise BackendError(f"param {node.name!r}: weight is {list(w.shape)} {w.dtype}, "
                                   f"graph expects {list(node.shape)} {node.dtype}")
            raw, dtype, shape, key = w.data, w.dtype, tuple(w.shape), ("param", node.name)
        self.raw, self.dtype, self.shape, self.key = raw, dtype, shape, key
        self.weights = weights

    def f32(self) -> np.ndarray:
        cache = self.weights.derived if self.weights is not None else {}
        k = ("f32",) + self.key
        if k not in cache:
            cache[k] = np.ascontiguousarray(dequantize(self.raw, self.dtype, self.shape), np.float32)
        return cache[k]


def val(x: Any) -> Any:
    return x.f32() if isinstance(x, ParamRef) else x


# ---------------------------------------------------------------- plan-time decisions
def fold_params(graph: Graph, weights: Weights) -> dict[int, Any]:
    """Evaluate nodes computed only from Params and Consts once, at lowering.

    A concat of same-dtype Params on axis 0 (stacked QKV / gate|up) stays in the weights'
    storage format, so quantized stacks stay quantized; it is cached in `weights.derived`
    and shared by every Program over these weights.
    """
    folded: dict[int, Any] = {}
    const_only: dict[int, bool] = {}
    for n in graph.nodes():
        if n.is_leaf:
            const_only[id(n)] = n.op in ("param", "const")
            continue
        const_only[id(n)] = all(const_only[id(s)] for s in n.src) and not OPS[n.op].writes
        if not const_only[id(n)] or n.op == "item" or OPS[n.op].multi:
            continue
        srcs = [folded[id(s)] if id(s) in folded else ParamRef(s, weights) if s.op == "param" else None
                for s in n.src]
        if n.op == "concat" and n.params["axis"] % len(n.shape) == 0 and all(isinstance(s, ParamRef) for s in srcs) \
                and len({s.dtype for s in srcs}) == 1:
            key = ("concat0",) + tuple(s.key for s in srcs)
            if key not in weights.derived:
                weights.derived[key] = np.concatenate([s.raw for s in srcs], axis=0)
            folded[id(n)] = ParamRef(None, weights, weights.derived[key], srcs[0].dtype, n.shape, key)
        elif all(s is not None or src.op == "const" for s, src in zip(srcs, n.src)):
            # a const in its own dtype: an i32 one read as f32 made get_rows(param, const ids) an IndexError
            args = [val(s) if s is not None else
                    np.asarray(src.params["value"], np.int32 if src.dtype == "i32" else np.float32).reshape(src.shape)
                    for s, src in zip(srcs, n.src)]
            folded[id(n)] = np.ascontiguousarray(OPS[n.op].ref(*args, **n.params.as_dict()))
    return folded
