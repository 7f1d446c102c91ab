"""The gpu backend: every op has a lowering, layouts, auto selection and errors (run everywhere),
and whole models against the reference backend (the GPU suite, marker `gpu`)."""

from __future__ import annotations

import numpy as np
import pytest
from _gpu_helpers import HAS_GPU, assert_rel_close, gpu_only, host
from graphir.backends.gpu import layout
from graphir.backends.gpu.lowering import has_rule
from graphir.backends.registry import get_backend, resolve_backend

import graphir
from graphir import g
from graphir.errors import BackendError, InputError
from graphir.ir import Graph
from graphir.ops import OPS


# ---------------------------------------------------------------- coverage and structure (no GPU needed)
def test_every_op_has_a_gpu_lowering():
    missing = sorted(name for name in OPS if not has_rule(name))
    assert not missing, f"ops with no gpu lowering (a Program must never fall back to the host): {missing}"


@pytest.mark.parametrize("shape,strides,want", [
    ((3, 4), (4, 1), True), ((3, 4), (1, 3), False), ((1, 4), (99, 1), True), ((4, 1), (1, 7), True),
    ((2, 3, 2), (0, 4, 1), False), ((0, 5), (1, 1), True), ((3, 4), (13, 2), False)])
def test_is_contiguous(shape, strides, want):
    assert layout.is_contiguous(shape, strides) is want


def test_views_to_copy_picks_only_non_contiguous_views():
    x = g.input("x", (3, 4, 5))
    keep = g.reshape(x, shape=(12, 5))  # contiguous: aliases
    moved = g.permute(x, axes=(2, 0, 1))  # a real permute: gathered
    unit = g.permute(g.input("y", (1, 4)), axes=(1, 0))  # moves a size-1 axis only: aliases
    graph = Graph({"a": g.add(keep, keep), "b": g.exp(moved), "c": g.exp(unit)})
    copies = layout.views_to_copy(graph)
    assert id(moved) in copies and id(keep) not in copies and id(unit) not in copies


@pytest.mark.parametrize("shape,strides,dims,out", [
    ((2, 3, 4), (12, 4, 1), [1, 1, 1, 24], [0, 0, 0, 1]),  # contiguous collapses to one axis
    ((2, 3, 4), (0, 4, 1), [1, 1, 2, 12], [0, 0, 0, 1]),  # broadcast outer axis stays separate
    ((5, 1, 7), (7, 0, 1), [1, 1, 1, 35], [0, 0, 0, 1]),  # size-1 axes drop out
    ((4, 6), (1, 4), [1, 1, 4, 6], [0, 0, 1, 4]),  # a transpose does not merge
])
def test_collapse(shape, strides, dims, out):
    assert layout.collapse(shape, strides, 4, "t") == (dims, out)


def test_collapse_refuses_too_many_axes():
    with pytest.raises(BackendError, match="at most 2"):
        layout.collapse((2, 3, 4), (1, 100, 1000), 2, "gather")


