"""Passed graphs on disk: a new process reuses what an earlier one's pass pipeline made.

The default pipeline takes ~0.15-0.2 s a graph in Python (SmolLM2's decode graph, 1059 nodes after
it), and a model runs it on two graphs before its first token; reading the result back as JSON takes
~0.02 s. An entry is keyed by the input graph's signature, the pipeline as parsed (a flag that
changes what `default` expands to changes the key) and a hash of the code that defines graphs and
passes (graphir/ir.py, builder.py, taint.py, graphir/ops/, graphir/passes/), so an edited pass or op
never serves a stale graph. A pipeline naming a pass registered outside graphir.passes (a test's, a
user's) is never cached: its code is not in the hash. GRAPHIR_NO_GRAPH_CACHE=1 turns the cache off.

Where: $GRAPHIR_CACHE_DIR/passed, else ~/.cache/graphir/passed. Unwritable or corrupt entries are
skipped: the pipeline runs as if there were none.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from graphir import flags
from graphir.errors import GraphirError
from graphir.ir import Graph

_CODE = ("ir.py", "builder.py", "taint.py", "ops", "passes")


def files_hash(files: Iterable[Path]) -> str:
    """A hash of source files' names and bytes: the code part of a disk cache's key (this module's graphs, the cpu
    backend's kept weights, GGUF headers), so an edited file never serves what its old version made."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def file_identity(path: str | os.PathLike[str]) -> list[Any] | None:
    """A model file's identity in a disk cache's key (real path, device, inode, size, mtime_ns, ctime_ns): what an
    edit, a copy or a replacement of the file changes. None where the file cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


_SEAL = 32  # bytes of blake2b over a sealed entry's payload, stored after its magic


def read_sealed(path: Path, magic: bytes) -> bytes | None:
    """The payload of an entry write_sealed kept at `path`, or None where there is none or its bytes do not match
    the digest stored before them (a truncated or overwritten entry misses before anything parses it)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = len(magic) + _SEAL
    if data[:len(magic)] != magic or hashlib.blake2b(data[head:], digest_size=_SEAL).digest() != data[len(magic):head]:
        return None
    return data[head:]


def write_sealed(path: Path, magic: bytes, payload: bytes) -> None:
    """Keep `payload` at `path` behind `magic` and its digest, written whole or not at all (a temporary file
    replaced into place); nothing where the disk refuses."""
    tmp = path.with_name(f".{os.getpid()}.{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(magic + hashlib.blake2b(payload, digest_size=_SEAL).digest() + payload)
        tmp.replace(path)
    except OSError:
        with contextlib.suppress(OSError):  # a cache folder that cannot exist (a file in its place)
            tmp.unlink(missing_ok=True)


@functools.cache
def code_hash() -> str:
    root = Path(__file__).parent
    return files_hash(f for part in _CODE
                      for f in (sorted((root / part).glob("*.py")) if (root / part).is_dir() else [root / part]))


def base_dir() -> Path:
    """Where graphir keeps what later processes reuse: $GRAPHIR_CACHE_DIR, else ~/.cache/graphir."""
    return Path(os.environ.get("GRAPHIR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "graphir"))


def cache_dir() -> Path:
    return base_dir() / "passed"


def _entry(signature: str, passes: str) -> Path | None:
    """The file for (a graph of this signature, passes), or None where the pipeline may not be cached."""
    from graphir.passes import PASSES, parse_pipeline

    if flags.enabled("GRAPHIR_NO_GRAPH_CACHE"):
        return None
    steps = parse_pipeline(passes)
    if any(not PASSES[name].impl.__module__.startswith("graphir.passes") for name, _ in steps):
        return None
    key = json.dumps([signature, steps, code_hash()], sort_keys=True, default=str)
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def load(signature: str, passes: str) -> Graph | None:
    """The cached result of `passes` on a graph of this signature (Graph.signature()), or None."""
    path = _entry(signature, passes)
    if path is None or not path.is_file():
        return None
    try:
        return Graph.from_records(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, GraphirError):
        return None  # a corrupt or foreign entry: run the pipeline instead


def store(signature: str, passes: str, result: Graph) -> None:
    """Keep `result` (passes run on a graph of this signature) for later processes; silently skipped where
    the disk refuses."""
    path = _entry(signature, passes)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result.to_records()))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError:
        pass
