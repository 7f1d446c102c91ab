"""Short prompts and prompt tails run as one padded prefill call, never as a loop of decode steps.

Padding tokens go first in the call and write KV rows past the real tokens' rows: the real tokens
never read them (kv_len stops below), and the next tokens overwrite them before anyone does.
"""

from __future__ import annotations

import numpy as np
import pytest

import graphir

IDS = [72, 101, 108, 108, 111, 44, 32, 256, 119, 111, 114, 108, 100, 33, 7, 90, 61, 5, 250, 18, 1]
PADDED = ["random:llama-tiny", "random:gemma3-tiny"]


def _exact(model, ids):
    """Logits of one unpadded call holding exactly these tokens: the path padding must reproduce."""
    saved = model.prefill_buckets
    model.prefill_buckets = (len(ids),)
    try:
        assert model.chunks(len(ids)) == [len(ids)]
        return model.logits(ids)
    finally:
        model.prefill_buckets = saved


def _close(got, want, what):
    assert got.shape == want.shape, what
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-5, f"{what}: max error {err:.2e} of max|logit|"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("spec", PADDED)
def test_padded_prefill_equals_unpadded(spec, backend):
    model = graphir.load(spec, backend=backend, passes="default" if backend == "cpu" else "")
    for n in (2, 5, 7, 13, 21):
        plan = model.chunks(n)
        assert 1 not in plan and sum(plan) > n, (n, plan)  # one padded call at the end, no decode steps
        _close(model.logits(IDS[:n]), _exact(model, IDS[:n]), f"{spec} {backend} {n} tokens as {plan}")
    model.reset()
    _close(model.feed(IDS[:5], last_only=True), _exact(model, IDS[:5])[-1:], "last_only")


@pytest.mark.parametrize("spec", PADDED)
def test_rows_written_by_padding_are_never_read(spec):
    """Poison every KV row at or past n_past after each padded call: what follows must not change."""
    model = graphir.load(spec, backend="cpu", passes="default")
    clean = [model.logits(IDS[:5]), model.feed(IDS[5:8]), model.feed([9]), model.feed(IDS[8:])]
    model.reset()
    got = []
    for part in (IDS[:5], IDS[5:8], [9], IDS[8:]):
        got.append(model.feed(part))
        for buf in model._state.values():  # KV caches: [ctx, ...], row = position
            buf[model.n_past:] = np.nan
    for i, (g, c) in enumerate(zip(got, clean)):
        assert np.isfinite(g).all(), f"call {i} read a poisoned row"
        np.testing.assert_array_equal(g, c)


def test_recurrent_models_take_exact_chunks():
    """A padding token would advance a recurrent state, so hybrids keep exact chunks (and stay right)."""
    model = graphir.load("random:qwen35-tiny", backend="reference", passes="")
    assert model.chunks(13) == [8, 1, 1, 1, 1, 1]
    _close(model.logits(IDS[:13]), _exact(model, IDS[:13]), "qwen35 13 tokens")


def test_plan_near_the_end_of_the_context_pads_only_into_free_rows():
    model = graphir.load("random:llama-tiny", backend="reference", passes="", ctx=16)
    assert model.chunks(5) == [8]
    model.n_past = 10  # 6 rows left: an 8-token call would write past the cache
    assert model.chunks(5) == [1, 1, 1, 1, 1]
    assert model.chunks(1) == [1]


def _least_cost(n: int, buckets: tuple[int, ...], call_cost: int, pad_room: int) -> float:
    """The least modelled cost of reading n tokens, searched top-down (an independent statement of chunks()'s
    rule: a call costs its bucket plus call_cost; only the last call may be padded, within pad_room rows)."""
    from functools import cache

    sizes = sorted(set(buckets) - {1})

    @cache
    def rest(k: int) -> float:  # k tokens left, read from position n - k
        if k == 0:
            return 0.0
        options = [1 + call_cost + rest(k - 1)] if k == 1 or not any(b <= k or n - k + b <= pad_room
                                                                      for b in sizes) else []
        options += [b + call_cost + rest(k - b) for b in sizes if b <= k]
        options += [b + call_cost for b in sizes if b > k and n - k + b <= pad_room]
        return min(options)

    for k in range(n):  # smallest first: each call then recurses one level only
        rest(k)
    return rest(n)


@pytest.mark.parametrize("ctx", [64, 4096])
def test_chunk_plans_have_the_least_modelled_cost(ctx):
    """Every plan reads exactly n tokens (padding only in its last call, within the context) at the least
    modelled cost, over GPU-like and CPU-like bucket sets; asking again (the memo) gives the same plan."""
    model = graphir.load("random:llama-tiny", backend="reference", passes="", ctx=ctx)
    for buckets, cost in (((4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 1), 64), ((512, 128, 32, 8, 1), 3)):
        model.prefill_buckets, model.call_cost = buckets, cost
        for n_past in (0, ctx - 40):
            model.n_past = n_past
            room = ctx - n_past
            for n in [1, 2, 7, 9, 33, 40, 63] + ([511, 1025, 3000] if n_past == 0 and ctx > 1000 else []):
                if n > room:
                    continue
                plan = model.chunks(n)
                assert model.chunks(n) == plan
                assert sum(plan[:-1]) < n <= sum(plan) and sum(plan) <= room, (n, plan)
                got = sum(b + cost for b in plan)
                assert got == _least_cost(n, buckets, cost, room), (buckets, n_past, n, plan)
