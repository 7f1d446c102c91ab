"""Sampling and the generation loop: seeded draws, greedy limits, EOS."""

from __future__ import annotations

import numpy as np
import pytest

import graphir
from graphir.errors import InputError
from graphir.generate import make_sampler

PROMPT = list(b"Once upon a time")


@pytest.fixture(scope="module")
def model():
    return graphir.load("random:qwen3-tiny", backend="reference", passes="")


@pytest.fixture(scope="module")
def greedy(model):
    return list(model.generate(PROMPT, 12, stop_at_eos=False))


def test_greedy_is_argmax_of_logits(model, greedy):
    ids = PROMPT + greedy
    expected = model.logits(ids)[len(PROMPT) - 1:-1].argmax(-1)
    assert greedy == expected.tolist()


def test_seeded_sampling_is_reproducible(model):
    def run(seed):
        return list(model.generate(PROMPT, 12, temperature=1.0, top_k=50, top_p=0.95, seed=seed, stop_at_eos=False))

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c  # 12 draws from a spread-out distribution: equal only by a ~0 chance


def test_top_k_1_is_greedy(model, greedy):
    assert list(model.generate(PROMPT, 12, temperature=1.5, top_k=1, seed=0, stop_at_eos=False)) == greedy


def test_tiny_top_p_is_greedy(model, greedy):
    assert list(model.generate(PROMPT, 12, temperature=1.5, top_p=1e-9, seed=0, stop_at_eos=False)) == greedy


def test_eos_stops_and_is_not_yielded(model, greedy):
    k = next(i for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    saved = model.eos_ids
    model.eos_ids = {greedy[k]}
    try:
        assert list(model.generate(PROMPT, 12)) == greedy[:k]
        assert list(model.generate(PROMPT, 12, stop_at_eos=False)) == greedy
    finally:
        model.eos_ids = saved
    assert model.eos_ids == {257}  # the byte tokenizer's <|eos|>


def test_generation_is_lazy_and_counted(model, greedy):
    it = model.generate(PROMPT, 12, stop_at_eos=False)
    assert model.stats["prefill_tokens"] == 0
    assert next(it) == greedy[0]
    assert model.stats["prefill_tokens"] == len(PROMPT) and model.stats["decode_tokens"] == 0
    assert list(it) == greedy[1:]
    assert model.stats["decode_tokens"] == 11
    assert list(model.generate(PROMPT, 0)) == []


@pytest.mark.parametrize("draft", [None, "lookup"])
def test_generators_made_before_they_run_each_start_fresh(model, greedy, draft):
    """generate() runs lazily: a generator made, then another, then both read in turn must each give its own
    prompt's tokens (the second read on after the first one's cache: 'a fresh KV cache' was not)."""
    spec = {} if draft is None else {"draft": draft}
    other = list(model.generate(PROMPT[:5], 6, stop_at_eos=False, **spec))
    first = model.generate(PROMPT, 12, stop_at_eos=False, **spec)
    second = model.generate(PROMPT[:5], 6, stop_at_eos=False, **spec)
    assert (list(first), list(second)) == (greedy, other)


@pytest.mark.parametrize("draft", [None, "lookup"])
def test_a_generator_overtaken_by_a_new_sequence_refuses_to_go_on(model, greedy, draft):
    """logits(), reset(), feed() or another generate() between two tokens replace or extend the cache a generator
    reads on: it raises instead of yielding tokens of a mixed-up sequence (it went on with wrong ids, without a
    word; feed() did until the generator also checked where it had left n_past)."""
    spec = {} if draft is None else {"draft": draft}
    for overtake in (lambda: model.logits(PROMPT[:4]), model.reset, lambda: model.feed([3, 4]),
                     lambda: list(model.generate(PROMPT[:3], 2, **spec))):
        it = model.generate(PROMPT, 12, stop_at_eos=False, **spec)
        assert [next(it), next(it)] == greedy[:2]
        overtake()
        with pytest.raises(InputError, match="started a new sequence"):
            list(it)
        assert list(model.generate(PROMPT, 12, stop_at_eos=False, **spec)) == greedy  # the model is usable


# ---- the sampler alone, on fixed logits ----

LOGITS = np.log(np.array([0.1, 0.5, 0.25, 0.15]))


def draws(n: int = 4000, **kw) -> np.ndarray:
    sample = make_sampler(seed=123, **kw)
    return np.bincount([sample(LOGITS) for _ in range(n)], minlength=4) / n


def test_temperature_1_follows_softmax():
    assert np.abs(draws(temperature=1.0) - [0.1, 0.5, 0.25, 0.15]).max() < 0.03


def test_top_k_keeps_the_k_most_likely():
    freq = draws(temperature=1.0, top_k=2)
    assert freq[0] == 0 and freq[3] == 0
    assert abs(freq[1] - 2 / 3) < 0.03


def test_top_p_keeps_the_smallest_set_reaching_p():
    freq = draws(temperature=1.0, top_p=0.7)  # 0.5 < 0.7 <= 0.5 + 0.25: tokens 1 and 2
    assert freq[0] == 0 and freq[3] == 0
    assert abs(freq[1] - 2 / 3) < 0.03


def test_low_temperature_sharpens():
    assert draws(temperature=0.05)[1] > 0.99


def test_greedy_ties_take_the_first_index():
    assert make_sampler()(np.array([1.0, 3.0, 3.0])) == 1


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_k=-1), dict(top_k=1.5), dict(top_p=0.0),
                                dict(top_p=1.5), dict(temperature=float("nan"))])
def test_bad_sampling_options(kw):
    with pytest.raises(InputError):
        make_sampler(**kw)
