"""flash_attn on the GPU: split-K flash decoding for a few queries, a tiled causal kernel for prefill.

Both paths read positions and kv_len on the device (attention.cu), so a lowered Program serves
every position. The kernel and every launch argument are chosen here from shapes, K/V alignment
and the device's SM count only. Shape class suffix: `_d<DK>_g<GB>` (DK 64/128/256 >= the head
dims, GB 1/4/8 q heads per block), or `_any` (element loads, one head per block) when a head dim
is not a multiple of 4 (8 for most f16 decode classes) or K/V is not 16-byte aligned (8 for f16).

- decode (n_q <= DECODE_MAX_QUERIES): `attn_decode_<kv><suffix>` over a fixed grid of n_split
  splits per (query, kv head, head chunk), then `attn_combine`. A split's row count is
  max(MIN_CHUNK, ceil(Ls / n_split)), Ls the rows the query sees (its position + 1, at most kv_len),
  computed on the device, so the work follows the actual context and splits past Ls exit at once.
  n_split is sized so that every block of one query's full context is resident at once (one wave:
  SMs x resident blocks of the decode kernel), the same for a verify call's queries, so that each
  is its decode step bit for bit; a verify call of WALK_MIN_QUERIES or more runs `attn_decode_walk_<kv><suffix>`, whose
  blocks walk several of a query's splits each (`walk_blocks`), so its queries share about one wave
  too. The shape
  classes take R rows per row group per step, loads of the next step overlapping this step's math
  (R per KV dtype and GQA class: the table at the end of attention.cu); `_any` one row at a time.
  H200, 2026-11-30, `bench_gpu_attention.py --variants`, %copy at 1k/8k/32k: f16 7.3/41.5/58.5, f32 16.9/53.1/85.6
- prefill: `attn_prefill_<kv><suffix>`, QT queries x one GQA head chunk per block, K/V tiles in
  shared memory.
- flash_attn_bf16 (the attn-bf16 pass; prefill): on CUDA sm_80+ `attn_kv_bf16_<kv>` rounds the K/V
  rows below kv_len into a bf16 scratch shared by every layer, then `attn_prefill_bf16_d<DK>`
  (attention_prefill.cu) runs FlashAttention-2 on tensor cores, 16*TC_MT*TC_WARPS queries of one q
  head per block (`_tc_rows`); DK 128 (Qwen3, Llama) and 256 (Qwen3.5, Gemma 3) keep Q in dynamic
  shared memory, with the K/V tiles past the 48 KiB default (the limit is raised). Where only bf16
  GEMMs read the output (the o-projection: matmul.bf16_twin), `attn_prefill_bf16_d<DK>_obf16` writes
  it as bf16 for them.
  HIP and older GPUs (and a GPU without that much shared memory a block) take the f32 kernels
  above: they compute the op without its bf16 roundings (closer to exact attention, off the op's
  reference by about them).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from graphir.errors import BackendError

from . import kernels, matmul
from .device import tensor_cores
from .launch import Launch, Lowering, cdiv, f32, i32

FILE = "attention.cu"
# Up to this many queries (a speculative verify call: graphir/speculative.py VERIFY_BUCKETS) take the
# split-K decode kernel: the prefill kernel's grid is (queries / QT) x kv heads, 8 blocks for 8 queries of
# Qwen3-0.6B, each walking the whole context alone (61 us a layer at 136 keys, H200, 2026-12-01,
# profile_gpu_decode.py --verify 8). The decode grid reads K/V once per query, but its blocks of one split
# run in the same wave, so the repeats mostly hit L2.
DECODE_MAX_QUERIES = 16
DECODE_THREADS = 128  # ATTN_DECODE_THREADS
PREFILL_THREADS = 128  # ATTN_PREFILL_THREADS
COMBINE_THREADS = 256  # ATTN_COMBINE_THREADS
MAX_SPLITS = 1024  # ATTN_MAX_SPLITS (combine's shared weights)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634

# Decode grid: TARGET_BLOCKS blocks when every split is busy; None: one wave of the decode kernel
# (SM count x its resident blocks per SM, from its register count), so no SM idles through a second,
# partial wave. MIN_CHUNK: rows per split at least, so a block's fixed cost (kv_len and q loads,
# merge, partial write of GB*dv floats, combine reads) stays small next to its rows. It only decides
# short contexts (below n_split x MIN_CHUNK keys), where a split's rows are walked one step after
# another: fewer rows a split, fewer dependent steps. H200, 2026-12-01, captured decode step at ~335
# keys (`profile_gpu_decode.py MODEL --min-chunk 64,32,16,8`), us: Qwen3-0.6B 948.5 / 902.4 / 888.3 /
# 914.9, Qwen3-8B 4,598.8 / 4,537.0 / 4,515.9 / -, SmolLM2 f32 764.9 / 741.1 / 746.6 / 769.3.
TARGET_BLOCKS: int | None = None
MIN_CHUNK = 16
# A verify call of this many queries or more runs the walk kernels (one wave of blocks walking splits); fewer
# take a block a split. H200, Qwen3-0.6B, attention us a layer (block a split -> walk): 16 queries 17.4 -> 11.8
# at 128 keys, 81.3 -> 76.7 at 2,000; 8 queries 42.4 -> 43.3 at 2,000 keys, and SmolLM2 F32's 8-token verify
# call at position 100 1.2 -> 1.1 ms; 2 and 4 queries at 2,000 keys 12.0 -> 14.7 and 22.3 -> 24.9 (the walk
# kernel keeps 2 blocks an SM resident where the decode kernel keeps 3) (BENCHMARKS.md, twenty-first session).
WALK_MIN_QUERIES = 8


def _kv_name(a: Any) -> str:
    dt = np.dtype(a.dtype)
    if dt == np.float32:
        return "f32"
    if dt in (np.float16, np.uint16):  # f16 as numpy/cupy float16 or as raw bits
        return "f16"
    raise BackendError(f"flash_attn: the gpu backend reads K/V as f32 or f16, got {dt}")


def _aligned(a: Any, n: int) -> bool:
    return a.size == 0 or int(a.data.ptr) % n == 0


def _shape_class(kv: str, d: int, dv: int, group: int, k: Any, v: Any) -> tuple[str, int, int, int]:
    """(kernel suffix, DK, GB, prefill NV) for these shapes; mirrors ATTN_DEFINE_KV in attention.cu."""
    width = 16 if kv == "f32" else 8  # one vector load: 4 elements
    if d % 4 or dv % 4 or not (_aligned(k, width) and _aligned(v, width)):
        return "_any", 256, 1, 4
    dk = 64 if max(d, dv) <= 64 else 128 if max(d, dv) <= 128 else 256
    gb = 1 if group == 1 else 4 if group <= 4 else 8
    return f"_d{dk}_g{gb}", dk, gb, 2 if gb == 8 else 4


def _decode_suffix(kv: str, suffix: str, dk: int, gb: int, d: int, dv: int, k: Any, v: Any) -> str:
    """The decode kernel's suffix: the prefill one, or `_any` where attn_decode_tile cannot load the rows.
    Its f16 classes with NV=2 (all but GB=8 below DK=256: ATTN_DEFINE_DECODE_KV) read 8 halves per
    16-byte load: d, dv multiples of 8 and 16-byte aligned K/V."""
    nv = 1 if gb == 8 and dk < 256 else 2
    if kv == "f16" and nv == 2 and (d % 8 or dv % 8 or not (_aligned(k, 16) and _aligned(v, 16))):
        return "_any"
    return suffix


@functools.cache
def _sm_count() -> int:
    try:
        from .device import cupy

        return int(cupy().cuda.Device().attributes["MultiProcessorCount"])
    except Exception:  # no device attributes here: an H200
        return 132


def resident_blocks(kernel: Any, threads: int) -> int:
    """Blocks of a RawKernel resident at once on the device (one wave)."""
    per_sm = 0
    try:
        from cupy_backends.cuda.api import driver

        per_sm = int(driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, threads, 0))
    except Exception:  # HIP or an older CuPy: from the register count (64K registers per SM)
        try:
            regs = max(1, int(kernel.num_regs))
            per_sm = 65536 // (cdiv(regs * 32, 256) * 256 * (threads // 32))
        except Exception:
            per_sm = 0
    return _sm_count() * max(1, min(per_sm, 16)) if per_sm > 0 else _sm_count() * 4


def lower_flash_attn(lw: Lowering, n: Any, ins: list, outs: list, p: dict) -> list:
    q, k, v, pos, kv_len = ins
    out = outs[0]
    n_q, hq, d = q.shape
    cap, hk, dv = v.shape
    if max(d, dv) > MAX_HEAD_DIM:
        raise BackendError(f"flash_attn: head dims d={d}, dv={dv}: the gpu backend supports up to {MAX_HEAD_DIM}")
    kv = _kv_name(k)
    if _kv_name(v) != kv:
        raise BackendError(f"flash_attn: k is {k.dtype} and v is {v.dtype}: the gpu backend needs one K/V dtype")
    if n_q == 0 or hq == 0 or dv == 0:
        return []
    group = hq // hk
    suffix, dk, gb, nvp = _shape_class(kv, d, dv, group, k, v)
    n_gch = cdiv(group, gb)
    window = int(p.get("window", 0))
    window = window if 0 < window < 2**31 else 0  # a window past any i32 position restricts nothing
    scale2 = f32(float(p["scale"]) * LOG2E)  # scores in the log2 domain (exp2f)
    code = lw.code_arg(f"flash_attn: kv_len {{value}} outside 0..{cap} (the KV capacity)")
    common = (i32(hq), i32(hk), i32(d), i32(dv), i32(cap))

    if n_q > DECODE_MAX_QUERIES:
        qt = PREFILL_THREADS // (dk // (4 * nvp))  # queries per block: one row group of T lanes each
        return [Launch(FILE, f"attn_prefill_{kv}{suffix}", (cdiv(n_q, qt), hk * n_gch), PREFILL_THREADS,
                       (q, k, v, pos, kv_len, out, i32(n_q), *common, scale2, i32(window), i32(n_gch),
                        lw.errflag, code))]

    suffix = _decode_suffix(kv, suffix, dk, gb, d, dv, k, v)
    if suffix == "_any":  # one head per block
        gb, n_gch = 1, group
    dname = f"attn_decode_{kv}{suffix}"
    target = TARGET_BLOCKS
    if target is None:
        target = resident_blocks(kernels.get(FILE, dname), DECODE_THREADS)
    # Splits a query are sized for one query whatever n_q is, and each query's split length follows its own
    # position (attention.cu split_len): a verify call's query is its decode step bit for bit, so greedy
    # speculative decoding equals plain greedy decoding exactly. Its blocks walk several splits each
    # (attn_decode_walk_*), so all its queries share about one wave, as a decode step's splits do.
    n_split = decode_splits(cap, hk * n_gch, target)
    blocks_x = n_split
    if n_q >= WALK_MIN_QUERIES:
        dname = dname.replace("attn_decode_", "attn_decode_walk_")
        walk_target = TARGET_BLOCKS or resident_blocks(kernels.get(FILE, dname), DECODE_THREADS)
        blocks_x = walk_blocks(n_split, hk * n_gch * n_q, walk_target)
    part_m = lw.scratch((n_q * hq * n_split,))
    part_l = lw.scratch((n_q * hq * n_split,))
    part_acc = lw.scratch((n_q * hq * n_split * dv,))
    early = i32(inputs_early(n))
    return [
        Launch(FILE, dname, (blocks_x, hk * n_gch, n_q), DECODE_THREADS,
               (q, k, v, pos, kv_len, part_m, part_l, part_acc, *common, i32(n_split), i32(MIN_CHUNK), scale2,
                i32(window), i32(n_gch), lw.errflag, code, early)),
        Launch(FILE, "attn_combine", (hq, n_q), COMBINE_THREADS,
               (part_m, part_l, part_acc, pos, kv_len, out, i32(hq), i32(dv), i32(cap), i32(n_split), i32(MIN_CHUNK),
                early)),
    ]


def inputs_early(n: Any) -> bool:
    """Whether the decode kernels may read pos and kv_len before their PDL wait (common.cuh
    PDL_ENTRY_EARLY): only where both are Input nodes, which the host writes before the graph runs
    and no kernel writes. A position or length computed inside the graph is read after the wait."""
    return n is not None and all(s.op == "input" for s in n.src[3:5])


TC_FILE = "attention_prefill.cu"
TC_WARPS = 4  # ATTN_TC_WARPS
TC_MT = 1  # ATTN_TC_MT: m-tiles of 16 query rows per warp at head dims 64 and 128 (256: 1)
# ATTN_TC_Q_SHARED_D64 / _D128: Q in dynamic shared memory at that head dim; None: the .cu default
# (at 128: TC_MT > 1, where 64 registers of Q a lane make O spill)
TC_Q_SHARED: dict[int, bool | None] = {64: False, 128: None}
TC_MAX_HEAD_DIM = 256
TC_BN_D256 = 32  # ATTN_TC_BN_D256: keys per K/V tile at DK 256
KV_CONVERT_THREADS = 256  # ATTN_KV_CONVERT_THREADS
KV_BF16_KEY = "attn_bf16_kv_scratch"


def _tc_dk(d: int, dv: int) -> int:
    """The attn_prefill_bf16_d<DK> that serves head dims d, dv (<= TC_MAX_HEAD_DIM)."""
    return 64 if max(d, dv) <= 64 else 128 if max(d, dv) <= 128 else 256


def _tc_rows(dk: int) -> int:
    """Query rows of one attn_prefill_bf16_d<dk> block: 16 per m-tile, TC_MT m-tiles a warp below DK 256."""
    return 16 * TC_WARPS * (1 if dk == 256 else TC_MT)


def _tc_q_shared(dk: int) -> bool:
    """Whether attn_prefill_bf16_d<dk> keeps Q in (dynamic) shared memory; mirrors QShared<DK>."""
    if dk == 256:
        return True
    q_shared = TC_Q_SHARED.get(dk)
    return q_shared if q_shared is not None else dk == 128 and TC_MT > 1


def _tc_dynamic_shared(dk: int) -> int:
    """Bytes of dynamic shared memory attn_prefill_bf16_d<dk> is launched with, bf16 rows of DK + 8
    (attention_prefill.cu): at DK 256 its K and V tiles and every warp's 16 Q rows; below, the block's
    Q rows where Q is in shared memory (the K/V tiles are static)."""
    if dk == 256:
        return (2 * TC_BN_D256 + 16 * TC_WARPS) * (dk + 8) * 2
    return _tc_rows(dk) * (dk + 8) * 2 if _tc_q_shared(dk) else 0


def _tc_kernel_fits(kernel: Any, dynamic: int) -> bool:
    """Raise the kernel's dynamic shared memory limit to `dynamic` bytes; False where the device cannot
    give a block that much (its opt-in maximum, static shared memory included)."""
    if dynamic == 0:
        return True
    from .device import cupy

    rt = cupy().cuda.runtime
    limit = int(rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, rt.getDevice()))
    if int(kernel.shared_size_bytes) + dynamic > limit:
        return False
    if int(kernel.max_dynamic_shared_size_bytes) < dynamic:
        kernel.max_dynamic_shared_size_bytes = dynamic
    return True


def _kv_bf16_scratch(lw: Lowering, size: int) -> Any:
    """One bf16 K/V buffer per weight store and device, shared by every attention node: each converts
    its K/V and reads them right away, on the one stream. A larger need replaces it; Programs lowered
    before keep the old one alive through their launch arguments."""
    from .device import cupy

    cp = cupy()
    key = ("gpu", KV_BF16_KEY, cp.cuda.Device().id)
    derived = lw.weights.derived
    if derived.get(key) is None or derived[key].size < size:
        derived[key] = cp.zeros(size, np.uint16)
    return derived[key][:size]


def lower_flash_attn_bf16(lw: Lowering, n: Any, ins: list, outs: list, p: dict) -> list:
    """flash_attn_bf16 (the attn-bf16 pass): K/V rounded to a bf16 scratch, then tensor-core attention.
    Every launch argument comes from shapes and fixed buffers; kv_len and positions are read on the device."""
    q, k, v = ins[:3]
    n_q, hq, d = q.shape
    cap, hk, dv = v.shape
    if not tensor_cores() or max(d, dv) > TC_MAX_HEAD_DIM:
        return lower_flash_attn(lw, n, ins, outs, p)
    kv = _kv_name(k)
    if _kv_name(v) != kv:
        raise BackendError(f"flash_attn_bf16: k is {k.dtype} and v is {v.dtype}: the gpu backend needs one K/V dtype")
    if n_q == 0 or hq == 0 or dv == 0:
        return []
    dk = _tc_dk(d, dv)
    shared = _tc_dynamic_shared(dk)
    name = f"attn_prefill_bf16_d{dk}"
    if not all(_tc_kernel_fits(kernels.get(TC_FILE, kernel), shared) for kernel in (name, name + "_obf16")):
        return lower_flash_attn(lw, n, ins, outs, p)
    pos, kv_len, out = ins[3], ins[4], outs[0]
    kvb = _kv_bf16_scratch(lw, 2 * hk * cap * dk)
    window = int(p.get("window", 0))
    window = window if 0 < window < 2**31 else 0
    code = lw.code_arg(f"flash_attn_bf16: kv_len {{value}} outside 0..{cap} (the KV capacity)")
    # where only bf16 GEMMs read the output, they get it as bf16 from the kernel and `out` stays unwritten
    twin = matmul.bf16_twin(lw, n, 0, out)
    attend = Launch(TC_FILE, name if twin is None else name + "_obf16", (hq, cdiv(n_q, _tc_rows(dk))),
                    32 * TC_WARPS,
                    (q, kvb, pos, kv_len, out if twin is None else twin, i32(n_q), i32(hq), i32(hk), i32(d),
                     i32(dv), i32(cap), f32(float(p["scale"]) * LOG2E), i32(window), lw.errflag, code),
                    shared=shared)
    vec = d % 8 == 0 and dv % 8 == 0 and k.data.ptr % 16 == 0 and v.data.ptr % 16 == 0  # 16-byte K/V loads
    convert = Launch(TC_FILE, f"attn_kv_bf16_{kv}", (max(1, cdiv(hk * cap * dk // 8, KV_CONVERT_THREADS)), 2),
                     KV_CONVERT_THREADS, (k, v, kvb, kv_len, i32(cap), i32(hk), i32(d), i32(dv), i32(dk), i32(vec)))
    return [convert, attend]


def walk_blocks(n_split: int, other_blocks: int, target_blocks: int) -> int:
    """Blocks along the splits of a verify call's walk kernel: `other_blocks` (heads x queries) times it fill
    about `target_blocks`; each walks n_split / it splits."""
    return max(1, min(n_split, target_blocks // max(1, other_blocks)))


def decode_splits(cap: int, blocks_per_split: int, target_blocks: int) -> int:
    """Splits per (query, kv head, head chunk): about target_blocks blocks at full context,
    no more than cap needs at MIN_CHUNK rows each."""
    return max(1, min(MAX_SPLITS, math.ceil(cap / MIN_CHUNK), target_blocks // max(1, blocks_per_split)))
