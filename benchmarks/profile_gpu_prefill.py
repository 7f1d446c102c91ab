"""Where a GPU prefill's time goes: one prefill Program of N tokens, every step timed with CUDA events.

    python benchmarks/profile_gpu_prefill.py [MODEL] [--tokens 4096] [--passes PIPELINE]

A prefill Program holds cuBLAS steps, so it is never captured: its steps run from Python as in a real
prefill. Each step is bracketed by events on the Program's stream (the GPU's own time, launch gaps
excluded); the table sums them by kernel or library call, largest first, against the whole call's time.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import graphir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="random:qwen3-8b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--passes", default="default,gemm-bf16,attn-bf16,gemm-bf16-out")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--ctx", type=int, default=0, help="KV capacity (default: --tokens; `graphir bench` runs at the "
                                                       "model's own ctx)")
    args = ap.parse_args()
    import cupy as cp
    from graphir.backends.gpu.device import stream
    from graphir.backends.registry import get_backend

    from graphir.passes import run_pipeline

    model = graphir.load(args.model, backend="gpu", passes=args.passes, ctx=args.ctx or args.tokens)
    graph = run_pipeline(model.graph("prefill", args.tokens, last_only=True), args.passes)
    gpu = get_backend("gpu")
    program, state = gpu.lower(graph, model.weights), gpu.new_state(graph)
    rows = np.arange(args.tokens, dtype=np.int32)
    feeds = {"tokens": (rows % 200 + 1).astype(np.int32), "pos": rows, "kv_idx": rows,
             "kv_len": np.array([args.tokens], np.int32)}
    program(feeds, state)  # loads every kernel, warms clocks
    t0 = time.perf_counter()
    program(feeds, state)
    whole = time.perf_counter() - t0

    s = stream()
    per: dict[str, list[float]] = {}
    with s:
        marks = [cp.cuda.Event() for _ in range(len(program._steps) + 1)]
        marks[0].record(s)
        for i, step in enumerate(program._steps):
            step()
            marks[i + 1].record(s)
        marks[-1].synchronize()
    for i, step in enumerate(program._steps):
        name = getattr(step, "name", type(step).__name__)
        per.setdefault(name, []).append(cp.cuda.get_elapsed_time(marks[i], marks[i + 1]) * 1e3)
    total = sum(sum(v) for v in per.values())
    print(f"model {args.model}, passes {args.passes}: prefill of {args.tokens} tokens = {len(program._steps)} "
          f"steps; whole call {whole * 1e3:.1f} ms ({args.tokens / whole:,.0f} tok/s), steps on the GPU "
          f"{total / 1e3:.1f} ms")
    print(f"{'step':<60} {'calls':>5} {'ms':>8} {'share':>6}")
    for name, v in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
        print(f"{name[:60]:<60} {len(v):5d} {sum(v) / 1e3:8.2f} {100 * sum(v) / total:5.1f}%")


if __name__ == "__main__":
    main()
