"""The pattern-rewrite walker every rewriting pass is built on.

A rule is a pair `(pattern, rewrite)`:
  pattern(node, rw) -> match or None   reads the *old* graph, where `rw.users` is known;
  rewrite(match, rw) -> Node or None   builds the replacement from `rw.new(old)` nodes.
The walker visits old nodes in topological order; the first rule whose rewrite returns a
Node replaces that node, and every later user is rebuilt on the replacement (names kept).
A rewrite that also replaces nodes *after* this one (a fused op's second result standing
in for its residual, the other projections of a stack) says so with `rw.replace(old, new)`.

A rewrite builds its nodes with `rw.make(op, *sources, **params)`, handing it sources from the
*old* graph as they are: each is swapped for its rebuilt counterpart. The walker then checks every
replacement: one that still reaches an old node this walk has replaced (a source wired in by hand,
without `rw.make` or `rw.new`) is a GraphError naming both, never a silently stale subgraph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphir.builder import make
from graphir.errors import GraphError
from graphir.ir import Graph, Node, toposort
from graphir.passes.report import record_match, record_reject

Pattern = Callable[[Node, "Rewriter"], Any]
Rewrite = Callable[[Any, "Rewriter"], "Node | None"]
Rule = tuple[Pattern, Rewrite]


class Rewriter:
    def __init__(self, graph: Graph, rules: list[Rule]):
        self.graph = graph
        self.rules = rules
        self._users = graph.users()
        self.order = graph.ids()  # id(old) -> topological position
        self._memo: dict[int, Node] = {}  # id(old) -> its replacement
        self._visited: set[int] = set()
        self._built: set[int] = set()  # ids of replacement nodes already checked by _check_wiring

    def users(self, old: Node) -> list[Node]:
        """The old graph's readers of `old` (a node reading it twice appears twice)."""
        return self._users[id(old)]

    def sole_user(self, old: Node) -> Node | None:
        """The only reader of `old`, or None; a root (output or update) counts as a reader."""
        us = self.users(old)
        is_root = any(r is old for r in self.graph.roots)
        return us[0] if len(us) == 1 and not is_root else None

    def new(self, old: Node) -> Node:
        """The rebuilt counterpart of an old node, building it (and its sources) on demand."""
        if id(old) not in self._memo:
            for n in toposort([old]):
                if id(n) not in self._visited:
                    self._visit(n)
        return self._memo[id(old)]

    def make(self, opname: str, *sources: Node, name: str | None = None, **params: Any) -> Node:
        """A new node over `sources`: old-graph nodes are swapped for their rebuilt counterparts,
        nodes this rule just made are used as they are."""
        return make(opname, *(self.new(s) if id(s) in self.order else s for s in sources), name=name, **params)

    def _check_wiring(self, old: Node, new: Node) -> None:
        """`new` (the replacement of `old`) must not reach an old node that this walk replaced."""
        built = self._built
        stack, seen = [new], set()
        while stack:
            x = stack.pop()
            if id(x) in seen or id(x) in built:
                continue
            seen.add(id(x))
            if id(x) in self.order:  # an old node: fine only if the walk kept it as it is
                if self._memo.get(id(x), x) is not x:
                    raise GraphError(f"rewrite of {old.describe()}: the replacement reads the old {x.describe()}, "
                                     f"which this pass rebuilt; build it with rw.make(...) (or rw.new(source))")
                continue
            stack.extend(x.src)
        built.update(seen)

    @staticmethod
    def _check_shape(old: Node, new: Node) -> None:
        """The readers of `old` are rebuilt on `new` keeping their own shapes, so a replacement of another shape gave
        a graph that only the verifier caught, naming a reader downstream rather than the rewrite."""
        if new.shape != old.shape or (new.dtype == "tuple") != (old.dtype == "tuple"):
            raise GraphError(f"rewrite of {old.describe()}: the replacement {new.describe()} has another shape; "
                             f"its readers expect {list(old.shape)}")

    def rebuild(self, old: Node) -> Node:
        """`old` with its sources swapped for their rebuilt versions (itself if none changed)."""
        src = tuple(self.new(s) for s in old.src)
        return old if all(a is b for a, b in zip(src, old.src, strict=True)) else old.replace(src=src)

    def replace(self, old: Node, new: Node) -> None:
        """Make `new` stand in for a node the walker has not reached yet."""
        if id(old) in self._visited:
            raise GraphError(f"rewrite: {old.describe()} was already rebuilt; a rule may only replace later nodes")
        self._check_shape(old, new)
        self._visited.add(id(old))
        self._memo[id(old)] = new

    matched = staticmethod(record_match)
    reject = staticmethod(record_reject)

    def _visit(self, n: Node) -> None:
        self._visited.add(id(n))
        for pattern, rewrite_fn in self.rules:
            m = pattern(n, self)
            if m is None:
                continue
            r = rewrite_fn(m, self)
            if r is not None:
                self._check_shape(n, r)
                self._check_wiring(n, r)
                self._memo[id(n)] = r
                return
        self._memo[id(n)] = self.rebuild(n)

    def run(self) -> Graph:
        for n in self.graph.nodes():
            if id(n) not in self._visited:
                self._visit(n)
        g = self.graph
        return Graph({k: self.new(v) for k, v in g.outputs.items()}, [self.new(u) for u in g.updates], g.meta)


def is_weight_matrix(w: Node) -> bool:
    """A 2-D operand computed from Params and Consts only (a Param, or Params stacked by stack-projections,
    which lowering folds): a weight, not an activation, and without batch axes."""
    return len(w.shape) == 2 and all(a.op in ("param", "const") for a in toposort([w]) if a.is_leaf)


def rewrite(graph: Graph, rules: list[Rule]) -> Graph:
    """Apply `rules` once over the graph (one walk, old topological order); see the module doc."""
    return Rewriter(graph, rules).run()


def check_options(minimum: int, **options: int) -> None:
    """A pass's count options at least `minimum` (called from its __post_init__; Pass.configured names the pass):
    a negative row count matched nothing without a word."""
    for key, value in options.items():
        if value < minimum:
            raise GraphError(f"option {key}={value} must be >= {minimum}")
