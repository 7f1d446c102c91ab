"""Rope fusions: rope straight into the KV cache, and Qwen3's per-head q/k norm before rope."""

from __future__ import annotations

from graphir.ir import Graph, Node
from graphir.passes import register_pass
from graphir.passes.fuse_norm import norm_times_weight
from graphir.passes.rewrite import Rewriter, rewrite


def _match_rope_set_rows(n: Node, rw: Rewriter) -> tuple[Node, Node] | None:
    if n.op != "set_rows":
        return None
    src = n.src[1]
    if src.op == "reshape" and src.shape[0] == src.src[0].shape[0]:  # [n, heads, d] -> [n, heads * d]
        if rw.sole_user(src) is not n:
            rw.reject(n, f"the reshape of its rows has another user ({len(rw.users(src))} readers)")
            return None
        src = src.src[0]
    if src.op not in ("rope", "rms_norm_mul_rope"):
        return None
    reader = n if src is n.src[1] else n.src[1]
    if rw.sole_user(src) is not reader:
        others = [u.name or u.op for u in rw.users(src)]
        rw.reject(n, f"the roped rows {src.name or 'rope'} have other users {others}; read them through the cache")
        return None
    return n, src


def _fuse_rope_set_rows(m: tuple[Node, Node], rw: Rewriter) -> Node:
    n, rope = m
    fused = "rope_set_rows" if rope.op == "rope" else "rms_norm_mul_rope_set_rows"
    rw.matched(n, fused)
    return rw.make(fused, n.src[0], *rope.src, n.src[2], name=n.name, **rope.params.as_dict())


# Roped K is written to the cache and read only through it: never store it anywhere else. Qwen3's
# K, already normed and roped in one op by fuse-qk-norm-rope, goes to the cache from the same kernel.
@register_pass("fuse-rope-set-rows", "set_rows(cache, rope(x, pos), idx) where the rope has no other user "
                                     "-> rope_set_rows(cache, x, pos, idx), in place; the same from "
                                     "rms_norm_mul_rope -> rms_norm_mul_rope_set_rows")
def fuse_rope_set_rows(graph: Graph) -> Graph:
    return rewrite(graph, [(_match_rope_set_rows, _fuse_rope_set_rows)])


def _match_norm_rope(n: Node, rw: Rewriter) -> tuple[Node, Node, Node, Node] | None:
    if n.op != "rope" or n.src[0].op != "mul":
        return None
    mul = n.src[0]
    parts = norm_times_weight(mul)
    if parts is None:
        return None
    norm, weight = parts
    if rw.sole_user(mul) is not n or rw.sole_user(norm) is not mul:
        rw.reject(n, "the normed (or weighted) q/k has another user; it must stay materialized")
        return None
    if mul.shape != norm.shape or not weight.is_leaf:
        rw.reject(n, "the mul is not rms_norm(x) * weight with a leaf weight")
        return None
    return n, norm, weight, mul


def _fuse_norm_rope(m: tuple[Node, Node, Node, Node], rw: Rewriter) -> Node:
    rope, norm, weight, _ = m
    rw.matched(rope, "rms_norm_mul_rope")
    return rw.make("rms_norm_mul_rope", norm.src[0], weight, rope.src[1], name=rope.name,
                eps=norm.params["eps"], **rope.params.as_dict())


# Qwen3 normalizes each head of q and k before rope; one pass over the head does all three.
@register_pass("fuse-qk-norm-rope", "rope(rms_norm(x) * w, pos) with single-use intermediates "
                                    "-> rms_norm_mul_rope(x, w, pos)")
def fuse_qk_norm_rope(graph: Graph) -> Graph:
    return rewrite(graph, [(_match_norm_rope, _fuse_norm_rope)])
