"""Split-K decode attention (backends/gpu/attention.cu) built for the host (tests/_host_emulation.py), no GPU
needed: a verify call's queries through the decode kernel and its combine give each query what a decode step at its
position gives (kv_len = position + 1), bit for bit, with the same n_split (attention.py sizes it for one query). The
rule greedy speculative decoding's exactness rests on; tests/test_speculative.py checks it on the GPU through whole
models."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from _host_emulation import build
from graphir.backends.gpu import attention

ATTN_HOST_PRELUDE = r"""
#include <atomic>
// the prefill kernel's shared bounds (built here, not run): atomics of the threads of one emulated block
inline int atomicMin(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int o = a.load();
    while (v < o && !a.compare_exchange_weak(o, v)) {}
    return o;
}
inline int atomicMax(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int o = a.load();
    while (v > o && !a.compare_exchange_weak(o, v)) {}
    return o;
}
"""
ATTN_HOST_LAUNCHERS = r"""
static void emu_launch3(unsigned gx, unsigned gy, unsigned gz, unsigned threads, const std::function<void()>& kernel) {
    for (unsigned z = 0; z < gz; ++z) {  // emu_launch's blocks, one z plane at a time
        emu_launch(gx, gy, threads, [&] { blockIdx.z = z; kernel(); });
    }
}
extern "C" void emu_decode(unsigned n_split, unsigned heads, unsigned n_q, const float* q, const float* k,
                           const float* v, const int* pos, const int* kv_len, float* pm, float* pl, float* pa, int hq,
                           int hk, int d, int dv, int cap, int min_chunk, float scale2, int n_gch, int* err) {
    emu_launch3(n_split, heads, n_q, 128, [=] { attn_decode_f32_d64_g4(q, k, v, pos, kv_len, pm, pl, pa, hq, hk, d,
                                                                      dv, cap, n_split, min_chunk, scale2, 0, n_gch,
                                                                      err, 1, 0); });
}
extern "C" void emu_decode_walk(unsigned blocks_x, unsigned n_split, unsigned heads, unsigned n_q, const float* q,
                                const float* k, const float* v, const int* pos, const int* kv_len, float* pm, float* pl,
                                float* pa, int hq, int hk, int d, int dv, int cap, int min_chunk, float scale2,
                                int n_gch, int* err) {
    emu_launch3(blocks_x, heads, n_q, 128, [=] { attn_decode_walk_f32_d64_g4(q, k, v, pos, kv_len, pm, pl, pa, hq, hk,
                                                                            d, dv, cap, n_split, min_chunk, scale2, 0,
                                                                            n_gch, err, 1, 0); });
}
extern "C" void emu_combine(unsigned hq, unsigned n_q, const float* pm, const float* pl, const float* pa,
                            const int* pos, const int* kv_len, float* out, int dv, int cap, int n_split,
                            int min_chunk) {
    emu_launch(hq, n_q, 256, [=] { attn_combine(pm, pl, pa, pos, kv_len, out, hq, dv, cap, n_split, min_chunk, 0); });
}
"""


@pytest.fixture(scope="module")
def decode_host(tmp_path_factory):
    """run(q [n_q, hq, d], k, v [cap, hk, d], pos, kv_len, n_split, blocks_x) -> out [n_q, hq, d]:
    attn_decode_f32_d64_g4 (blocks_x None: a block a split) or its walk twin over blocks_x blocks, and attn_combine
    (MIN_CHUNK keys a split at least), built for the host."""
    lib = build(tmp_path_factory.mktemp("attn_emu"), "attention.cu", ATTN_HOST_LAUNCHERS, ("-ffp-contract=off",),
                prelude=ATTN_HOST_PRELUDE)

    def run(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, kv_len: int, n_split: int,
            blocks_x: int | None = None) -> np.ndarray:
        n_q, hq, d = q.shape
        cap, hk, _ = k.shape
        parts = [np.full(n_q * hq * n_split * w, np.nan, np.float32) for w in (1, 1, d)]
        out = np.full((n_q, hq, d), np.nan, np.float32)
        pos, lens, err = np.ascontiguousarray(pos, np.int32), np.array([kv_len], np.int32), np.zeros(2, np.int32)
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)
        i, f = ctypes.c_int, ctypes.c_float
        launch = (ctypes.c_uint(n_split), ctypes.c_uint(hk), ctypes.c_uint(n_q), ptr(q), ptr(k), ptr(v), ptr(pos),
                  ptr(lens), *map(ptr, parts), i(hq), i(hk), i(d), i(d), i(cap), i(attention.MIN_CHUNK),
                  f(0.125 * attention.LOG2E), i(1), ptr(err))
        if blocks_x is None:
            lib.emu_decode(*launch)
        else:
            lib.emu_decode_walk(ctypes.c_uint(blocks_x), *launch)
        lib.emu_combine(ctypes.c_uint(hq), ctypes.c_uint(n_q), *map(ptr, parts), ptr(pos), ptr(lens), ptr(out), i(d),
                        i(cap), i(n_split), i(attention.MIN_CHUNK))
        assert not err.any() and not np.isnan(out).any()
        return out

    return run


@pytest.mark.parametrize("n_split,n_past,blocks_x", [(8, 300, None), (8, 300, 3), (8, 300, 1), (4, 60, None),
                                                     (4, 60, 2), (16, 5, None), (16, 5, 5)])
def test_verify_queries_are_decode_steps_on_the_host(decode_host, n_split, n_past, blocks_x):
    """5 queries after n_past keys (a verify call: kv_len n_past + 5) against 5 decode steps (kv_len position + 1):
    bit for bit, where chunks exceed MIN_CHUNK keys and the call's keys cross a multiple of n_split (300..305 over
    8 splits: chunks of 38 and 39 keys) and where they do not; and all within 1e-5 of the f64 softmax. The call
    runs the decode kernel (blocks_x None) or, as attention.py launches it, the walk kernel with blocks_x blocks a
    query, each walking splits x, x + blocks_x, ..."""
    rng = np.random.default_rng(n_split + n_past)
    hq, hk, d, cap, n_q = 4, 2, 64, 512, 5
    k, v = (rng.standard_normal((cap, hk, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((n_q, hq, d)).astype(np.float32)
    pos = np.arange(n_past, n_past + n_q, dtype=np.int32)
    rows = decode_host(q, k, v, pos, n_past + n_q, n_split, blocks_x)
    for t in range(n_q):
        step = decode_host(q[t:t + 1], k, v, pos[t:t + 1], int(pos[t]) + 1, n_split)[0]
        np.testing.assert_array_equal(rows[t], step, err_msg=f"query {t} at position {pos[t]}")
        kk, vv = np.repeat(k[:pos[t] + 1], hq // hk, 1), np.repeat(v[:pos[t] + 1], hq // hk, 1)
        s = np.einsum("hd,jhd->hj", q[t].astype(np.float64), kk) * 0.125
        w = np.exp(s - s.max(1, keepdims=True))
        want = np.einsum("hj,jhd->hd", w / w.sum(1, keepdims=True), vv)
        np.testing.assert_allclose(rows[t], want, rtol=0, atol=1e-5)


def test_walk_blocks_fill_about_one_wave():
    """A verify call's walk grid: heads x queries x walk_blocks blocks fill about the target (each block at least
    one split), a decode step's n_split at most."""
    assert attention.walk_blocks(64, 2 * 16, 64) == 2
    assert attention.walk_blocks(49, 8 * 16, 396) == 3
    assert attention.walk_blocks(8, 2, 1000) == 8  # never more blocks than splits
    assert attention.walk_blocks(8, 500, 64) == 1  # never fewer than one
