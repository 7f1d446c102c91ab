"""Derived weights on disk: stacked projections and repacked GEMV layouts, kept for later processes.

Lowering derives arrays from a model's weights once per process, into `weights.derived`: stacked
q|k|v and gate|up copies (graphir.lowering.fold_params: 0.06 s for SmolLM2's prefill graph) and the
GEMV's structure-of-arrays repacks (gemv_repacked.repack: 0.05 s for the Q8_0 head before the first
token, ~0.2 s for every weight when decode binds). Both are pure functions of bytes in the model file,
so a cpu Program's `weights.derived` becomes a DerivedCache: an entry missing in memory is read back
from $GRAPHIR_CACHE_DIR/weights (memory-mapped copy-on-write: no copy, writeable as numba's
signatures expect), and a new one is written there.

An entry is keyed by the file's identity (real path, device, inode, size, mtime_ns, ctime_ns), the byte
range, dtype and shape of every source tensor in it, the derivation's key and a hash of the code that
derives (this module, gemv_repacked.py, matmul.py, graphir/lowering.py). It also records a digest of
the first and last 4 KiB of every source range, checked against the live mapping when read, and the
shapes and dtypes of its arrays. Only weights that are memory-mapped file data take part (GGUF and
safetensors loads); converted, random or in-memory weights never do, nor entries under MIN_BYTES.
Writing a file's entries removes those of its earlier identities and earlier deriving code. Unwritable
or unreadable entries are skipped: the array is derived as if there were none.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from graphir import flags, graph_cache

KINDS = ("concat0", "gemv_soa", "gemv_q8x")  # derivations kept on disk (weights.derived key prefixes)
MIN_BYTES = 1 << 20  # smaller entries derive faster than a file is opened and checked
SAMPLE = 4096  # bytes digested at each end of a source range
_CODE = ("weight_cache.py", "gemv_repacked.py", "gemv_q8x.py", "matmul.py")  # beside this file; and graphir/lowering.py


@functools.cache
def code_hash() -> str:
    import graphir.lowering

    h = hashlib.sha256()
    for f in [*(Path(__file__).with_name(n) for n in _CODE), Path(graphir.lowering.__file__)]:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return graph_cache.base_dir() / "weights"


def file_range(a: Any) -> tuple[str, int, int] | None:
    """(file, byte offset, byte count) of a C-contiguous array that is a view of a memory-mapped file, else None."""
    mm, name = getattr(a, "_mmap", None), getattr(a, "filename", None)  # kept by np.memmap and its views
    if not isinstance(mm, mmap.mmap) or not name or not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
        return None
    try:
        base = np.frombuffer(mm, np.uint8).ctypes.data
    except (TypeError, ValueError):  # a closed mapping
        return None
    start = a.offset - a.offset % mmap.ALLOCATIONGRANULARITY  # where np.memmap began its mapping
    return str(name), start + a.ctypes.data - base, int(a.nbytes)


def identity(path: str) -> list[Any] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _digest(a: np.ndarray) -> str:
    b = a.reshape(-1).view(np.uint8)
    return hashlib.blake2b(b[:SAMPLE].tobytes() + b[-SAMPLE:].tobytes(), digest_size=16).hexdigest()


class DerivedCache(dict):
    """`weights.derived` backed by the disk for the KINDS of entries whose sources are one mapped file."""

    def __init__(self, weights: Any, items: dict | None = None):
        super().__init__(items or {})
        self._weights = weights
        self._tried: set = set()  # keys looked up on disk already (a miss is not looked up again)
        self._identities: dict[str, list[Any] | None] = {}

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or self._load(key)

    def __getitem__(self, key: Any) -> Any:
        if not super().__contains__(key):
            self._load(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self._tried.add(key)
        items = _arrays(value)
        entry = self._entry(key) if items is not None and sum(a.nbytes for a in items if a is not None) >= MIN_BYTES \
            else None
        if entry is not None:
            _store(*entry, items, isinstance(value, tuple))

    def _sources(self, part: Any, out: list) -> Any:
        """`part` of a key with every ("param", name) replaced by its file range, dtype and shape (into `out`)."""
        if isinstance(part, tuple) and len(part) == 2 and part[0] == "param" and isinstance(part[1], str):
            w = self._weights.get(part[1])
            where = file_range(w.data) if w is not None else None
            if where is None:
                raise LookupError(part[1])
            out.append((where, w.data))
            return ["param", where[1], where[2], w.dtype, list(w.shape)]
        if isinstance(part, tuple):
            return [self._sources(p, out) for p in part]
        if isinstance(part, (str, int)) and not isinstance(part, bool):
            return part
        raise LookupError(repr(part))

    def _entry(self, key: Any) -> tuple[Path, dict] | None:
        """(the entry's path stem, its manifest without arrays) for a key kept on disk, else None."""
        if not (isinstance(key, tuple) and key and key[0] in KINDS):
            return None
        # gemv_soa / gemv_q8x keys end with the repacked weight's own key, flattened: ("param", name), ("concat0", ...)
        parts = key if key[0] == "concat0" else key[:2] + (key[2:],)
        sources: list = []
        try:
            spec = self._sources(parts, sources)
        except LookupError:
            return None
        files = {where[0] for where, _ in sources}
        if len(files) != 1 or sum(where[2] for where, _ in sources) < MIN_BYTES:
            return None
        ident = self._identity(files.pop())
        if ident is None:
            return None
        text = json.dumps([ident, spec, code_hash()])
        # one folder per (file, identity and code): writing into a new one removes the file's older ones
        version = hashlib.sha256(json.dumps([ident, code_hash()]).encode()).hexdigest()[:16]
        stem = cache_root() / hashlib.sha256(ident[0].encode()).hexdigest()[:16] / version / \
            hashlib.sha256(text.encode()).hexdigest()[:32]
        return stem, {"key": text, "digests": [_digest(a) for _, a in sources]}

    def _identity(self, path: str) -> list[Any] | None:
        if path not in self._identities:  # once per process: the mapping was made from this file as it was then
            self._identities[path] = identity(path)
        return self._identities[path]

    def _load(self, key: Any) -> bool:
        if key in self._tried:
            return False
        self._tried.add(key)
        entry = self._entry(key)
        value = _read(*entry) if entry is not None else None
        if value is None:
            return False
        super().__setitem__(key, value)
        return True


def attach(weights: Any) -> None:
    """Make `weights.derived` a DerivedCache (once; what it already holds stays). GRAPHIR_NO_WEIGHT_CACHE=1:
    leave it a plain dict, so nothing is read from or written to disk."""
    derived = getattr(weights, "derived", None)
    if type(derived) is dict and not flags.enabled("GRAPHIR_NO_WEIGHT_CACHE"):
        weights.derived = DerivedCache(weights, derived)


def _arrays(value: Any) -> list[np.ndarray | None] | None:
    items = list(value) if isinstance(value, tuple) else [value]
    if not all(v is None or isinstance(v, np.ndarray) and v.dtype != object for v in items):
        return None
    return items


def _store(stem: Path, manifest: dict, items: list[np.ndarray | None], is_tuple: bool) -> None:
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        for old in stem.parent.parent.iterdir():  # the file's earlier identities or code: stale
            if old != stem.parent:
                shutil.rmtree(old, ignore_errors=True)
        tmp = f".{os.getpid()}.tmp"
        for i, a in enumerate(items):
            if a is not None:
                path = stem.with_suffix(f".{i}.npy")
                with open(path.with_suffix(tmp), "wb") as f:
                    np.save(f, np.ascontiguousarray(a))
                path.with_suffix(tmp).replace(path)
        meta = {**manifest, "tuple": is_tuple,
                "arrays": [None if a is None else [a.dtype.str, list(a.shape)] for a in items]}
        stem.with_suffix(tmp).write_text(json.dumps(meta))
        stem.with_suffix(tmp).replace(stem.with_suffix(".json"))  # last: an entry is whole once this exists
    except OSError:
        pass


def _read(stem: Path, manifest: dict) -> Any:
    try:
        meta = json.loads(stem.with_suffix(".json").read_text())
        if meta.get("key") != manifest["key"] or meta.get("digests") != manifest["digests"]:
            return None  # a hash collision, or source bytes that changed under an unchanged identity
        items: list[np.ndarray | None] = []
        for i, want in enumerate(meta["arrays"]):
            if want is None:
                items.append(None)
                continue
            a = np.load(stem.with_suffix(f".{i}.npy"), mmap_mode="c")
            if [a.dtype.str, list(a.shape)] != want:
                return None
            items.append(a.view(np.ndarray))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return tuple(items) if meta["tuple"] else items[0]
