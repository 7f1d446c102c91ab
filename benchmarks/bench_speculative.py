"""Speculative decoding against plain decoding, in the same run: SmolLM2 converted to F32 as the target,
drafted by SmolLM2 Q4_1 and by prompt lookup on a prompt that asks for an edit of a given paragraph.

    python benchmarks/bench_speculative.py [--backend cpu] [--new 128] [--draft-lens 3,5,7]

Decode tok/s counts the tokens after the first (which prefill gives) over the time after prefill:
drafting, verify calls and acceptance for speculative runs, decode steps for plain ones. Each
configuration runs --repeat times, interleaved with the others, after a round that compiles and warms;
the best rate is kept, and every output must equal plain greedy decoding's.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import graphir
from graphir import speculative as sp

STORY = ("<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a bottle."
         "<|im_end|>\n<|im_start|>assistant\n")
PARAGRAPH = ("The old lighthouse stood on the northern cliff for more than two hundred years. Every night its keeper "
             "climbed the ninety steps to light the lamp, and every morning he wrote the weather, the ships he had "
             "seen and the state of the sea in a thick leather book. When the storms came in winter, the whole "
             "tower shook, but the light never went out.")
EDIT = (f"<|im_start|>user\nRewrite this paragraph, replacing 'keeper' with 'guardian' and changing nothing "
        f"else:\n\n{PARAGRAPH}<|im_end|>\n<|im_start|>assistant\n")


def run_config(model, prompt: list[int], new: int, drafter, k: int) -> tuple[list[int], float, str, str]:
    """(output, decode tok/s, acceptance, tokens per verify) of one generation; drafter None: plain decode."""
    if drafter is None:
        return list(model.generate(prompt, new, stop_at_eos=False)), rate(model), "-", "-"
    out = list(sp.generate(model, drafter, prompt, new, draft_len=k, stop_at_eos=False))
    st = sp.last_stats(model)
    return out, rate(model), f"{st.acceptance:.2f}", f"{st.tokens_per_verify:.2f}"


def call_ms(model, b: int, repeat: int = 10) -> float:
    """Best time of a b-token greedy verify call (b = 1: the decode step) at position 100, in ms."""
    model.reset()
    model.feed(list(range(1000, 1100)))
    tokens = list(range(2000, 2000 + b))
    times = []
    for _ in range(repeat + 1):  # the first compiles and warms
        t0 = time.perf_counter()
        sp.verify(model, tokens, greedy=True)
        times.append(time.perf_counter() - t0)
    return 1000 * min(times[1:])


def rate(model) -> float:
    return model.stats["decode_tokens"] / model.stats["decode_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--draft-lens", default="3,5,7")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    target = graphir.load("smollm2-135m", backend=args.backend, dtype="f32")
    draft = graphir.load("smollm2-135m", backend=args.backend)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, backend {args.backend}")
    tok = target.tokenizer
    lens = [int(x) for x in args.draft_lens.split(",")]
    configs = [("plain decode", None, "-")] + [(name, d, k) for name, d in (("SmolLM2 Q4_1", draft),
                                                                           ("lookup", "lookup")) for k in lens]
    rows = []
    for label, text in (("story", STORY), ("paragraph edit", EDIT)):
        prompt = tok.encode(text)
        plain = run_config(target, prompt, args.new, None, 0)[0]  # also compiles and warms
        best = {}
        # configurations interleaved round by round, the best of --repeat rounds kept: the machine is shared,
        # and a slow spell then hits every configuration alike instead of one
        for _ in range(args.repeat + 1):  # the first round compiles and warms
            for name, d, k in configs:
                out, r, acc, tpv = run_config(target, prompt, args.new, d, k)
                if out != plain:
                    raise SystemExit(f"{label}, {name}, draft_len {k}: output differs from plain greedy decoding")
                best[name, k] = (max(r, best[name, k][0]) if (name, k) in best else 0.0, acc, tpv)
        for name, _, k in configs:
            r, acc, tpv = best[name, k]
            rows.append((label, name, k, r, r / best["plain decode", "-"][0], acc, tpv))
        print(f"{label}: {len(prompt)} prompt tokens; plain output {tok.decode(plain)[:100]!r}...")
    print(f"\n{args.new} new tokens, greedy, best of {args.repeat}; outputs equal plain greedy decoding; "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| prompt | drafter | draft_len | decode tok/s | speedup | acceptance | tokens / verify |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for label, name, k, r, speedup, acc, tpv in rows:
        print(f"| {label} | {name} | {k} | {r:.1f} | {speedup:.2f}x | {acc} | {tpv} |")
    # what a verify call costs against a decode step bounds the speedup: tokens per verify over this ratio
    print("\n| call (greedy, at position 100) | " + " | ".join(f"{b} tokens" for b in (1, *sp.VERIFY_BUCKETS)) + " |")
    print("| --- |" + " ---: |" * (1 + len(sp.VERIFY_BUCKETS)))
    for name, model in (("target F32, ms", target), ("draft Q4_1, ms", draft)):
        print(f"| {name} | " + " | ".join(f"{call_ms(model, b):.1f}" for b in (1, *sp.VERIFY_BUCKETS)) + " |")


if __name__ == "__main__":
    main()
