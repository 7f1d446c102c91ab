"""What a kernel costs in a replayed decode graph when it does (almost) nothing: the floor under every
launch-bound target.

A chain of N dependent `silu` ops, lowered by the gpu backend like any Program (each op one kernel,
each reading the one before), captured into a CUDA graph and replayed, with and without
programmatic dependent launch (backends/gpu/pdl.py). A replay also copies the Input in and the error flag
out (two small copies, shared by the whole chain):

- 4 bytes a tensor: the per-kernel cost with no data to move (launch, scheduling, the dependency on
  the kernel before, one load's round trip). A decode step of K kernels cannot take less than K times
  this; Qwen3-0.6B's step has 258 kernels.
- 2 MiB a tensor (read 2 MiB, write 2 MiB): the traffic of one Gated DeltaNet layer's recurrent state at
  Qwen3.5-9B shapes (32 value heads x 128 x 128 f32), whose "state-traffic floor" issue 12 counts at
  copy bandwidth. A kernel doing nothing but this copy, in the same setting, bounds how close any
  separate delta-rule step kernel can come to that floor.

    python benchmarks/bench_gpu_launch_floor.py [--kernels 256] [--sizes 1,524288]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from graphir.backends.registry import get_backend

from graphir.bench import measure_device_bandwidth
from graphir.builder import Builder
from graphir.ir import Graph


def chain(n_elems: int, kernels: int) -> Graph:
    g = Builder()
    x = g.input("x", (n_elems,))
    for i in range(kernels):
        x = g.silu(x, name=f"silu{i}")
    return Graph({"y": x})


def graph_us(n_elems: int, kernels: int, pdl: bool, reps: int) -> float:
    """Microseconds a replay of the captured chain takes, best of 5 batches of `reps` replays."""
    import cupy as cp
    from graphir.backends.gpu.device import stream

    os.environ["GRAPHIR_NO_PDL"] = "0" if pdl else "1"
    try:
        program = get_backend("gpu").lower(chain(n_elems, kernels))
        feeds = {"x": np.random.default_rng(0).standard_normal(n_elems).astype(np.float32)}
        for _ in range(3):  # the second call captures
            program(feeds, device=True)
        assert program.captured, "the chain was not captured"
    finally:
        del os.environ["GRAPHIR_NO_PDL"]
    s = stream()
    best = float("inf")
    for _ in range(5):
        s.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            program.replay_once(s)
        s.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    cp.get_default_memory_pool().free_all_blocks()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=256)
    ap.add_argument("--sizes", default="1,524288", help="elements (f32) a tensor, comma-separated")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    bw = measure_device_bandwidth()
    print(f"device copy bandwidth (1 GiB, read + write): {bw / 1e12:.3f} TB/s; chain of {args.kernels} silu kernels")
    print(f"{'bytes a tensor':>15} {'PDL':>4} {'graph us':>10} {'us a kernel':>12} {'floor us':>9} {'% of floor':>11}")
    for n in (int(s) for s in args.sizes.split(",")):
        for pdl in (True, False):
            us = graph_us(n, args.kernels, pdl, args.reps)
            per = us / args.kernels
            floor = 2 * 4 * n / bw * 1e6  # read + write at copy bandwidth
            print(f"{4 * n:>15,} {'on' if pdl else 'off':>4} {us:>10.1f} {per:>12.3f} {floor:>9.3f} "
                  f"{100 * floor / per:>10.1f}%")


if __name__ == "__main__":
    main()
