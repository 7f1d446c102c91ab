"""Numpy codecs for GGUF block-quantized types (and the plain float storage types).

Layouts follow ggml (little-endian, f16 scales). Every codec works on a whole array of
blocks at once: raw bytes are reshaped to (n_blocks, block_bytes) and decoded with array ops.
Quantizers reproduce ggml's reference round-to-nearest arithmetic step by step, so their
bytes match llama.cpp / gguf-py for the same float32 input.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from graphir.dtypes import DType
from graphir.dtypes import dtype as _lookup
from graphir.errors import GraphError

# IQ4_NL / IQ4_XS non-linear 4-bit code book.
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)

_F32 = np.float32


def row_bytes(dtype: str, n: int) -> int:
    """Bytes taken by a row of `n` elements of `dtype`."""
    return _lookup(dtype).row_bytes(n)


# ---------------------------------------------------------------- byte-field helpers


def _f16(blocks: np.ndarray, off: int) -> np.ndarray:
    """The f16 field at byte `off` of every block, as float32 of shape (n_blocks, 1)."""
    return np.ascontiguousarray(blocks[:, off : off + 2]).view("<f2").astype(_F32)


def _put_f16(values: np.ndarray) -> np.ndarray:
    """float32 (n_blocks, 1) -> the f16 field bytes (n_blocks, 2)."""
    with np.errstate(over="ignore"):
        return values.astype("<f2").view(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Bytes (..., m) -> 4-bit codes (..., 2m): low nibbles first, then high nibbles."""
    return np.concatenate([q & 0x0F, q >> 4], axis=-1)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Inverse of _nibbles for codes < 16 (higher bits of the first half are dropped)."""
    m = q.shape[-1] // 2
    return (q[..., :m] & 0x0F) | (q[..., m:] << 4)


def _bits32(field: np.ndarray) -> np.ndarray:
    """A little-endian u32 bit field (n_blocks, 4 bytes) -> bit j as a 0/1 code (n_blocks, 32)."""
    return np.unpackbits(field, axis=-1, bitorder="little")


def _recip(d: np.ndarray) -> np.ndarray:
    """1/d, with 0 where d == 0 (an all-zero block quantizes to zero codes, as in ggml)."""
    out = np.zeros_like(d)
    np.divide(_F32(1), d, out=out, where=d != 0)
    return out


# ---------------------------------------------------------------- 32-element block types


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return _f16(b, 0) * q.astype(_F32)


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _nibbles(b[:, 4:20]).astype(_F32) + _f16(b, 2)


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    q = (_nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)).astype(np.int8) - np.int8(16)
    return _f16(b, 0) * q.astype(_F32)


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.astype(_F32) + _f16(b, 2)


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(_F32)


def _absmax_signed(x: np.ndarray) -> np.ndarray:
    """Per block, the element of largest magnitude with its sign (first one on ties, like ggml)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1, keepdims=True), axis=-1)


def _trunc_codes(v: np.ndarray, top: int) -> np.ndarray:
    # ggml casts (x*id + 0.5 [+ offset]) to int, i.e. truncates, then clamps the top code.
    return np.minimum(np.trunc(v).astype(np.uint8), np.uint8(top))


def _q_q4_0(x: np.ndarray) -> np.ndarray:
    d = _absmax_signed(x) / _F32(-8)
    q = _trunc_codes(x * _recip(d) + _F32(8.5), 15)
    return np.concatenate([_put_f16(d), _pack_nibbles(q)], axis=-1)


