"""Decode tok/s on the cpu backend at 128, 1k and 4k keys, next to what the bytes allow.

    python benchmarks/bench_cpu_long_context.py [MODEL ...] [--contexts 128,1024,3968] [--tokens 32] [--threads N]
        [--passes default --passes default,kv-f16]

For each context L: a prompt of L tokens (prefill), then --tokens greedy one-token decode steps, timed
one by one; the best of --repeats runs is kept (the machine is shared). The prediction assumes
a decode step at L keys costs the 128-key step plus the extra KV bytes read at the streaming
bandwidth measured here (numba, one thread, 256 MB): t(L) = t(128) + (kv(L) - kv(128)) / bandwidth,
kv(L) = L x (bytes of one K and one V row, all layers). It is the best the attention kernel can
do without making KV rows smaller; issue 13 asks for t(1k) and t(4k) within 15% of t(128).
With several --passes (kv-f16: f16 KV rows, half the bytes) the runs interleave, pipeline by pipeline.
"""

from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np
from graphir.backends.cpu import threads
from numba import njit, prange

import graphir


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _read_rows(rows, parts, out):
    """Sum each lane over the rows (so nothing is optimized away): a streaming read of `rows`."""
    for p in prange(parts):
        for i in range(rows.shape[1]):
            out[p, i] = 0.0
        for r in range(p * rows.shape[0] // parts, (p + 1) * rows.shape[0] // parts):
            for i in range(64):
                out[p, i] += rows[r, i]


def read_bandwidth(n_threads: int, repeats: int = 7) -> float:
    """Bytes per second one streaming read of 256 MB reaches with n_threads threads (best of repeats)."""
    rows = np.random.default_rng(0).standard_normal((2 ** 20, 64), dtype=np.float32)
    out = np.empty((n_threads, 64), np.float32)
    numba.set_num_threads(n_threads)
    _read_rows(rows, n_threads, out)
    best = min(_timed(lambda: _read_rows(rows, n_threads, out)) for _ in range(repeats))
    return rows.nbytes / best


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def kv_bytes_per_row(model: graphir.Model) -> int:
    """Bytes of one position's K and V rows over all layers (from the model's KV-cache State)."""
    model._ensure_state()
    caches = [a for name, a in model._state.items() if name.endswith(("k_cache", "v_cache"))]
    return sum(a.nbytes // a.shape[0] for a in caches)


def decode_rate(model: graphir.Model, context: int, tokens: int) -> float:
    """tok/s of `tokens` greedy decode steps after a prompt of `context` tokens."""
    model.reset()
    logits = model.feed(np.arange(context) % 200 + 10, last_only=True)
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits = model.feed([int(np.argmax(logits[-1]))])
    return tokens / (time.perf_counter() - t0)


def bench(spec: str, contexts: list[int], tokens: int, repeats: int, bandwidth: float, pipelines: list[str]) -> None:
    """Each pipeline's model measured at every context, runs interleaved (repeat, context, pipeline), so
    the pipelines see the same machine load."""
    models = {p: graphir.load(spec, backend="cpu", passes=p, ctx=max(contexts) + tokens + 1) for p in pipelines}
    rates: dict[str, dict[int, float]] = {p: {} for p in pipelines}
    for model in models.values():
        decode_rate(model, contexts[0], 4)  # compiles and binds the decode Program (numba's cache may be cold)
    for _ in range(repeats):
        for L in contexts:
            for p, model in models.items():
                rates[p][L] = max(rates[p].get(L, 0.0), decode_rate(model, L, tokens))
    for p, model in models.items():
        _report(spec, p, model, contexts, rates[p], bandwidth)


def _report(spec: str, passes: str, model: graphir.Model, contexts: list[int], rates: dict[int, float],
            bandwidth: float) -> None:
    row = kv_bytes_per_row(model)
    dtypes = sorted({str(a.dtype) for n, a in model._state.items() if n.endswith("_cache")})
    print(f"{spec} --passes {passes}: KV {row} bytes a position ({'/'.join(dtypes)}), threads "
          f"{threads.threads_now()}")
    base_L = contexts[0]
    base_t = 1.0 / rates[base_L]
    print(f"  {'context':>8} {'tok/s':>8} {'vs ' + str(base_L):>8} {'KV MB/token':>12} {'predicted tok/s':>16} "
          f"{'measured/predicted':>19}")
    for L in contexts:
        predicted = 1.0 / (base_t + (L - base_L) * row / bandwidth)
        print(f"  {L:8d} {rates[L]:8.1f} {rates[L] / rates[base_L]:8.2f} {L * row / 1e6:12.1f} {predicted:16.1f} "
              f"{rates[L] / predicted:19.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["smollm2-135m", "random:llama-tiny"])
    ap.add_argument("--contexts", default="128,1024,3968", help="prompt lengths, the first is the baseline")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    ap.add_argument("--repeats", type=int, default=2, help="runs per context; the best is kept")
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: auto, as a run decides)")
    ap.add_argument("--passes", action="append", default=None,
                    help="pass pipeline, repeatable: each is measured, interleaved with the others "
                         "(e.g. --passes default --passes default,kv-f16); default: default")
    args = ap.parse_args()
    threads.set_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    bandwidths = {t: read_bandwidth(t) for t in (1, numba.config.NUMBA_NUM_THREADS)}
    print("streaming read: " + ", ".join(f"{t} thread(s) {b / 1e9:.1f} GB/s" for t, b in bandwidths.items()))
    contexts = [int(c) for c in args.contexts.split(",")]
    for spec in args.models:
        bench(spec, contexts, args.tokens, args.repeats, max(bandwidths.values()), args.passes or ["default"])
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
