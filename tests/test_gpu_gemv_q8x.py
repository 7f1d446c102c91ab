"""mul_mat_q8x's GPU kernels (backends/gpu/gemv_q8x.cu, chosen by gemv_q8x.py), on the host and on a GPU.

On the host (no GPU): gemv_q8x.cu built by g++ with tests/_host_emulation.py's shim, every staged geometry and
the `_any` kernel at awkward shapes (partial chunks, partial row blocks, rows that are not whole 16-byte pieces,
two tokens), against the op's reference (graphir/ops/fused.py):
  - bit for bit on data where every float operation is exact (power-of-two scales, x whose block maximum is
    127 times a power of two, small codes): any error in the integer sums, q4_0's -8, or x's rounding shows;
  - within the f32 bound of an n_in / 32-term sum on random data (outliers, an all-zero block, a block too
    small to scale), every geometry bitwise equal to `_any` (the same terms added in the same order).
On a GPU (marker `gpu`): the rule's kernels against the reference up to Qwen3-8B's shapes, every geometry, x not
16-byte aligned, replayed steps; a model decoding through the pass against the reference backend.
"""

from __future__ import annotations

import ctypes

import _host_emulation as host_emulation
import numpy as np
import pytest
from _gpu_helpers import gpu_only
from graphir.backends.gpu.gemv_q8x import ANY_ROWS, Q8X_CONFIGS

import graphir
from graphir.ops import OPS
from graphir.quant import dequantize, random_quantized

FORMATS = ("q4_0", "q8_0")
BLOCK_BYTES = {"q4_0": 18, "q8_0": 34}


def kernels_for(fmt: str, n_in: int) -> dict[str, tuple[int, int]]:
    """{kernel: (threads, rows per block)}: `_any`, and every staged geometry where rows are whole 16-byte pieces."""
    out = {f"gemv_q8x_{fmt}_any": (32 * ANY_ROWS, ANY_ROWS)}
    if n_in // 32 * BLOCK_BYTES[fmt] % 16 == 0:
        out.update({f"gemv_q8x_{fmt}_{cfg}": tr for cfg, tr in Q8X_CONFIGS.items()})
    return out


def reference(raw: np.ndarray, fmt: str, x: np.ndarray) -> np.ndarray:
    wf = dequantize(raw, fmt, (raw.shape[0], x.shape[-1]))
    return OPS["mul_mat_q8x"].ref(wf, x)


def check_bound(got: np.ndarray, raw: np.ndarray, fmt: str, x: np.ndarray, what: str) -> None:
    """got within (n_in / 32 + 2) 2^-24 sum |terms| of the reference: an f32 sum of the block terms in any order,
    each term rounded twice (the scales' product, the fma). The terms' magnitudes come from the same formula."""
    want = reference(raw, fmt, x).astype(np.float64)
    n_in = x.shape[-1]
    wf = np.abs(dequantize(raw, fmt, (raw.shape[0], n_in)).astype(np.float64))
    # sum_b |d_x sum_i w_i q_i| <= sum_i |w_i| |x_i| (1 + 1/254) + 1/2 d_x per value: a bound on sum |terms|
    mag = (wf @ np.abs(x.astype(np.float64)).T).T * 1.01 + 1e-30
    bound = (n_in // 32 + 2) * 2.0 ** -24 * mag
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), f"{what}: max error {err.max():.3g} ({(err > bound).sum()} outputs past the bound)"


# ---------------------------------------------------------------- data
def exact_weight(rng: np.random.Generator, fmt: str, n_out: int, n_in: int) -> np.ndarray:
    """Blocks with scales 2^-3 or 2^-2 and codes (q8_0: -20..20) that keep every sum of the product exact in f32."""
    nb = n_in // 32
    d = np.float16(2.0) ** -rng.integers(2, 4, (n_out, nb, 1)).astype(np.float16)
    if fmt == "q4_0":
        codes = rng.integers(0, 256, (n_out, nb, 16), dtype=np.uint8)
    else:
        codes = rng.integers(-20, 21, (n_out, nb, 32)).astype(np.int8).view(np.uint8)
    return np.concatenate([d.view(np.uint8), codes], axis=-1).reshape(n_out, -1)