def _q_q4_1(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = (hi - lo) / _F32(15)
    q = _trunc_codes((x - lo) * _recip(d) + _F32(0.5), 15)
    return np.concatenate([_put_f16(d), _put_f16(lo), _pack_nibbles(q)], axis=-1)


def _q_q5_0(x: np.ndarray) -> np.ndarray:
    d = _absmax_signed(x) / _F32(-16)
    q = _trunc_codes(x * _recip(d) + _F32(16.5), 31)
    qh = np.packbits(q >> 4, axis=-1, bitorder="little")
    return np.concatenate([_put_f16(d), qh, _pack_nibbles(q)], axis=-1)


def _q_q5_1(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = (hi - lo) / _F32(31)
    q = _trunc_codes((x - lo) * _recip(d) + _F32(0.5), 31)
    qh = np.packbits(q >> 4, axis=-1, bitorder="little")
    return np.concatenate([_put_f16(d), _put_f16(lo), qh, _pack_nibbles(q)], axis=-1)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf (half away from zero), exact: floor(|v| + 0.5) can round up 0.49999997."""
    a = np.abs(v)
    f = np.floor(a)
    return np.copysign(f + (a - f >= _F32(0.5)), v)


def _q_q8_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=-1, keepdims=True) / _F32(127)
    q = _roundf(x * _recip(d)).astype(np.int8).view(np.uint8)
    return np.concatenate([_put_f16(d), q], axis=-1)


# ---------------------------------------------------------------- 256-element super-block types


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12 scale bytes -> 8 six-bit scales and 8 six-bit mins, as float32 (n_blocks, 8).

    Bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of
    scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits sit in bits 6-7 of bytes 0-7.
    """
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(_F32), mn.astype(_F32)


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    # Each 32-byte chunk of qs holds two 32-element sub-blocks: low nibbles, then high nibbles.
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).astype(_F32)
    y = (_f16(b, 0) * sc)[:, :, None] * q - (_f16(b, 2) * mn)[:, :, None]
    return y.reshape(n, 256)


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    low = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    # Bit i of qh[l] is the fifth bit of element l of sub-block i.
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (low | (high << 4)).astype(_F32)
    y = (_f16(b, 0) * sc)[:, :, None] * q - (_f16(b, 2) * mn)[:, :, None]
    return y.reshape(n, 256)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    # Per 128-element half: ql's 64 bytes give 4 groups of 32 low nibbles
    # (lo[0:32], lo[32:64], hi[0:32], hi[32:64]); qh's 32 bytes give each group's top 2 bits.
    low = _nibbles(b[:, 0:128].reshape(n, 2, 64))
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    q = (low | (high.reshape(n, 2, 128) << 4)).astype(np.int8) - np.int8(32)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(_F32)  # one per 16 elements
    y = (_f16(b, 208) * scales)[:, :, None] * q.reshape(n, 16, 16).astype(_F32)
    return y.reshape(n, 256)


def _deq_iq4_xs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sh = np.ascontiguousarray(b[:, 2:4]).view("<u2")  # (n, 1): 2 high bits per sub-block
    sl = b[:, 4:8]
    low = np.stack([sl & 0x0F, sl >> 4], axis=-1).reshape(n, 8)
    high = (sh >> (2 * np.arange(8, dtype=np.uint16))) & 3
    ls = (low.astype(np.int32) | (high.astype(np.int32) << 4)) - 32
    q = _nibbles(b[:, 8:136].reshape(n, 8, 16))
    y = (_f16(b, 0) * ls.astype(_F32))[:, :, None] * IQ4_NL_VALUES[q]
    return y.reshape(n, 256)


_DEQUANT: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "q4_0": _deq_q4_0,
    "q4_1": _deq_q4_1,
    "q5_0": _deq_q5_0,
    "q5_1": _deq_q5_1,
    "q8_0": _deq_q8_0,
    "q4_k": _deq_q4_k,
    "q5_k": _deq_q5_k,
    "q6_k": _deq_q6_k,
    "iq4_xs": _deq_iq4_xs,
}
_QUANT: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "q4_0": _q_q4_0,
    "q4_1": _q_q4_1,
    "q5_0": _q_q5_0,
    "q5_1": _q_q5_1,
    "q8_0": _q_q8_0,
}
# the types `quantize` makes (graphir.load(dtype=) converts to these); K-quants and iq4_xs are only read from GGUF files
CONVERTIBLE = ("f32", "f16", "bf16", *_QUANT)

