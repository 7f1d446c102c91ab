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
  copy bandwidth. A kernel doing nothing but move these bytes, in the same setting, bounds how close
  any separate delta-rule step kernel can come to that floor. The driver's own device-to-device copy of
  the same bytes, captured the same way, is the third line.

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
    us = best_replay_us(program.replay_once, stream(), reps)
    cp.get_default_memory_pool().free_all_blocks()
    return us


def best_replay_us(replay, s, reps: int) -> float:
    """Microseconds a replay(s) takes, best of 5 batches of `reps`."""
    best = float("inf")
    for _ in range(5):
        s.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            replay(s)
        s.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def memcpy_chain_us(n_elems: int, copies: int, reps: int) -> float:
    """The same chain as device-to-device cudaMemcpyAsync calls captured into a graph (the driver's own copy,
    ping-ponging between two buffers): what the same bytes cost without any kernel of ours."""
    import cupy as cp

    rt = cp.cuda.runtime
    a = cp.random.standard_normal(n_elems, dtype=cp.float32)
    b = cp.empty_like(a)
    s = cp.cuda.Stream(non_blocking=True)
    s.begin_capture()
    for i in range(copies):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice, s.ptr)
    graph = s.end_capture()
    for _ in range(3):
        graph.launch(s)
    return best_replay_us(graph.launch, s, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=256)
    ap.add_argument("--sizes", default="1,524288", help="elements (f32) a tensor, comma-separated")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    bw = measure_device_bandwidth()
    print(f"device copy bandwidth (1 GiB, read + write): {bw / 1e12:.3f} TB/s; chain of {args.kernels} silu kernels")
    print(f"{'bytes a tensor':>15} {'chain':>16} {'graph us':>10} {'us a link':>12} {'floor us':>9} {'% of floor':>11}")
    for n in (int(s) for s in args.sizes.split(",")):
        floor = 2 * 4 * n / bw * 1e6  # read + write at copy bandwidth
        for what, us in (("silu, PDL on", graph_us(n, args.kernels, True, args.reps)),
                         ("silu, PDL off", graph_us(n, args.kernels, False, args.reps)),
                         ("cudaMemcpyAsync", memcpy_chain_us(n, args.kernels, args.reps))):
            per = us / args.kernels
            print(f"{4 * n:>15,} {what:>16} {us:>10.1f} {per:>12.3f} {floor:>9.3f} {100 * floor / per:>10.1f}%")

if __name__ == "__main__":
    main()
