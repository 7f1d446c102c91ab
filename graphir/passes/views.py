"""fold-reshape-view: a reshape, permute or view of a view becomes one strided view of the base.

After stack-projections, q = reshape(cols(y, 0, n_q), [n, heads, head_dim]) reshapes a
non-contiguous view; as one view (strides [row, head_dim, 1]) no backend has to copy it.
Qwen3.5's gated q takes views of such a column view (q and gate interleaved per head): as views
of the base, the column view itself has no reader left and is never gathered.
"""

from __future__ import annotations

from graphir.builder import contiguous_strides, is_state_chain, merge_axes
from graphir.ir import Graph, Node
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, rewrite

Layout = tuple[tuple[int, ...], tuple[int, ...], int]  # (shape, strides, offset) in the base's elements


def reshape_strides(shape: tuple[int, ...], strides: tuple[int, ...],
                    new_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides that show a (shape, strides) view as new_shape without a copy, or None (numpy's
    _attempt_nocopy_reshape): each run of old axes merged or split must itself be contiguous."""
    if 0 in shape:
        return None
    old = [(n, s) for n, s in zip(shape, strides, strict=True) if n != 1]
    new = list(new_shape)
    out = [1] * len(new)
    oi, ni = 0, 0
    while oi < len(old) and ni < len(new):
        oj, nj = oi + 1, ni + 1
        o_size, n_size = old[oi][0], new[ni]
        while o_size != n_size:  # grow whichever side is smaller until the runs cover equal sizes
            if n_size < o_size:
                n_size, nj = n_size * new[nj], nj + 1
            else:
                o_size, oj = o_size * old[oj][0], oj + 1
        if any(old[k][1] != old[k + 1][0] * old[k + 1][1] for k in range(oi, oj - 1)):
            return None
        out[nj - 1] = old[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            out[k - 1] = out[k] * new[k]
        oi, ni = oj, nj
    return tuple(out)


def compose_strides(inner: Layout, shape: tuple[int, ...],
                    strides: tuple[int, ...], offset: int) -> tuple[tuple[int, ...], int] | None:
    """(strides, offset) over the base of a view (shape, strides, offset) taken over the row-major
    order of an inner view (shape, strides, offset) of that base, or None. Each outer axis steps
    one inner axis (the outermost whose row-major stride divides it); exact when no index of the
    outer view carries from one inner axis into the next (each inner digit stays below its size)."""
    ishape, istrides, ioffset = _merged(*inner)
    if 0 in ishape or 0 in shape or min(strides, default=0) < 0 or offset >= _prod(ishape):
        return None
    cs = contiguous_strides(ishape)
    digits, rest = [], offset
    for c in cs:  # offset's digits in the inner view's mixed radix
        digits.append(rest // c)
        rest %= c
    reach = list(digits)  # the largest digit each inner axis takes
    out = []
    for n, s in zip(shape, strides, strict=True):
        j = next((j for j, c in enumerate(cs) if ishape[j] > 1 and s % c == 0), None) if s else None
        if j is None:  # a broadcast axis, or a size-1 axis whose stride is never stepped
            if n > 1 and s:
                return None
            out.append(0)
            continue
        reach[j] += (n - 1) * (s // cs[j])
        out.append(s // cs[j] * istrides[j])
    if any(r >= size for r, size in zip(reach, ishape, strict=True)):
        return None
    return tuple(out), ioffset + sum(d * st for d, st in zip(digits, istrides, strict=True))


def _merged(shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> Layout:
    """The same layout with size-1 axes dropped and adjacent axes merged where their strides compose
    (the same row-major order, fewer digits: a reshape across merged rows then composes too)."""
    dims = merge_axes(shape, strides)
    return tuple(d[0] for d in dims) or (1,), tuple(d[1] for d in dims) or (1,), offset


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _view_of_view(n: Node, rw: Rewriter) -> tuple[Node, Node, tuple[int, ...], int] | None:
    if n.op not in ("reshape", "permute", "view"):
        return None
    v = rw.new(n.src[0])  # the source as this walk rebuilt it: a chain of views folds in one walk
    if v.op != "view" or is_state_chain(v.src[0]):
        return None  # views of State stay as built: a second reader of the buffer would reorder writes
    strides, offset = v.params["strides"], v.params["offset"]
    if n.op == "permute":
        return n, v, tuple(strides[a] for a in n.params["axes"]), offset
    if n.op == "view":
        p = n.params
        composed = compose_strides((v.shape, tuple(strides), offset), n.shape, tuple(p["strides"]), p["offset"])
        if composed is None:
            rw.reject(n, f"view strides {list(p['strides'])} offset {p['offset']} of view strides {list(strides)} "
                         "do not compose into one view")
            return None
        return n, v, *composed
    new = reshape_strides(v.shape, strides, n.shape)
    if new is None:
        rw.reject(n, f"view strides {list(strides)} cannot be reshaped to {list(n.shape)} without a copy")
        return None
    return n, v, new, offset


def _fold(m: tuple[Node, Node, tuple[int, ...], int], rw: Rewriter) -> Node:
    n, v, strides, offset = m
    rw.matched(n, "view")
    return rw.make("view", v.src[0], name=n.name, shape=n.shape, strides=strides, offset=offset)


# A view of a view is still a view: fold the layout change into the strides.
@register_pass("fold-reshape-view", "reshape/permute/view of a view -> one view of the base with combined strides, "
                                    "when the result needs no copy")
def fold_reshape_view(graph: Graph) -> Graph:
    return rewrite(graph, [(_view_of_view, _fold)])
