"""The cpu backend's decode attention (backends/cpu/attention.py) against the op table's numpy reference:
awkward key counts (one chunk, a few, many; a last chunk of one key), GQA group sizes 1, 3 and 4, f32
and f16 caches, queries at the end of a full cache, sliding windows, several queries at once, and the
f16 widening bit for bit against numpy on every half."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numba
import numpy as np
import pytest
from graphir.backends.cpu import attention as ATT
from graphir.backends.cpu import lowering_rules as LR
from graphir.backends.cpu import precompile

from graphir.ops.core import _flash_attn_ref

SCALE = 0.125
KEYS = [1, 7, 511, 1025, 4095]  # 4095: 16 chunks of 256, the last one key short; 1025: 9 chunks at most
GROUPS = [(3, 3), (9, 3), (8, 2), (10, 2)]  # (q heads, KV heads): GQA groups 1, 3, 4, 5 (a block of 4, then 1)


def attend(q, k, v, pos, kv_len, window=0, scale=SCALE) -> np.ndarray:
    """flash_attn through the cpu backend's lowering rule (the kernel a Program binds), run once."""
    o = np.full((q.shape[0], q.shape[1], v.shape[2]), np.nan, np.float32)  # every element must be written
    _, step = LR._flash_attn(None, [q, k, v, pos, kv_len], [o], {"scale": scale, "window": window})
    step()
    return o


def case(rng, keys, hq, hk, dtype, n_q=1, d=64, spare=0):
    """q [n_q, hq, d] at the last n_q positions of `keys` keys; caches of keys + spare rows. The rows past
    kv_len hold large values, so reading one shows in the result."""
    cap = keys + spare
    q = rng.standard_normal((n_q, hq, d), dtype=np.float32)
    k = (rng.standard_normal((cap, hk, d)) * 2).astype(dtype)
    v = rng.standard_normal((cap, hk, d)).astype(dtype)
    k[keys:], v[keys:] = 30.0, 1000.0
    pos = np.arange(keys - n_q, keys, dtype=np.int32).clip(0)
    return q, k, v, pos, np.array([keys], np.int32)


