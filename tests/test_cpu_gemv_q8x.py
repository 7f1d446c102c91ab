"""mul_mat_q8x on the cpu (backends/cpu/gemv_q8x.py) against numpy formulas of the same integer arithmetic.

The independent formula reads the weight's blocks with gguf-py's layout constants (d, q4_1's m, the codes) and
x's codes from gguf-py's own q8_0 quantizer, takes each block's integer sums in int64 and the rest in float64.
The kernel's float order (its module docstring) rounds each block's d_w * d_x (and q4_1's sx = d_x * sum q),
then each exact block sum times it by one fma into one of 4 lanes (nquad = ceil(nblk / 4) fmas a lane), then
adds 3 times (the lanes, q4_1's offsets): each of the n_in / 32 block terms is rounded at most nquad + 5 times,
so |error| <= (nquad + 6) 2^-24 sum |terms| (one more for the second-order part of gamma_n). The AVX2 and
portable paths must agree bit for bit.

On SmolLM2 (slow, skipped without its weights) the whole model through q8-activations is checked two ways: against
a bound on how often and how far its greedy picks leave the f32 path's (met), and against issue 13's greedy rule
itself (missed on the haiku prompt on AVX2 machines, at the rule's edge: the test pins that miss). Why no variant
of the pass meets the rule: the 8-bit path moves the f32 path's top-2 logit margin by a median 0.066, above the
rule's 0.05 (BENCHMARKS.md, "q8-activations against issue 13's greedy rule").
"""

from __future__ import annotations

import numpy as np
import pytest

from graphir import g
from graphir.errors import BackendError
from graphir.ops import OPS
from graphir.ops.fused import q8_blocks
from graphir.passes import coverage
from graphir.quant import dequantize, random_quantized

gguf = pytest.importorskip("gguf")
from graphir.backends.cpu import gemv_q8x as GQ  # noqa: E402

SHAPES = [(n_out, n_in, (1, 3, 16)[(i + j) % 3]) for i, n_out in enumerate((1, 7, 511, 1025))
          for j, n_in in enumerate((32, 64, 576, 1536))]  # every n_out with every n_in, x's rows rotating


def activations(m: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Normal values with an outlier, an all-zero block (scale 0) where there are two blocks, and q8_blocks'
    rounding cases in a block whose max is 127 (scale 1)."""
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    x[0, -1] = 40.0
    if n_in >= 64:
        x[-1, 32:64] = 0.0
    x[0, :7] = [127.0, 2.5, -2.5, 0.5, -0.5, 0.49999997, -126.5]
    return x


def blocks_of(raw: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d, m, codes) float64 [rows, nblk], [rows, nblk], int64 [rows, nblk, 32] from ggml's block layout
    (q4_0's codes with the 8 taken off, m = 0 where the format has none)."""
    _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[dtype.upper()]]  # (values, bytes) a block
    b = raw.reshape(raw.shape[0], -1, size)
    f16 = lambda lo: b[..., lo:lo + 2].copy().view(np.float16)[..., 0].astype(np.float64)  # noqa: E731
    if dtype == "q8_0":
        return f16(0), np.zeros(b.shape[:2]), b[..., 2:].copy().view(np.int8).astype(np.int64)
    qs = b[..., -16:].astype(np.int64)
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
    return (f16(0), f16(2), codes) if dtype == "q4_1" else (f16(0), np.zeros(b.shape[:2]), codes - 8)


