"""How a split passes through each op: the rules of the shard-tp pass.

A split is a `Sel` (axis, indices): a rank holds the tensor's elements at those indices along that
axis. Heads are whole along every other axis, so every op below works on a rank's part alone.
`back(n, sel)` says which part of each source a rank needs to make `sel` of n (None: the whole
source, shared by every rank); `local(n, ...)` builds the rank's node. An op that cannot work on a
part raises Reject, naming the node and the reason; the pass then leaves that region whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from graphir.builder import make
from graphir.errors import GraphError
from graphir.ir import Node

Sel = tuple[int, tuple[int, ...]]  # (axis, indices kept along it, in order)

ELEMENTWISE = ("neg", "exp", "silu", "gelu", "sigmoid", "softplus", "scale", "cont")
BINARY = ("add", "sub", "mul", "div", "swiglu_split")
ROW_NORMS = ("rms_norm", "l2_norm", "norm", "softmax")  # over the last axis: that axis stays whole
HEAD_OPS = ("flash_attn", "gated_delta_net")  # whose head structure decides a region's split


class Reject(Exception):  # noqa: N818 (a control-flow signal, reported as a coverage reason)
    def __init__(self, node: Node, reason: str):
        super().__init__(reason)
        self.node, self.reason = node, reason


def last(n: Node) -> int:
    return len(n.shape) - 1


# ---------------------------------------------------------------- reshapes: a split moved between shapes
def map_reshape(node: Node, frm: tuple[int, ...], to: tuple[int, ...], sel: Sel) -> Sel:
    """The same elements of a row-major tensor seen as `frm` and as `to`: split heads [n, H*d] <-> [n, H, d]."""
    axis, idx = sel
    outer, inner = math.prod(frm[:axis]), math.prod(frm[axis + 1:])
    flat = [i * inner + j for i in idx for j in range(inner)]  # positions inside one outer block
    for b in range(len(to)):
        if math.prod(to[:b]) != outer or to[b] == 1:
            continue
        inner_to = math.prod(to[b + 1:])
        if len(flat) % inner_to:
            continue
        idx_to = tuple(flat[k * inner_to] // inner_to for k in range(len(flat) // inner_to))
        if [i * inner_to + j for i in idx_to for j in range(inner_to)] == flat:
            return b, idx_to
    raise Reject(node, f"reshape {list(frm)} -> {list(to)} would cut a rank's part mid-row")


# ---------------------------------------------------------------- heads of grouped ops
def kv_heads(node: Node, big_idx: Sequence[int], n_big: int, n_small: int) -> tuple[int, ...]:
    """The shared (KV / DeltaNet key) heads a rank's query (or value) heads read, grouped as the op reads
    them: local head j reads local shared head j // (len(big) / len(small))."""
    group = n_big // n_small
    small = tuple(sorted({h // group for h in big_idx}))
    local = len(big_idx) // len(small)
    if len(big_idx) % len(small) or any(h // group != small[j // local] for j, h in enumerate(big_idx)):
        raise Reject(node, f"heads {list(big_idx)} read shared heads {list(small)} in unequal groups "
                           f"({n_big} heads over {n_small} shared)")
    return small


# ---------------------------------------------------------------- back: what each source must hold
def back(n: Node, sel: Sel, item_sels: dict[int, Sel] | None = None) -> list[Sel | None]:
    """Per source: the part a rank needs (or None: whole and shared). Multi-output ops get `item_sels`,
    the parts asked of their results by index."""
    axis, idx = sel
    op = n.op
    if op in ELEMENTWISE:
        return [sel]
    if op in BINARY:
        return [sel, _broadcast(n, n.src[1], sel)]
    if op in ROW_NORMS:
        if axis == last(n):
            raise Reject(n, f"{op} reduces over the split axis {axis}")
        return [sel] + [_broadcast(n, m, sel) for m in n.src[1:]]
    if op == "rope":
        if axis != 1:
            raise Reject(n, f"rope rotates within a head; split axis {axis} is not the heads axis")
        return [sel, None]
    if op == "reshape":
        return [map_reshape(n, n.shape, n.src[0].shape, sel)]
    if op == "view":
        return [(1, _view_cols(n, sel))]
    if op == "mul_mat":
        w = n.src[0]
        if axis != last(n) or w.op != "param" or len(w.shape) != 2:
            raise Reject(n, f"mul_mat of {w.op} {list(w.shape)} split on axis {axis}: only a 2-D Param weight "
                            f"splits by output rows")
        return [(0, idx), None]
    if op == "set_rows":
        if axis == 0:
            raise Reject(n, "set_rows writes whole rows; the cache splits across heads, not rows")
        return [sel, sel, None]
    if op == "assign":
        return [sel, sel]
    if op == "flash_attn":
        if axis != 1:
            raise Reject(n, f"flash_attn splits by heads (axis 1), not axis {axis}")
        kv = (1, kv_heads(n, idx, n.src[0].shape[1], n.src[1].shape[1]))
        return [sel, kv, kv, None, None]
    if op == "item":
        return [None]  # handled by the pass: an item's part is asked of its multi-output source
    if op == "ssm_conv":
        ch = _agreed(n, item_sels, {0: 1, 1: 1})
        return [(1, ch), (1, ch), (0, ch)]
    if op == "gated_delta_net":
        heads = _agreed(n, item_sels, {0: 1, 1: 0})
        k = (1, kv_heads(n, heads, n.src[2].shape[1], n.src[0].shape[1]))
        return [k, k, (1, heads), (1, heads), (1, heads), (0, heads)]
    raise Reject(n, f"shard-tp has no split rule for {op} (run it before the default fusions)")


def complete_items(n: Node, asked: dict[int, Sel]) -> dict[int, Sel]:
    """Every result's part of a multi-output op, from the parts its readers asked for: one head list
    (channels for ssm_conv) on each result's heads axis."""
    axes = {"ssm_conv": {0: 1, 1: 1}, "gated_delta_net": {0: 1, 1: 0}}.get(n.op)
    if axes is None:
        raise Reject(n, f"shard-tp has no split rule for the multi-output {n.op}")
    heads = _agreed(n, asked, axes)
    return {i: (a, heads) for i, a in axes.items()}


def _agreed(n: Node, sels: dict[int, Sel] | None, axes: dict[int, int]) -> tuple[int, ...]:
    """The one head (channel) list every asked-for result of a multi-output op agrees on."""
    got = set()
    for i, (axis, idx) in (sels or {}).items():
        if axes.get(i) != axis:
            raise Reject(n, f"result {i} of {n.op} is split on axis {axis}, not its heads axis {axes.get(i)}")
        got.add(tuple(idx))
    if len(got) != 1:
        raise Reject(n, f"{n.op}'s results are asked for different heads")
    return got.pop()


def _broadcast(n: Node, b: Node, sel: Sel) -> Sel | None:
    """b broadcast onto n: split alike where b has the axis, shared where b is 1 or lacks it."""
    axis = sel[0] - (len(n.shape) - len(b.shape))
    return None if axis < 0 or b.shape[axis] == 1 else (axis, sel[1])


def _view_cols(n: Node, sel: Sel) -> tuple[int, ...]:
    """Columns of a [rows, cols] source a view of it reads for `sel` (the view walks rows with stride cols)."""
    src, p = n.src[0], n.params
    strides, offset = p["strides"], p["offset"]
    if len(src.shape) != 2 or strides[0] != src.shape[1] or offset >= src.shape[1] or sel[0] == 0:
        raise Reject(n, f"view {list(n.shape)} strides {list(strides)} of {list(src.shape)} is not a column "
                        f"selection of a [rows, cols] tensor")
    return tuple(sorted(set(_view_col_map(n, sel[0], sel[1]))))


def _view_col_map(n: Node, axis: int, idx: Sequence[int]) -> list[int]:
    """Source column of every element (row 0) of the view's part, row-major over its axes 1.."""
    strides, cols = n.params["strides"], [n.params["offset"]]
    for k in range(1, len(n.shape)):
        steps = idx if k == axis else range(n.shape[k])
        cols = [c + i * strides[k] for c in cols for i in steps]
    return cols


# ---------------------------------------------------------------- local: a rank's node
def local(n: Node, srcs: list[Node], sel: Sel, src_sels: list[Sel | None], name: str | None) -> Node:
    """n as one rank computes it from its sources' parts `srcs` (held as `src_sels`)."""
    params = n.params.as_dict()
    if n.op == "reshape":
        params["shape"] = local_shape(n.shape, sel)
    elif n.op == "view":
        params.update(_local_view(n, sel, src_sels[0]))
    out = make(n.op, *srcs, name=name, **params)
    if n.types is None and out.shape != local_shape(n.shape, sel):
        raise GraphError(f"shard-tp: rank node {out.describe()} of {n.describe()} is not the part {sel[0]}")
    return out


def local_shape(shape: tuple[int, ...], sel: Sel) -> tuple[int, ...]:
    return shape[:sel[0]] + (len(sel[1]),) + shape[sel[0] + 1:]


def _local_view(n: Node, sel: Sel, src_sel: Sel | None) -> dict:
    """Strides and offset of the same view over the rank's columns: they must stay an affine map."""
    held = {c: i for i, c in enumerate(src_sel[1])}
    shape = local_shape(n.shape, sel)
    cols = [held[c] for c in _view_col_map(n, sel[0], sel[1])]
    offset = cols[0]
    strides = [len(held)]
    for k in range(1, len(shape)):
        step = math.prod(shape[k + 1:])
        strides.append(cols[step] - offset if shape[k] > 1 else n.params["strides"][k])
    want = [offset]
    for k in range(1, len(shape)):
        want = [c + i * strides[k] for c in want for i in range(shape[k])]
    if want != cols or min(strides) < 0:
        raise Reject(n, "the view's columns on a rank are not evenly strided")
    return {"shape": shape, "strides": tuple(strides), "offset": offset}
