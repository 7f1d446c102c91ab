"""How far f16 KV caches (the kv-f16 pass) move a model's logits and greedy text from f32 caches.

    python benchmarks/kv_f16_drift.py [MODEL] [--backend cpu] [--continuation 256] [--greedy 32]

1. Greedy-decode --continuation tokens after a fixed prompt with f32 KV; then feed prompt + that text
   (teacher-forced, one prefill each) to both models and compare the continuation rows' logits:
   max |diff| / max |logit|, and how often the argmax differs.
2. Greedy text of --greedy tokens from each model: equal, or the first step where they part and the f32
   model's top-2 logit gap there (a small gap: a near tie that any rounding may flip).
"""

from __future__ import annotations

import argparse

import numpy as np

import graphir

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--greedy", type=int, default=32)
    args = ap.parse_args()
    f32 = graphir.load(args.model, backend=args.backend, passes="default")
    f16 = graphir.load(args.model, backend=args.backend, passes="default,kv-f16")
    prompt = f32.tokenizer.encode(PROMPT)
    text = list(f32.generate(prompt, args.continuation, stop_at_eos=False))
    ids = prompt + text[:-1]
    rows = slice(len(prompt) - 1, len(ids))  # the rows that predict the continuation
    a, b = f32.logits(ids)[rows], f16.logits(ids)[rows]
    rel = float(np.abs(a - b).max() / np.abs(a).max())
    flips = int((a.argmax(-1) != b.argmax(-1)).sum())
    print(f"{args.model}: prompt {len(prompt)} tokens, continuation {len(text)}: max |diff| / max |logit| "
          f"{rel:.2e} (max |diff| {np.abs(a - b).max():.4f}, max |logit| {np.abs(a).max():.2f}); "
          f"argmax differs at {flips} of {len(text)} rows")
    g32 = list(f32.generate(prompt, args.greedy, stop_at_eos=False))
    g16 = list(f16.generate(prompt, args.greedy, stop_at_eos=False))
    if g32 == g16:
        print(f"greedy {args.greedy} tokens: equal: {f32.tokenizer.decode(g32)!r}")
        return
    at = next(i for i, (x, y) in enumerate(zip(g32, g16)) if x != y)
    top = np.sort(f32.logits(prompt + g32[:at])[-1])[-2:]
    print(f"greedy {args.greedy} tokens: first differ at step {at} (top-2 gap of the f32 logits there "
          f"{top[1] - top[0]:.4f}): f32 {f32.tokenizer.decode(g32)!r} / f16 {f16.tokenizer.decode(g16)!r}")


if __name__ == "__main__":
    main()
