"""shard-tp{n=N}: tensor parallelism (Megatron-style) as one graph holding all N ranks' branches.

A *region* ends at a row-parallel mul_mat R = mul_mat(W, y): each rank multiplies its columns of W
by its part of y, and an `all_reduce` sums the N partial products into R's value. The part of y
each rank holds is pulled back through the ops that made y (shard_tp_rules.back) until it reaches
column-parallel mul_mats of a shared input (rank r keeps W's rows that make its part). So
attention splits by heads (q|gate rows, KV heads, the KV cache), the FFN by d_ff columns, a
Gated DeltaNet by value heads (its conv channels, gates and recurrent state follow), all from one
rule set, with no model family named. Norms and residuals stay shared (computed once: every rank
would compute the same values).

How a region is cut: the head op in it (flash_attn, gated_delta_net) splits by heads: whole KV
groups per rank when there are at least N KV heads (uneven when they do not divide: 3 KV heads on
2 ranks give 2 and 1), else query heads split evenly and a KV head is replicated on every rank
that reads it (weights and cache rows duplicated). A region without a head op (the FFN) splits
y's columns evenly, in whole blocks of W's quantized type. A region that cannot be cut (a query
range reading KV heads in unequal groups, an op without a rule) is left whole and its reason is
in the coverage report.

Every other mul_mat with a 2-D Param weight (the LM head) splits by output rows (vocabulary rows)
into N equal pieces joined by `all_gather`; rows that N does not divide stay whole (every rank computes
them). The embedding is shared whole.

Weights and State of a rank: see graphir/tp.py (slice-named Params, `@tp<r>of<N>` States).
Run it on a model graph before the default fusions: `shard-tp{n=2},default`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from graphir.builder import g, make
from graphir.dtypes import DTYPES
from graphir.errors import GraphError
from graphir.ir import Graph, Node
from graphir.passes import register_pass
from graphir.passes import shard_tp_rules as R
from graphir.passes.report import record_match, record_reject
from graphir.passes.rewrite import check_options
from graphir.passes.shard_tp_plan import seed_parts
from graphir.tp import ranges, rank_graph, slice_name, state_name


def _projection(n: Node) -> bool:
    return n.op == "mul_mat" and n.src[0].op == "param" and len(n.src[0].shape) == 2


@dataclass
class Region:
    out: Node  # the row-parallel mul_mat
    sels: dict[int, list] = field(default_factory=dict)  # id(node) -> per rank Sel (None for multi-output ops)
    nodes: dict[int, Node] = field(default_factory=dict)
    asked: dict[int, list] = field(default_factory=dict)  # id(node) -> per rank, the parts back() asked of its sources
    note: str = ""


class _Planner:
    """Pulls a rank split of y back through its producers, in reverse topological order."""

    def __init__(self, graph: Graph, n: int):
        self.graph, self.n = graph, n
        self.users = graph.users()
        self.order = graph.ids()
        self.updates = {id(u) for u in graph.updates}

    def plan(self, out: Node) -> Region:
        y = out.src[1]
        parts, note = seed_parts(out, y, self.n, self.users)
        reg = Region(out, note=note)
        demands: dict[int, list[list]] = {}
        items: dict[int, list[dict]] = {}  # multi-output node -> per rank {index: Sel}
        heap: list[tuple[int, int]] = []
        nodes = {id(y): y}

        def ask(node: Node, per_rank: list) -> None:
            if id(node) not in demands:
                demands[id(node)] = []
                nodes[id(node)] = node
                heapq.heappush(heap, (-self.order[id(node)], id(node)))
            demands[id(node)].append(per_rank)

        ask(y, [(R.last(y), p) for p in parts])
        while heap:
            node = nodes[heapq.heappop(heap)[1]]
            if node.types is not None:
                self._multi(reg, node, items.get(id(node), []), ask)
                continue
            sels = self._merge(node, demands[id(node)])
            self._add(reg, node, sels)
            if node.is_leaf:
                if node.op not in ("param", "state"):
                    raise R.Reject(node, f"{node.op} {node.name!r} would have to be split across ranks")
                continue
            if node.op == "item":
                per = items.setdefault(id(node.src[0]), [{} for _ in range(self.n)])
                for r, s in enumerate(sels):
                    per[r][node.params["index"]] = s
                reg.asked[id(node)] = [[None] for _ in range(self.n)]
                if id(node.src[0]) not in demands:
                    ask(node.src[0], [None] * self.n)
                continue
            self._back(reg, node, [R.back(node, s) for s in sels], ask)
        self._check_users(reg, out)
        return reg

    def _multi(self, reg: Region, node: Node, per_rank: list[dict], ask: Callable) -> None:
        complete = [R.complete_items(node, asked) for asked in per_rank]
        reg.nodes[id(node)], reg.sels[id(node)] = node, [None] * self.n
        for u in self.users[id(node)]:  # results nobody in the region asked for (a State write-back) follow
            if u.op == "item" and id(u) not in reg.nodes:
                self._add(reg, u, [c[u.params["index"]] for c in complete])
                reg.asked[id(u)] = [[None] for _ in range(self.n)]
                for w in self.users[id(u)]:
                    if w.op != "assign" or id(w) not in self.updates:
                        raise R.Reject(u, f"{node.op}'s result {u.params['index']} is read by {w.op} outside the "
                                          f"split region")
                    self._add(reg, w, [c[u.params["index"]] for c in complete])
                    reg.asked[id(w)] = [[s, s] for s in reg.sels[id(w)]]
                    ask(w.src[0], reg.sels[id(w)])
        self._back(reg, node, [R.back(node, (0, ()), asked) for asked in complete], ask)

    def _back(self, reg: Region, node: Node, asked: list[list], ask: Callable) -> None:
        reg.asked[id(node)] = asked
        for i, s in enumerate(node.src):
            per = [a[i] for a in asked]
            if all(p is None for p in per):
                continue
            if any(p is None for p in per):
                raise R.Reject(node, f"source {i} is split on some ranks only")
            ask(s, per)

    def _merge(self, node: Node, demands: list[list]) -> list:
        """One part per rank from every user's ask: equal asks, or the union for readers that are views."""
        out = []
        for r in range(self.n):
            asks = [d[r] for d in demands]
            if len({a[0] for a in asks}) != 1:
                raise R.Reject(node, f"its users split it on different axes {sorted({a[0] for a in asks})}")
            out.append((asks[0][0], tuple(sorted(set().union(*(a[1] for a in asks)))) if len(set(asks)) > 1
                        else asks[0][1]))
        return out

    def _add(self, reg: Region, node: Node, sels: list) -> None:
        reg.nodes[id(node)], reg.sels[id(node)] = node, sels

    def _check_users(self, reg: Region, out: Node) -> None:
        for node in reg.nodes.values():
            if node.op == "param":
                continue
            for u in self.users[id(node)]:
                if id(u) not in reg.nodes and u is not out:
                    raise R.Reject(node, f"it is also read by {u.op} {u.name or ''} outside the split region")


