"""Where a GPU decode token's time goes: the whole Model.feed step, the Program call alone, and the
captured CUDA graph alone.

    python benchmarks/profile_gpu_decode.py [MODEL] [--prompt 128] [--tokens 200]

(graph alone) is what the GPU needs per token; (Program call) adds the Input copy, the output copy
to the host and the error-flag read; (Model.feed) adds the model's Python around it. The gaps are
host time per token, which the replay issue brings down.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import graphir


def per_call_us(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    from graphir.backends.gpu.device import stream

    model = graphir.load(args.model, backend="gpu", passes="default")
    model.feed(np.arange(args.prompt) % 200 + 1, last_only=True)
    model.feed([1])
    model.feed([2])  # the decode Program is captured on its second call
    program = model._program(1, False)
    assert program.captured, "decode Program not captured"
    feed_us = per_call_us(lambda: model.feed([3]), args.tokens)
    n = model.n_past
    feeds = {"tokens": np.array([3], np.int32), "pos": np.array([n], np.int32), "kv_idx": np.array([n], np.int32),
             "kv_len": np.array([n + 1], np.int32)}
    call_us = per_call_us(lambda: program(feeds, model._state), args.tokens)
    s = stream()

    def graph_only() -> None:
        program._graph_exec.launch(s)
        s.synchronize()

    graph_us = per_call_us(graph_only, args.tokens)
    steps = len(program._steps)
    print(f"model {args.model}: decode step = {steps} kernels, captured; context {n}")
    print(f"{'what':<34} {'us/token':>9}")
    for what, us in (("Model.feed (whole step)", feed_us), ("Program call", call_us),
                     ("captured graph alone (launch+sync)", graph_us)):
        print(f"{what:<34} {us:9.1f}")
    print(f"graph time per kernel: {graph_us / steps:.2f} us; host time per token: {feed_us - graph_us:.1f} us")


if __name__ == "__main__":
    main()
