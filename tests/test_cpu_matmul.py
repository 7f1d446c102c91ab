"""CPU (numba) matmul and get_rows against an independent f32 reference.

The reference dequantizes with gguf-py (`gguf.quants.dequantize`) and multiplies in
float64 with numpy. The kernels accumulate in float32 from float32 activations, so the
tolerance is tight: 1e-4 of max|y|.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402
from graphir.backends.cpu.matmul import (  # noqa: E402
    SUPPORTED,
    get_rows,
    matmul,
    prepare_get_rows,
    prepare_matmul,
)

from graphir.dtypes import dtype as graph_dtype  # noqa: E402
from graphir.errors import GraphError  # noqa: E402

Q = gguf.GGMLQuantizationType
GGML = {
    "q4_0": Q.Q4_0,
    "q4_1": Q.Q4_1,
    "q5_0": Q.Q5_0,
    "q5_1": Q.Q5_1,
    "q8_0": Q.Q8_0,
    "q4_k": Q.Q4_K,
    "q5_k": Q.Q5_K,
    "q6_k": Q.Q6_K,
    "iq4_xs": Q.IQ4_XS,
}
QUANTIZABLE = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # gguf-py has a quantizer for these
# byte offsets of the f16 super-block scales (d, dmin) inside one block
F16_FIELDS = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0,)}
TOL = 1e-4  # relative to max|y|: float32 accumulation


def random_k_blocks(name: str, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for a K-quant / iq4_xs weight with modest f16 scales (0.005..0.02)."""
    dt = graph_dtype(name)
    raw = rng.integers(0, 256, size=(n_out, dt.row_bytes(n_in)), dtype=np.uint8)
    blocks = raw.reshape(n_out, -1, dt.block_bytes)
    for off in F16_FIELDS[name]:
        scale = rng.uniform(0.005, 0.02, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, off : off + 2] = scale.view(np.uint8).reshape(blocks.shape[:2] + (2,))
    return raw


