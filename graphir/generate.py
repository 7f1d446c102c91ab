"""Model-agnostic generation: sampling from logits and the prefill-then-decode loop.

Sampling order (as llama.cpp's default chain): top-k, then temperature, softmax, then top-p
(keep the smallest set of most likely tokens whose probability reaches p), then draw.
temperature 0 or top_k 1 is greedy: the first index of the largest logit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

import numpy as np

from graphir.errors import InputError

Sampler = Callable[[np.ndarray], int]


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not temperature >= 0.0:
        raise InputError(f"temperature must be >= 0, got {temperature}")
    if not (isinstance(top_k, (int, np.integer)) and top_k >= 0):
        raise InputError(f"top_k must be an int >= 0 (0: off), got {top_k!r}")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> Sampler:
    """logits [vocab] -> token id. `seed` makes draws reproducible (a fresh numpy Generator per sampler)."""
    check_sampling(temperature, top_k, top_p)
    rng = np.random.default_rng(seed)

    def sample(logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if temperature == 0.0 or top_k == 1:
            return int(np.argmax(logits))
        order = np.argsort(-logits, kind="stable")  # most likely first, lower id first on ties
        if top_k:
            order = order[:top_k]
        z = logits[order] / temperature
        p = np.exp(z - z[0])
        p /= p.sum()
        if top_p < 1.0:
            # keep tokens while the mass before them is below top_p (the first is always kept)
            keep = int(np.searchsorted(np.cumsum(p), top_p, side="left")) + 1
            order, p = order[:keep], p[:keep] / p[:keep].sum()
        return int(order[rng.choice(len(p), p=p)])

    return sample


def generate(prefill: Callable[[list[int]], np.ndarray], decode: Callable[[int], np.ndarray],
             prompt_ids: list[int], max_new_tokens: int, sample: Sampler,
             eos_ids: Collection[int] = (), stop_at_eos: bool = True) -> Iterator[int]:
    """Yield up to max_new_tokens ids. `prefill(ids)` returns the last position's logits;
    `decode(id)` feeds one token and returns the next logits. An EOS id ends the loop unyielded."""
    if max_new_tokens <= 0:
        return
    logits = prefill(list(prompt_ids))
    for i in range(max_new_tokens):
        token = sample(logits)
        if stop_at_eos and token in eos_ids:
            return
        yield token
        if i + 1 < max_new_tokens:
            logits = decode(token)
