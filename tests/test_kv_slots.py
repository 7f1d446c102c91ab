"""KV slots (issue 11, item 5): a KV cache in a pool of slots addressed through a run-time slot map.
Shuffled slots give the logits of a contiguous cache; cached Programs replay bitwise over positions,
buckets and pool wrap-around; replay-lint catches the seed bug (attention reading a pool window sized
from a build-time logical length) and the numbers show it; bad slot maps fail clearly before any write."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from _gpu_helpers import gpu_only, host
from graphir.backends.registry import get_backend
from graphir.models import llama
from graphir.models.family import SLOT_MAP
from graphir.models.layers import rms_norm_mul
from test_replay import copy_state
from test_speculative import ScriptedDrafter

import graphir
from graphir import kv_slots
from graphir import speculative as sp
from graphir.api import Model
from graphir.builder import g
from graphir.passes import run_pipeline
from graphir.passes.replay_lint import kv_bound_problems
from graphir.run_inputs import new_state

CTX, POOL = 40, 64
CALLS = [(8, 8), (8, 5), (1, 1), (4, 3), (16, 9), (1, 1), (2, 2)]  # (bucket, real tokens): prefill, verify, decode


def models(backend: str, spec: str = "random:llama-tiny") -> tuple[Model, Model]:
    """(contiguous cache of CTX rows, the same weights with a pool of POOL slots)."""
    plain = graphir.load(spec, backend=backend, passes="default", ctx=CTX)
    slotted = Model(dataclasses.replace(plain.config, kv_slots=POOL), plain.weights, plain.tokenizer,
                    backend=backend, passes="default", source=plain.source)
    return plain, slotted


def program(model: Model, b: int):
    return model.programs.get_program(model.graph("decode" if b == 1 else "prefill", b), model.weights,
                                      model.backend, model.passes)


def run_sequence(model: Model, tokens: list[int], slot_map: np.ndarray | None) -> list[np.ndarray]:
    """CALLS over `tokens` from position 0, padded as verify calls pad; each call's logits of its real rows."""
    state, n_past, out = new_state(run_pipeline(model.graph("decode"), model.passes)), 0, []
    for b, m in CALLS:
        inputs = sp.verify_inputs(n_past, tokens[n_past:n_past + m], b)
        if slot_map is not None:
            inputs = kv_slots.slot_inputs(inputs, slot_map, POOL)
        out.append(program(model, b)(inputs, state)["logits"][b - m:])
        n_past += m
    return out


