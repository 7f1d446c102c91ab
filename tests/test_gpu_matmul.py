"""mul_mat and get_rows on the gpu backend (backends/gpu/matmul.py, matmul.cu, get_rows.cu, quant.cuh).

Every weight format, at decode sizes (m <= 8 tokens: our GEMV, m == 1 its own kernel), just past
them (m = 9, 33: dequant + cuBLAS) and at awkward shapes (511 rows, 1025 rows, 7 rows of 3
super-blocks, 1025 columns of a float weight), against the reference backend and against a
float64 product of graphir.quant's dequantized weights with an error bound scaled by sum |x||w|.
get_rows is compared bit for bit. A "rule" runner calls the lowering rules directly on device
buffers (an x that is not 16-byte aligned; steps replayed), so the kernels are checked even where
the Program glue is not. The 2..16-token gemvm kernels also run on the host, without a GPU: matmul.cu
built by g++ with a shim of threads, barriers and warp shuffles (test_gemvm_sets_on_the_host).
"""

from __future__ import annotations

import math
import re

import _host_emulation as host_emulation
import numpy as np
import pytest
from graphir.backends.registry import get_backend

from graphir import g
from graphir.errors import BackendError
from graphir.ir import Graph
from graphir.lowering import ParamRef
from graphir.quant import dequantize, random_quantized
from graphir.weights import Weight, Weights

try:
    from graphir.backends.gpu.device import available
except ImportError:  # pragma: no cover - the package always has it; keep collection safe
    def available() -> bool:
        return False


def on_gpu(test):
    """The GPU suite: marked gpu, skipped where there is no CUDA/HIP device (the host emulation tests
    of the gemvm kernels below run anywhere)."""
    return pytest.mark.gpu(pytest.mark.skipif(not available(), reason="no CUDA/HIP device")(test))


FORMATS = ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs"]
K_QUANTS = ("q4_k", "q5_k", "q6_k", "iq4_xs")
FLOATS = ("f32", "f16", "bf16")
TOKENS = [1, 2, 3, 5, 8, 9, 16, 17, 33]  # float weights: gemvm2/4/8/16 up to 16; 17 and 33 take dequant + cuBLAS


def _shapes(fmt: str) -> list[tuple[int, int]]:
    if fmt in K_QUANTS:
        return [(511, 512), (7, 256 * 3)]
    if fmt in FLOATS:
        return [(511, 512), (1025, 64), (7, 1025)]  # 1025 columns: rows not whole 16-byte pieces
    return [(511, 512), (1025, 64)]


CASES = [(fmt, shape, m) for fmt in FORMATS for shape in _shapes(fmt) for m in TOKENS]


def _raw(rng: np.random.Generator, fmt: str, shape: tuple[int, ...]) -> np.ndarray:
    return random_quantized(rng, fmt, shape)  # floats: normal values in the storage type


def _weights(**items: tuple[str, np.ndarray, tuple[int, ...]]) -> Weights:
    return Weights({k: Weight(dt, tuple(shape), raw) for k, (dt, raw, shape) in items.items()})


def _run(backend: str, outputs, inputs: dict, weights: Weights | None = None) -> dict:
    return get_backend(backend).lower(Graph(outputs), weights)(inputs, {})


def _check_product(got: np.ndarray, x: np.ndarray, wf: np.ndarray, batch_w: bool = False) -> None:
    """got == x @ wf^T in f32 arithmetic: within 1e-5 of sum |x||w| per output (an f32 dot of a
    few thousand terms is within ~1e-6 of it), so a wrong value, scale or offset cannot pass."""
    xd, wd = x.astype(np.float64), wf.astype(np.float64)
    want = np.matmul(xd, np.swapaxes(wd, -1, -2))
    bound = np.matmul(np.abs(xd), np.swapaxes(np.abs(wd), -1, -2)) * 1e-5 + 1e-6
    assert got.shape == want.shape and got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"at {worst}: got {got[worst]}, want {want[worst]} (bound {bound[worst]:.3g})"


# ---------------------------------------------------------------- mul_mat through the backend
@pytest.mark.parametrize("fmt,shape,m", CASES, ids=[f"{f}-{s[0]}x{s[1]}-m{m}" for f, s, m in CASES])
@on_gpu
def test_mul_mat_formats(fmt, shape, m, rng):
    n_out, n_in = shape
    raw = _raw(rng, fmt, shape)
    wf = dequantize(raw, fmt, shape)
    assert np.isfinite(wf).all() and np.abs(wf).max() > 0
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    weights = _weights(w=(fmt, raw, shape))
    node = g.mul_mat(g.param("w", shape, fmt), g.input("x", x.shape))
    got = _run("gpu", {"y": node}, {"x": x}, weights)["y"]
    want_ref = _run("reference", {"y": node}, {"x": x}, weights)["y"]
    np.testing.assert_allclose(got, want_ref, rtol=1e-4, atol=1e-3)
    _check_product(got, x, wf)


@pytest.mark.parametrize("fmt,n_in", [("q8_0", 64), ("q4_0", 64), ("bf16", 64), ("f16", 64), ("q4_k", 256),
                                      ("q6_k", 256)])
@on_gpu
def test_mul_mat_vocab_sized(fmt, n_in, rng):
    shape = (151936, n_in)  # Qwen3's vocabulary: a grid far larger than the device
    raw = _raw(rng, fmt, shape)
    wf = dequantize(raw, fmt, shape)
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    got = _run("gpu", {"y": g.mul_mat(g.param("w", shape, fmt), g.input("x", x.shape))}, {"x": x},
               _weights(w=(fmt, raw, shape)))["y"]
    _check_product(got, x, wf)


@pytest.mark.parametrize("m", [1, 5, 12])
@on_gpu
def test_mul_mat_program_replays_with_new_inputs(m, rng):
    """One lowered Program, called with different x: every call reads the new tokens (nothing stale)."""
    shape = (300, 512)
    raw = _raw(rng, "q4_k", shape)
    wf = dequantize(raw, "q4_k", shape)
    prog = get_backend("gpu").lower(Graph({"y": g.mul_mat(g.param("w", shape, "q4_k"), g.input("x", (m, 512)))}),
                                    _weights(w=("q4_k", raw, shape)))
    for _ in range(3):
        x = rng.standard_normal((m, 512)).astype(np.float32)
        _check_product(prog({"x": x})["y"], x, wf)


