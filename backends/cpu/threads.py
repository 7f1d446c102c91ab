"""How many threads the CPU kernels use: a fixed count, or (the default) as many as other programs leave free.

A parallel kernel splits its work evenly and waits for every thread at its end, so one thread
on a core that another program keeps busy makes every kernel wait for the scheduler. Measured
on a 2-core machine, SmolLM2 Q4_1 decode (tok/s, 1 thread / 2 threads):

    quiet (benchmark at real-time priority)          80 / 133
    a compile or test run on the machine             46-59 / 15-19

So `auto` uses numba's whole pool while the machine is quiet, and one thread fewer for each
core that other processes keep busy, as graphir/cpu_load.py's watch reads it.

The count is per process (numba has one pool): `set_threads(n)` fixes it, `set_threads(None)`
returns to auto. numba's count is per calling thread, so `apply()` sets it on the thread that
runs each Program.
"""

from __future__ import annotations

import numba

from graphir import cpu_load
from graphir.errors import InputError

from .matmul import _num_threads

_fixed: int | None = None  # set_threads(n); None: auto


def pool_size() -> int:
    """numba's thread pool (NUMBA_NUM_THREADS, default the CPU count): the most threads a kernel can use."""
    return numba.config.NUMBA_NUM_THREADS


def set_threads(n: int | None) -> None:
    """Fix the kernels' thread count at n (1..pool_size()), or None for auto (the default)."""
    global _fixed
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"threads must be an int >= 1 or None (auto), got {n!r}")
        if n > pool_size():
            raise InputError(f"threads={n} exceeds numba's pool of {pool_size()} threads "
                             f"(set NUMBA_NUM_THREADS={n} before numba is imported to allow more)")
    _fixed = n


def get_threads() -> int | None:
    """The fixed thread count, or None when auto."""
    return _fixed


def threads_now() -> int:
    """The thread count the next kernel should use."""
    return _fixed if _fixed is not None else min(pool_size(), cpu_load.WATCH.current())


def apply() -> None:
    """Set numba's thread count for this calling thread to threads_now() (a Program calls this first)."""
    n = threads_now()
    if n != _num_threads():
        numba.set_num_threads(n)
