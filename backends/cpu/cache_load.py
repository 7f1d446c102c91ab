"""This backend's kernels loaded from numba's on-disk cache without numba's compiler start-up.

numba's `Cache.load_overload` first refreshes the target context: it imports and installs every typing
and lowering registry (numba.cpython.*, numba.np.*, typed containers, ...), 0.12-0.15 s once per process
on the 2-core machine, a quarter of a second process's time to its first token. Machine code read back
from the cache needs none of it: rebuilding a kernel links its object code against symbols that exist
without the registries (numba's C helpers and math functions, registered when the target context is
made; the parallel runtime, started by the library's own reload hooks) plus the NRT's, which
`rtsys.initialize` registers. So for kernels of this package a cache load initializes the NRT only.

Such a load also leaves the entry's LLVM bitcode unparsed: numba parses it (0.03 s for SmolLM2's 9 first
kernels) to list the symbols the object code defines, which the object's own symbol table lists
(elf_symbols.py), and to link the kernel into another one compiled later, which parses it then.

Nothing else changes: a cache miss compiles as before (numba's compiler refreshes the contexts itself
before compiling), other packages' functions load as numba loads them, and a load that fails on the
short path is tried again on numba's own. Where numba's cache no longer has these methods, nothing is
patched.
"""

from __future__ import annotations

import threading
from typing import Any

from llvmlite import binding as ll
from numba.core import caching, codegen
from numba.core.runtime import rtsys

from . import elf_symbols

PACKAGE = __name__.rpartition(".")[0] + "."  # "graphir.backends.cpu."
_LOADING = threading.local()  # .ours: this thread is loading one of this package's kernels from the cache


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
            _LOADING.ours = True
            try:
                with self._guard_against_spurious_io_errors():
                    return self._load_overload(sig, target_context)
            finally:
                _LOADING.ours = False
        except Exception:  # whatever the short path lacks, numba's own load has
            return full(self, sig, target_context)

    load_overload._graphir_light = True  # type: ignore[attr-defined]
    cls.load_overload = load_overload
    _install_lazy_bitcode()
    return True


def _install_lazy_bitcode() -> bool:
    """Object-code libraries of this package's kernels unserialized without parsing their bitcode until a compile
    links them in; False (nothing patched) where numba's code library lacks what this relies on."""
    lib = codegen.CPUCodeLibrary
    unserialize = lib.__dict__.get("_unserialize")
    for_linking = getattr(lib, "_get_module_for_linking", None)
    needed = ("enable_object_caching", "_set_compiled_object", "_finalize_final_module")
    if not hasattr(getattr(codegen, "JitEngine", None), "_load_defined_symbols"):
        return False
    if not isinstance(unserialize, classmethod) or for_linking is None or not all(hasattr(lib, a) for a in needed):
        return False
    full = unserialize.__func__

    def _unserialize(cls: Any, cg: Any, state: Any) -> Any:
        name, kind, data = state
        engine = getattr(cg, "_engine", None)
        names = None
        if kind == "object" and getattr(_LOADING, "ours", False) and isinstance(
                getattr(engine, "_defined_symbols", None), set):
            names = elf_symbols.defined(data[0])
        if names is None:
            return full(cls, cg, state)
        object_code, shared_bitcode = data
        self = cg.create_library(name)
        self.enable_object_caching()
        self._set_compiled_object(object_code)
        self._graphir_bitcode = shared_bitcode  # parsed by _get_module_for_linking when asked for
        self._finalize_final_module()
        engine._defined_symbols |= names  # what numba's _load_defined_symbols adds, from the bitcode
        return self

    def _get_module_for_linking(self: Any) -> Any:
        bitcode = self.__dict__.pop("_graphir_bitcode", None)
        if bitcode is not None and self._shared_module is None:
            self._shared_module = ll.parse_bitcode(bitcode)
        return for_linking(self)

    lib._unserialize = classmethod(_unserialize)
    lib._get_module_for_linking = _get_module_for_linking
    jit_lib = codegen.JITCodeLibrary
    pointer = jit_lib.get_pointer_to_function

    def get_pointer_to_function(self: Any, name: str) -> int:
        address = pointer(self, name)
        if not address and "_graphir_bitcode" in self.__dict__:  # a name the symbol table missed: numba's list
            self._codegen._engine._load_defined_symbols(self._get_module_for_linking())
            address = pointer(self, name)
        return address

    jit_lib.get_pointer_to_function = get_pointer_to_function
    return True
