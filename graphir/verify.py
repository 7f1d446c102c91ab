"""The verifier: checks any graph and names the node and the rule it breaks.

Rules: known ops; arity; params match the schema; shapes and dtypes equal what the op's
rule infers (so views are in bounds); no cycles; leaves with one name have one type;
in-place writes go only into State; and every other reader of a value that is written
in place (directly, or through a view, which aliases it) is an ancestor of the write, so
"read the old KV rows, then overwrite them" has exactly one legal order.
"""

from __future__ import annotations

from graphir.builder import check_params, is_state_chain
from graphir.dtypes import DTYPES
from graphir.errors import GraphError
from graphir.ir import LEAF_OPS, Graph, Node
from graphir.ops import OPS


def where(ids: dict[int, int], n: Node) -> str:
    return f"node %{ids[id(n)]} {n.describe()}"


def verify(graph: Graph) -> Graph:
    """Raise GraphError for the first broken rule; return the graph unchanged if it is sound."""
    nodes = graph.nodes()  # raises on cycles
    ids = graph.ids()
    leaves: dict[tuple[str, str], Node] = {}
    for n in nodes:
        _check_node(n, ids)
        if n.is_leaf and n.op != "const":
            prev = leaves.setdefault((n.op, n.name), n)
            if prev is not n and (prev.shape, prev.dtype) != (n.shape, n.dtype):
                raise GraphError(f"{where(ids, n)}: {n.op} {n.name!r} also appears as {list(prev.shape)} {prev.dtype}")
    for name, out in graph.outputs.items():
        if out.dtype == "tuple":
            raise GraphError(f"output {name!r} is a multi-output {out.op}; output one item")
    for u in graph.updates:
        if not OPS[u.op].writes:
            raise GraphError(f"{where(ids, u)}: listed as a state update but {u.op} writes nothing")
    _check_write_order(graph, ids)
    return graph


def _check_node(n: Node, ids: dict[int, int]) -> None:
    w = where(ids, n)
    d = OPS.get(n.op)
    if d is None:
        raise GraphError(f"{w}: unknown op {n.op!r}")
    if n.dtype not in DTYPES and n.dtype != "tuple":
        raise GraphError(f"{w}: unknown dtype {n.dtype!r}")
    if n.op in LEAF_OPS:
        if n.src:
            raise GraphError(f"{w}: a {n.op} has no sources")
        if n.op != "const" and not n.name:
            raise GraphError(f"{w}: a {n.op} needs a name")
        if n.op == "const" and len(n.params.get("value", ())) != n.numel:
            raise GraphError(f"{w}: const holds {len(n.params.get('value', ()))} values for shape {list(n.shape)}")
        if n.op == "state" and n.dtype not in ("f32", "f16"):
            raise GraphError(f"{w}: State must be f32 or f16")
        return
    lo, hi = d.arity
    if not lo <= len(n.src) <= hi:
        raise GraphError(f"{w}: {n.op} takes {lo}..{hi} sources, has {len(n.src)}")
    params = check_params(d, n.params.as_dict(), w)
    if params != n.params:
        raise GraphError(f"{w}: params {n.params.as_dict()} are not in canonical form {params.as_dict()}")
    for i, s in enumerate(n.src):
        if s.dtype == "tuple" and n.op != "item":
            raise GraphError(f"{w}: source {i} is multi-output; read it through item")
    if n.op == "item":
        types = n.src[0].types
        if types is None or not 0 <= n.params["index"] < len(types):
            raise GraphError(f"{w}: item index {n.params['index']} does not select a result of {n.src[0].op}")
        expect = types[n.params["index"]]
    else:
        if d.writes and not is_state_chain(n.src[0]):
            raise GraphError(f"{w}: {n.op} writes in place; its destination must be a State")
        try:
            expect = d.infer([(s.shape, s.dtype) for s in n.src], params.as_dict())
        except GraphError as e:
            raise GraphError(f"{w}: {e}") from None
    if d.multi:
        got = n.types
        if n.dtype != "tuple" or got is None or [(tuple(s), t) for s, t in expect] != list(got):
            raise GraphError(f"{w}: result types {got} differ from the rule's {expect}")
    elif (tuple(expect[0]), expect[1]) != (n.shape, n.dtype):
        raise GraphError(f"{w}: has {list(n.shape)} {n.dtype} but the rule gives {list(expect[0])} {expect[1]}")


def _check_write_order(graph: Graph, ids: dict[int, int]) -> None:
    writes = [n for n in graph.nodes() if OPS[n.op].writes]
    if not writes:
        return
    users = graph.users()
    for n in writes:
        dst = n.src[0]
        writers = {id(u): u for u in users[id(dst)] if OPS[u.op].writes and u.src[0] is dst}
        if len(writers) > 1:
            raise GraphError(f"{where(ids, n)}: {len(writers)} writes consume the same value of "
                             f"{dst.describe()}; chain them so their order is defined")
        readers = [r for r in _readers(users, dst) if r is not n]
        before = _ancestors(n, min((ids[id(r)] for r in readers), default=ids[id(n)]), ids)
        for reader in readers:
            if id(reader) in before:
                continue
            raise GraphError(f"{where(ids, reader)} reads {dst.describe()} but is not ordered before the in-place "
                             f"write {where(ids, n)}; read the write's result instead, or make the write depend on it")


def _ancestors(n: Node, floor: int, ids: dict[int, int]) -> set[int]:
    """ids of the nodes n depends on at topological position `floor` or later. Positions grow along every edge,
    so a node at position p >= floor that n depends on is reached through nodes at p or later: the walk stays in
    the few layers between a write and its readers (the whole ancestry of each of SmolLM2's 60 KV writes took
    6-9 ms of every lowering, quadratic in the layers)."""
    seen: set[int] = set()
    stack = list(n.src)
    while stack:
        s = stack.pop()
        if id(s) not in seen and ids[id(s)] >= floor:
            seen.add(id(s))
            stack.extend(s.src)
    return seen


def _readers(users: dict[int, list[Node]], dst: Node) -> list[Node]:
    """Nodes that read dst's storage: its users and, since view ops alias their source, the users of those views."""
    out: dict[int, Node] = {}
    stack = [dst]
    while stack:
        v = stack.pop()
        for u in users[id(v)]:
            if id(u) not in out:
                out[id(u)] = u
                if OPS[u.op].view and u.src[0] is v:
                    stack.append(u)
    return list(out.values())