def exact_x(rng: np.random.Generator, m: int, n_in: int) -> np.ndarray:
    """Each block's largest |value| is 127 * 2^e (e = 0 or 1: the scale 2^e, exact), the rest small multiples of
    2^e whose codes take every rounding case: ties both ways, 0.49999997, exact integers."""
    cases = np.array([0.0, 0.25, 0.5, -0.5, 0.49999997, -0.49999997, 1.5, -2.5, 3.5, 1.0, -3.0, 2.75, 0.75],
                     np.float32)
    x = rng.choice(cases, (m, n_in // 32, 32)) * rng.choice(np.float32([-1, 1]), (m, n_in // 32, 32))
    x[..., rng.integers(0, 32)] = np.float32(127) * rng.choice(np.float32([-1, 1]), (m, n_in // 32))
    x *= np.float32(2) ** rng.integers(0, 2, (m, n_in // 32, 1)).astype(np.float32)
    if n_in >= 64:
        x[0, 1] = 0.0  # an all-zero block: scale 0
    return x.reshape(m, n_in).astype(np.float32)


def random_x(rng: np.random.Generator, m: int, n_in: int) -> np.ndarray:
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    x[0, 3] = 60.0  # an outlier: its block's other values round to a few codes
    if n_in >= 96:
        x[-1, 32:64] = 0.0  # scale 0
        x[0, 64:96] = rng.uniform(-1e-37, 1e-37, 32)  # scale below 2^-126: 1/d would overflow, codes are 0
    return x


# ---------------------------------------------------------------- host emulation
LAUNCHER = r"""
typedef void (*emu_q8x_t)(const u8*, long long, const float*, float*, int, int);
extern "C" void emu_q8x(emu_q8x_t kernel, unsigned gx, unsigned gy, unsigned threads, const u8* W,
                        long long row_bytes, const float* X, float* Y, int n_out, int n_in) {
    emu_launch(gx, gy, threads, [=] { kernel(W, row_bytes, X, Y, n_out, n_in); });
}
"""
GUARD = 64  # guard elements either side of every host buffer
SENTINEL = np.float32(-7.25)  # the output's guards: a kernel writing outside the output changes one


@pytest.fixture(scope="module")
def q8x_host(tmp_path_factory):
    """run(kernel, threads, rows per block, raw, x) -> y, gemv_q8x.cu run on the host."""
    lib = host_emulation.build(tmp_path_factory.mktemp("q8x_emu"), "gemv_q8x.cu", LAUNCHER, ("-ffp-contract=off",))

    def run(kernel: str, threads: int, rows: int, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
        (n_out, rb), (m, n_in) = raw.shape, x.shape
        w_buf = np.full(raw.size + 2 * GUARD, 0xFF, np.uint8)  # guards: NaN scales
        w_buf[GUARD:GUARD + raw.size] = raw.ravel()
        x_buf = np.full(x.size + 2 * GUARD, np.nan, np.float32)
        x_buf[GUARD:GUARD + x.size] = x.ravel()
        y_buf = np.full(m * n_out + 2 * GUARD, SENTINEL, np.float32)
        y_buf[GUARD:GUARD + m * n_out] = np.nan
        ptr = lambda a: ctypes.c_void_p(a.ctypes.data + GUARD * a.itemsize)  # noqa: E731
        lib.emu_q8x(ctypes.cast(getattr(lib, kernel), ctypes.c_void_p), ctypes.c_uint(-(-n_out // rows)),
                    ctypes.c_uint(m), ctypes.c_uint(threads), ptr(w_buf), ctypes.c_longlong(rb), ptr(x_buf),
                    ptr(y_buf), ctypes.c_int(n_out), ctypes.c_int(n_in))
        assert (y_buf[:GUARD] == SENTINEL).all() and (y_buf[-GUARD:] == SENTINEL).all(), f"{kernel} wrote outside Y"
        return y_buf[GUARD:GUARD + m * n_out].reshape(m, n_out).copy()

    return run


# (m, n_out, n_in): one block; 7 rows of rows not whole 16-byte pieces (_any only); partial chunks (16 and 40
# blocks of 32 / 64) and partial row blocks (33, 17 rows); two tokens; 4096 columns (Qwen3-8B's rows)
HOST_SHAPES = [(1, 1, 32), (1, 7, 64), (1, 33, 512), (2, 17, 1280), (1, 5, 4096)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n_out,n_in", HOST_SHAPES)
def test_kernels_on_the_host_are_exact_where_the_floats_are(fmt, m, n_out, n_in, q8x_host):
    rng = np.random.default_rng(n_out + n_in)
    raw, x = exact_weight(rng, fmt, n_out, n_in), exact_x(rng, m, n_in)
    want = reference(raw, fmt, x)
    for kernel, (threads, rows) in kernels_for(fmt, n_in).items():
        np.testing.assert_array_equal(q8x_host(kernel, threads, rows, raw, x), want, err_msg=kernel)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n_out,n_in", HOST_SHAPES)
def test_kernels_on_the_host_meet_the_reference_and_each_other(fmt, m, n_out, n_in, q8x_host):
    rng = np.random.default_rng(7 * n_out + n_in)
    raw, x = random_quantized(rng, fmt, (n_out, n_in)), random_x(rng, m, n_in)
    results = {k: q8x_host(k, *tr, raw, x) for k, tr in kernels_for(fmt, n_in).items()}
    first = results.pop(f"gemv_q8x_{fmt}_any")
    check_bound(first, raw, fmt, x, f"gemv_q8x_{fmt}_any")
    for kernel, got in results.items():
        np.testing.assert_array_equal(got, first, err_msg=f"{kernel} differs from _any")


# ---------------------------------------------------------------- on a GPU
# Qwen3-8B's q/o, gate|up-sized, down and (a fifth of) the LM head, and awkward small ones
GPU_SHAPES = [(1, 32), (7, 64), (511, 4096), (4096, 4096), (12288, 4096), (4096, 12288), (32768, 4096)]


def _param(fmt: str, raw: np.ndarray, shape: tuple[int, int]):
    from graphir.backends.gpu.launch import GpuParam

    from graphir.lowering import ParamRef
    from graphir.weights import Weight, Weights

    weights = Weights({"w": Weight(fmt, shape, raw)})
    return GpuParam(ParamRef(None, weights, raw, fmt, shape, ("param", "w"))), weights


def _rule(fmt: str, raw: np.ndarray, x: np.ndarray, cfg: str | None, x_offset: int = 0):
    """(y, steps) of lower_mul_mat_q8x with Q8X_KERNEL[fmt] = cfg (None: the default); x placed x_offset floats
    into a device buffer."""
    import cupy as cp
    from graphir.backends.gpu import gemv_q8x
    from graphir.backends.gpu.launch import Lowering

    shape = (raw.shape[0], x.shape[-1])
    gp, weights = _param(fmt, raw, shape)
    saved = dict(gemv_q8x.Q8X_KERNEL)
    if cfg is not None:
        gemv_q8x.Q8X_KERNEL[fmt] = cfg
    try:
        xd = cp.zeros(x.size + x_offset, np.float32)
        xd[x_offset:] = cp.asarray(x.ravel())
        y = cp.full((x.shape[0], shape[0]), np.nan, np.float32)
        steps = gemv_q8x.lower_mul_mat_q8x(Lowering(weights), None, [gp, xd[x_offset:].reshape(x.shape)], [y], {})
    finally:
        gemv_q8x.Q8X_KERNEL.clear()
        gemv_q8x.Q8X_KERNEL.update(saved)
    for s in steps:
        s()
    return y, steps


def _check_rows(got: np.ndarray, raw: np.ndarray, fmt: str, x: np.ndarray, what: str) -> None:
    """check_bound on every row of a small weight, on 192 rows (first, last, random) of a large one."""
    n_out = raw.shape[0]
    rows = np.arange(n_out) if n_out <= 4096 else np.unique(np.concatenate(
        [np.arange(64), np.arange(n_out - 64, n_out), np.random.default_rng(0).integers(0, n_out, 64)]))
    check_bound(got[:, rows], raw[rows], fmt, x, what)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[f"{a}x{b}" for a, b in GPU_SHAPES])
@gpu_only
@pytest.mark.gpu
def test_every_geometry_on_the_gpu(fmt, shape, rng):
    """The rule with every Q8X_CONFIGS geometry (and `_any` where rows are not whole 16-byte pieces) against the
    reference, outliers and a zero block in x; all geometries bitwise equal (the same sums in the same order)."""
    n_out, n_in = shape
    raw, x = random_quantized(rng, fmt, shape), random_x(rng, 1, n_in)
    first = None
    for cfg in Q8X_CONFIGS:
        y, steps = _rule(fmt, raw, x, cfg)
        got = y.get()
        staged = n_in // 32 * BLOCK_BYTES[fmt] % 16 == 0
        assert steps[-1].name == (f"gemv_q8x_{fmt}_{cfg}" if staged else f"gemv_q8x_{fmt}_any")
        _check_rows(got, raw, fmt, x, steps[-1].name)
        if first is not None:
            np.testing.assert_array_equal(got, first, err_msg=f"{steps[-1].name} differs from the first geometry")
        first = got


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 16])
@gpu_only
@pytest.mark.gpu
def test_unaligned_x_tokens_and_replay(fmt, m, rng):
    """x 4 bytes off a 16-byte boundary (the rule stages it), m tokens along grid y, the steps run twice."""
    raw, x = random_quantized(rng, fmt, (1025, 1024)), random_x(rng, m, 1024)
    y, steps = _rule(fmt, raw, x, None, x_offset=1)
    assert len(steps) == 2  # the aligning copy, then the GEMV
    first = y.get()
    _check_rows(first, raw, fmt, x, steps[-1].name)
    y.fill(np.nan)
    for s in steps:
        s()
    np.testing.assert_array_equal(y.get(), first)


def _decode_logits(spec: str, backend: str, dtype: str, passes: str, n: int) -> np.ndarray:
    model = graphir.load(spec, backend=backend, passes=passes, dtype=dtype, ctx=64)
    model.reset()
    return np.concatenate([model.feed([t]) for t in np.random.default_rng(4).integers(0, 256, n)])


@pytest.mark.parametrize("dtype", FORMATS)
@gpu_only
@pytest.mark.gpu
def test_model_decode_through_the_pass_meets_the_reference_backend(dtype):
    """random:qwen3-tiny decoding 24 tokens one a call: the gpu's 8-bit path is as close to the f32 path as the
    reference backend's 8-bit path is, and the two 8-bit paths are closer to each other than either is to f32.
    Not to an f32 summation-order bound: where an x value moved by an ulp upstream (the gpu's f32 kernels sum
    in other orders) its 8-bit code may round the other way, a step of max|x|/127 in one value, the same size
    as the pass's own rounding (half a step), and the flips cascade through later layers and tokens. On the
    H200 (2026-12-01) the two 8-bit paths' normalized squared error was 4.5e-5 against the pass's own 2.7e-4
    (q4_0; a first bound of a tenth of the pass's error, set before any GPU run, failed). A wrong block,
    scale, offset or operand in the kernel or the lowering costs errors of the logits' own size (NMSE ~1).
    This tiny model's rows (64 and 96 values: 36-68 bytes, not whole 16-byte pieces) all take `_any`: on the
    H200 (2026-12-02) dropping q4_0's -8 there failed this test, dropping it in the staged kernels did not (the
    geometry tests above catch that one)."""
    got = _decode_logits("random:qwen3-tiny", "gpu", dtype, "default,q8-activations", 24)
    want = _decode_logits("random:qwen3-tiny", "reference", dtype, "default,q8-activations", 24)
    f32 = _decode_logits("random:qwen3-tiny", "reference", dtype, "default", 24)

    def nmse(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.mean((a - b) ** 2) / np.mean(b ** 2))

    own = nmse(want, f32)
    assert nmse(got, f32) <= 1.5 * own, (nmse(got, f32), own)
    assert nmse(got, want) <= own, (nmse(got, want), own)
