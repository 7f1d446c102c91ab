"""The decode GEMV of q4_0 weights on tensor cores (kernels in gemv_tc.cu; CUDA sm_80 and later).

mul_mat lowers a 1-token product of a 2-D q4_0 Param here where GEMV1_KERNEL["q4_0"] is "tc" (matmul.py) and the
device has tensor cores, and a 2..16-token one too (a speculative verify call: matmul.decode_kernel_serves);
elsewhere (HIP, older GPUs) the f32 kernel serves it. The weight is repacked once per weight store
(`repack_q4_0_tc`, on the device) into 16-row tiles of mma fragments, kept beside the ggml copy that prefill and
the other kernels read. x keeps f32 accuracy (split into two f16 halves per block of 32, see gemv_tc.cu), so the
result is within the same 1e-5 of sum |x||w| as the f32 kernel's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import kernels
from .device import cupy, tensor_cores
from .launch import GpuParam, Launch, cdiv, i32

# cfg -> (row tiles of 16 a block, warps a block splitting the column groups), as FOR_EACH_GEMV_TC in gemv_tc.cu
GEOMETRIES = {"t1w4": (1, 4), "t1w8": (1, 8), "t1w16": (1, 16), "t2w4": (2, 4), "t2w8": (2, 8), "t2w16": (2, 16),
              "t4w4": (4, 4)}
# The geometry every call takes; "auto": the first of AUTO whose grid has at least the row tiles beside it.
GEOMETRY = "auto"
# H200, 2026-12-03, `bench_gpu_gemv.py --tc` (% of copy bandwidth, the f32 kernel's beside): 151936x4096 (9,496
# tiles) t4w4 93.6 (66.9); 12288x4096 (768) t2w4 62.5 (51.6); 4096x4096 (256) t2w16 40.5 (35.4); 4096x12288
# (256) t2w16 63.2 (45.7). Below 512 tiles t1w8: Qwen3-0.6B q4_0's captured step (profile_gpu_decode.py --gemv1,
# one call) 715.2 us with every GEMV at t1w8, 748.6 at t2w8, 764.7 with the small ones at t2w16 (f32 kernel 749.2).
# Products of 8,192 inputs or more below 512 tiles take t2w16: Qwen3-8B q4_0's captured step (same sweep,
# 2026-12-04) 2,415 us as above, 2,185 with its down GEMVs (4096x12288) at t2w16, 2,189 with o and q|k|v too
# (4096 inputs), 2,454 with those at t2w8 and 2,511 at t1w16.
# From 512 tiles t2w8 (t2w4 until then): Qwen3-8B q4_0's fused gate|up + swiglu takes the warps of this entry,
# and its captured step took 2,144.2-2,156.9 us at t2w8 against 2,172.5-2,174.0 at t2w4, three sweeps each
# alternated (profile_gpu_decode.py --tc-swiglu "auto+t2w8+...", 2026-12-04).
AUTO = (("t4w4", 4096), ("t2w8", 512), ("t2w16", 0, 8192), ("t1w8", 0))
# mul_mat_swiglu's fused kernel (gemv_tc_sw_q4_0_t2w<W>, FOR_EACH_GEMV_TC_SW): "auto" takes the W of the plain
# product's geometry, so the fused rows are that product's then swiglu_halves_f32 bit for bit; "t2w<W>" a given
# one; None keeps the plain product and the swiglu launch (for measurements).
SW_GEOMETRY: str | None = "auto"
SW_WARPS = (4, 8, 16)
GROUP = 128  # columns a group: 4 q4_0 blocks
REPACK_THREADS = 256


def available() -> bool:
    return tensor_cores()


def n_groups(n_in: int) -> int:
    return cdiv(n_in, GROUP)


def repack(w: GpuParam) -> tuple[Any, Any]:
    """(codes, scales) of a 2-D q4_0 weight in gemv_tc.cu's tile layout: uint32 [tiles, groups, 32, 8] and
    [tiles, groups, 32]."""
    cp = cupy()
    n_out, n_in = w.shape
    tiles, groups = cdiv(n_out, 16), n_groups(n_in)
    codes = cp.empty((tiles, groups, 32, 8), np.uint32)
    scales = cp.empty((tiles, groups, 32), np.uint32)
    kernels.get("gemv_tc.cu", "repack_q4_0_tc")(
        (cdiv(tiles * groups * 32, REPACK_THREADS),), (REPACK_THREADS,),
        (w.raw, np.int64(w.raw.shape[1]), codes, scales, i32(n_out), i32(n_in), i32(groups)))
    return codes, scales


def geometry_for(n_out: int, geometry: str | None = None, n_in: int = 0) -> str:
    """The geometry of an n_out x n_in product: a GEOMETRIES name, or the first entry of a table that has its row
    tiles (and at least its input width, where the entry gives one): "auto" (AUTO), or a table written as
    "t4w4:4096/t2w4:512/t2w16:0:12288/t1w8:0" (cfg:tiles[:n_in]; for measurements: profile_gpu_decode.py --gemv1)."""
    cfg = geometry or GEOMETRY
    table = AUTO if cfg == "auto" else None
    if ":" in cfg:
        table = tuple(_table_entry(part, cfg) for part in cfg.split("/"))
    if table:
        found = next((e for e in table if cdiv(n_out, 16) >= e[1] and n_in >= (e[2] if len(e) > 2 else 0)), None)
        if found is None:
            raise ValueError(f"gemv_tc geometry table {cfg!r}: no entry serves {n_out} x {n_in} (end it with cfg:0)")
        cfg = found[0]
    return cfg


def _table_entry(part: str, table: str) -> tuple:
    name, *bounds = part.split(":")
    if name not in GEOMETRIES or not 1 <= len(bounds) <= 2:
        raise ValueError(f"gemv_tc geometry table {table!r}: {part!r} is not cfg:tiles[:n_in] with cfg one of "
                         f"{sorted(GEOMETRIES)}")
    return (name, *map(int, bounds))


def steps(w: GpuParam, x2: Any, y2: Any, geometry: str | None = None) -> list:
    """The launch of y2 = x2 @ w^T (x2: [m, n_in] f32, 16-byte aligned: matmul._gemv_steps stages it), a token
    of m in each of m blocks per row block (common.cuh GEMV1_TOKEN_BLOCK): each row is the 1-token kernel's."""
    n_out, m = w.shape[0], x2.shape[0]
    cfg = geometry_for(n_out, geometry, w.shape[1])
    tiles, warps = GEOMETRIES[cfg]
    return [_launch(f"gemv_tc_q4_0_{cfg}", cdiv(cdiv(n_out, 16), tiles) * m, warps, w, x2, y2, n_out)]


