"""Derived weights on disk: stacked projections and repacked GEMV layouts, kept for later processes.

Lowering derives arrays from a model's weights once per process, into `weights.derived`: stacked
q|k|v and gate|up copies (graphir.lowering.fold_params) and the GEMVs' repacked layouts
(gemv_repacked.repack, gemv_q8x.repack: 0.06-0.1 s for SmolLM2's 121 products, 90 of them under 1 MiB,
before a second process's first token). Both are pure functions of bytes in the model file, so a cpu
Program's `weights.derived` becomes a DerivedCache: an entry missing in memory is read back from
$GRAPHIR_CACHE_DIR/weights (memory-mapped copy-on-write: no copy, writeable as numba's signatures
expect), and what a Program's binding derived is written there (`flush`) as one segment file: a header
indexing its entries, then their arrays. One file a binding, not one an entry: opening and checking 61
entry files took 0.04 s of a first token, their 90 smaller siblings were not kept at all.

An entry is keyed by the file's identity (real path, device, inode, size, mtime_ns, ctime_ns), the byte
range, dtype and shape of every source tensor in it, the derivation's key and a hash of the code that
derives (this module, gemv_repacked.py, gemv_q8x.py, matmul.py, graphir/lowering.py). It also records a
digest of the first and last 4 KiB of every source range, checked against the live mapping when read,
and each array's dtype, shape, place in the segment and a digest of its own first and last 4 KiB, checked
when read (a truncated or overwritten segment misses). Only weights that are memory-mapped file data
take part (GGUF and safetensors loads); converted, random or in-memory weights never do. Segments of a
file's earlier identities and earlier deriving code are removed when one is written. Unwritable or
unreadable segments and entries are skipped: the array is derived as if there were none.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import mmap
import os
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from graphir import flags, graph_cache

KINDS = ("concat0", "gemv_soa", "gemv_q8x")  # derivations kept on disk (weights.derived key prefixes)
SAMPLE = 4096  # bytes digested at each end of a source range and of a kept array
MAGIC = b"graphir weights 1\n"  # a segment: MAGIC, u64 header length, the JSON header, arrays from ALIGN on
ALIGN = 64  # arrays start 64-byte aligned in the file (numba types unaligned arrays apart)
MAX_SEGMENTS = 16  # more in one folder (entries derived again and again): all removed before the next is written
_CODE = ("weight_cache.py", "gemv_repacked.py", "gemv_q8x.py", "matmul.py")  # beside this file; and graphir/lowering.py


@functools.cache
def code_hash() -> str:
    import graphir.lowering

    return graph_cache.files_hash([*(Path(__file__).with_name(n) for n in _CODE), Path(graphir.lowering.__file__)])


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


identity = graph_cache.file_identity  # a module name of its own: tests blind it to an edit


def _digest(a: np.ndarray) -> str:
    b = a.reshape(-1).view(np.uint8)
    h = hashlib.blake2b(b[:SAMPLE], digest_size=16)  # hashed in place: no copies (~800 digests a first token)
    h.update(b[-SAMPLE:])
    return h.hexdigest()


class DerivedCache(dict):
    """`weights.derived` backed by the disk for the KINDS of entries whose sources are one mapped file."""

    def __init__(self, weights: Any, items: dict | None = None):
        super().__init__(items or {})
        self._weights = weights
        self._tried: set = set()  # keys looked up on disk already (a miss is not looked up again)
        self._identities: dict[str, tuple[list[Any], Path] | None] = {}  # file -> (identity, its folder)
        self._digests: dict[tuple[str, int, int], str] = {}  # a source range's _digest
        self._indexes: dict[Path, dict[str, list]] = {}  # folder -> entry name -> [(mapping, data start, header)]
        self._pending: dict[Path, dict[str, tuple]] = {}  # folder -> entry name -> (manifest, arrays, is_tuple)

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
        entry = self._entry(key) if items is not None else None
        if entry is not None:
            folder, name, manifest = entry
            self._pending.setdefault(folder, {})[name] = (manifest, items, isinstance(value, tuple))

    def flush(self) -> None:
        """Write what was derived since the last flush: one segment a model file (CpuProgram, after binding)."""
        pending, self._pending = self._pending, {}
        for folder, entries in pending.items():
            _write_segment(folder, entries)

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

    def _entry(self, key: Any) -> tuple[Path, str, dict] | None:
        """(the segment folder, the entry's name, its manifest without arrays) for a key kept on disk, else None."""
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
        if len(files) != 1:
            return None
        known = self._identity(files.pop())
        if known is None:
            return None
        ident, folder = known
        text = json.dumps([ident, spec, code_hash()])
        name = hashlib.sha256(text.encode()).hexdigest()[:32]
        return folder, name, {"key": text, "digests": [self._source_digest(*src) for src in sources]}

    def _source_digest(self, where: tuple[str, int, int], a: np.ndarray) -> str:
        """_digest of a source range, once per process (a weight is a source of several entries)."""
        if where not in self._digests:
            self._digests[where] = _digest(a)
        return self._digests[where]

    def _identity(self, path: str) -> tuple[list[Any], Path] | None:
        if path not in self._identities:  # once per process: the mapping was made from this file as it was then
            ident = identity(path)
            # one folder per (file, identity and code): writing into a new one removes the file's older ones
            version = hashlib.sha256(json.dumps([ident, code_hash()]).encode()).hexdigest()[:16]
            folder = cache_root() / hashlib.sha256(ident[0].encode()).hexdigest()[:16] / version if ident else None
            self._identities[path] = (ident, folder) if ident else None
        return self._identities[path]

    def _load(self, key: Any) -> bool:
        if key in self._tried:
            return False
        self._tried.add(key)
        entry = self._entry(key)
        if entry is None:
            return False
        folder, name, manifest = entry
        if folder not in self._indexes:
            self._indexes[folder] = _read_index(folder)
        for candidate in self._indexes[folder].get(name, ()):
            value = _value(*candidate, manifest)
            if value is not None:
                super().__setitem__(key, value)
                return True
        return False


def attach(weights: Any) -> None:
    """Make `weights.derived` a DerivedCache (once; what it already holds stays). GRAPHIR_NO_WEIGHT_CACHE=1:
    leave it a plain dict, so nothing is read from or written to disk."""
    derived = getattr(weights, "derived", None)
    if type(derived) is dict and not flags.enabled("GRAPHIR_NO_WEIGHT_CACHE"):
        weights.derived = DerivedCache(weights, derived)


def flush(weights: Any) -> None:
    """Write what `weights.derived` derived since its last flush, where it is a DerivedCache."""
    derived = getattr(weights, "derived", None)
    if isinstance(derived, DerivedCache):
        derived.flush()


def _arrays(value: Any) -> list[np.ndarray | None] | None:
    items = list(value) if isinstance(value, tuple) else [value]
    if not all(v is None or isinstance(v, np.ndarray) and v.dtype != object for v in items):
        return None
    return items


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _write_segment(folder: Path, entries: dict[str, tuple]) -> None:
    header: dict[str, Any] = {}
    blobs: list[tuple[int, np.ndarray]] = []
    end = 0
    for name, (manifest, items, is_tuple) in entries.items():
        arrays: list[Any] = []
        for a in items:
            if a is None:
                arrays.append(None)
                continue
            a = a if a.flags.c_contiguous else a.copy(order="C")
            off = _aligned(end)
            arrays.append([a.dtype.str, list(a.shape), off, int(a.nbytes), _digest(a)])
            blobs.append((off, a))
            end = off + a.nbytes
        header[name] = {**manifest, "tuple": is_tuple, "arrays": arrays}
    head = json.dumps(header).encode()
    start = _aligned(len(MAGIC) + 8 + len(head))
    tmp = folder / f".{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.parent.iterdir():  # the file's earlier identities or code: stale
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        segments = list(folder.glob("*.seg"))
        if len(segments) >= MAX_SEGMENTS:
            for s in segments:
                s.unlink(missing_ok=True)
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(head)) + head)
            for off, a in blobs:
                f.seek(start + off)
                f.write(a.reshape(-1).view(np.uint8).data)
            f.truncate(start + end)
        tmp.replace(tmp.with_name(f"{uuid.uuid4().hex}.seg"))  # whole once it has its name
    except OSError:
        with contextlib.suppress(OSError):  # a cache folder that cannot exist (a file in its place)
            tmp.unlink(missing_ok=True)