@pytest.mark.parametrize("fmt,shape,cfg", [
    ("bf16", (151936, 1024), "g32r2"),  # Qwen3-0.6B's LM head: many 2 KiB rows
    ("bf16", (4096, 1024), "g64r2"),
    ("f32", (49152, 576), "g32r2"),  # SmolLM2's LM head in f32
    ("f32", (3072, 576), "g64r2"),
    ("bf16", (2047, 1024), "g128r1"),  # too few rows
    ("bf16", (1024, 2048), "g128r1"),
    ("f16", (151936, 1184), "g128r1"),  # rows over SHORT_ROW_BYTES
    ("bf16", (151936, 4096), "g128r1"),
])
def test_decode_gemv_geometry_follows_the_rows(fmt, shape, cfg):
    """Float weights of many short rows take a geometry of several rows a warp (matmul.short_float_rows);
    the rest keep GEMV1_KERNEL's; an explicit variant wins; quantized formats never take the float rule."""
    from graphir.backends.gpu import matmul as mm

    n_out, n_in = shape
    assert mm.gemv_kernel(fmt, n_out, n_in, 1, 0)[0] == f"gemv1v2_{fmt}_{cfg}"
    assert mm.gemv_kernel(fmt, n_out, n_in, 1, 0, "g128r1")[0] == f"gemv1v2_{fmt}_g128r1"
    cfg_m = {"g128r1": "j32w4r4", "g64r2": "j32w2r4", "g32r2": "j32w1r4"}[cfg]  # the same row split (exact)
    assert mm.gemv_kernel(fmt, n_out, n_in, 2, 0)[0] == f"gemvm2_{fmt}_{cfg_m}"  # two tokens: not the m == 1 rule
    assert mm.gemv_kernel(fmt, n_out, n_in, 5, 0)[0] == f"gemvm4_{fmt}_{cfg_m}"  # 8-token bucket, 4 tokens a block
    assert mm.gemv_kernel(fmt, n_out, n_in, 9, 0)[0] == f"gemvm8_{fmt}_{cfg_m}"
    # quantized: the decode step's own kernel, a token a block (GEMVM_KERNEL "exact": matmul.decode_kernel_serves);
    # where that is gemv1_<fmt> (rows not of whole 16-byte pieces), gemv16_<fmt>, which adds in its order
    for q in ("q4_0", "q4_1"):
        one = mm.gemv_kernel(q, n_out, n_in, 1, 0)[0]
        assert mm.gemv_kernel(q, n_out, n_in, 9, 0)[0] == (f"gemv16_{q}" if one == f"gemv1_{q}" else one)
    assert mm.gemv_kernel(fmt, n_out, n_in - 4, 5, 0)[0] == f"gemv_{fmt}"  # rows not of whole 8-value units
    assert mm.gemv_kernel("q4_0", n_out, n_in, 1, 0) == mm.gemv_kernel("q4_0", 1, n_in, 1, 0)


def test_auto_backend_is_gpu_only_with_a_device():
    assert resolve_backend("auto") == ("gpu" if HAS_GPU else "cpu")
    assert resolve_backend("cpu") == "cpu"


def test_unknown_backend_lists_auto():
    with pytest.raises(BackendError, match="auto"):
        get_backend("tpu")


def test_missing_cupy_is_one_clear_line(monkeypatch):
    import builtins

    from graphir.backends.gpu import device

    real_import = builtins.__import__

    def no_cupy(name, *args, **kw):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kw)

    device.cupy.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_cupy)
    try:
        with pytest.raises(BackendError, match=r"pip install -e '\.\[gpu\]'") as e:
            get_backend("gpu")
        assert "\n" not in str(e.value)
        assert device.available() is False
    finally:
        monkeypatch.undo()
        device.cupy.cache_clear()


# ---------------------------------------------------------------- whole models (GPU suite)
REL = 1e-3  # of max |logit|: gpu vs reference (f32 math, different summation orders and fusions)
TINY = ["random:llama-tiny", "random:qwen3-tiny", "random:qwen2-tiny", "random:qwen35-tiny"]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("passes", ["", "default"])
@pytest.mark.parametrize("spec", TINY)
def test_tiny_models_gpu_equal_reference(spec, passes):
    gpu = graphir.load(spec, backend="gpu", passes=passes, ctx=64)
    ref = graphir.load(spec, backend="reference", passes="", ctx=64)
    ids = list(np.random.default_rng(0).integers(0, 256, 45))  # prefill chunks 32 + 8 + 5 x 1
    assert_rel_close(gpu.logits(ids), ref.logits(ids), REL, f"{spec} prefill")
    for t in (7, 200, 65):
        assert_rel_close(gpu.feed([t]), ref.feed([t]), REL, f"{spec} decode at {gpu.n_past}")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("passes", ["default", "default,kv-f16"])
