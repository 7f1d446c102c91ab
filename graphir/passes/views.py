"""fold-reshape-view: a reshape or permute of a view becomes one strided view of the base.

After stack-projections, q = reshape(cols(y, 0, n_q), [n, heads, head_dim]) reshapes a
non-contiguous view; as one view (strides [row, head_dim, 1]) no backend has to copy it.
"""

from __future__ import annotations

from graphir.builder import is_state_chain
from graphir.ir import Graph, Node
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, rewrite


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


def _view_of_view(n: Node, rw: Rewriter) -> tuple[Node, Node, tuple[int, ...]] | None:
    if n.op not in ("reshape", "permute") or n.src[0].op != "view" or is_state_chain(n.src[0].src[0]):
        return None  # views of State stay as built: a second reader of the buffer would reorder writes
    v = n.src[0]
    strides = v.params["strides"]
    if n.op == "permute":
        return n, v, tuple(strides[a] for a in n.params["axes"])
    new = reshape_strides(v.shape, strides, n.shape)
    if new is None:
        rw.reject(n, f"view strides {list(strides)} cannot be reshaped to {list(n.shape)} without a copy")
        return None
    return n, v, new


def _fold(m: tuple[Node, Node, tuple[int, ...]], rw: Rewriter) -> Node:
    n, v, strides = m
    rw.matched(n, "view")
    return rw.make("view", v.src[0], name=n.name, shape=n.shape, strides=strides, offset=v.params["offset"])


# A view of a view is still a view: fold the layout change into the strides.
@register_pass("fold-reshape-view", "reshape/permute of a view -> one view of the base with combined strides, "
                                    "when the reshape needs no copy")
def fold_reshape_view(graph: Graph) -> Graph:
    return rewrite(graph, [(_view_of_view, _fold)])
