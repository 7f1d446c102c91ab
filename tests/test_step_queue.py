"""generate() with decode steps queued ahead of the host (api.Model._generate_queued).

The gpu backend's StepQueue (backends/gpu/step_queue.py) runs the next step before the host has read the
last id. The loop's bookkeeping (which steps count, where n_past ends, what an EOS or a caller stopping
early leaves behind) does not depend on the device, so here it runs on the reference backend with a
stand-in queue that executes each pushed step at once: a step pushed ahead really runs and really writes
the State, as on the GPU. tests/test_gpu_step_queue.py runs the real queue against the one-step loop.
"""

from __future__ import annotations

import types
from collections import deque

import numpy as np
import pytest

import graphir
from graphir import api
from graphir.errors import InputError

PROMPT = list(b"Once upon a time")
SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 5}


class RunAtPushQueue:
    """StepQueue's interface over any Program: a push runs the step now (feed_back: the last step's id)."""

    depth = 2

    def __init__(self, program, state, feedback):
        self.program, self.state = program, state
        self.out_name, self.in_name = feedback
        self.done: deque = deque()
        self.last = None

    @property
    def in_flight(self) -> int:
        return len(self.done)

    def push(self, inputs, feed_back=False):
        self._run(inputs, feed_back)

    def _run(self, inputs, feed_back):
        assert self.in_flight < self.depth
        inputs = {k: np.array(v, copy=True) for k, v in inputs.items()}
        if feed_back:
            inputs[self.in_name] = self.last.copy()
        out = self.program(inputs, self.state)
        self.last = out[self.out_name]
        self.done.append(out)

    def pop(self):
        return self.done.popleft()

    def drain(self):
        self.done.clear()


@pytest.fixture
def queued(monkeypatch):
    """api.get_backend gives every backend a StepQueue (the stand-in); yields the pushes made."""
    real = api.get_backend
    pushes = []

    class Counting(RunAtPushQueue):
        def push(self, inputs, feed_back=False):
            pushes.append(int(np.asarray(inputs["pos"])[0]))
            super().push(inputs, feed_back)

    def with_queue(name):
        return types.SimpleNamespace(**vars(real(name)), StepQueue=Counting)

    monkeypatch.setattr(api, "get_backend", with_queue)
    return pushes


def load(spec, **kw):
    return graphir.load(spec, backend="reference", passes="default", ctx=64, **kw)


def plain(spec, **kw):
    """The same model running the one-step loop (nothing queued ahead)."""
    model = load(spec, **kw)
    model._queues_ahead = lambda stop_at_eos: False
    return model


def continuation(model):
    """Logits of one more token fed after generate(): what the State and KV rows left behind give."""
    return model.feed([7])[-1]


@pytest.mark.parametrize("spec", ["random:qwen3-tiny", "random:qwen35-tiny"])
@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_queued_ids_equal_the_one_step_loop(spec, sampling, queued):
    model, ref = load(spec), plain(spec)
    got = list(model.generate(PROMPT, 10, stop_at_eos=False, **sampling))
    assert queued == list(range(len(PROMPT), len(PROMPT) + 9)), "one push per decode step, in position order"
    assert got == list(ref.generate(PROMPT, 10, stop_at_eos=False, **sampling))
    assert model.n_past == ref.n_past == len(PROMPT) + 9
    np.testing.assert_array_equal(continuation(model), continuation(ref))


@pytest.mark.parametrize("slots", [0, 40])
def test_eos_ends_the_loop_where_the_one_step_loop_ends_and_the_cache_agrees(slots, queued):
    extra = {"kv_slots": slots} if slots else {}
    model, ref = load("random:qwen3-tiny", **extra), plain("random:qwen3-tiny", **extra)
    free = list(ref.generate(PROMPT, 10, stop_at_eos=False))
    first = free.index(free[4])  # the EOS's first appearance
    model.eos_ids = ref.eos_ids = {free[4]}
    got = list(model.generate(PROMPT, 10))
    assert got == free[:first] == list(ref.generate(PROMPT, 10))
    assert queued[-1] == len(PROMPT) + first, "the queue ran a step past the EOS (what the rollback must undo)"
    assert model.n_past == ref.n_past == len(PROMPT) + first
    np.testing.assert_array_equal(continuation(model), continuation(ref))


