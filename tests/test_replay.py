"""Replay: the one cached decode Program, run at any position, is bitwise equal to a freshly built and
lowered Program at that position. Positions cover 0, bucket and chunk boundaries and capacity - 1.

A builder that bakes a position into the graph (here: a sliding KV window whose view offset is the
position) is caught twice: replay-lint names the node, and the differential replay sees the numbers move.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
from graphir.backends.registry import get_backend
from graphir.models import llama

import graphir
from graphir import taint
from graphir.builder import g
from graphir.errors import GraphError
from graphir.passes import run_pipeline
from graphir.run_inputs import new_state

CTX = 160
PRESETS = ["random:llama-tiny", "random:qwen3-tiny", "random:qwen35-tiny"]
# 0, the first steps, prefill bucket sizes and their neighbours (1, 8, 32, 128), 64 (the CPU DeltaNet
# chunk), and the last two rows of the KV capacity.
SPECIAL = [0, 1, 2, 7, 8, 9, 31, 32, 33, 63, 64, 65, 127, 128, 129, CTX - 2, CTX - 1]


def positions(n: int = 100, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    rest = [int(p) for p in rng.permutation(CTX) if p not in SPECIAL]
    return sorted(SPECIAL + rest[: n - len(SPECIAL)])


def random_state(graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Every State buffer filled with non-zero values (KV rows the sequence never wrote included)."""
    rng = np.random.default_rng(seed)
    state = new_state(graph)
    for buf in state.values():
        buf[...] = (rng.uniform(0.1, 1.0, buf.shape) * rng.choice([-1, 1], buf.shape)).astype(buf.dtype)
    return state


def step_inputs(pos: int, token: int) -> dict[str, np.ndarray]:
    p = np.array([pos], np.int32)
    return {"tokens": np.array([token], np.int32), "pos": p, "kv_idx": p, "kv_len": np.array([pos + 1], np.int32)}


def fresh_program(model, build=None):
    """A new graph object, a new pass pipeline run and a new lowering: nothing shared with the cache."""
    graph = build() if build else model.graph("decode")
    if model.passes:
        graph = run_pipeline(graph, model.passes)
    return get_backend(model.backend).lower(graph, model.weights)


