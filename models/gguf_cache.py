"""A GGUF file's parsed header on disk, so a later process skips the parse.

Parsing SmolLM2's header decodes its 49k-token vocabulary and 49k merges one string at a time: 0.04-0.05 s of
a second process's ~0.7 s to its first token on the 2-core machine; unpickling the parsed header takes 0.01 s.
An entry is kept per file under $GRAPHIR_CACHE_DIR/gguf (graph_cache.base_dir) and read back only when all of
these hold: the file's identity (real path, device, inode, size, mtime_ns, ctime_ns) and the hash of the code
that parses (gguf_file.py, graphir/dtypes.py) are the entry's; a digest of the whole header as it is in the
file now (its bytes up to the tensor data, ~1.5 MB: ~2 ms) is the one the entry was made from; and the entry's
own bytes match the digest stored before them (a truncated or overwritten entry misses before it is unpickled).
Whatever fails, the header is parsed as if there were no entry, and a new entry replaces the old.
GRAPHIR_NO_HEADER_CACHE=1: neither read nor written.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

from graphir import flags, graph_cache

MAGIC = b"graphir gguf header 1\n"


@functools.cache
def code_hash() -> str:
    import graphir.dtypes

    return graph_cache.files_hash((Path(__file__).with_name("gguf_file.py"), Path(__file__),
                                   Path(graphir.dtypes.__file__)))


identity = graph_cache.file_identity  # a module name of its own: tests blind it to an edit


def entry_path(ident: list[Any]) -> Path:
    return graph_cache.base_dir() / "gguf" / (hashlib.sha256(ident[0].encode()).hexdigest()[:24] + ".pkl")


def _header_digest(mm: Any, end: int) -> str:
    return hashlib.blake2b(mm[:end], digest_size=16).hexdigest()


def read(path: str | os.PathLike[str], mm: Any) -> dict[str, Any] | None:
    """The parsed header kept for this file (`mm`: its mapping), or None where there is none to trust."""
    if flags.enabled("GRAPHIR_NO_HEADER_CACHE"):
        return None
    ident = identity(path)
    if ident is None:
        return None
    payload = graph_cache.read_sealed(entry_path(ident), MAGIC)
    if payload is None:
        return None
    try:
        entry = pickle.loads(payload)
        state = entry["state"]
        end = state["data_offset"]
        if entry["key"] != [ident, code_hash()] or not 0 < end <= len(mm) or \
                entry["header"] != _header_digest(mm, end):
            return None
    except Exception:  # noqa: BLE001 (whatever a damaged entry raises: unpickling can raise nearly anything)
        return None
    return state


def write(path: str | os.PathLike[str], mm: Any, state: dict[str, Any]) -> None:
    """Keep `state` (the header parsed from `mm`) for later processes; nothing where the cache is unwritable."""
    if flags.enabled("GRAPHIR_NO_HEADER_CACHE"):
        return
    ident = identity(path)
    if ident is None:
        return
    try:
        entry = {"key": [ident, code_hash()], "header": _header_digest(mm, state["data_offset"]), "state": state}
        payload = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
    except pickle.PicklingError:
        return
    graph_cache.write_sealed(entry_path(ident), MAGIC, payload)