class _Builder:
    """Builds rank nodes: slice-named Params shared by ranks holding the same slice, one State per rank."""

    def __init__(self, n: int):
        self.n = n
        self.params: dict[str, Node] = {}
        self.states: dict[str, list] = {}  # rank State name -> [unsharded name, axis, [[start, stop], ...], rank]

    def param(self, w: Node, sel: R.Sel) -> Node:
        axis, idx = sel
        d = DTYPES[w.dtype]
        if axis == R.last(w) and d.quantized and any(i % d.block for i in (idx[0], idx[-1] + 1)):
            raise R.Reject(w, f"{w.dtype} splits only at blocks of {d.block} columns; a rank would start at "
                              f"column {idx[0]} and end at {idx[-1] + 1}")
        name = slice_name(w.name, axis, idx)
        if name not in self.params:
            self.params[name] = g.param(name, R.local_shape(w.shape, sel), w.dtype)
        return self.params[name]

    def state(self, s: Node, sel: R.Sel, r: int) -> Node:
        name = state_name(s.name, r, self.n)
        self.states[name] = [s.name, sel[0], [list(span) for span in ranges(sel[1])], r]
        return g.state(name, R.local_shape(s.shape, sel), s.dtype)

    def region(self, reg: Region, order: dict[int, int], shared: Callable[[Node], Node]) -> tuple[list[Node], dict]:
        """Rank nodes of every region node; returns (R's rank products, id(node) -> rank nodes)."""
        locs: dict[int, list[Node]] = {}
        for node in sorted(reg.nodes.values(), key=lambda m: order[id(m)]):
            locs[id(node)] = [self._one(reg, node, r, locs, shared) for r in range(self.n)]
        y = reg.out.src[1]
        w = reg.out.src[0]
        products = [make("mul_mat", self.param(w, (1, reg.sels[id(y)][r][1])), locs[id(y)][r],
                         name=_rank_name(reg.out, r)) for r in range(self.n)]
        return products, locs

    def _one(self, reg: Region, node: Node, r: int, locs: dict, shared: Callable[[Node], Node]) -> Node:
        sel = reg.sels[id(node)][r]
        if node.op == "param":
            return self.param(node, sel)
        if node.op == "state":
            return self.state(node, sel, r)
        held = [reg.sels[id(s)][r] if id(s) in reg.nodes else None for s in node.src]
        for i, (want, have) in enumerate(zip(reg.asked[id(node)][r], held)):
            if want != have and node.op != "view":
                raise R.Reject(node, f"source {i} holds other elements than it reads ({_span(have)} vs {_span(want)})")
        srcs = [locs[id(s)][r] if id(s) in reg.nodes else shared(s) for s in node.src]
        return R.local(node, srcs, sel, held, _rank_name(node, r))


