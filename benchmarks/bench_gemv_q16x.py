"""The decode GEMV with int16 activations (backends/cpu/gemv_q16x.py) timed against the f32 and q8x paths.

    python benchmarks/bench_gemv_q16x.py [--reps 300] [--rounds 10] [--threads 1,2] [--rows 1]

One token (--rows: that many, as a verify call's), SmolLM2's q4_1 layer shapes and its q8_0 head (49152 x 576),
random blocks, one weight per shape; the three kernels on the same weight called in turn (`rounds` rounds of
best-of-(reps / rounds) each, so a slow spell of the machine lands on all three), x's quantizing included. Prints ns
per 32-value block and row of x. Before timing, each kernel's output is checked against its op's numpy reference (the
exact checks are tests/test_cpu_gemv_q16x.py's).

This began as a prototype with its own copy of the kernel, two nibble layouts and planted bugs (BENCHMARKS.md, "int16
activations for q4_1: a measured prototype"); the "words" layout became the library kernel, the "zext" one
(`vpmovzxbw`, 1.19-1.33x slower) was dropped, and the checks moved to the tests.
"""

from __future__ import annotations

import argparse

import numba
import numpy as np
from bench_gemv_q8x import best_ns
from graphir.backends.cpu import gemv_q8x as GQ
from graphir.backends.cpu import gemv_q16x as G16
from graphir.backends.cpu import gemv_repacked as GR

from graphir.ops import OPS
from graphir.quant import dequantize, random_quantized

SHAPES = [("attn_qkv", 960, 576, "q4_1"), ("attn_output", 576, 576, "q4_1"), ("ffn_gate_up", 3072, 576, "q4_1"),
          ("ffn_down", 576, 1536, "q4_1"), ("output", 49152, 576, "q8_0")]


def kernels(raw: np.ndarray, dtype: str, x: np.ndarray) -> dict:
    """name -> (a zero-argument GEMV writing its y, y, the op whose reference it computes); no "f32" for more than one
    row of x (gemv_repacked's GEMV takes one)."""
    out = {}
    for name, mod, op in (("f32", GR, "mul_mat"), ("q8x", GQ, "mul_mat_q8x"), ("q16x", G16, "mul_mat_q16x")):
        y = np.empty((x.shape[0], raw.shape[0]), np.float32)
        run = mod.prepare(raw, dtype, x, y)
        if run is not None:
            out[name] = (run, y, op)
    return out


def check(raw: np.ndarray, dtype: str, x: np.ndarray, runs: dict) -> None:
    wf = dequantize(raw, dtype, (raw.shape[0], x.shape[1]))
    for name, (run, y, op) in runs.items():
        run()
        want = OPS[op].ref(wf, x)
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), f"{name}: not its op's reference"


def time_shapes(reps: int, rounds: int, threads: list[int], rows: int) -> None:
    rng = np.random.default_rng(0)
    print("| shape | threads | f32 path | q8x | q16x | q16x / q8x | f32 / q16x |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, n_out, n_in, dtype in SHAPES:
        raw = random_quantized(rng, dtype, (n_out, n_in))
        x = rng.standard_normal((rows, n_in)).astype(np.float32)
        runs = kernels(raw, dtype, x)
        check(raw, dtype, x, runs)
        blocks = n_out * n_in // 32 * rows
        for th in threads:
            numba.set_num_threads(th)
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(rounds):  # interleaved: a slow spell of the machine lands on all three
                for k, (run, _, _) in runs.items():
                    best[k] = min(best[k], best_ns(run, max(1, reps // rounds)) / blocks)
            a, b, c = best.get("f32", float("nan")), best["q8x"], best["q16x"]
            print(f"| {name} [{n_out} x {n_in}] {dtype} | {th} | {a:.2f} | {b:.2f} | {c:.2f} | {c / b:.2f} "
                  f"| {a / c:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", type=int, default=1, help="rows of x")
    args = ap.parse_args()
    print(f"gemv_q16x path: {'avx2' if G16.AVX2 else 'portable'}")
    time_shapes(args.reps, args.rounds, [int(t) for t in args.threads.split(",")], args.rows)


if __name__ == "__main__":
    main()
