"""Prefill-512 with the prefill attention kernel (attention_prefill.py) against the kernel before it
(kernels.attention), and llama.cpp, interleaved in one process.

    python benchmarks/bench_cpu_prefill_ab.py [--threads 2] [--rounds 5]

Two SmolLM2 models: one lowered as usual, one lowered with attention_prefill.supports patched to
refuse (so its prefill attention is kernels.attention); each round times a prefill of 512 tokens
with each, then llama.cpp's (n_threads=2), so all three see the same machine. Needs llama-cpp-python.
"""

from __future__ import annotations

import argparse
import os
import statistics

import llama_cpp
from graphir.backends.cpu import attention_prefill as ATP
from graphir.backends.cpu import threads

import graphir
from graphir.bench import LlamaCpp, _prefill_s, token_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    threads.set_threads(args.threads)
    new = graphir.load("smollm2-135m", backend="cpu", passes="default")
    old = graphir.load("smollm2-135m", backend="cpu", passes="default")
    ids = token_ids(new, 512)
    _prefill_s(new, ids)  # lowers the 512-token Program with the prefill kernel
    supports = ATP.supports
    ATP.supports = lambda *a: False  # this model's prefill attention lowers to kernels.attention
    try:
        _prefill_s(old, ids)
    finally:
        ATP.supports = supports
    llm = LlamaCpp(llama_cpp, new.source, ids, ids[:1], 0, 2)
    llm.prefill_s()
    rates: dict[str, list[float]] = {"before": [], "after": [], "llama.cpp": []}
    for r in range(args.rounds):
        rates["before"].append(512 / _prefill_s(old, ids))
        rates["after"].append(512 / _prefill_s(new, ids))
        rates["llama.cpp"].append(512 / llm.prefill_s())
        print(f"round {r}: " + "  ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items())
              + f" tok/s  load {os.getloadavg()[0]:.2f}", flush=True)
    for k, v in rates.items():
        print(f"{k}: best {max(v):.1f} median {statistics.median(v):.1f}")
    for k in ("before", "after"):
        print(f"{k} / llama.cpp per round:", [round(a / b, 2) for a, b in zip(rates[k], rates["llama.cpp"])])


if __name__ == "__main__":
    main()