def copy_state(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in state.items()}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on 2 shared cores: waking a second numba thread per kernel costs more than the work
    (~8 ms a kernel when the cores are busy). Results do not depend on the thread count (each output
    element is computed by one thread); test_replay_with_threads runs a few positions with them."""
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


@pytest.fixture(scope="module", params=PRESETS)
def model(request):
    return graphir.load(request.param, backend="cpu", passes="default", ctx=CTX)


def test_position_list_covers_the_boundaries():
    ps = positions()
    assert len(ps) >= 100 and len(set(ps)) == len(ps)
    assert {0, 1, 7, 8, 31, 32, 127, 128, 129, CTX - 2, CTX - 1} <= set(ps)


def check_replay(model, ps: list[int]) -> None:
    model.feed([1])  # the model's own path lowers (and caches) its decode program
    misses = model.programs.misses
    cached = model.programs.get_program(model.graph("decode"), model.weights, model.backend, model.passes)
    assert model.programs.misses == misses  # a hit: the Program every later token replays
    live = random_state(model.graph("decode"))  # the cached program's own buffers: bound once, then replayed
    tokens = np.random.default_rng(1).integers(0, model.config.n_vocab, CTX)
    for pos in ps:
        before, fresh = copy_state(live), copy_state(live)
        inputs = step_inputs(pos, int(tokens[pos]))
        want = fresh_program(model)(inputs, fresh)["logits"]
        got = cached(inputs, live)["logits"]  # the sequence moves on: recurrent states evolve, KV rows pile up
        assert np.array_equal(got, want), f"{model.source}: logits differ at position {pos}"
        for name in live:
            assert np.array_equal(live[name], fresh[name]), f"{model.source}: state {name} at position {pos}"
        assert any(not np.array_equal(live[k], before[k]) for k in live)  # the step wrote its rows
    assert model.programs.misses == misses


def test_cached_decode_program_equals_fresh_program_bitwise(model):
    check_replay(model, positions())


def test_replay_with_threads(model):
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    try:
        check_replay(model, [0, 8, 33, 128, CTX - 1])
    finally:
        numba.set_num_threads(1)


def test_decode_graph_structure_has_no_per_step_value(model):
    a, b = model.graph("decode"), model.graph("decode")
    assert a is not b and a.signature() == b.signature()
    assert run_pipeline(a, model.passes).signature() == run_pipeline(b, model.passes).signature()
    assert run_pipeline(a, "replay-lint") is a


def test_generating_40_tokens_lowers_one_decode_program(model):
    model.programs.clear()
    prompt = list(b"Hello, world!")
    out = list(model.generate(prompt, 40, stop_at_eos=False))
    assert len(out) == 40
    lowered, misses = len(model.programs), model.programs.misses
    assert lowered <= 3  # the prompt's bucket(s) and one decode step program, nothing per position
    out = list(model.generate(list(b"Bonjour, monde"[:13]), 40, stop_at_eos=False))  # other tokens, same shapes
    assert model.programs.misses == misses and len(model.programs) == lowered
    model.programs.get_program(model._graph(1, sampler=True), model.weights, model.backend, model.passes)
    assert model.programs.misses == misses  # the decode step generate() ran is the cached one


# ---------------------------------------------------------------- a builder that bakes the position in
WINDOW = 8


def windowed_attention(position: int):
    """llama's attention over the last WINDOW KV rows, read as a view at a build-time offset: the bug."""

    def attention(c, p, i, h, pos, kv_idx, kv_len):
        n, b = h.shape[0], f"blk.{i}."
        q = g.reshape(g.mul_mat(p(b + "attn_q.weight"), h), shape=(n, c.n_heads, c.head_dim))
        k = g.reshape(g.mul_mat(p(b + "attn_k.weight"), h), shape=(n, c.n_kv_heads, c.head_dim))
        v = g.reshape(g.mul_mat(p(b + "attn_v.weight"), h), shape=(n, c.n_kv_heads, c.head_dim))
        rope = {"n_dims": c.head_dim, "mode": c.rope_mode, "theta": float(c.rope_theta)}
        q, k = g.rope(q, pos, name=b + "q_rope", **rope), g.rope(k, pos, name=b + "k_rope", **rope)
        shape = (c.ctx, c.n_kv_heads, c.head_dim)
        k_all = g.set_rows(g.state(b + "k_cache", shape), k, kv_idx, name=b + "k_cache_write")
        v_all = g.set_rows(g.state(b + "v_cache", shape), v, kv_idx, name=b + "v_cache_write")
        start = taint.step(position, "position") - (WINDOW - 1)  # rows start..position
        k_win = g.rows(k_all, start, WINDOW, name=b + "k_window")
        v_win = g.rows(v_all, start, WINDOW, name=b + "v_window")
        n_win = g.const([WINDOW], "i32")  # every window row is valid
        o = g.flash_attn(q, k_win, v_win, pos, n_win, scale=1.0 / math.sqrt(c.head_dim), name=b + "attn")
        o = g.reshape(o, shape=(n, c.n_heads * c.head_dim))
        return g.mul_mat(p(b + "attn_output.weight"), o, name=b + "attn_out")

    return attention


@pytest.fixture(scope="module")
def llama_tiny():
    return graphir.load("random:llama-tiny", backend="cpu", passes="", ctx=CTX)


def window_inputs(pos: int) -> dict[str, np.ndarray]:
    inputs = step_inputs(pos, 5)
    del inputs["kv_len"]  # the window's length is a const
    return inputs


def broken_decode(model, position: int, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(llama, "_attention", windowed_attention(position))
        return model.graph("decode")


def test_replay_lint_names_the_baked_window_view(llama_tiny, monkeypatch):
    graph = broken_decode(llama_tiny, 40, monkeypatch)
    with pytest.raises(GraphError, match=r"replay-lint: .*view 'blk\.0\.k_window'.*param offset=1056 .*position=40"):
        run_pipeline(graph, "replay-lint")
    with pytest.raises(GraphError, match="replay-lint"):
        run_pipeline(graph, "default")  # the default pipeline lints too
    assert run_pipeline(llama_tiny.graph("decode"), "replay-lint")  # the real builder passes


def test_replay_differential_catches_the_baked_window(llama_tiny, monkeypatch):
    """Lowered at position 40 and replayed at 41..: it reads rows 33..40 forever, a fresh build does not."""
    def build_at(position: int):
        return fresh_program(llama_tiny, lambda: broken_decode(llama_tiny, position, monkeypatch))

    cached = build_at(40)
    state = random_state(llama_tiny.graph("decode"), seed=2)
    # at the position it was built for the broken program is right, so a one-position test misses it
    a, b = copy_state(state), copy_state(state)
    assert np.array_equal(cached(window_inputs(40), a)["logits"], build_at(40)(window_inputs(40), b)["logits"])
    for pos in (41, 47, 100, CTX - 1):
        a, b = copy_state(state), copy_state(state)
        got, want = cached(window_inputs(pos), a)["logits"], build_at(pos)(window_inputs(pos), b)["logits"]
        assert not np.allclose(got, want, rtol=1e-3, atol=1e-3), f"the replayed window was not caught at {pos}"