# For random_quantized, per type: byte offset of the f16 scale d; the largest |code x sub-scale|
# product d multiplies (d = target / product gives values up to about `target`); byte offset of
# the f16 min field (None if absent) and the largest code it multiplies.
_RANDOM_FIELDS: dict[str, tuple[int, int, int | None, int]] = {
    "q4_0": (0, 8, None, 0),
    "q4_1": (0, 15, 2, 1),
    "q5_0": (0, 16, None, 0),
    "q5_1": (0, 31, 2, 1),
    "q8_0": (0, 127, None, 0),
    "q4_k": (0, 63 * 15, 2, 63),
    "q5_k": (0, 63 * 31, 2, 63),
    "q6_k": (208, 128 * 32, None, 0),
    "iq4_xs": (0, 32 * 127, None, 0),
}


# ---------------------------------------------------------------- validation


def _check_shape(dt: DType, shape: tuple[int, ...]) -> None:
    if any(int(s) < 0 for s in shape):
        raise GraphError(f"dtype {dt.name}: shape {shape} has a negative dimension")
    if dt.quantized and not shape:
        raise GraphError(f"dtype {dt.name}: shape {shape}: a quantized tensor needs at least one axis")
    if dt.quantized and shape[-1] % dt.block:
        raise GraphError(
            f"dtype {dt.name}: shape {shape}: the innermost axis ({shape[-1]}) must be a multiple of the block size "
            f"{dt.block}"
        )