def shuffled(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(POOL)[:CTX].astype(np.int32)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("spec", ["random:llama-tiny", "random:qwen3-tiny"])
def test_shuffled_slots_give_the_logits_of_a_contiguous_cache(backend, spec):
    plain, slotted = models(backend, spec)
    tokens = np.random.default_rng(0).integers(0, plain.config.n_vocab, CTX).tolist()
    want = run_sequence(plain, tokens, None)
    wrapped = ((POOL - 13 + np.arange(CTX)) % POOL).astype(np.int32)  # a ring that wraps past the pool's end
    for slot_map in (np.arange(CTX, dtype=np.int32), shuffled(1), shuffled(2)[::-1].copy(), wrapped):
        got = run_sequence(slotted, tokens, slot_map)
        for call, (a, b) in enumerate(zip(got, want, strict=True)):
            assert np.array_equal(a, b), f"{spec} {backend}: call {call} ({CALLS[call]}) differs"


def test_slot_graphs_pass_replay_lint_and_hold_no_position():
    _, slotted = models("reference")
    graph = slotted.graph("prefill", 4)
    assert [n.name for n in graph.inputs if n.name == SLOT_MAP] == [SLOT_MAP]
    assert next(n for n in graph.states if n.name == "blk.0.k_cache").shape[0] == POOL
    for b in (1, 2, 16):
        a = slotted.graph("decode" if b == 1 else "prefill", b)
        assert run_pipeline(a, "replay-lint") is a and not kv_bound_problems(run_pipeline(a, "default"))


def test_cached_slot_programs_equal_fresh_programs_bitwise():
    """120 patterns: buckets 1..16, positions to the context's end, slot maps shuffled and wrapping the pool;
    the cached Program on a live pool equals one lowered fresh for the pattern, logits and pool bitwise."""
    _, slotted = models("cpu")
    backend = get_backend("cpu")
    rng = np.random.default_rng(4)
    live = {k: rng.standard_normal(v.shape).astype(v.dtype)
            for k, v in new_state(run_pipeline(slotted.graph("decode"), slotted.passes)).items()}
    tokens = rng.integers(0, slotted.config.n_vocab, CTX)
    for i in range(120):
        b = (1, 2, 4, 8, 16)[i % 5]
        m, n_past = int(rng.integers(1, b + 1)), int(rng.integers(0, CTX - b + 1))
        slot_map = shuffled(i) if i % 2 else ((int(rng.integers(0, POOL)) + np.arange(CTX)) % POOL).astype(np.int32)
        inputs = kv_slots.slot_inputs(sp.verify_inputs(n_past, tokens[n_past:n_past + m].tolist(), b), slot_map, POOL)
        fresh_state = copy_state(live)
        graph = slotted.graph("decode" if b == 1 else "prefill", b)
        want = backend.lower(run_pipeline(graph, slotted.passes), slotted.weights)(inputs, fresh_state)["logits"]
        got = program(slotted, b)(inputs, live)["logits"]
        assert np.array_equal(got, want), f"pattern {i}: bucket {b}, m {m}, at {n_past}"
        for name in live:
            assert np.array_equal(live[name], fresh_state[name]), f"pattern {i}: {name}"
    assert len(slotted.programs) == 5  # one per bucket, none per position or slot map


def pool_window_attention(logical_len: int):
    """The issue's second seed bug: a slot-pool attention whose KV view is the pool's first `logical_len`
    rows (a logical length built in as a plain int, its taint lost) while the mask (kv_len) is fed per
    call: it reads pool rows in pool order, which are not the sequence's slots, some never written."""

    def attention(c, p, i, h, pos, kv_idx, kv_len, slot_map=None):
        n, b = h.shape[0], f"blk.{i}."
        q = g.reshape(g.mul_mat(p(b + "attn_q.weight"), h), shape=(n, c.n_heads, c.head_dim))
        k = g.reshape(g.mul_mat(p(b + "attn_k.weight"), h), shape=(n, c.n_kv_heads, c.head_dim))
        v = g.reshape(g.mul_mat(p(b + "attn_v.weight"), h), shape=(n, c.n_kv_heads, c.head_dim))
        if c.qk_norm:
            q = rms_norm_mul(q, p(b + "attn_q_norm.weight"), c.rms_eps, b + "attn_q_norm")
            k = rms_norm_mul(k, p(b + "attn_k_norm.weight"), c.rms_eps, b + "attn_k_norm")
        rope = {"n_dims": c.head_dim, "mode": c.rope_mode, "theta": float(c.rope_theta)}
        q, k = g.rope(q, pos, name=b + "q_rope", **rope), g.rope(k, pos, name=b + "k_rope", **rope)
        shape = (c.kv_slots, c.n_kv_heads, c.head_dim)
        k_all = g.set_rows(g.state(b + "k_cache", shape), k, kv_idx, name=b + "k_cache_write")
        v_all = g.set_rows(g.state(b + "v_cache", shape), v, kv_idx, name=b + "v_cache_write")
        k_seq = g.rows(k_all, 0, logical_len, name=b + "k_seq")
        v_seq = g.rows(v_all, 0, logical_len, name=b + "v_seq")
        o = g.flash_attn(q, k_seq, v_seq, pos, kv_len, scale=1.0 / math.sqrt(c.head_dim), name=b + "attn")
        o = g.reshape(o, shape=(n, c.n_heads * c.head_dim))
        return g.mul_mat(p(b + "attn_output.weight"), o, name=b + "attn_out")

    return attention


@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=[pytest.mark.gpu, gpu_only])])
def test_a_pool_view_sized_from_a_logical_length_is_caught(monkeypatch, backend):
    _, slotted = models(backend)
    with monkeypatch.context() as mp:
        mp.setattr(llama, "_attention", pool_window_attention(CTX))
        broken = slotted.graph("prefill", 4)
    with pytest.raises(graphir.GraphError, match=r"replay-lint: node %\d+ view 'blk\.0\.k_seq' .*spans 40 of its 64 "
                                                 r"rows: its extent is a build-time length"):
        run_pipeline(broken, "replay-lint")
    with pytest.raises(graphir.GraphError, match="replay-lint"):
        run_pipeline(broken, "default")
    # by the numbers: with slots that are not the pool's first rows in position order, its logits leave the
    # slot-mapped graph's (with contiguous slots 0..39 the two agree: a test with ordered slots misses it)
    lowering = get_backend(backend)
    tokens = np.random.default_rng(5).integers(0, slotted.config.n_vocab, 12).tolist()
    decode = run_pipeline(slotted.graph("decode"), slotted.passes)
    state = lowering.new_state(decode) if backend == "gpu" else new_state(decode)  # device buffers on the gpu
    for slot_map, agree in ((np.arange(CTX, dtype=np.int32), True), (shuffled(6), False)):
        inputs = kv_slots.slot_inputs(sp.verify_inputs(8, tokens[8:12], 4), slot_map, POOL)
        prefix = kv_slots.slot_inputs(sp.verify_inputs(0, tokens[:8], 8), slot_map, POOL)
        a, b = copy_state(state), copy_state(state)
        program(slotted, 8)(prefix, a)
        program(slotted, 8)(prefix, b)
        want = host(program(slotted, 4)(inputs, a)["logits"])
        fed = {k: v for k, v in inputs.items() if k != SLOT_MAP}
        got = host(lowering.lower(broken, slotted.weights)(fed, b)["logits"])
        # (unfused, as replay-lint stops the default pipeline: equal up to f32 rounding where it is right)
        assert np.allclose(got, want, rtol=1e-4, atol=1e-4) == agree


