"""Kernel sources: one `.cu` file per op family beside this module, compiled with CuPy RawModule.

Every source includes common.cuh (the CUDA/HIP portability layer) and has `#ifndef` defaults
for everything it is specialized on, so each file also compiles on its own (what CI checks with
NVRTC and hipcc, without a GPU). Kernels are `extern "C"`, one name per specialization, so a
file is compiled once per process and every specialization the backend can emit is in SOURCES.

A process's first kernel request compiles every source at once, side by side in threads (NVRTC and
hiprtc run without the GIL), the requested file's translation units first; the two large files are
compiled in parts (PARTS), so a first run waits for about its largest part rather than for all the
files in turn (H200, 16 CPUs: 75.8 s -> 8.8 s). Later processes load the binaries from CuPy's disk
cache (CUPY_CACHE_DIR), also all at once (0.61 s for every source there, 0.24 s whole and in turn).
Tried and dropped: a marker under $GRAPHIR_CACHE_DIR saying a set of sources was compiled, so that a
warm process would load each source only when asked for; with CuPy's cache emptied and the marker kept
(as `graphir bench --new-process` does for its cold run) a first token took 40.4 s instead of ~17.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
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


# Sources compiled as several translation units: part k is the file with -DGRAPHIR_PART=k and holds the sections
# marked `#if IN_PART(k)` (common.cuh); each kernel is in exactly one part (tests/test_gpu_kernels_compile.py).
# nvcc -cubin for sm_90 on the 2-core CI machine (2026-12-04): matmul.cu 43.9 s whole, its parts 1.5-7.4 s;
# attention.cu 27.1 s whole.
PARTS: dict[str, int] = {"matmul.cu": 8, "attention.cu": 4}


def unit_defines(name: str) -> list[tuple[str, ...]]:
    """The -D options of each translation unit of source `name`: its SOURCES options, and a part's number."""
    parts = PARTS.get(name, 0)
    return [SOURCES[name] + (f"GRAPHIR_PART={k}",) for k in range(parts)] if parts else [SOURCES[name]]


class Compiled:
    """A source file's compiled translation units; a kernel is looked up in the unit that defines it."""

    def __init__(self, name: str, units: list[Any]):
        self.name, self.units = name, units
        self._found: dict[str, Any] = {}

    def get_function(self, kernel: str) -> Any:
        fn = self._found.get(kernel)
        if fn is None:
            from .device import cupy

            for unit in self.units:
                try:
                    fn = unit.get_function(kernel)
                    break
                except cupy().cuda.driver.CUDADriverError:  # not in this unit (CUDA_ERROR_NOT_FOUND)
                    continue
            else:
                raise KeyError(f"{self.name}: no kernel {kernel!r} in any of its {len(self.units)} translation units")
            self._found[kernel] = fn
        return fn


_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_units: dict[str, list[Future]] = {}  # source -> its translation units, compiling or compiled
_modules: dict[str, Compiled] = {}


def _compile_unit(name: str, defines: tuple[str, ...]) -> Any:
    from .device import cupy

    unit = cupy().RawModule(code=source(name), options=tuple(nvrtc_options(defines)))
    unit.compile()
    return unit


def _submit(name: str) -> list[Future]:
    """`name`'s units, submitted to the pool if they were not (call with _lock held)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 4, thread_name_prefix="graphir-nvrtc")
    if name not in _units:
        _units[name] = [_pool.submit(_compile_unit, name, d) for d in unit_defines(name)]
    return _units[name]


def module(name: str) -> Compiled:
    """The compiled kernels of one source file (NVRTC on CUDA, hiprtc on ROCm). The first request in a
    process starts every other source compiling behind this one."""
    done = _modules.get(name)
    if done is not None:
        return done
    with _lock:
        first = not _units
        futures = _submit(name)
        if first:
            for other in SOURCES:
                _submit(other)
    compiled = Compiled(name, [f.result() for f in futures])
    _modules[name] = compiled
    return compiled


def clear() -> None:
    """Forget every compiled source, so the next request compiles with SOURCES as it is now (tests and
    benchmarks that compile with extra -D switches). Launches made before keep their kernels."""
    with _lock:
        _units.clear()
        _modules.clear()


def get(name: str, kernel: str) -> Any:
    """A RawKernel from source file `name`."""
    return module(name).get_function(kernel)