def _read_index(folder: Path) -> dict[str, list]:
    """Entry name -> [(the segment's mapping, where its arrays start, the entry's header)] of every readable
    segment in `folder`."""
    index: dict[str, list] = {}
    try:
        segments = sorted(folder.glob("*.seg"))
    except OSError:
        return index
    for seg in segments:
        try:
            with open(seg, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                lead = f.read(len(MAGIC) + 8)
                if lead[:len(MAGIC)] != MAGIC:
                    continue
                (n,) = struct.unpack("<Q", lead[len(MAGIC):])
                start = _aligned(len(MAGIC) + 8 + n)
                if start > size:
                    continue
                header = json.loads(f.read(n))
            mm = np.memmap(seg, np.uint8, mode="c")
        except (OSError, ValueError, struct.error):
            continue
        if isinstance(header, dict):
            for name, meta in header.items():
                index.setdefault(name, []).append((mm, start, meta))
    return index


def _value(mm: np.memmap, start: int, meta: Any, manifest: dict) -> Any:
    """The entry `meta` describes, as arrays mapped from `mm`, if it is the one `manifest` asks for and its arrays
    are whole; else None."""
    try:
        if meta.get("key") != manifest["key"] or meta.get("digests") != manifest["digests"]:
            return None  # a hash collision, or source bytes that changed under an unchanged identity
        items: list[np.ndarray | None] = []
        for want in meta["arrays"]:
            if want is None:
                items.append(None)
                continue
            dt, shape, off, nbytes, check = want
            dtype = np.dtype(dt)
            if dtype.hasobject or off < 0 or nbytes != int(np.prod(shape)) * dtype.itemsize \
                    or start + off + nbytes > mm.size:
                return None
            a = mm[start + off:start + off + nbytes].view(dtype).reshape(shape).view(np.ndarray)
            if _digest(a) != check:
                return None
            items.append(a)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None
    return tuple(items) if meta.get("tuple") else items[0]
