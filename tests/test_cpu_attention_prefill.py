"""The cpu backend's prefill attention (backends/cpu/attention_prefill.py) against the op table's numpy
reference: query counts that fill no block evenly (17, 33, 511), key counts across chunk edges (1, 7, 511,
1025), GQA groups 1, 3, 4 and 5, head dims, sliding windows, queries that see no key, rows past kv_len
that must not be read, and 1 and 2 threads."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from graphir.backends.cpu import attention_prefill as ATP
from graphir.backends.cpu import lowering_rules as LR
from graphir.backends.cpu import precompile

from graphir.ops.core import _flash_attn_ref

SCALE = 0.125
TOL = 1e-5  # of max |ref|: f32 sums over up to 1025 keys (kernels.attention, the kernel before: 3.9e-6 here)
GROUPS = [(3, 3), (9, 3), (8, 2), (10, 2)]  # GQA groups 1, 3, 4, 5


def attend(q, k, v, pos, kv_len, window=0) -> np.ndarray:
    o = np.full((q.shape[0], q.shape[1], v.shape[2]), np.nan, np.float32)  # every element must be written
    _, step = LR._flash_attn(None, [q, k, v, pos, kv_len], [o], {"scale": SCALE, "window": window})
    step()
    return o


def case(rng, n_q, keys, hq, hk, d=64, spare=3):
    """n_q queries at the last n_q positions of `keys` keys (positions clipped at 0 when n_q > keys, so
    early rows repeat position 0); caches with spare rows of large values past kv_len."""
    cap = keys + spare
    q = (rng.standard_normal((n_q, hq, d)) * 1.5).astype(np.float32)
    k = (rng.standard_normal((cap, hk, d)) * 2).astype(np.float32) + np.float32(0.1)
    v = rng.standard_normal((cap, hk, d)).astype(np.float32) - np.float32(0.2)
    k[keys:], v[keys:] = 30.0, 1000.0
    pos = np.arange(keys - n_q, keys, dtype=np.int32).clip(0)
    return q, k, v, pos, np.array([keys], np.int32)


def check(q, k, v, pos, kv_len, window=0) -> None:
    assert ATP.supports(q, k, v)
    ours = attend(q, k, v, pos, kv_len, window)
    ref = _flash_attn_ref(q, k, v, pos, kv_len, SCALE, window)
    err = float(np.abs(ours - ref).max())
    assert err <= TOL * max(1.0, float(np.abs(ref).max())), f"max |diff| {err:.3g}"


@pytest.mark.parametrize("hq,hk", GROUPS)
@pytest.mark.parametrize("n_q,keys", [(17, 17), (17, 1025), (511, 511), (64, 1025), (33, 7), (17, 1)])
def test_matches_reference(rng, n_q, keys, hq, hk):
    check(*case(rng, n_q, keys, hq, hk))


@pytest.mark.parametrize("d", [16, 32, 128])
def test_other_head_dims(rng, d):
    check(*case(rng, 40, 300, 9, 3, d=d))


@pytest.mark.parametrize("window", [1, 5, 64, 100])
def test_sliding_window(rng, window):
    check(*case(rng, 130, 300, 9, 3), window=window)


def test_rows_past_kv_len_and_rows_with_no_key(rng):
    """Queries whose position is past kv_len see only kv_len keys; kv_len 0 gives zeros, as the reference."""
    q, k, v, pos, _ = case(rng, 20, 200, 9, 3)
    check(q, k, v, pos, np.array([190], np.int32))
    check(q, k, v, pos, np.array([0], np.int32))
    out = attend(q, k, v, pos, np.array([0], np.int32))
    assert not np.isnan(out).any() and not out.any()


def test_results_do_not_depend_on_thread_count(rng):
    q, k, v, pos, kv_len = case(rng, 100, 700, 9, 3)
    before = numba.get_num_threads()
    try:
        outs = []
        for n in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(n)
            outs.append(attend(q, k, v, pos, kv_len))
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(outs[0], outs[-1])


def test_prefill_uses_this_kernel_and_decode_the_decode_one(rng):
    q, k, v, pos, kv_len = case(rng, ATP.MIN_QUERIES, 511, 9, 3)
    LR.RECORD = []
    try:
        attend(q, k, v, pos, kv_len)
        attend(q[1:], k, v, pos[1:], kv_len)  # a speculative verify call's 16 queries: the decode kernel
        used = [use[1] for use in LR.RECORD]
    finally:
        LR.RECORD = None
    assert used[0] is ATP.KERNELS[64] and used[1] is not ATP.KERNELS[64]


def test_precompile_helper_finds_the_kernels_by_name():
    jobs = precompile._Jobs()
    for d, kernel in ATP.KERNELS.items():
        assert precompile._dispatcher(jobs.kernel(kernel, ()), jobs.sigs)[0] is kernel, d


def test_kv_len_past_the_capacity_is_an_error_before_the_kernel_runs():
    """The prefill path checks kv_len as the decode path does: no kernel reads past the cache."""
    q, k, v, pos, kv_len = case(np.random.default_rng(9), 17, 40, 8, 2)
    assert ATP.supports(q, k, v)
    with pytest.raises(ValueError, match=f"kv_len {k.shape[0] + 1} outside 0..{k.shape[0]}"):
        attend(q, k, v, pos, np.array([k.shape[0] + 1], np.int32))
