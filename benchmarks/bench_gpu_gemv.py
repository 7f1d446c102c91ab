"""Benchmark the gpu backend's decode GEMV (m = 1) against device copy bandwidth.

    python benchmarks/bench_gpu_gemv.py [--quick] [--iters N]
    python benchmarks/bench_gpu_gemv.py --variants [--formats bf16,q8_0] [--shapes 4096x4096,...]
    python benchmarks/bench_gpu_gemv.py --gemvm [--tokens 16,8] [--cfgs g128r2,j4w8r2] [--models qwen,smollm]
    python benchmarks/bench_gpu_gemv.py --q8x [--formats q4_0,q8_0] [--cfgs w4r4,w8r4] [--shapes 4096x4096,...]
    python benchmarks/bench_gpu_gemv.py --tc [--shapes 4096x4096,...]

Formats bf16, q8_0, q4_k, q4_0 at Qwen3-8B shapes (n_out x n_in): 4096x4096 (q/o), 12288x4096
(gate/up), 4096x12288 (down), 151936x4096 (LM head). Bandwidth counts the weight's stored bytes
(quantized blocks) plus x and y. Goals on one H200: bf16 >= 90% of copy bandwidth, q8_0 and
q4_k >= 80%.

Method: the copy bandwidth is a device-to-device copy of 1 GiB (read + write counted). Each
GEMV is lowered by the backend's rule (backends/gpu/matmul.py lower_mul_mat) on device buffers;
weights smaller than 256 MiB are uploaded several times and the calls rotate over the copies, so
nothing is served from the 50 MB L2 (each matrix is read once per token in a real decode). The
calls are captured into a CUDA graph (as a decode step is) and timed with CUDA events after a
warm-up (a cold GPU runs at low clocks); without graph capture they run from a Python loop.
The first rows of every result are checked against numpy.

--variants times every m == 1 kernel (gemv1_<fmt>, each gemv1v2_<fmt>_<cfg> of matmul.py
GEMV1_CONFIGS and, for q8_0 / q4_0 / q4_k, each gemv1v3_<fmt>_<cfg> of GEMV1_V3) on the same
device buffers, checks every output row against the weight dequantized on the device
(dequant_<fmt>) times x, and ends with a table of % of copy bandwidth per variant, the best marked,
next to the current GEMV1_KERNEL choice.

--gemvm times the 2..16-token float GEMVs of a speculative verify call (gemvm<M>_<fmt>_<cfg>, and
gemvmsw<M> for the stacked gate|up weight) for every geometry of matmul.py GEMVM_CONFIGS, at the
shapes of Qwen3-0.6B (bf16) and SmolLM2-135M (f32), 16 and 8 tokens: us per call, effective TFLOP/s
(2 m n_out n_in / t) and the weight read at copy bandwidth (the floor); each result checked against
cuBLAS's f32 product within 1e-5 of sum |x||w| (silu's derivatives carried for gemvmsw), and marked
"=" where it equals g128r2's bit for bit. It ends with each geometry's GEMV time of one verify call
(layers x the four projections + the LM head), the best per shape, and GEMVM_KERNEL = "auto"'s.

--q8x times mul_mat_q8x's kernels (backends/gpu/gemv_q8x.cu: x rounded to 8-bit blocks, dp4a; the
q8-activations pass) for every geometry of gemv_q8x.py Q8X_CONFIGS against the current f32 m == 1 kernel
(GEMV1_KERNEL's) on the same rotated weights: a table of % of copy bandwidth, the best geometry marked, the
current Q8X_KERNEL choice bracketed. Each q8x result's first and last rows are checked against the op's
reference (within the f32 bound of tests/test_gpu_gemv_q8x.py) and every geometry against the first bit for bit
(they add the same terms in the same order); the f32 kernel's against the dequantized product.

--tc times q4_0's m == 1 GEMV on tensor cores (backends/gpu/gemv_tc.py, each geometry of GEOMETRIES) against its
f32 kernel, through mul_mat's lowering (the repacking happens outside the timing) as the plain mode does, each
result checked against numpy within 1e-5 of sum |x||w|.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import replay_seconds  # noqa: E402  (beside this script)

from graphir.bench import measure_device_bandwidth  # noqa: E402

SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288), (151936, 4096)]
FORMATS = ["bf16", "q8_0", "q4_k", "q4_0"]
GOALS = {"bf16": 0.90, "q8_0": 0.80, "q4_k": 0.80}
ROTATE_BYTES = 256 << 20
CHECK_ROWS = 64


def make_raw(rng: np.random.Generator, fmt: str, shape: tuple[int, int]) -> np.ndarray:
    from graphir.quant import random_quantized

    if fmt == "bf16":  # random bits of finite bf16 values, without an f32 temporary of the whole matrix
        bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        return (bits & np.uint16(0x3FFF)) | (bits & np.uint16(0x8000))  # |v| < 2, finite
    return random_quantized(rng, fmt, shape)


def device_copies(cp, rng: np.random.Generator, fmt: str, shape: tuple[int, int]) -> tuple[np.ndarray, int, list]:
    """A random `fmt` weight: its host bytes, its row bytes, and enough device copies of it to rotate through
    (ROTATE_BYTES in all, so the 50 MB L2 cannot serve a timed call)."""
    from graphir.backends.gpu.matmul import _row_bytes

    raw = make_raw(rng, fmt, shape)
    rb = _row_bytes(fmt, shape[1])
    dev = cp.asarray(raw.view(np.uint8).reshape(shape[0], rb))
    return raw, rb, [dev] + [dev.copy() for _ in range(max(1, math.ceil(ROTATE_BYTES / dev.nbytes)) - 1)]


def time_steps(steps: list, iters: int) -> tuple[float, str]:
    """Seconds per pass over `steps`, replayed from a captured CUDA graph (gpu_timing.py)."""
    def run() -> None:
        for s in steps:
            s()
    return replay_seconds(run, iters)


def bench_one(cp, rng, fmt: str, shape: tuple[int, int], iters: int) -> dict:
    from graphir.backends.gpu.launch import GpuParam, Lowering
    from graphir.backends.gpu.matmul import lower_mul_mat

    from graphir.lowering import ParamRef
    from graphir.quant import dequantize
    from graphir.weights import Weight, Weights

    n_out, n_in = shape
    t0 = time.perf_counter()
    raw = make_raw(rng, fmt, shape)
    wbytes = raw.nbytes
    copies = max(1, math.ceil(ROTATE_BYTES / wbytes))
    weights = Weights({f"w{k}": Weight(fmt, shape, raw) for k in range(copies)})
    lw = Lowering(weights)
    x = cp.asarray(rng.standard_normal((1, n_in)).astype(np.float32))
    ys = [cp.zeros((1, n_out), np.float32) for _ in range(copies)]
    steps = []
    for k in range(copies):
        gp = GpuParam(ParamRef(None, weights, raw, fmt, shape, ("param", f"w{k}")))
        steps += lower_mul_mat(lw, None, [gp, x], [ys[k]], {})
    prep_s = time.perf_counter() - t0
    secs, how = time_steps(steps, max(3, iters // copies))
    per_call = secs / copies
    # check the first rows of every copy's result against numpy
    head = dequantize(raw[:CHECK_ROWS], fmt, (CHECK_ROWS, n_in)).astype(np.float64)
    want = head @ x.get()[0].astype(np.float64)
    for y in ys:
        got = y.get()[0, :CHECK_ROWS]
        tol = 1e-5 * (np.abs(head) @ np.abs(x.get()[0])) + 1e-6
        if not (np.abs(got - want) <= tol).all():
            raise SystemExit(f"{fmt} {shape}: wrong result (max error {np.abs(got - want).max():.3g})")
    del weights, steps, ys, lw
    cp.get_default_memory_pool().free_all_blocks()
    moved = wbytes + n_in * 4 + n_out * 4
    return {"fmt": fmt, "shape": shape, "us": per_call * 1e6, "bps": moved / per_call, "copies": copies,
            "how": how, "prep_s": prep_s}


def bench_variants(cp, rng, fmt: str, shape: tuple[int, int], iters: int) -> dict[str, float]:
    """us per call of every m == 1 variant on one weight (rotated copies); each result checked."""
    from graphir.backends.gpu import kernels
    from graphir.backends.gpu.launch import Launch, cdiv, i32
    from graphir.backends.gpu.matmul import GEMV1_CONFIGS, GEMV1_V3, gemv_kernel

    n_out, n_in = shape
    raw, rb, ws = device_copies(cp, rng, fmt, shape)
    dev, copies = ws[0], len(ws)
    x = cp.asarray(rng.standard_normal((1, n_in)).astype(np.float32))
    # reference: the weight dequantized on the device (dequant_<fmt>, bit-exact to graphir.quant)
    wf = cp.empty((n_out, n_in), np.float32)
    kernels.get("matmul.cu", f"dequant_{fmt}")((min(cdiv(n_out * n_in // 8, 256), 1 << 20),), (256,),
                                                (dev, np.int64(rb), wf, i32(n_out), i32(n_in)))
    want = (wf @ x[0]).astype(np.float64)
    bound = (cp.abs(wf) @ cp.abs(x[0])).astype(np.float64) * 1e-5 + 1e-6
    del wf
    ys = [cp.zeros((1, n_out), np.float32) for _ in range(copies)]
    out = {}
    for var in ["gemv1", *GEMV1_CONFIGS, *GEMV1_V3]:
        name, threads, rows = gemv_kernel(fmt, n_out, n_in, 1, dev.data.ptr, var)
        if var != "gemv1" and not name.startswith("gemv1v"):
            continue  # this shape falls back to gemv1
        steps = [Launch("matmul.cu", name, cdiv(n_out, rows), threads,
                        (w, np.int64(rb), x, y, i32(n_out), i32(n_in), i32(1))) for w, y in zip(ws, ys)]
        for y in ys:
            y.fill(np.nan)
        secs, _ = time_steps(steps, max(3, iters // copies))
        for y in ys:
            err = cp.abs(y[0].astype(np.float64) - want)
            if not bool((err <= bound).all()):
                print(f"  {name} {shape}: WRONG (max error {float(err.max()):.3g}, "
                      f"{int((err > bound).sum())} rows out of bound)", flush=True)
                secs = float("nan")
                break
        out[var] = secs / copies * 1e6
    del ws, ys, dev
    cp.get_default_memory_pool().free_all_blocks()
    return out


def main_variants(cp, rng, args, bw: float) -> None:
    from graphir.backends.gpu.matmul import GEMV1_CONFIGS, GEMV1_KERNEL, GEMV1_V3, _row_bytes, short_float_rows

    shapes = ([tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")] if args.shapes else SHAPES)
    fmts = args.formats.split(",")
    iters = args.iters or 100
    variants = ["gemv1", *GEMV1_CONFIGS, *GEMV1_V3]
    rows = []
    for fmt in fmts:
        for shape in shapes:
            t0 = time.perf_counter()
            us = bench_variants(cp, rng, fmt, shape, iters)
            moved = shape[0] * _row_bytes(fmt, shape[1]) + 4 * (shape[0] + shape[1])
            pct = {v: 100 * moved / (t * 1e-6) / bw for v, t in us.items()}
            rows.append((fmt, shape, us, pct))
            print(f"  {fmt} {shape[0]}x{shape[1]}: " + ", ".join(f"{v} {t:.2f}us" for v, t in us.items())
                  + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"\n% of copy bandwidth ({bw / 1e12:.3f} TB/s), m = 1; * = best, [ ] = current choice")
    print(f"{'format':7} {'shape':>13} " + " ".join(f"{v:>9}" for v in variants))
    for fmt, shape, _us, pct in rows:
        best = max((v for v in pct if pct[v] == pct[v]), key=lambda v: pct[v], default=None)
        cur = short_float_rows(fmt, shape[0], _row_bytes(fmt, shape[1])) or GEMV1_KERNEL.get(fmt, "gemv1")
        cells = []
        for v in variants:
            if v not in pct:
                cells.append(f"{'-':>9}")
                continue
            mark = ("*" if v == best else "") + ("[]" if v == cur else "")
            cells.append(f"{pct[v]:6.1f}{mark:<3}")
        print(f"{fmt:7} {shape[0]:>6}x{shape[1]:<6} " + " ".join(cells))


# --gemvm: (model, weight format, layers, [(name, rows, n_in, fused swiglu)]); the LM head runs once a call
GEMVM_MODELS = {
    "qwen": ("Qwen3-0.6B", "bf16", 28, [("q|k|v", 4096, 1024, False), ("o", 1024, 2048, False),
                                        ("gate|up", 6144, 1024, True), ("down", 1024, 3072, False),
                                        ("lm head", 151936, 1024, False)]),
    "smollm": ("SmolLM2-135M", "f32", 30, [("q|k|v", 960, 576, False), ("o", 576, 576, False),
                                           ("gate|up", 3072, 576, True), ("down", 576, 1536, False),
                                           ("lm head", 49152, 576, False)]),
}


def bench_gemvm_shape(cp, rng, fmt: str, rows: int, n_in: int, sw: bool, m: int, cfgs: list[str],
                      iters: int) -> dict[str, tuple[float, bool]]:
    """{cfg: (us per call, bitwise equal to g128r2)} of gemvm<m> (gemvmsw<m> where sw: rows / 2 outputs)
    on one [rows, n_in] weight in rotated copies; every output checked against cuBLAS's f32 product."""
    from graphir.backends.gpu.launch import Launch, cdiv, i32
    from graphir.backends.gpu.matmul import GEMVM_CONFIGS, _row_bytes, gemvm_block_tokens, token_blocks

    # normal weights (bf16: the f32 values' top halves), generated on the device: make_raw's random bf16 bits
    # span 2^-127..2 and make nearly every sum independent of the order its terms are added in
    rb = _row_bytes(fmt, n_in)
    normal = cp.random.standard_normal((rows, n_in), dtype=np.float32)
    dev = (normal.view(np.uint32) >> 16).astype(np.uint16) if fmt == "bf16" else normal
    dev = dev.view(np.uint8).reshape(rows, rb)
    del normal
    copies = max(1, math.ceil(ROTATE_BYTES / dev.nbytes))
    ws = [dev] + [dev.copy() for _ in range(copies - 1)]
    x = cp.asarray(rng.standard_normal((m, n_in)).astype(np.float32))
    wf = (dev.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if fmt == "bf16" else dev.view(np.float32)
    prod = (x @ wf.T).astype(cp.float64)  # cuBLAS f32: within ~1e-6 of sum |x||w|
    bound = (cp.abs(x) @ cp.abs(wf).T).astype(cp.float64) * 1e-5 + 1e-6
    del wf
    n_out = rows // 2 if sw else rows
    if sw:  # silu(g) * u, its error from g's and u's as tests/test_gpu_matmul.py _check_swiglu carries it
        g, u, bg, bu = prod[:, :n_out], prod[:, n_out:], bound[:, :n_out], bound[:, n_out:]
        sig = 1 / (1 + cp.exp(-g))
        want, bound = g * sig * u, cp.abs(sig * (1 + g * (1 - sig)) * u) * bg + cp.abs(g * sig) * bu + 1e-6
    else:
        want = prod
    ys = [cp.zeros((m, n_out), np.float32) for _ in range(copies)]
    out: dict[str, tuple[float, bool]] = {}
    first: dict[str, np.ndarray] = {}
    tokens = gemvm_block_tokens(m)  # a block's, as the verify call runs them
    for cfg in cfgs:
        threads, per_block = GEMVM_CONFIGS[cfg]
        per_block = per_block // 2 if sw else per_block
        name = f"gemvm{'sw' if sw else ''}{tokens}_{fmt}_{cfg}"
        steps = [Launch("matmul.cu", name, cdiv(n_out, per_block) * token_blocks(name, m), threads,
                        (w, np.int64(rb), x, y, i32(n_out), i32(n_in), i32(m))) for w, y in zip(ws, ys)]
        for y in ys:
            y.fill(np.nan)
        secs, _ = time_steps(steps, max(3, iters // copies))
        for y in ys:
            err = cp.abs(y.astype(np.float64) - want)
            if not bool((err <= bound).all()):
                print(f"  {name} {rows}x{n_in}: WRONG (max error {float(err.max()):.3g}, "
                      f"{int((err > bound).sum())} outputs out of bound)", flush=True)
                secs = float("nan")
                break
        first[cfg] = ys[0].get()
        out[cfg] = (secs / copies * 1e6, cfg != "g128r2" and "g128r2" in first
                    and np.array_equal(first[cfg], first["g128r2"]))
    del ws, ys, dev, x, prod, bound, want
    cp.get_default_memory_pool().free_all_blocks()
    return out


def main_gemvm(cp, rng, args, bw: float) -> None:
    from graphir.backends.gpu.matmul import GEMVM_CONFIGS, GEMVM_KERNEL, _row_bytes, gemvm_auto

    cfgs = args.cfgs.split(",") if args.cfgs else list(GEMVM_CONFIGS)
    if "g128r2" in cfgs:  # first: the others are compared with it bit for bit
        cfgs = ["g128r2"] + [c for c in cfgs if c != "g128r2"]
    tokens = [int(t) for t in args.tokens.split(",")]
    iters = args.iters or 200
    print(f"GEMVM_KERNEL = {GEMVM_KERNEL!r}; us per call, effective TFLOP/s; '=' equals g128r2 bit for bit; "
          "* best; floor: the weight at copy bandwidth")
    head = " ".join(f"{c:>16}" for c in cfgs)
    for key in args.models.split(","):
        model, fmt, layers, shapes = GEMVM_MODELS[key]
        for m in tokens:
            print(f"\n{model} ({fmt}, {layers} layers), {m} tokens")
            print(f"{'weight':9} {'rows x n_in':>13} {'floor':>7} {head}")
            per_call = dict.fromkeys([*cfgs, "best", "auto"], 0.0)
            for name, rows, n_in, sw in shapes:
                res = bench_gemvm_shape(cp, rng, fmt, rows, n_in, sw, m, cfgs, iters)
                flop = 2 * m * rows * n_in
                floor = rows * _row_bytes(fmt, n_in) / bw * 1e6
                best = min((c for c in cfgs if res[c][0] == res[c][0]), key=lambda c: res[c][0], default=None)
                cells = [f"{res[c][0]:7.2f} {flop / res[c][0] / 1e6:5.1f}{'=' if res[c][1] else ' '}"
                         f"{'*' if c == best else ' '}" for c in cfgs]
                print(f"{name:9} {rows:>6}x{n_in:<6} {floor:7.2f} " + " ".join(f"{c:>16}" for c in cells), flush=True)
                count = 1 if name == "lm head" else layers
                for c in cfgs:
                    per_call[c] += count * res[c][0]
                if best:
                    per_call["best"] += count * res[best][0]
                auto = gemvm_auto(rows, 1 << (m - 1).bit_length())
                per_call["auto"] += count * res[auto][0] if auto in res else float("nan")
            print(f"{'per call':9} {'':13} {'':7} " + " ".join(f"{per_call[c]:>14.0f}us" for c in cfgs)
                  + f"   best per shape {per_call['best']:.0f}us, auto {per_call['auto']:.0f}us")



def bench_q8x(cp, rng, fmt: str, shape: tuple[int, int], cfgs: list[str], iters: int) -> dict[str, float]:
    """us per call of the f32 m == 1 GEMV ("f32") and of each mul_mat_q8x geometry on one weight (rotated
    copies); every result checked (a wrong one is reported and timed as nan)."""
    from graphir.backends.gpu.gemv_q8x import Q8X_CONFIGS
    from graphir.backends.gpu.launch import Launch, cdiv, i32
    from graphir.backends.gpu.matmul import gemv_kernel

    from graphir.ops import OPS
    from graphir.quant import dequantize

    n_out, n_in = shape
    raw, rb, ws = device_copies(cp, rng, fmt, shape)
    dev, copies = ws[0], len(ws)
    xh = rng.standard_normal((1, n_in)).astype(np.float32)
    x = cp.asarray(xh)
    rows = np.r_[0:CHECK_ROWS, n_out - CHECK_ROWS:n_out] if n_out > 2 * CHECK_ROWS else np.arange(n_out)
    wf = dequantize(raw[rows], fmt, (len(rows), n_in)).astype(np.float64)
    mag = np.abs(wf) @ np.abs(xh[0]).astype(np.float64)
    checks = {"f32": (wf @ xh[0].astype(np.float64), 1e-5 * mag + 1e-6),  # as bench_variants
              "q8x": (OPS["mul_mat_q8x"].ref(wf.astype(np.float32), xh)[0], (n_in // 32 + 2) * 2.0 ** -24 * 1.01 * mag)}
    ys = [cp.zeros((1, n_out), np.float32) for _ in range(copies)]
    name, threads, per_block = gemv_kernel(fmt, n_out, n_in, 1, dev.data.ptr)
    kernels = {"f32": ("matmul.cu", name, threads, per_block, (i32(1),))}
    kernels.update({cfg: ("gemv_q8x.cu", f"gemv_q8x_{fmt}_{cfg}", *Q8X_CONFIGS[cfg], ()) for cfg in cfgs})
    out, first = {}, None
    for key, (src, kname, threads, per_block, tail) in kernels.items():
        steps = [Launch(src, kname, cdiv(n_out, per_block), threads,
                        (w, np.int64(rb), x, y, i32(n_out), i32(n_in), *tail)) for w, y in zip(ws, ys)]
        for y in ys:
            y.fill(np.nan)
        secs, _ = time_steps(steps, max(3, iters // copies))
        want, bound = checks["f32" if key == "f32" else "q8x"]
        for y in ys:
            got = y.get()[0]
            err = np.abs(got[rows].astype(np.float64) - want)
            same = key == "f32" or first is None or np.array_equal(got, first)
            if not (err <= bound).all() or not same:
                print(f"  {kname} {shape}: WRONG (max error {err.max():.3g}"
                      f"{'' if same else ', differs from the first geometry'})", flush=True)
                secs = float("nan")
                break
        if key != "f32" and first is None:
            first = ys[0].get()[0]
        out[key] = secs / copies * 1e6
    del ws, ys, dev
    cp.get_default_memory_pool().free_all_blocks()
    return out


def main_q8x(cp, rng, args, bw: float) -> None:
    from graphir.backends.gpu.gemv_q8x import Q8X_CONFIGS, Q8X_KERNEL
    from graphir.backends.gpu.matmul import _row_bytes

    shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")] if args.shapes else SHAPES
    cfgs = args.cfgs.split(",") if args.cfgs else list(Q8X_CONFIGS)
    fmts = args.formats.split(",") if args.formats != ",".join(FORMATS) else ["q4_0", "q8_0"]
    print(f"% of copy bandwidth ({bw / 1e12:.3f} TB/s), m = 1; f32: the current f32 kernel (GEMV1_KERNEL); "
          "* = best q8x, [ ] = Q8X_KERNEL")
    print(f"{'format':7} {'shape':>13} {'f32':>7} " + " ".join(f"{c:>9}" for c in cfgs))
    for fmt in fmts:
        for shape in shapes:
            us = bench_q8x(cp, rng, fmt, shape, cfgs, args.iters or 100)
            moved = shape[0] * _row_bytes(fmt, shape[1]) + 4 * (shape[0] + shape[1])
            pct = {k: 100 * moved / (t * 1e-6) / bw for k, t in us.items()}
            best = max((c for c in cfgs if pct[c] == pct[c]), key=lambda c: pct[c], default=None)
            cells = [f"{pct[c]:6.1f}{('*' if c == best else '') + ('[]' if c == Q8X_KERNEL[fmt] else ''):<3}"
                     for c in cfgs]
            print(f"{fmt:7} {shape[0]:>6}x{shape[1]:<6} {pct['f32']:7.1f} " + " ".join(cells), flush=True)


def main_tc(cp, rng, args, bw: float) -> None:
    """q4_0 at m == 1: the f32 kernel (TC_FALLBACK) against each tensor-core geometry (gemv_tc.GEOMETRIES), through
    mul_mat's own lowering on rotated copies, each result checked against numpy (bench_one)."""
    from graphir.backends.gpu import gemv_tc
    from graphir.backends.gpu import matmul as mm

    shapes = ([tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")] if args.shapes else SHAPES)
    iters = args.iters or 100
    choices = [("f32 " + mm.TC_FALLBACK, mm.TC_FALLBACK, None)] + [(f"tc {c}", "tc", c)
                                                                     for c in [*gemv_tc.GEOMETRIES, "auto"]]
    table = {}
    for label, kernel, geometry in choices:
        mm.GEMV1_KERNEL["q4_0"] = kernel
        if geometry:
            gemv_tc.GEOMETRY = geometry
        for shape in shapes:
            table[label, shape] = 100 * bench_one(cp, rng, "q4_0", shape, iters)["bps"] / bw
    print(f"\nq4_0, m = 1: % of copy bandwidth ({bw / 1e12:.3f} TB/s)")
    print(f"{'kernel':12} " + " ".join(f"{f'{r}x{c}':>12}" for r, c in shapes))
    for label, _, _ in choices:
        print(f"{label:12} " + " ".join(f"{table[label, sh]:12.1f}" for sh in shapes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, fewer iterations")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case (default 200, quick 50)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--variants", action="store_true", help="time every m == 1 kernel variant, checked")
    ap.add_argument("--shapes", default=None, help="with --variants or --q8x: e.g. 4096x4096,12288x4096")
    ap.add_argument("--gemvm", action="store_true", help="time the 2..16-token float GEMV geometries, checked")
    ap.add_argument("--tokens", default="16,8", help="with --gemvm: tokens a call")
    ap.add_argument("--cfgs", default=None, help="with --gemvm: GEMVM_CONFIGS keys; with --q8x: Q8X_CONFIGS keys "
                                                 "(default all)")
    ap.add_argument("--tc", action="store_true", help="time q4_0's tensor-core geometries against its f32 kernel, "
                                                      "checked")
    ap.add_argument("--q8x", action="store_true", help="time mul_mat_q8x's geometries against the f32 GEMV, checked")
    ap.add_argument("--models", default=",".join(GEMVM_MODELS), help="with --gemvm: " + ", ".join(GEMVM_MODELS))
    ap.add_argument("--defines", default="", help="-D options matmul.cu and gemv_q8x.cu are compiled with, ',' "
                    "between them (e.g. GEMV3_MIN_BLOCKS=6): a kernel variant timed as the shipped one")
    args = ap.parse_args()
    from graphir.backends.gpu import kernels
    from graphir.backends.gpu.device import available, cupy

    if args.defines:
        extra = tuple(args.defines.split(","))
        kernels.SOURCES.update({k: v + extra for k, v in kernels.SOURCES.items()
                                if k in ("matmul.cu", "gemv_q8x.cu", "gemv_tc.cu")})
        print(f"kernels compiled with -D{' -D'.join(extra)}")

    if not available():
        raise SystemExit("no CUDA/HIP device: this benchmark needs a GPU")
    cp = cupy()
    iters = args.iters or (50 if args.quick else 200)
    shapes = SHAPES[:2] if args.quick else SHAPES
    rng = np.random.default_rng(0)
    bw = measure_device_bandwidth()
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"copy bandwidth (1 GiB d2d, read + write): {bw / 1e12:.3f} TB/s\n")
    if args.variants:
        main_variants(cp, rng, args, bw)
        return
    if args.gemvm:
        main_gemvm(cp, rng, args, bw)
        return
    if args.q8x:
        main_q8x(cp, rng, args, bw)
        return
    if args.tc:
        main_tc(cp, rng, args, bw)
        return
    rows = []
    print(f"{'format':7} {'shape':>13} {'us/call':>9} {'GB/s':>8} {'% copy':>7}  notes")
    for fmt in args.formats.split(","):
        for shape in shapes:
            r = bench_one(cp, rng, fmt, shape, iters)
            rows.append(r)
            pct = 100 * r["bps"] / bw
            print(f"{fmt:7} {shape[0]:>6}x{shape[1]:<6} {r['us']:9.2f} {r['bps'] / 1e9:8.0f} {pct:6.1f}%"
                  f"  {r['how']}, {r['copies']} cop{'y' if r['copies'] == 1 else 'ies'}", flush=True)
    print("\nsummary (bytes-weighted over the shapes: a decode step's mix)")
    for fmt in args.formats.split(","):
        rs = [r for r in rows if r["fmt"] == fmt]
        total_bytes = sum(r["bps"] * r["us"] for r in rs)
        total_us = sum(r["us"] for r in rs)
        frac = total_bytes / total_us / bw
        goal = GOALS.get(fmt)
        verdict = "" if goal is None else f"  goal {goal:.0%}: {'met' if frac >= goal else 'NOT met'}"
        print(f"  {fmt:7} {100 * frac:5.1f}% of copy bandwidth{verdict}")


if __name__ == "__main__":
    main()
