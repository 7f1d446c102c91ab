"""Repacked decode GEMV (backends/cpu/gemv_repacked.py) against an independent f32 reference.

The reference dequantizes with gguf-py and multiplies in float64 with numpy; the kernels
accumulate in float32, so the tolerance is 1e-4 of max|y|.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402
from graphir.backends.cpu import gemv_repacked as GR  # noqa: E402

Q = gguf.GGMLQuantizationType
GGML = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}
TOL = 1e-4


def _case(dtype, rows, n_in, n_tok, seed):
    rng = np.random.default_rng(seed)
    wf = rng.standard_normal((rows, n_in)).astype(np.float32) + np.float32(0.3)  # mean != 0: min / -8 term
    raw = quantize(wf, GGML[dtype])
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32) + np.float32(0.5)
    ref = x.astype(np.float64) @ dequantize(raw, GGML[dtype]).astype(np.float64).T
    return raw, x, ref


@pytest.mark.parametrize("dtype", sorted(GGML))
@pytest.mark.parametrize("rows", [1, 7, 511, 1025])
@pytest.mark.parametrize("n_in", [32, 96, 576, 1536])
def test_gemv_matches_reference(dtype, rows, n_in):
    for n_tok in range(1, 5):
        raw, x, ref = _case(dtype, rows, n_in, n_tok, seed=rows * 7919 + n_in + n_tok)
        out = np.full((n_tok, rows), np.nan, np.float32)
        cache: dict = {}
        run = GR.prepare(raw, dtype, x, out, cache, ("param", "w"), max_tokens=4)
        assert run is not None
        run()
        np.testing.assert_allclose(out, ref, rtol=0, atol=TOL * np.abs(ref).max())
        # x is read in place at every call; the repacked weight is cached and shared
        x[...] = x[::-1].copy() if n_tok > 1 else -x
        ref2 = x.astype(np.float64) @ dequantize(raw, GGML[dtype]).astype(np.float64).T
        run2 = GR.prepare(raw, dtype, x, out, cache, ("param", "w"), max_tokens=4)
        assert len(cache) == 1
        run2()
        np.testing.assert_allclose(out, ref2, rtol=0, atol=TOL * np.abs(ref2).max())


def test_repack_q4_layout_roundtrip():
    raw, _, _ = _case("q4_1", 5, 96, 1, seed=1)  # 3 blocks: one pair and an odd last block
    d, c, qs = GR.repack(raw, "q4_1")
    w = dequantize(raw, Q.Q4_1).reshape(5, 3, 32)
    vals = np.empty((5, 3, 32), np.float32)
    vals[:, 0] = qs[:, :32] & 15
    vals[:, 1] = qs[:, :32] >> 4
    vals[:, 2, :16] = qs[:, 32:] & 15
    vals[:, 2, 16:] = qs[:, 32:] >> 4
    np.testing.assert_allclose(d[:, :, None] * vals + c[:, :, None], w, rtol=1e-6, atol=1e-6)


def test_unsupported_returns_none():
    raw, x, _ = _case("q4_1", 8, 64, 1, seed=2)
    out = np.empty((1, 8), np.float32)
    assert GR.prepare(raw, "q4_k", x, out) is None  # dtype
    assert GR.prepare(np.zeros((8, 64), np.float32), "f32", x, out) is None
    x5 = np.zeros((5, 64), np.float32)
    assert GR.prepare(raw, "q4_1", x5, np.empty((5, 8), np.float32), max_tokens=4) is None  # too many tokens
    assert GR.prepare(raw, "q4_1", np.zeros((2, 64), np.float32), np.empty((2, 8), np.float32)) is None  # default: 1
    assert GR.prepare(raw, "q4_1", np.zeros((1, 32), np.float32), out) is None  # n_in mismatch
    assert GR.prepare(raw, "q4_1", x, np.empty((1, 9), np.float32)) is None  # out shape
    assert GR.prepare(raw, "q4_1", x, out) is not None


def _uncached_kernels(lanes: int) -> dict:
    """The module's kernels generated with `lanes` accumulator lanes, compiled here (serial, uncached:
    inspect_asm reads nothing back from numba's cache) with the module's vectorizer settings."""
    import numba

    src = GR._kernel_source(lanes).replace("parallel=True, cache=True", "parallel=False, cache=False")
    ns = {"njit": numba.njit, "prange": numba.prange, "f32": np.float32, "u8": np.uint8, "i8": np.int8}
    exec(compile(src, f"<gemv lanes={lanes}>", "exec"), ns)
    return ns


def test_lanes_follow_the_compile_target():
    assert GR.lanes_for("+avx2,+fma,+avx512f,+avx512bw") == 16
    assert GR.lanes_for("+avx2,+fma,-avx512f") == 8
    assert GR.lanes_for("") == 8  # NUMBA_CPU_NAME=generic
    # a user's NUMBA_CPU_FEATURES decides, not the host: it is what numba compiles for
    from numba.core import config

    old = config.CPU_FEATURES
    try:
        config.CPU_FEATURES = "+avx2,+fma"
        assert GR.target_features() == "+avx2,+fma"
        config.CPU_FEATURES = None
        assert GR.target_features() == GR.get_host_cpu_features()
    finally:
        config.CPU_FEATURES = old
    assert GR.LANES == GR.lanes_for(GR.target_features())


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("dtype", sorted(GGML))
def test_both_lane_counts_match_reference(lanes, dtype):
    ns = _uncached_kernels(lanes)
    for rows, n_in in ((7, 96), (33, 576)):  # 96: a q4 pair and an odd last block
        raw, x, ref = _case(dtype, rows, n_in, 1, seed=lanes * 101 + n_in)
        d, c, qs = GR.repack(raw, dtype)
        y = np.full(rows, np.nan, np.float32)
        with GR.slp_only():
            if dtype == "q8_0":
                ns["_gemv_q8"](d, qs, x[0], y, 1)
            else:
                ns["_gemv_q4"](d, c, qs, x[0], x[0].reshape(-1, 32).sum(axis=1, dtype=np.float32), y, 1)
        np.testing.assert_allclose(y, ref[0], rtol=0, atol=TOL * np.abs(ref).max())


@pytest.mark.skipif(GR.LANES != 16, reason="numba's compile target has no AVX-512F")
def test_q4_kernel_uses_512_bit_registers_on_avx512():
    """The 16-lane q4 body is what puts LLVM in zmm registers (the 8-lane one stays in ymm)."""
    import re

    from numba import types as t

    a2, f1 = (lambda dt: t.Array(dt, 2, "C")), t.Array(t.float32, 1, "C")
    sig = (a2(t.float32), a2(t.float32), a2(t.uint8), f1, f1, f1, t.int64)
    for lanes, want in ((16, True), (8, False)):
        k = _uncached_kernels(lanes)["_gemv_q4"]
        with GR.slp_only():
            k.compile(sig)
        zmm = len(re.findall(r"%zmm\d+", k.inspect_asm(sig)))
        assert (zmm >= 16) == want, (lanes, zmm)
