"""Where a decode token's time goes: time every bound step of the cached CPU decode Program.

    python benchmarks/profile_decode.py [MODEL] [--prompt 256] [--threads N] [--tokens 512] [--passes default]

Feeds a prompt of --prompt tokens (so attention sees that many keys), then replays the decode
step's bound kernels one by one and prints milliseconds per token by op, largest first.
--tokens N profiles the N-token prefill call instead (N a prefill bucket, e.g. 512; times per call).
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
from graphir.backends.cpu import threads

import graphir


def cpu_program(spec: str, passes: str, prompt: int, tokens: int = 1):
    """(the model, its cached cpu Program of `tokens` tokens) after a prompt of `prompt` tokens (so attention sees
    that many keys); tokens > 1: a prefill bucket's Program, from a reset model."""
    model = graphir.load(spec, backend="cpu", passes=passes)
    model.feed(np.arange(prompt) % 256 + 1, last_only=True)
    model.feed([1])  # lowers the decode Program
    if tokens > 1:
        model.reset()
        model.feed(np.arange(tokens) % 256 + 1, last_only=True)  # lowers that bucket's Program
    return model, next(p for _, p, _ in model.programs._programs.values() if p.graph.inputs[0].shape == (tokens,))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: auto, as a run decides)")
    ap.add_argument("--tokens", type=int, default=1, help="profile the call of this many tokens (1: decode)")
    ap.add_argument("--passes", default="default", help="the pipeline (e.g. default,q8-activations)")
    args = ap.parse_args()
    threads.set_threads(args.threads)
    model, program = cpu_program(args.model, args.passes, args.prompt, args.tokens)
    per_op: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    threads.apply()  # the steps below are replayed without the Program call that would set it
    for _ in range(args.repeats):
        for step, label in zip(program._steps, program._step_nodes):
            t0 = time.perf_counter()
            step()
            op = label.split()[2]
            per_op[op] += time.perf_counter() - t0
            calls[op] += 1
    total = sum(per_op.values()) / args.repeats
    what = "decode token" if args.tokens == 1 else f"{args.tokens}-token call"
    print(f"{args.model}: {total * 1e3:.2f} ms per {what} at position {model.n_past}, "
          f"{len(program._steps)} bound steps, {threads.numba.get_num_threads()} threads")
    for op, seconds in sorted(per_op.items(), key=lambda kv: -kv[1]):
        print(f"  {op:20s} {seconds / args.repeats * 1e3:8.3f} ms  ({calls[op] // args.repeats} calls)")


if __name__ == "__main__":
    main()
