"""Captured gpu Programs replay exactly what uncaptured ones compute (the GPU suite, marker `gpu`).

A decode Program is captured into a CUDA graph on its second call; every later call only copies
the Inputs in and launches the graph. If any launch argument had been fixed from a run-time value
(a position, a KV row, kv_len), the replayed graph would read or write the wrong rows at later
positions: these tests walk many positions and compare bitwise against a Program that launches
every kernel from Python.
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu_helpers import captured_and_launched, gpu_only, host
from graphir.backends.gpu import matmul
from graphir.backends.registry import get_backend
from test_replay import step_inputs

import graphir

pytestmark = [pytest.mark.gpu, gpu_only]


def _decode_pair(spec: str, ctx: int, dtype: str | None = None, passes: str = "default"):
    model = graphir.load(spec, backend="gpu", passes=passes, ctx=ctx, dtype=dtype)
    from graphir.passes import run_pipeline

    graph = run_pipeline(model.graph("decode"), passes)
    gpu = get_backend("gpu")
    captured = gpu.lower(graph, model.weights)
    plain = gpu.lower(graph, model.weights)  # called with GRAPHIR_NO_CAPTURE=1 below
    return model, captured, plain, gpu.new_state(graph), gpu.new_state(graph)


# (spec, weight dtype, passes): the q8-activations cases run mul_mat_q8x, through its any-shape kernel (the tiny
# model's 64-wide rows) and its staged ones (Qwen3-0.6B's, the LM head included)
DECODE_CASES = [("random:llama-tiny", None, "default"), ("random:qwen3-tiny", None, "default"),
                ("random:qwen35-tiny", None, "default"), ("random:qwen3-tiny", "q4_0", "default,q8-activations"),
                ("random:qwen2-tiny", None, "default"),
                ("random:qwen3-0.6b", "q4_0", "default,q8-activations")]


@pytest.mark.parametrize("spec,dtype,passes", DECODE_CASES,
                         ids=[f"{s.split(':')[1]}-{d or 'file'}-{p}" for s, d, p in DECODE_CASES])
def test_captured_decode_equals_launched_decode_at_every_position(spec, dtype, passes, monkeypatch):
    ctx = 160
    model, captured, plain, s_cap, s_plain = _decode_pair(spec, ctx, dtype, passes)
    tokens = np.random.default_rng(3).integers(0, 256, ctx)
    for pos in range(ctx):  # 0, 1, every split and tile boundary of a 160-row cache, capacity - 1
        got, want = captured_and_launched(captured, plain, step_inputs(pos, tokens[pos]), s_cap, s_plain, monkeypatch,
                                          "logits")
        assert np.array_equal(got, want), f"{spec}: logits differ at position {pos}"
    assert captured.captured and not plain.captured
    for name in s_cap:
        assert np.array_equal(s_cap[name].get(), s_plain[name].get()), f"{spec}: state {name} differs"


@pytest.mark.parametrize("bucket", [8, 16, 32, 128])  # 16: the largest captured bucket (a verify call)
@pytest.mark.parametrize("spec", ["random:qwen3-tiny", "random:qwen35-tiny"])
def test_reused_prefill_bucket_equals_a_fresh_program(spec, bucket, monkeypatch):
    """Each prefill bucket's Program, lowered once and called for chunks at every start (0, bucket
    boundaries, odd starts, the last chunk that fits the cache), gives bitwise what a Program freshly
    lowered for that one chunk gives. Buckets of only the project's kernels are captured on the second
    call and replayed; larger ones call cuBLAS (never captured) and still reuse their fixed launches."""
    from graphir.passes import run_pipeline

    ctx = 512
    model = graphir.load(spec, backend="gpu", passes="default", ctx=ctx)
    graph = run_pipeline(model.graph("prefill", bucket), "default")
    gpu = get_backend("gpu")
    reused = gpu.lower(graph, model.weights)
    s_reused, s_fresh = gpu.new_state(graph), gpu.new_state(graph)
    tokens = np.random.default_rng(4).integers(0, 256, ctx)
    starts = sorted({*range(0, ctx - bucket + 1, max(bucket, ctx // 16)), ctx - bucket, 1, 3})
    for start in starts:
        rows = np.arange(start, start + bucket, dtype=np.int32)
        feeds = {"tokens": tokens[rows].astype(np.int32), "pos": rows, "kv_idx": rows,
                 "kv_len": np.array([start + bucket], np.int32)}
        got = reused(feeds, s_reused)["logits"]
        monkeypatch.setenv("GRAPHIR_NO_CAPTURE", "1")
        want = gpu.lower(graph, model.weights)(feeds, s_fresh)["logits"]
        monkeypatch.delenv("GRAPHIR_NO_CAPTURE")
        assert np.array_equal(got, want), f"{spec} bucket {bucket}: logits differ for the chunk at {start}"
    assert reused.captured == reused.capturable
    assert reused.capturable == (bucket <= matmul.GEMV_MAX_TOKENS)  # more rows go to cuBLAS
    for name in s_reused:
        assert np.array_equal(s_reused[name].get(), s_fresh[name].get()), f"{spec} bucket {bucket}: state {name}"


@pytest.mark.parametrize("spec", ["random:qwen3-tiny", "smollm2-135m"])
def test_greedy_generation_with_capture_equals_without(spec, monkeypatch):
    ids = list(range(40, 60))
    try:  # load finds SmolLM2's package without importing it (its __init__ imports `llm`, absent on GPU machines)
        with_capture = graphir.load(spec, backend="gpu", passes="default", ctx=128)
    except graphir.LoadError as e:
        pytest.skip(str(e))
    got = list(with_capture.generate(ids, 64, stop_at_eos=False))
    decode = with_capture._program(1, False, sampler=True)  # the step generate() runs: samples on the device
    assert decode.captured, "the decode Program should have been captured"
    monkeypatch.setenv("GRAPHIR_NO_CAPTURE", "1")
    without = graphir.load(spec, backend="gpu", passes="default", ctx=128)
    assert list(without.generate(ids, 64, stop_at_eos=False)) == got
    assert not without._program(1, False, sampler=True).captured
    cpu = graphir.load(spec, backend="cpu", passes="default", ctx=128)
    want = list(cpu.generate(ids, 64, stop_at_eos=False))
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    assert same >= 16, f"{spec}: gpu greedy tokens leave the cpu backend's at token {same}"


@pytest.mark.parametrize("spec", ["random:llama-tiny", "random:qwen35-tiny"])
def test_captured_sampling_step_equals_launched_step(spec, monkeypatch):
    """The decode step with the sampler in the graph: ids and State bitwise equal, replayed or not,
    with settings and u changing every step (they are Inputs, never baked into the graph)."""
    from graphir.generate import with_sampler
    from graphir.passes import run_pipeline

    ctx = 96
    model = graphir.load(spec, backend="gpu", passes="default", ctx=ctx)
    graph = run_pipeline(with_sampler(model.graph("decode")), "default")
    gpu = get_backend("gpu")
    captured, plain = gpu.lower(graph, model.weights), gpu.lower(graph, model.weights)
    s_cap, s_plain = gpu.new_state(graph), gpu.new_state(graph)
    rng = np.random.default_rng(5)
    token = 65
    for pos in range(ctx):
        settings = np.array([[rng.choice([0.0, 0.7, 1.3]), rng.choice([0, 1, 5, 40]), rng.choice([1.0, 0.8]),
                              rng.random()]], np.float32)
        feeds = {**step_inputs(pos, token), "sampling": settings}
        got, want = captured_and_launched(captured, plain, feeds, s_cap, s_plain, monkeypatch, "token")
        assert got.tolist() == want.tolist(), f"{spec}: sampled ids differ at position {pos}"
        token = int(got[0])
    assert captured.captured and not plain.captured
    for name in s_cap:
        assert np.array_equal(s_cap[name].get(), s_plain[name].get()), f"{spec}: state {name} differs"


def test_new_state_buffers_drop_the_graph(monkeypatch, capsys):
    monkeypatch.setenv("GRAPHIR_DEBUG_CACHE", "1")  # says so on stderr
    model = graphir.load("random:llama-tiny", backend="gpu", ctx=16)
    gpu = get_backend("gpu")
    graph = model.graph("decode")
    program = gpu.lower(graph, model.weights)
    feeds = {"tokens": np.array([7], np.int32), "pos": np.array([0], np.int32),
             "kv_idx": np.array([0], np.int32), "kv_len": np.array([1], np.int32)}
    first = gpu.new_state(graph)
    for _ in range(3):
        out = program(feeds, first)["logits"]
    assert program.captured
    second = gpu.new_state(graph)  # other buffers: the captured pointers are stale
    again = program(feeds, second)["logits"]
    assert not program.captured
    err = capsys.readouterr().err
    assert "capturing" in err and "rebinds to new State buffers" in err
    assert np.array_equal(again, out)
    assert float(abs(second[next(iter(second))]).max()) > 0  # written through the new buffers


# ---------------------------------------------------------------- replay-lint of the gpu lowering
def _lowered(spec: str, phase: str, sampler: bool = False):
    from graphir.generate import with_sampler
    from graphir.passes import run_pipeline

    model = graphir.load(spec, backend="gpu", passes="default", ctx=64)
    graph = model.graph(phase, None if phase == "decode" else 8, last_only=phase == "prefill")
    graph = run_pipeline(with_sampler(graph) if sampler else graph, "default")
    return model, graph, get_backend("gpu").lower(graph, model.weights)


@pytest.mark.parametrize("spec", ["random:llama-tiny", "random:qwen3-tiny", "random:qwen35-tiny"])
@pytest.mark.parametrize("phase,sampler", [("decode", False), ("decode", True), ("prefill", False)])
def test_gpu_lowering_passes_replay_lint(spec, phase, sampler):
    from graphir.backends.gpu.replay_lint import lint

    _, graph, program = _lowered(spec, phase, sampler)
    assert lint(program, get_backend("gpu").new_state(graph)) == []


def test_gpu_replay_lint_and_the_numbers_catch_a_kv_row_read_while_lowering(monkeypatch):
    """A set_rows rule that reads the write row from the device while binding and bakes it in (the
    'KV offset fixed when the graph was built' bug, moved into the backend): the lint names the
    step, and replays at later positions differ from an honest Program's."""
    from graphir.backends.gpu import lowering
    from graphir.backends.gpu.replay_lint import lint

    honest_rule = lowering.RULES["set_rows"]

    def baked(lw, n, ins, outs, p):
        dst, src, rows = ins
        row = int(rows.get()[0])  # the bug: a run-time value read at binding
        zero = lw.scratch(rows.shape, np.int32)
        zero.fill(0)
        return honest_rule(lw, n, [dst[row:], src, zero], outs, p)

    model, graph, honest = _lowered("random:llama-tiny", "decode")
    assert any(n.op == "set_rows" for n in graph.nodes())
    gpu = get_backend("gpu")
    broken = gpu.lower(graph, model.weights)

    def feeds(pos):
        return step_inputs(pos, pos % 200 + 1)

    s_broken, s_honest = gpu.new_state(graph), gpu.new_state(graph)
    with monkeypatch.context() as m:
        m.setitem(lowering.RULES, "set_rows", baked)
        assert lint(broken, gpu.new_state(graph)), "the lint must see launches that change with the Inputs"
        problems = lint(broken, gpu.new_state(graph))
        assert all("set_rows" in p for p in problems), problems
        for name, arr in feeds(0).items():  # the Input buffers hold position 0 when the Program binds
            broken.input_host[name][...] = arr
        broken._input_dev.set(broken._input_host_bytes)
        first = broken(feeds(0), s_broken)["logits"]
    assert lint(honest, gpu.new_state(graph)) == []
    assert np.array_equal(first, honest(feeds(0), s_honest)["logits"])  # right where it was bound
    later = [not np.array_equal(broken(feeds(p), s_broken)["logits"], honest(feeds(p), s_honest)["logits"])
             for p in range(1, 12)]
    assert sum(later) >= 10, f"the baked KV row should corrupt later positions: {later}"