def _blocks(raw: np.ndarray, dt: DType, shape: tuple[int, ...]) -> np.ndarray:
    """Validate quantized raw bytes against the logical shape; return (n_blocks, block_bytes)."""
    rb = dt.row_bytes(shape[-1])
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    if raw.dtype != np.uint8:
        raise GraphError(f"dtype {dt.name}: shape {shape}: raw data must be uint8 bytes, got {raw.dtype}")
    flat_ok = raw.ndim == 1 and raw.size == rows * rb
    rows_ok = raw.ndim >= 1 and raw.shape[-1] == rb and raw.size == rows * rb
    if not (flat_ok or rows_ok):
        raise GraphError(
            f"dtype {dt.name}: shape {shape}: raw bytes of shape {raw.shape} do not match; expected flat "
            f"{rows * rb} bytes or [..., {rb}] with {rows} rows ({rb} bytes per row of {shape[-1]})"
        )
    return np.ascontiguousarray(raw).reshape(rows * rb // dt.block_bytes, dt.block_bytes)


def _float_values(raw: np.ndarray, dt: DType, shape: tuple[int, ...]) -> np.ndarray:
    """Validate a plain-float storage array (or its raw bytes); return it flat in its storage dtype."""
    store = np.dtype(dt.storage).newbyteorder("<")
    if raw.dtype == np.uint8 and store.itemsize > 1:
        if raw.size % store.itemsize or (raw.ndim and raw.shape[-1] % store.itemsize):
            raise GraphError(f"dtype {dt.name}: shape {shape}: {raw.size} raw bytes are not whole {store} values")
        raw = np.ascontiguousarray(raw).view(store)
    elif raw.dtype != store:
        raise GraphError(
            f"dtype {dt.name}: shape {shape}: storage must be {dt.storage} (or uint8 bytes), got {raw.dtype}"
        )
    size = int(np.prod(shape, dtype=np.int64))
    if raw.size != size or (raw.ndim > 1 and shape and raw.shape[-1] != shape[-1]):
        raise GraphError(f"dtype {dt.name}: shape {shape}: storage of shape {raw.shape} does not hold {size} values")
    return raw.reshape(-1)


# ---------------------------------------------------------------- public API


def dequantize(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Decode storage `raw` of `dtype` into float32 of the logical `shape` (numpy order, innermost last).

    Quantized types take uint8 of shape [..., row_bytes] or flat; f32/f16 take float arrays and
    bf16 takes uint16 raw bits (any of these may also be given as their uint8 bytes).
    """
    dt = _lookup(dtype)
    shape = tuple(int(s) for s in shape)
    raw = np.asarray(raw)
    _check_shape(dt, shape)
    if dt.quantized:
        return _DEQUANT[dt.name](_blocks(raw, dt, shape)).reshape(shape)
    if dt.name not in ("f32", "f16", "bf16"):
        raise GraphError(f"dtype {dt.name}: shape {shape}: not a float type, nothing to dequantize")
    v = _float_values(raw, dt, shape)
    if dt.name == "bf16":
        # bf16 is the top half of an f32.
        return (v.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return v.astype(np.float32).reshape(shape)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even; NaNs stay NaN (quiet bit set), as ggml does."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def quantize(x: np.ndarray, dtype: str) -> np.ndarray:
    """Encode float `x` as `dtype` storage along its innermost axis.

    Block types give uint8 of shape x.shape[:-1] + (row_bytes,); bf16 gives uint16 bits,
    f16 float16 and f32 float32, each of shape x.shape. K-quants and iq4_xs have no quantizer.
    """
    dt = _lookup(dtype)
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating) and not np.issubdtype(x.dtype, np.integer):
        raise GraphError(f"dtype {dt.name}: cannot quantize values of numpy type {x.dtype}")
    x = x.astype(np.float32)
    if dt.name == "f32":
        return x.copy()
    if dt.name == "f16":
        with np.errstate(over="ignore"):  # out-of-range values become inf, as a C cast would
            return x.astype(np.float16)
    if dt.name == "bf16":
        return _bf16_bits(x).reshape(x.shape)
    if dt.name not in _QUANT:
        raise GraphError(
            f"dtype {dt.name}: no quantizer (supported: f32, f16, bf16, {', '.join(_QUANT)}); "
            "use random_quantized for test data"
        )
    _check_shape(dt, x.shape)
    if not np.isfinite(x).all():
        raise GraphError(f"dtype {dt.name}: shape {x.shape}: cannot quantize non-finite values")
    blocks = x.reshape(-1, dt.block) if x.size else np.zeros((0, dt.block), np.float32)
    out = _QUANT[dt.name](blocks)
    return out.reshape(x.shape[:-1] + (dt.row_bytes(x.shape[-1]),))


def random_quantized(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random valid storage for `dtype` and logical `shape`: random codes, modest finite scales.

    Values dequantize to roughly O(0.1 - 1). Plain float types get standard normal values.
    """
    dt = _lookup(dtype)
    shape = tuple(int(s) for s in shape)
    _check_shape(dt, shape)
    if dt.name in ("f32", "f16", "bf16"):
        v = rng.standard_normal(shape, dtype=np.float32)
        return _bf16_bits(v).reshape(shape) if dt.name == "bf16" else v.astype(dt.storage)
    if not dt.quantized:
        raise GraphError(f"dtype {dt.name}: random_quantized only makes float or block-quantized data")
    rb = dt.row_bytes(shape[-1])
    raw = rng.integers(0, 256, size=shape[:-1] + (rb,), dtype=np.uint8)
    b = raw.reshape(-1, dt.block_bytes)  # a view: writing scale fields writes raw
    d_off, product, m_off, m_code = _RANDOM_FIELDS[dt.name]
    target = rng.uniform(0.2, 1.0, size=(b.shape[0], 1)).astype(np.float32)  # about the block's max |value|
    b[:, d_off : d_off + 2] = _put_f16(target / _F32(product))
    if m_off is not None:
        # Shift values down by up to target/2. q4_1/q5_1 store the (negative) min itself;
        # K-quants store a positive dmin that the decoder subtracts.
        m = target / _F32(2 * m_code)
        b[:, m_off : m_off + 2] = _put_f16(-m if dt.block == 32 else m)
    return raw