def exact_terms(raw: np.ndarray, dtype: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y in float64 [m, n_out], the sum of |terms| [m, n_out]): y = sum_b d_w d_x (sum c q) + m_w d_x (sum q)."""
    d, mn, c = blocks_of(raw, dtype)
    n = x.shape[0]
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(n, -1, 34)[..., 2:].copy().view(np.int8)
    q = q.astype(np.int64)  # [m, nblk, 32]
    dx = (np.abs(x).reshape(n, -1, 32).max(axis=-1) / np.float32(127)).astype(np.float64)  # [m, nblk]
    isum = np.einsum("obi,tbi->tob", c, q)  # exact integers, [m, n_out, nblk]
    qsum = q.sum(axis=-1)[:, None, :]
    scale, offset = d[None] * dx[:, None], mn[None] * dx[:, None] * qsum
    return (scale * isum + offset).sum(-1), (np.abs(scale * isum) + np.abs(offset)).sum(-1)


def run_kernel(raw, dtype, x, path):
    y = np.full((x.shape[0], raw.shape[0]), np.nan, np.float32)
    run = GQ.prepare(raw, dtype, x, y, {}, ("param", "w"), path=path)
    run()
    return y


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("n_out,n_in,m", SHAPES)
def test_kernel_matches_the_integer_formula(dtype, n_out, n_in, m, rng):
    raw = random_quantized(rng, dtype, (n_out, n_in))
    x = activations(m, n_in, rng)
    want, size = exact_terms(raw, dtype, x)
    paths = ["avx2", "portable"] if GQ.AVX2 else ["portable"]
    got = {p: run_kernel(raw, dtype, x, p) for p in paths}
    nquad = (n_in // 32 + 3) // 4
    bound = (nquad + 6) * 2.0 ** -24 * size + 1e-30
    for p, y in got.items():
        err = np.abs(y - want)
        assert (err <= bound).all(), f"{p}: max error {err.max():.3g}, {(err > bound).sum()} outputs past the bound"
    assert all(np.array_equal(y, got["portable"]) for y in got.values())  # the same float order


def test_x_codes_are_q8_blocks_bit_for_bit(rng):
    x = activations(3, 96, rng)
    x[1, 32:38] = [1e-37, -3e-38, 0.0, 0.0, 0.0, 0.0]  # a block whose scale is below 2^-126: codes 0
    x[1, 38:64] = 0.0
    xq, dx, sx = np.ones((3, 128), np.int8), np.empty((3, 4), np.float32), np.empty((3, 4), np.float32)
    GQ.quantize_x(x, xq, dx, sx)
    q, d = q8_blocks(x)
    assert np.array_equal(xq[:, :96], q) and not xq[:, 96:].any()
    assert np.array_equal(dx[:, :3], d) and not dx[:, 3].any()
    assert np.array_equal(sx[:, :3], (d * q.reshape(3, 3, 32).sum(-1).astype(np.float32)))
    assert not xq[1, 32:64].any() and dx[1, 1] > 0


def test_q4_1_reference_is_the_integer_formula(rng):
    """The op's reference (dequantized d c + m, summed in float64) against the formula from the raw blocks:
    one f32 rounding of the float64 sum, plus float64's own (n_in / 32 terms)."""
    for n_out, n_in, m in [(7, 64, 3), (33, 1536, 1)]:
        raw = random_quantized(rng, "q4_1", (n_out, n_in))
        x = activations(m, n_in, rng)
        want, size = exact_terms(raw, "q4_1", x)
        got = OPS["mul_mat_q8x"].ref(dequantize(raw, "q4_1", (n_out, n_in)), x)
        assert (np.abs(got - want) <= 2.0 ** -24 * np.abs(want) + n_in * 2.0 ** -52 * size + 1e-30).all()
        assert np.abs(got - x.astype(np.float64) @ dequantize(raw, "q4_1", (n_out, n_in)).T).max() > 1e-4


@pytest.mark.skipif(not GQ.AVX2, reason="numba does not compile for AVX2 here: the portable path runs")
def test_avx2_kernel_emits_packed_integer_multiply_adds(rng):
    run_kernel(random_quantized(rng, "q4_1", (7, 64)), "q4_1", activations(1, 64, rng), "avx2")
    asm = GQ.asm("avx2")
    assert "vpmaddubsw" in asm and "vpmaddwd" in asm and "vpsignb" in asm


def test_gpu_lowering_refuses_q4_1_naming_the_node():
    from graphir.backends.gpu.gemv_q8x import lower_mul_mat_q8x
    from graphir.backends.gpu.launch import GpuParam

    w = GpuParam.__new__(GpuParam)  # no device here: the check comes before anything touches one
    w.dtype, w.shape = "q4_1", (8, 64)
    node = g.mul_mat_q8x(g.param("w", (8, 64), "q4_1"), g.input("x", (1, 64)), name="blk.0.attn_q")
    with pytest.raises(BackendError, match=r"blk\.0\.attn_q.*q4_1 has no gpu kernel.*cpu backend.*q4_0 / q8_0"):
        lower_mul_mat_q8x(None, node, [w, None], [None], {})


