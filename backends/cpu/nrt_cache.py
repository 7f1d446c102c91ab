"""numba's NRT library kept on disk as object code, as numba keeps a kernel's.

The first kernel a process loads from numba's cache starts numba's runtime (`rtsys.initialize`), which builds
its refcount functions (NRT_incref, NRT_decref, the atomics) as LLVM IR and compiles them at -O3: 0.02-0.025 s
of a second process's ~0.6 s to its first token on the 2-core machine, the same machine code every time. So
the compiled library is written once per machine (numba's own object-code serialization: the object file and
the bitcode later compiles link in) and read back (~1 ms) after that.

An entry is keyed by the IR the process builds now (its text: whatever numba or its config changes in these
functions changes it), numba's and llvmlite's versions, the codegen's target (triple, CPU name and features)
and its optimization settings, and is read only when its bytes match the digest stored before them.
Where it misses, is damaged or cannot be written, the library is compiled as numba does.
GRAPHIR_NO_NRT_CACHE=1: neither read nor written. Where: $GRAPHIR_CACHE_DIR/nrt (graph_cache.base_dir).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

from graphir import flags, graph_cache

MAGIC = b"graphir nrt library 1\n"


def install() -> bool:
    """Make numba's runtime start from the kept library (once); False where numba lacks what this patches."""
    from numba.core.runtime import nrtdynmod

    full = getattr(nrtdynmod, "compile_nrt_functions", None)
    if full is None or not hasattr(nrtdynmod, "create_nrt_module"):
        return False
    if getattr(full, "_graphir_kept", False):
        return True

    def compile_nrt_functions(ctx: Any) -> Any:
        try:
            return _kept_or_compiled(ctx)
        except Exception:  # whatever this path lacks (a numba that serializes otherwise): numba's own
            return full(ctx)

    compile_nrt_functions._graphir_kept = True  # type: ignore[attr-defined]
    nrtdynmod.compile_nrt_functions = compile_nrt_functions
    return True


def _kept_or_compiled(ctx: Any) -> Any:
    """nrtdynmod.compile_nrt_functions(ctx), its library read from disk where an entry for it is kept."""
    from numba.core.runtime import nrtdynmod

    ir_mod, library = nrtdynmod.create_nrt_module(ctx)
    codegen = ctx.codegen()
    path = None if flags.enabled("GRAPHIR_NO_NRT_CACHE") else entry_path(key(codegen, str(ir_mod)))
    state = read(path) if path is not None else None
    if state is not None:
        return codegen.unserialize_library(state)
    library.enable_object_caching()  # keeps the object code MCJIT makes (the same code without it)
    library.add_ir_module(ir_mod)
    library.finalize()
    if path is not None:
        write(path, library.serialize_using_object_code())
    return library


def key(codegen: Any, ir_text: str) -> str:
    import llvmlite
    import numba
    from numba.core import config

    parts = [ir_text, numba.__version__, llvmlite.__version__, repr(codegen.magic_tuple()),
             repr((config.OPT, config.LOOP_VECTORIZE, config.SLP_VECTORIZE, config.MACHINE_BITS))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def entry_path(entry_key: str) -> Path:
    return graph_cache.base_dir() / "nrt" / f"{entry_key}.bin"


def read(path: Path) -> tuple[str, str, tuple[bytes, bytes]] | None:
    """numba's serialized state of the kept library, or None where there is none to trust."""
    data = graph_cache.read_sealed(path, MAGIC)
    if data is None or len(data) < 8:
        return None
    n_object, n_bitcode = struct.unpack_from("<II", data, 0)
    body = data[8:]
    if n_object + n_bitcode != len(body):
        return None
    return "nrt", "object", (body[:n_object], body[n_object:])


def write(path: Path, state: tuple[str, str, tuple[bytes, bytes]]) -> None:
    """Keep numba's serialized state of the compiled library; nothing where the cache is unwritable."""
    name, kind, (object_code, bitcode) = state
    if (name, kind) != ("nrt", "object"):
        return
    payload = struct.pack("<II", len(object_code), len(bitcode)) + object_code + bitcode
    graph_cache.write_sealed(path, MAGIC, payload)
