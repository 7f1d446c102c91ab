"""swiglu-split: mul(silu(a), b) -> swiglu_split(a, b), the gated FFN activation as one op."""

from __future__ import annotations

from graphir.ir import Graph, Node
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, rewrite


def _match(n: Node, rw: Rewriter) -> tuple[Node, Node, Node] | None:
    if n.op != "mul":
        return None
    for silu, b in (n.src, n.src[::-1]):  # either operand order
        if silu.op != "silu":
            continue
        if silu.shape != b.shape or silu.dtype != b.dtype:
            rw.reject(n, f"silu {list(silu.shape)} and gate {list(b.shape)} differ (broadcast is not fused)")
            return None
        return n, silu, b
    return None


def _fuse(m: tuple[Node, Node, Node], rw: Rewriter) -> Node:
    n, silu, b = m
    rw.matched(n, "swiglu_split")
    return rw.make("swiglu_split", silu.src[0], b, name=n.name)


# silu(gate) is read once, inside the product: it need not be stored. If silu has other users
# it is still computed for them; the product no longer waits for it.
@register_pass("swiglu-split", "mul(silu(a), b) (either order) -> swiglu_split(a, b)")
def swiglu_split(graph: Graph) -> Graph:
    return rewrite(graph, [(_match, _fuse)])
