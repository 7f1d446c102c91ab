"""Benchmark flash_attn on the GPU: split-K decode against copy bandwidth, and causal prefill.

    python benchmarks/bench_gpu_attention.py [--quick] [--reps N]

Shapes are Qwen3-8B's attention: 32 q heads, 8 kv heads, head_dim 128, a KV cache of CAP rows
(f16 and f32). Decode: one query at the last position of a 1k / 8k / 32k context (kv_len set in
device memory, as a model does). Prefill: 512 and 4096 prompt tokens from an empty cache.

The node is lowered through get_backend("gpu") when that backend is registered (result checked
against the direct lowering), and always through the rule `lower_flash_attn` on fixed device
buffers: its steps are captured into a CUDA graph and replayed, so the time is the kernels',
not Python's launch overhead (~8 us per launch). Each result is checked against a cupy einsum.

Columns: us per call; GB/s = K+V bytes of the visible rows / time (the bytes decode must read);
percent of the measured device copy bandwidth; TFLOP/s = 2*(d+dv) per visible (query, head, key);
for decode, the decode kernel and attn_combine also timed alone (each replayed from its own graph).
A summary table ends the output. --quick: 8k decode and 512 prefill only, fewer reps.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import replay_seconds  # noqa: E402  (beside this script)

from graphir.bench import measure_device_bandwidth  # noqa: E402

HQ, HK, D = 32, 8, 128
CAP = 32768 + 1024  # capacity above the longest context: kv_len, not the cap, sets the work


def cupy():
    import cupy as cp

    return cp


def time_fn(fn, reps: int) -> float:
    return replay_seconds(fn, reps)[0]


class Node:
    """What lower_flash_attn reads on its node: only params (passed separately)."""


def lower(q, k, v, pos, kv_len, out, scale, window=0):
    from graphir.backends.gpu.attention import lower_flash_attn
    from graphir.backends.gpu.launch import Lowering

    lw = Lowering(None)
    lw.code = 1
    steps = lower_flash_attn(lw, Node(), [q, k, v, pos, kv_len], [out], {"scale": scale, "window": window})

    def run():
        for s in steps:
            s()

    run.steps = steps
    return run, lw


def reference(q, k, v, pos, kv_len: int, scale: float):
    """Causal GQA attention with cupy (f32), queries in chunks to bound the score matrix."""
    cp = cupy()
    n_q, hq, _ = q.shape
    group = hq // k.shape[1]
    kk = cp.repeat(k[:kv_len].astype(cp.float32), group, axis=1)
    vv = cp.repeat(v[:kv_len].astype(cp.float32), group, axis=1)
    out = cp.zeros((n_q, hq, v.shape[2]), cp.float32)
    j = cp.arange(kv_len)
    for i0 in range(0, n_q, 512):
        qq, pp = q[i0:i0 + 512], pos[i0:i0 + 512]
        s = cp.einsum("qhd,khd->hqk", qq, kk) * scale
        s = cp.where((j[None, :] <= pp[:, None])[None], s, -cp.inf)
        s = s - s.max(-1, keepdims=True)
        p = cp.exp(s)
        p /= p.sum(-1, keepdims=True)
        out[i0:i0 + 512] = cp.einsum("hqk,khd->qhd", p, vv)
    return out


def via_backend(q, k, v, pos, kv_len, scale):
    """The same node through get_backend("gpu"), when the backend is registered; None otherwise."""
    try:
        from graphir.backends.registry import get_backend

        from graphir import g
        from graphir.ir import Graph

        gpu = get_backend("gpu")
    except Exception:
        return None
    kvdt = "f32" if k.dtype == np.float32 else "f16"
    node = g.flash_attn(g.input("q", q.shape), g.input("k", k.shape, kvdt), g.input("v", v.shape, kvdt),
                        g.input("pos", pos.shape, "i32"), g.input("len", (1,), "i32"), scale=scale)
    program = gpu.lower(Graph({"out": node}), None)
    res = program({"q": q.get(), "k": k.get(), "v": v.get(), "pos": pos.get(), "len": kv_len.get()})["out"]
    return res.get() if hasattr(res, "get") else np.asarray(res)


def case(kvdt, n_q: int, ctx: int, cap: int, reps: int, bw: float, label: str, check_backend: bool = False,
         parts: bool = False) -> dict:
    cp = cupy()
    rng = cp.random.default_rng(0)
    npdt = np.float32 if kvdt == "f32" else np.float16
    scale = 1.0 / math.sqrt(D)
    q = rng.standard_normal((n_q, HQ, D), dtype=cp.float32)
    k = rng.standard_normal((cap, HK, D), dtype=cp.float32).astype(npdt)
    v = rng.standard_normal((cap, HK, D), dtype=cp.float32).astype(npdt)
    pos = cp.arange(ctx - n_q, ctx, dtype=cp.int32)
    kv_len = cp.array([ctx], cp.int32)
    out = cp.empty((n_q, HQ, D), cp.float32)
    run, lw = lower(q, k, v, pos, kv_len, out, scale)
    t = time_fn(run, reps)
    flag = lw.errflag.get()
    assert not flag[0], f"kernel reported error {flag}"
    want = reference(q, k, v, pos, ctx, scale)
    err = float(cp.abs(out - want).max())
    visible = n_q * ctx - n_q * (n_q - 1) // 2  # (query, key) pairs
    kv_bytes = ctx * HK * 2 * D * np.dtype(npdt).itemsize
    flops = 2 * visible * HQ * (D + D)
    line = (f"{label:<28} {t * 1e6:>10.1f} {kv_bytes / t / 1e9:>9.0f} {100 * kv_bytes / t / bw:>6.1f}% "
            f"{flops / t / 1e12:>8.2f} {err:>9.1e}")
    res = {"t": t, "pct": 100 * kv_bytes / t / bw, "tflops": flops / t / 1e12, "err": err,
           "kernels": [st.name for st in run.steps]}
    if parts and len(run.steps) > 1:  # each kernel alone (the combine reads the partials the decode left)
        res["parts"] = [time_fn(st, reps) for st in run.steps]
        line += "  " + " + ".join(f"{st.name} {tp * 1e6:.1f}" for st, tp in zip(run.steps, res["parts"]))
    if check_backend:
        got = via_backend(q, k, v, pos, kv_len, scale)
        line += "  backend: " + ("not registered" if got is None else f"max|diff| {np.abs(got - out.get()).max():.1e}")
    if not err < 1e-4:
        line += "  MISMATCH"
    print(line, flush=True)
    return res


def summary(rows: list) -> None:
    """The table, last: one line per case."""
    print("\nsummary (decode us, combine us: the decode kernel and attn_combine, each replayed alone):")
    print(f"{'case':<24} {'kernel':<26} {'us/call':>8} {'%copy':>7} {'TFLOP/s':>8} {'decode us':>10} "
          f"{'combine us':>10} {'max|err|':>9}")
    for label, r in rows:
        parts = r.get("parts")
        dec, comb = (f"{parts[0] * 1e6:10.1f}", f"{parts[-1] * 1e6:10.1f}") if parts else (f"{'':>10}", f"{'':>10}")
        bad = "" if r["err"] < 1e-4 else "  MISMATCH"
        print(f"{label:<24} {r['kernels'][0]:<26} {r['t'] * 1e6:8.1f} {r['pct']:6.1f}% {r['tflops']:8.2f} {dec} {comb} "
              f"{r['err']:9.1e}{bad}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer reps, 8k decode and 512 prefill only")
    ap.add_argument("--reps", type=int, default=None)
    a = ap.parse_args()
    reps = a.reps or (20 if a.quick else 100)
    cp = cupy()
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    bw = measure_device_bandwidth()
    print(f"copy bandwidth (read + write): {bw / 1e12:.2f} TB/s")
    print(f"Qwen3-8B attention: hq={HQ} hk={HK} d={D}, KV capacity {CAP}")
    print(f"{'case':<28} {'us/call':>10} {'GB/s':>9} {'%copy':>7} {'TFLOP/s':>8} {'max|err|':>9}")
    rows = []
    contexts = [8192] if a.quick else [1024, 8192, 32768]
    for kvdt in ("f16", "f32"):
        for i, ctx in enumerate(contexts):
            label = f"decode {kvdt} ctx={ctx}"
            rows.append((label, case(kvdt, 1, ctx, CAP, reps, bw, label, check_backend=(i == 0), parts=True)))
    for kvdt in ("f16", "f32"):
        for n in [512] if a.quick else [512, 4096]:
            label = f"prefill {kvdt} n={n}"
            rows.append((label, case(kvdt, n, n, n, max(3, reps // 10), bw, label)))
    summary(rows)


if __name__ == "__main__":
    main()