@pytest.mark.parametrize("spec", ["random:qwen3-tiny", "random:qwen35-tiny"])
def test_cached_verify_programs_equal_fresh_programs_bitwise(spec, monkeypatch):
    """Issue 11's replay rule on the gpu: the model's cached verify Programs (captured on their second call,
    replayed after) and, for Qwen3.5, its commit Program, run over 120 position/acceptance patterns on one
    live State, equal Programs lowered fresh for each pattern and launched kernel by kernel: every output
    and every State buffer bitwise."""
    import cupy as cp
    from test_speculative import CTX as ctx
    from test_speculative import patterns

    from graphir import speculative as sp
    from graphir.generate import SAMPLING_INPUT
    from graphir.ops import SAMPLING_FIELDS
    from graphir.passes import run_pipeline

    model = graphir.load(spec, backend="gpu", passes="default", ctx=ctx)
    prompt = [(7 * i) % 23 + 3 for i in range(30)]  # repeats, so prompt lookup drafts
    list(sp.generate(model, "lookup", prompt, 8, draft_len=3))  # the model's own path: programs cached
    recurrent = sp.keeps_states(model)
    gpu = get_backend("gpu")
    rng = np.random.default_rng(2)
    commit = sp.commit_graph(model) if recurrent else None
    graphs = [sp.verify_graph(model, b, g) for b in sp.VERIFY_BUCKETS for g in (True, False)] + [commit] * recurrent
    shapes = {k: v for graph in graphs for k, v in gpu.new_state(graph).items()}  # per-token state rows included
    live = {k: cp.asarray(rng.standard_normal(v.shape).astype(v.dtype)) for k, v in sorted(shapes.items())}
    tokens = rng.integers(0, model.config.n_vocab, ctx)
    for i, (b, m, n_past) in enumerate(patterns(seed=3)):
        greedy = i % 2 == 0
        inputs = sp.verify_inputs(n_past, tokens[n_past:n_past + m].tolist(), b, keep_states=recurrent and b > 1)
        if greedy:
            inputs[SAMPLING_INPUT] = np.zeros((b, len(SAMPLING_FIELDS)), np.float32)
        fresh_state = {k: v.copy() for k, v in live.items()}
        got = sp.verify_program(model, b, greedy)(inputs, live)
        monkeypatch.setenv("GRAPHIR_NO_CAPTURE", "1")
        want = gpu.lower(run_pipeline(sp.verify_graph(model, b, greedy), model.passes), model.weights)(
            inputs, fresh_state)
        if commit is not None and b > 1:
            row = {sp.STATE_ROW_INPUT: np.array([int(rng.integers(0, m))], np.int32)}
            gpu.lower(run_pipeline(commit, model.passes), model.weights)(row, fresh_state)
        monkeypatch.delenv("GRAPHIR_NO_CAPTURE")
        if commit is not None and b > 1:
            model.programs.get_program(commit, model.weights, model.backend, model.passes)(row, live)
        for name in want:
            assert np.array_equal(host(got[name]), host(want[name])), f"{spec}: {name}, bucket {b}, m {m}, at {n_past}"
        for name in live:
            assert np.array_equal(live[name].get(), fresh_state[name].get()), \
                f"{spec}: state {name}, bucket {b}, m {m}, at {n_past}"
    cached = [sp.verify_program(model, b, g) for b in sp.VERIFY_BUCKETS for g in (True, False)]
    assert all(p.captured == p.capturable for p in cached) and any(p.captured for p in cached), \
        [(p.capturable, p.captured) for p in cached]