def sw_serves(w: GpuParam) -> bool:
    """Whether sw_steps can fuse silu(gate) * up into w's product: gate and up rows in whole 16-row tiles."""
    return SW_GEOMETRY is not None and w.shape[0] % 32 == 0


def sw_steps(w: GpuParam, x2: Any, y2: Any) -> list:
    """The launch of y2 = silu(x2 @ gate^T) * (x2 @ up^T), w = [gate; up] (2 half rows, half % 16 == 0), x2 [m, n_in]
    f32 16-byte aligned, y2 [m, half]: the plain product's tiles in gate/up pairs, a token of m in each of m blocks."""
    n_rows, m = w.shape[0], x2.shape[0]
    half = n_rows // 2
    auto = SW_GEOMETRY == "auto"
    warps = GEOMETRIES[geometry_for(n_rows, n_in=w.shape[1])][1] if auto else int(SW_GEOMETRY.rpartition("w")[2])
    if warps not in SW_WARPS:
        raise ValueError(f"gemv_tc.SW_GEOMETRY {SW_GEOMETRY!r}: no gemv_tc_sw_q4_0_t2w{warps} (warps {SW_WARPS})")
    return [_launch(f"gemv_tc_sw_q4_0_t2w{warps}", (half // 16) * m, warps, w, x2, y2, half)]


def _launch(name: str, blocks: int, warps: int, w: GpuParam, x2: Any, y2: Any, n_out: int) -> Launch:
    """A gemv_tc.cu kernel over w's repacked tiles (derived once per weight store): every kernel there takes
    the same arguments, n_out being the rows it writes (the plain product's, or half of the gate|up rows)."""
    codes, scales = w.derived("q4_0_tc", repack)
    n_in, m = w.shape[1], x2.shape[0]
    return Launch("gemv_tc.cu", name, blocks, 32 * warps,
                  (codes, scales, x2, y2, i32(n_out), i32(n_in), i32(n_groups(n_in)), i32(m)))
