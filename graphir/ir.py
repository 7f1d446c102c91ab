"""The graph IR: immutable nodes and the graphs they form.

Shape order is numpy's everywhere: outermost axis first, the last axis contiguous.
(ggml's ne[] lists axes innermost first; loaders reverse it once, at the file boundary.)
Activations are [n_tokens, features]; a weight used by mul_mat is [n_out, n_in].

A Node never changes after it is built. A pass "changes" a node by building a new one,
so passes are pure functions and a graph's structure can be hashed for the program cache.
Nodes compare by identity; `Graph.signature()` gives the structural identity.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from graphir.errors import GraphError

LEAF_OPS = ("input", "param", "state", "const")


class Params(tuple):
    """Op parameters: a hashable, ordered tuple of (key, value) pairs read like a dict."""

    def __new__(cls, items: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()) -> Params:
        pairs = items.items() if isinstance(items, Mapping) else items
        return super().__new__(cls, tuple(sorted((k, _freeze(v)) for k, v in pairs)))

    def __getitem__(self, key):  # type: ignore[override]
        if isinstance(key, str):
            for k, v in tuple.__iter__(self):
                if k == key:
                    return v
            raise KeyError(key)
        return tuple.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def as_dict(self) -> dict[str, Any]:
        return dict(tuple.__iter__(self))


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, tuple):
        return tuple(_freeze(x) for x in v)
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalar
        return v.item()
    return v


class Node:
    """One tensor-valued (or tuple-valued) operation. Build nodes with graphir.builder."""

    __slots__ = ("op", "dtype", "shape", "src", "params", "name", "types", "_frozen")

    def __init__(
        self,
        op: str,
        dtype: str,
        shape: tuple[int, ...],
        src: tuple[Node, ...] = (),
        params: Params = Params(),  # noqa: B008 (immutable, so one shared default is safe)
        name: str | None = None,
        types: tuple[tuple[tuple[int, ...], str], ...] | None = None,
    ):
        self.op = op
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.src = tuple(src)
        self.params = params if isinstance(params, Params) else Params(params)
        self.name = name
        # For multi-output ops: ((shape, dtype), ...) of each item; dtype is then "tuple".
        self.types = types
        self._frozen = True

    def __setattr__(self, key: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"Node is immutable; build a new node instead of setting {key!r}")
        object.__setattr__(self, key, value)

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"Node is immutable; cannot delete {key!r}")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_leaf(self) -> bool:
        return self.op in LEAF_OPS

    def describe(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"{self.op}{label} {list(self.shape)} {self.dtype}"

    def __repr__(self) -> str:
        return f"<Node {self.describe()}>"

    def replace(self, **changes: Any) -> Node:
        fields = {k: getattr(self, k) for k in ("op", "dtype", "shape", "src", "params", "name", "types")}
        fields.update(changes)
        return Node(**fields)


def toposort(roots: Iterable[Node]) -> list[Node]:
    """Nodes reachable from roots, every node after its sources (iterative: graphs are deep)."""
    order: list[Node] = []
    state: dict[int, int] = {}  # id -> 1 visiting, 2 done
    for root in roots:
        if state.get(id(root)) == 2:
            continue
        stack: list[tuple[Node, int]] = [(root, 0)]
        while stack:
            node, i = stack.pop()
            if i == 0:
                if state.get(id(node)) == 2:
                    continue
                state[id(node)] = 1
            if i < len(node.src):
                stack.append((node, i + 1))
                child = node.src[i]
                s = state.get(id(child))
                if s == 1:
                    raise GraphError(f"cycle through node {child.describe()}")
                if s is None:
                    stack.append((child, 0))
            else:
                state[id(node)] = 2
                order.append(node)
    return order


class Graph:
    """Named outputs plus in-place State updates that nothing else consumes.

    `outputs` maps a name to a node; `updates` lists writes into State (for example the
    recurrent-state write-back of a DeltaNet layer) that must run even though no output
    reads them.
    """

    def __init__(self, outputs: Mapping[str, Node], updates: Iterable[Node] = (),
                 meta: Mapping[str, Any] | None = None):
        # checked here: a number, an array or a list given as outputs failed later as "'int' object has no
        # attribute 'src'" (toposort) or "cannot convert dictionary update sequence element #0 to a sequence"
        if not isinstance(outputs, Mapping):
            raise GraphError(f"Graph outputs must map names to nodes, got a {type(outputs).__name__}")
        self.outputs: dict[str, Node] = dict(outputs)
        for k, v in self.outputs.items():
            if not isinstance(k, str):
                raise GraphError(f"Graph output name {k!r} is a {type(k).__name__}: outputs map str names to nodes")
            if not isinstance(v, Node):
                raise GraphError(f"Graph output {k!r} is a {type(v).__name__}: outputs map str names to nodes")
        if isinstance(updates, Node):
            raise GraphError(f"Graph updates must be a list of State writes, got one node ({updates.describe()})")
        self.updates: tuple[Node, ...] = tuple(updates)
        for u in self.updates:
            if not isinstance(u, Node):
                raise GraphError(f"Graph updates must be State write nodes, got a {type(u).__name__}")
        self.meta: dict[str, Any] = dict(meta or {})
        self._nodes: list[Node] | None = None
        self._leaves: dict[str, list[Node]] = {}
        self._signature: str | None = None

    @property
    def roots(self) -> list[Node]:
        return list(self.outputs.values()) + list(self.updates)

    def nodes(self) -> list[Node]:
        if self._nodes is None:
            self._nodes = toposort(self.roots)
        return self._nodes

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes())

    def __len__(self) -> int:
        return len(self.nodes())

    def leaves(self, op: str) -> list[Node]:
        # cached: Programs check inputs and states on every call of a replayed decode step
        if op not in self._leaves:
            self._leaves[op] = [n for n in self.nodes() if n.op == op]
        return self._leaves[op]

    @property
    def inputs(self) -> list[Node]:
        return self.leaves("input")

    @property
    def params(self) -> list[Node]:
        return self.leaves("param")

    @property
    def states(self) -> list[Node]:
        return self.leaves("state")

    def users(self) -> dict[int, list[Node]]:
        """id(node) -> the nodes that read it (each user once per source slot)."""
        out: dict[int, list[Node]] = {id(n): [] for n in self.nodes()}
        for n in self.nodes():
            for s in n.src:
                out[id(s)].append(n)
        return out

    def ids(self) -> dict[int, int]:
        """id(node) -> its position in topological order (the %N shown in dumps)."""
        return {id(n): i for i, n in enumerate(self.nodes())}

    def to_records(self) -> dict[str, Any]:
        """A canonical, JSON-ready description; equal graphs give equal records."""
        ids = self.ids()
        nodes = []
        for n in self.nodes():
            rec: dict[str, Any] = {
                "id": ids[id(n)],
                "op": n.op,
                "dtype": n.dtype,
                "shape": list(n.shape),
                "src": [ids[id(s)] for s in n.src],
                "params": {k: _jsonable(v) for k, v in n.params.as_dict().items()},
            }
            if n.name is not None:
                rec["name"] = n.name
            if n.types is not None:
                rec["types"] = [[list(s), d] for s, d in n.types]
            nodes.append(rec)
        return {
            "nodes": nodes,
            "outputs": {k: ids[id(v)] for k, v in self.outputs.items()},
            "updates": [ids[id(u)] for u in self.updates],
            "meta": {k: _jsonable(v) for k, v in self.meta.items()},
        }

    @classmethod
    def from_records(cls, rec: Mapping[str, Any]) -> Graph:
        if not isinstance(rec, Mapping) or not isinstance(rec.get("nodes"), list):
            raise GraphError("graph record: 'nodes' must be a list of node records")
        built: list[Node] = []

        def node(i: Any, where: str) -> Node:
            # a negative id indexed from the end: an output of -1 silently became the last node
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(built):
                raise GraphError(f"graph record {where}: {i!r} is not the id of an earlier node (0..{len(built) - 1})")
            return built[i]

        for r in rec["nodes"]:
            if not isinstance(r, Mapping):
                raise GraphError(f"graph record node {len(built)}: not a node record: {r!r}")
            if r.get("id") != len(built) or any(isinstance(s, int) and s >= len(built) for s in r.get("src", ())):
                raise GraphError(f"graph record node {r.get('id')}: ids must be 0..N-1 in topological order")
            try:
                src = tuple(node(s, f"node {len(built)} src") for s in r["src"])
                types = tuple((tuple(s), d) for s, d in r["types"]) if "types" in r else None
                built.append(Node(r["op"], r["dtype"], tuple(r["shape"]), src, Params(r["params"]), r.get("name"),
                                  types))
            except KeyError as e:
                raise GraphError(f"graph record node {len(built)}: missing field {e}") from None
            except (TypeError, ValueError) as e:
                raise GraphError(f"graph record node {len(built)}: a malformed field ({type(e).__name__}: {e})"
                                 ) from None
        outputs, updates = rec.get("outputs"), rec.get("updates", [])
        if not isinstance(outputs, Mapping) or not isinstance(updates, list):
            raise GraphError("graph record: 'outputs' must map names to node ids and 'updates' list node ids")
        return cls({k: node(i, f"output {k!r}") for k, i in outputs.items()},
                   [node(i, "update") for i in updates], rec.get("meta", {}))

    def signature(self) -> str:
        """Structural hash: same ops, shapes, dtypes, params, names and wiring -> same string."""
        if self._signature is None:
            blob = json.dumps(self.to_records(), sort_keys=True, separators=(",", ":")).encode()
            self._signature = hashlib.sha256(blob).hexdigest()[:16]
        return self._signature

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Graph) and self.signature() == other.signature()

    def __hash__(self) -> int:
        return hash(self.signature())

    def __repr__(self) -> str:
        return f"<Graph {len(self)} nodes, outputs {list(self.outputs)}>"


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v