@pytest.mark.parametrize("spec", ["random:qwen3-tiny", "random:llama-tiny", "random:qwen2-tiny"])
def test_q_k_v_writes_run_as_one_launch_bitwise(spec, passes, monkeypatch):
    """Each attention layer's q rope, K cache write and V cache write run as one qkv_* launch
    (lowering.merge_kv_writes) with bitwise the logits and KV caches of three launches
    (GRAPHIR_NO_KV_MERGE=1): a prefill, decode steps, and a 4-token call (V read strided in place)."""
    ids = list(np.random.default_rng(1).integers(0, 256, 21))
    runs = {}
    for merge in (True, False):
        monkeypatch.setenv("GRAPHIR_NO_KV_MERGE", "0" if merge else "1")
        model = graphir.load(spec, backend="gpu", passes=passes, ctx=64)
        outs = [model.logits(ids)] + [model.feed([t]) for t in (7, 200, 65)] + [model.feed([3, 4, 5, 6])]
        names = [s.name for _, prog, _ in model.programs._programs.values() for s in prog._steps]
        runs[merge] = ([host(o) for o in outs], {k: host(v) for k, v in model._state.items()}, names)
    (merged, merged_state, merged_names), (three, three_state, three_names) = runs[True], runs[False]
    kernel = "qkv_norm_rope" if "qwen3" in spec else "qkv_rope"
    assert any(nm.startswith(kernel) for nm in merged_names), sorted(set(merged_names))
    assert not any(nm.startswith("qkv_") for nm in three_names)
    # every decode step's two layers took it: no V write was left as its own launch there
    v_writes = [sum(nm.startswith("set_rows") for nm in names) for names in (merged_names, three_names)]
    assert v_writes[0] < v_writes[1], v_writes
    for i, (a, b) in enumerate(zip(merged, three)):
        np.testing.assert_array_equal(a, b, err_msg=f"call {i}")
    for k in three_state:
        np.testing.assert_array_equal(merged_state[k], three_state[k], err_msg=f"state {k}")


def _prefill_graph(spec: str, n: int, passes: str) -> Graph:
    from graphir.passes import run_pipeline
    model = graphir.load(spec, backend="reference")
    return run_pipeline(model.graph("prefill", n, last_only=True), passes)


def test_bf16_twins_go_to_results_only_gemms_read():
    """matmul.bf16_x_readers (no GPU needed): a prefill's norm, swiglu and attention results, read only by
    mul_mat_bf16 as x, get bf16 twins; the residual sum (read by the next add) and the logits' input
    (an f32 mul_mat at last_only) do not."""
    from graphir.backends.gpu.matmul import bf16_x_readers
    graph = _prefill_graph("random:qwen3-tiny", 37, "default,gemm-bf16,attn-bf16")
    readers = bf16_x_readers(graph, layout.views_to_copy(graph))
    by_op: dict[tuple[str, int], int] = {}
    for n in graph.nodes():
        for k in range(3):
            if (id(n), k) in readers:
                assert all(u.op == "mul_mat_bf16" for u in readers[(id(n), k)])
                by_op[(n.op, k)] = by_op.get((n.op, k), 0) + 1
    layers = 2
    assert by_op.get(("swiglu_split", 0)) == layers and by_op.get(("flash_attn_bf16", 0)) == layers
    # each layer's ffn norm and the next layer's attention norm; the output norm feeds the f32 head
    assert by_op.get(("add_rms_norm_mul", 0)) == 2 * layers - 1
    assert ("add_rms_norm_mul", 1) not in by_op


