"""The numba CPU backend: graphs lowered to bound, compiled kernels over a planned arena."""

import sys

if __name__ != "graphir.backends.cpu":
    # Imported by path as `backends.cpu` (the repo root on sys.path). numba's on-disk cache is keyed
    # by source file and function, not by module name, so a second copy of these kernel modules under
    # another name would share cache entries linked under the first name: a wrong kernel loaded, or a
    # cache flushed and compiled again by each name in turn. Every submodule of this name is the
    # installed one instead, so the kernels exist once per process and compile once per machine.
    import importlib
    import pkgutil

    for _sub in pkgutil.iter_modules(__path__):
        sys.modules[f"{__name__}.{_sub.name}"] = importlib.import_module(f"graphir.backends.cpu.{_sub.name}")
    sys.modules[__name__] = importlib.import_module("graphir.backends.cpu")
else:
    # link_private makes each kernel call its own linked-in code, compiled or loaded alike (first: before
    # any kernel compiles); compile_note registers the first-run note before any kernel compiles;
    # cache_load makes loading them from numba's cache skip numba's compiler start-up, nrt_cache numba's runtime
    # start from its library kept on disk; numba and the kernel
    # modules are imported with the garbage collector paused (graphir/gc_pause.py: they allocate ~200k objects
    # that live as long as the process, and would trigger a full collection)
    from graphir.gc_pause import gc_paused

    with gc_paused():
        from . import numba_import

        numba_import.import_numba()  # without PyYAML where numba would not read a config file with it
        from . import link_private

        link_private.install()
        from . import cache_load, compile_note, kernels, matmul, nrt_cache
        from .program import CpuProgram, lower
        from .threads import get_threads, set_threads

    if compile_note.note_if_cold([kernels, matmul]):  # before a command prints anything of its own
        from . import precompile

        precompile.start()  # the helper's start-up overlaps the model's load (it gets its jobs when a Program binds)
    cache_load.install()
    nrt_cache.install()

    __all__ = ["lower", "CpuProgram", "set_threads", "get_threads"]