def _rank_name(n: Node, r: int) -> str | None:
    return f"{n.name}@tp{r}" if n.name else None


def _span(sel: R.Sel | None) -> str:
    return "whole" if sel is None else f"axis {sel[0]} [{sel[1][0]}..{sel[1][-1]}] ({len(sel[1])})"


def shard(graph: Graph, n: int) -> Graph:
    """The sharded graph; see the module doc."""
    if n < 1:
        raise GraphError(f"shard-tp: n={n} ranks must be >= 1")
    if "tp" in graph.meta:
        raise GraphError(f"shard-tp: the graph is already sharded over {graph.meta['tp']['ranks']} ranks")
    if n == 1:
        return graph
    planner, order = _Planner(graph, n), graph.ids()
    regions: dict[int, Region] = {}
    members: set[int] = set()
    why: dict[int, str] = {}
    for node in graph.nodes():
        if not _projection(node) or id(node) in members:
            continue
        try:
            reg = planner.plan(node)
            if members & set(reg.nodes):
                raise R.Reject(node, "its region overlaps another region")
            _Builder(n).region(reg, order, lambda s: s)  # a dry run: every rank node builds
        except R.Reject as e:
            why[id(node)] = f"not row-parallel: {e.node.op} {e.node.name or ''}: {e.reason}"
            continue
        regions[id(node)] = reg
        members |= set(reg.nodes)
    # rows in n equal pieces only: one rank's all_gather joins equal pieces (graphir/tp.py), so a head of 272 rows
    # on 3 ranks stays whole, computed by every rank, rather than failing in the rank graph
    gathered = {id(m) for m in graph.nodes() if _projection(m) and id(m) not in members and id(m) not in regions
                and m.src[0].shape[0] % n == 0}
    _report(graph, regions, members, gathered, why, n)
    return _rebuild(graph, n, regions, members, gathered)


def _report(graph: Graph, regions: dict, members: set, gathered: set, why: dict, n: int) -> None:
    for m in graph.nodes():
        if not _projection(m):
            continue
        if id(m) in regions:
            record_match(m, f"row-parallel + all_reduce over {n} ranks ({regions[id(m)].note})")
        elif id(m) in members:
            record_match(m, f"column-parallel ({m.src[0].name} rows split)")
        elif id(m) in gathered:
            record_match(m, f"{m.src[0].name} rows split + all_gather ({why.get(id(m), '')})")
        else:
            reason = f" ({why[id(m)]})" if id(m) in why else ""
            record_reject(m, f"{m.src[0].name}: {m.src[0].shape[0]} output rows are not {n} equal pieces; left whole"
                             f"{reason}")


def _rebuild(graph: Graph, n: int, regions: dict, members: set, gathered: set) -> Graph:
    b = _Builder(n)
    order = graph.ids()
    memo: dict[int, Node] = {}
    rank_nodes: dict[int, list[Node]] = {}

    def shared(s: Node) -> Node:
        if id(s) not in memo:
            raise GraphError(f"shard-tp: {s.describe()} is needed by a rank before it is built")
        return memo[id(s)]

    for node in graph.nodes():
        if id(node) in regions:
            products, locs = b.region(regions[id(node)], order, shared)
            rank_nodes.update(locs)
            memo[id(node)] = make("all_reduce", *products, name=node.name, ranks=n)
        elif id(node) in members:
            continue
        elif id(node) in gathered:
            w, x = node.src
            rows = [tuple(range(w.shape[0] * r // n, w.shape[0] * (r + 1) // n)) for r in range(n)]
            pieces = [make("mul_mat", b.param(w, (0, rows[r])), memo[id(x)], name=_rank_name(node, r))
                      for r in range(n)]
            memo[id(node)] = make("all_gather", *pieces, name=node.name, axis=R.last(node), ranks=n)
        else:
            src = tuple(memo[id(s)] for s in node.src)
            memo[id(node)] = node if all(a is c for a, c in zip(src, node.src)) else node.replace(src=src)
    updates = []
    for u in graph.updates:
        updates += rank_nodes[id(u)] if id(u) in members else [memo[id(u)]]
    meta = {**graph.meta, "tp": {"ranks": n, "states": b.states}}
    return Graph({k: memo[id(v)] for k, v in graph.outputs.items()}, updates, meta)


@register_pass("shard-tp", "tensor parallel over n ranks in one graph: heads / FFN columns split, "
                           "all_reduce after row-parallel mul_mats, LM head rows split + all_gather")
@dataclass(frozen=True)
class ShardTP:
    n: int = 2  # ranks
    rank: int = -1  # >= 0: only what that rank runs (graphir.tp.rank_graph), e.g. to dump it

    def __post_init__(self) -> None:
        check_options(1, n=self.n)
        check_options(-1, rank=self.rank)  # -1: every rank

    def __call__(self, graph: Graph) -> Graph:
        sharded = shard(graph, self.n)
        return sharded if self.rank < 0 or self.n == 1 else rank_graph(sharded, self.rank)
