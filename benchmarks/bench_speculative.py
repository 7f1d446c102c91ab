"""Speculative decoding against plain decoding, in the same run: SmolLM2 converted to F32 as the target,
drafted by SmolLM2 Q4_1 and by prompt lookup on a prompt that asks for an edit of a given paragraph.

    python benchmarks/bench_speculative.py [--backend cpu] [--new 128] [--draft-lens 3,5,7]

Decode tok/s counts the tokens after the first (which prefill gives) over the time after prefill:
drafting, verify calls and acceptance for speculative runs, decode steps for plain ones. Each
configuration runs once to compile and warm, then is timed; the outputs must equal plain greedy's.
"""

from __future__ import annotations

import argparse
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


def decode_rate(run, model) -> tuple[list[int], float]:
    run()  # compile and warm every Program this configuration uses
    out = run()
    s = model.stats
    return out, s["decode_tokens"] / s["decode_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--draft-lens", default="3,5,7")
    args = ap.parse_args()
    t0 = time.perf_counter()
    target = graphir.load("smollm2-135m", backend=args.backend, dtype="f32")
    draft = graphir.load("smollm2-135m", backend=args.backend)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {platform.processor() or platform.machine()}, "
          f"backend {args.backend}")
    tok = target.tokenizer
    rows = []
    for label, prompt_text, drafters in (("story", STORY, {"SmolLM2 Q4_1": draft, "lookup": "lookup"}),
                                         ("paragraph edit", EDIT, {"SmolLM2 Q4_1": draft, "lookup": "lookup"})):
        prompt = tok.encode(prompt_text)
        plain, plain_rate = decode_rate(lambda p=prompt: list(target.generate(p, args.new, stop_at_eos=False)),
                                        target)
        rows.append((label, "plain decode", "-", plain_rate, 1.0, "-", "-"))
        for name, drafter in drafters.items():
            for k in (int(x) for x in args.draft_lens.split(",")):
                run = lambda p=prompt, d=drafter, k=k: list(sp.generate(target, d, p, args.new, draft_len=k,
                                                                       stop_at_eos=False))
                out, rate = decode_rate(run, target)
                if out != plain:
                    raise SystemExit(f"{label}, {name}, draft_len {k}: output differs from plain greedy decoding")
                st = sp.last_stats(target)
                rows.append((label, name, k, rate, rate / plain_rate, f"{st.acceptance:.2f}",
                             f"{st.tokens_per_verify:.2f}"))
        print(f"{label}: {len(prompt)} prompt tokens; plain output {tok.decode(plain)[:100]!r}...")
    print(f"\n{args.new} new tokens, greedy; outputs equal plain greedy decoding\n")
    print("| prompt | drafter | draft_len | decode tok/s | speedup | acceptance | tokens / verify |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for label, name, k, rate, speedup, acc, tpv in rows:
        print(f"| {label} | {name} | {k} | {rate:.1f} | {speedup:.2f}x | {acc} | {tpv} |")


if __name__ == "__main__":
    main()
