"""Which kernels each op lowers to on the GPU. Every op in the op table has a rule here
(tests/test_gpu_backend.py walks the table); there is no host fallback inside a Program.

Rules follow the signature at the bottom of launch.py. The matmul, attention and recurrent
families live in their own modules beside their .cu files; the small ops are here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from graphir import flags
from graphir.builder import contiguous_strides
from graphir.errors import BackendError
from graphir.ir import Node, toposort
from graphir.ops import OPS

from . import attention, matmul, nccl, recurrent
from .gemv_q8x import lower_mul_mat_q8x, lower_mul_mat_q16x
from .launch import Launch, Lowering, cdiv, dev, f32, i32
from .layout import BLOCK, broadcast_strides, collapse, copy_launch, grid_for, is_contiguous, tname, view_layout


def row_block(ncols: int) -> int:
    """Threads for one-block-per-row kernels: a multiple of 64 (a wavefront on gfx9), up to 1024."""
    return max(64, min(1024, cdiv(ncols, 64) * 64))


# ---------------------------------------------------------------- inputs read as row-strided views
def input_strides(lw: Lowering, n: Node, i: int) -> tuple[int, ...]:
    """Element strides of input i as this rule receives it. A view that layout.views_to_copy left
    in place (every reader listed it in ROW_STRIDED_INPUTS) is bound at its first element and keeps
    its layout's strides; anything else is C-contiguous: a gathered view (_view_copy marks it), a
    value folded from Params at lowering, every other node."""
    v = n.src[i]
    if not OPS[v.op].view or ("gathered", id(v)) in lw.shared or not _reads_runtime(lw, v):
        return contiguous_strides(v.shape)
    return view_layout(v)[1]


def _reads_runtime(lw: Lowering, v: Node) -> bool:
    """Whether v reads an Input or State (not folded from Params), memoized for the binding."""
    memo = lw.shared.setdefault("reads_runtime", {})
    for x in toposort([v]):
        if id(x) not in memo:
            memo[id(x)] = x.op in ("input", "state") or any(memo[id(s)] for s in x.src)
    return memo[id(v)]


def contiguous_input(lw: Lowering, n: Node, i: int, x: Any) -> tuple[Any, list]:
    """Input i as a contiguous array, with the gather that makes it (none when it already is), for
    the paths of a strided-input rule whose kernels read contiguous rows."""
    strides = input_strides(lw, n, i)
    if is_contiguous(x.shape, strides):
        return x, []
    tmp = lw.scratch(x.shape)
    return tmp, [copy_launch(x, tmp, (x.shape, strides, 0), f"{n.op} input {i} gather")]


# ---------------------------------------------------------------- elementwise
def _binary(op: str) -> Callable:
    def rule(lw: Lowering, n: Node, ins: list, outs: list, p: dict) -> list:
        a, b, y = dev(ins[0]), dev(ins[1]), outs[0]
        return [binary_launch(op, a, b, y)]
    return rule


def binary_launch(op: str, a: Any, b: Any, y: Any) -> Launch:
    dims, strides = collapse(a.shape, broadcast_strides(a.shape, b.shape), 4, f"{op} broadcast")
    args = (a, b, y, np.int64(a.size), i32(dims[1]), i32(dims[2]), i32(dims[3]), *map(i32, strides))
    return Launch("elementwise.cu", f"binary_{op}", grid_for(a.size), BLOCK, args)


def _unary(op: str) -> Callable:
    def rule(lw, n, ins, outs, p):
        x, y = dev(ins[0]), outs[0]
        return [Launch("elementwise.cu", f"unary_{op}", grid_for(x.size), BLOCK, (x, y, np.int64(x.size)))]
    return rule


def _scale(lw, n, ins, outs, p):
    x, y = dev(ins[0]), outs[0]
    return [Launch("elementwise.cu", "scale_f32", grid_for(x.size), BLOCK,
                   (x, y, np.int64(x.size), f32(p["s"]), f32(p["b"])))]


def _swiglu_split(lw, n, ins, outs, p):
    a, b, y = dev(ins[0]), dev(ins[1]), outs[0]
    stored = [matmul.bf16_stored(lw, s) for s in n.src] if n is not None else [None, None]
    if any(s is not None for s in stored):
        if any(s is None for s in stored):  # matmul.bf16_stored_products stores both halves or neither
            raise BackendError(f"swiglu_split {n.describe()}: one source stored as bf16, the other as f32")
        yb = matmul.bf16_twin(lw, n, 0, y)  # slots and scratch are 64-byte aligned (memplan.ALIGN, CuPy's pool)
        return [Launch("elementwise.cu", "swiglu_split_bf16in_v8_f32" if yb is None else "swiglu_split_bf16in_v8_bf16",
                       grid_for(a.size // 8), BLOCK, (*stored, y if yb is None else yb, np.int64(a.size)))]
    strides = [contiguous_strides(x.shape) if n is None else input_strides(lw, n, i) for i, x in enumerate((a, b))]
    if not all(is_contiguous(x.shape, st) for x, st in zip((a, b), strides)):
        return _swiglu_split_rows(lw, n, a, b, y, strides)
    if all(t.data.ptr % 16 == 0 for t in (a, b, y)):  # 16-byte accesses, 4 values a thread
        yb = matmul.bf16_twin(lw, n, 0, y)  # only GEMMs read y: write it as their bf16 x
        return [Launch("elementwise.cu", "swiglu_split_v4_f32" if yb is None else "swiglu_split_v4_bf16",
                       grid_for(a.size // 4), BLOCK, (a, b, y if yb is None else yb, np.int64(a.size)))]
    return [Launch("elementwise.cu", "swiglu_split_f32", grid_for(a.size), BLOCK, (a, b, y, np.int64(a.size)))]


def _swiglu_split_rows(lw: Lowering, n: Node, a: Any, b: Any, y: Any, strides: list) -> list:
    """swiglu_split of halves read in place through their row strides (ROW_STRIDED_INPUTS: one outer axis)."""
    f = a.shape[-1]
    (rows,), (sa,) = collapse(a.shape[:-1], strides[0][:-1], 1, "swiglu_split a")
    _, (sb,) = collapse(b.shape[:-1], strides[1][:-1], 1, "swiglu_split b")
    if f % 4 == 0 and sa % 4 == 0 and sb % 4 == 0 and all(t.data.ptr % 16 == 0 for t in (a, b, y)):
        yb = matmul.bf16_twin(lw, n, 0, y)
        return [Launch("elementwise.cu", "swiglu_split_rows_v4_f32" if yb is None else "swiglu_split_rows_v4_bf16",
                       grid_for(rows * f // 4), BLOCK,
                       (a, b, y if yb is None else yb, np.int64(rows), i32(f), np.int64(sa), np.int64(sb)))]
    return [Launch("elementwise.cu", "swiglu_split_rows_f32", grid_for(rows * f), BLOCK,
                   (a, b, y, np.int64(rows), i32(f), np.int64(sa), np.int64(sb)))]


def _mul_sigmoid(lw, n, ins, outs, p):
    """y = a * sigmoid(b), b read in place through its row strides (Qwen3.5's gate half of q)."""
    a, b, y = dev(ins[0]), dev(ins[1]), outs[0]
    if not is_contiguous(a.shape, input_strides(lw, n, 0)):
        raise BackendError(f"mul_sigmoid {n.describe()}: a must be contiguous here (ROW_STRIDED_INPUTS lists b only)")
    strides = input_strides(lw, n, 1)
    cols = b.shape[-1] if b.ndim else 1
    dims, outer = collapse(b.shape[:-1], strides[:-1], 2, "mul_sigmoid b")
    args = (a, b, y, np.int64(a.size), i32(cols), i32(dims[1]), np.int64(outer[0]), np.int64(outer[1]))
    return [Launch("elementwise.cu", "mul_sigmoid_f32", grid_for(a.size), BLOCK, args)]


# ---------------------------------------------------------------- norms and row reductions
SAMPLE_THREADS = 1024  # sample.cu: one block per row, each thread one contiguous segment of it
ARGMAX_THREADS, ARGMAX_CHUNK = 256, 4096  # sample.cu row_argmax_part_f32: logits per block of the first stage


def _rows(x: Any) -> tuple[int, int]:
    ncols = x.shape[-1] if x.ndim else 1
    return (x.size // ncols if ncols else 0), ncols


def rms_norm_launch(x: Any, w: Any | None, y: Any, eps: float) -> Launch:
    rows, ncols = _rows(x)
    args = (x, w if w is not None else x, y, i32(ncols), f32(eps), i32(w is not None))
    return Launch("norm.cu", "rms_norm_f32", rows, row_block(ncols), args)


def _is_row_weight(w: Any, ncols: int) -> bool:
    return w.size == ncols and w.shape[-1] == ncols  # [ncols] or [1, .., ncols]: one weight per column


def _rms_norm(lw, n, ins, outs, p):
    return [rms_norm_launch(dev(ins[0]), None, outs[0], p["eps"])]


def _row_norm(kernel: str) -> Callable:
    def rule(lw, n, ins, outs, p):
        x, y = dev(ins[0]), outs[0]
        rows, ncols = _rows(x)
        return [Launch("norm.cu", kernel, rows, row_block(ncols), (x, y, i32(ncols), f32(p["eps"])))]
    return rule


NORM_REGS_THREADS = 256  # add_rms_norm_mul_v<NV>_f32: rows up to 1,024 columns take 1 float4 a thread, 4,096 take 4


def _add_rms_norm_mul(lw, n, ins, outs, p):
    a, b, w = dev(ins[0]), dev(ins[1]), dev(ins[2])
    y_norm, y_sum = outs
    rows, ncols = _rows(a)
    if a.shape == b.shape and _is_row_weight(w, ncols):
        args = (a, b, w, y_norm, y_sum, i32(ncols), f32(p["eps"]))
        nv = cdiv(ncols, 4 * NORM_REGS_THREADS)
        if ncols % 4 == 0 and nv <= 8 and all(t.data.ptr % 16 == 0 for t in (a, b, w, y_norm, y_sum)):
            nv = 1 << (nv - 1).bit_length()  # the kernels are 1, 2, 4 and 8 float4 a thread
            yb = matmul.bf16_twin(lw, n, 0, y_norm)  # only GEMMs read the normed rows: write their bf16 x
            if yb is not None:
                args = (a, b, w, yb, y_sum, i32(ncols), f32(p["eps"]))
            return [Launch("norm.cu", f"add_rms_norm_mul_v{nv}_{'f32' if yb is None else 'bf16'}", rows,
                           cdiv(cdiv(ncols // 4, nv), 32) * 32, args)]
        return [Launch("norm.cu", "add_rms_norm_mul_f32", rows, row_block(ncols), args)]
    # other broadcasts: the same math from the unfused kernels
    normed = lw.scratch(a.shape)
    return [binary_launch("add", a, b, y_sum), rms_norm_launch(y_sum, None, normed, p["eps"]),
            binary_launch("mul", normed, w, y_norm)]


def _rms_norm_mul_gate(lw, n, ins, outs, p):
    x, w, z = dev(ins[0]), dev(ins[1]), dev(ins[2])
    rows, ncols = _rows(x)
    if z.shape != x.shape or not _is_row_weight(w, ncols):
        raise BackendError(f"rms_norm_mul_gate: z {list(z.shape)} must match x {list(x.shape)} and w "
                           f"{list(w.shape)} hold one weight per column")
    args = (x, w, z, outs[0], i32(ncols), f32(p["eps"]))
    return [Launch("norm.cu", "rms_norm_mul_gate_f32", rows, row_block(ncols), args)]


def _reduce_rows(mean: bool) -> Callable:
    def rule(lw, n, ins, outs, p):
        x, y = dev(ins[0]), outs[0]
        rows, ncols = _rows(x)
        mul = 1.0 / ncols if mean else 1.0
        return [Launch("reduce.cu", "sum_rows_f32", rows, row_block(ncols), (x, y, i32(ncols), f32(mul)))]
    return rule


def _argmax(lw, n, ins, outs, p):
    x, y = dev(ins[0]), outs[0]
    rows, ncols = _rows(x)
    return [Launch("reduce.cu", "argmax_f32", rows, row_block(ncols), (x, y, i32(ncols)))]


def _top_k(lw, n, ins, outs, p):
    x, y = dev(ins[0]), outs[0]
    rows, ncols = _rows(x)
    return [Launch("reduce.cu", "top_k_f32", rows, row_block(ncols), (x, y, i32(ncols), i32(p["k"])))]


def _sample(lw, n, ins, outs, p):
    x, settings, y = dev(ins[0]), ins[1], outs[0]
    rows, ncols = _rows(x)
    n_part = cdiv(ncols, ARGMAX_CHUNK)
    if n_part < 2:  # one block scans it as fast
        return [Launch("sample.cu", "sample_f32", rows, SAMPLE_THREADS,
                       (x, settings, y, i32(ncols), x, y, i32(0)))]
    part_v, part_i = lw.scratch((rows, n_part)), lw.scratch((rows, n_part), np.int32)
    return [Launch("sample.cu", "row_argmax_part_f32", (n_part, rows), ARGMAX_THREADS, (x, part_v, part_i, i32(ncols))),
            Launch("sample.cu", "sample_f32", rows, SAMPLE_THREADS,
                   (x, settings, y, i32(ncols), part_v, part_i, i32(n_part)))]


def _softmax(lw, n, ins, outs, p):
    x, y = dev(ins[0]), outs[0]
    rows, ncols = _rows(x)
    mask = dev(ins[1]) if len(ins) > 1 else None
    ms = broadcast_strides(x.shape, mask.shape) if mask is not None else (0,) * x.ndim
    dims, strides = collapse(x.shape[:-1], ms[:-1], 3, "softmax mask")
    args = (x, mask if mask is not None else x, y, i32(ncols), f32(p["scale"]), i32(mask is not None),
            i32(dims[1]), i32(dims[2]), *map(i32, strides), i32(ms[-1] if ms else 0))
    return [Launch("reduce.cu", "softmax_f32", rows, row_block(ncols), args)]


# ---------------------------------------------------------------- rope
def _inv_freq(lw: Lowering, p: dict) -> Any:
    half = p["n_dims"] // 2
    host = p["theta"] ** (-np.arange(half, dtype=np.float64) * 2.0 / p["n_dims"])  # as the reference
    buf = lw.scratch((half,), np.float64)
    buf.set(host)
    return buf


def _head_strides(x: Any, strides: tuple[int, ...]) -> tuple[np.int64, np.int64]:
    """The token and head strides of x [n_tok, n_heads, head_dim] (head_dim contiguous), kernel args."""
    if len(strides) != 3 or (x.shape[-1] > 1 and strides[-1] != 1):
        raise BackendError(f"rope kernels read x {list(x.shape)} as head rows with a contiguous last axis; "
                           f"got strides {list(strides)}")
    return np.int64(strides[0]), np.int64(strides[1])


def rope_launch(lw: Lowering, x: Any, pos: Any, y: Any, p: dict, x_strides: tuple[int, ...] | None = None) -> Launch:
    """y = rope(x), y contiguous; x read through x_strides (contiguous if None)."""
    n_tok, n_heads, head_dim = x.shape
    n_dims = p["n_dims"]
    work = n_tok * n_heads * (n_dims // 2 + head_dim - n_dims)
    xs = _head_strides(x, x_strides or contiguous_strides(x.shape))
    args = (x, pos, _inv_freq(lw, p), y, i32(n_tok), i32(n_heads), i32(head_dim), i32(n_dims),
            i32(p["mode"] == "neox"), np.float64(p["freq_scale"]), *xs)
    return Launch("rope.cu", "rope_f32", grid_for(work), BLOCK, args)


def _rope(lw, n, ins, outs, p):
    return [rope_launch(lw, dev(ins[0]), ins[1], outs[0], p, input_strides(lw, n, 0))]


def _rms_norm_mul_rope(lw, n, ins, outs, p):
    return norm_rope_steps(lw, n, 0, dev(ins[0]), dev(ins[1]), ins[2], outs[0], p)


# The norm-rope kernels (rope.cu): a lane group of 32 per head row, 8 rows a block; a lane holds at most
# 4 units of 2 columns in registers, so head_dim <= 256 (wider heads take rms_norm, then rope). At prefill
# sizes the _wide kernels give a group rpg rows: U units of each (U = 1, 2, 4 for rows of up to 64, 128, 256
# columns), at most NORM_ROPE_SLOTS units in all. (Keep these numbers in step with rope.cu.)
NORM_ROPE_THREADS = 256
NORM_ROPE_ROWS = NORM_ROPE_THREADS // 32
NORM_ROPE_MAX_HEAD = 256
NORM_ROPE_SLOTS = 8
# A group takes more than one row only while the launch keeps this many blocks: 2 an SM of an H200. Smaller
# launches (decode, verify) keep a row a group and the one-row kernels, their blocks spread over the SMs.
NORM_ROPE_FILL_BLOCKS = 264


def _fused_norm_rope(w: Any, head_dim: int) -> bool:
    return _is_row_weight(w, head_dim) and head_dim <= NORM_ROPE_MAX_HEAD


def _norm_rope_blocks(n_tok: int, n_heads: int, rpg: int) -> tuple[int, int]:
    """(blocks, tokens a block) for rpg rows a lane group: a block takes tb tokens and hb = min(n_heads,
    rows // tb) heads of each (tb > 1 only for fewer heads than the block's rows, e.g. 4 KV heads at one
    row a group: its 8 groups then take 2 tokens)."""
    rows = NORM_ROPE_ROWS * rpg
    tb = max(1, min(n_tok, rows // n_heads) if rpg > 1 else rows // n_heads)
    hb = min(n_heads, rows // tb)
    return cdiv(n_tok, tb) * cdiv(n_heads, hb), tb


def _norm_rope_geometry(n_tok: int, n_heads: int, head_dim: int, n_dims: int) -> tuple[str, int, int, int, int]:
    """(kernel suffix, blocks, tokens a block, rows a lane group, shared bytes) of a norm-rope launch: the most
    rows a group can hold, halved while that leaves fewer than NORM_ROPE_FILL_BLOCKS blocks; "_wide" where it
    is more than one. Shared: the block's cos/sin table of its tokens (doubles), then (_wide) their KV rows."""
    units = n_dims // 2 + (head_dim - n_dims + 1) // 2
    rpg = NORM_ROPE_SLOTS // (1 if units <= 32 else 2 if units <= 64 else 4)  # as rope.cu's norm_rope_wide
    while rpg > 1 and _norm_rope_blocks(n_tok, n_heads, rpg)[0] < NORM_ROPE_FILL_BLOCKS:
        rpg //= 2
    blocks, tb = _norm_rope_blocks(n_tok, n_heads, rpg)
    if rpg == 1:
        return "", blocks, tb, 1, 16 * tb * (n_dims // 2)
    return "_wide", blocks, tb, rpg, 16 * tb * (n_dims // 2) + 4 * tb


def norm_rope_steps(lw: Lowering, n: Node, xi: int, x: Any, w: Any, pos: Any, y: Any, p: dict) -> list:
    """y = rope(rms_norm(x) * w), x being n's input xi (read in place through its strides)."""
    n_tok, n_heads, head_dim = x.shape
    if _fused_norm_rope(w, head_dim):  # one kernel: a lane group per head row
        wide, blocks, tb, rpg, shared = _norm_rope_geometry(n_tok, n_heads, head_dim, p["n_dims"])
        args = (x, w, pos, _inv_freq(lw, p), y, i32(n_tok), i32(n_heads), i32(head_dim), i32(p["n_dims"]),
                i32(p["mode"] == "neox"), np.float64(p["freq_scale"]), f32(p["eps"]),
                *_head_strides(x, input_strides(lw, n, xi)), i32(tb)) + ((i32(rpg),) if wide else ())
        return [Launch("rope.cu", f"rms_norm_mul_rope{wide}_f32", blocks, NORM_ROPE_THREADS, args, shared=shared)]
    x, steps = contiguous_input(lw, n, xi, x)  # the unfused kernels read contiguous rows
    if _is_row_weight(w, x.shape[-1]):
        steps += [rms_norm_launch(x, w, y, p["eps"])]
    else:
        normed = lw.scratch(x.shape)
        steps += [rms_norm_launch(x, None, normed, p["eps"]), binary_launch("mul", normed, w, y)]
    return steps + [rope_launch(lw, y, pos, y, p)]  # in place: each thread reads its pair, then writes it


def _rope_set_rows(lw, n, ins, outs, p):
    cache, x, pos, rows = ins[0], dev(ins[1]), ins[2], ins[3]
    n_tok, n_heads, head_dim = x.shape
    cap = cache.shape[0]
    code = lw.code_arg(f"rope_set_rows: row index out of range 0..{cap - 1} (got {{value}}; the KV capacity)")
    args = (cache, x, pos, rows, _inv_freq(lw, p), i32(n_tok), i32(n_heads), i32(head_dim), i32(p["n_dims"]),
            i32(p["mode"] == "neox"), np.float64(p["freq_scale"]), i32(cap), lw.errflag, code,
            *_head_strides(x, input_strides(lw, n, 1)))
    work = n_tok * n_heads * (p["n_dims"] // 2 + head_dim - p["n_dims"])  # a thread per pair or pass-through column
    return [Launch("rope.cu", f"rope_set_rows_{tname(cache)}", grid_for(work), BLOCK, args)]


def _rms_norm_mul_rope_set_rows(lw, n, ins, outs, p):
    cache, x, w, pos, rows = ins[0], dev(ins[1]), dev(ins[2]), ins[3], ins[4]
    n_tok, n_heads, head_dim = x.shape
    cap = cache.shape[0]
    if not _fused_norm_rope(w, head_dim):  # the unfused rules, through scratch
        roped = lw.scratch(x.shape)
        steps = norm_rope_steps(lw, n, 1, x, w, pos, roped, p)
        return steps + set_rows_steps(lw, cache, roped, rows, contiguous_strides(roped.shape))
    code = lw.code_arg(f"rms_norm_mul_rope_set_rows: row index out of range 0..{cap - 1} (got {{value}}; "
                       "the KV capacity)")
    wide, blocks, tb, rpg, shared = _norm_rope_geometry(n_tok, n_heads, head_dim, p["n_dims"])
    args = (cache, x, w, pos, rows, _inv_freq(lw, p), i32(n_tok), i32(n_heads), i32(head_dim), i32(p["n_dims"]),
            i32(p["mode"] == "neox"), np.float64(p["freq_scale"]), f32(p["eps"]), i32(cap), lw.errflag, code,
            *_head_strides(x, input_strides(lw, n, 1)), i32(tb)) + ((i32(rpg),) if wide else ())
    return [Launch("rope.cu", f"rms_norm_mul_rope_set_rows{wide}_{tname(cache)}", blocks, NORM_ROPE_THREADS, args,
                   shared=shared)]


# ---------------------------------------------------------------- q, k and v of a layer in one launch
# (q kernel, K cache kernel, V cache kernel) -> the rope.cu kernel running the three side by side
QKV_KERNELS = {
    (q, f"{k}_{kv}", f"set_rows{vec}_{kv}"): f"{name}_{kv}"
    for kv in ("f32", "f16")
    for vec in ("", "_v4")
    for q, k, name in (("rms_norm_mul_rope_f32", "rms_norm_mul_rope_set_rows", "qkv_norm_rope"),
                       ("rope_f32", "rope_set_rows", "qkv_rope"))
}


def merge_kv_writes(node_steps: list[tuple[Node, list]]) -> list:
    """The Program's steps, with each attention layer's q rope, K cache write and V cache write (three
    nodes in a row, one kernel each) as one launch of rope.cu's qkv_* kernel: three launch-to-launch
    gaps become one. The three must not read anything another of them writes (they read one q|k|v
    product and write q, the K cache and the V cache). GRAPHIR_NO_KV_MERGE=1 keeps three launches."""
    if flags.enabled("GRAPHIR_NO_KV_MERGE"):
        return [s for _, steps in node_steps for s in steps]
    out: list = []
    i = 0
    while i < len(node_steps):
        merged = _merged_qkv(node_steps[i:i + 3])
        if merged is not None:
            out.append(merged)
            i += 3
        else:
            out += node_steps[i][1]
            i += 1
    return out


def _merged_qkv(trio: list[tuple[Node, list]]) -> Launch | None:
    if len(trio) < 3 or any(len(steps) != 1 or not isinstance(steps[0], Launch) for _, steps in trio):
        return None
    (q, [lq]), (k, [lk]), (v, [lv]) = trio
    name = QKV_KERNELS.get((lq.name, lk.name, lv.name))
    if name is None or lq.block != lk.block or len(lq.block) != 1 or not _independent([q, k, v]):
        return None
    threads = lq.block[0]
    nv = cdiv(lv.grid[0] * lv.block[0], threads)  # V's grid-stride loop, at least as many threads as its own launch
    v_vec = i32(lv.name.startswith("set_rows_v4"))  # V's 16-byte body
    merged = Launch("rope.cu", name, lq.grid[0] + lk.grid[0] + nv, threads,
                    lq.args + lk.args + lv.args + (i32(lq.grid[0]), i32(lk.grid[0]), v_vec),
                    shared=max(lq.shared, lk.shared))
    merged.parts = (lq.name, lk.name, lv.name)
    return merged


def _independent(nodes: list[Node]) -> bool:
    """No node of `nodes` reads (through views) another's result or the State another writes."""
    ids = {id(n) for n in nodes}
    writers = [n for n in nodes if OPS[n.op].writes]
    written = {id(n.src[0]) for n in writers}
    if len(written) < len(writers):  # two of them write one State
        return False
    for n in nodes:
        stack = list(n.src)
        while stack:
            x = stack.pop()
            if id(x) in ids or (id(x) in written and not (OPS[n.op].writes and x is n.src[0])):
                return False
            if OPS[x.op].view:
                stack += x.src
    return True


# ---------------------------------------------------------------- data movement
def _view_copy(lw, n, ins, outs, p):
    lw.shared[("gathered", id(n))] = True  # its readers get it contiguous (input_strides)
    return [copy_launch(dev(ins[0]), outs[0], view_layout(n), f"{n.op} gather")]


def _copy(lw, n, ins, outs, p):
    """cont and cast: one element-wise copy, converting when the dtypes differ."""
    return [copy_launch(dev(ins[0]), outs[0], what=n.op)]


def _assign(lw, n, ins, outs, p):
    return [copy_launch(dev(ins[1]), ins[0], what="assign")]


def _concat(lw, n, ins, outs, p):
    a, b, y = dev(ins[0]), dev(ins[1]), outs[0]
    axis = p["axis"] % a.ndim
    inner = math.prod(a.shape[axis + 1:])
    kernel = "concat_b2" if a.dtype.itemsize == 2 else "concat_b4"
    args = (a, b, y, np.int64(y.size), i32(a.shape[axis]), i32(b.shape[axis]), i32(inner))
    return [Launch("copy.cu", kernel, grid_for(y.size), BLOCK, args)]  # lower_node skips empty results


def _one_rank(n: Node) -> bool:
    """Whether n is one rank's part of a collective (one source, several ranks): NCCL's to run."""
    return len(n.src) == 1 and n.params["ranks"] > 1


def _all_reduce(lw, n, ins, outs, p):
    """One rank's part: NCCL (nccl.py). Simulated ranks in one Program: the sum of the rank sources,
    in rank order (as the reference)."""
    xs, y = [dev(x) for x in ins], outs[0]
    if _one_rank(n):
        return nccl.all_reduce(n, xs[0], y, lw)
    if len(xs) == 1:
        return [copy_launch(xs[0], y, what="all_reduce of one rank")]
    return [binary_launch("add", xs[0], xs[1], y)] + [binary_launch("add", y, x, y) for x in xs[2:]]


def _all_gather(lw, n, ins, outs, p):
    """One rank's part: NCCL gathers every rank's piece (straight into y when the pieces are y's flat
    parts, else into scratch [ranks, *piece], joined below). Simulated ranks: the rank pieces joined
    along `axis`, pairwise through scratch."""
    xs, y = [dev(x) for x in ins], outs[0]
    axis = p["axis"] % y.ndim
    if _one_rank(n):
        if nccl.gather_is_flat(xs[0].shape, axis):
            return nccl.all_gather_flat(n, xs[0], y.reshape((p["ranks"],) + xs[0].shape))
        pieces = lw.scratch((p["ranks"],) + xs[0].shape, y.dtype)
        return nccl.all_gather_flat(n, xs[0], pieces) + _join(lw, n, list(pieces), y, axis)
    if len(xs) == 1:
        return [copy_launch(xs[0], y, what="all_gather of one rank")]
    return _join(lw, n, xs, y, axis)


def _join(lw: Lowering, n: Node, xs: list, y: Any, axis: int) -> list:
    """y = xs joined along axis, pairwise through scratch (concat kernels)."""
    steps, acc = [], xs[0]
    for i, x in enumerate(xs[1:], start=2):
        shape = acc.shape[:axis] + (acc.shape[axis] + x.shape[axis],) + acc.shape[axis + 1:]
        out = y if i == len(xs) else lw.scratch(shape, y.dtype)
        steps += _concat(lw, n, [acc, x], [out], {"axis": axis})
        acc = out
    return steps


def _set_rows(lw, n, ins, outs, p):
    return set_rows_steps(lw, ins[0], dev(ins[1]), ins[2], input_strides(lw, n, 1))


def set_rows_steps(lw: Lowering, dst: Any, src: Any, rows: Any, strides: tuple[int, ...]) -> list:
    """dst[rows[t]] = src[t], src read through `strides` (row-strided: V in place in a stacked q|k|v
    product); its outer axes are collapsed to two for the kernel."""
    if not src.size:
        return []
    cap = dst.shape[0]
    row = dst.size // cap if cap else 0
    inner = src.shape[-1] if src.ndim > 1 else src.size
    dims, outer = collapse(src.shape[:-1], strides[:-1], 2, "set_rows src") if src.ndim > 1 else ([1, 1], [0, 0])
    code = lw.code_arg(f"set_rows: row index out of range 0..{cap - 1} (got {{value}})")
    args = (dst, src, rows, i32(src.shape[0]), np.int64(row), i32(cap), lw.errflag, code, i32(inner), i32(dims[1]),
            np.int64(outer[0]), np.int64(outer[1]))
    if inner % 4 == 0 and outer[0] % 4 == 0 and outer[1] % 4 == 0 and src.data.ptr % 16 == 0 and dst.data.ptr % 16 == 0:
        return [Launch("rope.cu", f"set_rows_v4_{tname(dst)}", grid_for(src.size // 4), BLOCK, args)]
    return [Launch("rope.cu", f"set_rows_{tname(dst)}", grid_for(src.size), BLOCK, args)]


RULES: dict[str, Callable] = {
    **{op: _binary(op) for op in ("add", "sub", "mul", "div")},
    **{op: _unary(op) for op in ("neg", "exp", "silu", "gelu", "sigmoid", "softplus")},
    "scale": _scale,
    "swiglu_split": _swiglu_split,
    "mul_sigmoid": _mul_sigmoid,
    "rms_norm": _rms_norm,
    "l2_norm": _row_norm("l2_norm_f32"),
    "norm": _row_norm("layer_norm_f32"),
    "add_rms_norm_mul": _add_rms_norm_mul,
    "rms_norm_mul_gate": _rms_norm_mul_gate,
    "rms_norm_mul_rope": _rms_norm_mul_rope,
    "sum_rows": _reduce_rows(False),
    "mean": _reduce_rows(True),
    "argmax": _argmax,
    "top_k": _top_k,
    "sample": _sample,
    "softmax": _softmax,
    "rope": _rope,
    "rope_set_rows": _rope_set_rows,
    "rms_norm_mul_rope_set_rows": _rms_norm_mul_rope_set_rows,
    "view": _view_copy,
    "reshape": _view_copy,
    "permute": _view_copy,
    "transpose": _view_copy,
    "cont": _copy,
    "cast": _copy,
    "concat": _concat,
    "set_rows": _set_rows,
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "assign": _assign,
    "mul_mat": matmul.lower_mul_mat,
    "mul_mat_bf16": matmul.lower_mul_mat_bf16,
    "mul_mat_bf16_rounded": matmul.lower_mul_mat_bf16_rounded,
    "mul_mat_swiglu": matmul.lower_mul_mat_swiglu,
    "mul_mat_q8x": lower_mul_mat_q8x,
    "mul_mat_q16x": lower_mul_mat_q16x,
    "get_rows": matmul.lower_get_rows,
    "flash_attn": attention.lower_flash_attn,
    "flash_attn_bf16": attention.lower_flash_attn_bf16,
    "ssm_conv": recurrent.lower_ssm_conv,
    "ssm_conv_silu": recurrent.lower_ssm_conv_silu,
    "gated_delta_net": recurrent.lower_gated_delta_net,
    "gated_delta_net_raw": recurrent.lower_gated_delta_net_raw,
}

# Inputs a rule takes as f16 (numpy float16 State or activations); every other f16 input is cast to
# f32 scratch first, and an f16 result of any other op is computed in f32 and cast.
F16_INPUTS: dict[str, tuple[int, ...]] = {
    "set_rows": (0,), "rope_set_rows": (0,), "rms_norm_mul_rope_set_rows": (0,), "assign": (0,),
    "flash_attn": (1, 2), "flash_attn_bf16": (1, 2),
    "view": (0,), "reshape": (0,), "permute": (0,), "transpose": (0,), "cont": (0,), "cast": (0,), "concat": (0, 1),
}
# Inputs a rule reads in place as row-strided views, {input index: outer axes its kernel indexes}
# (layout.views_to_copy does not gather them); the rule reads their strides with input_strides.
# Each listed rule is checked at several strides and row counts in tests/test_gpu_strided.py.
ROW_STRIDED_INPUTS: dict[str, dict[int, int]] = {
    "rms_norm_mul_rope": {0: 2}, "rms_norm_mul_rope_set_rows": {1: 2},  # x [n_tok, n_heads, head_dim]
    "rope": {0: 2}, "rope_set_rows": {1: 2},
    "set_rows": {1: 2},  # src [n_tok, ...]: V of a stacked q|k|v product
    "mul_sigmoid": {1: 2},  # the gate b, up to 2 collapsed outer axes
    "swiglu_split": {0: 1, 1: 1},  # gate and up columns of a stacked gate|up product (prefill)
}
F16_OUTPUTS = frozenset({"view", "reshape", "permute", "transpose", "cont", "cast", "concat"})
# ops handled by the Program itself, not by a rule
STRUCTURAL = frozenset({"input", "param", "state", "const", "item"})


def has_rule(op: str) -> bool:
    return op in RULES or op in STRUCTURAL


def lower_node(lw: Lowering, n: Node, ins: list, outs: list | None) -> list:
    """The node's steps, with f16 inputs and outputs converted around rules that work in f32."""
    rule = RULES.get(n.op)
    if outs is not None and all(o.size == 0 for o in outs):
        return []  # an empty result: nothing to compute
    if rule is None:
        raise BackendError(f"gpu backend: no lowering for op {n.op!r} (node {n.describe()})")
    pre, post = [], []
    ok16 = F16_INPUTS.get(n.op, ())
    ins = list(ins)
    for i, x in enumerate(ins):
        if i not in ok16 and getattr(x, "dtype", None) == np.float16:
            tmp = lw.scratch(x.shape, np.float32)
            pre.append(copy_launch(x, tmp, what="f16 input"))
            ins[i] = tmp
    if outs is not None and n.op not in F16_OUTPUTS:
        outs = list(outs)
        for k, o in enumerate(outs):
            if o.dtype == np.float16:
                tmp = lw.scratch(o.shape, np.float32)
                post.append(copy_launch(tmp, o, what="f16 result"))
                outs[k] = tmp
    return pre + rule(lw, n, ins, outs, n.params.as_dict()) + post


__all__ = ["RULES", "lower_node", "has_rule", "merge_kv_writes"]
