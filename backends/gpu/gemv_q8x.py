"""mul_mat_q8x on the GPU (kernels in gemv_q8x.cu): the decode GEMV with x rounded to 8-bit blocks.

The q8-activations pass produces the op for decode matmuls of q4_0 / q4_1 / q8_0 weights; the gpu has kernels
for q4_0 and q8_0 (a q4_1 one was never written: its lowering is an error). Each thread block
quantizes x as it stages it and multiplies the weight's integer codes with dp4a. Rows of whole 16-byte
pieces in a 16-byte aligned weight take a staged geometry (`gemv_q8x_<fmt>_<cfg>`, Q8X_KERNEL's choice);
every other weight the `_any` kernel, which gives the same bits, slowly. x rows go along grid y: the weight
is read once a token, so the rule takes at most MAX_TOKENS rows (decode and speculative verify calls).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from graphir.dtypes import dtype as dtype_info
from graphir.errors import BackendError

from .launch import GpuParam, Launch, Lowering, cdiv, i32
from .layout import copy_launch

# cfg -> (threads, rows per block), mirroring gemv_q8x.cu FOR_EACH_Q8X_CFG: w<G>r<NR>[b<BPL>] = G 32-lane
# groups of NR rows, chunks of 32 BPL blocks a row.
Q8X_CONFIGS = {"w4r2": (128, 8), "w4r4": (128, 16), "w8r2": (256, 16), "w8r4": (256, 32), "w4r4b2": (128, 16)}
# The staged geometry per format. H200, 2026-12-01, `bench_gpu_gemv.py --q8x --formats q4_0,q8_0`, % of copy
# bandwidth at 4096x4096 / 12288x4096 / 4096x12288 / 151936x4096 (the f32-activation gemv1v3 default beside):
#   q4_0 w4r2 32.8/47.2/42.4/69.5, w4r4 31.1/56.7/40.4/82.9, w8r2 32.5/49.2/42.2/72.2, w8r4 29.9/58.8/38.7/81.8,
#        w4r4b2 32.2/49.4/45.0/79.4; f32 path 35.2/47.5/45.6/64.7
#   q8_0 w4r2 49.6/63.4/51.5/91.8, best of the rest 48.7/63.9/54.2/95.6; f32 path 54.4/71.0/61.6/94.9
# So 8-bit x pays for q4_0 at the large shapes only (gate|up, the LM head) and never for q8_0: each block
# still spends ~2.6 instructions a weight, a third of them quantizing x.
Q8X_KERNEL = {"q4_0": "w4r4", "q8_0": "w4r2"}  # its keys are the formats with a gpu kernel
ANY_ROWS = 4  # gemv_q8x_<fmt>_any: one 32-lane group a row, 128 threads
MAX_TOKENS = 16


def q8x_kernel(fmt: str, n_in: int, w_ptr: int, cfg: str | None = None) -> tuple[str, int, int]:
    """(kernel, threads, rows per block) for a [*, n_in] `fmt` weight at device address w_ptr; `cfg` (a
    Q8X_CONFIGS key) overrides Q8X_KERNEL. Rows not whole 16-byte pieces, or an unaligned weight: `_any`."""
    if fmt not in Q8X_KERNEL:
        raise BackendError(f"mul_mat_q8x: weight dtype {fmt} has no gpu kernel (only {', '.join(Q8X_KERNEL)})")
    if dtype_info(fmt).row_bytes(n_in) % 16 or w_ptr % 16:
        return f"gemv_q8x_{fmt}_any", 32 * ANY_ROWS, ANY_ROWS
    cfg = cfg or Q8X_KERNEL[fmt]
    return f"gemv_q8x_{fmt}_{cfg}", *Q8X_CONFIGS[cfg]


def lower_mul_mat_q8x(lw: Lowering, n: Any, ins: list, outs: list, p: dict) -> list:
    w, x, y = ins[0], ins[1], outs[0]
    if not (isinstance(w, GpuParam) and len(w.shape) == 2):
        raise BackendError("mul_mat_q8x: the gpu backend takes a 2-D weight (what the q8-activations pass rewrites)")
    if w.dtype not in Q8X_KERNEL:
        raise BackendError(f"mul_mat_q8x {n.describe()}: weight dtype {w.dtype} has no gpu kernel (the gpu's is "
                           f"for {', '.join(Q8X_KERNEL)}): run q8-activations on the cpu backend, or use a "
                           f"{' / '.join(Q8X_KERNEL)} weight")
    n_out, n_in = w.shape
    m = math.prod(x.shape[:-1])
    name, threads, rows = q8x_kernel(w.dtype, n_in, w.raw.data.ptr)
    if m == 0 or n_out == 0:
        return []
    if x.dtype != np.float32:
        raise BackendError(f"mul_mat_q8x: x must be float32 on the gpu backend, got {x.dtype}")
    if m > MAX_TOKENS:
        raise BackendError(f"mul_mat_q8x: {m} rows of x; the gpu kernel reads the weight once a row and takes at "
                           f"most {MAX_TOKENS} (run q8-activations with max_rows <= {MAX_TOKENS})")
    x2, y2, steps = x.reshape(m, n_in), y.reshape(m, n_out), []
    if x2.data.ptr % 16 and not name.endswith("_any"):  # the staged kernels read x with 16-byte loads
        buf = lw.scratch((m, n_in))
        steps.append(copy_launch(x2, buf, what="aligned x"))
        x2 = buf
    rb = np.int64(dtype_info(w.dtype).row_bytes(n_in))
    return steps + [Launch("gemv_q8x.cu", name, (cdiv(n_out, rows), m), threads,
                           (w.raw, rb, x2, y2, i32(n_out), i32(n_in)))]


def lower_mul_mat_q16x(lw: Lowering, n: Any, ins: list, outs: list, p: dict) -> list:
    """mul_mat_q16x (the q16-activations pass) has a cpu kernel only: an error naming the node, before any device
    work."""
    raise BackendError(f"{n.describe()}: no gpu kernel (16-bit activations are a cpu path, "
                       "backends/cpu/gemv_q16x.py): run q16-activations on the cpu backend, or q8-activations on "
                       "the gpu")
