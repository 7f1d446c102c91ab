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
