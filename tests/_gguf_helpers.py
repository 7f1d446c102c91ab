"""Small GGUF files for tests: one written by gguf-py's GGUFWriter (the reference writer),
and a raw byte builder that can also write the malformed files a writer refuses to make."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

# Values of every metadata type, with the GGUF type each one must be written as.
METADATA: dict[str, tuple[Any, V]] = {
    "t.u8": (200, V.UINT8),
    "t.i8": (-100, V.INT8),
    "t.u16": (60000, V.UINT16),
    "t.i16": (-30000, V.INT16),
    "t.u32": (4_000_000_000, V.UINT32),
    "t.i32": (-2_000_000_000, V.INT32),
    "t.f32": (1.5, V.FLOAT32),
    "t.bool": (True, V.BOOL),
    "t.str": ("naïve café 日本語 👋🏽", V.STRING),
    "t.u64": (2**63 + 5, V.UINT64),
    "t.i64": (-(2**62), V.INT64),
    "t.f64": (3.141592653589793, V.FLOAT64),
    "t.empty_str": ("", V.STRING),
}
ARRAYS: dict[str, list[Any]] = {
    "a.str": ["a", "", "Ġhello", "<|im_start|>", "日本"],
    "a.i32": [3, -1, 7],
    "a.f32": [0.5, -2.0],
    "a.bool": [True, False, True],
}


def write_with_gguf_py(
    path: Path, tensors: dict[str, tuple[np.ndarray, Q | None]], alignment: int | None = None
) -> None:
    """Write `tensors` (name -> (array, raw_dtype or None)) and METADATA/ARRAYS with GGUFWriter."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (val, vtype) in METADATA.items():
        w.add_key_value(key, val, vtype)
    for key, val in ARRAYS.items():
        w.add_array(key, val)
    for name, (arr, raw) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def all_dtype_tensors(seed: int = 0) -> dict[str, tuple[np.ndarray, Q | None]]:
    """One tensor per graphir dtype, plain ones as arrays, quantized ones as raw ggml bytes."""
    rng = np.random.default_rng(seed)
    f = rng.standard_normal((4, 64)).astype(np.float32)
    out: dict[str, tuple[np.ndarray, Q | None]] = {
        "f32_1d": (rng.standard_normal(7).astype(np.float32), None),
        "f32_4d": (rng.standard_normal((2, 3, 4, 5)).astype(np.float32), None),
        "f16": (rng.standard_normal((3, 5)).astype(np.float16), None),
        "i32": (rng.integers(-(2**31), 2**31 - 1, (2, 6), dtype=np.int32), None),
        # bf16 bits are the top half of f32 bits; written as raw bytes [3, 2*8].
        "bf16": ((rng.standard_normal((3, 8)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
                 .view(np.uint8), Q.BF16),
    }  # fmt: skip
    for q in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        out[q.name.lower()] = (gguf.quants.quantize(f, q), q)
    # gguf-py has no K-quant quantizer: random bytes of the right size stand in.
    for q in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS):
        block, size = gguf.GGML_QUANT_SIZES[q]
        out[q.name.lower()] = (rng.integers(0, 256, (3, 512 // block * size), dtype=np.uint8), q)
    return out


# ---- raw builder ----


def gguf_string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gguf_value(vtype: int, val: Any) -> bytes:
    fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    if vtype in fmt:
        return struct.pack("<" + fmt[vtype], val)
    if vtype == 8:
        return gguf_string(val)
    if vtype != 9:  # an unknown type: write the value as 4 raw bytes
        return struct.pack("<I", val)
    etype, items = val  # arrays: (element type, items)
    return struct.pack("<IQ", etype, len(items)) + b"".join(gguf_value(etype, x) for x in items)


def build_gguf(
    kvs: list[tuple[str, int, Any]],
    tensors: list[tuple[str, list[int], int, bytes]],
    version: int = 3,
    alignment: int = 32,
    magic: bytes = b"GGUF",
) -> bytes:
    """kvs: (key, value type, value); tensors: (name, ggml ne (innermost first), ggml type id, data).
    Data is laid out back to back at `alignment`, as GGUFWriter does."""
    head = magic + struct.pack("<IQQ", version, len(tensors), len(kvs))
    head += b"".join(gguf_string(k) + struct.pack("<I", t) + gguf_value(t, v) for k, t, v in kvs)
    data, infos = b"", b""
    for name, ne, type_id, blob in tensors:
        infos += gguf_string(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, type_id, len(data))
        data += blob + b"\0" * (-len(blob) % alignment)
    head += infos
    return head + b"\0" * (-len(head) % alignment) + data


def small_raw_gguf() -> bytes:
    """A small valid file used as the seed of corruption tests."""
    kvs = [
        ("general.architecture", 8, "llama"),
        ("n", 4, 3),
        ("toks", 9, (8, ["a", "bc", "Ġd"])),
        ("nested", 9, (9, [(5, [1, 2]), (5, [3])])),
    ]
    tensors = [
        ("w", [4, 2], 0, np.arange(8, dtype=np.float32).tobytes()),
        ("q", [32, 1], 8, bytes(range(34))),
    ]
    return build_gguf(kvs, tensors)
