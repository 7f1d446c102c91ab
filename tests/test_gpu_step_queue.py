"""Decode steps queued ahead of the host on the device (backends/gpu/step_queue.py; the GPU suite, marker `gpu`).

generate() on the gpu backend keeps the next step queued while the host reads the last id, the id itself
fed from step to step on the device. Everything must be what the one-step loop (GRAPHIR_NO_QUEUE=1) gives:
the ids, where the sequence ends, and the KV rows and recurrent State left for the next token.
tests/test_step_queue.py covers the loop's bookkeeping on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu_helpers import gpu_only
from graphir.backends.gpu import StepQueue

import graphir
from graphir.errors import BackendError
from graphir.generate import SAMPLING_INPUT, TOKEN_OUTPUT, Settings

pytestmark = [pytest.mark.gpu, gpu_only]

PROMPT = list(b"Once upon a time, in a land far away")
SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 3}


def run(spec: str, queue: bool, monkeypatch, n: int = 40, eos_at: int | None = None, **kw):
    """(ids, n_past, logits of one more token) from a fresh gpu model."""
    monkeypatch.setenv("GRAPHIR_NO_QUEUE", "0" if queue else "1")
    model = graphir.load(spec, backend="gpu", passes="default", ctx=128)
    if eos_at is not None:
        model.eos_ids = {eos_at}
    ids = list(model.generate(PROMPT, n, stop_at_eos=eos_at is not None, **kw))
    n_past = model.n_past
    queued = model._queues_ahead(eos_at is not None)
    return ids, n_past, model.feed([9])[-1], queued


@pytest.mark.parametrize("spec", ["random:qwen3-tiny", "random:qwen35-tiny", "random:llama-tiny"])
@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_queued_generate_equals_the_one_step_loop(spec, sampling, monkeypatch):
    ids, n_past, after, queued = run(spec, True, monkeypatch, **sampling)
    want_ids, want_n, want_after, plain = run(spec, False, monkeypatch, **sampling)
    assert queued and not plain
    assert ids == want_ids
    assert n_past == want_n == len(PROMPT) + 39
    np.testing.assert_array_equal(after, want_after)  # the same kernels on the same State: bitwise


def test_an_eos_rolls_back_the_step_queued_past_it(monkeypatch):
    free, _, _, _ = run("random:qwen3-tiny", False, monkeypatch)
    eos = free[7]
    ids, n_past, after, queued = run("random:qwen3-tiny", True, monkeypatch, eos_at=eos)
    want_ids, want_n, want_after, _ = run("random:qwen3-tiny", False, monkeypatch, eos_at=eos)
    assert queued
    assert ids == want_ids == free[:free.index(eos)]
    assert n_past == want_n
    np.testing.assert_array_equal(after, want_after)


def queue_for(model):
    model._ensure_state(model._graph(1, False, sampler=True))
    program = model._program(1, False, sampler=True)
    return StepQueue(program, model._state, feedback=(TOKEN_OUTPUT, "tokens"))


def step_feeds(pos: int, token: int = 5) -> dict[str, np.ndarray]:
    row = Settings().row()[None, :]
    return {"tokens": np.array([token], np.int32), "pos": np.array([pos], np.int32),
            "kv_idx": np.array([pos], np.int32), "kv_len": np.array([pos + 1], np.int32), SAMPLING_INPUT: row}


def test_feed_back_carries_the_sampled_id_into_the_next_step():
    """Step 1 fed back must be step 1 fed the host's copy of step 0's id (greedy: deterministic)."""
    a = graphir.load("random:qwen3-tiny", backend="gpu", passes="default", ctx=64)
    a.feed(PROMPT)
    b = graphir.load("random:qwen3-tiny", backend="gpu", passes="default", ctx=64)
    b.feed(PROMPT)
    n = len(PROMPT)
    qa, qb = queue_for(a), queue_for(b)
    qa.push(step_feeds(n))
    qa.push(step_feeds(n + 1, token=0), feed_back=True)
    first, second = qa.pop()[TOKEN_OUTPUT], qa.pop()[TOKEN_OUTPUT]
    qb.push(step_feeds(n))
    assert qb.pop()[TOKEN_OUTPUT][0] == first[0]
    qb.push(step_feeds(n + 1, token=int(first[0])))
    assert qb.pop()[TOKEN_OUTPUT][0] == second[0]


def test_a_kernel_error_in_a_queued_step_raises_at_its_pop():
    model = graphir.load("random:qwen3-tiny", backend="gpu", passes="default", ctx=64)
    q = queue_for(model)
    q.push(step_feeds(3))
    q.push(step_feeds(64))  # KV row 64 of a 64-row cache: the row write reports it
    q.pop()
    with pytest.raises(BackendError, match="node %"):
        q.pop()


def test_queue_limits_are_clear_errors():
    model = graphir.load("random:qwen3-tiny", backend="gpu", passes="default", ctx=64)
    q = queue_for(model)
    with pytest.raises(BackendError, match="feed_back needs"):
        q.push(step_feeds(0), feed_back=True)
    q.push(step_feeds(0))
    q.push(step_feeds(1))
    with pytest.raises(BackendError, match="in flight already"):
        q.push(step_feeds(2))
    q.drain()
    with pytest.raises(BackendError, match="no step in flight"):
        q.pop()
