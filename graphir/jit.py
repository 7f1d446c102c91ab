"""`@graphir.jit`: trace a Python function of graph ops once per input signature, then run it.

    @graphir.jit
    def f(x, w):
        return g.mul(g.rms_norm(x, eps=1e-6), w)

    f(x_array, w_array)        # traces, lowers on the backend, runs
    f.graph(x_array, w_array)  # the traced Graph, for dumps and passes

Each argument becomes an Input named after the parameter. The traced graph is keyed by the
arguments' shapes and dtypes, so a new shape traces again and an old one reuses its Program.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from graphir.errors import GraphError, InputError
from graphir.ir import Graph, Node

NUMPY_TO_DTYPE = {np.dtype("float32"): "f32", np.dtype("float16"): "f16", np.dtype("int32"): "i32"}


class Jitted:
    def __init__(self, fn: Callable[..., Any], backend: str, passes: str | None):
        self.fn = fn
        self.backend = backend
        self.passes = passes
        self.signature = inspect.signature(fn)
        self.arg_names = list(self.signature.parameters)
        varargs = [p.name for p in self.signature.parameters.values()
                   if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if varargs:  # each array is an Input named after its parameter, so *args has no names to give
            raise GraphError(f"jit: {fn.__name__} takes *{varargs[0]}; name each array parameter instead")
        self.programs: dict[tuple, Any] = {}
        self.graphs: dict[tuple, Graph] = {}
        self.kinds: dict[tuple, str] = {}  # what fn returned: "node", "dict" or "tuple"
        functools.update_wrapper(self, fn)

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Parameter name -> the array given for it, or `_Static(default)` for a parameter left at its default:
        arrays may be passed by keyword, and a default (eps=1e-6) reaches the function as the value it is, not
        an Input (keywords were "unexpected keyword argument", a default 'takes 2 arrays, got 1')."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise InputError(f"{self.fn.__name__} takes {len(self.arg_names)} arrays, got {len(args)}"
                             f"{' and ' + ', '.join(map(repr, kwargs)) if kwargs else ''} ({e})") from None
        values: dict[str, Any] = {}
        for name, p in self.signature.parameters.items():
            if name in bound.arguments or isinstance(p.default, np.ndarray):  # an array default is an Input too
                values[name] = bound.arguments.get(name, p.default)
            else:
                values[name] = _Static(p.default)
        return values

    def _key(self, values: dict[str, Any]) -> tuple:
        key = []
        for name, a in values.items():
            if isinstance(a, _Static):
                key.append(("default", repr(a.value)))
                continue
            a = np.asarray(a)
            if a.dtype not in NUMPY_TO_DTYPE:
                raise InputError(f"{self.fn.__name__}: argument {name!r} has dtype {a.dtype}; "
                                 "use float32, float16 or int32")
            key.append((a.shape, NUMPY_TO_DTYPE[a.dtype]))
        return tuple(key)

    def graph(self, *args: np.ndarray, **kwargs: np.ndarray) -> Graph:
        values = self._bind(args, kwargs)
        return self._graph(values, self._key(values))

    def _graph(self, values: dict[str, Any], key: tuple) -> Graph:
        if key not in self.graphs:
            from graphir.builder import g

            nodes = [v.value if isinstance(v, _Static) else g.input(name, shape, dt)
                     for (name, v), (shape, dt) in zip(values.items(), key)]
            result = self.fn(*nodes)
            if isinstance(result, Node):
                outputs, self.kinds[key] = {"out": result}, "node"
            elif isinstance(result, dict):
                outputs, self.kinds[key] = dict(result), "dict"
            else:
                outputs = {f"out{i}": r for i, r in enumerate(result)} if isinstance(result, (tuple, list)) else {}
                self.kinds[key] = "tuple"
            if not outputs or not all(isinstance(o, Node) for o in outputs.values()):
                # else a missing return failed as "'NoneType' object is not iterable", a number among the outputs
                # deep in Graph, and no outputs as 'unexpected inputs'
                raise GraphError(f"{self.fn.__name__} must return a graph node, or a dict, tuple or list of them; "
                                 f"got {_shown(result)}")
            graph = Graph(outputs)
            if self.passes:
                from graphir.passes import run_pipeline

                graph = run_pipeline(graph, self.passes)
            self.graphs[key] = graph
        return self.graphs[key]

    def __call__(self, *args: np.ndarray, **kwargs: np.ndarray) -> Any:
        values = self._bind(args, kwargs)
        key = self._key(values)
        graph = self._graph(values, key)
        if key not in self.programs:
            from graphir.backends.registry import get_backend

            self.programs[key] = get_backend(self.backend).lower(graph)
        out = self.programs[key]({k: v for k, v in values.items() if not isinstance(v, _Static)}, {})
        kind = self.kinds[key]
        if kind == "node":
            return out["out"]
        if kind == "tuple":  # a function returning (a, b) gives back a tuple, not a dict of "outN"
            return tuple(out[f"out{i}"] for i in range(len(out)))
        return out


class _Static:
    """A parameter left at its default: passed to the traced function as it is."""

    def __init__(self, value: Any):
        self.value = value


def _shown(result: Any) -> str:
    """A traced function's result for an error message, its nodes as "Node"."""
    if result is None:
        return "None (a missing return?)"
    if isinstance(result, (tuple, list)):
        items = ", ".join("Node" if isinstance(r, Node) else repr(r) for r in result)
        return (f"({items}{',' * (len(result) == 1)})" if isinstance(result, tuple) else f"[{items}]")
    if isinstance(result, dict):
        return "{" + ", ".join(f"{k!r}: {'Node' if isinstance(v, Node) else repr(v)}" for k, v in result.items()) + "}"
    return repr(result)


def jit(fn: Callable[..., Any] | None = None, *, backend: str = "reference", passes: str | None = None):
    """Decorator; use bare (`@jit`) or with options (`@jit(backend="cpu", passes="default")`)."""
    if fn is None:
        return lambda f: Jitted(f, backend, passes)
    return Jitted(fn, backend, passes)
