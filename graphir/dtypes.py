"""Element types: plain numpy types and GGUF block-quantized types.

A quantized type packs `block` consecutive elements of the innermost axis into
`block_bytes` bytes. The ggml type ids are the numbers GGUF files store.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphir.errors import GraphError


@dataclass(frozen=True)
class DType:
    name: str
    ggml_id: int
    block: int  # elements per block (1 for plain types)
    block_bytes: int  # bytes per block
    storage: str  # numpy dtype of the storage array

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def row_bytes(self, n: int) -> int:
        """Bytes taken by `n` consecutive elements of one row."""
        if n % self.block:
            raise GraphError(f"dtype {self.name}: row length {n} is not a multiple of its block {self.block}")
        return n // self.block * self.block_bytes


DTYPES: dict[str, DType] = {
    d.name: d
    for d in [
        DType("f32", 0, 1, 4, "float32"),
        DType("f16", 1, 1, 2, "float16"),
        DType("bf16", 30, 1, 2, "uint16"),  # raw bits: numpy has no bfloat16
        DType("i32", 26, 1, 4, "int32"),
        DType("q4_0", 2, 32, 18, "uint8"),
        DType("q4_1", 3, 32, 20, "uint8"),
        DType("q5_0", 6, 32, 22, "uint8"),
        DType("q5_1", 7, 32, 24, "uint8"),
        DType("q8_0", 8, 32, 34, "uint8"),
        DType("q4_k", 12, 256, 144, "uint8"),
        DType("q5_k", 13, 256, 176, "uint8"),
        DType("q6_k", 14, 256, 210, "uint8"),
        DType("iq4_xs", 23, 256, 136, "uint8"),
    ]
}
BY_GGML_ID: dict[int, DType] = {d.ggml_id: d for d in DTYPES.values()}
FLOAT = ("f32", "f16", "bf16")
QUANTIZED = tuple(n for n, d in DTYPES.items() if d.quantized)


def dtype(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise GraphError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


_RUNTIME = {"f32": np.dtype("float32"), "f16": np.dtype("float16"), "i32": np.dtype("int32")}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of values of this type at run time (quantized and bf16 compute in f32)."""
    return _RUNTIME.get(name, _RUNTIME["f32"])
