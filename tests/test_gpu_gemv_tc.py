"""The tensor-core q4_0 decode GEMV (backends/gpu/gemv_tc.py, gemv_tc.cu).

The kernel keeps mul_mat's f32 meaning: every geometry, at awkward shapes (one row, rows and columns that end
inside a 16-row tile or a 4-block group), is checked against a float64 product of graphir.quant's dequantized
weight with the GPU suite's bound of 1e-5 of sum |x||w| (a code, scale or x half in the wrong place costs far
more). x blocks span 1e-30 to 1e6 and include all-zero blocks: the per-block power-of-two scale must keep f16
from overflowing or losing small blocks. The repacked layout is read back on the host and compared with the
codes and scales of the ggml rows, following the layout as gemv_tc.cu documents it.

Without a GPU (CI) the same source runs on the host (tests/_host_emulation.py): the six PTX helpers are given
host definitions here, mma.sync as the PTX ISA's fragment layout of m16n8k16 states it (each lane posts its
registers, the warp meets at a barrier, each lane sums its four outputs), so the repacking, the code and x
conversions, the scales and the reductions are checked in CI; only the tensor core itself is not.
"""

from __future__ import annotations

import ctypes

import _host_emulation as host_emulation
import numpy as np
import pytest
from test_gpu_matmul import _check_product, _check_swiglu, _param, on_gpu

from graphir.quant import dequantize, random_quantized

# (40, 12320): past the 8,192 inputs from which AUTO takes t2w16 (Qwen3-8B's down is 4096x12288), 385 blocks of 32
SHAPES = [(1, 32), (7, 96), (16, 128), (17, 160), (511, 512), (100, 4128), (1025, 64), (40, 12320)]


def _geometries() -> list[str]:
    from graphir.backends.gpu.gemv_tc import GEOMETRIES

    return list(GEOMETRIES)


def _tc_here() -> bool:
    from graphir.backends.gpu.device import available, tensor_cores

    return available() and tensor_cores()


tc_only = pytest.mark.skipif(not _tc_here(), reason="no f16 tensor cores here (HIP or below sm_80)")


