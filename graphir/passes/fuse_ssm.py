"""Recurrent-layer fusions: the conv step with its silu, and the delta rule with its raw gates."""

from __future__ import annotations

from graphir.builder import make
from graphir.ir import Graph, Node
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, rewrite


def _match_conv_silu(conv: Node, rw: Rewriter) -> tuple[Node, Node, Node] | None:
    if conv.op != "ssm_conv":
        return None
    outs = [u for u in rw.users(conv) if u.params["index"] == 0]
    if len(outs) != 1:
        return None
    y = outs[0]
    silu = rw.sole_user(y)
    if silu is None or silu.op != "silu":
        rw.reject(conv, "its output is read raw (not only by one silu); the pre-activation must stay")
        return None
    return conv, y, silu


def _fuse_conv_silu(m: tuple[Node, Node, Node], rw: Rewriter) -> Node:
    conv, y, silu = m
    fused = rw.make("ssm_conv_silu", *conv.src, name=conv.name)
    # item 0 now means silu(y): the raw item (no other reader) and the silu both become it; item 1 follows.
    act = make("item", fused, index=0, name=silu.name)
    rw.replace(y, act)
    rw.replace(silu, act)
    rw.matched(conv, "ssm_conv_silu")
    return fused


# The conv output is read once, by its activation: apply silu as each value is produced.
@register_pass("fuse-ssm-conv-silu", "silu(item(ssm_conv(x, state, w), 0)) with no other reader of the raw conv "
                                     "-> item(ssm_conv_silu(x, state, w), 0); the new state is item 1 as before")
def fuse_ssm_conv_silu(graph: Graph) -> Graph:
    return rewrite(graph, [(_match_conv_silu, _fuse_conv_silu)])


def _gate_parts(gate: Node) -> tuple[Node, Node, Node] | None:
    """(alpha, dt_bias, a_neg) of gate = mul(softplus(add(alpha, dt_bias)), a_neg), either operand order."""
    if gate.op != "mul":
        return None
    for sp, a_neg in (gate.src, gate.src[::-1]):
        if sp.op == "softplus" and sp.src[0].op == "add" and a_neg.shape == gate.shape[-1:]:
            alpha, dt = sp.src[0].src
            if alpha.shape == gate.shape and dt.shape == gate.shape[-1:]:
                return alpha, dt, a_neg
    return None


def _match_gdn_raw(n: Node, rw: Rewriter) -> tuple[Node, tuple[Node, Node, Node], Node] | None:
    if n.op != "gated_delta_net":
        return None
    gate, beta = n.src[3], n.src[4]
    parts = _gate_parts(gate)
    if parts is None:
        rw.reject(n, f"its decay g is {gate.op}, not a_neg * softplus(alpha + dt_bias) with [v_heads] a_neg, dt_bias")
        return None
    if beta.op != "sigmoid":
        rw.reject(n, f"its beta is {beta.op}, not sigmoid(b)")
        return None
    return n, parts, beta.src[0]


def _fuse_gdn_raw(m: tuple[Node, tuple[Node, Node, Node], Node], rw: Rewriter) -> Node:
    n, (alpha, dt, a_neg), b = m
    q, k, v, state = (n.src[i] for i in (0, 1, 2, 5))
    rw.matched(n, "gated_delta_net_raw")
    return rw.make("gated_delta_net_raw", q, k, v, alpha, b, a_neg, dt, state,
                name=n.name, scale=n.params["scale"], steps=n.params["steps"])


# The gates are [tokens, v_heads] elementwise chains: computing them inside the delta-rule kernel
# saves four tiny launches per layer and two round trips through memory.
@register_pass("fuse-gated-delta-net-raw", "gated_delta_net(q, k, v, a_neg * softplus(alpha + dt), sigmoid(b), S) "
                                           "-> gated_delta_net_raw(q, k, v, alpha, b, a_neg, dt, S)")
def fuse_gated_delta_net_raw(graph: Graph) -> Graph:
    return rewrite(graph, [(_match_gdn_raw, _fuse_gdn_raw)])


def _match_gdn_l2(n: Node, rw: Rewriter) -> tuple[Node, Node, Node] | None:
    if n.op != "gated_delta_net_raw" or n.params["l2_eps"] is not None:
        return None
    q, k = n.src[0], n.src[1]
    if q.op != "l2_norm" or k.op != "l2_norm":
        rw.reject(n, f"its q, k are {q.op}, {k.op}, not both l2_norm")
        return None
    if q.params["eps"] != k.params["eps"]:
        rw.reject(n, f"the l2_norms of q and k have different eps ({q.params['eps']}, {k.params['eps']})")
        return None
    if rw.sole_user(q) is not n or rw.sole_user(k) is not n:
        rw.reject(n, "a normalized q or k has another reader; the normalized tensor must stay")
        return None
    return n, q, k


def _fuse_gdn_l2(m: tuple[Node, Node, Node], rw: Rewriter) -> Node:
    n, q, k = m
    rw.matched(n, "gated_delta_net_raw{l2}")
    return rw.make("gated_delta_net_raw", q.src[0], k.src[0], *n.src[2:], name=n.name, scale=n.params["scale"],
                   l2_eps=q.params["eps"], steps=n.params["steps"])


# Each token's q and k are read by the delta-rule kernel anyway: normalizing them there saves two
# launches per layer and the normalized copies' round trip through memory.
@register_pass("fuse-gated-delta-net-l2", "gated_delta_net_raw(l2_norm(q), l2_norm(k), ...), normalized q, k read "
                                          "by nothing else -> gated_delta_net_raw(q, k, ..., l2_eps=eps)")
def fuse_gated_delta_net_l2(graph: Graph) -> Graph:
    return rewrite(graph, [(_match_gdn_l2, _fuse_gdn_l2)])
