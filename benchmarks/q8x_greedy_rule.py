"""Issue 13's greedy rule for a fast cpu pipeline against the f32 one, on the parity prompts and 54 held-out ones.

    python benchmarks/q8x_greedy_rule.py [--passes default,q8-activations] [--held-out] [--x-bits N]
    python benchmarks/q8x_greedy_rule.py --passes default,q16-activations --held-out   (the 16-bit path)

The rule (issue 13): the fast path's greedy text equals the f32 path's for 16 tokens, or first differs where the
f32 path's top-2 logit gap is below 0.05. Per prompt: '.' equal, 'n' first differs at a near-tie, 'X' a miss.

Also the top-2 margin error, the quantity the rule turns on: fed the f32 path's greedy tokens, at every step,
|(fast[t1] - fast[t2]) - (f32[t1] - f32[t2])| for the f32 path's top two tokens t1, t2. A step whose gap is at
least 0.05 can only flip where this error exceeds the gap, so the rule holds on any prompt once it stays below 0.05.

--x-bits N replaces the cpu's 8-bit kernel (backends/cpu/gemv_q8x.py) by a numpy model of the same product with x
rounded per 32-value block to N-bit codes (scale max |x| / (2^(N-1) - 1), half away from zero) and multiplied by
the dequantized weight in f32: how many bits of x the rule needs. At N = 8 it is the kernel's formula up to float
order, not its bits.
"""

from __future__ import annotations

import argparse

import numpy as np
from q8x_logit_drift import PROMPTS

import graphir

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
HELD_OUT = [  # written for this check, never tuned on: 34 completions, 20 chat turns
    "The quick brown fox", "Once upon a time, in a small village,", "import numpy as np\n",
    "The largest planet in the solar system is", "Water boils at", "In 1492, Columbus", "def quicksort(arr):\n",
    "The theory of relativity states that", "SELECT * FROM users WHERE", "My favorite food is", "The mitochondria is",
    "To make a cup of tea, first", "class Stack:\n", "The stock market today", "Photosynthesis is the process by which",
    "The best way to learn a language is",
    *(CHAT.format(q) for q in [
        "What is the capital of Japan?", "Write a poem about autumn.", "Explain gravity to a child.",
        "Give me three tips for sleeping better.", "Translate 'good morning' into French.",
        "Write a limerick about a cat.", "What is 12 times 7?", "Tell me a joke about computers."]),
    "The history of Rome begins", "Dear Sir or Madam,", "for i in range(10):\n", "The recipe calls for two cups of",
    "Breaking news:", "The patient presented with", "function add(a, b) {\n", "The meaning of life is",
    "In mathematics, a prime number is", "The weather in London is usually", "Shakespeare wrote",
    "#include <stdio.h>\n", "The first step in solving any problem is", "Electric cars are", "The Amazon rainforest",
    "Here is a list of fruits:", "The Great Wall of China", "A neural network is", "She opened the door and saw",
    "The price of gold",
    *(CHAT.format(q) for q in [
        "How do I boil an egg?", "Name the planets in order.", "What is machine learning?",
        "Write a short story about a robot.", "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.",
        "What are the benefits of exercise?", "Write a haiku about mountains.", "How many legs does a spider have?",
        "Suggest a name for a pet dog."]),
]
TOKENS, NEAR_TIE = 16, 0.05


def greedy(model, ids: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """TOKENS greedy tokens and the logits each was picked from."""
    model.reset()
    logits, out, seen = model.feed(ids)[-1], [], []
    for _ in range(TOKENS):
        seen.append(logits)
        out.append(int(np.argmax(logits)))
        logits = model.feed([out[-1]])[-1]
    return out, seen


def teacher_forced(model, ids: list[int], tokens: list[int]) -> list[np.ndarray]:
    model.reset()
    out = [model.feed(ids)[-1]]
    return out + [model.feed([t])[-1] for t in tokens[:-1]]


def use_x_bits(bits: int) -> None:
    """Swap the cpu's mul_mat_q8x kernel for the N-bit numpy model (the module doc)."""
    from graphir.backends.cpu import gemv_q8x as GQ

    from graphir.quant import dequantize

    qmax = 2 ** (bits - 1) - 1

    def prepare(w_raw, dtype, x2, out2, cache=None, key=None, path=None):
        wt = dequantize(w_raw, dtype, (w_raw.shape[0], x2.shape[1])).T.copy()  # [n_in, n_out] f32

        def run() -> None:
            b = x2.reshape(x2.shape[0], -1, 32).astype(np.float64)
            d = np.abs(b).max(axis=-1, keepdims=True) / qmax
            q = np.sign(b) * np.floor(np.abs(b) / np.where(d > 0, d, 1.0) + 0.5)
            out2[...] = (q * d).reshape(x2.shape).astype(np.float32) @ wt

        return run

    GQ.prepare = prepare


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", default="default,q8-activations")
    ap.add_argument("--held-out", action="store_true", help="also the 54 held-out prompts")
    ap.add_argument("--x-bits", type=int, default=0, help="model x's codes with N bits instead of the kernel")
    args = ap.parse_args()
    if args.x_bits:
        use_x_bits(args.x_bits)
    f32 = graphir.load("smollm2-135m", backend="cpu", passes="default")
    fast = graphir.load("smollm2-135m", backend="cpu", passes=args.passes)
    marks, misses, margin = [], [], []
    for i, prompt in enumerate(PROMPTS + (HELD_OUT if args.held_out else [])):
        ids = f32.tokenizer.encode(prompt)
        want, seen = greedy(f32, ids)
        for a, b in zip(seen, teacher_forced(fast, ids, want)):
            t1, t2 = np.argsort(a)[-2:][::-1]
            margin.append(abs(float(b[t1] - b[t2]) - float(a[t1] - a[t2])))
        got, _ = greedy(fast, ids)
        first = next((s for s, (x, y) in enumerate(zip(got, want)) if x != y), None)
        gap = None if first is None else float(np.diff(np.sort(seen[first])[-2:])[0])
        marks.append("." if gap is None else "n" if gap < NEAR_TIE else "X")
        if gap is not None and gap >= NEAR_TIE:
            misses.append(f"#{i} step {first} gap {gap:.3f}")
    m = np.array(margin)
    print(f"{args.passes}{f' x-bits {args.x_bits}' if args.x_bits else ''}: parity {''.join(marks[:3])} "
          f"held-out {''.join(marks[3:])}; rule missed on {len(misses)} of {len(marks)}: {', '.join(misses) or '-'}")
    print(f"top-2 margin error over {m.size} steps: median {np.median(m):.4f}, p90 {np.percentile(m, 90):.4f}, "
          f"max {m.max():.3f}, above {NEAR_TIE} at {np.mean(m > NEAR_TIE):.1%} of steps")


if __name__ == "__main__":
    main()
