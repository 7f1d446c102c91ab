"""graphir.quant against gguf-py's reference codecs, plus round trips and error cases."""

from __future__ import annotations

import numpy as np
import pytest

from graphir import quant
from graphir.dtypes import DTYPES, QUANTIZED
from graphir.errors import GraphError

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402

SIMPLE = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # types with a quantizer
K_TYPES = tuple(t for t in QUANTIZED if t not in SIMPLE)

# Per-block bound on |x - dequantize(quantize(x))| as a fraction of the block's max |x|:
# one code step (clamping the top code of q4_0/q5_0 costs a full step), plus slack for f16 scales.
STEP = {"q4_0": 1 / 8, "q4_1": 2 / 30, "q5_0": 1 / 16, "q5_1": 2 / 62, "q8_0": 1 / 254}


def _qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name.upper()]


def _shapes(name: str) -> list[tuple[int, ...]]:
    shapes = [(1, 256), (7, 512), (3, 1024), (2, 3, 256)]
    return shapes + [(5, 96), (64,)] if DTYPES[name].block == 32 else shapes


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantize_matches_gguf(name: str) -> None:
    rng = np.random.default_rng(1)
    for shape in _shapes(name):
        raw = quant.random_quantized(rng, name, shape)
        assert raw.dtype == np.uint8 and raw.shape == shape[:-1] + (quant.row_bytes(name, shape[-1]),)
        got = quant.dequantize(raw, name, shape)
        want = gguf.quants.dequantize(raw, _qtype(name))
        assert got.dtype == np.float32 and got.shape == shape
        np.testing.assert_array_equal(got, want.reshape(shape))
        # Flat bytes decode the same.
        np.testing.assert_array_equal(quant.dequantize(raw.reshape(-1), name, shape), got)


@pytest.mark.parametrize("name", QUANTIZED)
def test_random_quantized_is_modest(name: str) -> None:
    x = quant.dequantize(quant.random_quantized(np.random.default_rng(2), name, (4, 512)), name, (4, 512))
    assert np.isfinite(x).all()
    assert 0.05 < np.abs(x).max() <= 2.0
    assert np.abs(x).mean() > 0.01


def test_q4_0_element_order() -> None:
    # d = 1; byte j holds element j (low nibble) and element j + 16 (high nibble).
    qs = np.arange(16, dtype=np.uint8) | (np.uint8(15) - np.arange(16, dtype=np.uint8)) << 4
    raw = np.concatenate([np.array([1.0], "<f2").view(np.uint8), qs])
    want = np.concatenate([np.arange(16), 15 - np.arange(16)]).astype(np.float32) - 8
    np.testing.assert_array_equal(quant.dequantize(raw, "q4_0", (32,)), want)


@pytest.mark.parametrize("name", SIMPLE)
def test_quantize_matches_gguf_bytes(name: str) -> None:
    rng = np.random.default_rng(3)
    for shape in [(1, 256), (7, 512), (5, 96), (2, 3, 64)]:
        x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 10)
        got = quant.quantize(x, name)
        assert got.dtype == np.uint8 and got.shape == shape[:-1] + (quant.row_bytes(name, shape[-1]),)
        np.testing.assert_array_equal(got, gguf.quants.quantize(x, _qtype(name)))


@pytest.mark.parametrize("name", SIMPLE)
def test_quantize_special_blocks_match_gguf(name: str) -> None:
    # All-zero, constant, single spike, and exact ties in magnitude.
    x = np.zeros((4, 32), np.float32)
    x[1] = 0.75
    x[2, 5] = -3.0
    x[3, ::2], x[3, 1::2] = 2.0, -2.0
    np.testing.assert_array_equal(quant.quantize(x, name), gguf.quants.quantize(x, _qtype(name)))
    assert not quant.dequantize(quant.quantize(x, name), name, x.shape)[0].any()


@pytest.mark.parametrize("name", SIMPLE)
def test_round_trip_error(name: str) -> None:
    x = np.random.default_rng(4).standard_normal((8, 1024)).astype(np.float32)
    y = quant.dequantize(quant.quantize(x, name), name, x.shape)
    err = np.abs(y - x).reshape(-1, 32).max(axis=1)
    amax = np.abs(x).reshape(-1, 32).max(axis=1)
    assert (err <= (STEP[name] + 2e-3) * amax).all()
    assert 0 < err.max()


