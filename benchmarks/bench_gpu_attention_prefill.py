"""Benchmark causal prefill attention on the GPU: the tensor-core bf16 kernel against the f32 one.

    python benchmarks/bench_gpu_attention_prefill.py [--shape qwen3-8b qwen3.5] [--n 512 4096]
        [--variants default mt1 ...] [--reps N] [--peer torch]

Shapes (--shape): Qwen3-8B's attention (32 q heads, 8 kv heads, head_dim 128), Qwen3.5's (16 q heads,
4 kv heads, head_dim 256) and the same heads as Qwen3-8B at head_dim 64 (llama-d64); a prompt of n tokens
from an empty cache (positions 0..n-1, kv_len n) with K/V caches of f32 and f16. In the same run, on the
same buffers: `lower_flash_attn` (attn_prefill_<kv>_d<DK>_g4, f32 CUDA cores) and `lower_flash_attn_bf16`
(attn_kv_bf16_<kv> + attn_prefill_bf16_d<DK>, tensor cores) once per --variants entry (VARIANTS: the file
recompiled with that variant's defines, attention.py's mirrors set to match). Steps are captured into a
CUDA graph and replayed (gpu_timing.py), so the times are the kernels'. The bf16 time includes the K/V
conversion, which is also timed alone.

Columns: us per call; TFLOP/s = 4 * d per visible (query, head, key) pair (Q.K^T and P.V, causal:
n(n+1)/2 pairs per head); speed-up over the f32 kernel; max |bf16 - f32| / max |f32| (the rounding,
~1e-2: a sanity check, the tests compare against the op's reference).

--peer torch: PyTorch's scaled_dot_product_attention on the same shapes in the same run (bf16 q, k, v; K/V
heads repeated to the q heads outside the timing), once per SDPA backend it has (flash, cuDNN, efficient), each
timed from torch's own CUDA graph replay. The peer's flop count is the same causal count; its inputs are
already bf16, so it does no K/V conversion, where the graphir time includes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import replay_seconds  # noqa: E402  (beside this script)

SHAPES = {"qwen3-8b": (32, 8, 128), "qwen3.5": (16, 4, 256), "llama-d64": (32, 8, 64)}  # q, kv heads, head dim


def lower(rule, bufs, out, d: int):
    from graphir.backends.gpu.launch import Lowering

    lw = Lowering(None)
    lw.code = 1
    steps = rule(lw, None, bufs, [out], {"scale": 1.0 / np.sqrt(d), "window": 0})
    return steps, lw


# Kernel variants to time (attention_prefill.cu defines, and the attention.py mirrors that must match them):
# name -> (defines, TC_MT, TC_Q_SHARED, TC_WARPS). "default" is what the backend ships.
VARIANTS = {
    "default": ((), 1, {64: False, 128: None}, 4),
    "mt2": (("ATTN_TC_MT=2",), 2, {64: False, 128: None}, 4),
    "mt2-bn32": (("ATTN_TC_MT=2", "ATTN_TC_BN_D128=32"), 2, {64: False, 128: None}, 4),
    "w8": (("ATTN_TC_WARPS=8",), 1, {64: False, 128: None}, 8),
    "bn32": (("ATTN_TC_BN_D128=32", "ATTN_TC_BN_D64=32"), 1, {64: False, 128: None}, 4),
}


def use_variant(name: str) -> None:
    """Compile attention_prefill.cu as VARIANTS[name] for the Launches lowered from now on."""
    from graphir.backends.gpu import attention, kernels

    defines, mt, q_shared, warps = VARIANTS[name]
    kernels.SOURCES[attention.TC_FILE] = tuple(defines)
    kernels.clear()  # Launches made before keep their compiled kernels
    attention.TC_MT, attention.TC_Q_SHARED, attention.TC_WARPS = mt, dict(q_shared), warps


def run_steps(steps) -> None:
    for st in steps:
        st()


def bench_case(shape: str, n: int, kvdtype: str, variants: list[str], reps: int) -> list[tuple]:
    import cupy as cp
    from graphir.backends.gpu.attention import lower_flash_attn, lower_flash_attn_bf16

    hq, hk, d = SHAPES[shape]
    rng = np.random.default_rng(n)
    npdt = np.float32 if kvdtype == "f32" else np.float16
    q = cp.asarray(rng.standard_normal((n, hq, d), dtype=np.float32))
    k = cp.asarray(rng.standard_normal((n, hk, d)).astype(npdt))
    v = cp.asarray(rng.standard_normal((n, hk, d)).astype(npdt))
    pos, kv_len = cp.arange(n, dtype=cp.int32), cp.asarray([n], cp.int32)
    bufs = [q, k, v, pos, kv_len]
    flops = 4.0 * d * hq * n * (n + 1) / 2
    rows = []

    out32 = cp.zeros((n, hq, d), cp.float32)
    steps, _ = lower(lower_flash_attn, bufs, out32, d)
    t32 = replay_seconds(lambda: run_steps(steps), reps)[0]
    case = f"{shape} {kvdtype} n={n}"
    rows.append((case, steps[0].name, t32, flops / t32 / 1e12, 1.0, ""))
    ref = out32.get()
    for variant in variants:
        use_variant(variant)
        out = cp.zeros((n, hq, d), cp.float32)
        steps, lw = lower(lower_flash_attn_bf16, bufs, out, d)
        t = replay_seconds(lambda steps=steps: run_steps(steps), reps)[0]
        t_convert = replay_seconds(steps[0], reps)[0]
        assert not lw.errflag.get()[0], "a kernel reported an error"
        diff = float(np.abs(out.get() - ref).max() / np.abs(ref).max())
        rows.append((case, f"{steps[1].name} {variant} (convert {t_convert * 1e6:.0f} us)", t,
                     flops / t / 1e12, t32 / t, f"{diff:.2e}"))
    return rows


def torch_peer(shape: str, n: int, reps: int) -> list[tuple]:
    """PyTorch SDPA (causal, bf16) per backend: (case, name, seconds, TFLOP/s); skipped where torch is missing."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return []
    hq, hk, d = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, hk, n, d, device="cuda", dtype=torch.bfloat16, generator=g).repeat_interleave(hq // hk, 1)
    v = torch.randn(1, hk, n, d, device="cuda", dtype=torch.bfloat16, generator=g).repeat_interleave(hq // hk, 1)
    flops = 4.0 * d * hq * n * (n + 1) / 2
    rows = []
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                def call():
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    call()
                graph.replay()
                best = float("inf")
                for _ in range(3):
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(reps):
                        graph.replay()
                    stop.record()
                    stop.synchronize()
                    best = min(best, start.elapsed_time(stop) / 1e3 / reps)
        except RuntimeError as e:  # a backend this build or GPU lacks
            print(f"  (torch sdpa {name}: {str(e).splitlines()[0][:80]})")
            continue
        rows.append((f"{shape} bf16 n={n}", f"torch sdpa {name} {torch.__version__}", best, flops / best / 1e12))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="attention shapes")
    ap.add_argument("--n", type=int, nargs="+", default=[512, 4096], help="prompt lengths")
    ap.add_argument("--variants", nargs="+", default=["default", "mt2"], choices=list(VARIANTS),
                    help="kernel variants to time (VARIANTS)")
    ap.add_argument("--kv", nargs="+", default=["f32", "f16"], choices=["f32", "f16"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--peer", choices=["torch"], help="also time PyTorch's SDPA on the same shapes")
    args = ap.parse_args()
    import cupy as cp

    shapes = ", ".join(f"{s} (hq {SHAPES[s][0]}, hk {SHAPES[s][1]}, d {SHAPES[s][2]})" for s in args.shape)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: {shapes}, causal from 0")
    print(f"{'case':<24} {'kernel':<52} {'us':>9} {'TFLOP/s':>8} {'x f32':>6} {'vs f32':>9}")
    for shape in args.shape:
        for n in args.n:
            for kvdtype in args.kv:
                for case, name, t, tflops, speedup, diff in bench_case(shape, n, kvdtype, args.variants, args.reps):
                    print(f"{case:<24} {name:<52} {t * 1e6:9.1f} {tflops:8.1f} {speedup:6.1f} {diff:>9}")
            if args.peer:
                for case, name, t, tflops in torch_peer(shape, n, args.reps):
                    print(f"{case:<24} {name:<52} {t * 1e6:9.1f} {tflops:8.1f}")


if __name__ == "__main__":
    main()
