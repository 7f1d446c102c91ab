"""CuPy, imported once with a one-line error when it is missing, and whether a GPU is present."""

from __future__ import annotations

import functools
from types import ModuleType

from graphir.errors import BackendError

INSTALL_HINT = "pip install -e '.[gpu]' (CuPy for CUDA 13: cupy-cuda13x)"


@functools.cache
def cupy() -> ModuleType:
    try:
        import cupy as cp
    except ImportError as e:
        raise BackendError(f"the gpu backend needs CuPy, which is not installed ({e}); {INSTALL_HINT}") from None
    return cp


def available() -> bool:
    """True when CuPy imports and sees at least one device (what backend='auto' asks)."""
    try:
        cp = cupy()
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "not here"
        return False


@functools.cache
def tensor_cores() -> bool:
    """mma.sync on f16/bf16, ldmatrix and cp.async: CUDA sm_80 and later (not HIP)."""
    cp = cupy()
    return not cp.cuda.runtime.is_hip and int(cp.cuda.Device().compute_capability) >= 80


@functools.cache
def stream() -> object:
    """The one stream every gpu Program runs on. Programs of a model share State buffers, so their
    work must stay in order; a stream of our own (not the legacy default one) can be captured.
    Blocking: it waits for work on the default stream, e.g. weight uploads."""
    return cupy().cuda.Stream(non_blocking=False)
