"""What a lowering rule works with: fixed kernel launches, device weights, scratch and the error flag.

A rule turns one node into a list of Steps. Every Step is a `Launch` (or, for prefill GEMMs, a
cuBLAS call) whose arguments are all fixed at lowering: device pointers into the arena, State
buffers, weights and the persistent Input buffers, plus Python-side sizes. Values that change
between calls (token ids, positions, KV rows, kv_len) are only ever read *on the device* from
those Input buffers, so a Program can be replayed, or captured into a CUDA graph, unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphir.lowering import ParamRef
from graphir.weights import Weights

from . import kernels, pdl
from .device import cupy


def i32(v: int) -> np.int32:
    return np.int32(v)


def f32(v: float) -> np.float32:
    return np.float32(v)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Launch:
    """One kernel launch, every argument fixed. `capturable`: may run inside CUDA-graph capture."""

    __slots__ = ("kernel", "grid", "block", "args", "shared", "name", "parts")
    capturable = True

    def __init__(self, file: str, name: str, grid: int | tuple[int, ...], block: int | tuple[int, ...],
                 args: tuple[Any, ...], shared: int = 0):
        self.kernel = kernels.get(file, name)
        self.name = name
        self.grid = grid if isinstance(grid, tuple) else (grid,)
        self.block = block if isinstance(block, tuple) else (block,)
        for a in args:
            if type(a) in (int, float, bool):  # CuPy would pick the C type: make it explicit (np scalars pass)
                raise TypeError(f"kernel {name}: pass sizes as np.int32/np.float32, got {type(a).__name__} {a!r}")
        self.args = tuple(args)
        self.shared = shared
        self.parts: tuple[str, ...] = ()  # the kernels a merged launch runs side by side (lowering.merge_kv_writes)
        if min(self.grid) <= 0:
            raise ValueError(f"kernel {name}: empty grid {self.grid}")

    @property
    def label(self) -> str:
        return f"{self.name} ({' + '.join(self.parts)})" if self.parts else self.name

    def __call__(self) -> None:
        self.kernel(self.grid, self.block, self.args, shared_mem=self.shared)

    def launch_overlapped(self, stream_ptr: int) -> None:
        """The same launch with programmatic stream serialization (pdl.py): it may start before the
        kernel ahead of it on the stream has finished, and waits for it at PDL_WAIT."""
        pdl.launch(self.kernel, self.grid, self.block, self.args, self.shared, stream_ptr, self.name)


class HostLibraryCall:
    """A step that calls a vendor library (cuBLAS) on device buffers: never inside capture."""

    capturable = False

    def __init__(self, fn: Any, name: str):
        self.fn, self.name = fn, name

    def __call__(self) -> None:
        self.fn()


class GpuParam:
    """A weight on the device in its storage format, uploaded once per weight store.

    raw: float32 for f32; uint16 bits for f16 and bf16; uint8 [rows, row_bytes] ggml blocks for
    quantized types (rows = prod(shape[:-1])). `f32()` is a dequantized device copy, made on
    first use, for the rare Param that feeds an op other than mul_mat/get_rows (norm weights).
    """

    def __init__(self, ref: ParamRef):
        self.dtype, self.shape, self.ref = ref.dtype, tuple(ref.shape), ref
        cache = ref.weights.derived if ref.weights is not None else {}
        key = ("gpu",) + ref.key
        if key not in cache:
            cache[key] = _upload(ref.raw, ref.dtype, self.shape)
        self.raw = cache[key]
        self._cache = cache

    def f32(self) -> Any:
        if self.dtype == "f32":
            return self.raw
        return self.derived("f32", lambda p: cupy().asarray(p.ref.f32()))  # the host copy the cpu backend also uses

    def derived(self, name: str, make: Any) -> Any:
        """`make(self)`'s value (e.g. the weight repacked for one kernel), made once per weight store."""
        key = ("gpu", name) + self.ref.key
        if key not in self._cache:
            self._cache[key] = make(self)
        return self._cache[key]


def _upload(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Any:
    cp = cupy()
    a = np.ascontiguousarray(raw)
    if dtype == "f32":
        return cp.asarray(a.astype(np.float32, copy=False).reshape(shape))
    if dtype in ("f16", "bf16"):
        return cp.asarray(a.view(np.uint16).reshape(shape))
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return cp.asarray(a.view(np.uint8).reshape(rows, -1))


class Lowering:
    """Handed to every rule: the Program's error flag and per-node code, and its scratch buffers.

    `code` is the number the current node's kernels write into the error flag (its step + 1), so
    a bad run-time value is reported with the node that saw it.
    """

    def __init__(self, weights: Weights | None = None):
        cp = cupy()
        self.weights = weights if weights is not None else Weights()  # holds shared scratch (matmul.py)
        self.errflag = cp.zeros(2, np.int32)
        self.code = 0
        self.scratch_buffers: list[Any] = []
        self.messages: dict[int, str] = {}  # error code -> message template ({value} is the bad value)
        # values rules share within one binding, keyed by what they derive from (e.g. a node's bf16 copy)
        self.shared: dict[Any, Any] = {}
        # (id(node), result k) -> the mul_mat_bf16 nodes that alone read it (matmul.bf16_twin); set by the Program
        self.bf16_readers: dict[tuple[int, int], list] = {}
        # ids of the rounded products stored as bf16 for their readers (matmul.bf16_stored_products); set by the Program
        self.bf16_products: set[int] = set()

    def scratch(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        """A device buffer owned by the Program, for temporaries of one node (fixed address)."""
        buf = cupy().empty(shape, dtype)
        self.scratch_buffers.append(buf)
        return buf

    def code_arg(self, message: str) -> np.int32:
        """The kernel argument `code` for the current node, with the message the host raises when a
        kernel reports a bad run-time value: `message` may use {value}, e.g.
        "get_rows: id {value} out of range 0..511"."""
        self.messages[self.code] = message
        return i32(self.code)


def dev(x: Any) -> Any:
    """A rule's input as a device array: Params other than matmul weights and tables as f32."""
    return x.f32() if isinstance(x, GpuParam) else x


# A lowering rule:  rule(lw: Lowering, node: Node, ins: list, outs: list | None, p: dict) -> list[step]
#   ins   the node's sources: cupy arrays (C-contiguous, f32 or i32; f16 only where the rule says it
#         takes f16: State buffers of set_rows/rope_set_rows/flash_attn, and the copy ops) or
#         GpuParam for Params (use dev(x) to get a float32 device array).
#   outs  one cupy array per result, arena views of the node's shape and dtype (None for ops that
#         write a State in place: their value is ins[0]).
#   p     node.params as a dict.
#   returns the steps (Launch or HostLibraryCall) to run, in order, every call.
