"""Does a decode GEMV read its weight faster when the weight was asked into L2 while DRAM sat idle?

    python benchmarks/bench_gpu_l2_prefetch.py [--iters 200] [--idle-us 0,4,8,12]

The question behind it (issue 10): between a layer's q|k|v GEMV and its o GEMV a decode step runs only small,
latency-bound kernels (norm-rope, attention, its combine: ~10 us a layer on Qwen3-8B) while DRAM is idle. If a
kernel early in that chain asked for the o weight's lines into L2 (`cp.async.bulk.prefetch.L2`, one instruction
per chunk, nothing waits for it), the o GEMV would read L2 instead of DRAM. This probe answers whether that pays
before any kernel of the backend changes: each timed pass is

    [prefetch kernel over the weight copy k]  ->  [an idle kernel of T us, one warp]  ->  [the GEMV on copy k]

against the same pass without the prefetch kernel, replayed from a captured CUDA graph over enough weight copies
that L2 cannot keep any copy from one pass to its next use. The GEMV is the backend's own (mul_mat's lowering:
bf16 gemv1v2, q4_0 on tensor cores). Every GEMV result is checked against numpy. The idle kernel stands in for
the small kernels, so the prefetch has T us to land; T = 0 shows what the prefetch kernel itself costs.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu_gemv import make_raw  # noqa: E402  (beside this script)
from gpu_timing import replay_seconds  # noqa: E402

SOURCE = r"""
extern "C" __global__ void prefetch_l2(const char* p, long long bytes, long long chunk) {
    // every block's thread 0 asks for its share of [p, p + bytes) in chunks (16-byte multiples)
    long long per = ((bytes + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
    long long lo = per * blockIdx.x, hi = min(bytes, lo + per);
    if (threadIdx.x != 0) return;
    for (long long o = lo; o < hi; o += chunk) {
        unsigned n = (unsigned)min(chunk, hi - o);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + o), "r"(n) : "memory");
    }
}
extern "C" __global__ void idle_for(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)ns);
}
"""

SHAPES = {"o 4096x4096": (4096, 4096), "q|k|v 6144x4096": (6144, 4096), "0.6B o 1024x2048": (1024, 2048)}
ROTATE_BYTES = 512 << 20


def bench(cp, rng, fmt: str, shape: tuple[int, int], idle_us: list[float], iters: int, blocks: int,
          chunk: int) -> list[tuple[float, float, float]]:
    from graphir.backends.gpu.launch import GpuParam, Lowering
    from graphir.backends.gpu.matmul import lower_mul_mat

    from graphir.lowering import ParamRef
    from graphir.quant import dequantize
    from graphir.weights import Weight, Weights

    mod = cp.RawModule(code=SOURCE, options=("-std=c++17", "-arch=sm_90"))
    prefetch, idle = mod.get_function("prefetch_l2"), mod.get_function("idle_for")
    n_out, n_in = shape
    raw = make_raw(rng, fmt, shape)
    copies = max(2, math.ceil(ROTATE_BYTES / raw.nbytes))
    weights = Weights({f"w{k}": Weight(fmt, shape, raw) for k in range(copies)})
    lw = Lowering(weights)
    x = cp.asarray(rng.standard_normal((1, n_in)).astype(np.float32))
    ys = [cp.zeros((1, n_out), np.float32) for _ in range(copies)]
    gemvs, regions = [], []
    for k in range(copies):
        gp = GpuParam(ParamRef(None, weights, raw, fmt, shape, ("param", f"w{k}")))
        gemvs.append(lower_mul_mat(lw, None, [gp, x], [ys[k]], {}))
        # what the GEMV reads: the repacked tiles where q4_0 runs on tensor cores, else the stored rows
        tc = gp.derived("q4_0_tc", lambda _: None) if fmt == "q4_0" else None
        regions.append([(a.data.ptr, a.nbytes) for a in tc] if tc else [(gp.raw.data.ptr, gp.raw.nbytes)])
    def per_pass(t_us: float, with_prefetch: bool) -> float:
        def run() -> None:
            for k in range(copies):
                if with_prefetch:
                    for ptr, nb in regions[k]:
                        prefetch((blocks,), (32,), (np.uint64(ptr), np.int64(nb), np.int64(chunk)))
                idle((1,), (32,), (np.int64(int(t_us * 1000)),))
                for s in gemvs[k]:
                    s()
        return replay_seconds(run, max(3, iters // copies))[0] / copies * 1e6

    rows = [(t, per_pass(t, False), per_pass(t, True)) for t in idle_us]
    head = dequantize(raw[:64], fmt, (64, n_in)).astype(np.float64)
    want = head @ x.get()[0].astype(np.float64)
    tol = 1e-5 * (np.abs(head) @ np.abs(x.get()[0])) + 1e-6
    for y in ys:
        if not (np.abs(y.get()[0, :64] - want) <= tol).all():
            raise SystemExit(f"{fmt} {shape}: wrong GEMV result")
    gemvs.clear()
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--idle-us", default="0,4,8,12")
    ap.add_argument("--formats", default="bf16,q4_0")
    ap.add_argument("--blocks", type=int, default=132, help="prefetch kernel blocks")
    ap.add_argument("--chunk", type=int, default=1 << 16, help="bytes per prefetch instruction")
    a = ap.parse_args()
    import cupy as cp

    rng = np.random.default_rng(0)
    idle = [float(v) for v in a.idle_us.split(",")]
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; prefetch {a.blocks} blocks, "
          f"{a.chunk} B an instruction; us per pass (idle kernel + GEMV), best of 3 batches")
    print(f"{'format':6} {'shape':18} {'idle us':>7} {'no prefetch':>12} {'prefetch':>9} {'GEMV saved':>10}")
    for fmt in a.formats.split(","):
        for name, shape in SHAPES.items():
            for t_us, base, pf in bench(cp, rng, fmt, shape, idle, a.iters, a.blocks, a.chunk):
                print(f"{fmt:6} {name:18} {t_us:7.1f} {base:12.2f} {pf:9.2f} {base - pf:10.2f}")


if __name__ == "__main__":
    main()