def test_kv_model_stopped_early_continues_as_the_one_step_loop(queued):
    model, ref = load("random:qwen3-tiny"), plain("random:qwen3-tiny")
    for m in (model, ref):
        gen = m.generate(PROMPT, 20, stop_at_eos=False)
        [next(gen) for _ in range(5)]
        gen.close()
    assert queued[-1] == len(PROMPT) + 4, "a step was queued past the last id read"
    assert model.n_past == ref.n_past == len(PROMPT) + 4
    np.testing.assert_array_equal(continuation(model), continuation(ref))


def test_recurrent_model_with_eos_runs_one_step_at_a_time(queued):
    model = load("random:qwen35-tiny")
    assert not model._pads_safely()
    model.eos_ids = {271}
    assert not model._queues_ahead(stop_at_eos=True)
    assert model._queues_ahead(stop_at_eos=False)
    list(model.generate(PROMPT, 6))
    assert queued == [], "a recurrent State with an EOS that may end the loop must not be stepped ahead"


def test_recurrent_state_left_ahead_is_refused_until_reset(queued):
    model = load("random:qwen35-tiny")
    gen = model.generate(PROMPT, 20, stop_at_eos=False)
    ids = [next(gen) for _ in range(4)]
    gen.close()
    assert model.n_past == len(PROMPT) + 3
    with pytest.raises(InputError, match="recurrent state .* ran one decode step past position"):
        model.feed([7])
    model.reset()
    model.feed(PROMPT + ids)  # after a reset the model runs again
    assert model.n_past == len(PROMPT) + 4


def test_a_queue_that_drops_the_fed_back_token_changes_the_ids(queued, monkeypatch):
    """The equality test above can fail: a queue that feeds the host's placeholder (0) instead of the last
    step's id gives other ids."""
    want = list(plain("random:qwen3-tiny").generate(PROMPT, 8, stop_at_eos=False))
    monkeypatch.setattr(RunAtPushQueue, "push", lambda self, inputs, feed_back=False:
                        RunAtPushQueue.__dict__["_run"](self, inputs, False))
    assert list(load("random:qwen3-tiny").generate(PROMPT, 8, stop_at_eos=False)) != want


@pytest.mark.parametrize("spec", ["random:qwen3-tiny", "random:qwen35-tiny"])
def test_queued_generators_start_fresh_and_refuse_an_overtaken_sequence(spec, queued):
    """As the one-step loop (tests/test_generate.py): two generators made before either runs each give their own
    prompt's ids; one overtaken by logits() between two tokens raises, and leaves n_past to the new sequence."""
    model, ref = load(spec), plain(spec)
    want = list(ref.generate(PROMPT, 8, stop_at_eos=False)), list(ref.generate(PROMPT[:5], 8, stop_at_eos=False))
    first, second = model.generate(PROMPT, 8, stop_at_eos=False), model.generate(PROMPT[:5], 8, stop_at_eos=False)
    assert (list(first), list(second)) == want
    it = model.generate(PROMPT, 8, stop_at_eos=False)
    assert [next(it), next(it)] == want[0][:2]
    model.logits(PROMPT[:4])
    with pytest.raises(InputError, match="started a new sequence"):
        next(it)
    ref.logits(PROMPT[:4])
    assert model.n_past == ref.n_past == 4
    np.testing.assert_array_equal(continuation(model), continuation(ref))
    it = model.generate(PROMPT, 8, stop_at_eos=False)  # feed() moves n_past without a reset: caught as well
    assert [next(it), next(it)] == want[0][:2]
    model.feed([3, 4])
    fed = model.n_past
    with pytest.raises(InputError, match="fed the cache"):
        next(it)
    assert model.n_past == fed  # the overtaken generator's cleanup leaves n_past to the call that moved it
