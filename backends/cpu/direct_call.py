"""Bound kernel calls that skip numba's dispatcher once the kernel has run.

A step calls its kernel with the same arrays and scalars every time, so the dispatcher's work at each call
(typing every argument, looking up the compiled overload) gives the same answer each time. Measured on the
SmolLM2 decode step's kernels (2-core EPYC, numba 0.68.1, hot caches): the dispatcher costs 0.25-0.9 us a call
more than the overload's entry point, which still unboxes the arguments; over a token's 213 non-GEMV calls,
0.21 ms (benchmarks/profile_decode_overhead.py).

`KernelCall(kernel, *args)` is a step: its first call goes through the dispatcher, exactly as a lambda would
(so numba compiles the kernel or loads it from its cache then, and precompile.py's helper is met as before);
after it, `direct` is `functools.partial(entry_point, *args)`, a C-level callable, which the step calls from
then on and which a Program puts in its step list in place of the KernelCall (`unwrap`). Where no overload
matches the arguments' types as `typeof_pyval` gives them, the step keeps calling the dispatcher.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any


def entry_point(kernel: Any, args: Sequence[Any]) -> Callable[..., Any] | None:
    """The compiled overload's entry point that `kernel(*args)` dispatches to, or None (not compiled, or a type
    the dispatcher would convert). Call it after `kernel(*args)` has run once."""
    overloads = getattr(kernel, "overloads", None)
    if overloads is None:
        return None
    try:
        sig = tuple(kernel.typeof_pyval(a) for a in args)
    except (TypeError, ValueError):
        return None
    cres = overloads.get(sig)
    return cres.entry_point if cres is not None else None


def first_call(kernel: Any, *args: Any) -> Callable[..., Any]:
    """`kernel(*args)` through the dispatcher (which compiles the kernel or loads it from numba's cache), then what to
    call from now on with arguments of the same types: the overload's entry point, or the dispatcher itself."""
    kernel(*args)
    return entry_point(kernel, args) or kernel


class KernelCall:
    """A zero-argument step `kernel(*args)`: through the dispatcher the first time, then the entry point."""

    __slots__ = ("kernel", "args", "direct")

    def __init__(self, kernel: Any, *args: Any):
        self.kernel = kernel
        self.args = args
        self.direct: Callable[[], Any] | None = None

    def __call__(self) -> None:
        if self.direct is not None:
            self.direct()
            return
        call = first_call(self.kernel, *self.args)
        if call is not self.kernel:
            self.direct = functools.partial(call, *self.args)


def unwrap(steps: list[Callable[[], None]]) -> list[Callable[[], None]]:
    """`steps` with every KernelCall that has run replaced by its direct call (one Python frame less a step)."""
    return [s.direct if isinstance(s, KernelCall) and s.direct is not None else s for s in steps]
