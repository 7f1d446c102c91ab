"""This backend's kernels loaded from numba's on-disk cache without numba's compiler start-up.

numba's `Cache.load_overload` first refreshes the target context: it imports and installs every typing
and lowering registry (numba.cpython.*, numba.np.*, typed containers, ...), 0.12-0.15 s once per process
on the 2-core machine, a quarter of a second process's time to its first token. Machine code read back
from the cache needs none of it: rebuilding a kernel links its object code against symbols that exist
without the registries (numba's C helpers and math functions, registered when the target context is
made; the parallel runtime, started by the library's own reload hooks) plus the NRT's, which
`rtsys.initialize` registers. So for kernels of this package a cache load initializes the NRT only.

Nothing else changes: a cache miss compiles as before (numba's compiler refreshes the contexts itself
before compiling), other packages' functions load as numba loads them, and a load that fails on the
short path is tried again on numba's own. Where numba's cache no longer has these methods, nothing is
patched.
"""

from __future__ import annotations

from typing import Any

from numba.core import caching
from numba.core.runtime import rtsys

PACKAGE = __name__.rpartition(".")[0] + "."  # "graphir.backends.cpu."


def _ours(cache: Any) -> bool:
    return getattr(getattr(cache, "_py_func", None), "__module__", "").startswith(PACKAGE)


def install() -> bool:
    """Patch numba's cache loads for this package's kernels (once); False where numba lacks the hooks."""
    cls = caching.Cache
    full = cls.load_overload
    if getattr(full, "_graphir_light", False):
        return True
    if not all(hasattr(cls, a) for a in ("_load_overload", "_guard_against_spurious_io_errors")):
        return False

    def load_overload(self: Any, sig: Any, target_context: Any) -> Any:
        if not _ours(self):
            return full(self, sig, target_context)
        try:
            rtsys.initialize(target_context)  # the NRT's symbols: kernels that allocate link against them
            with self._guard_against_spurious_io_errors():
                return self._load_overload(sig, target_context)
        except Exception:  # whatever the short path lacks, numba's own load has
            return full(self, sig, target_context)

    load_overload._graphir_light = True  # type: ignore[attr-defined]
    cls.load_overload = load_overload
    return True
