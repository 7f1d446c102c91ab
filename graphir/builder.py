"""ggml-style constructors: `g.rms_norm(x, eps=1e-5)` returns a Node and computes nothing.

Every op in the op table is reachable as `g.<op>(*sources, name=None, **params)`; the
op's shape rule runs here, so a malformed graph fails at the line that built it, with
a message naming the op, the node and the rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphir.dtypes import DTYPES
from graphir.errors import GraphError
from graphir.ir import Node, Params
from graphir.ops import OPS, REQUIRED, OpDef


def _label(opname: str, name: str | None, src: tuple[Node, ...]) -> str:
    nm = f" {name!r}" if name else ""
    args = ", ".join(s.describe() if isinstance(s, Node) else type(s).__name__ for s in src)
    return f"{opname}{nm}({args})"


def check_params(d: OpDef, given: dict[str, Any], where: str) -> Params:
    unknown = set(given) - set(d.params)
    if unknown:
        raise GraphError(f"{where}: unknown params {sorted(unknown)}; {d.name} takes {sorted(d.params) or 'none'}")
    out = {}
    for key, (typ, default) in d.params.items():
        v = given.get(key, default)
        if v is REQUIRED:
            raise GraphError(f"{where}: missing required param {key!r}")
        if typ is float and isinstance(v, (int, np.integer, np.floating)) and not isinstance(v, bool):
            v = float(v)
        if typ is int and isinstance(v, np.integer):
            v = int(v)
        if typ is tuple and isinstance(v, list):
            v = tuple(v)
        if not isinstance(v, typ) or isinstance(v, bool) and typ is not bool:
            raise GraphError(f"{where}: param {key!r} must be {getattr(typ, '__name__', typ)}, got {v!r}")
        out[key] = v
    return Params(out)


def make(opname: str, *src: Node, name: str | None = None, **params: Any) -> Node:
    d = OPS.get(opname)
    where = _label(opname, name, src)
    if d is None:
        raise GraphError(f"{where}: unknown op {opname!r}")
    if opname in ("input", "param", "state", "const"):
        raise GraphError(f"{where}: build leaves with g.{opname}(...)")
    lo, hi = d.arity
    if not lo <= len(src) <= hi:
        raise GraphError(f"{where}: {opname} takes {lo if lo == hi else f'{lo}..{hi}'} sources, got {len(src)}")
    for i, s in enumerate(src):
        if not isinstance(s, Node):
            raise GraphError(f"{where}: source {i} is {type(s).__name__}, not a Node")
        if s.dtype == "tuple" and opname != "item":
            raise GraphError(f"{where}: source {i} is a multi-output {s.op}; take one result with g.item")
    p = check_params(d, params, where)
    if opname == "item":
        types = src[0].types
        if types is None:
            raise GraphError(f"{where}: item needs a multi-output source")
        if not 0 <= p["index"] < len(types):
            raise GraphError(f"{where}: index {p['index']} out of range for {len(types)} results")
        shape, dtype = types[p["index"]]
        return Node("item", dtype, shape, src, p, name)
    if d.writes and not is_state_chain(src[0]):
        raise GraphError(f"{where}: {opname} writes in place, so its first source must be a State (or a write to one)")
    try:
        result = d.infer([(s.shape, s.dtype) for s in src], p.as_dict())
    except GraphError as e:
        raise GraphError(f"{where}: {e}") from None
    if d.multi:
        types = tuple((tuple(s), t) for s, t in result)
        return Node(opname, "tuple", (), src, p, name, types)
    shape, dtype = result
    return Node(opname, dtype, tuple(shape), src, p, name)


def is_state_chain(n: Node) -> bool:
    """True for a State node or an in-place write whose destination chain ends at one."""
    while OPS[n.op].writes:
        n = n.src[0]
    return n.op == "state"


def _leaf(kind: str, name: str, shape: tuple[int, ...], dtype: str) -> Node:
    if not isinstance(name, str) or not name:
        raise GraphError(f"{kind}: a name is required (got {name!r})")
    if dtype not in DTYPES:
        raise GraphError(f"{kind} {name!r}: unknown dtype {dtype!r}")
    try:
        shape = tuple(shape)
    except TypeError:  # g.input("x", 5): "'int' object is not iterable" from here
        raise GraphError(f"{kind} {name!r}: shape must be a tuple of ints, got {shape!r}") from None
    if any(not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
        raise GraphError(f"{kind} {name!r}: shape {list(shape)} must be non-negative ints")
    blk = DTYPES[dtype].block
    if blk > 1 and (not shape or shape[-1] % blk):
        raise GraphError(f"{kind} {name!r}: {dtype} needs the last axis to be a multiple of {blk}, got {list(shape)}")
    return Node(kind, dtype, shape, (), Params(), name)


class Builder:
    """The `g` in `g.add(a, b)`: leaves explicitly, every table op through attribute lookup."""

    def input(self, name: str, shape: tuple[int, ...], dtype: str = "f32") -> Node:
        return _leaf("input", name, shape, dtype)

    def param(self, name: str, shape: tuple[int, ...], dtype: str = "f32") -> Node:
        return _leaf("param", name, shape, dtype)

    def state(self, name: str, shape: tuple[int, ...], dtype: str = "f32") -> Node:
        if dtype not in ("f32", "f16"):
            raise GraphError(f"state {name!r}: State must be f32 or f16, got {dtype}")
        return _leaf("state", name, shape, dtype)

    def const(self, value: Any, dtype: str = "f32", name: str | None = None) -> Node:
        if dtype not in ("f32", "i32"):
            raise GraphError(f"const {name!r}: dtype must be f32 or i32, got {dtype!r}")
        try:
            arr = np.asarray(value, dtype={"f32": np.float32, "i32": np.int32}[dtype])
        except (TypeError, ValueError) as e:  # ragged lists, strings, NaN as i32: numpy's ValueError from here
            label = f"const {name!r}" if name else "const"
            raise GraphError(f"{label}: value {value!r} is not a rectangular array of {dtype} numbers ({e})") from None
        return Node("const", dtype, arr.shape, (), Params({"value": tuple(arr.reshape(-1).tolist())}), name)

    def __getattr__(self, opname: str):
        if opname.startswith("_") or opname not in OPS:
            raise AttributeError(f"no op named {opname!r}")

        def build(*src: Node, name: str | None = None, **params: Any) -> Node:
            return make(opname, *src, name=name, **params)

        build.__name__ = opname
        build.__doc__ = OPS[opname].doc
        return build

    # Layout helpers that read better than raw views; each is one table op.
    def rows(self, x: Node, start: int, count: int, name: str | None = None) -> Node:
        """x[start:start+count] along axis 0 of a contiguous tensor, as a view."""
        if not x.shape:  # x.shape[0] was an IndexError
            raise GraphError(f"rows({x.describe()}): a 0-d tensor has no rows")
        inner = x.numel // x.shape[0] if x.shape[0] else 0
        strides = contiguous_strides(x.shape)
        return make("view", x, name=name, shape=(count,) + x.shape[1:], strides=strides, offset=start * inner)

    def cols(self, x: Node, start: int, count: int, name: str | None = None) -> Node:
        """x[..., start:start+count] of a contiguous tensor, as a view."""
        strides = contiguous_strides(x.shape)
        return make("view", x, name=name, shape=x.shape[:-1] + (count,), strides=strides, offset=start)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def merge_axes(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """(size, stride) of each axis left once size-1 axes are dropped and adjacent axes whose strides
    compose (outer stride == inner stride * inner size) are merged: the same elements in the same order."""
    dims: list[tuple[int, int]] = []
    for n, s in zip(shape, strides):
        if n == 1:
            continue
        if dims and dims[-1][1] == s * n:
            dims[-1] = (dims[-1][0] * n, s)
        else:
            dims.append((n, s))
    return dims


g = Builder()
