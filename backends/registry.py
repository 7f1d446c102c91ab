"""Backends by name. Each backend module provides `lower(graph, weights) -> Program`."""

from __future__ import annotations

import importlib
from types import ModuleType

from graphir.errors import BackendError

BACKENDS = {
    "reference": "graphir.backends.reference",
    "cpu": "graphir.backends.cpu",
}


def get_backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    try:
        return importlib.import_module(BACKENDS[name])
    except ImportError as e:
        raise BackendError(f"backend {name!r} is not available here: {e}") from e