@on_gpu
def test_mul_mat_tokens_with_batch_axes_take_the_gemv(rng):
    """x [2, 3, n_in] against a 2-D weight: 6 token rows, one GEMV (w's rows broadcast)."""
    shape = (65, 256)
    raw = _raw(rng, "q5_k", shape)
    x = rng.standard_normal((2, 3, 256)).astype(np.float32)
    got = _run("gpu", {"y": g.mul_mat(g.param("w", shape, "q5_k"), g.input("x", x.shape))}, {"x": x},
               _weights(w=("q5_k", raw, shape)))["y"]
    _check_product(got, x, dequantize(raw, "q5_k", shape))


@on_gpu
def test_prefill_scratch_is_one_buffer_per_weight_store(rng):
    """Two Programs over one store share the dequant scratch, sized for the largest matrix."""
    from graphir.backends.gpu.matmul import SCRATCH_KEY

    small, big = (33, 256), (700, 512)
    raws = {"a": _raw(rng, "q8_0", small), "b": _raw(rng, "q6_k", big)}
    weights = _weights(a=("q8_0", raws["a"], small), b=("q6_k", raws["b"], big))
    x1 = rng.standard_normal((20, 256)).astype(np.float32)
    x2 = rng.standard_normal((40, 512)).astype(np.float32)
    p1 = get_backend("gpu").lower(Graph({"y": g.mul_mat(g.param("a", small, "q8_0"), g.input("x", x1.shape))}),
                                  weights)
    p2 = get_backend("gpu").lower(Graph({"y": g.mul_mat(g.param("b", big, "q6_k"), g.input("x", x2.shape))}),
                                  weights)
    for i in range(2):  # alternate: each call dequantizes its own weight into the shared buffer
        _check_product(p1({"x": x1})["y"], x1, dequantize(raws["a"], "q8_0", small))
        _check_product(p2({"x": x2})["y"], x2, dequantize(raws["b"], "q6_k", big))
        if i == 0:  # Programs bind (and lower) on their first call
            first = weights.derived[SCRATCH_KEY]
            assert first.size >= math.prod(big)  # sized for the largest matrix at once, never regrown
    assert weights.derived[SCRATCH_KEY] is first
    assert sum(1 for k in weights.derived if "dequant_scratch" in k) == 1


# ---------------------------------------------------------------- batched and activation weights
@pytest.mark.parametrize("sw,sx", [((3, 1, 5, 16), (3, 4, 7, 16)), ((5, 16), (2, 7, 16)), ((1, 5, 16), (4, 1, 16)),
                                   ((2, 3, 1, 16), (2, 3, 1, 16)), ((7, 33), (9, 33)), ((2, 1, 4, 8), (2, 3, 4, 8))])
@on_gpu
def test_mul_mat_activation_weights(sw, sx, rng):
    w = rng.standard_normal(sw).astype(np.float32)
    x = rng.standard_normal(sx).astype(np.float32)
    got = _run("gpu", {"y": g.mul_mat(g.input("w", sw), g.input("x", sx))}, {"w": w, "x": x})["y"]
    _check_product(got, x, w)


@on_gpu
def test_mul_mat_param_with_batch_axes(rng):
    shape = (2, 5, 64)
    raw = _raw(rng, "q8_0", shape)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    got = _run("gpu", {"y": g.mul_mat(g.param("w", shape, "q8_0"), g.input("x", x.shape))}, {"x": x},
               _weights(w=("q8_0", raw, shape)))["y"]
    _check_product(got, x, dequantize(raw, "q8_0", shape))


@on_gpu
def test_mul_mat_too_many_batch_axes_is_a_clear_error(rng):
    sw, sx = (2, 1, 3, 1, 4, 6), (2, 5, 3, 7, 4, 6)
    node = g.mul_mat(g.input("w", sw), g.input("x", sx))
    w, x = rng.standard_normal(sw).astype(np.float32), rng.standard_normal(sx).astype(np.float32)
    with pytest.raises(BackendError, match="at most 2"):
        _run("gpu", {"y": node}, {"w": w, "x": x})


# ---------------------------------------------------------------- the rules on raw device buffers
def _param(fmt: str, raw: np.ndarray, shape: tuple[int, ...], name: str = "w"):
    from graphir.backends.gpu.launch import GpuParam

    weights = _weights(**{name: (fmt, raw, shape)})
    return GpuParam(ParamRef(None, weights, raw, fmt, shape, ("param", name))), weights


@pytest.mark.parametrize("fmt", ["q4_0", "q6_k", "bf16"])
@pytest.mark.parametrize("m", [1, 4])
@on_gpu
def test_gemv_rule_unaligned_x_and_replay(fmt, m, rng):
    """x at a 4-byte offset (the GEMV reads x in 16-byte pieces: the rule stages it), steps replayed."""
    import cupy as cp
    from graphir.backends.gpu.launch import Lowering
    from graphir.backends.gpu.matmul import lower_mul_mat

    shape = (77, 512)
    raw = _raw(rng, fmt, shape)
    gp, weights = _param(fmt, raw, shape)
    lw = Lowering(weights)
    base = cp.zeros(m * 512 + 1, np.float32)
    x_dev = base[1:].reshape(m, 512)
    assert x_dev.data.ptr % 16
    y_dev = cp.zeros((m, 77), np.float32)
    steps = lower_mul_mat(lw, None, [gp, x_dev], [y_dev], {})
    for _ in range(2):
        x = rng.standard_normal((m, 512)).astype(np.float32)
        x_dev[...] = cp.asarray(x)
        for s in steps:
            s()
        _check_product(y_dev.get(), x, dequantize(raw, fmt, shape))


def _variant_cases() -> list[tuple[str, str, tuple[int, int]]]:
    from graphir.backends.gpu.matmul import GEMV1_CONFIGS, GEMV1_V3, V3_FORMATS

    cases = []
    for fmt in FORMATS:
        qk = 256 if fmt in K_QUANTS else (8 if fmt in FLOATS else 32)
        if fmt == "q6_k":  # 210-byte blocks: rows of whole 16-byte pieces only from 8 blocks on
            n_ins = [256, 2048, 256 * 24]
        elif fmt in K_QUANTS:
            n_ins = [256, 512, 256 * 17]
        else:
            n_ins = [qk * 8, qk * 16, qk * 8 * 13]  # rows of whole 16-byte pieces (the wide loads)
        for cfg in ["gemv1", *GEMV1_CONFIGS, *(GEMV1_V3 if fmt in V3_FORMATS else ())]:
            for shape in [(1, n_ins[0]), (7, n_ins[1]), (511, n_ins[2])]:
                cases.append((fmt, cfg, shape))
    return cases


