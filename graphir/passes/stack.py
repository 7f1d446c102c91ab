"""stack-projections: mul_mats that read one x through different weights become one mul_mat.

    q = mul_mat(wq, x); k = mul_mat(wk, x); v = mul_mat(wv, x)
 -> y = mul_mat(concat(concat(wq, wk), wv, axis=0), x);  q, k, v = cols(y, 0, nq), cols(y, nq, nk), ...

The stacked weight is built from Params only, so a backend computes it once and caches it.
One launch instead of three, and x is read once (the decode mat-vec is bandwidth bound).

Biased projections (Qwen2's q, k, v: add(mul_mat(w, x), b), b a 1-D Param of w's rows) stack their
biases the same way, so the group adds one stacked bias and the views are taken of that sum:

    y = add(mul_mat(concat(wq, wk, wv), x), concat(bq, bk, bv));  q, k, v = cols(y, ...)

The views then stay views of one tensor (fold-reshape-view and the rope/KV-write fusions read them in
place, as for Llama); an add per view would read three strided views and write three copies. When only
some projections of a group have a bias (or one's product has another reader) the weights still stack
and each bias is added to its view.

Only projections of at most `max_rows` rows of x stack. A prefill matmul is compute bound, so
stacking saves it nothing, while its column views are strided [rows, cols] blocks that a backend
copies before most consumers: on an H200, Qwen3-8B's 4096-token prefill spent 41 of 184 ms in
those copies (q, k, v, gate, up: 5 a layer), more than its attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphir.builder import g
from graphir.ir import Graph, Node
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, check_options, rewrite


def _projection(n: Node) -> bool:
    """mul_mat(w, x) with w a 2-D Param: [n_out, n_in]."""
    return n.op == "mul_mat" and n.src[0].op == "param" and len(n.src[0].shape) == 2


def _label(mm: Node) -> str:
    """A projection's name, or its weight's without ".weight" (model builders often leave mul_mats unnamed)."""
    return mm.name or mm.src[0].name.removesuffix(".weight")


def _group(mm: Node, rw: Rewriter, max_rows: int) -> list[Node] | None:
    """The projections of mm's x that can stack with mm, in topological order (None if < 2 weights)."""
    if not _projection(mm):
        return None
    x, w = mm.src[1], mm.src[0]
    rows = math.prod(x.shape[:-1])
    if rows > max_rows:
        rw.reject(mm, f"{rows} rows of x > max_rows={max_rows}: compute-bound, and its stacked views would be "
                      f"strided copies")
        return None
    siblings = [u for u in dict.fromkeys(rw.users(x)) if u.op == "mul_mat" and u.src[1] is x]
    if len(siblings) < 2:
        return None
    group = [u for u in siblings if _projection(u) and (u.src[0].dtype, u.src[0].shape[-1]) == (w.dtype, w.shape[-1])]
    if len({u.src[0].name for u in group}) < 2:
        other = next(u for u in siblings if u is not mm)
        name = _label(other) if _projection(other) else other.op
        rw.reject(mm, f"no other projection of its x has a 2-D {w.dtype} Param weight "
                      f"(sibling {name} reads {other.src[0].op} {other.src[0].dtype})")
        return None
    return sorted(group, key=lambda u: rw.order[id(u)])


def _concat_rows(leaves: list[Node]) -> Node:
    """The Params stacked on axis 0 (a Param-only subgraph: lowering folds it once), named a+b+c."""
    stacked = leaves[0]
    for w in leaves[1:]:
        stacked = g.concat(stacked, w, axis=0)
    return stacked.replace(name="+".join(w.name for w in leaves))


def _bias_add(mm: Node, rw: Rewriter) -> Node | None:
    """add(mm, b), mm's only reader, with b a 1-D Param of mm's rows: the bias of a projection."""
    add = rw.sole_user(mm)
    if add is None or add.op != "add" or add.src[0] is not mm:
        return None
    b = add.src[1]
    return add if b.op == "param" and b.shape == (mm.shape[-1],) else None


def _stacked_biases(group: list[Node], rw: Rewriter) -> list[Node] | None:
    """Each projection's bias add, when all have one, over distinct weights, with biases of one dtype. Otherwise
    None, and no rejection: the weights still stack (Qwen3.5's alpha projection adds dt_bias, its group-mates
    nothing; fuse-gated-delta-net-raw reads that add as it is)."""
    adds = [_bias_add(u, rw) for u in group]
    if not all(adds) or len({u.src[0].name for u in group}) < len(group) or len({a.src[1].dtype for a in adds}) > 1:
        return None
    return adds


def _stack(group: list[Node], rw: Rewriter) -> Node:
    weights = list({u.src[0].name: u.src[0] for u in group}.values())  # a weight used twice is stacked once
    y = rw.make("mul_mat", _concat_rows(weights), group[0].src[1], name="+".join(map(_label, group)))
    start = {}
    offset = 0
    for w in weights:
        start[w.name], offset = offset, offset + w.shape[0]

    def views(of: Node, names: list[Node]) -> list[Node]:
        return [g.cols(of, start[u.src[0].name], u.src[0].shape[0], name=n.name) for u, n in zip(group, names)]

    products = views(y, group)
    for u, view in zip(group[1:], products[1:], strict=True):
        rw.replace(u, view)  # the walker puts products[0] in group[0]'s place (the return below)
    adds = _stacked_biases(group, rw)
    if adds:  # one add of the stacked bias; its views stand in for the bias adds (the products go unread)
        biased = rw.make("add", y, _concat_rows([a.src[1] for a in adds]), name=y.name + "+bias")
        for a, view in zip(adds, views(biased, adds), strict=True):
            rw.replace(a, view)
    rw.matched(group[0], "stacked " + " + ".join(map(_label, group)) + (" with their biases" if adds else ""))
    return products[0]


# The first projection of a group (in topological order) builds the stack; the rest become its views.
@register_pass("stack-projections", "mul_mats sharing x (at most max_rows rows) whose weights are 2-D Params of one "
                                    "dtype -> one mul_mat over the weights concatenated on axis 0, then a column "
                                    "view per original")
@dataclass(frozen=True)
class StackProjections:
    max_rows: int = 16  # decode and verify calls: the GPU's mat-vec takes up to 16 rows (its GEMV_MAX_TOKENS)

    def __post_init__(self) -> None:
        check_options(0, max_rows=self.max_rows)

    def __call__(self, graph: Graph) -> Graph:
        return rewrite(graph, [(lambda mm, rw: _group(mm, rw, self.max_rows), _stack)])