def test_a_gather_by_a_const_and_a_const_length_bound_are_caught():
    pool = g.state("k_pool", (POOL, 2, 4))
    x, idx = g.input("x", (3, 2, 4)), g.input("idx", (3,), "i32")
    written = g.set_rows(pool, x, idx)
    flat = g.reshape(written, shape=(POOL, 8))
    by_const = g.get_rows(flat, g.const(list(range(CTX)), "i32"), name="gather_const")
    by_input = g.get_rows(flat, g.input("slot_map", (CTX,), "i32"), name="gather_slots")
    q, pos = g.input("q", (3, 2, 4)), g.input("pos", (3,), "i32")
    kv = g.reshape(by_input, shape=(CTX, 2, 4))
    const_len = g.flash_attn(q, kv, kv, pos, g.const([CTX], "i32"), scale=0.5, name="attn_const_len")
    fed_len = g.flash_attn(q, kv, kv, pos, g.input("kv_len", (1,), "i32"), scale=0.5, name="attn_fed_len")
    problems = kv_bound_problems(graphir.Graph({"a": by_const, "b": const_len, "c": fed_len}))
    assert len(problems) == 2
    assert "gather_const" in problems[0] and "not by an Input (a slot map fed per call)" in problems[0]
    assert "attn_const_len" in problems[1] and "KV length bound const" in problems[1]


def test_a_kv_view_one_row_short_of_the_pool_is_caught():
    """The view rule at its edge: rows 0..POOL-2 or 1..POOL-1 of the pool (one row short) are a build-time extent; a
    view of every row is not."""
    written = g.set_rows(g.state("k_pool", (POOL, 2, 4)), g.input("x", (3, 2, 4)), g.input("idx", (3,), "i32"))
    views = {name: g.rows(written, start=start, count=count, name=name)
             for name, start, count in (("k_short", 0, POOL - 1), ("k_late", 1, POOL - 1), ("k_whole", 0, POOL))}
    problems = kv_bound_problems(graphir.Graph(views))
    assert sorted(p.split("'")[1] for p in problems) == ["k_late", "k_short"], problems
    assert all(f"spans {POOL - 1} of its {POOL} rows" in p for p in problems)


