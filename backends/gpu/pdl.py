"""Programmatic dependent launch: kernels of a captured graph that overlap the kernel before them.

In a replayed CUDA graph each kernel still waits for the one before it to finish, its blocks to be
scheduled and its first loads to return: ~1-3 us per boundary on an H200, ~430 boundaries in a
Qwen3-8B decode step. Launched with programmatic stream serialization (sm_90+), a kernel is
scheduled as soon as every block of the one before has executed PDL_TRIGGER, and holds at PDL_WAIT
until that one has finished (common.cuh; each kernel triggers just after its own wait): block
scheduling and launch latency overlap the kernel ahead. Measured on an H200 (BENCHMARKS.md,
2026-12-02): ~250 us per Qwen3-8B step, ~175 us per Qwen3-0.6B step.

CuPy's RawKernel launches without launch attributes, so these launches go through the driver's
cuLaunchKernelEx by ctypes, with the same CUfunction, grid, block, shared memory and arguments.
They are used only while capturing a Program (the launch cost is paid once; replays are free),
only for a kernel whose step directly follows another kernel's (after a copy or a library call the
ordinary full dependency stays), and only where every kernel begins with PDL_ENTRY or
PDL_TRIGGER/PDL_WAIT, which tests/test_gpu_pdl.py checks for every source.
GRAPHIR_NO_PDL=1 turns it off (the A/B the benchmarks print).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from graphir import flags
from graphir.errors import BackendError

from .device import cupy

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):  # cuda.h CUlaunchAttribute: id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # cuda.h CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def _driver_launch() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernelEx
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return fn


@functools.cache
def supported() -> bool:
    """CUDA (not HIP), compute capability 9.0 or newer, and a driver with cuLaunchKernelEx."""
    cp = cupy()
    if cp.cuda.runtime.is_hip or int(cp.cuda.Device().compute_capability) < 90:
        return False
    try:
        _driver_launch()
    except (OSError, AttributeError):
        return False
    return True


def enabled() -> bool:
    return not flags.enabled("GRAPHIR_NO_PDL") and supported()


def kernel_args(args: tuple[Any, ...]) -> list[Any]:
    """Each argument as the ctypes value the kernel's parameter holds, as CuPy would pass it: device
    arrays by address, numpy scalars by their own type (Launch rejects Python ints and floats)."""
    out: list[Any] = []
    for a in args:
        if isinstance(a, np.generic):
            out.append(np.ctypeslib.as_ctypes_type(a.dtype)(a.item()))
        elif hasattr(a, "data") and hasattr(a.data, "ptr"):  # a CuPy array
            out.append(ctypes.c_void_p(a.data.ptr))
        else:
            raise BackendError(f"programmatic launch: cannot pass a kernel argument of type {type(a).__name__}")
    return out


def launch(kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], shared: int,
           stream_ptr: int, name: str) -> None:
    """One launch of a CuPy RawKernel with programmatic stream serialization on `stream_ptr`."""
    g, b = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    attr = _LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = _LaunchConfig(*g, *b, shared, stream_ptr, ctypes.pointer(attr), 1)
    values = kernel_args(args)
    params = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
    err = _driver_launch()(ctypes.byref(cfg), kernel.kernel.ptr, params, None)
    if err != 0:
        raise BackendError(f"gpu backend: cuLaunchKernelEx of kernel {name} failed with CUresult {err}")
