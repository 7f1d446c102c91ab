"""Each kernel of this package calls its own copies of the numba functions linked into it, in the process
that compiles it as in one that loads it from numba's cache: the same machine code either way.

numba links what a kernel calls (its helpers, a prange body's gufunc, the NRT) into the kernel's LLVM
module as linkonce_odr copies and optimizes the whole module again (codegen.CPUCodeLibrary.finalize). In
object code those copies are weak symbols, which the JIT's linker binds to the first definition of that
name loaded in the process. A process that compiles a kernel has loaded each callee's library first
(optimized once, on its own), so the kernel's calls went there; a process that loads the kernel from the
cache runs the kernel's own copies (optimized again inside the kernel's module), or those of whichever
cached kernel it loaded first. Under fast-math the two optimizations may sum in different orders:
SmolLM2's decode attention (decode_attention_d64_g3's prange body) gave outputs up to 5e-7 apart, its
logits 3e-5 apart, between a process with a cold cache and one with a warm one.

So before numba optimizes one of this package's kernel modules, the linked-in copies become internal:
a kernel's calls bind to its own code, the code its cache entry holds. Cache entries made without this
(weak copies) carry a different index key, so they are compiled again, not loaded.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path
from typing import Any

from llvmlite import binding as ll
from numba.core import caching, codegen

PACKAGE = __name__.rpartition(".")[0]  # "graphir.backends.cpu"
MANGLED_PREFIX = "_ZN" + "".join(f"{len(p)}{p}" for p in PACKAGE.split("."))  # numba's mangling of PACKAGE.<...>
KEY_TAG = ("graphir: linked-in copies internal", 1)  # in the cache index key of this package's kernels


def _ours(module: Any) -> bool:
    """Whether an LLVM module exports a function of this package (a kernel's own library)."""
    return any(not f.is_declaration and f.linkage == ll.Linkage.external and f.name.startswith(MANGLED_PREFIX)
               for f in module.functions)


# numba's linked-in copies are linkonce_odr; a gufunc's wrapper (which calls a prange body) is weak_odr
_SHARED = (ll.Linkage.linkonce_odr, ll.Linkage.weak_odr, ll.Linkage.linkonce_any, ll.Linkage.weak_any)


def internalize_linked(module: Any) -> int:
    """Make the module's shared definitions (linkonce or weak: numba's linked-in copies) internal;
    returns how many."""
    copies = [f for f in module.functions if not f.is_declaration and f.linkage in _SHARED]
    for f in copies:
        f.linkage = "internal"
    return len(copies)


@functools.cache
def depends_key(module: str) -> tuple[str, ...]:
    """Hashes of the sibling sources a kernel module lists in CACHE_DEPENDS: files whose numba functions or LLVM
    emitters its kernels compile in. numba's cache checks a kernel's own file only, so without them an edit there
    would leave the kernel's cached machine code as it was (gemv_q16x compiles gemv_q8x's emitters)."""
    names = getattr(sys.modules.get(module), "CACHE_DEPENDS", ())
    return tuple(hashlib.sha256((Path(__file__).parent / n).read_bytes()).hexdigest()[:16] for n in names)


def install() -> bool:
    """Patch numba (once) for this package's kernels; False where numba lacks the methods patched."""
    lib_cls, cache_cls = codegen.CPUCodeLibrary, caching.Cache
    if not all(hasattr(c, a) for c, a in ((lib_cls, "_optimize_final_module"), (cache_cls, "_index_key"))):
        return False
    optimize, index_key = lib_cls._optimize_final_module, cache_cls._index_key
    if getattr(optimize, "_graphir_private", False):
        return True

    def _optimize_final_module(self: Any) -> None:
        if _ours(self._final_module):
            internalize_linked(self._final_module)
        optimize(self)

    def _index_key(self: Any, sig: Any, cg: Any) -> Any:
        key = index_key(self, sig, cg)
        module = getattr(getattr(self, "_py_func", None), "__module__", "") or ""
        return (*key, KEY_TAG, *depends_key(module)) if module.startswith(PACKAGE + ".") else key

    _optimize_final_module._graphir_private = True  # type: ignore[attr-defined]
    lib_cls._optimize_final_module = _optimize_final_module
    cache_cls._index_key = _index_key
    return True
