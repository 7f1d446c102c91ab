"""Cleanup: drop identity ops and unreachable nodes (dce); merge duplicate nodes (cse)."""

from __future__ import annotations

from typing import Any

from graphir.builder import contiguous_strides, is_state_chain
from graphir.ir import Graph, Node
from graphir.ops import OPS
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, rewrite

VIEW_OPS = {name for name, d in OPS.items() if d.view}


def _is_identity(n: Node) -> bool:
    if n.op not in ("reshape", "permute", "view", "cont", "cast", "scale") or n.src[0].dtype == "tuple":
        return False
    x, p = n.src[0], n.params
    if (x.shape, x.dtype) != (n.shape, n.dtype):
        return False
    return {
        "reshape": True,
        "permute": tuple(p.get("axes", ())) == tuple(range(len(x.shape))),
        "view": p.get("offset") == 0 and tuple(p.get("strides", ())) == contiguous_strides(x.shape),
        # a cont of a view is the copy that makes it contiguous; of anything else it is a no-op
        "cont": x.op not in VIEW_OPS,
        "cast": True,
        "scale": p.get("s") == 1.0 and p.get("b") == 0.0,
    }[n.op]


def _identity(n: Node, rw: Rewriter) -> Node | None:
    # Reads of State stay: dropping them would turn their users into readers of the buffer,
    # which the in-place write-order rule may forbid (and a cont there is a snapshot).
    return n if _is_identity(n) and not is_state_chain(n.src[0]) else None


def _forward(n: Node, rw: Rewriter) -> Node:
    rw.matched(n, "removed")
    return rw.new(n.src[0])


# dce: an identity op's users read its source; nodes no root reaches are never rebuilt.
@register_pass("dce", "remove identity ops (same-shape reshape/view, identity permute, cont of a non-view, "
                      "same-dtype cast, scale by 1) and nodes no output or update reaches")
def dce(graph: Graph) -> Graph:
    return rewrite(graph, [(_identity, _forward)])


def _cse_key(n: Node, rw: Rewriter) -> Any:
    if n.op == "const":
        return ("const", n.dtype, n.shape, n.params)
    if n.is_leaf:
        return (n.op, n.name)  # one Param/Input/State per name, however many times a builder asked
    return (n.op, n.dtype, n.shape, n.params, n.types, tuple(id(rw.new(s)) for s in n.src))


def _cse_rules() -> list:
    seen: dict[Any, Node] = {}

    def pattern(n: Node, rw: Rewriter) -> Node | None:
        # An in-place write is an event, not a value: two equal writes both happen.
        return None if OPS[n.op].writes else n

    def merge(n: Node, rw: Rewriter) -> Node:
        node = rw.rebuild(n)
        first = seen.setdefault(_cse_key(n, rw), node)
        if first is not node:
            rw.matched(n, f"merged into {first.name or first.op}")
        return first

    return [(pattern, merge)]


# cse: same op, type, params and (already merged) sources compute the same value; names don't matter.
@register_pass("cse", "merge structurally identical nodes (names ignored except on leaves); never in-place writes")
def cse(graph: Graph) -> Graph:
    return rewrite(graph, _cse_rules())