def test_bad_slot_maps_fail_clearly_and_leave_the_cache_usable():
    plain, slotted = models("cpu")
    tokens = np.random.default_rng(7).integers(0, plain.config.n_vocab, CTX).tolist()
    slot_map = shuffled(8)
    want = run_sequence(slotted, tokens, slot_map)
    state = new_state(run_pipeline(slotted.graph("decode"), slotted.passes))
    program(slotted, 8)(kv_slots.slot_inputs(sp.verify_inputs(0, tokens[:8], 8), slot_map, POOL), state)
    before = copy_state(state)
    dup, out_of_range = slot_map.copy(), slot_map.copy()
    dup[9] = dup[3]
    out_of_range[30] = POOL
    cases = [(dup, rf"slot map: positions 3 and 9 share slot {slot_map[3]}; each position a call reads or writes"),
             (out_of_range, rf"slot map: position 30 holds slot {POOL}, outside the pool of {POOL} slots")]
    for bad, message in cases:
        with pytest.raises(graphir.InputError, match=message):
            kv_slots.slot_inputs(sp.verify_inputs(8, tokens[8:13], 8), bad, POOL)
        for name in state:
            assert np.array_equal(state[name], before[name])  # nothing ran
    assert [np.array_equal(a, b) for a, b in zip(run_sequence(slotted, tokens, slot_map), want, strict=True)] \
        == [True] * len(CALLS)
    # a duplicate among positions no call touches yet is allowed: those slots are gathered but masked
    late = slot_map.copy()
    late[CTX - 1] = late[CTX - 2]
    kv_slots.slot_inputs(sp.verify_inputs(8, tokens[8:13], 8), late, POOL)


@pytest.mark.gpu
@gpu_only
def test_gpu_shuffled_slots_give_the_logits_of_a_contiguous_cache():
    """On the gpu the gather is the get_rows kernel over a State; shuffled, wrapping and ordered slots must
    agree with the contiguous cache (to the last bits: the same kernels read the same rows)."""
    plain, slotted = models("gpu")
    tokens = np.random.default_rng(0).integers(0, plain.config.n_vocab, CTX).tolist()
    want = run_sequence(plain, tokens, None)
    for slot_map in (np.arange(CTX, dtype=np.int32), shuffled(1),
                     ((POOL - 13 + np.arange(CTX)) % POOL).astype(np.int32)):
        for a, b in zip(run_sequence(slotted, tokens, slot_map), want, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


@pytest.mark.parametrize("spec", ["random:llama-tiny", "random:qwen3-tiny", "random:gemma3-tiny", "random:qwen35-tiny"])
def test_every_family_reads_its_kv_within_the_rule(spec):
    """The real builders' graphs (decode, prefill, verify, Qwen3.5's commit), before and after the default
    pipeline, bound every KV read by the pool or an Input."""
    m = graphir.load(spec, backend="reference")
    graphs = [m.graph("decode"), m.graph("prefill", 8), m.graph("prefill", 8, last_only=True)]
    graphs += [sp.verify_graph(m, b, greedy) for b in sp.VERIFY_BUCKETS for greedy in (True, False)]
    if sp.keeps_states(m):
        graphs.append(sp.commit_graph(m))
    for graph in graphs:
        assert kv_bound_problems(graph) == [] and kv_bound_problems(run_pipeline(graph, "default")) == []


# ---------------------------------------------------------------- end to end: graphir.load(spec, kv_slots=N)
E2E_CTX = 64
SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 11}


def pair(spec: str, backend: str, pool: int, **kw) -> tuple[Model, Model]:
    """(contiguous cache of E2E_CTX rows, the same model with a pool of `pool` slots)."""
    load = lambda **more: graphir.load(spec, backend=backend, passes="default", ctx=E2E_CTX, **kw, **more)  # noqa: E731
    return load(), load(kv_slots=pool)


