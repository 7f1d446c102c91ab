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
    """Each silu reads the one before: two arena buffers in turn, so the data stays in L2."""
    g = Builder()
    x = g.input("x", (n_elems,))
    for i in range(kernels):
        x = g.silu(x, name=f"silu{i}")
    return Graph({"y": x})


def spread(n_elems: int, kernels: int) -> Graph:
    """Each silu reads its own State buffer and writes its own output: in a replay every kernel reads bytes
    last touched a whole replay (GBs) earlier, from DRAM, as a decode step reads a layer's recurrent state.
    (State, not Inputs: a replay copies its Inputs in from the host.)"""
    g = Builder()
    outs = {f"y{i}": g.silu(g.state(f"s{i}", (n_elems,)), name=f"silu{i}") for i in range(kernels)}
    return Graph({**outs, "x": g.silu(g.input("x", (1,)))})


def graph_us(graph: Graph, pdl: bool, reps: int) -> float:
    """Microseconds a replay of the captured graph takes, best of 5 batches of `reps` replays."""
    import cupy as cp
    from graphir.backends.gpu.device import stream

    os.environ["GRAPHIR_NO_PDL"] = "0" if pdl else "1"
    try:
        gpu = get_backend("gpu")
        program, state = gpu.lower(graph), gpu.new_state(graph)
        rng = np.random.default_rng(0)
        feeds = {x.name: rng.standard_normal(x.shape).astype(np.float32) for x in graph.inputs}
        for _ in range(3):  # the second call captures
            program(feeds, state, device=True)
        assert program.captured, "the chain was not captured"
    finally:
        del os.environ["GRAPHIR_NO_PDL"]
    us = best_replay_us(program.replay_once, stream(), reps)
    del program, state
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


def memcpy_us(n_elems: int, copies: int, reps: int, distinct: bool) -> float:
    """The same links as device-to-device cudaMemcpyAsync calls captured into a graph (the driver's own copy):
    what the same bytes cost without any kernel of ours. Two buffers in turn, or (distinct) each copy its
    own source and destination."""
    import cupy as cp

    rt = cp.cuda.runtime
    n_buf = copies if distinct else 1
    a = [cp.random.standard_normal(n_elems, dtype=cp.float32) for _ in range(n_buf)]
    b = [cp.empty_like(x) for x in a]
    s = cp.cuda.Stream(non_blocking=True)
    s.begin_capture()
    for i in range(copies):
        src, dst = (a[i], b[i]) if distinct else (a[0], b[0]) if i % 2 == 0 else (b[0], a[0])
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice, s.ptr)
    graph = s.end_capture()
    for _ in range(3):
        graph.launch(s)
    us = best_replay_us(graph.launch, s, reps)
    del a, b, graph
    cp.get_default_memory_pool().free_all_blocks()
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=256)
    ap.add_argument("--sizes", default="1,524288", help="elements (f32) a tensor, comma-separated")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    bw = measure_device_bandwidth()
    print(f"device copy bandwidth (1 GiB, read + write): {bw / 1e12:.3f} TB/s; {args.kernels} links a graph "
          "(chain: each reads the one before, in L2; spread: each its own buffers, from DRAM)")
    print(f"{'bytes a tensor':>15} {'what':>20} {'graph us':>10} {'us a link':>10} {'floor us':>9} {'% of floor':>11}")
    for n in (int(s) for s in args.sizes.split(",")):
        floor = 2 * 4 * n / bw * 1e6  # read + write at copy bandwidth
        k, reps = args.kernels, args.reps
        rows = [("silu chain, PDL", graph_us, (chain(n, k), True, reps)),
                ("silu chain, no PDL", graph_us, (chain(n, k), False, reps)),
                ("memcpy chain", memcpy_us, (n, k, reps, False))]
        if 4 * n >= 1 << 20:  # from DRAM: only where a tensor is more than a cache line or two
            rows += [("silu spread, PDL", graph_us, (spread(n, k), True, reps)),
                     ("memcpy spread", memcpy_us, (n, k, reps, True))]
        for what, fn, fn_args in rows:
            per = fn(*fn_args) / k
            print(f"{4 * n:>15,} {what:>20} {per * k:>10.1f} {per:>10.3f} {floor:>9.3f} {100 * floor / per:>10.1f}%")

if __name__ == "__main__":
    main()
