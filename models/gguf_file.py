"""A fast, strict GGUF (v2/v3, little-endian) reader.

Layout (all little-endian):
  "GGUF" | u32 version | u64 n_tensors | u64 n_kv
  n_kv x (string key | u32 value_type | value)             string = u64 length + UTF-8 bytes
  n_tensors x (string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset)
  padding to `general.alignment`, then tensor data; each offset is relative to that start.

gguf-py's GGUFReader builds a numpy view per array element and takes seconds on a 49k-token
vocabulary; here the header is walked once with struct on an mmap, and tensor data is only
mapped (np.memmap), never read, at open.

Every length and count read from the file is checked against the bytes that remain before it
is used, so a corrupt or hostile file raises LoadError instead of allocating or looping forever.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphir.dtypes import BY_GGML_ID, DTYPES
from graphir.errors import LoadError
from graphir.weights import Weight, Weights

from . import gguf_cache

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8  # GGUF allows arrays of arrays; real files nest at most once

# GGUF metadata value types -> (struct format, numpy dtype) for fixed-size scalars.
_SCALAR = {
    0: ("<B", "<u1"),  # UINT8
    1: ("<b", "<i1"),  # INT8
    2: ("<H", "<u2"),  # UINT16
    3: ("<h", "<i2"),  # INT16
    4: ("<I", "<u4"),  # UINT32
    5: ("<i", "<i4"),  # INT32
    6: ("<f", "<f4"),  # FLOAT32
    7: ("<B", "<u1"),  # BOOL (one byte)
    10: ("<Q", "<u8"),  # UINT64
    11: ("<q", "<i8"),  # INT64
    12: ("<d", "<f8"),  # FLOAT64
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_SCALAR_STRUCTS = {t: struct.Struct(fmt) for t, (fmt, _) in _SCALAR.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# ggml type names for error messages about types graphir does not handle.
_GGML_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # a graphir.dtypes name
    shape: tuple[int, ...]  # numpy order (outermost first): ggml's ne reversed
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; every failure names the file and the field."""

    def __init__(self, buf: Any, size: int, label: str):
        self.buf, self.size, self.label, self.pos = buf, size, label, 0

    def fail(self, msg: str) -> LoadError:
        return LoadError(f"{self.label}: {msg}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"truncated: {what} needs {n} bytes at offset {self.pos}, file size is {self.size}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        if n > self.size - self.pos:
            raise self.fail(f"truncated: {what} length {n} at offset {self.pos - 8} runs past the end, "
                            f"file size is {self.size}")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u64 element count, capped by what the rest of the file could possibly hold."""
        n = self.u64(what)
        if n * min_item_bytes > self.size - self.pos:
            # A cut file and a corrupt count look the same here: the items do not fit in what is left.
            raise self.fail(
                f"truncated or corrupt: {what} {n} needs at least {n * min_item_bytes} bytes, "
                f"{self.size - self.pos} left after offset {self.pos}, file size is {self.size}"
            )
        return n

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALAR_STRUCTS:
            st = _SCALAR_STRUCTS[vtype]
            self.need(st.size, what)
            (v,) = st.unpack_from(self.buf, self.pos)
            self.pos += st.size
            return bool(v) if vtype == _BOOL else v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what, depth)
        raise self.fail(f"{what} has unknown value type {vtype}")

    def array(self, what: str, depth: int) -> Any:
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_NESTING}")
        etype = self.u32(f"{what} element type")
        if etype in _SCALAR:
            size = _SCALAR_STRUCTS[etype].size
            n = self.count(f"{what} element count", size)
            # Copied so metadata does not pin the mapping; a few hundred KB at most in real files.
            arr = np.frombuffer(self.buf, dtype=_SCALAR[etype][1], count=n, offset=self.pos)
            self.pos += n * size
            return arr != 0 if etype == _BOOL else arr.astype(arr.dtype.newbyteorder("="))
        if etype == _STRING:
            return self.string_array(self.count(f"{what} element count", 8), what)
        if etype == _ARRAY:
            n = self.count(f"{what} element count", 12)  # each nested array: u32 type + u64 count
            return [self.array(f"{what}[{i}]", depth + 1) for i in range(n)]
        raise self.fail(f"{what} has unknown element type {etype}")

    def string_array(self, n: int, what: str) -> list[str]:
        # The hot loop of a vocabulary (~100k strings): locals only, one pass, one decode each.
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = [""] * n
        try:
            for i in range(n):
                if pos + 8 > size:
                    self.pos = pos
                    raise self.fail(f"truncated: {what}[{i}] length at offset {pos}, file size is {size}")
                (ln,) = unpack(buf, pos)
                pos += 8
                if ln > size - pos:
                    self.pos = pos
                    raise self.fail(f"truncated: {what}[{i}] claims {ln} bytes at offset {pos}, file size is {size}")
                out[i] = buf[pos : pos + ln].decode("utf-8")
                pos += ln
        except UnicodeDecodeError as e:
            raise self.fail(f"{what}[{i}] is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        self.pos = pos
        return out


class GGUFFile:
    """The header of a GGUF file, parsed eagerly; tensor data mapped lazily by `weights()`."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.label = str(path)
        try:
            with open(self.path, "rb") as f:
                self.file_size = os.fstat(f.fileno()).st_size
                if self.file_size < len(GGUF_MAGIC):
                    raise LoadError(f"{self.label}: {_too_short(f.read())}")
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    kept = gguf_cache.read(self.path, mm)  # an earlier process's parse of these bytes
                    if kept is not None:
                        self._restore(kept)
                    else:
                        self._parse(mm)
                        gguf_cache.write(self.path, mm, self._state())
        except OSError as e:
            raise LoadError(f"{self.label}: cannot read GGUF file: {e.strerror or e}") from None

    def _state(self) -> dict[str, Any]:
        """What `_parse` found, as gguf_cache keeps it (tensors as plain tuples)."""
        return {"version": self.version, "metadata": self.metadata, "alignment": self.alignment,
                "data_offset": self.data_offset, "tensors": [tuple(vars(t).values()) for t in self.tensors.values()]}

    def _restore(self, state: dict[str, Any]) -> None:
        self.version, self.metadata, self.alignment = state["version"], state["metadata"], state["alignment"]
        self.data_offset = state["data_offset"]
        self.tensors = {t[0]: TensorInfo(*t) for t in state["tensors"]}

    def _parse(self, mm: mmap.mmap) -> None:
        cur = _Cursor(mm, self.file_size, self.label)
        magic = mm[:4]
        if magic != GGUF_MAGIC:
            raise cur.fail(f"not a GGUF file: magic {magic!r}, expected {GGUF_MAGIC!r}")
        cur.pos = 4
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0 and (version >> 24) in SUPPORTED_VERSIONS:
                raise cur.fail("big-endian GGUF files are not supported")
            raise cur.fail(f"unsupported GGUF version {version} (supported: {SUPPORTED_VERSIONS})")
        self.version = version
        # Smallest possible tensor info: empty name (8) + n_dims (4) + type (4) + offset (8).
        n_tensors = cur.count("tensor count", 24)
        # Smallest possible key/value: empty key (8) + type (4) + a 1-byte value.
        n_kv = cur.count("metadata key/value count", 13)

        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in self.metadata:
                raise cur.fail(f"duplicate metadata key {key!r}")
            vtype = cur.u32(f"metadata {key!r} type")
            self.metadata[key] = cur.value(vtype, f"metadata {key!r}")

        self.alignment = self._alignment(cur)
        infos = [self._tensor_info(cur, i) for i in range(n_tensors)]
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dt, shape, rel, nbytes in infos:
            if name in self.tensors:
                raise cur.fail(f"duplicate tensor name {name!r}")
            if rel % self.alignment:
                raise cur.fail(f"tensor {name!r} offset {rel} is not a multiple of the alignment {self.alignment}")
            start = self.data_offset + rel
            if start + nbytes > self.file_size:
                raise cur.fail(f"truncated: tensor {name!r} data [{start}, {start + nbytes}) extends past end of file "
                               f"(file size is {self.file_size})")
            self.tensors[name] = TensorInfo(name, dt, shape, start, nbytes)

    def _alignment(self, cur: _Cursor) -> int:
        a = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(a, bool) or not isinstance(a, int) or a <= 0 or a & (a - 1):
            raise cur.fail(f"general.alignment must be a positive power of two, got {a!r}")
        return a

    def _tensor_info(self, cur: _Cursor, i: int) -> tuple[str, str, tuple[int, ...], int, int]:
        name = cur.string(f"tensor #{i} name")
        n_dims = cur.u32(f"tensor {name!r} n_dims")
        if n_dims > MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dims, more than ggml's maximum {MAX_DIMS}")
        ne = [cur.u64(f"tensor {name!r} ne[{d}]") for d in range(n_dims)]
        type_id = cur.u32(f"tensor {name!r} type")
        rel = cur.u64(f"tensor {name!r} offset")
        dt = BY_GGML_ID.get(type_id)
        if dt is None:
            known = _GGML_NAMES.get(type_id)
            what = f"ggml type {type_id} ({known})" if known else f"unknown ggml type id {type_id}"
            raise cur.fail(f"tensor {name!r}: {what} is not supported (supported: {', '.join(DTYPES)})")
        n_elem = 1
        for d in ne:
            n_elem *= d
        # Python ints do not overflow; the size check against the file bounds every product.
        row = ne[0] if ne else 1
        if row % dt.block:
            raise cur.fail(f"tensor {name!r}: row length {row} is not a multiple of {dt.name}'s block {dt.block}")
        nbytes = n_elem // dt.block * dt.block_bytes
        if nbytes > self.file_size:
            raise cur.fail(f"truncated or corrupt: tensor {name!r} shape {tuple(reversed(ne))} needs {nbytes} bytes, "
                           f"more than the file (file size is {self.file_size})")
        return name, dt.name, tuple(reversed(ne)), rel, nbytes

    def weights(self) -> Weights:
        """Every tensor as a Weight whose data is a read-only np.memmap view (no copy)."""
        if not self.tensors:
            return Weights({}, source=self.label)
        try:
            mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise LoadError(f"{self.label}: cannot map tensor data: {e}") from None
        if mm.size != self.file_size:
            raise LoadError(f"{self.label}: file changed size since it was opened ({self.file_size} -> {mm.size})")
        out = Weights(source=self.label)
        for t in self.tensors.values():
            out.add(t.name, Weight(t.dtype, t.shape, _view(mm, t)))
        return out

    def __repr__(self) -> str:
        return f"GGUFFile({self.label!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"


def _too_short(head: bytes) -> str:
    """Why a file shorter than the magic is not readable: empty, cut inside the magic, or something else."""
    if not head:
        return "empty file (0 bytes): not a GGUF file"
    if GGUF_MAGIC.startswith(head):
        return f"truncated: file size is {len(head)}, too short for the magic {GGUF_MAGIC!r}"
    return f"not a GGUF file: {len(head)} bytes, too short for the magic {GGUF_MAGIC!r}"


def _view(mm: np.memmap, t: TensorInfo) -> np.ndarray:
    dt = DTYPES[t.dtype]
    raw = mm[t.offset : t.offset + t.nbytes]
    if dt.quantized:  # [rows..., bytes_per_row]
        return raw.reshape(*t.shape[:-1], dt.row_bytes(t.shape[-1]))
    return raw.view(np.dtype(dt.storage).newbyteorder("<")).reshape(t.shape)