def repeating_prompt(n: int, seed: int) -> list[int]:
    """n tokens that repeat a phrase (prompt lookup finds n-grams in it)."""
    phrase = np.random.default_rng(seed).integers(0, 256, 9).tolist()
    return (phrase * (n // 9 + 1))[:n]


def check_pool(model: Model) -> None:
    """Between calls the sequence's positions hold distinct slots and every other slot is free, once."""
    pool = model.slots
    assert pool.held == model.n_past
    assert sorted([*pool.slot_map[:pool.held].tolist(), *pool.free]) == list(range(pool.n_slots))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("spec", ["random:llama-tiny", "random:qwen3-tiny"])
def test_generate_with_a_slot_pool_equals_the_contiguous_cache(backend, spec):
    """Greedy and seeded sampling, prompts across the prefill buckets (padded calls included), slots handed out
    in order and from shuffled free lists: token for token the contiguous cache's output."""
    plain, slotted = pair(spec, backend, pool=96)
    for n, settings in ((1, {}), (9, SAMPLED), (13, {}), (33, SAMPLED)):
        prompt = repeating_prompt(n, seed=n)
        want = list(plain.generate(prompt, 24, stop_at_eos=False, **settings))
        for shuffle in (None, 1, 2):
            slotted.reset()
            if shuffle is not None:
                slotted.slots.shuffle_free(np.random.default_rng(shuffle))
            got = list(slotted.generate(prompt, 24, stop_at_eos=False, **settings))
            assert got == want, f"{spec} {backend}: prompt {n}, {settings}, shuffle {shuffle}"
            check_pool(slotted)
            held = slotted.slots.slot_map[:slotted.n_past]
            if shuffle is not None:  # the slots really were out of position order
                assert np.any(np.diff(held) != 1)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("spec", ["random:llama-tiny", "random:qwen3-tiny"])
def test_speculative_greedy_with_slots_equals_plain_greedy(backend, spec):
    """Verify calls write their rows to slots; rejected drafts give them back and the next call reuses them.
    The pool is exactly prompt + new tokens, so a leaked slot would exhaust it; verify calls shrink at its end."""
    plain, _ = pair(spec, backend, pool=8)
    prompt = repeating_prompt(20, seed=3)
    new = 30
    want = list(plain.generate(prompt, new, stop_at_eos=False))
    _, target = pair(spec, backend, pool=len(prompt) + new)
    _, draft = pair(spec, backend, pool=E2E_CTX, dtype="q8_0")
    scripted = ScriptedDrafter(prompt, want, wrong=2)
    accepted = rejected = 0
    for k, drafter in ((1, "lookup"), (3, scripted), (5, draft), (8, scripted), (8, sp.PromptLookup(min_ngram=1))):
        for shuffle in (None, k):
            target.reset()
            if shuffle is not None:
                target.slots.shuffle_free(np.random.default_rng(shuffle))
                draft.slots.shuffle_free(np.random.default_rng(shuffle + 100))
            got = list(sp.generate(target, drafter, prompt, new, draft_len=k, stop_at_eos=False))
            assert got == want, f"{spec} {backend}: draft_len {k}, {getattr(drafter, 'name', drafter)}"
            check_pool(target)
            check_pool(draft)
            stats = sp.last_stats(target)
            accepted += stats.accepted_tokens
            rejected += stats.draft_tokens - stats.accepted_tokens
    assert accepted > 20 and rejected > 5  # drafts were kept and rolled back, not just plain decoding


def test_speculative_sampling_with_slots_equals_the_contiguous_cache():
    """Seeded speculative sampling reads the same logits from shuffled slots, so it draws the same tokens."""
    plain, slotted = pair("random:llama-tiny", "cpu", pool=80)
    drafts = pair("random:llama-tiny", "cpu", pool=80, dtype="q8_0")
    prompt = repeating_prompt(17, seed=5)
    want = list(sp.generate(plain, drafts[0], prompt, 30, draft_len=4, stop_at_eos=False, **SAMPLED))
    slotted.slots.shuffle_free(np.random.default_rng(6))
    drafts[1].slots.shuffle_free(np.random.default_rng(7))
    assert list(sp.generate(slotted, drafts[1], prompt, 30, draft_len=4, stop_at_eos=False, **SAMPLED)) == want
    assert sp.last_stats(slotted).accepted_tokens > 0


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_pool_smaller_than_the_context_fails_clearly_when_exhausted(backend):
    plain, slotted = pair("random:qwen3-tiny", backend, pool=24)
    tokens = repeating_prompt(24, seed=8)
    with pytest.raises(graphir.InputError, match=r"prompt of 10 tokens \+ max_new_tokens 15 needs 25 KV slots, the "
                                                 r"pool has 24 \(load\(\.\.\., kv_slots=N\) to raise it\)"):
        slotted.generate(tokens[:10], 15)
    slotted.slots.shuffle_free(np.random.default_rng(9))
    slotted.feed(tokens[:20])
    before = (slotted.slots.slot_map.copy(), list(slotted.slots.free), copy_state(slotted._state))
    with pytest.raises(graphir.InputError, match=r"KV slot pool exhausted: a sequence of 25 tokens needs 25 slots, "
                                                 r"the pool has 24 \(20 held"):
        slotted.feed(tokens[:5])
    # nothing ran: the sequence, its slots and the cache are as they were, and it goes on to the pool's end
    assert slotted.n_past == 20 and np.array_equal(slotted.slots.slot_map, before[0])
    assert slotted.slots.free == before[1]
    assert all(np.array_equal(slotted._state[k], v) for k, v in before[2].items())
    assert slotted.chunks(4) == [1, 1, 1, 1]  # no room in the pool for a padded call
    # (the contiguous cache reads them in one padded call: equal up to f32 rounding, not bitwise)
    np.testing.assert_allclose(slotted.feed(tokens[20:24]), plain.logits(tokens)[20:24], rtol=1e-5, atol=1e-5)
    with pytest.raises(graphir.InputError, match="KV slot pool exhausted: a sequence of 25 tokens"):
        slotted._decode_sample(tokens[0], graphir.generate.Settings())
    # generation to the pool's end (the last new token is not fed), its last token filling it; a reset frees it all
    want = list(plain.generate(tokens[:10], 14, stop_at_eos=False))
    assert list(slotted.generate(tokens[:10], 14, stop_at_eos=False)) == want
    assert slotted.slots.held == 23 and len(slotted.slots.free) == 1
    slotted.feed(want[-1:])
    assert slotted.slots.held == 24 and slotted.slots.free == []
    slotted.reset()
    assert slotted.slots.held == 0 and sorted(slotted.slots.free) == list(range(24))


def test_one_program_per_graph_serves_every_slot_pattern():
    """Replay: the decode, prefill and verify Programs lowered by the first run serve every later slot pattern
    (shuffled free lists, rollbacks reusing slots) with no new lowering, and give the same tokens."""
    plain, slotted = pair("random:llama-tiny", "cpu", pool=E2E_CTX)
    prompt = repeating_prompt(21, seed=10)
    want = list(plain.generate(prompt, 32, stop_at_eos=False))
    scripted = ScriptedDrafter(prompt, want, wrong=2)
    run = lambda: (list(slotted.generate(prompt, 32, stop_at_eos=False)),  # noqa: E731
                   list(sp.generate(slotted, scripted, prompt, 32, draft_len=7, stop_at_eos=False)))
    assert run() == (want, want)
    lowered, misses = len(slotted.programs), slotted.programs.misses
    patterns = set()
    for seed in range(6):
        slotted.reset()
        slotted.slots.shuffle_free(np.random.default_rng(seed))
        assert run() == (want, want)
        patterns.add(tuple(slotted.slots.slot_map[:slotted.n_past].tolist()))
    assert len(patterns) == 6 and slotted.programs.misses == misses and len(slotted.programs) == lowered


def test_kv_slots_bad_load_options_fail_clearly():
    for bad in (0, -3, True, 2.5):
        with pytest.raises(graphir.InputError, match=f"kv_slots must be an int >= 1, got {bad!r}"):
            graphir.load("random:llama-tiny", backend="reference", kv_slots=bad)
    with pytest.raises(graphir.InputError, match=r"kv_slots: random:gemma3-tiny \(gemma3\) has no KV slot pool"):
        graphir.load("random:gemma3-tiny", backend="reference", kv_slots=16)
    with pytest.raises(graphir.InputError, match="kv_slots: tensor-parallel models keep a contiguous KV cache"):
        graphir.load("random:llama-tiny", backend="cpu", kv_slots=16, tp=2)


@pytest.mark.gpu
@gpu_only
def test_gpu_generate_with_shuffled_slots_equals_the_contiguous_cache():
    """The gpu decode step replays a captured graph: the slot map and slot rows it is fed must change what it
    reads. Greedy plain and speculative generation with a shuffled pool equal the contiguous cache's."""
    plain, slotted = pair("random:llama-tiny", "gpu", pool=E2E_CTX)
    prompt = repeating_prompt(19, seed=12)
    want = list(plain.generate(prompt, 40, stop_at_eos=False))
    for seed in (1, 2):
        slotted.reset()
        slotted.slots.shuffle_free(np.random.default_rng(seed))
        assert list(slotted.generate(prompt, 40, stop_at_eos=False)) == want
        scripted = ScriptedDrafter(prompt, want, wrong=2)
        assert list(sp.generate(slotted, scripted, prompt, 40, draft_len=5, stop_at_eos=False)) == want
        check_pool(slotted)