def test_bf16_twin_refused_where_another_op_reads_the_result():
    """A result that a GEMM and an elementwise op both read, or that is a graph output, keeps its f32."""
    from graphir.backends.gpu.matmul import bf16_x_readers
    x = g.input("x", (20, 8))
    w = g.param("w", (5, 8))
    shared = g.silu(x)
    only_gemm = g.silu(g.exp(x))
    out = g.silu(g.neg(x))
    graph = Graph({"a": g.mul_mat_bf16(w, shared), "b": g.exp(shared), "c": g.mul_mat_bf16(w, only_gemm),
                   "d": g.mul_mat_bf16(w, out), "e": out})
    readers = bf16_x_readers(graph, layout.views_to_copy(graph))
    assert (id(only_gemm), 0) in readers
    assert (id(shared), 0) not in readers and (id(out), 0) not in readers


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("spec", ["random:qwen3-tiny", "random:llama-tiny"])
def test_bf16_twins_bitwise(spec, monkeypatch):
    """Prefill GEMM inputs written as bf16 by their producers (add_rms_norm_mul, swiglu_split, attention)
    give bitwise the logits and KV caches of f32 results cast by cast_f32_bf16 (GRAPHIR_NO_BF16_TWINS=1),
    at 37 tokens (above gemm-bf16's 17 rows) and then a 513-token call."""
    ids = list(np.random.default_rng(2).integers(0, 256, 37))
    long = list(np.random.default_rng(3).integers(0, 256, 513))
    runs = {}
    for twins in (True, False):
        monkeypatch.setenv("GRAPHIR_NO_BF16_TWINS", "0" if twins else "1")
        model = graphir.load(spec, backend="gpu", passes="default,gemm-bf16,attn-bf16", ctx=1024)
        outs = [model.logits(ids), model.feed(long)]
        names = [s.name for _, prog, _ in model.programs._programs.values() for s in prog._steps]
        runs[twins] = ([host(o) for o in outs], {k: host(v) for k, v in model._state.items()}, names)
    (got, got_state, got_names), (want, want_state, want_names) = runs[True], runs[False]
    casts = [sum(nm.startswith("cast_f32_bf16") for nm in names) for names in (got_names, want_names)]
    assert casts[0] < casts[1], casts
    assert any(nm.startswith("add_rms_norm_mul_v") and nm.endswith("_bf16") for nm in got_names), set(got_names)
    assert "swiglu_split_v4_bf16" in got_names
    assert any(nm.startswith("attn_prefill_bf16_d") and nm.endswith("_obf16") for nm in got_names), set(got_names)
    assert not any(nm.endswith("_bf16") and nm.startswith(("add_rms", "swiglu")) for nm in want_names)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"call {i}")
    for k in want_state:
        np.testing.assert_array_equal(got_state[k], want_state[k], err_msg=f"state {k}")


@pytest.mark.gpu
@gpu_only
def test_bf16_twins_live_in_their_results_slots():
    """Each bf16 twin is the first half of its f32 result's own arena slot (matmul.bf16_half), so a prefill's twins
    allocate nothing: every GEMM x registered as a twin lies inside the arena (a scratch buffer would not)."""
    model = graphir.load("random:qwen3-tiny", backend="gpu", passes="default,gemm-bf16,attn-bf16", ctx=1024)
    model.feed(list(np.random.default_rng(4).integers(0, 256, 513)))
    progs = [p for _, p, _ in model.programs._programs.values() if p.graph.meta.get("phase") == "prefill"]
    prog = max(progs, key=lambda p: p.graph.meta["n_tokens"])  # the 512-token chunk
    assert prog.graph.meta["n_tokens"] >= 512
    lo, hi = prog.arena.data.ptr, prog.arena.data.ptr + prog.arena.nbytes
    # the results only GEMMs read, of the ops whose kernels write twins (the first layer's unfused norm `mul`
    # has none: its GEMMs cast it into a scratch buffer)
    twinned = [(n, k) for n in prog.graph.nodes() for k in range(3) if (id(n), k) in prog.bf16_readers
               and n.op in ("swiglu_split", "flash_attn_bf16", "add_rms_norm_mul")]
    assert {n.op for n, _ in twinned} == {"swiglu_split", "flash_attn_bf16", "add_rms_norm_mul"}
    for n, k in twinned:
        for u in prog.bf16_readers[(id(n), k)]:
            buf = prog.lw.shared[("bf16 x", id(u.src[1]))]
            assert lo <= buf.data.ptr and buf.data.ptr + buf.nbytes <= hi, (n.describe(), k)


