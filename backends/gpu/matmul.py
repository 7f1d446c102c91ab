"""mul_mat and get_rows on the GPU: which kernel each case lowers to (kernels in matmul.cu, get_rows.cu).

mul_mat(w, x) = x @ w^T with f32 activations and f32 accumulation, for every weight format:
  - decode (m = prod(x.shape[:-1]) <= GEMV_MAX_TOKENS rows of x), 2-D Param weight: our GEMV
    `gemv_<fmt>` (`gemv16_<fmt>` above 8 tokens: a 16-token verify call; `gemvm<2|4|8|16>_<fmt>_<cfg>` for
    2..16 tokens of a float weight) reads the weight's blocks once for all m tokens and dequantizes in
    registers. Capturable. At m == 1 the kernel is the variant GEMV1_KERNEL names for the format
    (`gemv1v2_<fmt>_<cfg>`, a tuned geometry; `gemv1v3_<fmt>_<cfg>` for q8_0 / q4_0 / q4_k, staged through
    shared memory; "gemv1" keeps `gemv1_<fmt>`), or for float weights of many short rows the geometry
    `short_float_rows` picks.
  - prefill (more tokens), 2-D Param weight: `dequant_<fmt>` writes the weight as f32 into one
    scratch buffer shared by every Program of the weight store, then cuBLAS (`cupy.matmul`), as
    one HostLibraryCall (never captured). f32 weights go straight to cuBLAS.
  - mul_mat_bf16 (the gemm-bf16 pass): cuBLAS GemmEx on tensor cores with bf16 operands, any m.
  - anything else (w an activation, or with batch axes): `matmul_batched_f32`, a plain dot per
    output with w's batch axes broadcast through zero strides.
get_rows(table, ids): `get_rows_<fmt>`, one block per id; a bad id is reported through the error flag.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from graphir import flags
from graphir.dtypes import dtype as dtype_info
from graphir.errors import BackendError
from graphir.ops import OPS

from . import gemv_tc, kernels
from .device import cupy
from .launch import GpuParam, HostLibraryCall, Launch, Lowering, cdiv, i32
from .layout import copy_launch

SUPPORTED = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs")
GEMV_SMALL_TOKENS = 8  # matmul.cu GEMV_MAX_TOKENS: gemv_<fmt> up to this many tokens, gemv16_<fmt> up to twice
# More tokens take the prefill path (dequant + cuBLAS, not capturable); 16 holds every speculative verify bucket.
GEMV_MAX_TOKENS = 2 * GEMV_SMALL_TOKENS
GEMV_THREADS = 128  # matmul.cu GEMV_THREADS
GEMV_ROWS_PER_BLOCK = GEMV_THREADS // 32 * 2  # 32-lane groups per block x GEMV_NR rows each
# 2..16 tokens of a float weight: gemvm<M>_<fmt>_<cfg> (matmul.cu): cfg -> (threads, rows per block).
#   g<G>r<NR> (gemvm_impl): groups of G lanes owning NR rows each, 128 threads a block.
#   j<J>w<WB>r<NR> (gemvm_sets_impl): sets of J lanes owning NR rows, 32 / J sets a warp (reading the same x
#   pieces), WB warps a block, a row's units over the J * WB lanes; j32w4r4 is bitwise g128r2.
GEMVM_MAX_TOKENS = 16
GEMVM_CONFIGS = {"g64r4": (128, 8), "g128r2": (128, 2), "j32w4r4": (128, 4), "j32w2r4": (64, 4), "j32w1r4": (32, 4),
                 "j8w8r2": (256, 8), "j4w8r2": (256, 16), "j4w8r4": (256, 32)}
# Qwen3-0.6B bf16, captured greedy verify graph at 2 / 4 / 8 tokens (H200, 2026-12-01; the same as
# `profile_gpu_decode.py random:qwen3-0.6b --verify B --gemvm CFG`): g128r2 1,119 / 1,369 / 1,908 us, g64r4 1,240 /
# 1,515 / 2,137, g32r4 1,525 / 1,944 / 2,894, g32r8 1,509 / 2,078 / 3,232 (gemv_bf16: 1,642 / 2,107 / - ); the two
# 32-lane geometries were dropped after that run. The j* row-set geometries (gemvm_sets_impl), H200,
# 2026-12-01, `bench_gpu_gemv.py --gemvm`, GEMV time of one verify call at 16 / 8 / 4 / 2 tokens: Qwen3-0.6B
# bf16 g128r2 2,340 / 1,349 / 888 / 703 us, j32w4r4 1,639 / 1,107 / 812 / 661 (auto 1,823 at 16); SmolLM2 f32
# g128r2 1,227 / 745 / 549 / 453, j32w4r4 992 / 680 / 494 / 427 (auto 893, j8w8r2 912 at 16). j32w4r4 adds in
# g128r2's order (bitwise the same results) and was faster at every shape but the small o / down rows; the
# captured 16-token verify call of Qwen3-0.6B went 2,848 -> 2,174 us with it.
# The cfg every 2..16-token call takes. "exact" (the default): j32w<G/32>r4 where the decode step's kernel
# (gemv1v2_<fmt>_g<G>r<NR>) splits a row over G lanes: the same lanes take the same units, sum them with the
# same dot8 and meet in sum32's butterfly and then in warp order, so each row of a verify call is the decode
# step's value bit for bit and greedy speculative decoding equals plain greedy decoding exactly on float
# weights (tests/test_speculative.py). "auto": gemvm_auto's pick per shape and bucket; a cfg name:
# that geometry everywhere (benchmarks; rows then differ from the decode step's in the last bits).
GEMVM_KERNEL = "exact"
# Tokens a gemvm block computes, by the call's bucket (2, 4, 8, 16 tokens): a call of more runs gemvm<that> on
# cdiv(m, it) times its blocks (matmul.cu GEMVM_TOKEN_GROUP), each row the same bits, so the exact geometries stay
# the decode step's. Two token groups a row block put twice the blocks on the SMs for the same weight bytes from
# DRAM (the second group reads them from L2). H200, 2026-12-03, captured verify call (`profile_gpu_decode.py MODEL
# --verify B`), us at 16 / 8 / 4 / 2 tokens a block (as many of them as the call has): SmolLM2 F32 at 300 keys,
# 16-token call 1,750 / 1,453 / 1,407 / 1,589, 8-token 1,133 / 1,063 / 1,061, 4-token 873 / 822; Qwen3-0.6B bf16
# at 128 keys, 16-token 2,717 / 2,214 / 2,372 / 2,594, 8-token 1,678 / 1,552 / 1,698. The decode step's own kernel
# a token a block (GEMV1_TOKEN_BLOCK, as quantized weights take) was slower still: SmolLM2 16 / 8 / 4-token calls
# 2,799 / 1,663 / 1,088, Qwen3-0.6B 16 / 8 4,021 / 2,307.
GEMVM_TOKENS_A_BLOCK = {2: 2, 4: 2, 8: 4, 16: 8}
# "auto" (a guess from instruction counts; measured above: not better than j32w4r4 on Qwen3-0.6B, and not
# g128r2's order): the first geometry of GEMVM_AUTO whose grid has at
# least the blocks beside it. j4w8r4 (32-row blocks, 64 FMAs a lane per 16-byte x load) for vocabulary-sized
# weights; j4w8r2 (16 rows) where it still gives an H200's 132 SMs about two blocks each; j8w8r2 (8 rows) below.
GEMVM_AUTO = (("j4w8r4", 1024), ("j4w8r2", 256), ("j8w8r2", 0))
SCRATCH_KEY = ("gpu", "dequant_scratch")

# m == 1 GEMV variants (matmul.cu gemv1v2_<fmt>_<cfg>): cfg -> (threads per block, rows per
# block), mirroring FOR_EACH_GEMV1_CFG (T threads; T/G groups of G lanes, NR rows per group).
GEMV1_CONFIGS = {"g32r2": (128, 8), "g32r4": (128, 16), "g64r2": (128, 4), "g128r1": (128, 1)}
# Version-3 m == 1 kernels (matmul.cu gemv1v3_<fmt>_<cfg>: x and 2-byte-aligned blocks staged in
# shared memory, ~3 instructions per weight): cfg -> (threads, rows per block), for V3_FORMATS.
GEMV1_V3 = {"v3r2": (128, 8), "v3r4": (128, 16)}
V3_FORMATS = ("q8_0", "q4_0", "q4_k")
# The m == 1 kernel per format: a GEMV1_CONFIGS or GEMV1_V3 key, or "gemv1" for gemv1_<fmt>.
# Picked from `bench_gpu_gemv.py --variants` on an H200 (2026-11-30; % of copy bandwidth at 4096x4096,
# 12288x4096, 4096x12288, 151936x4096): bf16 g128r1 75/89/90/103; q8_0 v3r2 47/65/59/84 (gemv1
# 41/54/41/78). With the v3 kernels' next-chunk prefetch (2026-12-01, same command): q8_0 v3r2
# 55/71/60/94 (v3r4 52/67/59/97); q4_0 v3r4 35/48/46/65 (v3r2 35/48/44/60; 29/40/36/55 without the
# prefetch); q4_k v3r4 34/47/46/63 (v3r2 32/45/43/60). Tried and dropped the same day: each row's blocks
# split over 2 or 4 groups of a block (4x more blocks for 4096-row weights, each group staging its own x):
# q4_0 24-44 %, q8_0 35-67 %, below v3r2 at every shape, so few blocks an SM was not what held it back.
GEMV1_KERNEL = {"f32": "g128r1", "f16": "g128r1", "bf16": "g128r1", "q8_0": "v3r2", "q4_0": "tc",
                "q4_1": "g32r4", "q5_0": "g32r4", "q5_1": "g32r4", "q4_k": "v3r4", "q5_k": "g32r2",
                "q6_k": "g32r2", "iq4_xs": "g32r2"}
# "tc" (q4_0): gemv_tc.py's tensor-core kernel where the device has tensor cores; TC_FALLBACK elsewhere and for
# the fused-swiglu and 8-bit-x callers that need a matmul.cu kernel.
TC_FALLBACK = "v3r4"
# Formats whose gemv1v2 traits read 16-byte windows / headers (quant.cuh Fq*w): they need rows of
# whole 16-byte pieces in a 16-byte aligned weight.
_WIDE = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k")
FLOATS = ("f32", "f16", "bf16")

# Per quantized format: units per block, as in quant.cuh's traits; the dequant kernel runs one
# thread per unit. Float formats run one thread per value.
_UNITS = {"q4_0": 4, "q4_1": 4, "q5_0": 4, "q5_1": 4, "q8_0": 4, "q4_k": 8, "q5_k": 8, "q6_k": 32, "iq4_xs": 16}
_MAX_GRID = 1 << 20  # grid-stride kernels: enough blocks to fill any device


def _row_bytes(fmt: str, n_in: int) -> int:
    return dtype_info(fmt).row_bytes(n_in)


def _check_fmt(fmt: str, what: str) -> None:
    if fmt not in SUPPORTED:
        raise BackendError(f"{what}: weight dtype {fmt} is not supported by the gpu backend "
                           f"(supported: {', '.join(SUPPORTED)})")


# ---------------------------------------------------------------- mul_mat
def lower_mul_mat(lw: Lowering, n: Any, ins: list, outs: list, p: dict) -> list:
    w, x, y = ins[0], ins[1], outs[0]
    if isinstance(w, GpuParam) and len(w.shape) == 2:
        _check_fmt(w.dtype, "mul_mat")
        n_out, n_in = w.shape
        m = math.prod(x.shape[:-1])
        if m == 0 or n_out == 0:
            return []
        if x.dtype != np.float32:
            raise BackendError(f"mul_mat: x must be float32 on the gpu backend with a Param weight, got {x.dtype}")
        x2, y2 = x.reshape(m, n_in), y.reshape(m, n_out)
        if m <= GEMV_MAX_TOKENS:
            return _gemv_steps(lw, w, x2, y2)
        return [_prefill_step(lw, w, x2, y2)]
    return _batched_steps(lw, w, x, y)


# m == 1 mul_mat_swiglu (matmul.cu gemv1sw_<fmt>_<cfg>): cfg -> (threads, outputs per block). The cfg's
# groups in gate/up pairs, each pair NR outputs; g128r1 (one group a block) runs two groups a block.
GEMV1_SW = {"g32r2": (128, 4), "g32r4": (128, 8), "g64r2": (128, 2), "g128r1": (256, 1)}
# Stacked gate|up weights up to this size take the fused kernel; larger ones the plain GEMV then
# swiglu_halves_f32. H200, 2026-12-01 (profile_gpu_decode.py): Qwen3-8B's 201 MB gate|up took 48.3-49.3 us
# fused (either pairing of rows) against ~44.3 us for the plain GEMV + 1.6 us for the activation. Below
# the limit a launch is the larger cost (Qwen3-0.6B's 12.6 MB gate|up: its step went 1,383 -> 1,267 us
# with this and the norm-rope cache write fused; the two were not measured apart). The 2..16-token
# gemvmsw kernels keep the same limit (not measured apart).
SW_MAX_BYTES = 32 << 20


def lower_mul_mat_swiglu(lw: Lowering, n: Any, ins: list, outs: list, p: dict) -> list:
    """mul_mat_swiglu(w, x): one kernel that stores silu(gate) * up from its gate and up sums where the
    weight is at most SW_MAX_BYTES and its decode GEMV has a swiglu twin: at m == 1 a gemv1v2 geometry
    (gemv1sw_<fmt>_<cfg>), at 2..16 tokens of a float weight gemvm (gemvmsw<M>_<fmt>_<cfg>); otherwise the
    stacked product into scratch (mul_mat's own path) and swiglu_halves_f32 over it."""
    w, x, y = ins[0], ins[1], outs[0]
    half = y.shape[-1]
    m = math.prod(x.shape[:-1])
    if m == 0 or half == 0:
        return []
    if (isinstance(w, GpuParam) and len(w.shape) == 2 and x.dtype == np.float32 and _tc_serves(w, m)
            and gemv_tc.sw_serves(w)):
        x2, steps = _aligned_x(lw, x.reshape(m, w.shape[1]))
        return steps + gemv_tc.sw_steps(w, x2, y.reshape(m, half))
    if (isinstance(w, GpuParam) and len(w.shape) == 2 and m <= GEMVM_MAX_TOKENS and x.dtype == np.float32
            and w.shape[0] * _row_bytes(w.dtype, w.shape[1]) <= SW_MAX_BYTES):
        _check_fmt(w.dtype, "mul_mat_swiglu")
        name, threads, rows = gemv_kernel(w.dtype, w.shape[0], w.shape[1], m, w.raw.data.ptr)
        if name.startswith("gemv1v2_"):
            fused = name.replace("gemv1v2_", "gemv1sw_", 1)
            threads, rows = GEMV1_SW[name.rsplit("_", 1)[1]]
        elif name.startswith("gemvm"):
            fused, rows = name.replace("gemvm", "gemvmsw", 1), rows // 2  # outputs a block: half its rows
        else:
            fused = None
        if fused:
            x2, steps = _aligned_x(lw, x.reshape(m, w.shape[1]))
            return steps + [Launch("matmul.cu", fused, cdiv(half, rows) * token_blocks(fused, m), threads,
                                   (w.raw, np.int64(_row_bytes(w.dtype, w.shape[1])), x2, y.reshape(m, half),
                                    i32(half), i32(w.shape[1]), i32(m)))]
    both = lw.scratch(y.shape[:-1] + (2 * half,))
    steps = lower_mul_mat(lw, n, [w, x], [both], p)
    return steps + [Launch("elementwise.cu", "swiglu_halves_f32", min(cdiv(m * half, 256), _MAX_GRID), 256,
                           (both, y, np.int64(m * half), i32(half)))]


def _aligned_x(lw: Lowering, x2: Any) -> tuple[Any, list]:
    """x2, or a 16-byte aligned copy of it and the copy's launch: the GEMVs read x with 16-byte loads."""
    if x2.data.ptr % 16 == 0:
        return x2, []
    buf = lw.scratch(x2.shape)
    return buf, [copy_launch(x2, buf, what="aligned x")]


def _tc_serves(w: GpuParam, m: int) -> bool:
    """Whether gemv_tc.py's tensor-core kernel takes this product of m tokens (a decode step or a verify call)."""
    return (m == 1 or decode_kernel_serves(m)) and GEMV1_KERNEL.get(w.dtype) == "tc" and gemv_tc.available()


def _gemv_steps(lw: Lowering, w: GpuParam, x2: Any, y2: Any) -> list:
    m, n_in = x2.shape
    n_out = w.shape[0]
    x2, steps = _aligned_x(lw, x2)
    if _tc_serves(w, m):
        return steps + gemv_tc.steps(w, x2, y2)
    name, threads, rows = gemv_kernel(w.dtype, n_out, n_in, m, w.raw.data.ptr)
    steps.append(Launch("matmul.cu", name, cdiv(n_out, rows) * token_blocks(name, m), threads,
                        (w.raw, np.int64(_row_bytes(w.dtype, n_in)), x2, y2, i32(n_out), i32(n_in), i32(m))))
    return steps


def gemv_kernel(fmt: str, n_out: int, n_in: int, m: int, w_ptr: int,
                variant: str | None = None) -> tuple[str, int, int]:
    """(kernel name, threads per block, rows per block) of the GEMV for `m` tokens of an [n_out, n_in]
    weight at device address `w_ptr`. `variant` (a GEMV1_CONFIGS or GEMV1_V3 key, or "gemv1") overrides
    the choice (GEMV1_KERNEL, and short_float_rows for float formats); cases a variant cannot take (float
    rows not whole 8-value pieces; unaligned rows for the wide-load formats) fall back to gemv1_<fmt>."""
    if m != 1:
        if m <= GEMVM_MAX_TOKENS and fmt in FLOATS and n_in % 8 == 0:
            per_block = gemvm_block_tokens(m)  # gemvm2 / gemvm4 / gemvm8
            cfg = GEMVM_KERNEL
            if cfg == "exact":
                cfg = gemvm_exact(fmt, n_out, n_in, w_ptr)
            elif cfg == "auto":
                cfg = gemvm_auto(n_out, 1 << (m - 1).bit_length())
            if cfg is not None:
                return f"gemvm{per_block}_{fmt}_{cfg}", *GEMVM_CONFIGS[cfg]
        if decode_kernel_serves(m):
            name, threads, rows = gemv_kernel(fmt, n_out, n_in, 1, w_ptr, variant)
            if token_blocks(name, m) > 1:
                return name, threads, rows
        return f"gemv_{fmt}" if m <= GEMV_SMALL_TOKENS else f"gemv16_{fmt}", GEMV_THREADS, GEMV_ROWS_PER_BLOCK
    cfg = variant or short_float_rows(fmt, n_out, _row_bytes(fmt, n_in)) or GEMV1_KERNEL.get(fmt, "gemv1")
    if cfg == "tc":  # gemv_tc.cu's kernel is not a matmul.cu one: callers asking for one get the f32 kernel
        cfg = TC_FALLBACK
    ok = cfg in GEMV1_CONFIGS or (cfg in GEMV1_V3 and fmt in V3_FORMATS)
    if not ok or not _v2_fits(fmt, n_in, w_ptr):
        return f"gemv1_{fmt}", GEMV_THREADS, GEMV_ROWS_PER_BLOCK
    if cfg in GEMV1_V3:
        threads, rows = GEMV1_V3[cfg]
        return f"gemv1v3_{fmt}_{cfg[2:]}", threads, rows
    threads, rows = GEMV1_CONFIGS[cfg]
    return f"gemv1v2_{fmt}_{cfg}", threads, rows


def decode_kernel_serves(m: int) -> bool:
    """Whether an m-token call (2..16) runs the decode step's own kernel on m times its blocks (common.cuh
    GEMV1_TOKEN_BLOCK) where that kernel takes them (token_blocks): GEMVM_KERNEL "exact", for the quantized
    formats, whose 2..16-token gemv_<fmt> adds in another order than their tuned decode kernels. (gemv_kernel
    gives float rows of whole 8-value pieces gemvm_exact's geometry first; where the decode step takes
    gemv1_<fmt>, gemv_<fmt> is already its order.)"""
    return GEMVM_KERNEL == "exact" and 1 < m <= GEMV_MAX_TOKENS


def gemvm_block_tokens(m: int) -> int:
    """Tokens a gemvm block computes for an m-token call (2..16): GEMVM_TOKENS_A_BLOCK of its bucket."""
    return GEMVM_TOKENS_A_BLOCK[1 << (m - 1).bit_length()]


def token_blocks(name: str, m: int) -> int:
    """Blocks a row block takes: m for the decode kernels (GEMV1_TOKEN_BLOCK: a token a block), cdiv(m, M) for
    gemvm<M> (GEMVM_TOKEN_GROUP: M tokens a block), else 1."""
    if name.startswith(("gemv1v2_", "gemv1sw_", "gemv1v3_", "gemv_tc_")):
        return m
    if name.startswith("gemvm"):
        return cdiv(m, int(name.removeprefix("gemvmsw").removeprefix("gemvm").split("_")[0]))
    return 1


def gemvm_exact(fmt: str, n_out: int, n_in: int, w_ptr: int) -> str | None:
    """The 2..16-token geometry whose rows are the decode step's GEMV rows bit for bit (GEMVM_KERNEL "exact"), or
    None where the decode step takes gemv1_<fmt> (GEMV1_KERNEL set so): gemv_<fmt> then adds in its order."""
    name = gemv_kernel(fmt, n_out, n_in, 1, w_ptr)[0]
    cfg = name.rsplit("_", 1)[1]
    if not name.startswith("gemv1v2_"):
        return None
    return f"j32w{int(cfg[1:].split('r')[0]) // 32}r4"  # g<G>r<NR>: the same G lanes a row


def gemvm_auto(n_out: int, bucket: int) -> str:
    """The 2..16-token geometry GEMVM_KERNEL = "auto" takes for `n_out` rows (every bucket alike so far)."""
    return next(cfg for cfg, blocks in GEMVM_AUTO if cdiv(n_out, GEMVM_CONFIGS[cfg][1]) >= blocks)


# Float rows of at most this many bytes (Qwen3-0.6B's d_model 1024 in bf16, SmolLM2's 576 in f32) give
# g128r1 one 16-byte load a lane and a block a row: the LM head's 151,936 blocks ran at 39.6 % of copy
# bandwidth. Warps of several rows each keep more bytes in flight. H200, 2026-12-01, `bench_gpu_gemv.py
# --variants` (% of copy bandwidth, g128r1 -> the pick): bf16 151936x1024 39.6 -> g32r2 99.8, 4096x1024
# 32.5 -> g64r2 41.5; f32 49152x576 43.8 -> g32r2 91.9, 3072x576 34.9 -> g64r2 38.9. Fewer rows stay on
# g128r1 (bf16 1024x2048 29.4 vs g64r2 18.5; f32 960x576 19.7 vs 16.9).
SHORT_ROW_BYTES = 2304
SHORT_ROWS_MANY, SHORT_ROWS_VOCAB = 2048, 32768


def short_float_rows(fmt: str, n_out: int, row_bytes: int) -> str | None:
    """The m == 1 geometry for a float weight of short rows, None where GEMV1_KERNEL's applies."""
    if fmt not in FLOATS or row_bytes > SHORT_ROW_BYTES or n_out < SHORT_ROWS_MANY:
        return None
    return "g32r2" if n_out >= SHORT_ROWS_VOCAB else "g64r2"


def _v2_fits(fmt: str, n_in: int, w_ptr: int) -> bool:
    """Whether the gemv1v2 kernels can read this weight: float rows of whole 8-value pieces,
    16-byte aligned rows of whole 16-byte pieces for the wide-load formats."""
    if fmt in FLOATS and n_in % 8:
        return False
    return not (fmt in _WIDE and (_row_bytes(fmt, n_in) % 16 or w_ptr % 16))


def _largest_matrix(lw: Lowering) -> int:
    """Elements of the store's largest 2-D non-f32 weight (the ones prefill dequantizes)."""
    sizes = [math.prod(wt.shape) for wt in lw.weights.values() if len(wt.shape) == 2 and wt.dtype != "f32"]
    return max(sizes, default=0)


def _ensure_scratch(lw: Lowering, need: int, key: tuple[str, str] = SCRATCH_KEY, dtype: Any = np.float32) -> None:
    """One dequant buffer per weight store and `key`, at least `need` elements. It is allocated once
    for the largest matrix of the store and only replaced by a larger one (a stacked weight): steps
    look it up at call time, so every Program uses the current one and the old one is freed."""
    derived = lw.weights.derived
    buf = derived.get(key)
    if buf is not None and buf.size >= need:
        return
    size = max(need, _largest_matrix(lw) if buf is None else 0)
    derived[key] = None
    del buf  # free the smaller buffer before allocating the larger one
    derived[key] = cupy().empty(size, dtype)


def _dequantizer(lw: Lowering, w: GpuParam) -> Any:
    """A function that writes weight `w` as f32 [n_out, n_in] into the store's shared scratch (f32
    weights: the weight itself) and returns it, for the prefill matmuls."""
    fmt = w.dtype
    n_out, n_in = w.shape
    if fmt == "f32":
        return lambda: w.raw
    need = n_out * n_in
    _ensure_scratch(lw, need)
    derived = lw.weights.derived
    kern = kernels.get("matmul.cu", f"dequant_{fmt}")
    work = n_out * (n_in // dtype_info(fmt).block) * _UNITS[fmt] if fmt in _UNITS else need
    grid = (min(cdiv(work, 256), _MAX_GRID),)
    args_head = (w.raw, np.int64(_row_bytes(fmt, n_in)))
    tail = (i32(n_out), i32(n_in))

    def dequantized() -> Any:
        wf = derived[SCRATCH_KEY][:need].reshape(n_out, n_in)
        kern(grid, (256,), args_head + (wf,) + tail)
        return wf

    return dequantized


def _prefill_step(lw: Lowering, w: GpuParam, x2: Any, y2: Any) -> HostLibraryCall:
    cp = cupy()
    n_out, n_in = w.shape
    weight = _dequantizer(lw, w)
    how = "cuBLAS" if w.dtype == "f32" else "dequant + cuBLAS"
    return HostLibraryCall(lambda: cp.matmul(x2, weight().T, out=y2),
                           f"mul_mat prefill {w.dtype} {n_out}x{n_in} ({how})")


BF16_SCRATCH_KEY = ("gpu", "bf16_weight_scratch")  # a non-bf16 weight rounded to bf16 for mul_mat_bf16

# cuBLAS enums (cublas_api.h, library_types.h); hipBLAS takes the same values through CuPy's ROCm build
_OP_N, _OP_T = 0, 1
_R_32F, _R_16BF = 0, 14
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1


def _cast_bf16(src: Any, dst: Any) -> tuple[str, int]:
    """(kernel, grid of 256 threads) rounding f32 src to bf16 dst: 16-byte loads where both are aligned."""
    if src.data.ptr % 16 == 0 and dst.data.ptr % 8 == 0:
        return "cast_f32_bf16_v4", max(1, min(cdiv(src.size // 4, 256), _MAX_GRID))
    return "cast_f32_bf16", min(cdiv(src.size, 256), _MAX_GRID)


# ---------------------------------------------------------------- bf16 twins of GEMM inputs
# A prefill GEMM's x is rounded to bf16 by a cast kernel: an f32 write by its producer, then a read of
# 4 bytes and a write of 2 a value (Qwen3-8B, 4096 tokens: 144 casts, 6.5 ms of a 131.7 ms call on an
# H200, 2026-12-01). Where every reader of a result is a mul_mat_bf16 taking it as x, the producer's
# kernel writes it as bf16 instead (its "twin") and the GEMMs read that: the same f32 value rounded
# by the same f32_to_bf16, so every GEMM result is bitwise what the cast gave. The twin lives in the first
# half of the f32 result's own arena slot, which nothing else reads or writes (memplan never places a result
# over a slot its node reads), so twins take no memory of their own: a buffer each took 7.2 GB at Qwen3-8B's
# 4096-token prefill. GRAPHIR_NO_BF16_TWINS=1 keeps the casts.
BF16_GEMMS = ("mul_mat_bf16", "mul_mat_bf16_rounded")  # both round x to bf16 first


def bf16_x_readers(graph: Any, copies: set[int]) -> dict[tuple[int, int], list]:
    """(id(node), result k) -> the bf16 GEMMs (BF16_GEMMS) reading that result as x, for the results that
    nothing else reads: no other op, no graph output, seen through item and aliasing reshapes."""
    users = graph.users()
    outputs = {id(o) for o in graph.outputs.values()}

    def readers(v: Any) -> list | None:
        if id(v) in outputs:
            return None
        found: list = []
        for u in users[id(v)]:
            if u.op in BF16_GEMMS and u.src[1] is v and u.src[0] is not v:
                found.append(u)
            elif u.op == "reshape" and id(u) not in copies and (more := readers(u)) is not None:
                found += more
            else:
                return None
        return found or None

    out: dict[tuple[int, int], list] = {}
    for n in graph.nodes():
        if n.is_leaf or n.op in ("item", *BF16_GEMMS):
            continue
        values: dict[int, list] = {}
        for k, v in ([(u.params["index"], u) for u in users[id(n)] if u.op == "item"] if OPS[n.op].multi
                     else [(0, n)]):
            values.setdefault(k, []).append(v)
        for k, vs in values.items():
            found = [readers(v) for v in vs]
            if all(f is not None for f in found):  # every item of result k read by GEMMs alone
                out[(id(n), k)] = [u for f in found for u in f]
    return out


def bf16_half(slot: Any) -> Any:
    """The first half of a C-contiguous f32 array's bytes as uint16 of its shape: where a bf16 copy of its
    values fits when nothing else reads them."""
    return slot.view(np.uint16).reshape(-1)[:slot.size].reshape(slot.shape)


def bf16_twin(lw: Lowering, n: Any, k: int, like: Any) -> Any:
    """A uint16 buffer shaped like `like` (result k of node n: its f32 arena slot, whose first half it is)
    that n's kernel fills with the result rounded to bf16 (f32_to_bf16), registered as the bf16 x of every
    bf16 GEMM reading it; None where something else reads the result (then n writes f32 as usual). Call it
    only from a rule that then launches a bf16-writing kernel."""
    readers = lw.bf16_readers.get((id(n), k)) if n is not None else None
    if not readers or flags.enabled("GRAPHIR_NO_BF16_TWINS"):
        return None
    buf = bf16_half(like) if like.flags.c_contiguous else lw.scratch(like.shape, np.uint16)
    for u in readers:
        lw.shared[("bf16 x", id(u.src[1]))] = buf
    return buf


# ---------------------------------------------------------------- bf16 storage of rounded products
# mul_mat_bf16_rounded's result is a bf16 value by definition. Where only swiglu_split reads it (a prefill's gate and
# up, from the gemm-bf16-out pass), cuBLAS writes it as bf16 into the first half of its own f32 arena slot and the
# activation reads that: half the bytes written and read, no extra memory, the slot's liveness unchanged.
def bf16_stored_products(graph: Any) -> set[int]:
    """ids of the mul_mat_bf16_rounded nodes whose every reader is a swiglu_split over two such products (so the
    activation reads both halves as bf16); none is a graph output."""
    users = graph.users()
    outputs = {id(o) for o in graph.outputs.values()}

    def only_swiglu(v: Any) -> bool:
        return (v.op == "mul_mat_bf16_rounded" and id(v) not in outputs and bool(users[id(v)])
                and all(u.op == "swiglu_split" for u in users[id(v)]))

    return {id(n) for n in graph.nodes() if only_swiglu(n)
            and all(only_swiglu(s) for u in users[id(n)] for s in u.src)}


def bf16_stored(lw: Lowering, n: Any) -> Any:
    """The bf16 storage of node n's result (a uint16 view of its f32 slot), or None where it is stored as f32."""
    return lw.shared.get(("bf16 value", id(n))) if n is not None else None


def lower_mul_mat_bf16_rounded(lw: Lowering, n: Any, ins: list, outs: list, p: dict) -> list:
    """mul_mat_bf16_rounded: cuBLAS's bf16 output (its f32 accumulator rounded to nearest) where only bf16-reading
    kernels read the result, else an f32 product rounded in place."""
    y = outs[0]
    if n is not None and id(n) in lw.bf16_products and y.size and y.data.ptr % 16 == 0:
        yb = lw.shared[("bf16 value", id(n))] = bf16_half(y)
        return lower_mul_mat_bf16(lw, n, ins, [yb], p)
    steps = lower_mul_mat_bf16(lw, n, ins, outs, p)
    if y.size:
        steps.append(Launch("matmul.cu", "round_bf16_f32", min(cdiv(y.size, 256), _MAX_GRID), 256,
                            (y, np.int64(y.size))))
    return steps


def lower_mul_mat_bf16(lw: Lowering, n: Any, ins: list, outs: list, p: dict) -> list:
    """mul_mat_bf16 (from the gemm-bf16 pass): cuBLAS on tensor cores, bf16 operands, f32 accumulation.
    x is rounded to bf16 by our cast kernel (ties to even, as the reference); bf16 weights are used as
    stored, other formats dequantized to f32 and rounded by the same kernel into a shared scratch.
    (cuBLAS's own down-conversion, COMPUTE_32F_FAST_16BF, did not round as the reference does: the
    GPU op tests failed with it on f32 and q8_0 weights, H200, 2026-11-30.)"""
    from cupy_backends.cuda.libs import cublas

    w, x, y = ins[0], ins[1], outs[0]
    if not (isinstance(w, GpuParam) and len(w.shape) == 2):
        raise BackendError("mul_mat_bf16: the gpu backend takes a 2-D weight (what the gemm-bf16 pass rewrites)")
    _check_fmt(w.dtype, "mul_mat_bf16")
    n_out, n_in = w.shape
    m = math.prod(x.shape[:-1])
    if m == 0 or n_out == 0:
        return []
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        raise BackendError(f"mul_mat_bf16: x must be C-contiguous float32 on the gpu backend, got {x.dtype}")
    x2, y2 = x.reshape(m, n_in), y.reshape(m, n_out)
    handle = cupy().cuda.device.get_cublas_handle()
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)  # host scalars, read at each call
    def to_bf16(src: Any, dst: Any) -> None:
        name, grid = _cast_bf16(src, dst)
        kernels.get("matmul.cu", name)((grid,), (256,), (src, dst, np.int64(src.size)))

    # q, k, v (and gate, up) read one x: it is rounded once, by the first of them, into a buffer they
    # share (x's arena slot stays live, unwritten, until its last reader has run)
    key = ("bf16 x", id(n.src[1]) if n is not None else id(x))
    steps = []
    xb = lw.shared.get(key)
    if xb is None:
        xb = lw.shared[key] = lw.scratch((m, n_in), np.uint16)
        steps.append(Launch("matmul.cu", *_cast_bf16(x2, xb), 256, (x2, xb, np.int64(m * n_in))))
    if w.dtype == "bf16":
        def weight_ptr() -> int:
            return w.raw.data.ptr
    else:
        dequantized = _dequantizer(lw, w)
        _ensure_scratch(lw, n_out * n_in, BF16_SCRATCH_KEY, np.uint16)
        derived = lw.weights.derived

        def weight_ptr() -> int:
            wb = derived[BF16_SCRATCH_KEY][:n_out * n_in]
            to_bf16(dequantized(), wb)
            return wb.data.ptr

    y_type = _R_16BF if y.dtype == np.uint16 else _R_32F  # bf16 storage of a rounded product (above)

    def run() -> None:  # column-major: y^T [n_out, m] = w [n_in, n_out]^T . x^T [n_in, m]
        cublas.gemmEx(handle, _OP_T, _OP_N, n_out, m, n_in, one.ctypes.data, weight_ptr(), _R_16BF, n_in,
                      xb.data.ptr, _R_16BF, n_in, zero.ctypes.data, y2.data.ptr, y_type, n_out, _COMPUTE_32F,
                      _GEMM_DEFAULT)

    steps.append(HostLibraryCall(run, f"mul_mat_bf16 {w.dtype} {n_out}x{n_in} (cuBLAS, tensor cores)"))
    return steps


def _merge_batch(wb: tuple[int, ...], xb: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Drop size-1 batch axes and merge neighbours that broadcast alike (w's axis equal to x's, or
    1): both operands stay contiguous over the merged axes, so the kernel needs one stride each."""
    mw: list[int] = []
    mx: list[int] = []
    kinds: list[bool] = []
    for a, b in zip(wb, xb):
        if b == 1:
            continue
        kind = a == b
        if kinds and kinds[-1] == kind:
            mw[-1] *= a
            mx[-1] *= b
        else:
            mw.append(a)
            mx.append(b)
            kinds.append(kind)
    return mw, mx


def _batched_steps(lw: Lowering, w: Any, x: Any, y: Any) -> list:
    wa = w.f32() if isinstance(w, GpuParam) else w
    for name, a in (("w", wa), ("x", x)):
        if a.dtype not in (np.float32, np.float16) or not a.flags.c_contiguous:
            raise BackendError(f"mul_mat: {name} must be a C-contiguous float32 or float16 array on the gpu "
                               f"backend, got {a.dtype} {'contiguous' if a.flags.c_contiguous else 'strided'}")
    sw, sx = tuple(wa.shape), tuple(x.shape)
    n_out, n_in, n = sw[-2], sw[-1], sx[-2]
    wb, xb = sw[:-2], sx[:-2]
    if len(wb) > len(xb):
        raise BackendError(f"mul_mat: w {list(sw)} has more batch axes than x {list(sx)}")
    wb = (1,) * (len(xb) - len(wb)) + wb
    for a, b in zip(wb, xb):
        if a not in (1, b):
            raise BackendError(f"mul_mat: w batch axes {list(sw[:-2])} do not broadcast onto x's {list(xb)}")
    if y.size == 0:
        return []
    if all(a == 1 for a in wb):  # one w for every batch: x's batch axes are just more rows
        mw, mx, n = [], [], math.prod(sx[:-1])
    else:
        mw, mx = _merge_batch(wb, xb)
    if len(mx) > 2:
        raise BackendError(f"mul_mat: w {list(sw)} x {list(sx)} needs {len(mx)} batch axes after merging; "
                           "the gpu backend handles at most 2")
    mw, mx = [1] * (2 - len(mx)) + mw, [1] * (2 - len(mx)) + mx
    # element strides of the (merged) batch axes, 0 where w broadcasts
    sw1 = n_out * n_in if mw[1] > 1 else 0
    sw0 = n_out * n_in * mw[1] if mw[0] > 1 else 0
    sx1 = n * n_in
    sx0 = n * n_in * mx[1]
    total = mx[0] * mx[1] * n * n_out
    return [Launch("matmul.cu", "matmul_batched_f32", min(cdiv(total, 256), _MAX_GRID), 256,
                   (wa, x, y, i32(mx[0]), i32(mx[1]), i32(n), i32(n_out), i32(n_in), np.int64(sw0), np.int64(sw1),
                    np.int64(sx0), np.int64(sx1), i32(wa.dtype == np.float16), i32(x.dtype == np.float16)))]


# ---------------------------------------------------------------- get_rows
def lower_get_rows(lw: Lowering, n: Any, ins: list, outs: list, p: dict) -> list:
    table, ids, out = ins[0], ins[1], outs[0]
    if isinstance(table, GpuParam):
        fmt, raw = table.dtype, table.raw
        _check_fmt(fmt, "get_rows")
    elif table.dtype == np.float32:
        fmt, raw = "f32", table
    elif table.dtype == np.float16:
        fmt, raw = "f16", table.view(np.uint16)
    else:
        raise BackendError(f"get_rows: table must be float32 or float16 on the gpu backend, got {table.dtype}")
    if not isinstance(table, GpuParam) and not table.flags.c_contiguous:
        raise BackendError("get_rows: the table must be C-contiguous on the gpu backend")
    rows, dim = table.shape
    n_ids = ids.shape[0]
    if n_ids == 0 or dim == 0:
        return []
    code = lw.code_arg(f"get_rows: id {{value}} out of range 0..{rows - 1}")
    return [Launch("get_rows.cu", f"get_rows_{fmt}", n_ids, 256,
                   (raw, np.int64(_row_bytes(fmt, dim)), ids, out, i32(rows), i32(dim), lw.errflag, code))]
