"""Decode tok/s of pass pipelines on one backend, interleaved round by round in one process.

    python benchmarks/bench_pipelines.py                                  # auto against default on the cpu
    python benchmarks/bench_pipelines.py --passes cpu --passes default,q8-activations --rounds 10

`graphir bench` runs one pipeline per process, so a burst of load from another program lands on one
pipeline only. Here each round decodes `--decode` greedy tokens after a `--prompt`-token prompt with every
pipeline in turn (the order reversed every other round), as `graphir bench` times decode, and the ratio of
each round's pair (first pipeline / each other) is printed, so that a ratio is of runs that saw the same
machine.
"""

from __future__ import annotations

import argparse
import statistics

import graphir
from graphir.bench import _decode_s, token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--passes", action="append", help="a pipeline; give two or more (default: auto and default)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=128)
    a = ap.parse_args()
    models = {p: graphir.load(a.model, backend=a.backend, passes=p) for p in a.passes or ["auto", "default"]}
    prompt = token_ids(next(iter(models.values())), a.prompt)
    for model in models.values():
        _decode_s(model, prompt, 16)  # lowers the Programs and warms them
    rates: dict[str, list[float]] = {p: [] for p in models}
    for r in range(a.rounds):
        for p in list(models)[::1 if r % 2 == 0 else -1]:
            rates[p].append(a.decode / _decode_s(models[p], prompt, a.decode))
    first = next(iter(models))
    for p, v in rates.items():
        print(f"{p} ({models[p].passes}): decode best {max(v):.1f}, median {statistics.median(v):.1f} tok/s")
        if p != first:
            ratio = [x / y for x, y in zip(rates[first], v)]
            print(f"  per-round {first} / {p}: min {min(ratio):.3f}, median {statistics.median(ratio):.3f}, "
                  f"max {max(ratio):.3f}")


if __name__ == "__main__":
    main()