@pytest.fixture(scope="module")
def smol_gpu():
    if not HAS_GPU:
        pytest.skip("no GPU here")
    try:
        return graphir.load("smollm2-135m", backend="gpu", passes="default")
    except graphir.LoadError as e:
        pytest.skip(str(e))


@pytest.mark.gpu
@gpu_only
def test_smollm2_logits_gpu_equal_reference(smol_gpu):
    ref = graphir.load("smollm2-135m", backend="reference", passes="")
    ids = smol_gpu.tokenizer.encode("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert_rel_close(smol_gpu.logits(ids), ref.logits(ids), REL, "smollm2 prefill")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("prompt", ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, there"])
def test_smollm2_greedy_text_gpu_equals_cpu(smol_gpu, prompt):
    cpu = graphir.load("smollm2-135m", backend="cpu", passes="default")
    ids = cpu.tokenizer.encode(prompt)
    got = list(smol_gpu.generate(ids, 32, stop_at_eos=False))
    want = list(cpu.generate(ids, 32, stop_at_eos=False))
    assert got == want, f"{prompt!r}: gpu {cpu.tokenizer.decode(got)!r} vs cpu {cpu.tokenizer.decode(want)!r}"


@pytest.mark.gpu
@gpu_only
def test_bad_token_id_is_a_project_error_and_the_process_survives():
    model = graphir.load("random:llama-tiny", backend="gpu", ctx=16)
    graph = model.graph("decode")
    program = get_backend("gpu").lower(graph, model.weights)
    state = get_backend("gpu").new_state(graph)
    feeds = {"tokens": np.array([10**6], np.int32), "pos": np.array([0], np.int32),
             "kv_idx": np.array([0], np.int32), "kv_len": np.array([1], np.int32)}
    with pytest.raises(BackendError, match="get_rows: id 1000000 out of range"):
        program(feeds, state)
    with pytest.raises(BackendError, match=r"row index out of range 0\.\.15 \(got 16"):
        program({**feeds, "tokens": np.array([3], np.int32), "kv_idx": np.array([16], np.int32)}, state)
    ok = program({**feeds, "tokens": np.array([3], np.int32)}, state)["logits"]  # the context is not poisoned
    assert np.isfinite(ok).all()
    with pytest.raises(InputError):  # ids are checked on the host before anything runs
        model.logits([model.config.n_vocab])


@pytest.mark.gpu
@gpu_only
def test_device_outputs_and_device_state():
    cp = pytest.importorskip("cupy")
    model = graphir.load("random:qwen3-tiny", backend="gpu", ctx=16)
    graph = model.graph("decode")
    program = get_backend("gpu").lower(graph, model.weights)
    state = get_backend("gpu").new_state(graph)
    assert all(isinstance(v, cp.ndarray) for v in state.values())
    feeds = {"tokens": np.array([5], np.int32), "pos": np.array([0], np.int32),
             "kv_idx": np.array([0], np.int32), "kv_len": np.array([1], np.int32)}
    dev = program(feeds, state, device=True)["logits"]
    host = program(feeds, state)["logits"]
    assert isinstance(dev, cp.ndarray)
    np.testing.assert_array_equal(dev.get(), host)
    k0 = next(v for k, v in state.items() if k.endswith("k_cache"))
    assert float(cp.abs(k0[0]).max()) > 0 and float(cp.abs(k0[1:]).max()) == 0  # row 0 written in place


# ---------------------------------------------------------------- vocab-sized rows (GPU suite)
VOCAB = 151936  # Qwen3's vocabulary: the widest rows a model graph reduces over


