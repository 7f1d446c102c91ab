"""mul_mat_q16x on the cpu (backends/cpu/gemv_q16x.py) against numpy formulas of the same integer arithmetic.

As tests/test_cpu_gemv_q8x.py, with x's codes 16-bit: the weight's blocks read with gguf-py's layout constants
(that file's blocks_of), x's codes from the op's q16_blocks (itself checked against a formula written apart in
tests/test_ops.py), each block's integer sum in int64, the rest in float64. The kernel's x codes and its integer
block sums must equal these exactly; y is within (nquad + 6) 2^-24 sum |terms| (test_cpu_gemv_q8x's bound: the
float order is gemv_q8x's), q8_0 one 2^-24 more (its block sums, up to 2^27, are rounded once to f32); the AVX2 and
portable paths agree bit for bit.

On SmolLM2 (slow, skipped without its weights): the pass's sites on the real decode graph, and issue 13's greedy
rule for the 16-bit path (layers q4_1 and the q8_0 head at 16 bits).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from graphir.backends.cpu import gemv_q16x as G16
from test_cpu_gemv_q8x import PROMPTS, blocks_of, first_divergence

from graphir import g
from graphir.errors import BackendError
from graphir.ops.fused import q16_blocks
from graphir.passes import coverage
from graphir.quant import random_quantized

# n_in of 1, 3, 5 and 7 blocks (a lone pair, a quad and a pair, ...) and SmolLM2's 576 / 1536; x's rows rotating
SHAPES = [(n_out, n_in, (1, 2)[(i + j) % 2]) for i, n_out in enumerate((1, 7, 511))
          for j, n_in in enumerate((32, 96, 160, 224, 576))] + [(1025, 1536, 1), (960, 576, 2)]
PATHS = ["avx2", "portable"] if G16.AVX2 else ["portable"]


def activations(m: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Normal values with an outlier, an all-zero block (scale 0) where there are two blocks, and the rounding's
    hard cases in a block whose max is 32767 (scale 1): ties both ways, 0.49999997, -32766.5."""
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    x[0, -1] = 40.0
    if n_in >= 64:
        x[-1, 32:64] = 0.0
    x[0, :7] = [32767.0, 2.5, -2.5, 0.5, -0.5, 0.49999997, -32766.5]
    return x


