"""swiglu-split: mul(silu(a), b) -> swiglu_split(a, b), the gated FFN activation as one op."""

from __future__ import annotations

from graphir.builder import contiguous_strides
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


def _is_half(view: Node, mm: Node, offset: int, half: int) -> bool:
    """view is mm[..., offset:offset + half] of a row-major mm."""
    p = view.params
    return (view.op == "view" and view.src[0] is mm and p["offset"] == offset
            and tuple(p["shape"]) == mm.shape[:-1] + (half,) and tuple(p["strides"]) == contiguous_strides(mm.shape))


def _match_stacked(n: Node, rw: Rewriter) -> tuple[Node, Node] | None:
    if n.op != "swiglu_split" or n.src[0].op != "view" or n.src[0].src[0].op != "mul_mat":
        return None
    mm, half = n.src[0].src[0], n.shape[-1]
    if not (mm.shape[-1] == 2 * half and _is_half(n.src[0], mm, 0, half) and _is_half(n.src[1], mm, half, half)):
        rw.reject(n, "its operands are not the first and second halves of one mul_mat's rows")
        return None
    if rw.sole_user(n.src[0]) is not n or rw.sole_user(n.src[1]) is not n or len(rw.users(mm)) != 2 \
            or any(r is mm for r in rw.graph.roots):
        rw.reject(n, "the stacked product or one of its halves has another reader; it must be stored")
        return None
    return n, mm


def _fuse_stacked(m: tuple[Node, Node], rw: Rewriter) -> Node:
    n, mm = m
    rw.matched(n, "mul_mat_swiglu")
    return rw.make("mul_mat_swiglu", mm.src[0], mm.src[1], name=n.name)


# After stack-projections (gate|up one weight) and swiglu-split: the activation is read off the
# GEMV's two accumulators, so the [.., 2F] product is never stored and the step has one kernel less.
@register_pass("fuse-mul-mat-swiglu", "swiglu_split(y[.., :F], y[.., F:]) of y = mul_mat(w, x) read by nothing else "
                                      "-> mul_mat_swiglu(w, x)")
def fuse_mul_mat_swiglu(graph: Graph) -> Graph:
    return rewrite(graph, [(_match_stacked, _fuse_stacked)])
