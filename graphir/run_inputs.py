"""What a Program is fed, for every backend: Inputs checked against the graph, State buffers made and checked."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from graphir.dtypes import numpy_dtype
from graphir.errors import InputError
from graphir.ir import Graph


def check_inputs(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every Input present with its declared shape and dtype; returns contiguous arrays."""
    out = {}
    for node in graph.inputs:
        arr = inputs.get(node.name)
        if arr is None:
            raise InputError(f"missing input {node.name!r} ({list(node.shape)} {node.dtype})")
        want = numpy_dtype(node.dtype)
        if type(arr) is np.ndarray and arr.shape == node.shape and arr.dtype == want and arr.flags.c_contiguous:
            out[node.name] = arr  # the common case, first: a replayed decode step checks its Inputs every call
            continue
        arr = np.asarray(arr)
        if arr.shape != node.shape:
            raise InputError(f"input {node.name!r}: shape {list(arr.shape)}, graph expects {list(node.shape)}")
        if arr.dtype != want:
            if arr.dtype.kind != want.kind or (want.kind == "i" and not np.can_cast(arr.dtype, want, "same_kind")):
                raise InputError(f"input {node.name!r}: dtype {arr.dtype}, graph expects {node.dtype}")
            arr = arr.astype(want)
        out[node.name] = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)  # which makes 0-d [1]
    extra = set(inputs) - {n.name for n in graph.inputs} if len(inputs) != len(out) else ()
    if extra:
        raise InputError(f"unexpected inputs {sorted(extra)}; the graph takes {[n.name for n in graph.inputs]}")
    return out


def new_state(graph: Graph) -> dict[str, np.ndarray]:
    """Zeroed State buffers for a graph (KV caches, conv and recurrent states)."""
    return {n.name: np.zeros(n.shape, numpy_dtype(n.dtype)) for n in graph.states}


def check_state(graph: Graph, state: Mapping[str, np.ndarray]) -> None:
    for n in graph.states:
        buf = state.get(n.name)
        if buf is None:
            raise InputError(f"missing state buffer {n.name!r} ({list(n.shape)} {n.dtype})")
        if buf.shape != n.shape or buf.dtype != numpy_dtype(n.dtype):
            raise InputError(f"state {n.name!r}: {list(buf.shape)} {buf.dtype}, "
                             f"graph expects {list(n.shape)} {n.dtype}")