PROMPTS = [  # tests/test_smollm2.py's parity prompts
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smollm2():
    import graphir

    try:
        return (graphir.load("smollm2-135m", backend="cpu", passes="default"),
                graphir.load("smollm2-135m", backend="cpu", passes="default,q8-activations"))
    except graphir.LoadError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_smollm2_q8x_picks_the_f32_token_but_at_near_ties(smollm2):
    """SmolLM2 (q4_1 layers, q8_0 head) through q8-activations on the cpu, fed the f32 path's own greedy tokens
    for 16 steps on each parity prompt: the 8-bit path picks the f32 path's token at 44 of the 48 steps or
    more, and where it picks another, that token's f32 logit is within 0.5 of the top one's, below the median
    per-step logit movement of the 8-bit path on this file (0.64, BENCHMARKS.md), and no logit moves by more than
    2.6 (twice llama.cpp's own ~1.3 on this file, issue 13).

    Not issue 13's greedy rule (16 equal greedy tokens, or a first divergence at an f32 top-2 gap below 0.05;
    test_smollm2_q8x_misses_issue_13_rule_by_small_gaps below): the 8-bit path misses it at small f32 gaps (the
    haiku prompt at 0.059, reported in BENCHMARKS.md; France at 0.22 with 1e7b41f's attention order). (Before
    link_private.py a process that compiled the f32 kernels and one that loaded them from numba's cache computed
    ~3e-5 apart, and a cold process also diverged on France, at a 0.22 gap; cold and warm are now the same bits.)
    Measured 2026-12-01 (AMD EPYC, AVX2): 47 of 48 agree, cold and warm; largest logit movement 1.02."""
    f32, q8x = smollm2
    report = coverage(q8x.graph("decode"), "default,q8-activations")["q8-activations"]
    assert len(report.matched) == 30 * 4 + 1 and not report.rejected  # q|k|v, o, gate|up, down a layer; the head
    agree, moved = 0, 0.0
    for prompt in PROMPTS:
        ids = f32.tokenizer.encode(prompt)
        f32.reset()
        q8x.reset()
        lf, lq = f32.feed(ids)[-1], q8x.feed(ids)[-1]
        for step in range(16):
            want, got = int(np.argmax(lf)), int(np.argmax(lq))
            moved = max(moved, float(np.abs(lf - lq).max()))
            agree += got == want
            assert lf[want] - lf[got] < 0.5, f"{prompt!r} step {step}: picked {got}, f32 logit {lf[got]} vs {lf[want]}"
            lf, lq = f32.feed([want])[-1], q8x.feed([want])[-1]
    assert agree >= 44 and moved <= 2.6, (agree, moved)


def first_divergence(f32, fast, ids: list[int], n: int = 16) -> tuple[int, float] | None:
    """Where `fast`'s greedy text first differs from `f32`'s within n tokens, as (step, the f32 path's top-2
    logit gap there), or None if all n agree. Up to that step both have seen the same tokens."""
    f32.reset()
    fast.reset()
    lf, lq = f32.feed(ids)[-1], fast.feed(ids)[-1]
    for step in range(n):
        want, got = int(np.argmax(lf)), int(np.argmax(lq))
        if got != want:
            top2 = np.sort(lf)[-2:]
            return step, float(top2[1] - top2[0])
        lf, lq = f32.feed([want])[-1], fast.feed([want])[-1]
    return None


HAIKU = PROMPTS[2]


@pytest.mark.slow
def test_smollm2_q8x_misses_issue_13_rule_by_small_gaps(smollm2):
    """Issue 13's parity rule for the 8-bit path: on each parity prompt the greedy text through q8-activations
    equals the f32 path's for 16 tokens, or first differs where the f32 path's top-2 logit gap is below 0.05.
    The 8-bit path misses it (the reason the cpu pipeline rounds x to 16 bits instead), but only at gaps below
    the 0.5 that bounds its per-step picks (the test above): a wrong block, scale or operand parts at gaps of the
    logits' own size. Which prompts miss follows the last bits of the f32 sums: the haiku at step 1 (gap 0.059)
    and, with 1e7b41f's per-query attention chunks (or, before link_private.py, in a cold process), "The capital
    of France is" at step 5 (gap 0.22), so the set is not pinned here."""
    f32, q8x = smollm2
    misses = {}
    for prompt in PROMPTS:
        first = first_divergence(f32, q8x, f32.tokenizer.encode(prompt))
        if first is not None and first[1] >= 0.05:
            misses[prompt] = first
    assert misses, "q8-activations now meets issue 13's rule on every parity prompt: revisit the cpu pipeline"
    assert all(gap < 0.5 for _step, gap in misses.values()), f"first divergence at a wide f32 gap: {misses}"
