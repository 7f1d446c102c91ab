"""Speculative decoding against plain decoding, in the same run: SmolLM2 converted to F32 as the target,
drafted by SmolLM2 Q4_1 and by prompt lookup (adaptive draft length, and a fixed one for comparison) on a
prompt that asks for an edit of a given paragraph.

    python benchmarks/bench_speculative.py [--backend cpu] [--new 128] [--draft-lens 3,7,15] [--prompts story,edit]
                                           [--drafters q4_1,lookup,fixed]
    python benchmarks/bench_speculative.py --model-lookup   # prompt lookup's draft length in a cost model

Decode tok/s counts the tokens after the first (which prefill gives) over the time after prefill:
drafting, verify calls and acceptance for speculative runs, decode steps for plain ones. Each
configuration runs --repeat times, interleaved with the others, after a round that compiles and warms, each
run right after a plain decoding run: the speedup is the best speculative rate over the best of its own plain
runs (as many of each), with the median of the pairs' ratios beside it; every output must equal plain
greedy decoding's.

--model-lookup replays prompt lookup over plain greedy outputs with a cost model instead of a clock: each
verify call costs its bucket's measured time (call_ms), a draft is kept as far as it matches the output.
It is deterministic given the call costs, so it compares draft-length rules where a shared machine's timings
cannot. DEV_EDITS are prompts of our own, on which the adaptive rule was chosen; the benchmark's prompts
are reported beside them, not used to choose.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import graphir
from graphir import speculative as sp
from graphir.generate import Settings

STORY = ("<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a bottle."
         "<|im_end|>\n<|im_start|>assistant\n")
PARAGRAPH = ("The old lighthouse stood on the northern cliff for more than two hundred years. Every night its keeper "
             "climbed the ninety steps to light the lamp, and every morning he wrote the weather, the ships he had "
             "seen and the state of the sea in a thick leather book. When the storms came in winter, the whole "
             "tower shook, but the light never went out.")
EDIT = (f"<|im_start|>user\nRewrite this paragraph, replacing 'keeper' with 'guardian' and changing nothing "
        f"else:\n\n{PARAGRAPH}<|im_end|>\n<|im_start|>assistant\n")


DEV_EDITS = {
    "garden": "Rewrite this paragraph, replacing 'garden' with 'orchard' and changing nothing else:\n\nBehind the "
              "house there was a small garden with three apple trees and a row of tall sunflowers. My grandmother "
              "worked in the garden every morning before breakfast, pulling weeds and talking to the birds that "
              "followed her. In the autumn we picked the apples together and carried them to the cellar in wooden "
              "baskets.",
    "tense": "Rewrite this paragraph in the past tense, changing nothing else:\n\nThe train leaves the station at "
             "seven. Passengers crowd the platform with their bags and coffee cups, and the conductor walks along "
             "the cars checking tickets. Outside the window the city slowly gives way to fields, and a quiet "
             "settles over the carriage as people open their books.",
    "typos": "Correct the spelling mistakes in this text and change nothing else:\n\nThe comittee met on Tuesday to "
             "discus the new budjet. Every member agreed that the library needs more money for books, but nobody "
             "could say where the money should come from. The meeting ended late and the decision was postponed "
             "untill next month.",
    "poem": "Write a short poem about the sea at night.",
}


def modelled_speedup(prompt: list[int], plain: list[int], lookup: sp.PromptLookup, k: int,
                     costs: dict[int, float]) -> tuple[float, float]:
    """(speedup over plain decoding, tokens per verify) of greedy prompt lookup with draft_len k producing
    `plain`, when a call of b tokens costs costs[b] and nothing else costs anything."""
    lookup.start()
    context, produced, spent, calls = [*prompt, plain[0]], 1, 0.0, 0
    while produced < len(plain):
        cap = min(k, len(plain) - produced - 1)
        draft = lookup.propose(context, cap, Settings()).tokens[:cap] if cap else []
        kept = 0
        while kept < len(draft) and draft[kept] == plain[produced + kept]:
            kept += 1
        spent += costs[sp.verify_bucket(1 + len(draft), sp.VERIFY_BUCKETS[-1])]
        calls += 1
        lookup.observe(len(draft), kept)
        context += plain[produced:produced + kept + 1]
        produced += kept + 1
    return (len(plain) - 1) * costs[1] / spent, (len(plain) - 1) / calls


def model_lookup(target, new: int, lens: list[int]) -> None:
    costs = {b: call_ms(target, b) for b in (1, *sp.VERIFY_BUCKETS)}
    print("call costs, ms: " + ", ".join(f"{b} tokens {c:.1f}" for b, c in costs.items()))
    print("\n| prompt | " + " | ".join(f"{name} {k}" for name in ("fixed", "adaptive") for k in lens) + " |")
    print("| --- |" + " ---: |" * (2 * len(lens)))
    texts = {**{f"dev: {name}": f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
                for name, text in DEV_EDITS.items()}, "bench: story": STORY, "bench: paragraph edit": EDIT}
    for label, text in texts.items():
        prompt = target.tokenizer.encode(text)
        plain = list(target.generate(prompt, new, stop_at_eos=False))
        cells = [modelled_speedup(prompt, plain, sp.PromptLookup(adaptive=adaptive), k, costs)
                 for adaptive in (False, True) for k in lens]
        print(f"| {label} | " + " | ".join(f"{s:.2f}x ({t:.2f})" for s, t in cells) + " |")
    print("\n(modelled speedup over plain decoding (tokens per verify call))")


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
    ap.add_argument("--draft-lens", default="3,7,15")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", default="story,edit", help="of story, edit")
    ap.add_argument("--drafters", default="q4_1,lookup,fixed", help="of q4_1, lookup, fixed (lookup, fixed length)")
    ap.add_argument("--model-lookup", action="store_true", help="prompt lookup's draft length in a cost model")
    args = ap.parse_args()
    t0 = time.perf_counter()
    target = graphir.load("smollm2-135m", backend=args.backend, dtype="f32")
    if args.model_lookup:
        model_lookup(target, args.new, [int(x) for x in args.draft_lens.split(",")])
        return
    draft = graphir.load("smollm2-135m", backend=args.backend)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, backend {args.backend}; load average {os.getloadavg()[0]:.1f}")
    tok = target.tokenizer
    lens = [int(x) for x in args.draft_lens.split(",")]
    fixed = sp.PromptLookup(adaptive=False)  # the draft length always the cap: the adaptive one's baseline
    drafters = {"q4_1": ("SmolLM2 Q4_1", draft), "lookup": ("lookup", "lookup"),
                "fixed": ("lookup, fixed length", fixed)}
    configs = [(*drafters[key], k) for key in args.drafters.split(",") for k in lens]
    prompts = {"story": ("story", STORY), "edit": ("paragraph edit", EDIT)}
    rows, stats = [], {}
    for label, text in (prompts[key] for key in args.prompts.split(",")):
        prompt = tok.encode(text)
        plain = run_config(target, prompt, args.new, None, 0)[0]  # also compiles and warms
        # rates[config]: (plain decode, speculative) tok/s of each round. Configurations interleaved round by
        # round, each run right after a plain one: the machine is shared, and a slow spell then hits a
        # configuration and its baseline alike. Best of each over the same number of runs (a baseline with
        # more runs than its rival would have more chances of a quiet moment), and the median of the pairs.
        rates: dict[tuple[str, object], list[tuple[float, float]]] = {}
        for r in range(args.repeat + 1):  # the first round compiles and warms
            for name, d, k in configs:
                plain_rate = run_config(target, prompt, args.new, None, 0)[1]
                out, rate_, acc, tpv = run_config(target, prompt, args.new, d, k)
                if out != plain:
                    raise SystemExit(f"{label}, {name}, draft_len {k}: output differs from plain greedy decoding")
                if r:
                    rates.setdefault((name, k), []).append((plain_rate, rate_))
                    stats[name, k] = (acc, tpv)
        for name, _, k in configs:
            pairs = rates[name, k]
            best_plain, best_spec = max(p for p, _ in pairs), max(q for _, q in pairs)
            median = statistics.median(q / p for p, q in pairs)
            rows.append((label, name, k, best_plain, best_spec, best_spec / best_plain, median, *stats[name, k]))
        print(f"{label}: {len(prompt)} prompt tokens; plain output {tok.decode(plain)[:100]!r}...")
    print(f"\n{args.new} new tokens, greedy, best of {args.repeat}; outputs equal plain greedy decoding; "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| prompt | drafter | draft_len | plain tok/s | speculative tok/s | speedup (best / best) | "
          "median pair | acceptance | tokens / verify |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, name, k, plain_rate, spec_rate, speedup, median, acc, tpv in rows:
        print(f"| {label} | {name} | {k} | {plain_rate:.1f} | {spec_rate:.1f} | {speedup:.2f}x | {median:.2f}x | "
              f"{acc} | {tpv} |")
    # what a verify call costs against a decode step bounds the speedup: tokens per verify over this ratio
    print("\n| call (greedy, at position 100) | " + " | ".join(f"{b} tokens" for b in (1, *sp.VERIFY_BUCKETS)) + " |")
    print("| --- |" + " ---: |" * (1 + len(sp.VERIFY_BUCKETS)))
    for name, model in (("target F32, ms", target), ("draft Q4_1, ms", draft)):
        print(f"| {name} | " + " | ".join(f"{call_ms(model, b):.1f}" for b in (1, *sp.VERIFY_BUCKETS)) + " |")


if __name__ == "__main__":
    main()
