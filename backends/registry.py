"""Backends by name. Each backend module provides `lower(graph, weights) -> Program`."""

from __future__ import annotations

import importlib
from types import ModuleType

from graphir.errors import BackendError

BACKENDS = {
    "reference": "graphir.backends.reference",
    "cpu": "graphir.backends.cpu",
    "gpu": "graphir.backends.gpu",
}
AUTO = "auto"  # gpu when CuPy sees a device, else cpu


def resolve_backend(name: str) -> str:
    """The backend `name` stands for: "auto" picks gpu when CuPy sees a device, else cpu."""
    if name != AUTO:
        return name
    from graphir.backends.gpu.device import available

    return "gpu" if available() else "cpu"


def get_backend(name: str) -> ModuleType:
    name = resolve_backend(name)
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}, {AUTO}")
    try:
        module = importlib.import_module(BACKENDS[name])
    except ImportError as e:
        raise BackendError(f"backend {name!r} is not available here: {e}") from e
    if name == "gpu":
        module.device.cupy()  # a missing CuPy is a one-line error here, not at the first call
        if not module.device.available():
            raise BackendError("backend 'gpu': CuPy is installed but sees no CUDA/HIP device (or no working "
                               "driver); use --backend cpu, or auto to pick what is here")
    return module