def test_bf16_round_trip() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 100)).astype(np.float32)
    x[0, :4] = [np.inf, -np.inf, 0.0, -0.0]
    bits = quant.quantize(x, "bf16")
    assert bits.dtype == np.uint16 and bits.shape == x.shape
    # Round to nearest even on the dropped 16 bits.
    u = x.view(np.uint32).astype(np.uint64)
    np.testing.assert_array_equal(bits, ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16))
    np.testing.assert_array_equal(bits.view(np.uint8), gguf.quants.quantize(x, GGMLQuantizationType.BF16))
    y = quant.dequantize(bits, "bf16", x.shape)
    np.testing.assert_array_equal(y, (bits.astype(np.uint32) << 16).view(np.float32))
    fin = np.isfinite(x)
    np.testing.assert_array_equal(y[~fin], x[~fin])
    assert (np.abs(y[fin] - x[fin]) <= np.abs(x[fin]) * 2.0**-8).all()  # half an ulp of an 8-bit mantissa
    assert np.isnan(quant.dequantize(quant.quantize(np.array([np.nan], np.float32), "bf16"), "bf16", (1,))).all()


def test_bf16_ties_round_to_even() -> None:
    # 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: goes to the even 1.0; 1 + 3*2^-8 goes up.
    x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8], np.float32)
    np.testing.assert_array_equal(quant.quantize(x, "bf16"), np.array([0x3F80, 0x3F82], np.uint16))


def test_float_types() -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_array_equal(quant.dequantize(x, "f32", x.shape), x)
    h = quant.quantize(x, "f16")
    assert h.dtype == np.float16
    np.testing.assert_array_equal(quant.dequantize(h, "f16", x.shape), h.astype(np.float32))
    np.testing.assert_array_equal(quant.dequantize(h.view(np.uint8), "f16", x.shape), h.astype(np.float32))
    for name in ("f32", "f16", "bf16"):
        r = quant.random_quantized(rng, name, (2, 8))
        assert r.dtype == np.dtype(DTYPES[name].storage) and r.shape == (2, 8)


def test_empty() -> None:
    raw = quant.random_quantized(np.random.default_rng(7), "q6_k", (0, 256))
    assert quant.dequantize(raw, "q6_k", (0, 256)).shape == (0, 256)
    assert quant.quantize(np.zeros((0, 64), np.float32), "q8_0").shape == (0, 68)


@pytest.mark.parametrize("name", K_TYPES)
def test_no_quantizer_for_k_types(name: str) -> None:
    with pytest.raises(GraphError, match=name):
        quant.quantize(np.zeros((1, 256), np.float32), name)


def test_errors() -> None:
    rng = np.random.default_rng(8)
    raw = quant.random_quantized(rng, "q4_k", (2, 256))
    with pytest.raises(GraphError, match=r"q4_k.*\(2, 512\)"):
        quant.dequantize(raw, "q4_k", (2, 512))  # too few bytes
    with pytest.raises(GraphError, match="q4_k"):
        quant.dequantize(raw[:, :-1], "q4_k", (2, 256))
    with pytest.raises(GraphError, match="q4_k"):
        quant.dequantize(raw.reshape(4, 72), "q4_k", (2, 256))  # right size, rows cut mid-row
    with pytest.raises(GraphError, match="q4_k"):
        quant.dequantize(raw.view(np.int8), "q4_k", (2, 256))
    with pytest.raises(GraphError, match=r"q8_0.*\(3, 48\).*multiple"):
        quant.dequantize(np.zeros((3, 51), np.uint8), "q8_0", (3, 48))
    with pytest.raises(GraphError, match=r"q4_0.*multiple"):
        quant.quantize(np.zeros((2, 40), np.float32), "q4_0")
    with pytest.raises(GraphError, match="q8_0"):
        quant.quantize(np.array([[np.nan] * 32], np.float32), "q8_0")
    with pytest.raises(GraphError, match=r"iq4_xs.*multiple"):
        quant.random_quantized(rng, "iq4_xs", (1, 128))
    with pytest.raises(GraphError, match="f16"):
        quant.dequantize(np.zeros(5, np.float16), "f16", (2, 3))
    with pytest.raises(GraphError, match="bf16"):
        quant.dequantize(np.zeros(6, np.float32), "bf16", (2, 3))
    with pytest.raises(GraphError, match="nope"):
        quant.dequantize(raw, "nope", (2, 256))
    with pytest.raises(GraphError, match="q5_0"):
        quant.row_bytes("q5_0", 33)
