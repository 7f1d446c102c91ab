"""Where shard-tp cuts a region: the rank parts of a row-parallel mul_mat's input y.

With a head op behind y (flash_attn, gated_delta_net), ranks get heads (`head_plan`), carried
forward to y's columns along the chain of single readers between them; without one, y's columns
split evenly in whole blocks of the weight's quantized type.
"""

from __future__ import annotations

from graphir.dtypes import DTYPES
from graphir.ir import Node
from graphir.passes import shard_tp_rules as R


def head_plan(node: Node, big: int, small: int, n: int) -> list[tuple[int, ...]]:
    """Per rank, the query (value) heads it computes: whole groups when there are >= n shared heads
    (uneven when they do not divide), else an even split of query heads over replicated shared heads."""
    group = big // small
    if small >= n:
        return [tuple(range(small * r // n * group, small * (r + 1) // n * group)) for r in range(n)]
    if big >= n:
        return [tuple(range(big * r // n, big * (r + 1) // n)) for r in range(n)]
    raise R.Reject(node, f"{big} heads cannot give each of {n} ranks a head")


def seed_parts(out: Node, y: Node, n: int, users: dict[int, list[Node]]) -> tuple[list[tuple[int, ...]], str]:
    """Per rank, y's columns (its last axis) that the rank holds, and a note for the coverage report."""
    head = _head_op(out, y)
    if head is None:
        block = DTYPES[out.src[0].dtype].block
        units = y.shape[-1] // block
        if units < n:
            raise R.Reject(out, f"{y.shape[-1]} columns in blocks of {block} cannot give each of {n} ranks a part")
        parts = [tuple(range(units * r // n * block, units * (r + 1) // n * block)) for r in range(n)]
        return parts, f"columns split {[len(p) for p in parts]}"
    if head.op == "flash_attn":
        big, small, start = head.src[0].shape[1], head.src[1].shape[1], head
    else:
        big, small = head.src[2].shape[1], head.src[0].shape[1]
        start = next((u for u in users[id(head)] if u.op == "item" and u.params["index"] == 0), None)
        if start is None:
            raise R.Reject(head, "its output is not read")
    heads = head_plan(head, big, small, n)
    parts = [_carry(start, y, (1, h), users)[1] for h in heads]
    return parts, f"{head.op} heads {[len(h) for h in heads]} of {big} ({small} shared)"


def _head_op(out: Node, y: Node) -> Node | None:
    """The one head op y is computed from, searching back to the column-parallel mul_mats."""
    found: dict[int, Node] = {}
    seen: set[int] = set()
    stack = [y]
    while stack:
        node = stack.pop()
        if id(node) in seen or node.is_leaf:
            continue
        seen.add(id(node))
        if node.op in R.HEAD_OPS:
            found[id(node)] = node
        if node.op == "mul_mat" and node.src[0].op == "param":
            continue
        stack.extend(node.src)
    if len(found) > 1:
        raise R.Reject(out, f"its input comes from {len(found)} head ops; a region holds one")
    return next(iter(found.values()), None)


def _carry(node: Node, y: Node, sel: R.Sel, users: dict[int, list[Node]]) -> R.Sel:
    """A split of `node` carried forward to y along the chain of single readers."""
    while node is not y:
        readers = users[id(node)]
        if len(readers) != 1:
            raise R.Reject(node, f"{len(readers)} readers between the head op and the row-parallel mul_mat")
        u = readers[0]
        if u.op == "reshape":
            sel = R.map_reshape(u, node.shape, u.shape, sel)
        elif not (u.op in R.ELEMENTWISE or u.op in R.BINARY or u.op in R.ROW_NORMS and sel[0] != R.last(u)):
            raise R.Reject(u, f"shard-tp cannot carry a head split through {u.op}")
        node = u
    if sel[0] != R.last(y):
        raise R.Reject(y, f"heads land on axis {sel[0]} of y, not its columns")
    return sel
