"""flash_attn on the gpu backend (backends/gpu/attention.py, attention.cu) against the reference backend.

Two runners: "graph" lowers a one-node Graph with get_backend("gpu") (the whole backend path);
"rule" calls lower_flash_attn directly on fixed device buffers and replays its steps, so the
kernels are checked even where the Program glue is not. Rows at and past kv_len hold 1e3 garbage
(never read: with it the output would be nowhere near the reference), positions are repeated
and out of order, caps are not multiples of the split size, and one lowered program is replayed
at many kv_len values.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from _attention_cases import GARBAGE, AttentionCase, GraphRunner, RuleRunner, attention_graph
from _gpu_helpers import host
from graphir.backends.gpu import attention
from graphir.backends.registry import get_backend

from graphir.errors import BackendError

try:
    from graphir.backends.gpu.device import available
except ImportError:  # pragma: no cover - the package always has it; keep collection safe
    def available() -> bool:
        return False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(), reason="no CUDA/HIP device")]

class Case(AttentionCase):
    op = "flash_attn"


_graph = functools.partial(attention_graph, "flash_attn")
_host = host


@pytest.fixture(params=["rule", "graph"])
def runner(request):
    return {"rule": RuleRunner, "graph": GraphRunner}[request.param]


def close(got, want, tol=1e-5):
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def _positions(rng, n_q, kv_len):
    """Non-contiguous, repeated, out of order; some past kv_len, one at 0."""
    top = max(kv_len + 3, 1)
    pos = rng.integers(0, top, n_q).astype(np.int32)
    pos[: min(n_q, 3)] = [kv_len - 1 if kv_len else 0, 0, kv_len // 2][: min(n_q, 3)]
    if n_q > 4:
        pos[3] = pos[0]  # repeated
    return pos


# ---------------------------------------------------------------- decode (split-K)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [0, 3, 5])
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
@pytest.mark.parametrize("d", [8, 64, 128])
def test_decode(runner, group, window, kvdtype, d):
    rng = np.random.default_rng(group * 100 + window * 10 + d)
    cap = {8: 37, 64: 1025, 128: 300}[d]
    case = Case(1, 2 * group, 2, d, d, cap, kvdtype, window)
    run = runner(case)  # one program for every kv_len
    for kv_len in sorted({0, 1, 20, cap - 1, cap}):
        q, k, v = case.data(rng, kv_len)
        for p in {max(kv_len - 1, 0), kv_len // 3, kv_len + 5}:  # the newest row, an older one, past the end
            pos = np.array([p], np.int32)
            close(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
def test_decode_replay_many_kv_len(runner, kvdtype):
    """One lowered program, many contexts: every split-count boundary (128-row chunks) and the cap."""
    rng = np.random.default_rng(7)
    cap = 1025
    case = Case(1, 8, 2, 64, 64, cap, kvdtype, 0)
    run = runner(case)
    q, k, v = case.data(rng, cap)
    for kv_len in [0, 1, 2, 3, 5, 31, 64, 127, 128, 129, 255, 256, 257, 513, 640, 1000, 1023, 1024, 1025]:
        k2, v2 = k.copy(), v.copy()
        k2[kv_len:], v2[kv_len:] = GARBAGE, -GARBAGE
        pos = np.array([kv_len - 1], np.int32)
        close(run(q, k2, v2, pos, kv_len), case.ref(q, k2, v2, pos, kv_len))


@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
@pytest.mark.parametrize("n_q,window", [(3, 0), (9, 0), (16, 0), (7, 5), (16, 40)])
def test_decode_several_queries(runner, kvdtype, n_q, window):
    """Up to DECODE_MAX_QUERIES (a speculative verify call) stay on the decode path: a query per grid z,
    positions repeated, out of order and past kv_len; with a sliding window (Gemma 3's verify calls), each
    query's own window."""
    assert n_q <= attention.DECODE_MAX_QUERIES
    rng = np.random.default_rng(3 + n_q + window)
    case = Case(n_q, 12, 4, 16, 16, 700, kvdtype, window)
    run = runner(case)
    for kv_len in [0, 1, 20, 700]:
        q, k, v = case.data(rng, kv_len)
        pos = _positions(rng, n_q, kv_len)
        close(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


@pytest.mark.parametrize("hq,hk", [(16, 2), (24, 2), (5, 5), (6, 1)])
def test_decode_gqa_chunks(runner, hq, hk):
    """Groups of 8 (one chunk of GB=8), 12 (two chunks, the second half full), 1 and 6."""
    rng = np.random.default_rng(hq)
    case = Case(1, hq, hk, 128, 128, 2000, "f16", 0)
    run = runner(case)
    for kv_len in [1, 777, 2000]:
        q, k, v = case.data(rng, kv_len)
        pos = np.array([kv_len - 1], np.int32)
        close(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


def test_decode_long_window(runner):
    """A sliding window far from row 0: most splits see nothing and must add nothing."""
    rng = np.random.default_rng(11)
    case = Case(1, 4, 1, 64, 64, 5000, "f32", 300)
    run = runner(case)
    for kv_len, p in [(5000, 4999), (5000, 2500), (4000, 3999), (129, 128), (5000, 10**6)]:
        q, k, v = case.data(rng, kv_len)
        pos = np.array([p], np.int32)
        close(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
@pytest.mark.parametrize("splits", ["one_wave", "many"])
def test_decode_tuned_shape(runner, monkeypatch, kvdtype, splits):
    """The kernel the benchmark chose, on its shape (d 128, GQA group 4, and group 3: a partly
    used head chunk), with a window, at split counts from the default grid and from many short
    splits (chunks not multiples of a tile step, most blocks a partial last step)."""
    from graphir.backends.gpu import attention as A

    if splits == "many":
        monkeypatch.setattr(A, "TARGET_BLOCKS", 200)
        monkeypatch.setattr(A, "MIN_CHUNK", 7)
    rng = np.random.default_rng(1 + (splits == "many"))
    for hq, window in [(8, 0), (6, 37)]:
        case = Case(2, hq, 2, 128, 128, 1000, kvdtype, window)
        run = runner(case)
        if isinstance(run, RuleRunner):
            assert run.kernels == [f"attn_decode_{kvdtype}_d128_g4", "attn_combine"], run.kernels  # 2 queries
        for kv_len in [1, 33, 129, 999, 1000]:
            q, k, v = case.data(rng, kv_len)
            pos = np.array([kv_len - 1, kv_len // 2], np.int32)
            close(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
@pytest.mark.parametrize("dk", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("n_q", [1, 9])
def test_decode_every_class(runner, kvdtype, dk, group, n_q):
    """Every attn_decode_<kv>_d<DK>_g<GB> kernel (each has its own R and NV), dv < d; with 9 queries
    (attention.WALK_MIN_QUERIES or more) its walk twin, blocks walking several splits each."""
    rng = np.random.default_rng(dk + group + n_q)
    d, dv = dk, dk - 8
    case = Case(n_q, 2 * group, 2, d, dv, 1025, kvdtype, 0)
    run = runner(case)
    if isinstance(run, RuleRunner):
        walk = "walk_" if n_q >= attention.WALK_MIN_QUERIES else ""
        assert run.kernels == [f"attn_decode_{walk}{kvdtype}_d{dk}_g{group}", "attn_combine"], run.kernels
    for kv_len in [1, 511, 1025]:
        q, k, v = case.data(rng, kv_len)
        for p in (kv_len - 1, kv_len // 3):
            pos = np.clip(np.arange(p - n_q + 1, p + 1), 0, None).astype(np.int32)
            close(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


@pytest.mark.parametrize("kvdtype,offset", [("f16", 4), ("f16", 1), ("f32", 1)])
def test_decode_unaligned_kv_falls_back(kvdtype, offset):
    """K/V not 16-byte aligned (f16: 8 bytes, or 2): the element-load kernel, still exact."""
    rng = np.random.default_rng(offset)
    case = Case(1, 8, 2, 128, 128, 300, kvdtype, 0)
    run = RuleRunner(case, kv_offset=offset)
    assert run.kernels == [f"attn_decode_{kvdtype}_any", "attn_combine"], run.kernels
    for kv_len in [1, 300]:
        q, k, v = case.data(rng, kv_len)
        pos = np.array([kv_len - 1], np.int32)
        close(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


# ---------------------------------------------------------------- prefill
@pytest.mark.parametrize("n_q", [17, 129, 513])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
def test_prefill(runner, n_q, group, kvdtype):
    assert n_q > attention.DECODE_MAX_QUERIES
    d = {17: 8, 129: 64, 513: 128}[n_q]
    window = {1: 0, 3: 3, 4: 5}[group]
    rng = np.random.default_rng(n_q + group)
    cap = {17: 37, 129: 1025, 513: 600}[n_q]
    case = Case(n_q, 2 * group, 2, d, d, cap, kvdtype, window)
    run = runner(case)
    for kv_len in sorted({0, 1, 20, cap}):
        q, k, v = case.data(rng, kv_len)
        pos = _positions(rng, n_q, kv_len)
        close(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


@pytest.mark.parametrize("window", [0, 5])
def test_prefill_causal_block(runner, window):
    """The usual prompt: positions start..start+n-1 after `start` cached rows, kv_len = start + n."""
    rng = np.random.default_rng(5)
    n_q, start = 300, 211
    case = Case(n_q, 8, 2, 128, 128, 1024, "f16", window)
    run = runner(case)
    kv_len = start + n_q
    q, k, v = case.data(rng, kv_len)
    pos = np.arange(start, start + n_q, dtype=np.int32)
    close(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))
    pos0 = np.arange(n_q, dtype=np.int32)  # and from an empty cache
    close(run(q, k, v, pos0, n_q), case.ref(q, k, v, pos0, n_q))


@pytest.mark.parametrize("hq,hk,d,dv", [(24, 2, 64, 64), (16, 2, 256, 256), (4, 2, 64, 32), (3, 1, 6, 10),
                                        (2, 1, 250, 130)])
@pytest.mark.parametrize("n_q", [1, 70])
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
def test_head_shapes(runner, hq, hk, d, dv, n_q, kvdtype):
    """Group 12 (two head chunks), head dim 256, dv != d, and odd dims (the element-load fallback)."""
    rng = np.random.default_rng(d + dv + n_q)
    case = Case(n_q, hq, hk, d, dv, 333, kvdtype, 0)
    run = runner(case)
    if isinstance(run, RuleRunner) and d % 4:  # `_any` for decode and prefill, one combine
        assert run.kernels == (["attn_decode_" + kvdtype + "_any", "attn_combine"] if n_q == 1 else  # 70: prefill
                               ["attn_prefill_" + kvdtype + "_any"]), run.kernels
    for kv_len in [1, 150, 333]:
        q, k, v = case.data(rng, kv_len)
        pos = _positions(rng, n_q, kv_len)
        close(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


def test_no_visible_key_gives_zero(runner):
    rng = np.random.default_rng(2)
    for n_q in (2, 9):
        case = Case(n_q, 4, 1, 8, 8, 16, "f32", 5, scale=0.7)
        run = runner(case)
        q, k, v = case.data(rng, 10)
        pos = np.full(n_q, 30, np.int32)  # sees 26..30, but only 0..9 are valid
        pos[1] = -1  # sees nothing at all
        out = run(q, k, v, pos, 10)
        np.testing.assert_array_equal(out, 0.0)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("n_q", [1, 9])
def test_kv_len_past_capacity_raises(runner, n_q):
    rng = np.random.default_rng(4)
    case = Case(n_q, 4, 2, 16, 16, 37, "f32", 0)
    run = runner(case)
    q, k, v = case.data(rng, 37)
    pos = np.full(n_q, 36, np.int32)
    with pytest.raises(BackendError, match=r"flash_attn: kv_len 38 outside 0\.\.37 \(the KV capacity\)"):
        run(q, k, v, pos, 38)
    with pytest.raises(BackendError, match=r"kv_len -1 outside 0\.\.37"):
        run(q, k, v, pos, -1)
    close(run(q, k, v, pos, 37), case.ref(q, k, v, pos, 37))  # the program still works afterwards


def test_head_dim_past_256_is_refused():
    case_graph = _graph(1, 2, 8, 1, 264, 264, "f32", 0.1, 0)
    with pytest.raises(BackendError, match="up to 256"):
        get_backend("gpu").lower(case_graph, None)


def test_kv_cache_as_state():
    """K/V as State buffers (how models hold the cache), f16."""
    rng = np.random.default_rng(9)
    cap, kv_len = 400, 321
    graph = _graph(1, 8, cap, 2, 64, 64, "f16", 0.125, 0, state=True)
    case = Case(1, 8, 2, 64, 64, cap, "f16", 0, scale=0.125)
    q, k, v = case.data(rng, kv_len)
    pos = np.array([kv_len - 1], np.int32)
    program = get_backend("gpu").lower(graph, None)
    got = _host(program({"q": q, "pos": pos, "len": np.array([kv_len], np.int32)}, {"k": k, "v": v})["out"])
    close(got, case.ref(q, k, v, pos, kv_len))
