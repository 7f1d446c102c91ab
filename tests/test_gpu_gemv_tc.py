"""The tensor-core q4_0 decode GEMV (backends/gpu/gemv_tc.py, gemv_tc.cu).

The kernel keeps mul_mat's f32 meaning: every geometry, at awkward shapes (one row, rows and columns that end
inside a 16-row tile or a 4-block group), is checked against a float64 product of graphir.quant's dequantized
weight with the GPU suite's bound of 1e-5 of sum |x||w| (a code, scale or x half in the wrong place costs far
more). x blocks span 1e-30 to 1e6 and include all-zero blocks: the per-block power-of-two scale must keep f16
from overflowing or losing small blocks. The repacked layout is read back on the host and compared with the
codes and scales of the ggml rows, following the layout as gemv_tc.cu documents it.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_matmul import _check_product, _param, on_gpu

from graphir.quant import dequantize, random_quantized

SHAPES = [(1, 32), (7, 96), (16, 128), (17, 160), (511, 512), (100, 4128), (1025, 64)]


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
    n_out, n_in = shape
    blocks = gp.ref.raw.view(np.uint8).reshape(n_out, n_in // 32, 18)
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

    monkeypatch.setitem(mm.GEMV1_KERNEL, "q4_0", "tc")
    shape = (77, 512)
    raw = random_quantized(rng, "q4_0", shape)
    gp, weights = _param("q4_0", raw, shape)
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
    from graphir.backends.gpu.gemv_tc import GEOMETRIES

    text = (kernels.KERNEL_DIR / "gemv_tc.cu").read_text()
    line = re.search(r"#define FOR_EACH_GEMV_TC\(M\) (.*)", text).group(1)
    pairs = re.findall(r"M\((\d+), (\d+)\)", line)
    assert {f"t{t}w{w}": (int(t), int(w)) for t, w in pairs} == GEOMETRIES


def test_auto_geometry_covers_every_size():
    from graphir.backends.gpu.gemv_tc import AUTO, GEOMETRIES, geometry_for

    assert all(cfg in GEOMETRIES for cfg, _ in AUTO) and AUTO[-1][1] == 0
    for n_out in (1, 16, 4096, 12288, 151936):
        assert geometry_for(n_out, "auto") in GEOMETRIES
