"""Decode-step time by site for several pipelines, interleaved in one process: where one pipeline loses to another.

    python benchmarks/profile_decode_sites.py [MODEL] --passes default,q16-activations --passes default,q8-activations
        [--prompt 128] [--rounds 6] [--repeats 30]

profile_decode.py's replay of the cached decode Program's bound steps, with every pipeline's Program replayed in
turn each round (so a slow spell of a noisy machine lands on all of them), and matmuls split by site (the head,
q|k|v, o, gate|up, down) instead of summed by op. Prints, per pipeline and site, the median, p25 and min over all
repeats of the milliseconds a step spends there; the per-site medians summed make the step.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
from graphir.backends.cpu import threads
from profile_decode import cpu_program  # beside this script

SITES = ("logits", "attn_q", "attn_out", "gate_up", "ffn_out", "ffn_act")  # SmolLM2 / llama node names


def site(label: str) -> str:
    """'node %12 mul_mat_q16x 'blk.0.attn_q+...' [1, 960] f32' -> 'mul_mat_q16x attn_q'; other ops by op name."""
    _, _, op, *rest = label.split()
    if not op.startswith("mul_mat"):
        return op
    return f"{op} " + next((s for s in SITES if s in " ".join(rest)), "other")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--passes", action="append", help="a pipeline; give it once per pipeline")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=30, help="replays of each Program a round")
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: auto, as a run decides)")
    args = ap.parse_args()
    pipelines = args.passes or ["default"]
    threads.set_threads(args.threads)
    programs = {p: cpu_program(args.model, p, args.prompt)[1] for p in pipelines}
    threads.apply()  # the steps below are replayed without the Program call that would set it
    ms: dict[str, dict[str, list[float]]] = {p: collections.defaultdict(list) for p in pipelines}
    for _ in range(args.rounds):
        for p, program in programs.items():
            for _ in range(args.repeats):
                step_ms: dict[str, float] = collections.defaultdict(float)
                for step, label in zip(program._steps, program._step_nodes):
                    t0 = time.perf_counter()
                    step()
                    step_ms[site(label)] += (time.perf_counter() - t0) * 1e3
                for k, v in step_ms.items():
                    ms[p][k].append(v)
    for p in pipelines:
        print(f"{p}: {sum(np.median(v) for v in ms[p].values()):.2f} ms a step (sum of medians), "
              f"{threads.numba.get_num_threads()} threads")
        for k, v in sorted(ms[p].items(), key=lambda kv: -np.median(kv[1])):
            print(f"  {k:28s} median {np.median(v):6.3f}  p25 {np.percentile(v, 25):6.3f}  min {np.min(v):6.3f}")


if __name__ == "__main__":
    main()
