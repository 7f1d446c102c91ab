"""graphir's cpu backend and llama.cpp on the same GGUF, runs interleaved in one process.

    python benchmarks/bench_cpu_vs_llama.py [MODEL] [--rounds 5] [--decode 128] [--threads 2] [--passes P ...]

`graphir bench` runs all of graphir's repeats and then all of llama.cpp's, so a burst of load
from another program lands on one side only. Here each round runs graphir's decode, llama.cpp's
decode, graphir's prefill-512 and llama.cpp's prefill-512 back to back (the same measurements as
`graphir bench`: decode after a 128-token prompt, counted from the first sampled token; prefill
from an empty cache), and prints best and median tok/s of each side and the ratio of each round's
pair, so that the ratio is of runs that saw the same machine. Needs llama-cpp-python.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics

import llama_cpp
from graphir.backends.cpu import threads

import graphir
from graphir.bench import LlamaCpp, _decode_s, _prefill_s, token_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="graphir's and llama.cpp's threads (0: graphir auto)")
    ap.add_argument("--passes", action="append", help="a pipeline (default: default); given more than once, each "
                                                      "round runs every pipeline, each paired with a llama.cpp run")
    args = ap.parse_args()
    threads.set_threads(args.threads or None)
    models = {p: graphir.load(args.model, backend="cpu", passes=p) for p in args.passes or ["default"]}
    model = next(iter(models.values()))
    ids = token_ids(model, max(args.prefill, args.prompt))
    prompt, prefill = ids[: args.prompt], ids[: args.prefill]
    llm = LlamaCpp(llama_cpp, model.source, prefill, prompt, args.decode, args.threads or 2)
    for m in models.values():  # warm-up
        _decode_s(m, prompt, 8), llm.decode_s(), _prefill_s(m, prefill), llm.prefill_s()
    rows: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for r in range(args.rounds):
        for p, m in models.items():
            row = {"g_dec": args.decode / _decode_s(m, prompt, args.decode), "l_dec": args.decode / llm.decode_s(),
                   "g_pre": args.prefill / _prefill_s(m, prefill), "l_pre": args.prefill / llm.prefill_s()}
            for k, v in row.items():
                rows[p, k].append(v)
            dec, pre = row["g_dec"] / row["l_dec"], row["g_pre"] / row["l_pre"]
            print(f"round {r} {p}: decode {row['g_dec']:6.1f} vs {row['l_dec']:6.1f} ({dec:.2f}x)  prefill "
                  f"{row['g_pre']:6.1f} vs {row['l_pre']:6.1f} ({pre:.2f}x)  load {os.getloadavg()[0]:.2f}", flush=True)
    for p in models:
        for name, g, ll in (("decode", "g_dec", "l_dec"), (f"prefill-{args.prefill}", "g_pre", "l_pre")):
            gs, ls = rows[p, g], rows[p, ll]
            ratios = [a / b for a, b in zip(gs, ls)]
            print(f"{p} {name}: graphir best {max(gs):.1f} median {statistics.median(gs):.1f}; llama.cpp best "
                  f"{max(ls):.1f} median {statistics.median(ls):.1f}; best/best {max(gs) / max(ls):.2f}x, per-round "
                  f"ratio min {min(ratios):.2f} median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