@pytest.mark.parametrize("fmt,cfg,shape", _variant_cases(), ids=[f"{f}-{c}-{s[0]}x{s[1]}" for f, c, s in
                                                                  _variant_cases()])
@on_gpu
def test_gemv1_variants(fmt, cfg, shape, rng, monkeypatch):
    """Every m == 1 kernel variant (matmul.py GEMV1_CONFIGS and GEMV1_V3; the benchmark picks the
    default), at 1, 7 and 511 rows, against the f64 product of the dequantized weight. The v3
    kernels stage 32 blocks (q8_0, q4_0) or 8 super-blocks (q4_k) per chunk: the sizes below give
    one partial chunk, whole chunks, and whole chunks plus a partial one."""
    import cupy as cp
    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.launch import Lowering

    monkeypatch.setitem(mm.GEMV1_KERNEL, fmt, cfg)
    n_out, n_in = shape
    raw = _raw(rng, fmt, shape)
    gp, weights = _param(fmt, raw, shape)
    lw = Lowering(weights)
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    y_dev = cp.full((1, n_out), np.nan, np.float32)
    steps = mm.lower_mul_mat(lw, None, [gp, cp.asarray(x)], [y_dev], {})
    want_name = ("gemv1_" + fmt if cfg == "gemv1" else
                 f"gemv1v3_{fmt}_{cfg[2:]}" if cfg in mm.GEMV1_V3 else f"gemv1v2_{fmt}_{cfg}")
    assert steps[-1].name == want_name
    for s in steps:
        s()
    _check_product(y_dev.get(), x, dequantize(raw, fmt, shape))


# (fmt, shape): every quantized decode kernel (tc for q4_0 where tensor cores are, gemv1v3 for q8_0 and q4_k,
# gemv1v2 for the rest; 16-byte aligned rows) and the gemv1_ fallback (q4_0 rows of 36 bytes)
VERIFY_QUANT = [("q4_0", (511, 512)), ("q4_0", (33, 64)), ("q8_0", (1025, 256)), ("q4_k", (7, 768)),
                ("q4_1", (70, 384)), ("q5_0", (9, 512)), ("q5_k", (33, 512)), ("q6_k", (17, 256)),
                ("iq4_xs", (5, 512))]


@pytest.mark.parametrize("fmt,shape", VERIFY_QUANT, ids=[f"{f}-{s[0]}x{s[1]}" for f, s in VERIFY_QUANT])
@on_gpu
def test_verify_gemv_rows_of_quantized_weights_are_the_decode_gemv(fmt, shape, rng):
    """A 2..16-token product of a quantized weight (GEMVM_KERNEL "exact") runs the decode step's kernel a token a
    block: each row is the 1-token product bit for bit, plain and fused with swiglu, at every verify bucket."""
    import cupy as cp
    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.launch import Lowering

    n_out, n_in = shape
    raw = _raw(rng, fmt, (2 * n_out, n_in))
    gp, weights = _param(fmt, raw, (2 * n_out, n_in))
    lw = Lowering(weights)
    x = cp.asarray(rng.standard_normal((16, n_in)).astype(np.float32))

    def run(lower, rows: slice, width: int) -> np.ndarray:
        y = cp.full((rows.stop - rows.start, width), np.nan, np.float32)
        for step in lower(lw, None, [gp, x[rows]], [y], {}):
            step()
        return y.get()

    one = np.concatenate([run(mm.lower_mul_mat, slice(t, t + 1), 2 * n_out) for t in range(16)])
    one_sw = np.concatenate([run(mm.lower_mul_mat_swiglu, slice(t, t + 1), n_out) for t in range(16)])
    for m in (2, 3, 8, 16):
        np.testing.assert_array_equal(run(mm.lower_mul_mat, slice(0, m), 2 * n_out), one[:m], err_msg=f"{m} tokens")
        np.testing.assert_array_equal(run(mm.lower_mul_mat_swiglu, slice(0, m), n_out), one_sw[:m],
                                      err_msg=f"{m} tokens, fused")
    _check_product(one, x.get(), dequantize(raw, fmt, (2 * n_out, n_in)))


# rows: one, fewer than any block's, partial last blocks of every geometry (511, 1025, 33); row units: 1, 125,
# 17, 73 and 256 (none a multiple of every geometry's lanes a row; 256 takes j4w8r2 four batches a lane)
GEMVM_SHAPES = [(1, 8), (7, 1000), (511, 136), (1025, 584), (33, 2048)]


def _gemvm_cases() -> list[tuple[str, str, int, tuple[int, int]]]:
    from graphir.backends.gpu.matmul import GEMVM_CONFIGS

    return [(fmt, cfg, m, shape) for fmt in FLOATS for cfg in GEMVM_CONFIGS for m in (2, 3, 8, 11, 16)
            for shape in GEMVM_SHAPES]


@pytest.mark.parametrize("fmt,cfg,m,shape", _gemvm_cases(), ids=[f"{f}-{c}-m{m}-{s[0]}x{s[1]}" for f, c, m, s in
                                                                 _gemvm_cases()])
@on_gpu
def test_gemvm_variants(fmt, cfg, m, shape, rng, monkeypatch):
    """Every 2..16-token float GEMV geometry (matmul.py GEMVM_CONFIGS; profile_gpu_decode.py --verify picks
    the default) at GEMVM_SHAPES, against the f64 product; m = 3 runs the 4-token kernel with a token unused,
    m = 11 the 16-token one with five."""
    import cupy as cp
    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.launch import Lowering

    monkeypatch.setattr(mm, "GEMVM_KERNEL", cfg)
    n_out, n_in = shape
    raw = _raw(rng, fmt, shape)
    gp, weights = _param(fmt, raw, shape)
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    y_dev = cp.full((m, n_out), np.nan, np.float32)
    steps = mm.lower_mul_mat(Lowering(weights), None, [gp, cp.asarray(x)], [y_dev], {})
    assert steps[-1].name == f"gemvm{mm.gemvm_block_tokens(m)}_{fmt}_{cfg}"
    for s in steps:
        s()
    _check_product(y_dev.get(), x, dequantize(raw, fmt, shape))


