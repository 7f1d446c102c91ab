"""Does a persistent kernel beat one kernel a GEMV? A probe for issue 10's decode targets.

The decode step's GEMVs stream 94 % of its bytes, yet each costs ~3 us more than its bytes at copy bandwidth
(BENCHMARKS.md, "the per-kernel floor"): the ramp, the tail and the wait for the kernel before. A persistent
decode kernel would replace those boundaries with grid barriers, and could load the next GEMV's first weights
before the barrier (no separate kernel may read before the one ahead has ended). This times both on the same
chain of dependent bf16 GEMVs with Qwen3-8B's shapes (per layer q|k|v 6144x4096, o 4096x4096, gate|up
24576x4096, down 4096x12288; each x is the first n_in outputs of the GEMV before):

- kernels: the backend's own decode GEMV (matmul.cu gemv1v2_bf16_g128r1, what a Qwen3-8B step runs), one
  launch a GEMV, captured into a CUDA graph with programmatic dependent launch, as a decode step is;
- persistent: benchmarks/persistent_probe.cu, one cooperative launch for the whole chain, 1 block of 512
  threads an SM, a grid barrier between GEMVs; `+early`: each warp's first weight batch of the next GEMV is
  loaded before the barrier.

Each is checked against an f32 product of the same chain (cupy), and timed as the best of 5 batches of
replays. Printed: us a layer, and the weight bytes at the copy bandwidth measured in the same run over that.

    python benchmarks/bench_gpu_persistent_probe.py [--layers 8] [--reps 20]

Measured (one H200, 2026-12-02, BENCHMARKS.md twelfth session): kernels 97.7 us a layer (92.9 % of the bytes
at copy bandwidth), persistent 105.4 (86.1 %), persistent +early 106.4 (85.3 %); 16 layers the same. Under PDL
a GEMV boundary costs ~1.7 us, and this probe's grid barrier and early loads do not win it back.
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np
from bench_gpu_launch_floor import best_replay_us  # this directory is on sys.path when run as a script

from graphir.bench import measure_device_bandwidth

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # (n_out, n_in) a layer
PROBE = Path(__file__).with_name("persistent_probe.cu")
THREADS = 512  # PROBE_THREADS
CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2  # cuda.h CUlaunchAttributeID


def bf16_weights(cp, n_out: int, n_in: int, rng) -> tuple:
    """(bf16 bits [n_out, n_in], their f32 values): N(0, 1/n_in), so a chain keeps unit-size activations."""
    f = rng.standard_normal((n_out, n_in), dtype=cp.float32) * np.float32(1 / np.sqrt(n_in))
    bits = (f.view(cp.uint32) >> 16).astype(cp.uint16)
    return bits, (bits.astype(cp.uint32) << 16).view(cp.float32)


def kernels_graph(cp, stages, s):
    """The chain as the backend's decode GEMV kernels, captured with PDL like a decode step."""
    from graphir.backends.gpu import kernels, matmul, pdl

    threads, rows = matmul.GEMV1_CONFIGS["g128r1"]
    k = kernels.get("matmul.cu", "gemv1v2_bf16_g128r1")
    s.begin_capture()
    for i, (w, x, y) in enumerate(stages):
        n_out, n_in = w.shape
        args = (w, np.int64(2 * n_in), x, y, np.int32(n_out), np.int32(n_in), np.int32(1))
        grid = ((n_out + rows - 1) // rows,)
        if i and pdl.enabled():
            pdl.launch(k, grid, (threads,), args, 0, s.ptr, "gemv1v2_bf16_g128r1")
        else:
            with s:
                k(grid, (threads,), args)
    graph = s.end_capture()
    return graph.launch


def persistent(cp, stages, name: str):
    """One cooperative launch of the probe kernel over the chain."""
    from graphir.backends.gpu import pdl

    mod = cp.RawModule(code=PROBE.read_text(), options=("-std=c++17",))
    fn = mod.get_function(name)
    fn_ptr = (fn.kernel if hasattr(fn, "kernel") else fn).ptr  # the CUfunction
    rec = np.zeros(len(stages), dtype=[("w", "u8"), ("x", "u8"), ("y", "u8"), ("n_out", "i4"), ("n_in", "i4")])
    for i, (w, x, y) in enumerate(stages):
        rec[i] = (w.data.ptr, x.data.ptr, y.data.ptr, w.shape[0], w.shape[1])
    desc = cp.asarray(rec.view(np.uint8))
    bar = cp.zeros(2, cp.uint32)
    shared = 4 * max(w.shape[1] for w, _, _ in stages)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    attr = pdl._LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_COOPERATIVE, value=1)
    values = pdl.kernel_args((desc, np.int32(len(stages)), bar))
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])

    def run(s) -> None:
        cfg = pdl._LaunchConfig(sms, 1, 1, THREADS, 1, 1, shared, s.ptr, ctypes.pointer(attr), 1)
        err = pdl._driver_launch()(ctypes.byref(cfg), fn_ptr, params, None)
        if err:
            raise RuntimeError(f"cooperative launch of {name} failed: CUresult {err}")

    run.keep = (mod, desc, bar, values)  # alive as long as the launcher (params point into values)
    return run


def main() -> None:
    import cupy as cp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    bw = measure_device_bandwidth()
    rng = cp.random.default_rng(0)
    weights = [bf16_weights(cp, n_out, n_in, rng) for _ in range(args.layers) for n_out, n_in in SHAPES]
    x0 = rng.standard_normal(SHAPES[0][1], dtype=cp.float32)
    ys = [cp.zeros(w.shape[0], cp.float32) for w, _ in weights]
    stages = [(w, x0 if i == 0 else ys[i - 1], ys[i]) for i, (w, _) in enumerate(weights)]
    # the f32 chain: x_{s+1} = (W_s x_s)[:n_in of s+1]
    want, x = [], x0
    for i, (_, wf) in enumerate(weights):
        want.append(wf @ x)
        if i + 1 < len(weights):
            x = want[-1][: weights[i + 1][1].shape[1]]
    wbytes = sum(w.nbytes for w, _ in weights)
    floor = wbytes / bw * 1e6 / args.layers
    s = cp.cuda.Stream(non_blocking=True)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; {args.layers} layers of Qwen3-8B GEMVs, {wbytes / 1e9:.2f} GB of "
          f"bf16 weights; bytes at copy bandwidth: {floor:.1f} us a layer")
    print(f"{'variant':>22} {'us a layer':>11} {'% of floor':>11} {'max rel err (last)':>19}")
    for label, make in (("kernels (PDL graph)", lambda: kernels_graph(cp, stages, s)),
                        ("persistent", lambda: persistent(cp, stages, "probe_chain")),
                        ("persistent +early", lambda: persistent(cp, stages, "probe_chain_early"))):
        for y in ys:
            y.fill(0)
        run = make()
        run(s)
        s.synchronize()
        err = float(cp.abs(ys[-1] - want[-1]).max() / cp.abs(want[-1]).max())
        us = best_replay_us(run, s, args.reps) / args.layers
        bad = "" if err < 1e-3 else "  MISMATCH"
        print(f"{label:>22} {us:>11.1f} {100 * floor / us:>10.1f}% {err:>19.2e}{bad}", flush=True)


if __name__ == "__main__":
    main()
