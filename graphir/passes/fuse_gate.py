"""fuse-mul-sigmoid: mul(x, sigmoid(g)) -> mul_sigmoid(x, g), a sigmoid-gated product as one op."""

from __future__ import annotations

from graphir.ir import Graph, Node
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, rewrite


def _match(n: Node, rw: Rewriter) -> tuple[Node, Node, Node] | None:
    if n.op != "mul":
        return None
    blocked = None
    for sig, x in (n.src, n.src[::-1]):  # either operand order: a product commutes exactly
        if sig.op != "sigmoid":
            continue
        if sig.shape != x.shape or sig.dtype != x.dtype:
            rw.reject(n, f"sigmoid {list(sig.shape)} {sig.dtype} and x {list(x.shape)} {x.dtype} differ "
                         "(broadcast or mixed dtypes are not fused)")
            return None
        if rw.sole_user(sig) is n:
            return n, sig, x
        blocked = sig
    if blocked is not None:
        rw.reject(n, f"sigmoid {blocked.name or ''} has another reader; it must stay stored")
    return None


def _fuse(m: tuple[Node, Node, Node], rw: Rewriter) -> Node:
    n, sig, x = m
    rw.matched(n, "mul_sigmoid")
    return rw.make("mul_sigmoid", x, sig.src[0], name=n.name)


# Qwen3.5's gated attention output, attn * sigmoid(gate): the gate is a strided view of the q
# projection, read once in place by one kernel, instead of a gather, a sigmoid and a mul. Only
# when sigmoid(g) has no other reader: otherwise it is stored anyway and the product saves nothing.
@register_pass("fuse-mul-sigmoid", "mul(x, sigmoid(g)) (either order, same shape and dtype, the sigmoid read by "
                                   "nothing else) -> mul_sigmoid(x, g)")
def fuse_mul_sigmoid(graph: Graph) -> Graph:
    return rewrite(graph, [(_match, _fuse)])
