"""Layouts on the GPU: which views alias their source, and index maps collapsed for the kernels.

Every value a gpu Program holds is C-contiguous (an arena slot, a State, a weight, or a
contiguous alias at an element offset). A view whose elements are not contiguous in its
source's row-major order (a real permute, a strided view) is materialized by a gather kernel
into its own arena slot, every call, so kernels only ever see contiguous inputs: `copy_launch`,
the one gather (copy.cu), which also casts and stages copies.

The exception: a rule may declare inputs it reads as *row-strided* views (lowering.py
ROW_STRIDED_INPUTS: last axis contiguous, the outer axes at any strides). A view whose every
reader takes it so is not gathered; the Program binds it as an alias starting at its first
element, and the rule reads it through `lowering.input_strides` (Qwen3.5's q and gate halves,
interleaved per head in one projection, cost no copy kernels).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphir.builder import contiguous_strides, merge_axes
from graphir.errors import BackendError
from graphir.ir import Graph, Node
from graphir.ops import OPS

from .launch import Launch, cdiv, i32

BLOCK = 256  # threads of the grid-stride elementwise kernels
TNAME = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.int32): "i32"}

Layout = tuple[tuple[int, ...], tuple[int, ...], int]  # (shape, strides, offset) in source elements


def view_layout(n: Node) -> Layout:
    """A view node's elements as (shape, strides, offset) over its source's row-major order."""
    src = n.src[0].shape
    if n.op == "view":
        return tuple(n.params["shape"]), tuple(n.params["strides"]), n.params["offset"]
    if n.op == "reshape":
        return tuple(n.shape), contiguous_strides(n.shape), 0
    cs = contiguous_strides(src)
    if n.op == "permute":
        return tuple(n.shape), tuple(cs[a] for a in n.params["axes"]), 0
    if n.op == "transpose":
        return tuple(n.shape), cs[:-2] + (cs[-1], cs[-2]), 0
    raise BackendError(f"{n.op} is not a view op")


def is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Row-major contiguous, ignoring the strides of size-1 axes (they are never stepped)."""
    if 0 in shape:
        return True
    return all(s == c for n, s, c in zip(shape, strides, contiguous_strides(shape)) if n != 1)


def views_to_copy(graph: Graph, row_strided: dict[str, dict[int, int]] | None = None) -> set[int]:
    """ids of view nodes that need a gather into their own slot: not contiguous over their source,
    and not read in place by rules that take row-strided views (`row_strided`: op -> {input index:
    outer axes its kernel indexes}; lowering.ROW_STRIDED_INPUTS by default)."""
    if row_strided is None:
        from .lowering import ROW_STRIDED_INPUTS  # lowering imports this module: read its table late

        row_strided = ROW_STRIDED_INPUTS
    users, roots, runtime = graph.users(), {id(r) for r in graph.roots}, runtime_nodes(graph)
    copies = set()
    for n in graph.nodes():
        if not OPS[n.op].view:
            continue
        shape, strides, offset = view_layout(n)
        if is_contiguous(shape, strides):
            continue
        in_place = (n.dtype == "f32" and id(n) not in roots and id(n) in runtime and users[id(n)]
                    and offset + n.numel <= n.src[0].numel  # the Program's alias spans numel elements
                    and all(_takes_row_strided(u, n, shape, strides, row_strided) for u in users[id(n)]))
        if not in_place:
            copies.add(id(n))
    return copies


def _takes_row_strided(reader: Node, v: Node, shape: tuple[int, ...], strides: tuple[int, ...],
                       row_strided: dict[str, dict[int, int]]) -> bool:
    """Whether `reader` takes v, at every input position it reads v, as a row-strided view."""
    accepts = row_strided.get(reader.op, {})
    return all(i in accepts and is_row_strided(shape, strides, accepts[i])
               for i, s in enumerate(reader.src) if s is v)


def is_row_strided(shape: tuple[int, ...], strides: tuple[int, ...], outer: int) -> bool:
    """Last axis contiguous, non-negative strides, and at most `outer` outer axes once collapsed."""
    if not shape or min(strides) < 0 or (shape[-1] > 1 and strides[-1] != 1):
        return False
    try:
        collapse(shape[:-1], strides[:-1], outer, "row-strided view")
    except BackendError:
        return False
    return True


def runtime_nodes(graph: Graph) -> set[int]:
    """ids of nodes that read an Input or a State: the rest (Params and Consts only) are folded at
    lowering into contiguous arrays (graphir.lowering.fold_params), never bound as views."""
    out: set[int] = set()
    for n in graph.nodes():
        if n.op in ("input", "state") or any(id(s) in out for s in n.src):
            out.add(id(n))
    return out


def collapse(shape: tuple[int, ...], strides: tuple[int, ...], max_dims: int, what: str) -> tuple[list[int], list[int]]:
    """Merge adjacent axes whose strides compose (outer stride == inner stride * inner size), drop
    size-1 axes, and left-pad with (1, 0) to exactly `max_dims` axes."""
    dims = merge_axes(shape, strides)
    if len(dims) > max_dims:
        raise BackendError(f"{what}: index map {list(shape)} strides {list(strides)} needs {len(dims)} axes; "
                           f"the gpu kernels take at most {max_dims}")
    dims = [(1, 0)] * (max_dims - len(dims)) + dims
    return [d[0] for d in dims], [d[1] for d in dims]


def broadcast_strides(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides (in b's elements) that read b broadcast onto a: 0 along b's size-1 axes."""
    b = (1,) * (len(a_shape) - len(b_shape)) + tuple(b_shape)
    cs = contiguous_strides(b)
    return tuple(0 if nb == 1 else s for nb, s in zip(b, cs))


def grid_for(n: int) -> int:
    return max(1, min(cdiv(n, BLOCK), 1 << 16))  # grid-stride loops cover the rest


def tname(a: Any) -> str:
    return TNAME[np.dtype(a.dtype)]


def copy_launch(src: Any, dst: Any, layout: Layout | None = None, what: str = "copy") -> Launch:
    """dst (contiguous) = src gathered through `layout` (shape, strides, offset) over src's flat
    elements, converting between f32, f16 and i32; no layout: an element-wise copy of dst's shape."""
    shape, strides, offset = layout if layout is not None else (dst.shape, contiguous_strides(dst.shape), 0)
    dims, ss = collapse(tuple(shape), tuple(strides), 6, what)
    args = (src, dst, np.int64(dst.size), np.int64(offset), *map(i32, dims[1:]), *map(np.int64, ss))
    return Launch("copy.cu", f"copy_{tname(src)}_{tname(dst)}", grid_for(dst.size), BLOCK, args)
