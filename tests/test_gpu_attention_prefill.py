"""flash_attn_bf16 on the gpu backend (tensor-core prefill, attention_prefill.cu) against the op's reference.

Two runners, as in test_gpu_attention.py: "rule" calls lower_flash_attn_bf16 on fixed device buffers
(and checks which kernels it chose), "graph" lowers a one-node Graph through the whole backend.
Rows at and past kv_len hold 1e3 garbage, which the kernels must never read.

Tolerance (`close_bf16`). The reference rounds q, k, v and the softmax weights to bf16 exactly as
the kernel does, so they agree to f32 summation order, except where a weight lies within the f32
noise (tensor-core summation order, ex2.approx: ~1e-7..1e-6 relative) of a bf16 rounding boundary:
that weight then rounds one bf16 step (2^-8 of it) the other way, p ~ 1e-4 per weight. One flip moves
its row by ulp(w_j) / W * |v_j - out|: at most ~2^-9 |v_0 - v_1| in a row of two keys (~4e-3 of
max |ref|), ~2^-8 * w_j / W * |v_j - out| in longer ones. So: every element within 1e-2 of max |ref|,
and all (query, head) rows but 2 + 0.5 % within 1e-4 of it (rows with a flip of a weight above ~7 %
of their sum; expected well under 0.1 %). A wrong mask, tile or fragment moves most rows by far more
(one key too many in a row of 300 keys moves it by ~1e-3 of max |ref|); so does a dropped rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
from _attention_cases import GARBAGE, AttentionCase, GraphRunner, RuleRunner
from _gpu_helpers import host
from graphir.backends.registry import get_backend

import graphir
from graphir.errors import BackendError

try:
    from graphir.backends.gpu.device import available
except ImportError:  # pragma: no cover - the package always has it; keep collection safe
    def available() -> bool:
        return False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(), reason="no CUDA/HIP device")]


def _tensor_cores() -> bool:
    from graphir.backends.gpu.device import tensor_cores

    return available() and tensor_cores()


# The kernel's tests; without bf16 tensor cores flash_attn_bf16 runs the f32 kernel (test_without_tensor_cores_*).
tensor_cores = pytest.mark.skipif(not _tensor_cores(), reason="no bf16 tensor cores here (HIP or below sm_80)")

MAX_REL = 1e-2  # of max |ref|, any element (a flipped weight in a row of two keys: ~4e-3)
ROW_REL = 1e-4  # of max |ref|, every (query, head) row but a few (flipped weights of short rows)


class Case(AttentionCase):
    op = "flash_attn_bf16"


_host = host


@pytest.fixture(params=["rule", "graph"])
def runner(request):
    return {"rule": RuleRunner, "graph": GraphRunner}[request.param]


def close_bf16(got, want):
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.isfinite(got).all(), "non-finite output"
    scale = max(float(np.abs(want).max()), 1e-30)
    err = np.abs(got.astype(np.float64) - want) / scale
    assert err.max() <= MAX_REL, f"max error {err.max():.3g} of max |ref| > {MAX_REL}"
    rows = err.reshape(-1, want.shape[-1]).max(axis=1)
    off = int((rows > ROW_REL).sum())
    allowed = 2 + rows.size // 200
    assert off <= allowed, (f"{off} of {rows.size} (query, head) rows off by > {ROW_REL} of max |ref| (worst "
                            f"{rows.max():.3g}); rounding flips explain at most {allowed}")


def _kernels(kvdtype, d, dv):
    dk = 64 if max(d, dv) <= 64 else 128 if max(d, dv) <= 128 else 256
    return [f"attn_kv_bf16_{kvdtype}", f"attn_prefill_bf16_d{dk}"]


def _check_kernels(run, case):
    if isinstance(run, RuleRunner):
        assert run.kernels == _kernels(case.kvdtype, case.d, case.dv), run.kernels


# ---------------------------------------------------------------- shapes
@tensor_cores
@pytest.mark.parametrize("n_q", [1, 7, 33, 63, 64, 65, 127, 129, 511, 1025])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
def test_prefill_from_empty_cache(runner, n_q, group, d, kvdtype):
    """The prompt's first chunk: positions 0..n-1, kv_len n; n on either side of the 16-row m-tiles, the 32 rows
    of a warp and the 128-row blocks (16 * MT * WARPS), and of the 64-key tiles."""
    hk = 2 if n_q <= 130 else 1
    case = Case(n_q, hk * group, hk, d, d, n_q + 37, kvdtype)
    run = runner(case)
    _check_kernels(run, case)
    rng = np.random.default_rng(n_q * 100 + group * 10 + d)
    q, k, v = case.data(rng, n_q)
    pos = np.arange(n_q, dtype=np.int32)
    close_bf16(run(q, k, v, pos, n_q), case.ref(q, k, v, pos, n_q))


@tensor_cores
@pytest.mark.parametrize("n_q,start", [(7, 300), (130, 61), (511, 1000), (64, 64)])
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
def test_prefill_after_earlier_chunk(runner, n_q, start, kvdtype):
    """A later chunk: positions start..start+n-1 over `start` cached rows, kv_len = start + n > n."""
    case = Case(n_q, 8, 2, 128, 128, start + n_q + 5, kvdtype)
    run = runner(case)
    rng = np.random.default_rng(start + n_q)
    kv_len = start + n_q
    q, k, v = case.data(rng, kv_len)
    pos = np.arange(start, kv_len, dtype=np.int32)
    close_bf16(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


@tensor_cores
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
def test_prefill_4096(kvdtype):
    """Qwen3-8B's bench length and head dim, one GQA group of 8."""
    case = Case(4096, 8, 1, 128, 128, 4096, kvdtype)
    run = RuleRunner(case)
    rng = np.random.default_rng(4096)
    q, k, v = case.data(rng, 4096)
    pos = np.arange(4096, dtype=np.int32)
    close_bf16(run(q, k, v, pos, 4096), case.ref(q, k, v, pos, 4096))