@functools.cache
def weight(name: str, n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """(storage array, float32 reference [n_out, n_in]) for a random weight of type `name`."""
    rng = np.random.default_rng(zlib.crc32(f"{name}-{n_out}-{n_in}".encode()))
    if name == "f32":
        w = rng.standard_normal((n_out, n_in)).astype(np.float32)
        return w, w
    if name == "f16":
        w = rng.standard_normal((n_out, n_in)).astype(np.float16)
        return w, w.astype(np.float32)
    if name == "bf16":
        bits = (rng.standard_normal((n_out, n_in)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits, (bits.astype(np.uint32) << 16).view(np.float32)
    if name in QUANTIZABLE:
        w = quantize(rng.standard_normal((n_out, n_in)).astype(np.float32), GGML[name])
    else:
        w = random_k_blocks(name, n_out, n_in, rng)
    assert w.dtype == np.uint8 and w.shape == (n_out, graph_dtype(name).row_bytes(n_in))
    return w, dequantize(w, GGML[name]).astype(np.float32)


def shapes(name: str):
    block = graph_dtype(name).block if name in GGML else 1
    out = [(1, 256), (7, 512), (511, 1536), (1025, 256)]
    if block == 32 or block == 1:
        out += [(7, 96), (1025, 96)]
    return out


CASES = [(name, n_out, n_in) for name in SUPPORTED for n_out, n_in in shapes(name)]


def check(y: np.ndarray, ref: np.ndarray, tol: float = TOL):
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(y.astype(np.float64) - ref).max())
    assert err <= tol * scale, f"max abs err {err:.3g} > {tol:g} * max|y| ({scale:.3g})"


@pytest.mark.parametrize("name,n_out,n_in", CASES, ids=[f"{n}-{o}x{i}" for n, o, i in CASES])
def test_matmul_matches_reference(name, n_out, n_in):
    w, wf = weight(name, n_out, n_in)
    rng = np.random.default_rng(n_out * 7 + n_in)
    for n_tok in (1, 7, 33):
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        y = matmul(w, name, x)
        assert y.shape == (n_tok, n_out) and y.dtype == np.float32
        check(y, x.astype(np.float64) @ wf.astype(np.float64).T)


@pytest.mark.parametrize("name", ["f32", "bf16", "f16", "q4_k", "q6_k"])
@pytest.mark.parametrize("n_out,n_in", [(7, 256), (130, 1536), (1025, 512)])
def test_a_tokens_row_is_the_same_in_every_call(name, n_out, n_in):
    """Row t of a call of 2..17 tokens (the few-token tiles up to 3 tokens, prefill tiles past them) is the 1-token
    call of that token bit for bit: a speculative verify call's products are the decode steps'. Rows past a
    multiple of 4 (7, 130, 1025) take the one-row loop."""
    w, _ = weight(name, n_out, n_in)
    x = np.random.default_rng(n_out + n_in).standard_normal((17, n_in)).astype(np.float32)
    alone = np.concatenate([matmul(w, name, x[t:t + 1]) for t in range(17)])
    for n_tok in (2, 3, 4, 5, 8, 16, 17):
        got = matmul(w, name, x[:n_tok])
        bad = [t for t in range(n_tok) if not np.array_equal(got[t], alone[t])]
        diff = np.abs(got - alone[:n_tok]).max()
        assert not bad, f"{n_tok} tokens: rows {bad} differ from 1-token calls, max {diff:.3g}"


@pytest.mark.parametrize("name", SUPPORTED)
def test_get_rows(name):
    n_out, n_in = 37, 512
    w, wf = weight(name, n_out, n_in)
    ids = np.array([[3, 0, 36], [5, 5, 17]], dtype=np.int32)
    rows = get_rows(w, name, ids)
    assert rows.shape == (2, 3, n_in) and rows.dtype == np.float32
    np.testing.assert_allclose(rows, wf[ids], rtol=1e-6, atol=1e-6 * float(np.abs(wf).max()))
    out = np.empty((4, n_in), np.float32)
    assert get_rows(w, name, np.array([36, 1, 1, 0], np.int32), out=out) is out
    np.testing.assert_allclose(out, wf[[36, 1, 1, 0]], rtol=1e-6, atol=1e-6 * float(np.abs(wf).max()))


@pytest.mark.parametrize("name", SUPPORTED)
def test_prepare_get_rows_reads_ids_in_place_and_equals_get_rows(name):
    n_out, n_in = 37, 512
    w, _ = weight(name, n_out, n_in)
    ids = np.array([[3, 0, 36], [5, 5, 17]], dtype=np.int32)
    out = np.full((2, 3, n_in), np.nan, np.float32)
    run = prepare_get_rows(w, name, ids, out)
    for new_ids in ([[3, 0, 36], [5, 5, 17]], [[36, 1, 2], [0, 0, 9]]):
        ids[:] = new_ids
        run()
        np.testing.assert_array_equal(out.view(np.uint32), get_rows(w, name, ids).view(np.uint32))
    for bad in (-1, 37):
        ids[1, 2] = bad
        with pytest.raises(IndexError, match=f"get_rows: id {bad} out of range 0..36"):
            run()


def test_prepare_get_rows_layouts():
    w, wf = weight("q8_0", 37, 96)
    ids64 = np.array([4, 2], np.int64)
    out = np.zeros((2, 96), np.float32)
    prepare_get_rows(w, "q8_0", ids64, out)()
    np.testing.assert_array_equal(out, get_rows(w, "q8_0", ids64))
    every_other = np.array([4, 0, 2, 0], np.int32)[::2]  # strided, still one view of the ids
    prepare_get_rows(w, "q8_0", every_other, out)()
    np.testing.assert_array_equal(out, get_rows(w, "q8_0", ids64))
    columns = np.array([[4, 2, 0], [1, 3, 0]], np.int32)[:, :2]  # flattening would copy: not read in place
    assert prepare_get_rows(w, "q8_0", columns, np.zeros((2, 2, 96), np.float32)) is None
    with pytest.raises(GraphError, match="out must be"):
        prepare_get_rows(w, "q8_0", ids64, np.zeros((3, 96), np.float32))


def test_f16_special_values():
    vals = np.array(
        [0.0, -0.0, 1.0, -2.5, 65504.0, 6e-8, -6.1e-5, 3e-6, np.inf, -np.inf, np.nan, 0.1], dtype=np.float16
    )
    w = np.tile(vals, (2, 8))  # [2, 96]
    rows = get_rows(w, "f16", np.array([1], np.int32))[0]
    ref = w[1].astype(np.float32)
    assert np.array_equal(np.isnan(rows), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.array_equal(rows[ok], ref[ok])
    assert np.array_equal(np.signbit(rows[ok]), np.signbit(ref[ok]))
    # uint16 raw bits are accepted as f16 storage too
    rows16 = get_rows(w.view(np.uint16), "f16", np.array([1], np.int32))[0]
    assert np.array_equal(rows16[ok], ref[ok])


def test_leading_dims_out_and_layouts():
    w, wf = weight("q4_1", 511, 512)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 512)).astype(np.float32)
    out = np.full((2, 3, 511), np.nan, np.float32)
    assert matmul(w, "q4_1", x, out=out) is out
    check(out.reshape(6, 511), x.reshape(6, 512).astype(np.float64) @ wf.astype(np.float64).T)
    # 1-D x, non-contiguous x, float64 x, non-contiguous weight rows
    y1 = matmul(w, "q4_1", x[0, 0])
    assert y1.shape == (511,)
    check(y1[None], x[0, :1].astype(np.float64) @ wf.astype(np.float64).T)
    xt = np.asfortranarray(x[1])
    check(matmul(w, "q4_1", xt), xt.astype(np.float64) @ wf.astype(np.float64).T)
    check(matmul(w, "q4_1", x[1].astype(np.float64)), x[1].astype(np.float64) @ wf.astype(np.float64).T)
    check(matmul(w[::2], "q4_1", x[1]), x[1].astype(np.float64) @ wf[::2].astype(np.float64).T)
    # read-only weights (np.memmap mode "r", as GGUFReader gives them)
    wr = w.copy()
    wr.flags.writeable = False
    check(matmul(wr, "q4_1", x[1]), x[1].astype(np.float64) @ wf.astype(np.float64).T)


def test_prepare_matmul_reads_buffers_in_place():
    w, wf = weight("q4_1", 511, 512)
    x = np.zeros((3, 512), np.float32)
    run, out = prepare_matmul(w, "q4_1", x)
    assert out.shape == (3, 511)
    for seed in (1, 2):
        x[:] = np.random.default_rng(seed).standard_normal(x.shape)
        run()
        check(out, x.astype(np.float64) @ wf.astype(np.float64).T)
    with pytest.raises(GraphError, match="in place"):
        prepare_matmul(w, "q4_1", x.astype(np.float64))


def test_large_prefill_tile_path():
    # enough tokens and rows to use big L2 tiles, several tiles per thread, and odd remainders
    w, wf = weight("q8_0", 1025, 1536)
    x = np.random.default_rng(9).standard_normal((130, 1536)).astype(np.float32)
    check(matmul(w, "q8_0", x), x.astype(np.float64) @ wf.astype(np.float64).T)


def test_errors():
    w, _ = weight("q4_0", 7, 96)
    x = np.zeros((1, 96), np.float32)
    with pytest.raises(GraphError, match="unsupported"):
        matmul(w, "q3_k", x)
    with pytest.raises(GraphError, match="last axis"):
        matmul(w, "q4_0", np.zeros((1, 64), np.float32))
    with pytest.raises(GraphError, match="uint8"):
        matmul(w.astype(np.int16), "q4_0", x)
    with pytest.raises(GraphError, match="blocks"):
        matmul(w[:, :-1], "q4_0", x)
    with pytest.raises(GraphError, match="out must be"):
        matmul(w, "q4_0", x, out=np.zeros((1, 8), np.float32))
    with pytest.raises(GraphError, match="out of range"):
        get_rows(w, "q4_0", np.array([7], np.int32))
    with pytest.raises(GraphError, match="float32"):
        matmul(np.zeros((2, 96), np.float64), "f32", x)
