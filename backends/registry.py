"""Backends by name. Each backend module provides `lower(graph, weights) -> Program`."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from graphir.errors import BackendError

BACKENDS = {
    "reference": "graphir.backends.reference",
    "cpu": "graphir.backends.cpu",
    "gpu": "graphir.backends.gpu",
}
AUTO = "auto"  # gpu when CuPy sees a device, else cpu


# What any CUDA or ROCm device leaves on Linux: the ROCm compute node, WSL's GPU node, NVIDIA's control node.
GPU_DEVICE_NODES = ("/dev/kfd", "/dev/dxg", "/dev/nvidiactl")


def gpu_driver_present() -> bool:
    """False only where no GPU can be: Linux with none of GPU_DEVICE_NODES and no CUDA driver library
    (CuPy's runtime opens libcuda.so.1 by that name, so where it cannot, CuPy sees no device either).
    Elsewhere True: then CuPy is asked. Importing CuPy to find no device took 0.14 s of a second
    `graphir run`'s first token on a 2-core machine."""
    if not sys.platform.startswith("linux") or any(os.path.exists(p) for p in GPU_DEVICE_NODES):
        return True
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def resolve_backend(name: str) -> str:
    """The backend `name` stands for: "auto" picks gpu when CuPy sees a device, else cpu (without importing
    CuPy where no GPU driver is present)."""
    if name != AUTO:
        return name
    if not gpu_driver_present():
        return "cpu"
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