def check(q, k, v, pos, kv_len, window=0) -> None:
    ours = attend(q, k, v, pos, kv_len, window)
    ref = _flash_attn_ref(q, k, v, pos, kv_len, SCALE, window)
    err = float(np.abs(ours - ref).max())
    assert err <= 2e-6 * max(1.0, float(np.abs(ref).max())), f"max |diff| {err:.3g}"


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("hq,hk", GROUPS)
@pytest.mark.parametrize("keys", KEYS)
def test_one_query_at_the_end_of_a_full_cache(rng, keys, hq, hk, dtype):
    check(*case(rng, keys, hq, hk, dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("keys", [7, 1025])
def test_keys_past_kv_len_are_not_read(rng, keys, dtype):
    """A query whose position is past kv_len (padding rows of a bucket) still sees only kv_len keys."""
    q, k, v, _, kv_len = case(rng, keys, 9, 3, dtype, spare=300)
    check(q, k, v, np.array([keys + 299], np.int32), kv_len)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_q", [2, 5])
def test_several_queries_see_different_key_counts(rng, n_q, dtype):
    """Verify/speculative steps: a few queries at consecutive positions, each its own causal range."""
    check(*case(rng, 1025, 8, 2, dtype, n_q=n_q, spare=3))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("keys, window", [(20, 0), (2310, 0), (2310, 300)])
def test_each_query_of_a_verify_call_is_bitwise_its_decode_step(rng, keys, window, dtype):
    """A speculative verify call (up to DECODE_MAX_QUERIES queries) on the decode kernel: each row equals the
    one-query call at its position bit for bit, its keys chunked by its own position (2310 keys: the rows'
    chunk counts differ, 9 then 10 of 256 keys; 20: every row at the minimum of 8)."""
    n_q = ATT.DECODE_MAX_QUERIES
    q, k, v, pos, kv_len = case(rng, keys, 9, 3, dtype, n_q=n_q)
    many = attend(q, k, v, pos, kv_len, window)
    for t in range(n_q):
        one = attend(q[t:t + 1].copy(), k, v, pos[t:t + 1].copy(), pos[t:t + 1] + 1, window)
        assert np.array_equal(many[t], one[0]), f"query {t} at {pos[t]}: |diff| {np.abs(many[t] - one[0]).max():.3g}"


@pytest.mark.parametrize("window", [1, 5, 300])
def test_sliding_window(rng, window):
    check(*case(rng, 1025, 9, 3, np.float32, n_q=3), window=window)


@pytest.mark.parametrize("d", [16, 32, 128, 256])
def test_other_head_dims(rng, d):
    check(*case(rng, 511, 8, 2, np.float32, d=d))
    check(*case(rng, 511, 8, 2, np.float16, d=d))


def test_no_visible_key_gives_zero(rng):
    q, k, v, _, _ = case(rng, 7, 9, 3, np.float32)
    ours = attend(q, k, v, np.array([6], np.int32), np.array([0], np.int32))
    assert not ours.any()


def test_results_do_not_depend_on_thread_count(rng):
    args = case(rng, 4095, 9, 3, np.float16)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = attend(*args)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        assert np.array_equal(one, attend(*args))
    finally:
        numba.set_num_threads(before)


def test_replayed_step_reads_kv_len_and_the_cache_each_call(rng):
    """A bound step is replayed every token: kv_len, pos and the cache rows change under it."""
    q, k, v, pos, kv_len = case(rng, 600, 9, 3, np.float32, spare=500)
    k[600:], v[600:] = rng.standard_normal(k[600:].shape), rng.standard_normal(v[600:].shape)  # later tokens'
    o = np.empty((1, 9, 64), np.float32)
    _, step = LR._flash_attn(None, [q, k, v, pos, kv_len], [o], {"scale": SCALE, "window": 0})
    for keys in (600, 601, 1100, 3):
        k[keys - 1] = rng.standard_normal(k.shape[1:])
        v[keys - 1] = rng.standard_normal(v.shape[1:])
        pos[0], kv_len[0] = keys - 1, keys
        step()
        np.testing.assert_allclose(o, _flash_attn_ref(q, k, v, pos, kv_len, SCALE, 0), rtol=0, atol=2e-6)


def test_decode_uses_the_decode_kernel_and_prefill_the_prefill_one(rng):
    q, k, v, pos, kv_len = case(rng, 511, 9, 3, np.float32)
    LR.RECORD = []
    try:
        attend(q, k, v, pos, kv_len)
        for n in (ATT.DECODE_MAX_QUERIES, ATT.DECODE_MAX_QUERIES + 1):  # a verify call's most, one more
            attend(np.repeat(q, n, axis=0), k, v, np.arange(511 - n, 511, dtype=np.int32), kv_len)
        used = [use[1] for use in LR.RECORD]
    finally:
        LR.RECORD = None
    assert used == [ATT.KERNELS[64, 3, False], ATT.KERNELS[64, 3, False], LR.ATP.KERNELS[64]]


def test_precompile_helper_finds_the_kernels_by_name():
    jobs = precompile._Jobs()
    for key, kernel in ATT.KERNELS.items():
        name = jobs.kernel(kernel, ())
        assert precompile._dispatcher(name, jobs.sigs)[0] is kernel, (key, name)


def test_f16_widening_matches_numpy_on_every_half():
    bits = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16)
    expected = bits.view(np.float16).astype(np.float32).view(np.uint32)  # nan payloads and -0 compared as bits
    ours = np.empty(bits.shape, np.float32)
    ATT.widen_f16(bits, ours)
    assert np.array_equal(ours.view(np.uint32), expected)
    rows = np.full((1030, 1, 64), np.nan, np.float32)  # prefill's row widening: only the first n rows
    ATT.widen_f16_rows(bits.reshape(1024, 1, 64), 1024, rows)
    assert np.array_equal(rows[:1024].reshape(-1).view(np.uint32), expected)
    assert np.isnan(rows[1024:]).all()


# A packed select: AVX2's blend, AVX-512's masked blends, or (LLVM's choice for znver4) a ternary-logic bit select.
PACKED_SELECT = "vblendvps|vpblendmd|vblendmps|vpternlogd|vpternlogq"


def test_f16_widening_is_vectorized():
    """The widening loop compiles to packed conversions (zero-extend, shift, multiply, blend), not a scalar
    loop with a branch per element (which is what made f16 caches slower than f32 ones)."""
    fresh = numba.njit(nogil=True)(ATT.widen_f16.py_func)  # uncached: a cache-loaded kernel has no asm to show
    sig = (numba.types.uint16[::1], numba.types.float32[::1])
    fresh.compile(sig)
    asm = fresh.inspect_asm(sig)
    assert re.search(r"vpmovzxwd\s+[^\n]*%[xyz]mm", asm), "no packed uint16 -> uint32 widening"
    assert re.search(r"vmulps\s+[^\n]*%[yz]mm", asm), "no packed multiply by 2^112"
    assert re.search(rf"({PACKED_SELECT})\s+[^\n]*%[xyz]mm", asm), "inf/nan not fixed by a packed select"


def test_f16_decode_kernel_widens_in_vector_registers():
    """Inside the f16 decode kernel too (K in the dot products, V rows into scratch): packed shifts, scaling
    multiplies and blends on 256-bit (or 512-bit) registers. Compiled serial and uncached to read its asm."""
    q, k = np.ones((1, 9, 64), np.float32), np.ones((100, 3, 64), np.float16)
    kernel, args = ATT.bind_decode(q, k, k, np.array([99], np.int32), np.array([100], np.int32), np.float32(0.1), 0,
                                   np.empty((1, 9, 64), np.float32))
    fresh = numba.njit(fastmath=True)(kernel.py_func)
    sig = tuple(numba.typeof(a) for a in args)
    fresh.compile(sig)
    asm = fresh.inspect_asm(sig)
    for op in ("vpslld", "vmulps", PACKED_SELECT):
        assert re.search(rf"({op})\s+[^\n]*%[yz]mm", asm), op


_CACHE_PROBE = r"""
import numpy as np
from graphir.backends.cpu import attention as ATT
q = np.ones((1, 9, 64), np.float32)
k = np.ones((100, 3, 64), np.float32)
kernel, args = ATT.bind_decode(q, k, k, np.array([99], np.int32), np.array([100], np.int32), np.float32(0.1), 0,
                               np.empty((1, 9, 64), np.float32))
kernel(*args)
print(sum(kernel.stats.cache_hits.values()), sum(kernel.stats.cache_misses.values()))
"""


def test_a_second_process_loads_the_kernel_from_numbas_cache(tmp_path):
    """The kernels are closures: their cache entries must not depend on anything that differs between
    processes (a captured dispatcher did, so every process compiled them again, ~3 s)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    hits, misses = (int(x) for x in runs[1].stdout.split())
    assert (hits, misses) == (1, 0), runs[1].stdout + runs[1].stderr