# ---------------------------------------------------------------- head dim 256 (Qwen3.5, Gemma 3)
@tensor_cores
@pytest.mark.parametrize("n_q", [7, 65, 511])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("start", [0, 300])
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
def test_prefill_d256(runner, n_q, group, start, kvdtype):
    """attn_prefill_bf16_d256 (Q in shared memory, 32-key tiles): a chunk at positions start..start+n-1,
    kv_len = start + n (> n past the first chunk), capacity beyond it."""
    hk = 2 if n_q <= 65 else 1
    kv_len = start + n_q
    case = Case(n_q, hk * group, hk, 256, 256, kv_len + 21, kvdtype)
    run = runner(case)
    _check_kernels(run, case)
    rng = np.random.default_rng(n_q * 100 + group * 10 + start)
    q, k, v = case.data(rng, kv_len)
    pos = np.arange(start, kv_len, dtype=np.int32)
    close_bf16(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


@tensor_cores
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
def test_prefill_4096_d256(kvdtype):
    """Qwen3.5's head dim and GQA group (16 q heads over 4 kv heads; one group here) at its bench length."""
    case = Case(4096, 4, 1, 256, 256, 4096, kvdtype)
    run = RuleRunner(case)
    _check_kernels(run, case)
    rng = np.random.default_rng(4097)
    q, k, v = case.data(rng, 4096)
    pos = np.arange(4096, dtype=np.int32)
    close_bf16(run(q, k, v, pos, 4096), case.ref(q, k, v, pos, 4096))


@tensor_cores
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
def test_gemma3_sliding_window_d256(kvdtype):
    """Gemma 3's local layers: head dim 256, 4 q heads over 1 kv head, 512-key window; a 1025-token prompt
    (the window slides over 32-key tiles, early tiles skipped), then a later chunk past the window."""
    case = Case(1025, 4, 1, 256, 256, 1700, kvdtype, window=512)
    run = RuleRunner(case)
    _check_kernels(run, case)
    rng = np.random.default_rng(512)
    for start in (0, 675):
        kv_len = start + 1025
        q, k, v = case.data(rng, kv_len)
        pos = np.arange(start, kv_len, dtype=np.int32)
        close_bf16(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


def _positions(rng, n_q, kv_len):
    """Out of order and repeated; some past kv_len, one at 0, one at -1 (sees nothing)."""
    pos = rng.integers(0, kv_len + 3, n_q).astype(np.int32)
    pos[:4] = [kv_len - 1, 0, kv_len // 2, -1]
    pos[4] = pos[0]
    return pos


@tensor_cores
@pytest.mark.parametrize("window", [0, 5, 100])
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_arbitrary_positions_and_window(runner, window, kvdtype, d):
    """Positions need not be a run: every row masks by its own position; windows skip early tiles."""
    case = Case(150, 8, 2, d, d, 400, kvdtype, window)
    run = runner(case)
    rng = np.random.default_rng(window + 1)
    for kv_len in (1, 63, 64, 65, 300, 400):
        q, k, v = case.data(rng, kv_len)
        pos = _positions(rng, 150, kv_len)
        close_bf16(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))
    q, k, v = case.data(rng, 400)  # a causal chunk late in a long cache, the window far from row 0
    pos = np.arange(250, 400, dtype=np.int32)
    close_bf16(run(q, k, v, pos, 400), case.ref(q, k, v, pos, 400))


@tensor_cores
@pytest.mark.parametrize("n_q", [1, 33, 63, 129, 511, 1025])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [40, 300])
def test_prefill_sliding_window(n_q, group, d, window):
    """A prompt's chunks under a sliding window (Gemma 3's local layers, Mistral): from an empty cache, then at
    positions past the window. Each 128-row block starts at the first key its rows see, so its key tiles start
    off the 64-key grid, and the rows of one warp (32) see different first keys: tiles skipped, and masked at
    both ends of a row's range."""
    hk = 2
    case = Case(n_q, hk * group, hk, d, d, n_q + 700, "f16", window=window)
    run = RuleRunner(case)
    _check_kernels(run, case)
    rng = np.random.default_rng(n_q + window + d)
    for start in (0, 650):
        kv_len = start + n_q
        q, k, v = case.data(rng, kv_len)
        pos = np.arange(start, kv_len, dtype=np.int32)
        close_bf16(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


@tensor_cores
@pytest.mark.parametrize("hq,hk,d,dv", [(4, 2, 64, 32), (6, 1, 6, 10), (2, 1, 96, 128), (3, 3, 80, 80),
                                        (12, 1, 128, 120), (4, 1, 136, 256), (6, 2, 250, 130)])
def test_head_shapes(runner, hq, hk, d, dv):
    """dv != d, odd and non-power-of-two head dims (zero-padded to DK 64, 128 or 256), GQA groups 2, 3, 4, 6, 12."""
    case = Case(70, hq, hk, d, dv, 333, "f16")
    run = runner(case)
    _check_kernels(run, case)
    rng = np.random.default_rng(d + dv)
    for kv_len in (70, 333):
        q, k, v = case.data(rng, kv_len)
        pos = np.arange(kv_len - 70, kv_len, dtype=np.int32)
        close_bf16(run(q, k, v, pos, kv_len), case.ref(q, k, v, pos, kv_len))


@tensor_cores
@pytest.mark.parametrize("kvdtype,offset", [("f16", 1), ("f32", 1), ("f16", 4)])
def test_unaligned_kv(kvdtype, offset):
    """K/V at any element offset: the conversion kernel loads elements, the tiles read the aligned scratch."""
    case = Case(100, 4, 2, 64, 64, 150, kvdtype)
    run = RuleRunner(case, kv_offset=offset)
    rng = np.random.default_rng(offset)
    q, k, v = case.data(rng, 150)
    pos = np.arange(50, 150, dtype=np.int32)
    close_bf16(run(q, k, v, pos, 150), case.ref(q, k, v, pos, 150))


@tensor_cores
@pytest.mark.parametrize("d", [128, 256])
def test_replay_many_kv_len(d):
    """One lowered program, many contexts and chunk starts (tile boundaries of the keys and the queries)."""
    case = Case(65, 8, 2, d, d, 1100, "f32")
    run = RuleRunner(case)
    rng = np.random.default_rng(11)
    q, k, v = case.data(rng, 1100)
    for kv_len in (65, 66, 95, 96, 97, 127, 128, 129, 191, 192, 193, 640, 1100):
        k2, v2 = k.copy(), v.copy()
        k2[kv_len:], v2[kv_len:] = GARBAGE, -GARBAGE
        pos = np.arange(kv_len - 65, kv_len, dtype=np.int32)
        close_bf16(run(q, k2, v2, pos, kv_len), case.ref(q, k2, v2, pos, kv_len))


@tensor_cores
def test_no_visible_key_gives_zero(runner):
    case = Case(9, 4, 1, 64, 64, 16, "f32", window=5)
    run = runner(case)
    rng = np.random.default_rng(2)
    q, k, v = case.data(rng, 10)
    pos = np.full(9, 30, np.int32)  # sees 26..30, but only 0..9 are valid
    pos[1] = -1  # sees nothing at all
    np.testing.assert_array_equal(run(q, k, v, pos, 10), 0.0)
    np.testing.assert_array_equal(run(q, k, v, np.arange(9, dtype=np.int32), 0), 0.0)  # kv_len 0


@tensor_cores
def test_kv_len_past_capacity_raises(runner):
    case = Case(9, 4, 2, 64, 64, 37, "f32")
    run = runner(case)
    rng = np.random.default_rng(4)
    q, k, v = case.data(rng, 37)
    pos = np.arange(28, 37, dtype=np.int32)
    with pytest.raises(BackendError, match=r"flash_attn_bf16: kv_len 38 outside 0\.\.37 \(the KV capacity\)"):
        run(q, k, v, pos, 38)
    with pytest.raises(BackendError, match=r"kv_len -1 outside 0\.\.37"):
        run(q, k, v, pos, -1)
    close_bf16(run(q, k, v, pos, 37), case.ref(q, k, v, pos, 37))  # the program still works afterwards


@tensor_cores
def test_d256_without_the_shared_memory_takes_the_f32_kernel(monkeypatch):
    """A GPU that cannot give attn_prefill_bf16_d256 its dynamic shared memory (here: asked for 1 MiB) lowers
    with the f32 kernel: attention without the op's roundings, off its reference by about their cost."""
    from graphir.backends.gpu import attention

    monkeypatch.setattr(attention, "_tc_dynamic_shared", lambda dk: 1 << 20 if dk == 256 else 0)
    case = Case(70, 4, 2, 256, 256, 100, "f16")
    run = RuleRunner(case)
    assert run.kernels == ["attn_prefill_f16_d256_g4"], run.kernels
    rng = np.random.default_rng(256)
    q, k, v = case.data(rng, 100)
    pos = np.arange(30, 100, dtype=np.int32)
    want = case.ref(q, k, v, pos, 100)
    got = run(q, k, v, pos, 100)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


def test_without_tensor_cores_falls_back_to_f32(monkeypatch):
    """HIP and GPUs below sm_80 lower flash_attn_bf16 with the f32 prefill kernel: attention without the op's
    roundings, off its reference by about their cost (4e-3 of max |ref| here)."""
    from graphir.backends.gpu import attention

    monkeypatch.setattr(attention, "tensor_cores", lambda: False)
    case = Case(70, 8, 2, 128, 128, 100, "f32")
    run = RuleRunner(case)
    assert run.kernels == ["attn_prefill_f32_d128_g4"], run.kernels
    rng = np.random.default_rng(70)
    q, k, v = case.data(rng, 100)
    pos = np.arange(30, 100, dtype=np.int32)
    want = case.ref(q, k, v, pos, 100)
    assert np.abs(run(q, k, v, pos, 100) - want).max() <= 1e-2 * np.abs(want).max()


# ---------------------------------------------------------------- m-tiles; the bf16 output for a GEMM
@pytest.fixture
def recompile(monkeypatch):
    """recompile(*defines, **mirrors): attention_prefill.cu compiled with `defines` for the Launches lowered from
    now on, attention.py's mirrors (TC_MT, ...) set to match; the default module again after the test."""
    from graphir.backends.gpu import attention, kernels

    def use(*defines: str, **mirrors) -> None:
        monkeypatch.setitem(kernels.SOURCES, attention.TC_FILE, defines)
        for name, value in mirrors.items():
            monkeypatch.setattr(attention, name, value)
        kernels.clear()  # Launches made before keep their compiled kernels

    yield use
    kernels.clear()  # monkeypatch restores SOURCES next; the module is compiled again on use


@tensor_cores
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_two_m_tiles_bitwise_as_one(recompile, d, group):
    """ATTN_TC_MT=2 (32 rows a warp, each K and V fragment feeding both m-tiles; Q in shared memory at d 128)
    gives bitwise the output of the default ATTN_TC_MT=1 (16 rows a warp, Q in registers): the
    same products and sums of every row in the same order. Window 0, so every block's key tiles start at key 0
    (with a window a block's tiles start at the first key its rows see, which depends on the rows it holds)."""
    n_q, cap = 300, 700
    case = Case(n_q, 2 * group, 2, d, d, cap, "f16")
    one = RuleRunner(case)  # the default build
    recompile("ATTN_TC_MT=2", TC_MT=2)
    two = RuleRunner(case)
    rng = np.random.default_rng(d + group)
    for start, kv_len in ((0, n_q), (cap - n_q, cap), (37, 600)):
        q, k, v = case.data(rng, kv_len)
        for pos in (np.arange(start, start + n_q, dtype=np.int32), _positions(rng, n_q, kv_len)):
            got = two(q, k, v, pos, kv_len)
            np.testing.assert_array_equal(got, one(q, k, v, pos, kv_len), err_msg=f"start {start}, kv_len {kv_len}")
            close_bf16(got, case.ref(q, k, v, pos, kv_len))


def _f32_to_bf16(x):
    """f32 -> bf16 bits as common.cuh's f32_to_bf16 (the GEMM's cast kernel): nearest even, NaN kept NaN."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, rounded).astype(np.uint16)


class TwinRunner(RuleRunner):
    """The rule where only bf16 GEMMs read the output: matmul.bf16_twin hands it a uint16 buffer (0xffff, which
    no rounding gives, until the kernel writes it). Returns (the f32 output, NaN unless written; the bits)."""

    def __init__(self, case, monkeypatch):
        import cupy as cp
        from graphir.backends.gpu import matmul

        self.twin = cp.full((case.n_q, case.hq, case.dv), 0xFFFF, np.uint16)
        with monkeypatch.context() as m:
            m.setattr(matmul, "bf16_twin", lambda lw, n, k, like: self.twin if like.shape == self.twin.shape else None)
            super().__init__(case)

    def __call__(self, *args):
        out = super().__call__(*args)
        return out, self.twin.get()


@tensor_cores
@pytest.mark.parametrize("n_q", [1, 65, 300])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window", [0, 37])
def test_bf16_output_is_the_f32_output_rounded(monkeypatch, n_q, d, window):
    """attn_prefill_bf16_d<DK>_obf16 writes f32_to_bf16 of exactly the value attn_prefill_bf16_d<DK> stores (so
    the o-projection reads bitwise what the cast kernel would give it), every element, and leaves `out` alone."""
    case = Case(n_q, 8, 2, d, d, n_q + 400, "f32", window=window)
    plain, twin = RuleRunner(case), TwinRunner(case, monkeypatch)
    dk = _kernels("f32", d, d)[1]
    assert plain.kernels[1] == dk and twin.kernels[1] == dk + "_obf16", twin.kernels
    rng = np.random.default_rng(n_q + d + window)
    for kv_len in (n_q, n_q + 400):
        q, k, v = case.data(rng, kv_len)
        pos = np.arange(kv_len - n_q, kv_len, dtype=np.int32)
        want = plain(q, k, v, pos, kv_len)
        out, bits = twin(q, k, v, pos, kv_len)
        assert np.isnan(out).all(), "the f32 output was written"
        np.testing.assert_array_equal(bits, _f32_to_bf16(want))
        close_bf16(want, case.ref(q, k, v, pos, kv_len))


@tensor_cores
def test_o_projection_reads_the_bf16_output(monkeypatch):
    """flash_attn_bf16 -> reshape -> mul_mat_bf16 (the o-projection), through the whole backend: the attention
    kernel writes bf16 for the GEMM (attn_prefill_bf16_d128_obf16, no cast kernel), and the product is bitwise
    that of the f32 output cast by cast_f32_bf16 (GRAPHIR_NO_BF16_TWINS=1)."""
    from graphir import g
    from graphir.ir import Graph
    from graphir.ops.fused import bf16_round
    from graphir.weights import Weight, Weights

    n_q, hq, hk, d, cap, n_out = 300, 8, 2, 128, 400, 96
    case = Case(n_q, hq, hk, d, d, cap, "f16")
    att = case.graph.outputs["out"]
    wo = g.param("wo", (n_out, hq * d), "bf16")
    graph = Graph({"y": g.mul_mat_bf16(wo, g.reshape(att, shape=(n_q, hq * d)))})
    rng = np.random.default_rng(5)
    w = bf16_round(rng.standard_normal((n_out, hq * d)).astype(np.float32) * 0.05)
    weights = Weights({"wo": Weight("bf16", w.shape, (w.view(np.uint32) >> np.uint32(16)).astype(np.uint16))})
    q, k, v = case.data(rng, cap)
    pos = np.arange(cap - n_q, cap, dtype=np.int32)
    runs = {}
    for twins in (True, False):
        monkeypatch.setenv("GRAPHIR_NO_BF16_TWINS", "0" if twins else "1")
        program = get_backend("gpu").lower(graph, weights)
        y = host(program(case.feeds(q, k, v, pos, cap))["y"])
        runs[twins] = y, [getattr(st, "name", "") for st in program._steps]
    (got, names), (want, plain_names) = runs[True], runs[False]
    assert "attn_prefill_bf16_d128_obf16" in names and not any(nm.startswith("cast_f32_bf16") for nm in names), names
    assert "attn_prefill_bf16_d128" in plain_names and any(nm.startswith("cast_f32_bf16") for nm in plain_names)
    np.testing.assert_array_equal(got, want)
    ref = bf16_round(case.ref(q, k, v, pos, cap).reshape(n_q, hq * d)).astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max()


# ---------------------------------------------------------------- a whole model
@tensor_cores
def test_qwen3_tiny_prefill_passes_replay_lint():
    """No launch of the lowered prefill (the bf16 K/V scratch, the kernels' grids) depends on an Input's value."""
    from graphir.backends.gpu.replay_lint import launches, lint

    from graphir.passes import run_pipeline

    model = graphir.load("random:qwen3-tiny", backend="gpu", passes="default", ctx=64)
    graph = run_pipeline(model.graph("prefill", 24, last_only=True), "default,attn-bf16")
    program = get_backend("gpu").lower(graph, model.weights)
    assert lint(program, get_backend("gpu").new_state(graph)) == []
    names = [launch[0] for launch in launches(program)]
    assert names.count("attn_prefill_bf16_d64") == model.config.n_layers, names


@tensor_cores
def test_qwen3_tiny_with_attn_bf16():
    """random:qwen3-tiny, prompt chunks of more than 16 tokens (later chunks start past row 0): with the pass,
    the gpu meets the reference backend running the same pass (f32 differences and rare flips: 2e-3 of max
    |logit|), and it differs from the f32 graph by the rounding's cost (NMSE <= 1e-4, as tests/test_passes.py)."""
    ids = list(np.random.default_rng(0).integers(0, 256, 150))
    gpu = graphir.load("random:qwen3-tiny", backend="gpu", passes="default,attn-bf16", ctx=256)
    ref = graphir.load("random:qwen3-tiny", backend="reference", passes="default,attn-bf16", ctx=256)
    # the gpu's chunk plan ([128, 32], the last padded): a chunk of <= 16 tokens would keep f32 attention
    ref.prefill_buckets, ref.call_cost = gpu.prefill_buckets, gpu.call_cost
    f32 = graphir.load("random:qwen3-tiny", backend="gpu", passes="default", ctx=256)
    got, want, exact = gpu.logits(ids), ref.logits(ids), f32.logits(ids)
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= 2e-3 * scale
    assert ((got - exact) ** 2).sum() / (exact * exact).sum() <= 1e-4
    assert np.abs(got - exact).max() > 1e-4 * scale  # the roundings happened: the pass reached the gpu


def _d256_model(family: str, backend: str, passes: str):
    """A tiny random model with the real head shape: head dim 256, 4 q heads over 1 kv head (Gemma 3 270M,
    Qwen3.5's GQA group). gemma3: sliding windows of 40 keys and a global layer; qwen35: one attention layer
    among delta-rule ones."""
    import dataclasses

    from graphir.models import gemma3, presets, qwen35

    from graphir.api import Model

    module, extra = (gemma3, {"sliding_window": 40}) if family == "gemma3" else (qwen35, {})
    config = dataclasses.replace(module.PRESETS[f"{family}-tiny"][0], head_dim=256, n_kv_heads=1, **extra)
    model = Model(config, module.random_weights(config), presets.ByteTokenizer(), backend=backend, passes=passes)
    # one chunk plan on every backend: calls of <= 4 tokens keep f32 attention, so two plans would mix
    # the bf16 rounding differently and the comparison would measure the plans, not the kernel
    model.prefill_buckets, model.call_cost = (128, 32, 8, 1), 3
    return model


@tensor_cores
@pytest.mark.parametrize("family", ["gemma3", "qwen35"])
def test_d256_model_with_attn_bf16(family):
    """Every attention layer (sliding and global) takes attn_prefill_bf16_d256; the logits meet the reference
    backend running the same pass (2e-3 of max |logit|, as test_qwen3_tiny_with_attn_bf16) and differ from the
    f32 graph by the rounding's cost (on the reference backend: 7e-3 of max |logit| for gemma3, 6e-4 qwen35)."""
    from graphir.backends.gpu.replay_lint import launches, lint

    from graphir.passes import run_pipeline

    gpu = _d256_model(family, "gpu", "default,attn-bf16")
    graph = run_pipeline(gpu.graph("prefill", 64, last_only=True), "default,attn-bf16")
    program = get_backend("gpu").lower(graph, gpu.weights)
    assert lint(program, get_backend("gpu").new_state(graph)) == []  # binds the Program (it holds State)
    names = [launch[0] for launch in launches(program)]
    n_attn = sum(nd.op == "flash_attn_bf16" for nd in graph.nodes())
    assert n_attn >= 1 and names.count("attn_prefill_bf16_d256") == n_attn, names
    ids = list(np.random.default_rng(1).integers(0, 256, 150))
    got = gpu.logits(ids)
    want = _d256_model(family, "reference", "default,attn-bf16").logits(ids)
    exact = _d256_model(family, "gpu", "default").logits(ids)
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= 2e-3 * scale
    assert ((got - exact) ** 2).sum() / (exact * exact).sum() <= 1e-4
    assert np.abs(got - exact).max() > 1e-4 * scale  # the roundings happened: the pass reached the gpu
