"""ns per 32-block of the cpu's 8-bit-activation GEMV (gemv_q8x.py) against the f32-activation one (gemv_repacked.py).

    python benchmarks/bench_gemv_q8x.py [--reps 200] [--threads 1,2]

SmolLM2-135M's decode GEMVs, one token: stacked q|k|v [960 x 576], attn_output [576 x 576], stacked gate|up
[3072 x 576], ffn_down [576 x 1536] (q4_1) and the tied head [49152 x 576] (q8_0). Random blocks (gguf-py's
quantizer), one weight per shape; a call's time is the best of --reps (the weight in cache where it fits: L2 is
512 KiB a core on the AMD machine, so the layer weights mostly are, the head is not). q8x includes quantizing x.
Run at real-time priority on a quiet machine (`chrt -f 10`).
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from graphir.backends.cpu import gemv_q8x as GQ
from graphir.backends.cpu import gemv_repacked as GR

from graphir.quant import random_quantized

SHAPES = [("attn_qkv", 960, 576, "q4_1"), ("attn_output", 576, 576, "q4_1"), ("ffn_gate_up", 3072, 576, "q4_1"),
          ("ffn_down", 576, 1536, "q4_1"), ("output", 49152, 576, "q8_0")]


def best_ns(run, reps: int) -> float:
    run()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter_ns()
        run()
        best = min(best, time.perf_counter_ns() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"| shape | weight | threads | f32 path ns/block | q8x ns/block ({'avx2' if GQ.AVX2 else 'portable'}) "
          "| speed-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, n_out, n_in, dt in SHAPES:
        raw = random_quantized(rng, dt, (n_out, n_in))
        x = rng.standard_normal((1, n_in)).astype(np.float32)
        y0, y1 = np.empty((1, n_out), np.float32), np.empty((1, n_out), np.float32)
        f32 = GR.prepare(raw, dt, x, y0)
        q8x = GQ.prepare(raw, dt, x, y1)
        blocks = n_out * n_in // 32
        for th in (int(t) for t in args.threads.split(",")):
            numba.set_num_threads(th)
            a, b = best_ns(f32, args.reps) / blocks, best_ns(q8x, args.reps) / blocks
            print(f"| {name} [{n_out} x {n_in}] | {dt} | {th} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