@pytest.mark.gpu
@gpu_only
def test_vocab_sized_reductions_and_lookups_equal_reference():
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((3, VOCAB)) * 4).astype(np.float32)
    logits[1, [7, 151935]] = logits[1].max() + 1  # a tie: the first index wins
    x = g.input("x", logits.shape)
    graph = Graph({"argmax": g.argmax(x), "top_k": g.top_k(x, k=40), "softmax": g.softmax(x, scale=0.7),
                   "sum": g.sum_rows(x)})
    want = get_backend("reference").lower(graph, None)({"x": logits})
    got = get_backend("gpu").lower(graph, None)({"x": logits})
    assert got["argmax"].tolist() == want["argmax"].tolist() and got["argmax"][1] == 7
    np.testing.assert_array_equal(got["top_k"], want["top_k"])
    np.testing.assert_allclose(got["softmax"], want["softmax"], rtol=1e-5, atol=1e-9)
    # two f32 summation orders differ by up to ~eps * sum|x| (~0.05 here); a lost element is ~4
    bound = 1e-7 * float(np.abs(logits).sum(-1).max())
    np.testing.assert_allclose(got["sum"], want["sum"], rtol=0, atol=bound)
    table = rng.standard_normal((VOCAB, 64)).astype(np.float32)
    ids = np.array([0, 151935, 77, 77], np.int32)
    node = g.get_rows(g.input("t", table.shape), g.input("ids", (4,), "i32"))
    out = get_backend("gpu").lower(Graph({"o": node}), None)({"t": table, "ids": ids})["o"]
    np.testing.assert_array_equal(out, table[ids])


# ---------------------------------------------------------------- 16-byte elementwise kernels (GPU suite)
def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (nearest even, the reference's rounding) as its 16-bit patterns."""
    from graphir.ops.fused import bf16_round

    return (bf16_round(x).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("n", [1, 3, 7, 511, 1025, 4096])
@pytest.mark.parametrize("offset", [0, 1])
def test_cast_bf16_kernels(n, offset):
    """cast_f32_bf16_v4 (aligned src and dst) and cast_f32_bf16 (offset by one element: not 16-byte aligned)
    against the reference's rounding, ties to even and the n % 4 tail included."""
    import cupy as cp
    from graphir.backends.gpu import kernels
    from graphir.backends.gpu import matmul as mm

    x = np.random.default_rng(n).standard_normal(n + 1).astype(np.float32)
    x[:2] = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8][: min(2, n + 1)]  # exact ties: round down to 1, up to 1 + 2^-6
    src = cp.asarray(x)[offset:offset + n]
    dst = cp.full(n + 1, 0xFFFF, np.uint16)[offset:offset + n]
    name, grid = mm._cast_bf16(src, dst)
    assert name == ("cast_f32_bf16_v4" if offset == 0 else "cast_f32_bf16")
    kernels.get("matmul.cu", name)((grid,), (256,), (src, dst, np.int64(n)))
    np.testing.assert_array_equal(dst.get(), _bf16_bits(x[offset:offset + n]))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("n", [1, 3, 7, 511, 1025, 4096])
def test_swiglu_split_kernels(n):
    """swiglu_split_v4_f32 (a, b, y 16-byte aligned) and swiglu_split_f32 (the same values one element into
    their buffers: not aligned) bit for bit equal, and against the f64 formula; the n % 4 tail included."""
    import cupy as cp
    from graphir.backends.gpu.launch import Lowering
    from graphir.backends.gpu.lowering import RULES

    rng = np.random.default_rng(n)
    a, b = (rng.standard_normal(n) * 3).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    outs = []
    for off, kernel in ((0, "swiglu_split_v4_f32"), (1, "swiglu_split_f32")):
        da, db = cp.zeros(n + 1, np.float32), cp.zeros(n + 1, np.float32)
        da[off:off + n], db[off:off + n] = cp.asarray(a), cp.asarray(b)
        y = cp.full(n + 1, np.nan, np.float32)[off:off + n]
        steps = RULES["swiglu_split"](Lowering(None), None, [da[off:off + n], db[off:off + n]], [y], {})
        assert [s.name for s in steps] == [kernel]
        for s in steps:
            s()
        outs.append(y.get())
    np.testing.assert_array_equal(outs[0], outs[1])
    a64 = a.astype(np.float64)
    np.testing.assert_allclose(outs[0], a64 / (1 + np.exp(-a64)) * b, rtol=2e-6, atol=2e-6)
