"""Benchmark the chunked gated delta rule (delta_chunked.cu) against the token-loop kernel (recurrent.cu).

    python benchmarks/bench_gpu_delta_chunked.py [--quick] [--reps N]

One gated_delta_net_raw layer with l2 normalization of q and k (Qwen3.5's prefill path) at
Qwen3.5-9B-like shapes (hk 16, hv 32, d 128) and 0.8B-like ones (hk = hv = 16), for prompt lengths
from 16 to 4096: ms per layer for each path, the speedup, the chunked path's two kernels alone, and
the max difference between the two paths relative to the largest output. The lengths below 4096 show
where the chunked path starts to win (delta_chunked.CHUNKED_MIN_TOKENS). Launches are replayed from
a captured CUDA graph (gpu_timing.py), so the times are the kernels'. --quick: 4096 tokens only.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import replay_seconds  # noqa: E402  (beside this script)

SHAPES = {"9B": (16, 32, 128), "0.8B": (16, 16, 128)}  # (hk, hv, d)
LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 4096)
L2_EPS = 1e-6


def inputs(n: int, hk: int, hv: int, d: int) -> dict:
    import cupy as cp

    rng = cp.random.default_rng(0)

    def normal(shape, s=1.0):
        return rng.standard_normal(shape, dtype=cp.float32) * s

    return {"q": normal((n, hk, d)), "k": normal((n, hk, d)), "v": normal((n, hv, d)), "alpha": normal((n, hv)),
            "b": normal((n, hv)), "a_neg": -cp.exp(normal((hv,), 0.5)), "dt_bias": normal((hv,)),
            "state": normal((hv, d, d), 0.3)}


def chunked(x: dict, o, new_state):
    from graphir.backends.gpu import delta_chunked as DC
    from graphir.backends.gpu.launch import Lowering

    n, hk, d = x["q"].shape
    hv = x["v"].shape[1]
    i0, i1 = np.int32(0), np.int32(1)
    return DC.chunked_launches(Lowering(None), None, x["q"], x["k"], x["v"], x["alpha"], x["b"], x["a_neg"],
                               x["dt_bias"], i0, i1, i0, i1, x["state"], o, new_state, n, hk, hv, d, d,
                               1 / math.sqrt(d), True, L2_EPS)


def token_loop(x: dict, o, new_state):
    """The backend's rule with the chunked path switched off."""
    from graphir.backends.gpu import delta_chunked as DC
    from graphir.backends.gpu import recurrent as R
    from graphir.backends.gpu.launch import Lowering

    keep, DC.CHUNKED_MIN_TOKENS = DC.CHUNKED_MIN_TOKENS, 1 << 30
    try:
        ins = [x[k] for k in ("q", "k", "v", "alpha", "b", "a_neg", "dt_bias", "state")]
        steps = R.lower_gated_delta_net_raw(Lowering(None), None, ins, [o, new_state],
                                            {"scale": 1 / math.sqrt(x["q"].shape[2]), "l2_eps": L2_EPS})
    finally:
        DC.CHUNKED_MIN_TOKENS = keep
    assert all(st.name.startswith("gated_delta_net") for st in steps), [st.name for st in steps]
    return steps


def runner(steps):
    def run():
        for st in steps:
            st()

    return run


def case(label: str, n: int, hk: int, hv: int, d: int, reps: int) -> dict:
    import cupy as cp

    x = inputs(n, hk, hv, d)
    outs = {}
    times = {}
    for path, make in (("loop", token_loop), ("chunked", chunked)):
        o, s1 = cp.empty((n, hv, d), cp.float32), cp.empty((hv, d, d), cp.float32)
        steps = make(x, o, s1)
        times[path] = replay_seconds(runner(steps), reps)[0]
        if path == "chunked":
            times["parts"] = [replay_seconds(st, reps)[0] for st in steps]
        outs[path] = (o, s1)
    (lo, ls), (co, cs) = outs["loop"], outs["chunked"]
    err_o = float(cp.abs(co - lo).max() / cp.abs(lo).max())
    err_s = float(cp.abs(cs - ls).max() / cp.abs(ls).max())
    parts = " + ".join(f"{t * 1e3:.3f}" for t in times["parts"])
    bad = "" if max(err_o, err_s) <= 1e-4 else "  MISMATCH"
    print(f"{label:<6} {n:>6} {times['loop'] * 1e3:>10.3f} {times['chunked'] * 1e3:>10.3f} "
          f"{times['loop'] / times['chunked']:>8.2f}x  ({parts})  {err_o:.1e} {err_s:.1e}{bad}", flush=True)
    return {"label": label, "n": n, **times, "err": max(err_o, err_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4096 tokens only, fewer reps")
    ap.add_argument("--reps", type=int, default=None)
    a = ap.parse_args()
    reps = a.reps or (5 if a.quick else 20)
    import cupy as cp

    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("gated_delta_net_raw with l2 (q, k normalized), f32; ms per layer; chunked = prep + scan")
    print(f"{'shape':<6} {'tokens':>6} {'loop ms':>10} {'chunk ms':>10} {'speedup':>9}  (prep + scan ms)  "
          f"max|diff|/max (o, state)")
    rows = []
    for label, (hk, hv, d) in SHAPES.items():
        for n in (4096,) if a.quick else LENGTHS:
            rows.append(case(label, n, hk, hv, d, max(2, reps if n <= 1024 else reps // 2)))
    wins = [r["n"] for r in rows if r["chunked"] < r["loop"]]
    print(f"\nsmallest length where the chunked path wins: {min(wins) if wins else 'none'} "
          f"(delta_chunked.CHUNKED_MIN_TOKENS)")


if __name__ == "__main__":
    main()
