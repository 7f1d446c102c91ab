"""Tainted ints: per-step values (position, KV offset, length) that must never reach a graph.

A cached graph is replayed at every position, so a position baked into a view offset or a
const is silently wrong on the next token. A model builder (or a test of one) wraps its
per-step numbers with `step(value, "position")`; arithmetic keeps the taint, node params
keep the int object, and the `replay-lint` pass names every node that holds one.

    pos = step(5, "position")
    g.rows(k_cache, start=pos, count=1)   # view offset = pos * row: tainted -> replay-lint fails

Only params carry taint: a Node's shape is converted with int() and g.const copies through
numpy, so those lose it; `graphir.passes.replay_lint.replay_diff` catches them by building twice.
"""

from __future__ import annotations

from typing import Any


class StepInt(int):
    """An int that remembers it came from a per-step value; stays tainted through + - * // % and -x."""

    origin: str

    def __new__(cls, value: int, origin: str) -> StepInt:
        self = super().__new__(cls, int(value))
        self.origin = origin
        return self

    def __repr__(self) -> str:
        return f"{int(self)} (per-step {self.origin})"

    def __reduce__(self):
        return (StepInt, (int(self), self.origin))


def _origin(a: Any, b: Any) -> str:
    names = [x.origin for x in (a, b) if isinstance(x, StepInt)]
    return " and ".join(dict.fromkeys(names))


def _tainting(name: str):
    base = getattr(int, name)

    def method(self: StepInt, other: Any = None) -> Any:
        result = base(self) if other is None and name == "__neg__" else base(self, other)
        if result is NotImplemented or not isinstance(result, int) or isinstance(result, bool):
            return result
        return StepInt(result, _origin(self, other))

    method.__name__ = name
    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
              "__rfloordiv__", "__mod__", "__rmod__", "__neg__"):
    setattr(StepInt, _name, _tainting(_name))


def step(value: int, what: str) -> StepInt:
    """Mark `value` as a per-step number; `what` names it in lint messages ("position", "kv offset")."""
    return StepInt(value, f"{what}={int(value)}")


def find_tainted(value: Any) -> list[StepInt]:
    """Every StepInt inside value (nested tuples and lists included)."""
    if isinstance(value, StepInt):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in find_tainted(v)]
    return []
