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

import numpy as np
from numba.core import types
from numba.np import numpy_support


def entry_point(kernel: Any, args: Sequence[Any]) -> Callable[..., Any] | None:
    """The compiled overload's entry point that `kernel(*args)` dispatches to, or None (not compiled, or a type
    the dispatcher would convert). Call it after `kernel(*args)` has run once."""
    overloads = getattr(kernel, "overloads", None)
    if overloads is None:
        return None
    sig = _signature(kernel, args)
    cres = overloads.get(sig) if sig is not None else None
    return cres.entry_point if cres is not None else None


def _signature(kernel: Any, args: Sequence[Any]) -> tuple | None:
    """The argument types numba's dispatcher gives `args` (typeof_pyval), arrays typed here (`_array_type`)."""
    try:
        return tuple(_array_type(kernel, a) if type(a) in _ARRAYS else kernel.typeof_pyval(a) for a in args)
    except (TypeError, ValueError):
        return None


# numba's type of an ndarray argument, from what numba's typeof reads of it (numba.core.typing.typeof._typeof_ndarray:
# dtype, ndim, C, F or any layout, read-only), worked out once per kind. A new process types ~1500 arguments before
# its first token: 30 ms through typeof, whose MaskedArray check also imports numpy.ma (15 ms), for ~20 kinds.
_ARRAY_TYPES: dict[tuple[Any, ...], Any] = {}
_ARRAYS = (np.ndarray, np.memmap)  # typeof types an np.memmap (a GGUF weight's view) as it types an ndarray


def _array_type(kernel: Any, a: np.ndarray) -> Any:
    flags = a.flags
    key = (a.dtype, a.ndim, flags.c_contiguous, flags.f_contiguous, flags.writeable)
    t = _ARRAY_TYPES.get(key)
    if t is None:
        try:
            layout = "C" if flags.c_contiguous else "F" if flags.f_contiguous else "A"
            t = types.Array(numpy_support.from_dtype(a.dtype), a.ndim, layout, readonly=not flags.writeable)
        except Exception:  # a dtype numba does not take: whatever the dispatcher makes of it
            return kernel.typeof_pyval(a)
        _ARRAY_TYPES[key] = t
    return t


def first_call(kernel: Any, *args: Any) -> Callable[..., Any]:
    """`kernel(*args)`, then what to call from now on with arguments of the same types: the overload's entry point, or
    the dispatcher itself. The overload is compiled or loaded from numba's cache by `kernel.compile` for the types
    `_signature` gives, as the dispatcher's first call would for the types its typeof gives (the same types), but
    without typing every array through typeof, whose MaskedArray check imports numpy.ma (0.03 s of a second
    process's first token on the 2-core machine); where that compile fails (a literal argument numba asks for,
    compiling disabled) the call goes through the dispatcher as before."""
    call = _compiled(kernel, args)
    if call is None:
        kernel(*args)
        return entry_point(kernel, args) or kernel
    call(*args)
    return call


def _compiled(kernel: Any, args: Sequence[Any]) -> Callable[..., Any] | None:
    overloads, compile_ = getattr(kernel, "overloads", None), getattr(kernel, "compile", None)
    sig = _signature(kernel, args) if overloads is not None and compile_ is not None else None
    if sig is None:
        return None
    if sig not in overloads:
        sig = _read_only_twin(sig, overloads) or sig
    if sig not in overloads:
        try:
            compile_(sig)
        except Exception:  # whatever the dispatcher's own call makes of it (it raises the user-facing error)
            return None
    cres = overloads.get(sig)
    return cres.entry_point if cres is not None else None


def _read_only_twin(sig: tuple, overloads: Any) -> tuple | None:
    """The one compiled signature that is `sig` with some writeable arrays typed read-only (matmul's kernels type
    their inputs so, and compile nothing else): the overload the dispatcher converts such arguments to."""
    if len(overloads) != 1:
        return None
    (have,) = overloads.keys()
    if len(have) != len(sig) or not all(
            h == w or isinstance(h, types.Array) and isinstance(w, types.Array) and not h.mutable and w.mutable
            and h == w.copy(readonly=True) for h, w in zip(have, sig)):
        return None
    return have


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
