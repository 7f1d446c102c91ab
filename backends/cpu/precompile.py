"""On a cold numba cache, a second process compiles some of a model's matmul kernels while this one
compiles the rest: the first run after an install then takes about half the time on 2 cores.

numba compiles under one process-wide lock, so threads cannot share the work (LLVM holds it through
code generation); processes can, and numba's on-disk cache is where they meet. When a CPU Program is
lowered, `start` looks at the weight dtypes its matmuls read. Each kernel they need whose cache entry
is missing becomes a job ("matmul:q4_1", "gemv:q8") for a helper process, except the first one, which
this process is about to compile itself. The helper runs `python -m graphir.backends.cpu.precompile
JOB...`, compiling each job into the cache and printing "running JOB" / "done JOB" as it goes.

Before compiling a kernel itself, this process calls `wait(job)`: while the helper is compiling that
very job it waits and then loads the kernel from the cache; a job still queued there it compiles
itself (the helper later loads it from the cache in milliseconds). The helper is ended at exit: a
killed helper leaves no index entry behind (numba writes the index last), so nothing half-written
is ever loaded.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from collections.abc import Iterable

from graphir import flags

_cond = threading.Condition()
_jobs: dict[str, str] = {}  # job -> "queued", "running", "done" or "gone" (the helper ended first)
_proc: subprocess.Popen | None = None


def jobs_for(uses: Iterable[tuple[str, int | None]]) -> list[str]:
    """The kernel jobs, each once and in the order given, for weight uses (dtype, rows of x), rows
    None for get_rows: the choices lowering_rules._mul_mat and matmul.py make for those uses."""
    from .gemv_repacked import MAX_TOKENS, kind_of
    from .matmul import SUPPORTED, mode_for

    jobs: list[str] = []
    for dtype, rows in uses:
        if dtype not in SUPPORTED:
            continue
        kind = kind_of(dtype) if rows is not None and rows <= MAX_TOKENS else None
        job = f"gemv:{kind}" if kind else f"matmul:{dtype}:{'rows' if rows is None else mode_for(rows)}"
        if job not in jobs:
            jobs.append(job)
    return jobs


def _dispatcher(job: str):
    kind, *args = job.split(":")
    if kind == "matmul":
        from .matmul import _KERNELS

        return _KERNELS[tuple(args)]
    from .gemv_repacked import _KERNELS as GEMV

    return GEMV[args[0]]


def _cached(job: str) -> bool:
    """Whether numba's cache has an index for the job's kernel (a warm cache: nothing to share)."""
    index = getattr(getattr(getattr(_dispatcher(job), "_cache", None), "_cache_file", None), "_index_path", None)
    return index is None or os.path.exists(index)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def start(uses: Iterable[tuple[str, int | None]]) -> None:
    """Start the helper for the cold kernels of weight uses (dtype, rows of x or None for get_rows),
    given in the order this process will need them (once per process; not on 1 CPU)."""
    global _proc
    if _proc is not None or _cpus() < 2 or flags.enabled("GRAPHIR_NO_PRECOMPILE"):
        return
    uses = list(uses)
    # then the one-token products of the same weights: a prefill is followed by decode steps
    cold = [j for j in jobs_for(uses + [(d, 1) for d, rows in uses if rows is not None]) if not _cached(j)]
    if len(cold) < 2:  # the first job is this process's own: nothing to share
        return
    mine, theirs = cold[0], cold[1:]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    try:
        _proc = subprocess.Popen([sys.executable, "-m", __name__, *theirs], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    except OSError:  # no helper: this process compiles everything, as without one
        return
    with _cond:
        _jobs.update(dict.fromkeys(theirs, "queued"))
        _jobs.pop(mine, None)
    threading.Thread(target=_follow, args=(_proc,), daemon=True).start()
    atexit.register(_stop, _proc)


def _follow(proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        state, _, job = line.strip().partition(" ")
        with _cond:
            if job in _jobs:
                _jobs[job] = state
            _cond.notify_all()
    proc.wait()
    with _cond:
        for job, state in _jobs.items():
            if state != "done":
                _jobs[job] = "gone"
        _cond.notify_all()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def wait(job: str) -> None:
    """Return when the helper is not compiling `job` (done, gone, queued there, or never given it)."""
    with _cond:
        _cond.wait_for(lambda: _jobs.get(job) != "running")


def state(job: str) -> str | None:
    """The helper's state of `job`, or None when it was never given it (for tests)."""
    with _cond:
        return _jobs.get(job)


def _compile(job: str) -> None:
    kind, *args = job.split(":")
    if kind == "matmul":
        from .matmul import _compile as compile_matmul

        compile_matmul(*args)
    elif kind == "gemv":
        from .gemv_repacked import _compile as compile_gemv

        compile_gemv(*args)
    else:
        raise ValueError(f"precompile: unknown job {job!r} (matmul:<dtype>:<mode> or gemv:<q4|q8>)")


if __name__ == "__main__":
    for _job in sys.argv[1:]:
        print("running", _job, flush=True)
        _compile(_job)
        print("done", _job, flush=True)