def exact_terms(raw: np.ndarray, dtype: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(integer block sums int64 [m, n_out, nblk], y float64 [m, n_out], the sum of |terms| [m, n_out]):
    y = sum_b d_w d_x (sum c q) + m_w d_x (sum q)."""
    d, mn, c = blocks_of(raw, dtype)
    q, dx = q16_blocks(x)
    q = q.astype(np.int64).reshape(x.shape[0], -1, 32)  # [m, nblk, 32]
    dx = dx.astype(np.float64)
    isum = np.einsum("obi,tbi->tob", c, q)
    scale, offset = d[None] * dx[:, None], mn[None] * dx[:, None] * q.sum(axis=-1)[:, None, :]
    return isum, (scale * isum + offset).sum(-1), (np.abs(scale * isum) + np.abs(offset)).sum(-1)


def run_kernel(raw, dtype, x, path):
    y = np.full((x.shape[0], raw.shape[0]), np.nan, np.float32)
    G16.prepare(raw, dtype, x, y, {}, ("param", "w"), path=path)()
    return y


def x_codes(x: np.ndarray, words: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    m, n_in = x.shape
    nblk2, nblk4 = n_in // 32 + n_in // 32 % 2, -(-n_in // 128) * 4
    xq, dx, sx = np.ones((m, nblk2 * 32), np.int16), np.empty((m, nblk4), np.float32), np.empty((m, nblk4), np.float32)
    (G16.quantize_x if words else G16.quantize_x_in_order)(x, xq, dx, sx)
    return xq, dx, sx


@pytest.mark.parametrize("words", [True, False])
def test_x_codes_are_q16_blocks_bit_for_bit(words, rng):
    x = activations(3, 96, rng)
    x[1, 32:38] = [1e-37, -3e-38, 0.0, 0.0, 0.0, 0.0]  # a block whose scale is below 2^-126: codes 0
    x[1, 38:64] = 0.0
    xq, dx, sx = x_codes(x, words)
    q, d = q16_blocks(x)
    stored = xq[:, :96].reshape(3, 3, 32)
    if words:  # element j at j // 2 + 16 (j % 2): evens, then odds
        stored = stored[..., G16.WORDS_ORDER]
    assert np.array_equal(stored.reshape(3, 96), q) and not xq[:, 96:].any()
    assert np.array_equal(dx[:, :3], d) and not dx[:, 3].any()
    assert np.array_equal(sx[:, :3], d * q.reshape(3, 3, 32).sum(-1).astype(np.float32))
    assert not xq[1, 32:64].any() and dx[1, 1] > 0 and xq[0, 0] == 32767


@pytest.mark.skipif(not G16.AVX2, reason="numba does not compile for AVX2 here: the portable path runs")
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("n_out,n_in,m", SHAPES[:15])
def test_avx2_block_sums_are_exact(dtype, n_out, n_in, m, rng):
    raw = random_quantized(rng, dtype, (n_out, n_in))
    x = activations(m, n_in, rng)
    want, _, _ = exact_terms(raw, dtype, x)
    got = G16.block_isums(raw, dtype, x_codes(x, words=True)[0])
    nblk = n_in // 32
    assert np.array_equal(got[..., :nblk], want) and not got[..., nblk:].any()


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("n_out,n_in,m", SHAPES)
def test_kernel_matches_the_integer_formula(dtype, n_out, n_in, m, rng):
    raw = random_quantized(rng, dtype, (n_out, n_in))
    x = activations(m, n_in, rng)
    _, want, size = exact_terms(raw, dtype, x)
    got = {p: run_kernel(raw, dtype, x, p) for p in PATHS}
    nquad = (n_in // 32 + 3) // 4
    bound = (nquad + 6 + (dtype == "q8_0")) * 2.0 ** -24 * size + 1e-30  # q8_0: f32(block sum) rounds once
    for p, y in got.items():
        err = np.abs(y - want)
        assert (err <= bound).all(), f"{p}: max error {err.max():.3g}, {(err > bound).sum()} outputs past the bound"
    assert all(np.array_equal(y, got["portable"]) for y in got.values())  # the same float order


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("m", [2, 3, 7, 8, 16, 17])
def test_each_row_of_x_is_the_one_row_kernel_bit_for_bit(path, dtype, m, rng):
    """Row t of an m-row call equals the kernel on x[t] alone, bit for bit (speculative verify rows must be the
    decode steps: tests/test_speculative.py): the AVX2 path unpacks each weight quad once for up to 16 rows, and each
    row must still see its own accumulators in the 1-row order. 17 rows: a second tile of one row. Random non-zero
    x, n_in of 1, 3, 5, 7 and 48 blocks (a lone pair, a quad and a pair, two quads, whole quads)."""
    for n_out, n_in in [(1, 32), (7, 96), (511, 160), (1025, 224), (7, 1536)]:
        raw = random_quantized(rng, dtype, (n_out, n_in))
        x = rng.standard_normal((m, n_in)).astype(np.float32)
        got = run_kernel(raw, dtype, x, path)
        for t in range(m):
            one = run_kernel(raw, dtype, x[t:t + 1], path)[0]
            assert np.array_equal(got[t], one), f"[{n_out} x {n_in}] row {t} of {m}: {np.abs(got[t] - one).max():.3g}"


@pytest.mark.parametrize("path", PATHS)
def test_q8_0_extreme_codes(path, rng):
    """q8_0's largest block sums: codes -128 and 127 against x codes +-32767 (|sum| up to 32 * 128 * 32767 < 2^27,
    exact in int32), a weight block of scale 0, 1 to 7 blocks; the integer sums exactly, y within the bound."""
    for nblk in (1, 3, 5, 7):
        raw = random_quantized(rng, "q8_0", (7, 32 * nblk))
        b = raw.reshape(7, nblk, 34)
        b[0, :, 2:] = 0x80  # -128 everywhere in row 0
        b[1, :, 2:] = 127
        b[2, :, 2:18] = 0x80  # -128 and 127 alternating by half
        b[2, :, 18:] = 127
        b[3, 0, :2] = 0  # row 3's first block has scale 0
        x = np.full((2, 32 * nblk), -1.0, np.float32)
        x[1, ::2] = 1.0
        _, want, size = exact_terms(raw, "q8_0", x)
        if path == "avx2":
            isum, _, _ = exact_terms(raw, "q8_0", x)
            got = G16.block_isums(raw, "q8_0", x_codes(x, words=True)[0])[..., :nblk]
            assert np.array_equal(got, isum) and abs(isum[0, 0, 0]) == 32 * 128 * 32767
        y = run_kernel(raw, "q8_0", x, path)
        bound = ((nblk + 3) // 4 + 7) * 2.0 ** -24 * size + 1e-30
        assert (np.abs(y - want) <= bound).all()


def test_unsupported_weights_and_layouts_are_left_to_the_reference(rng):
    x, y = np.ones((1, 64), np.float32), np.empty((1, 7), np.float32)
    assert G16.prepare(random_quantized(rng, "q5_0", (7, 64)), "q5_0", x, y) is None  # no kernel for q5_0
    w = random_quantized(rng, "q4_1", (7, 64))
    assert G16.prepare(w, "q4_1", np.ones((1, 128), np.float32)[:, ::2], y) is None  # a strided x
    assert G16.prepare(w, "q4_1", x, np.empty((1, 6), np.float32)) is None  # y of another shape
    assert G16.prepare(w, "q4_1", x, y) is not None


@pytest.mark.skipif(not G16.AVX2, reason="numba does not compile for AVX2 here: the portable path runs")
def test_avx2_kernel_multiplies_int16_on_256_bit_registers(rng):
    run_kernel(random_quantized(rng, "q4_1", (7, 64)), "q4_1", activations(1, 64, rng), "avx2")
    asm = G16.asm("avx2")
    assert re.search(r"vpmaddwd\s[^\n]*%ymm", asm) and not re.search(r"vpmaddwd\s[^\n]*%xmm", asm)
    assert "vpmaddubsw" not in asm and "vpmovzxbw" not in asm  # no 8-bit products, no widening of the nibbles


def test_gpu_lowering_refuses_naming_the_node():
    from graphir.backends.gpu.lowering import lower_node

    node = g.mul_mat_q16x(g.param("w", (8, 64), "q4_1"), g.input("x", (1, 64)), name="blk.0.attn_q")
    with pytest.raises(BackendError, match=r"mul_mat_q16x 'blk\.0\.attn_q'.*no gpu kernel.*q16-activations on the cpu"):
        lower_node(None, node, [None, None], None)  # no device here: the rule refuses before touching one


@pytest.fixture(scope="module")
def smollm2():
    import graphir

    try:
        return (graphir.load("smollm2-135m", backend="cpu", passes="default"),
                graphir.load("smollm2-135m", backend="cpu", passes="default,q16-activations"))
    except graphir.LoadError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_smollm2_q16x_sites_and_logits(smollm2):
    """Every decode product of SmolLM2 becomes mul_mat_q16x (q|k|v, o, gate|up, down: 4 a layer, q4_1; the q8_0
    head); fed the f32 path's greedy tokens for 16 steps on each parity prompt, the 16-bit path picks the same token
    at every step and no logit moves by more than 0.02. Measured 2026-12-02 (AMD EPYC, AVX2), the head in f32: 48
    of 48 agree, largest logit movement 0.0050 (the 8-bit path: 47 of 48, 1.02); the head at 16 bits: 48 of 48,
    0.0051."""
    f32, q16 = smollm2
    report = coverage(q16.graph("decode"), "default,q16-activations")["q16-activations"]
    assert len(report.matched) == 30 * 4 + 1 and not report.rejected
    moved = 0.0
    for prompt in PROMPTS:
        ids = f32.tokenizer.encode(prompt)
        f32.reset()
        q16.reset()
        lf, lq = f32.feed(ids)[-1], q16.feed(ids)[-1]
        for step in range(16):
            want = int(np.argmax(lf))
            moved = max(moved, float(np.abs(lf - lq).max()))
            assert int(np.argmax(lq)) == want, f"{prompt!r} step {step}"
            lf, lq = f32.feed([want])[-1], q16.feed([want])[-1]
    assert moved <= 0.02, moved


@pytest.mark.slow
def test_smollm2_q16x_greedy_text_meets_issue_13_rule(smollm2):
    """Issue 13's parity rule for the 16-bit path: on each parity prompt, the greedy text through q16-activations
    equals the f32 path's for 16 tokens, or first differs where the f32 path's top-2 logit gap is below 0.05."""
    f32, q16 = smollm2
    misses = {}
    for prompt in PROMPTS:
        first = first_divergence(f32, q16, f32.tokenizer.encode(prompt))
        if first is not None and first[1] >= 0.05:
            misses[prompt] = first
    assert not misses, f"first divergence (step, f32 top-2 gap) at or above 0.05: {misses}"
