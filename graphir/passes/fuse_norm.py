"""fuse-add-rms-norm-mul: the residual add, the next block's rms_norm and its weight in one op."""

from __future__ import annotations

from dataclasses import dataclass

from graphir.builder import make
from graphir.ir import Graph, Node, toposort
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, rewrite


def norm_times_weight(mul: Node) -> tuple[Node, Node] | None:
    """(norm, w) of mul = rms_norm(x) * w in either operand order (the first rms_norm source when both
    are), or None when neither source is an rms_norm."""
    norm = next((s for s in mul.src if s.op == "rms_norm"), None)
    if norm is None:
        return None
    return norm, mul.src[1] if mul.src[0] is norm else mul.src[0]


@dataclass
class AddNormMul:
    add: Node
    norm: Node
    mul: Node
    weight: Node


def _match(add: Node, rw: Rewriter) -> AddNormMul | None:
    if add.op != "add":
        return None
    norms = [u for u in rw.users(add) if u.op == "rms_norm"]
    if not norms:
        return None
    if len(norms) > 1:
        rw.reject(add, f"{len(norms)} rms_norms read it; only one can be fused")
        return None
    norm = norms[0]
    mul = rw.sole_user(norm)
    if mul is None:
        rw.reject(add, f"its rms_norm {norm.name or ''} has another user (or is an output); the raw norm is needed")
        return None
    if mul.op != "mul":
        rw.reject(add, f"its rms_norm feeds {mul.op}, not mul")
        return None
    weight = mul.src[1] if mul.src[0] is norm else mul.src[0]
    if weight is norm or mul.shape != norm.shape:
        rw.reject(add, "the mul after its rms_norm is not norm * weight with norm's shape")
        return None
    if not weight.is_leaf and any(n is add for n in toposort([weight])):
        rw.reject(add, "the norm weight is computed from the add itself")
        return None
    return AddNormMul(add, norm, mul, weight)


def _fuse(m: AddNormMul, rw: Rewriter) -> Node:
    # The add is replaced by result 1 (every other reader still needs the residual);
    # the mul, later in topological order, by result 0.
    fused = rw.make("add_rms_norm_mul", m.add.src[0], m.add.src[1], m.weight, name=m.norm.name,
                    eps=m.norm.params["eps"])
    rw.replace(m.mul, make("item", fused, index=0, name=m.mul.name))
    rw.matched(m.mul, "add_rms_norm_mul")
    return make("item", fused, index=1, name=m.add.name)


# One kernel reads the residual stream once and writes both the normalized input and the residual.
@register_pass("fuse-add-rms-norm-mul", "mul(rms_norm(add(a, b)), w) -> add_rms_norm_mul(a, b, w) with two results: "
                                        "the normalized value and the residual a + b for the add's other users")
def fuse_add_rms_norm_mul(graph: Graph) -> Graph:
    return rewrite(graph, [(_match, _fuse)])


def _match_gated(gate: Node, rw: Rewriter) -> tuple[Node, Node, Node, Node] | None:
    """swiglu_split(z, mul(rms_norm(x), w)) -> (gate, z, norm, w)."""
    if gate.op != "swiglu_split" or gate.src[1].op != "mul":
        return None
    z, mul = gate.src
    parts = norm_times_weight(mul)
    if parts is None:
        return None
    norm, w = parts
    if mul.shape != norm.shape or w.shape != norm.shape[-1:] or z.shape != norm.shape:
        rw.reject(gate, "its mul is not rms_norm(x) * w with w over the last axis, or z is not shaped like x")
        return None
    if rw.sole_user(norm) is not mul or rw.sole_user(mul) is not gate:
        rw.reject(gate, "the norm or the scaled norm has another reader; it must stay")
        return None
    return gate, z, norm, w


def _fuse_gated(m: tuple[Node, Node, Node, Node], rw: Rewriter) -> Node:
    gate, z, norm, w = m
    rw.matched(gate, "rms_norm_mul_gate")
    return rw.make("rms_norm_mul_gate", norm.src[0], w, z, name=gate.name, eps=norm.params["eps"])


# Qwen3.5's gated output norm reads each head's row once for its statistics and once to scale and
# gate it: one kernel instead of three, and no round trips of the intermediate rows.
@register_pass("fuse-rms-norm-mul-gate", "swiglu_split(z, mul(rms_norm(x), w)) with no other reader of the norm "
                                         "-> rms_norm_mul_gate(x, w, z)")
def fuse_rms_norm_mul_gate(graph: Graph) -> Graph:
    return rewrite(graph, [(_match_gated, _fuse_gated)])
