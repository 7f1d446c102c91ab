"""Kernel sources: one `.cu` file per op family beside this module, compiled with CuPy RawModule.

Every source includes common.cuh (the CUDA/HIP portability layer) and has `#ifndef` defaults
for everything it is specialized on, so each file also compiles on its own (what CI checks with
NVRTC and hipcc, without a GPU). Kernels are `extern "C"`, one name per specialization, so a
file is compiled once per process and every specialization the backend can emit is in SOURCES.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).parent

# Every source file the backend compiles, with the -D options it compiles it with.
SOURCES: dict[str, tuple[str, ...]] = {
    "elementwise.cu": (),
    "norm.cu": (),
    "reduce.cu": (),
    "rope.cu": (),
    "copy.cu": (),
    "matmul.cu": (),
    "get_rows.cu": (),
    "attention.cu": (),
    "attention_prefill.cu": (),
    "recurrent.cu": (),
    "delta_chunked.cu": (),
    "sample.cu": (),
    "p2p.cu": (),
    "gemv_q8x.cu": (),
    "gemv_tc.cu": (),
}


HEADERS = ("common.cuh", "quant.cuh")


@functools.cache
def source(name: str) -> str:
    """The text compiled for `name`. It starts with a hash of the shared headers because CuPy's
    on-disk kernel cache (CUPY_CACHE_DIR, per GPU arch) keys on the source text and options only:
    without it, an edited header would load a stale binary compiled from the old one."""
    h = hashlib.sha256(b"".join((KERNEL_DIR / f).read_bytes() for f in HEADERS)).hexdigest()[:16]
    return f"// graphir headers {h}\n" + (KERNEL_DIR / name).read_text()


def nvrtc_options(defines: tuple[str, ...] = ()) -> list[str]:
    return [f"-I{KERNEL_DIR}", "-std=c++17", *(f"-D{d}" for d in defines)]


@functools.cache
def module(name: str) -> Any:
    """The compiled RawModule of one source file (NVRTC on CUDA, hiprtc on ROCm)."""
    from .device import cupy

    return cupy().RawModule(code=source(name), options=tuple(nvrtc_options(SOURCES[name])))


def get(name: str, kernel: str) -> Any:
    """A RawKernel from source file `name`."""
    return module(name).get_function(kernel)