# ---------------------------------------------------------------- get_rows
def _get_rows_cases() -> list[tuple[str, int, int]]:
    cases = []
    for fmt in FORMATS:
        if fmt in K_QUANTS:
            cases += [(fmt, 37, 256), (fmt, 5, 768)]
        elif fmt in FLOATS:
            cases += [(fmt, 37, 7), (fmt, 9, 1), (fmt, 5, 1025)]
        else:
            cases += [(fmt, 37, 64), (fmt, 513, 96)]
    return cases


@pytest.mark.parametrize("fmt,rows,dim", _get_rows_cases())
@on_gpu
def test_get_rows_formats(fmt, rows, dim, rng):
    raw = _raw(rng, fmt, (rows, dim))
    table = dequantize(raw, fmt, (rows, dim))
    ids = np.array([0, rows - 1, 3 % rows, 3 % rows, 1 % rows, rows // 2], np.int32)
    node = g.get_rows(g.param("emb", (rows, dim), fmt), g.input("ids", ids.shape, "i32"))
    got = _run("gpu", {"y": node}, {"ids": ids}, _weights(emb=(fmt, raw, (rows, dim))))["y"]
    assert got.dtype == np.float32 and got.shape == (len(ids), dim)
    np.testing.assert_array_equal(got, table[ids])  # decoding is exact: bit for bit


@on_gpu
def test_get_rows_activation_table(rng):
    t = rng.standard_normal((9, 5)).astype(np.float32)
    ids = np.array([8, 0, 4], np.int32)
    got = _run("gpu", {"y": g.get_rows(g.input("t", t.shape), g.input("ids", (3,), "i32"))}, {"t": t, "ids": ids})["y"]
    np.testing.assert_array_equal(got, t[ids])


@pytest.mark.parametrize("fmt", ["q4_k", "f32"])
@pytest.mark.parametrize("bad", [-1, 37, 1 << 30])
@on_gpu
def test_get_rows_bad_id_is_an_error(fmt, bad, rng):
    dim = 256
    raw = _raw(rng, fmt, (37, dim))
    node = g.get_rows(g.param("emb", (37, dim), fmt), g.input("ids", (3,), "i32"))
    prog = get_backend("gpu").lower(Graph({"y": node}), _weights(emb=(fmt, raw, (37, dim))))
    with pytest.raises(BackendError, match=rf"get_rows: id {bad} out of range 0\.\.36"):
        prog({"ids": np.array([0, bad, 2], np.int32)})
    good = np.array([36, 0, 2], np.int32)  # the same Program still works afterwards
    np.testing.assert_array_equal(prog({"ids": good})["y"], dequantize(raw, fmt, (37, dim))[good])


@on_gpu
def test_mul_mat_bf16_projections_of_one_x_share_its_rounding():
    """q, k, v-style mul_mat_bf16s of one x round x once (the first one's cast, shared); a second x
    computed later (its own node) gets its own cast. Each result equals the op's reference."""
    from graphir.ops.fused import bf16_round

    rng = np.random.default_rng(11)
    m, n_in = 37, 96
    outs_n = {"a": 40, "b": 24, "c": 24}
    ws = {k: rng.standard_normal((n, n_in)).astype(np.float32) for k, n in outs_n.items()}
    weights = Weights({k: Weight("bf16", w.shape, (bf16_round(w).view(np.uint32) >> np.uint32(16)).astype(np.uint16))
                       for k, w in ws.items()})
    x = g.input("x", (m, n_in))
    ys = {k: g.mul_mat_bf16(g.param(k, (n, n_in), "bf16"), x) for k, n in outs_n.items()}
    x2 = g.scale(x, s=1.5)  # another node: must not reuse x's rounded copy
    ys["d"] = g.mul_mat_bf16(g.param("a", (40, n_in), "bf16"), x2)
    program = get_backend("gpu").lower(Graph(ys), weights)
    xv = rng.standard_normal((m, n_in)).astype(np.float32)
    got = program({"x": xv})
    xs = {"a": xv, "b": xv, "c": xv, "d": xv * np.float32(1.5)}
    for k, y in got.items():
        w = bf16_round(ws["a" if k == "d" else k]).astype(np.float64)
        want = bf16_round(xs[k]).astype(np.float64) @ w.T
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4 * np.abs(want).max(), err_msg=k)


# ---------------------------------------------------------------- mul_mat_swiglu (the gate|up GEMV's activation)
def _check_swiglu(got: np.ndarray, x: np.ndarray, wf: np.ndarray) -> None:
    """got == silu(x @ gate^T) * (x @ up^T), gate and up the halves of wf's rows: each product within
    1e-5 of its sum |x||w| (as _check_product), carried through silu(g) * u by its derivatives."""
    half = wf.shape[0] // 2
    xd, wd = x.astype(np.float64), wf.astype(np.float64)
    gate, up = xd @ wd[:half].T, xd @ wd[half:].T
    bg, bu = (np.abs(xd) @ np.abs(wd[:half]).T) * 1e-5 + 1e-6, (np.abs(xd) @ np.abs(wd[half:]).T) * 1e-5 + 1e-6
    sig = 1 / (1 + np.exp(-gate))
    want = gate * sig * up
    bound = np.abs(sig * (1 + gate * (1 - sig)) * up) * bg + np.abs(gate * sig) * bu + 1e-6
    assert got.shape == want.shape and got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"at {worst}: got {got[worst]}, want {want[worst]} (bound {bound[worst]:.3g})"


def _swiglu_cases() -> list[tuple[str, str, tuple[int, int]]]:
    from graphir.backends.gpu.matmul import GEMV1_SW

    cases = []
    for fmt in FORMATS:
        n_in = 512 if fmt in K_QUANTS and fmt != "q6_k" else 2048 if fmt == "q6_k" else 256
        for cfg in GEMV1_SW:
            for half in (1, 7, 511):  # one output; fewer than a block's outputs; a partial last block
                cases.append((fmt, cfg, (half, n_in)))
    return cases


@pytest.mark.parametrize("fmt,cfg,shape", _swiglu_cases(), ids=[f"{f}-{c}-{s[0]}x{s[1]}" for f, c, s in
                                                                 _swiglu_cases()])
@on_gpu
def test_mul_mat_swiglu_decode_kernel(fmt, cfg, shape, rng, monkeypatch):
    """The m == 1 fused kernel (gemv1sw_<fmt>_<cfg>) for every format and geometry, at 1, 7 and 511
    outputs: equal bit for bit to the unfused gpu path (the gemv1v2 kernel of the same geometry, then
    swiglu_split_f32 on its halves), and to the f64 formula within the products' error bound."""
    import cupy as cp
    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.launch import Lowering
    from graphir.backends.gpu.lowering import RULES

    monkeypatch.setitem(mm.GEMV1_KERNEL, fmt, cfg)
    half, n_in = shape
    wshape = (2 * half, n_in)
    raw = _raw(rng, fmt, wshape)
    gp, weights = _param(fmt, raw, wshape)
    lw = Lowering(weights)
    x = cp.asarray(rng.standard_normal((1, n_in)).astype(np.float32))
    fused = cp.full((1, half), np.nan, np.float32)
    steps = mm.lower_mul_mat_swiglu(lw, None, [gp, x], [fused], {})
    assert [s.name for s in steps] == [f"gemv1sw_{fmt}_{cfg}"]
    both, unfused = cp.full((1, 2 * half), np.nan, np.float32), cp.full((1, half), np.nan, np.float32)
    steps += mm.lower_mul_mat(lw, None, [gp, x], [both], {})
    steps += RULES["swiglu_split"](lw, None, [both[:, :half], both[:, half:]], [unfused], {})
    for s in steps:
        s()
    np.testing.assert_array_equal(fused.get(), unfused.get())
    _check_swiglu(fused.get(), x.get(), dequantize(raw, fmt, wshape))


def _swiglu_verify_cases() -> list[tuple[str, str, int, tuple[int, int]]]:
    return [(fmt, cfg, m, shape) for fmt, cfg, m, shape in _gemvm_cases() if fmt != "f16" or m == 11]


@pytest.mark.parametrize("fmt,cfg,m,shape", _swiglu_verify_cases(),
                         ids=[f"{f}-{c}-m{m}-{s[0]}x{s[1]}" for f, c, m, s in _swiglu_verify_cases()])
@on_gpu
def test_mul_mat_swiglu_verify_kernel(fmt, cfg, m, shape, rng, monkeypatch):
    """The 2..16-token fused kernel (gemvmsw<M>_<fmt>_<cfg>) for every float geometry at GEMVM_SHAPES' row
    counts of outputs: equal bit for bit to the unfused gpu path (the op lowered above SW_MAX_BYTES: gemvm of the same
    geometry, then swiglu_halves_f32), and to the f64 formula within the products' error bound."""
    import cupy as cp
    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.launch import Lowering

    monkeypatch.setattr(mm, "GEMVM_KERNEL", cfg)
    half, n_in = shape
    wshape = (2 * half, n_in)
    raw = _raw(rng, fmt, wshape)
    gp, weights = _param(fmt, raw, wshape)
    lw = Lowering(weights)
    x = cp.asarray(rng.standard_normal((m, n_in)).astype(np.float32))
    fused = cp.full((m, half), np.nan, np.float32)
    steps = mm.lower_mul_mat_swiglu(lw, None, [gp, x], [fused], {})
    bucket = mm.gemvm_block_tokens(m)  # tokens a block
    assert [s.name for s in steps] == [f"gemvmsw{bucket}_{fmt}_{cfg}"]
    unfused = cp.full((m, half), np.nan, np.float32)
    monkeypatch.setattr(mm, "SW_MAX_BYTES", 0)
    plain = mm.lower_mul_mat_swiglu(lw, None, [gp, x], [unfused], {})
    assert [s.name for s in plain] == [f"gemvm{bucket}_{fmt}_{cfg}", "swiglu_halves_f32"]
    for s in steps + plain:
        s()
    np.testing.assert_array_equal(fused.get(), unfused.get())
    _check_swiglu(fused.get(), x.get(), dequantize(raw, fmt, wshape))


@pytest.mark.parametrize("fmt", FLOATS)
@pytest.mark.parametrize("m", [2, 3, 8, 11, 16])
@on_gpu
def test_gemvm_j32w4r4_is_bitwise_g128r2(fmt, m, rng, monkeypatch):
    """j32w4r4 (gemvm_sets_impl: 4 rows a lane, reduce-scatter) splits a row as g128r2 does and adds in
    its order: the plain and the fused kernels give g128r2's values bit for bit at every GEMVM_SHAPES size."""
    import cupy as cp
    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.launch import Lowering

    for n_out, n_in in GEMVM_SHAPES:
        wshape = (2 * n_out, n_in)
        raw = _raw(rng, fmt, wshape)
        gp, weights = _param(fmt, raw, wshape)
        x = cp.asarray(rng.standard_normal((m, n_in)).astype(np.float32))
        got = {}
        for cfg in ("g128r2", "j32w4r4"):
            monkeypatch.setattr(mm, "GEMVM_KERNEL", cfg)
            lw = Lowering(weights)
            plain, fused = cp.full((m, 2 * n_out), np.nan, np.float32), cp.full((m, n_out), np.nan, np.float32)
            steps = mm.lower_mul_mat(lw, None, [gp, x], [plain], {})
            steps += mm.lower_mul_mat_swiglu(lw, None, [gp, x], [fused], {})
            assert [s.name for s in steps][-1].endswith(cfg)
            for s in steps:
                s()
            got[cfg] = plain.get(), fused.get()
        np.testing.assert_array_equal(got["j32w4r4"][0], got["g128r2"][0])
        np.testing.assert_array_equal(got["j32w4r4"][1], got["g128r2"][1])


# ---------------------------------------------------------------- gemvm geometry tables (no GPU)
def test_gemvm_configs_mirror_the_kernel_source():
    """matmul.py GEMVM_CONFIGS (threads, rows a block) against matmul.cu's instantiated geometries."""
    from graphir.backends.gpu import kernels
    from graphir.backends.gpu import matmul as mm

    src = (kernels.KERNEL_DIR / "matmul.cu").read_text()
    old = re.findall(r"DEFINE_GEMVM_CFG\(name, F, (g\d+r\d+), (\d+), (\d+)\)", src)
    sets = re.findall(r"X\(name, F, (j\d+w\d+r\d+), (\d+), (\d+), (\d+), \w+\)", src)
    want = {cfg: (128, 128 // int(g) * int(nr)) for cfg, g, nr in old}
    want |= {cfg: (32 * int(wb), 32 // int(j) * int(nr)) for cfg, j, wb, nr in sets}
    assert mm.GEMVM_CONFIGS == want
    assert all(cfg == f"j{j}w{wb}r{nr}" for cfg, j, wb, nr in sets)


def test_gemvm_kernel_choice(monkeypatch):
    """GEMVM_KERNEL "exact" (the default) pairs each call with the decode geometry; a name takes one geometry for
    every 2..16-token call; "auto" takes GEMVM_AUTO's first geometry with enough blocks."""
    from graphir.backends.gpu import matmul as mm

    # by default two token groups a row block from 4 tokens on (GEMVM_TOKENS_A_BLOCK)
    assert [mm.gemv_kernel("bf16", 4096, 1024, m, 0)[0] for m in (2, 3, 8, 16)] == [
        "gemvm2_bf16_j32w2r4", "gemvm2_bf16_j32w2r4", "gemvm4_bf16_j32w2r4", "gemvm8_bf16_j32w2r4"]
    assert [mm.token_blocks(f"gemvm{b}_bf16_j32w2r4", m) for b, m in ((2, 2), (2, 3), (4, 8), (8, 16), (8, 9))] == [
        1, 2, 2, 2, 2]
    monkeypatch.setattr(mm, "GEMVM_TOKENS_A_BLOCK", {2: 2, 4: 4, 8: 8, 16: 16})
    assert mm.gemv_kernel("bf16", 4096, 1024, 16, 0) == ("gemvm16_bf16_j32w2r4", 64, 4)  # decode: g64r2
    assert mm.gemv_kernel("bf16", 1024, 1024, 2, 0) == ("gemvm2_bf16_j32w4r4", 128, 4)  # decode: g128r1
    monkeypatch.setattr(mm, "GEMVM_KERNEL", "j32w4r4")
    assert mm.gemv_kernel("f32", 7, 1000, 3, 0) == ("gemvm4_f32_j32w4r4", 128, 4)
    monkeypatch.setattr(mm, "GEMVM_KERNEL", "auto")
    monkeypatch.setattr(mm, "GEMVM_AUTO", (("j4w8r4", 1024), ("j4w8r2", 256), ("j8w8r2", 0)))
    assert mm.gemv_kernel("bf16", 32 * 1024, 1024, 16, 0) == ("gemvm16_bf16_j4w8r4", 256, 32)
    assert mm.gemv_kernel("bf16", 32 * 1024 - 32, 1024, 16, 0) == ("gemvm16_bf16_j4w8r2", 256, 16)
    assert mm.gemv_kernel("bf16", 16 * 256, 1024, 16, 0) == ("gemvm16_bf16_j4w8r2", 256, 16)
    assert mm.gemv_kernel("bf16", 16 * 256 - 16, 1024, 9, 0) == ("gemvm16_bf16_j8w8r2", 256, 8)
    assert mm.gemv_kernel("f32", 1, 576, 5, 0)[0] == "gemvm8_f32_j8w8r2"
    assert mm.gemv_kernel("bf16", 4096, 1020, 16, 0)[0] == "gemv16_bf16"  # rows not of whole 8-value units


# ---------------------------------------------------------------- gemvm on the host (no GPU)
# matmul.cu built for the host (tests/_host_emulation.py, as tests/test_gpu_delta_chunked.py runs its kernels):
# the gemvm kernels' index arithmetic, reduce-scatter and shared-memory layout checked anywhere, and their bitwise
# claims between kernels run through the same build.
GEMVM_LAUNCHER = r"""
typedef void (*emu_gemv_t)(const u8*, long long, const float*, float*, int, int, int);
extern "C" void emu_gemv(emu_gemv_t kernel, unsigned grid, unsigned threads, const u8* W, long long row_bytes,
                         const float* X, float* Y, int n_out, int n_in, int m) {
    emu_launch(grid, 1, threads, [=] { kernel(W, row_bytes, X, Y, n_out, n_in, m); });
}
"""
EMU_GUARD = 64  # guard elements either side of every host buffer
EMU_SENTINEL = np.float32(-7.25)  # the output's guards: a kernel writing outside the output changes one


@pytest.fixture(scope="module")
def gemvm_host(tmp_path_factory):
    """The host build of matmul.cu: (shared library, run(kernel, cfg, fmt, raw, x, n_out, fused) -> y)."""
    import ctypes

    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.matmul import GEMV1_CONFIGS, GEMV1_SW, GEMV_ROWS_PER_BLOCK, GEMV_THREADS, GEMVM_CONFIGS

    lib = host_emulation.build(tmp_path_factory.mktemp("gemvm_emu"), "matmul.cu", GEMVM_LAUNCHER,
                               ("-ffp-contract=off",))

    def run(kernel: str, raw: np.ndarray, x: np.ndarray, n_out: int, fused: bool = False) -> np.ndarray:
        cfg = kernel.rsplit("_", 1)[1]
        if kernel.startswith(("gemv_", "gemv16_", "gemv1_")):  # gemv_impl: 4 groups of 32 lanes, 2 rows each
            threads, rows = GEMV_THREADS, GEMV_ROWS_PER_BLOCK
        elif kernel.startswith("gemv1"):  # the decode step's gemv1v2_ / gemv1sw_ (fused: outputs a block)
            threads, rows = (GEMV1_SW if fused else GEMV1_CONFIGS)[cfg]
        else:
            threads, rows = GEMVM_CONFIGS[cfg]
            rows = rows // 2 if fused else rows
        m, n_in = x.shape
        wb = raw.view(np.uint8).reshape(raw.shape[0], -1)
        w_buf = np.full(wb.size + 2 * EMU_GUARD, 0xFF, np.uint8)  # NaN in every float format
        w_buf[EMU_GUARD:EMU_GUARD + wb.size] = wb.ravel()
        x_buf = np.full(x.size + 2 * EMU_GUARD, np.nan, np.float32)
        x_buf[EMU_GUARD:EMU_GUARD + x.size] = x.ravel()
        y_buf = np.full(m * n_out + 2 * EMU_GUARD, EMU_SENTINEL, np.float32)
        y_buf[EMU_GUARD:EMU_GUARD + m * n_out] = np.nan
        ptr = lambda a: ctypes.c_void_p(a.ctypes.data + EMU_GUARD * a.itemsize)
        grid = -(-n_out // rows) * mm.token_blocks(kernel, m)
        lib.emu_gemv(ctypes.cast(getattr(lib, kernel), ctypes.c_void_p), ctypes.c_uint(grid),
                     ctypes.c_uint(threads), ptr(w_buf), ctypes.c_longlong(wb.shape[1]), ptr(x_buf), ptr(y_buf),
                     ctypes.c_int(n_out), ctypes.c_int(n_in), ctypes.c_int(m))
        assert (y_buf[:EMU_GUARD] == EMU_SENTINEL).all() and (y_buf[-EMU_GUARD:] == EMU_SENTINEL).all(), \
            f"{kernel} wrote outside its output"
        return y_buf[EMU_GUARD:EMU_GUARD + m * n_out].reshape(m, n_out).copy()

    return run


# (fmt, m, (rows, n_in)): rows 1 and 7 (one partial block), 33 (the plain kernels' 66 rows: partial last blocks
# of every geometry); rows of 1, 17, 125 and 256 units (j4w8r2: 256 units are four 2-unit batches a lane)
EMU_CASES = ([("bf16", m, shape) for m in (2, 3, 8, 16) for shape in [(1, 8), (7, 136)]]
             + [("bf16", m, (33, 1000)) for m in (3, 16)] + [("bf16", 16, (5, 2048)), ("bf16", 11, (17, 2048))]
             + [("f32", 3, (7, 136)), ("f32", 16, (7, 136)), ("f32", 16, (33, 1000))]
             + [("f16", 8, (7, 136)), ("f16", 16, (7, 1000))])


@pytest.mark.parametrize("fmt,m,shape", EMU_CASES, ids=[f"{f}-m{m}-{s[0]}x{s[1]}" for f, m, s in EMU_CASES])
def test_gemvm_sets_on_the_host(fmt, m, shape, gemvm_host):
    """Every gemvm_sets_impl geometry (j* of GEMVM_CONFIGS), plain and fused, run on the host: the plain
    products within the f64 bound, the fused ones within silu's; j32w4r4 bit for bit g128r2 (both kernels)."""
    from graphir.backends.gpu.matmul import GEMVM_CONFIGS

    rng = np.random.default_rng(sum(shape) + m)
    n_out, n_in = shape
    wshape = (2 * n_out, n_in)
    raw = _raw(rng, fmt, wshape)
    wf = dequantize(raw, fmt, wshape)
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    bucket = 1 << (m - 1).bit_length()
    for cfg in [c for c in GEMVM_CONFIGS if c.startswith("j")]:
        plain = gemvm_host(f"gemvm{bucket}_{fmt}_{cfg}", raw, x, 2 * n_out)
        _check_product(plain, x, wf)
        fused = gemvm_host(f"gemvmsw{bucket}_{fmt}_{cfg}", raw, x, n_out, fused=True)
        _check_swiglu(fused, x, wf)
        if cfg == "j32w4r4":
            np.testing.assert_array_equal(plain, gemvm_host(f"gemvm{bucket}_{fmt}_g128r2", raw, x, 2 * n_out))
            np.testing.assert_array_equal(fused, gemvm_host(f"gemvmsw{bucket}_{fmt}_g128r2", raw, x, n_out, True))


# (fmt, decode geometry, m, (rows, n_in)): every float geometry a decode GEMV takes (g128r1; g64r2 and g32r2 for
# many short rows, matmul.short_float_rows), partial blocks, 1 to 129 units a row
EXACT_CASES = [("bf16", "g128r1", 3, (7, 1000)), ("f32", "g128r1", 16, (33, 1032)), ("f16", "g128r1", 9, (5, 1160)),
               ("f32", "g64r2", 5, (9, 576)), ("bf16", "g64r2", 16, (3, 1024)), ("f32", "g32r2", 2, (13, 64)),
               ("bf16", "g32r2", 11, (6, 8))]


@pytest.mark.parametrize("fmt,cfg,m,shape", EXACT_CASES,
                         ids=[f"{f}-{c}-m{m}-{s[0]}x{s[1]}" for f, c, m, s in EXACT_CASES])
def test_verify_gemv_rows_are_the_decode_gemv_on_the_host(fmt, cfg, m, shape, gemvm_host):
    """The 2..16-token GEMV that GEMVM_KERNEL "exact" pairs with a decode geometry gives each token's row bit for
    bit what the decode step's GEMV gives for that token alone, plain and fused with swiglu: a verify call's
    rows are decode steps (tests/test_speculative.py runs whole models on the GPU)."""
    rng = np.random.default_rng(shape[0] + m)
    n_out, n_in = shape
    raw = _raw(rng, fmt, (2 * n_out, n_in))  # gate rows, then up rows, for the fused kernels
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    pair = f"j32w{int(cfg[1:].split('r')[0]) // 32}r4"
    bucket = 1 << (m - 1).bit_length()
    rows = gemvm_host(f"gemvm{bucket}_{fmt}_{pair}", raw[:n_out], x, n_out)
    fused = gemvm_host(f"gemvmsw{bucket}_{fmt}_{pair}", raw, x, n_out, fused=True)
    for t in range(m):
        one = gemvm_host(f"gemv1v2_{fmt}_{cfg}", raw[:n_out], x[t:t + 1], n_out)[0]
        np.testing.assert_array_equal(rows[t], one, err_msg=f"row {t}")
        one = gemvm_host(f"gemv1sw_{fmt}_{cfg}", raw, x[t:t + 1], n_out, fused=True)[0]
        np.testing.assert_array_equal(fused[t], one, err_msg=f"fused row {t}")


# (fmt, geometry, m, tokens a block, (rows, n_in)): groups that divide m and groups that do not
TOKEN_GROUP_CASES = [("f32", "j32w4r4", 16, 4, (33, 576)), ("bf16", "j32w2r4", 11, 4, (7, 1000)),
                     ("f32", "j32w1r4", 16, 2, (5, 136)), ("bf16", "j4w8r2", 9, 8, (17, 2048)),
                     ("f16", "g128r2", 7, 2, (9, 1000)), ("f32", "j8w8r2", 3, 2, (1, 8))]


@pytest.mark.parametrize("fmt,cfg,m,sub,shape", TOKEN_GROUP_CASES)
def test_gemvm_token_groups_on_the_host(fmt, cfg, m, sub, shape, gemvm_host):
    """gemvm<sub> on cdiv(m, sub) times its blocks (GEMVM_TOKEN_GROUP; m not always a multiple of sub) gives an
    m-token call's rows bit for bit as gemvm<bucket> computing all m tokens in one block, plain and fused."""
    rng = np.random.default_rng(shape[0] + m)
    n_out, n_in = shape
    raw = _raw(rng, fmt, (2 * n_out, n_in))
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    bucket = 1 << (m - 1).bit_length()
    for kind, rows, fused in (("gemvm", 2 * n_out, False), ("gemvmsw", n_out, True)):
        whole = gemvm_host(f"{kind}{bucket}_{fmt}_{cfg}", raw, x, rows, fused)
        grouped = gemvm_host(f"{kind}{sub}_{fmt}_{cfg}", raw, x, rows, fused)
        np.testing.assert_array_equal(grouped, whole, err_msg=f"{kind}{sub} in groups vs {kind}{bucket}")


@pytest.mark.parametrize("fmt,m,shape", [("bf16", 3, (7, 1000)), ("f32", 16, (33, 1030)), ("q4_0", 9, (9, 64)),
                                         ("q8_0", 2, (5, 96))])
def test_verify_gemv_rows_are_gemv1_rows_on_the_host(fmt, m, shape, gemvm_host, monkeypatch):
    """Where the decode step takes gemv1_<fmt> (rows not of whole 16-byte pieces, or GEMV1_KERNEL set to "gemv1"),
    an m-token call takes gemv_<fmt> / gemv16_<fmt>: the same lanes and order, each row bit for bit gemv1_'s."""
    from graphir.backends.gpu import matmul as mm

    monkeypatch.setattr(mm, "GEMV1_KERNEL", dict(mm.GEMV1_KERNEL, **{fmt: "gemv1"}))
    rng = np.random.default_rng(shape[0] + m)
    n_out, n_in = shape
    raw = _raw(rng, fmt, shape)
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    many = mm.gemv_kernel(fmt, n_out, n_in, m, 0)[0]
    assert many == (f"gemv_{fmt}" if m <= mm.GEMV_SMALL_TOKENS else f"gemv16_{fmt}")
    rows = gemvm_host(many, raw, x, n_out)
    for t in range(m):
        one = gemvm_host(f"gemv1_{fmt}", raw, x[t:t + 1], n_out)[0]
        np.testing.assert_array_equal(rows[t], one, err_msg=f"row {t}")


@pytest.mark.parametrize("fmt,shape", [("f32", (960, 576)), ("f32", (3072, 576)), ("f32", (49152, 576)),
                                       ("bf16", (151936, 1024)), ("bf16", (6144, 4096)), ("f16", (4096, 1024))])
def test_verify_gemv_pairs_with_the_decode_geometry(fmt, shape, monkeypatch):
    """GEMVM_KERNEL "exact" picks, for every 2..16-token call, the j32 geometry of the decode step's row split
    (the pairs the host test above checks bit for bit), whatever geometry the decode step takes."""
    from graphir.backends.gpu import matmul as mm

    n_out, n_in = shape
    assert mm.GEMVM_KERNEL == "exact"
    one = mm.gemv_kernel(fmt, n_out, n_in, 1, 0)[0]
    lanes = int(one.rsplit("_", 1)[1][1:].split("r")[0])
    for m in (2, 3, 8, 16):
        per_block = mm.gemvm_block_tokens(m)
        assert mm.gemv_kernel(fmt, n_out, n_in, m, 0)[:2] == (f"gemvm{per_block}_{fmt}_j32w{lanes // 32}r4", lanes)
    monkeypatch.setattr(mm, "GEMV1_KERNEL", dict(mm.GEMV1_KERNEL, **{fmt: "g32r4"}))
    if mm.short_float_rows(fmt, n_out, mm._row_bytes(fmt, n_in)) is None:  # follows a retuned table
        assert mm.gemv_kernel(fmt, n_out, n_in, 16, 0)[0] == f"gemvm{mm.GEMVM_TOKENS_A_BLOCK[16]}_{fmt}_j32w1r4"


@pytest.mark.parametrize("fmt", ["bf16", "q4_0", "q8_0", "q4_k", "q6_k", "f32"])
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17])
@on_gpu
def test_mul_mat_swiglu_formats(fmt, m, rng):
    """Through the backend at every token count (1: the fused kernel, or for the v3 formats the GEMV
    then swiglu_halves_f32; 3-16 the fused gemvmsw kernel for float weights, the GEMV then
    swiglu_halves_f32 for quantized ones; 17 dequant + cuBLAS then swiglu_halves_f32), 7 outputs of 3
    super-blocks: against the reference and the f64 formula."""
    n_in = 768 if fmt in K_QUANTS else 96
    wshape = (14, n_in)
    raw = _raw(rng, fmt, wshape)
    weights = _weights(w=(fmt, raw, wshape))
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    node = g.mul_mat_swiglu(g.param("w", wshape, fmt), g.input("x", x.shape))
    got = _run("gpu", {"y": node}, {"x": x}, weights)["y"]
    want_ref = _run("reference", {"y": node}, {"x": x}, weights)["y"]
    np.testing.assert_allclose(got, want_ref, rtol=1e-4, atol=1e-3)
    _check_swiglu(got, x, dequantize(raw, fmt, wshape))


@on_gpu
def test_mul_mat_swiglu_large_weight_takes_the_plain_gemv(rng, monkeypatch):
    """Above SW_MAX_BYTES the product goes through the plain GEMV and swiglu_halves_f32: the same
    values, bit for bit, as the fused kernel below the limit."""
    import cupy as cp
    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.launch import Lowering

    half, n_in = 77, 512
    wshape = (2 * half, n_in)
    raw = _raw(rng, "bf16", wshape)
    gp, weights = _param("bf16", raw, wshape)
    x = cp.asarray(rng.standard_normal((1, n_in)).astype(np.float32))
    got = {}
    for limit in (1 << 30, 1024):
        monkeypatch.setattr(mm, "SW_MAX_BYTES", limit)
        y = cp.full((1, half), np.nan, np.float32)
        steps = mm.lower_mul_mat_swiglu(Lowering(weights), None, [gp, x], [y], {})
        for s in steps:
            s()
        got[len(steps)] = ([s.name for s in steps], y.get())
    assert got[1][0] == ["gemv1sw_bf16_g128r1"] and got[2][0] == ["gemv1v2_bf16_g128r1", "swiglu_halves_f32"]
    np.testing.assert_array_equal(got[1][1], got[2][1])
    _check_swiglu(got[2][1], x.get(), dequantize(raw, "bf16", wshape))