def _x(rng: np.random.Generator, n_in: int) -> np.ndarray:
    """Normal values times a per-32-block magnitude from 1e-30 to 1e6, every fifth block zero."""
    mags = 10.0 ** rng.uniform(-30, 6, n_in // 32)
    mags[::5] = 0.0
    mags[len(mags) // 2] = 1e6  # f16 overflows at 65504 without the block scale
    return (rng.standard_normal(n_in) * np.repeat(mags, 32)).astype(np.float32)[None, :]


def _run(rng, shape, cfg, monkeypatch, x=None):
    import cupy as cp
    from graphir.backends.gpu import gemv_tc
    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.launch import Lowering

    monkeypatch.setitem(mm.GEMV1_KERNEL, "q4_0", "tc")
    monkeypatch.setattr(gemv_tc, "GEOMETRY", cfg)
    raw = random_quantized(rng, "q4_0", shape)
    gp, weights = _param("q4_0", raw, shape)
    x = _x(rng, shape[1]) if x is None else x
    y = cp.full((1, shape[0]), np.nan, np.float32)
    steps = mm.lower_mul_mat(Lowering(weights), None, [gp, cp.asarray(x)], [y], {})
    assert steps[-1].name == f"gemv_tc_q4_0_{cfg}"
    for s in steps:
        s()
    return y.get(), x, dequantize(raw, "q4_0", shape), gp


def _tc_weight(rng, shape, monkeypatch):
    """(raw q4_0 rows, their GpuParam, the weight store) with GEMV1_KERNEL["q4_0"] = "tc"."""
    from graphir.backends.gpu import matmul as mm

    monkeypatch.setitem(mm.GEMV1_KERNEL, "q4_0", "tc")
    raw = random_quantized(rng, "q4_0", shape)
    return (raw, *_param("q4_0", raw, shape))


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("cfg", _geometries())
@tc_only
@on_gpu
def test_tc_gemv_is_the_f32_product(cfg, shape, rng, monkeypatch):
    got, x, wf, _ = _run(rng, shape, cfg, monkeypatch)
    _check_product(got, x, wf)


@tc_only
@on_gpu
def test_tc_gemv_x_of_one_scale(rng, monkeypatch):
    """Ordinary activations (no block far from the others): the bound has no slack from tiny blocks."""
    x = rng.standard_normal((1, 4096)).astype(np.float32)
    got, x, wf, _ = _run(rng, (4096 + 5, 4096), "t1w4", monkeypatch, x)
    _check_product(got, x, wf)


@tc_only
@on_gpu
def test_tc_gemv_keeps_f32_accuracy(rng, monkeypatch):
    """Within 4e-6 of sum |x||w| per row, where the suite's bound is 1e-5: x in f16 alone (no low half, ~2^-12 of
    each x) misses this by several times at this K, the two halves (~2^-22) and f32 sums do not."""
    x = rng.standard_normal((1, 4096)).astype(np.float32)
    got, x, wf, _ = _run(rng, (1027, 4096), "t1w8", monkeypatch, x)
    xd, wd = x[0].astype(np.float64), wf.astype(np.float64)
    err = np.abs(got[0] - wd @ xd)
    bound = 4e-6 * (np.abs(wd) @ np.abs(xd))
    worst = int(np.argmax(err / bound))
    assert (err <= bound).all(), f"row {worst}: error {err[worst]:.3g}, {err[worst] / bound[worst]:.2f}x the bound"


@tc_only
@on_gpu
def test_repacked_layout_holds_the_ggml_codes_and_scales(rng, monkeypatch):
    """Codes and scales read back from the tile layout (gemv_tc.cu's description) equal the ggml blocks'."""
    from graphir.backends.gpu.gemv_tc import repack

    shape = (21, 224)  # a partial second tile; 7 blocks: a partial second group
    _, _, _, gp = _run(rng, shape, "t1w4", monkeypatch)
    codes, scales = (a.get() for a in repack(gp))
    _check_layout(codes, scales, gp.ref.raw, shape)


def _check_layout(codes: np.ndarray, scales: np.ndarray, raw: np.ndarray, shape: tuple[int, int]) -> None:
    """Codes and scales of gemv_tc.cu's tile layout, read back by its description, equal the ggml blocks'."""
    n_out, n_in = shape
    blocks = raw.view(np.uint8).reshape(n_out, n_in // 32, 18)
    d = blocks[:, :, :2].copy().view(np.uint16)[:, :, 0]
    qs = blocks[:, :, 2:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2)  # [row, block, element]
    slot_row8 = [0, 1, 0, 1, 0, 1, 0, 1]
    slot_off = [0, 0, 2, 2, 1, 1, 3, 3]
    tiles, groups = codes.shape[:2]
    for tile in range(tiles):
        for grp in range(groups):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                rows = (tile * 16 + g, tile * 16 + g + 8)
                for j in range(4):
                    blk = grp * 4 + j
                    for s in range(2):
                        word = int(codes[tile, grp, lane, 2 * j + s])
                        for k in range(8):
                            r, e = rows[slot_row8[k]], 8 * t + 4 * s + slot_off[k]
                            want = q[r, blk, e] if r < n_out and blk < n_in // 32 else 0
                            assert (word >> (4 * k)) & 0xF == want, (tile, grp, lane, j, s, k)
                sc = int(scales[tile, grp, lane])
                blk = grp * 4 + t
                for h, r in enumerate(rows):
                    want = d[r, blk] if r < n_out and blk < n_in // 32 else 0
                    assert (sc >> (16 * h)) & 0xFFFF == want, (tile, grp, lane, h)


@tc_only
@on_gpu
def test_unaligned_x_is_staged_and_steps_replay(rng, monkeypatch):
    import cupy as cp
    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.launch import Lowering

    shape = (77, 512)
    raw, gp, weights = _tc_weight(rng, shape, monkeypatch)
    base = cp.zeros(513, np.float32)
    x_dev = base[1:].reshape(1, 512)
    y = cp.zeros((1, 77), np.float32)
    steps = mm.lower_mul_mat(Lowering(weights), None, [gp, x_dev], [y], {})
    assert [s.name for s in steps][-1].startswith("gemv_tc_q4_0_") and len(steps) == 2
    for _ in range(2):
        x = rng.standard_normal((1, 512)).astype(np.float32)
        x_dev[...] = cp.asarray(x)
        for s in steps:
            s()
        _check_product(y.get(), x, dequantize(raw, "q4_0", shape))


@on_gpu
def test_without_tensor_cores_the_f32_kernel_serves_q4_0(rng, monkeypatch):
    import cupy as cp
    from graphir.backends.gpu import gemv_tc
    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.launch import Lowering

    monkeypatch.setitem(mm.GEMV1_KERNEL, "q4_0", "tc")
    monkeypatch.setattr(gemv_tc, "available", lambda: False)
    shape = (33, 256)
    raw = random_quantized(rng, "q4_0", shape)
    gp, weights = _param("q4_0", raw, shape)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    y = cp.zeros((1, 33), np.float32)
    steps = mm.lower_mul_mat(Lowering(weights), None, [gp, cp.asarray(x)], [y], {})
    assert steps[-1].name == f"gemv1v3_q4_0_{mm.TC_FALLBACK[2:]}"
    for s in steps:
        s()
    _check_product(y.get(), x, dequantize(raw, "q4_0", shape))


def test_geometries_mirror_the_kernel_source():
    import re

    from graphir.backends.gpu import kernels
    from graphir.backends.gpu.gemv_tc import GEOMETRIES, SW_WARPS

    text = (kernels.KERNEL_DIR / "gemv_tc.cu").read_text()
    line = re.search(r"#define FOR_EACH_GEMV_TC\(M\) (.*)", text).group(1)
    pairs = re.findall(r"M\((\d+), (\d+)\)", line)
    assert {f"t{t}w{w}": (int(t), int(w)) for t, w in pairs} == GEOMETRIES
    sw_line = re.search(r"#define FOR_EACH_GEMV_TC_SW\(M\) (.*)", text).group(1)
    assert tuple(int(w) for w in re.findall(r"M\((\d+)\)", sw_line)) == SW_WARPS


def test_auto_geometry_covers_every_size():
    from graphir.backends.gpu.gemv_tc import AUTO, GEOMETRIES, geometry_for

    assert all(entry[0] in GEOMETRIES for entry in AUTO) and AUTO[-1][1:] == (0,)
    for n_out in (1, 16, 4096, 12288, 151936):
        for n_in in (1, 32, 4096, 12288):
            assert geometry_for(n_out, "auto", n_in) in GEOMETRIES


# ---------------------------------------------------------------- the kernels on the host (no GPU)
HOST_HELPERS = r"""
#define GEMV_TC_HOST 1
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned emu_h(double v) {  // round to the nearest f16 (even on ties), as cvt.rn / .rn f16x2 do
    _Float16 h = (_Float16)v;
    unsigned short b;
    std::memcpy(&b, &h, 2);
    return b;
}
inline double emu_f(unsigned bits) {
    unsigned short b = (unsigned short)bits;
    _Float16 h;
    std::memcpy(&h, &b, 2);
    return (double)h;
}
inline unsigned emu_h2(double lo, double hi) { return emu_h(lo) | (emu_h(hi) << 16); }
inline unsigned sub_f16x2(unsigned a, unsigned b) {
    return emu_h2(emu_f(a) - emu_f(b), emu_f(a >> 16) - emu_f(b >> 16));
}
inline unsigned fma_f16x2(unsigned a, unsigned b, unsigned c) {
    return emu_h2(emu_f(a) * emu_f(b) + emu_f(c), emu_f(a >> 16) * emu_f(b >> 16) + emu_f(c >> 16));
}
inline unsigned pack_f16x2(float lo, float hi) { return emu_h2(lo, hi); }
inline float f16_lo(unsigned h2) { return (float)emu_f(h2); }
inline float f16_hi(unsigned h2) { return (float)emu_f(h2 >> 16); }
inline float __shfl_sync(unsigned, float v, int src) {  // v of lane src, as the shim's xor shuffle meets
    float* posted = emu_posted.data() + (emu_shuffles++ % 2) * blockDim.x;
    posted[threadIdx.x] = v;
    emu_warps[threadIdx.x / 32]->arrive_and_wait();
    return posted[(threadIdx.x & ~31u) + (unsigned)src];
}
// mma.sync.m16n8k16.row.col.f32.f16.f16.f32, from the PTX ISA's fragment layouts (g = lane / 4, t = lane % 4):
// A a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..); B b0 (k 2t..2t+1, n g), b1 (k 2t+8..);
// C/D c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1); the lower half of a register is the lower index.
struct EmuFrag { unsigned a[4], b[2]; };
inline EmuFrag emu_frags[2][1024];
inline thread_local unsigned emu_mmas = 0;
inline void mma_f16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    EmuFrag* post = emu_frags[emu_mmas++ % 2];
    post[threadIdx.x] = EmuFrag{{a[0], a[1], a[2], a[3]}, {b0, b1}};
    emu_warps[threadIdx.x / 32]->arrive_and_wait();
    const unsigned base = threadIdx.x & ~31u, lane = threadIdx.x & 31u, g = lane / 4, t = lane % 4;
    auto A = [&](int r, int k) {
        unsigned reg = post[base + 4 * (r % 8) + (k % 8) / 2].a[(r >= 8) + 2 * (k >= 8)];
        return emu_f(k % 2 ? reg >> 16 : reg);
    };
    auto B = [&](int k, int n) {
        unsigned reg = post[base + 4 * n + (k % 8) / 2].b[k >= 8];
        return emu_f(k % 2 ? reg >> 16 : reg);
    };
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i / 2), n = 2 * t + i % 2;
        double dot = 0.0;  // products of halves and their sum over 16 are exact in double
        for (int k = 0; k < 16; ++k) dot += A(r, k) * B(k, n);
        c[i] = (float)((double)c[i] + dot);
    }
}
"""
HOST_LAUNCHERS = r"""
extern "C" void emu_repack(unsigned grid, unsigned threads, const u8* W, long long rb, unsigned* C, unsigned* S,
                           int n_out, int n_in, int n_groups) {
    emu_launch(grid, 1, threads, [=] { repack_q4_0_tc(W, rb, C, S, n_out, n_in, n_groups); });
}
typedef void (*emu_tc_t)(const u32x4*, const unsigned*, const float*, float*, int, int, int, int);
extern "C" void emu_gemv_tc(emu_tc_t kernel, unsigned grid, unsigned threads, const u32x4* C, const unsigned* S,
                            const float* X, float* Y, int n_out, int n_in, int n_groups, int m) {
    emu_launch(grid, 1, threads, [=] { kernel(C, S, X, Y, n_out, n_in, n_groups, m); });
}
"""


@pytest.fixture(scope="module")
def tc_host(tmp_path_factory):
    """run(cfg, raw, x, n_out) -> (y [m, n_out], codes, scales): repack_q4_0_tc and gemv_tc_q4_0_<cfg> built for
    the host; x [n_in] or [m, n_in] (m tokens: m blocks a row block, common.cuh GEMV1_TOKEN_BLOCK)."""
    from graphir.backends.gpu.gemv_tc import GEOMETRIES, GROUP, REPACK_THREADS

    lib = host_emulation.build(tmp_path_factory.mktemp("gemv_tc_emu"), "gemv_tc.cu", HOST_LAUNCHERS,
                               prelude=HOST_HELPERS)

    def run(cfg: str, raw: np.ndarray, x: np.ndarray, n_out: int):
        """cfg "sw_t2w<W>": gemv_tc_sw_q4_0_t2w<W> over the raw [gate; up] rows, y [m, n_out / 2]."""
        n_in = x.shape[-1]
        tiles, groups = -(-n_out // 16), -(-n_in // GROUP)
        codes = np.full((tiles, groups, 32, 8), 0xDEADBEEF, np.uint32)
        scales = np.full((tiles, groups, 32), 0xDEADBEEF, np.uint32)
        wb = np.ascontiguousarray(raw.view(np.uint8).reshape(n_out, -1))
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)
        lib.emu_repack(ctypes.c_uint(-(-tiles * groups * 32 // REPACK_THREADS)), ctypes.c_uint(REPACK_THREADS),
                       ptr(wb), ctypes.c_longlong(wb.shape[1]), ptr(codes), ptr(scales), ctypes.c_int(n_out),
                       ctypes.c_int(n_in), ctypes.c_int(groups))
        sw = cfg.startswith("sw_")
        name = f"gemv_tc_sw_q4_0_{cfg[3:]}" if sw else f"gemv_tc_q4_0_{cfg}"
        t, w = (2, int(cfg.rpartition("w")[2])) if sw else GEOMETRIES[cfg]
        n_y = n_out // 2 if sw else n_out  # rows of y: the kernel's n_out
        blocks = n_y // 16 if sw else -(-tiles // t)
        m = x.size // n_in
        xs = np.ascontiguousarray(x.reshape(-1), np.float32)
        y = np.full(m * n_y + 8, np.nan, np.float32)
        y[m * n_y:] = -7.25  # a write past the rows changes one
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)
        kernel = ctypes.cast(getattr(lib, name), ctypes.c_void_p)
        lib.emu_gemv_tc(kernel, ctypes.c_uint(blocks * m), ctypes.c_uint(32 * w), ptr(codes), ptr(scales),
                        ptr(xs), ptr(y), ctypes.c_int(n_y), ctypes.c_int(n_in), ctypes.c_int(groups), ctypes.c_int(m))
        assert (y[m * n_y:] == -7.25).all(), f"{name} wrote past its {m} x {n_y} outputs"
        return y[:m * n_y].reshape(m, n_y), codes, scales

    return run


HOST_CASES = [("t1w8", (1, 32)), ("t1w4", (17, 160)), ("t2w4", (33, 384)), ("t2w16", (40, 1056)), ("t4w4", (70, 128)),
              ("t1w16", (16, 4128))]


@pytest.mark.parametrize("cfg,shape", HOST_CASES, ids=[f"{c}-{r}x{k}" for c, (r, k) in HOST_CASES])
def test_tc_kernels_on_the_host(cfg, shape, tc_host, rng):
    """Repacking and every part of the GEMV but the tensor core, against the f64 product (x blocks from 1e-30 to
    1e6), and the repacked codes read back as test_repacked_layout_holds_the_ggml_codes_and_scales reads them."""
    raw = random_quantized(rng, "q4_0", shape)
    x = _x(rng, shape[1])
    y, codes, scales = tc_host(cfg, raw, x, shape[0])
    _check_product(y, x, dequantize(raw, "q4_0", shape))
    _check_layout(codes, scales, raw, shape)


@pytest.mark.parametrize("cfg,m,shape", [("t1w8", 3, (17, 160)), ("t2w4", 2, (33, 384)), ("t4w4", 5, (70, 128))])
def test_tc_kernel_takes_a_token_a_block_on_the_host(cfg, m, shape, tc_host, rng):
    """m tokens on m times the blocks (a speculative verify call): each token's row is the 1-token call's bit for
    bit (the same code and lanes run it), so a verify call's rows are decode steps."""
    raw = random_quantized(rng, "q4_0", shape)
    x = np.stack([_x(rng, shape[1]) for _ in range(m)])
    y = tc_host(cfg, raw, x, shape[0])[0]
    for t in range(m):
        np.testing.assert_array_equal(y[t], tc_host(cfg, raw, x[t], shape[0])[0][0], err_msg=f"token {t}")


def test_tc_kernel_on_the_host_keeps_f32_accuracy(tc_host, rng):
    """test_tc_gemv_keeps_f32_accuracy's bound on the host build (no low f16 half misses it several times)."""
    shape = (33, 4096)
    raw = random_quantized(rng, "q4_0", shape)
    x = rng.standard_normal((1, 4096)).astype(np.float32)
    y, _, _ = tc_host("t1w8", raw, x, shape[0])
    wd, xd = dequantize(raw, "q4_0", shape).astype(np.float64), x[0].astype(np.float64)
    err, bound = np.abs(y[0] - wd @ xd), 4e-6 * (np.abs(wd) @ np.abs(xd))
    assert (err <= bound).all(), f"{(err / bound).max():.2f}x the bound"


# (half, n_in, tokens): one tile pair; the tiny presets' d_ff (96: 6 pairs); Qwen3-0.6B's gate|up (384 tiles: t1w8's
# W); 1536 tiles (Qwen3-8B's count: t2w4's W) at a short row; a verify call of 3 and of 16 tokens.
SW_CASES = [(16, 64, 1), (96, 160, 1), (3072, 1024, 1), (12288, 128, 1), (96, 4128, 3), (32, 256, 16)]


@pytest.mark.parametrize("half,n_in,m", SW_CASES, ids=[f"{h}x{k}-m{m}" for h, k, m in SW_CASES])
@tc_only
@on_gpu
def test_mul_mat_swiglu_fused_on_tensor_cores_is_the_unfused_path_bitwise(half, n_in, m, rng, monkeypatch):
    """mul_mat_swiglu of a q4_0 [gate; up] weight runs one gemv_tc_sw launch whose rows equal the plain tc product
    then swiglu_halves_f32 bit for bit (gemv_tc.SW_GEOMETRY None), and the f64 formula within the products' bound."""
    import cupy as cp
    from graphir.backends.gpu import gemv_tc
    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.launch import Lowering

    wshape = (2 * half, n_in)
    raw, gp, weights = _tc_weight(rng, wshape, monkeypatch)
    x = cp.asarray(np.concatenate([_x(rng, n_in) for _ in range(m)]))
    got = {}
    for sw in ("auto", None):
        monkeypatch.setattr(gemv_tc, "SW_GEOMETRY", sw)
        y = cp.full((m, half), np.nan, np.float32)
        steps = mm.lower_mul_mat_swiglu(Lowering(weights), None, [gp, x], [y], {})
        for s in steps:
            s()
        got[sw] = [s.name for s in steps], y.get()
    warps = gemv_tc.GEOMETRIES[gemv_tc.geometry_for(2 * half)][1]
    assert got["auto"][0] == [f"gemv_tc_sw_q4_0_t2w{warps}"]
    assert got[None][0] == [f"gemv_tc_q4_0_{gemv_tc.geometry_for(2 * half)}", "swiglu_halves_f32"]
    np.testing.assert_array_equal(got["auto"][1].view(np.uint32), got[None][1].view(np.uint32))
    if m == 1:  # _x's blocks span 1e-30..1e6: silu saturates, so the formula's check takes ordinary x
        x1 = rng.standard_normal((1, n_in)).astype(np.float32)
        monkeypatch.setattr(gemv_tc, "SW_GEOMETRY", "auto")
        y = cp.full((1, half), np.nan, np.float32)
        for s in mm.lower_mul_mat_swiglu(Lowering(weights), None, [gp, cp.asarray(x1)], [y], {}):
            s()
        _check_swiglu(y.get(), x1, dequantize(raw, "q4_0", wshape))


@tc_only
@on_gpu
def test_mul_mat_swiglu_halves_off_tile_take_the_unfused_path(rng, monkeypatch):
    """Gate and up rows that do not fill whole 16-row tiles (half 40) cannot pair tiles: plain product, swiglu."""
    import cupy as cp
    from graphir.backends.gpu import matmul as mm
    from graphir.backends.gpu.launch import Lowering

    wshape = (80, 256)
    raw, gp, weights = _tc_weight(rng, wshape, monkeypatch)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    y = cp.full((1, 40), np.nan, np.float32)
    steps = mm.lower_mul_mat_swiglu(Lowering(weights), None, [gp, cp.asarray(x)], [y], {})
    assert [s.name for s in steps][-1] == "swiglu_halves_f32"
    for s in steps:
        s()
    _check_swiglu(y.get(), x, dequantize(raw, "q4_0", wshape))


def _swiglu_f32(both: np.ndarray) -> np.ndarray:
    """silu(gate) * up over [gate | up] rows in f32, elementwise.cu's expression."""
    half = both.shape[-1] // 2
    with np.errstate(over="ignore"):
        g, u = both[..., :half], both[..., half:]
        return (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)


@pytest.mark.parametrize("w,m,shape", [(8, 1, (32, 160)), (4, 2, (64, 384)), (16, 3, (96, 1056))])
def test_tc_swiglu_kernel_on_the_host(w, m, shape, tc_host, rng):
    """gemv_tc_sw_q4_0_t2w<W> pairs gate tile i with up tile i + half / 16: its outputs are silu(gate) * up of the
    plain kernel's rows (same W: the same sums), for every token of a verify-sized call."""
    raw = random_quantized(rng, "q4_0", shape)
    x = np.concatenate([_x(rng, shape[1]) for _ in range(m)])
    plain = tc_host(f"t1w{w}", raw, x, shape[0])[0]
    fused = tc_host(f"sw_t2w{w}", raw, x, shape[0])[0]
    want = _swiglu_f32(plain)
    assert fused.shape == want.shape
    np.testing.assert_allclose(fused, want, rtol=1e-6, atol=1e-37)


def test_geometry_tables_pick_by_row_tiles():
    """geometry_for: a name is taken as is; "auto" and a written table give the first entry whose row tiles the
    product has (16 rows a tile), so a sweep (profile_gpu_decode.py --gemv1 "q4_0=tc@t4w4:4096/t1w8:0") times
    the shapes it means to."""
    from graphir.backends.gpu.gemv_tc import geometry_for

    table = "t4w4:4096/t2w4:512/t1w8:0"
    assert [geometry_for(n, table) for n in (1, 16 * 511, 16 * 511 + 1, 16 * 4095, 16 * 4096, 151936)] == \
        ["t1w8", "t1w8", "t2w4", "t2w4", "t4w4", "t4w4"]
    assert geometry_for(151936, "auto") == "t4w4" and geometry_for(4096, "auto") == "t1w8"
    assert geometry_for(4096, "auto", 12288) == "t2w16" and geometry_for(4096, "auto", 4096) == "t1w8"
    assert geometry_for(151936, "t2w16") == "t2w16"


def test_geometry_tables_pick_by_input_width_where_an_entry_gives_one():
    """An entry cfg:tiles:n_in serves only products at least n_in wide; a table that serves nothing, or an
    entry that is not cfg:tiles[:n_in], is refused with the table named."""
    from graphir.backends.gpu.gemv_tc import geometry_for

    table = "t4w4:4096/t2w16:0:4096/t1w8:0"
    assert [geometry_for(4096, table, n_in) for n_in in (1, 1024, 4095, 4096, 12288)] == \
        ["t1w8", "t1w8", "t1w8", "t2w16", "t2w16"]
    assert geometry_for(151936, table, 12288) == "t4w4"
    with pytest.raises(ValueError, match="no entry serves 16 x 100"):
        geometry_for(16, "t4w4:4096/t2w16:0:4096", 100)
    with pytest.raises(ValueError, match="'t9w9:0'"):
        geometry_for(16, "t9w9:0")
