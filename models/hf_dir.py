"""Load a Hugging Face model directory: config.json plus safetensors weights, memory-mapped.

safetensors layout: u64 little-endian header length N | N bytes of JSON | data.
The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}, offsets
relative to the data start (8 + N); an optional "__metadata__" entry holds strings.
The header is parsed here rather than with the `safetensors` package because its numpy
framework cannot return bf16, which we keep as raw uint16 bits.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from graphir.errors import LoadError
from graphir.weights import Weight, Weights

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"  # optional: without it a directory loads with no tokenizer
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

# safetensors dtype -> (graphir dtype, little-endian numpy storage type)
_DTYPES = {
    "F32": ("f32", "<f4"),
    "F16": ("f16", "<f2"),
    "BF16": ("bf16", "<u2"),
    "I32": ("i32", "<i4"),
    "I64": ("i32", "<i8"),  # narrowed to int32 (a copy) after a range check
}


def load_hf_dir(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Weights]:
    """(config.json as a dict, all tensors of the directory's safetensors files by their HF names)."""
    root = Path(path)
    if not root.is_dir():
        raise LoadError(f"{root}: not a directory")
    config = read_json(root / "config.json")
    if not isinstance(config, dict):
        raise LoadError(f"{root / 'config.json'}: expected a JSON object, got {type(config).__name__}")
    # A plain dict: Weights' `in` goes through __getitem__, which raises LoadError, not KeyError.
    found: dict[str, Weight] = {}
    for shard, names in _shard_plan(root).items():
        tensors = read_safetensors(root / shard)
        for name, w in tensors.items():
            if name in found:
                raise LoadError(f"{root / shard}: tensor {name!r} also appears in another shard")
            found[name] = w
        for name in names:
            if name not in tensors:
                raise LoadError(f"{root / shard}: tensor {name!r} listed in {INDEX_FILE} is not in this shard")
    return config, Weights(found, source=str(root))


def _shard_plan(root: Path) -> dict[str, list[str]]:
    """Shard file name -> tensor names the index promises in it (none when there is no index)."""
    index_path = root / INDEX_FILE
    if index_path.exists():
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise LoadError(f"{index_path}: 'weight_map' must be an object of tensor name -> shard file name")
        plan: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            # Shards are plain names in the directory; a path could reach files outside it.
            if Path(shard).name != shard or shard in ("", ".", ".."):
                raise LoadError(f"{index_path}: tensor {name!r} names shard {shard!r}, which is not a plain file name")
            plan.setdefault(shard, []).append(name)
        for shard in plan:
            if not (root / shard).is_file():
                raise LoadError(f"{root / shard}: shard listed in {INDEX_FILE} is missing")
        return plan
    if (root / SINGLE_FILE).is_file():
        return {SINGLE_FILE: []}
    files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{root}: no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file")
    return {f: [] for f in files}


def read_text(path: Path) -> str:
    """A UTF-8 text file's contents; a missing, unreadable or binary file is a LoadError naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LoadError(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise LoadError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise LoadError(f"{path}: cannot read: {e.strerror or e}") from None


def read_json(path: Path) -> Any:
    text = read_text(path)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise LoadError(f"{path}: invalid JSON: {e}") from None


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, Weight]:
    """Every tensor of one safetensors file; data are np.memmap views except narrowed I64."""
    path = Path(path)
    header, data_start, size = _read_header(path)
    out: dict[str, Weight] = {}
    mm: np.memmap | None = None
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dt, storage, shape, begin, end = _check_entry(path, name, entry, data_start, size)
        if mm is None:
            mm = np.memmap(path, dtype=np.uint8, mode="r")
        arr = mm[data_start + begin : data_start + end].view(storage).reshape(shape)
        if storage == "<i8":
            if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
                raise LoadError(f"{path}: tensor {name!r}: I64 values do not fit in int32")
            arr = arr.astype(np.int32)
        out[name] = Weight(dt, shape, arr)
    return out


def _read_header(path: Path) -> tuple[dict[str, Any], int, int]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise LoadError(f"{path}: truncated: {size} bytes, too short for the 8-byte header length")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise LoadError(f"{path}: header length {n} extends past end of file (size {size})")
            if n > MAX_HEADER_BYTES:
                raise LoadError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
            raw = f.read(n)
    except FileNotFoundError:
        raise LoadError(f"{path}: file not found") from None
    except OSError as e:
        raise LoadError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise LoadError(f"{path}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise LoadError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header, 8 + n, size


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_entry(
    path: Path, name: str, entry: Any, data_start: int, size: int
) -> tuple[str, str, tuple[int, ...], int, int]:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise LoadError(f"{where}: entry must be an object with dtype, shape and data_offsets")
    st_dtype = entry.get("dtype")
    if st_dtype not in _DTYPES:
        raise LoadError(f"{where}: dtype {st_dtype!r} is not supported (supported: {', '.join(_DTYPES)})")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise LoadError(f"{where}: shape {shape!r} must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise LoadError(f"{where}: data_offsets {offsets!r} must be [begin, end]")
    begin, end = offsets
    dt, storage = _DTYPES[st_dtype]
    n = int(np.prod(shape, dtype=object)) if shape else 1  # object: no int64 overflow
    want = n * np.dtype(storage).itemsize
    if not 0 <= begin <= end or end - begin != want:
        raise LoadError(
            f"{where}: data_offsets [{begin}, {end}) hold {end - begin} bytes, {st_dtype}{shape} needs {want}"
        )
    if data_start + end > size:
        raise LoadError(
            f"{where}: data [{data_start + begin}, {data_start + end}) extends past end of file (size {size})"
        )
    return dt, storage, tuple(shape), begin, end
