"""graphir's cpu backend and llama.cpp on the same GGUF, runs interleaved in one process.

    python benchmarks/bench_cpu_vs_llama.py [MODEL] [--rounds 5] [--decode 128] [--threads 2]

`graphir bench` runs all of graphir's repeats and then all of llama.cpp's, so a burst of load
from another program lands on one side only. Here each round runs graphir's decode, llama.cpp's
decode, graphir's prefill-512 and llama.cpp's prefill-512 back to back (the same measurements as
`graphir bench`: decode after a 128-token prompt, counted from the first sampled token; prefill
from an empty cache), and prints best and median tok/s of each side and the ratio of each round's
pair, so that the ratio is of runs that saw the same machine. Needs llama-cpp-python.
"""

from __future__ import annotations

import argparse
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
    args = ap.parse_args()
    threads.set_threads(args.threads or None)
    model = graphir.load(args.model, backend="cpu", passes="default")
    ids = token_ids(model, max(args.prefill, args.prompt))
    prompt, prefill = ids[: args.prompt], ids[: args.prefill]
    llm = LlamaCpp(llama_cpp, model.source, prefill, prompt, args.decode, args.threads or 2)
    _decode_s(model, prompt, 8), llm.decode_s(), _prefill_s(model, prefill), llm.prefill_s()  # warm-up
    rows: dict[str, list[float]] = {k: [] for k in ("g_dec", "l_dec", "g_pre", "l_pre")}
    for r in range(args.rounds):
        rows["g_dec"].append(args.decode / _decode_s(model, prompt, args.decode))
        rows["l_dec"].append(args.decode / llm.decode_s())
        rows["g_pre"].append(args.prefill / _prefill_s(model, prefill))
        rows["l_pre"].append(args.prefill / llm.prefill_s())
        print(f"round {r}: decode {rows['g_dec'][-1]:6.1f} vs {rows['l_dec'][-1]:6.1f} "
              f"({rows['g_dec'][-1] / rows['l_dec'][-1]:.2f}x)  prefill {rows['g_pre'][-1]:6.1f} vs "
              f"{rows['l_pre'][-1]:6.1f} ({rows['g_pre'][-1] / rows['l_pre'][-1]:.2f}x)  load {os.getloadavg()[0]:.2f}",
              flush=True)
    for name, g, ll in (("decode", "g_dec", "l_dec"), (f"prefill-{args.prefill}", "g_pre", "l_pre")):
        ratios = [a / b for a, b in zip(rows[g], rows[ll])]
        print(f"{name}: graphir best {max(rows[g]):.1f} median {statistics.median(rows[g]):.1f}; llama.cpp best "
              f"{max(rows[ll]):.1f} median {statistics.median(rows[ll]):.1f}; best/best "
              f"{max(rows[g]) / max(rows[ll]):.2f}x, per-round ratio min {min(ratios):.2f} "
              f"median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
