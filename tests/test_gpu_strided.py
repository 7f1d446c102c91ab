"""Row-strided inputs on the gpu: views a rule reads in place instead of gathering them first.

Which views are read in place is decided on the host (layout.views_to_copy with lowering's
ROW_STRIDED_INPUTS) and is checked here without a GPU, on the Qwen3.5, Qwen3 and Llama graphs;
the kernels that read them (marker `gpu`) are checked against the reference backend at several
row strides, offsets and row counts, with the Program's gathers counted.
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu_helpers import gpu_only
from graphir.backends.gpu import layout
from graphir.backends.gpu.lowering import ROW_STRIDED_INPUTS, RULES
from graphir.backends.registry import get_backend

from graphir import g
from graphir.cli import load_graph
from graphir.ir import Graph, Node
from graphir.passes import run_pipeline
from graphir.weights import Weight, Weights

ATTENTION_READERS = {"rms_norm_mul_rope", "rms_norm_mul_rope_set_rows", "rope", "rope_set_rows", "mul_sigmoid",
                     "set_rows", "swiglu_split"}
STACKED_PREFILL = "default,stack-projections{max_rows=65536},fold-reshape-view,gemm-bf16,attn-bf16"


# ---------------------------------------------------------------- which views are gathered (no GPU needed)
def _gathered(spec: str, phase: str) -> tuple[Graph, list[tuple[Node, list[str]]]]:
    graph = run_pipeline(load_graph(f"random:{spec}", phase), "default")
    users, copies = graph.users(), layout.views_to_copy(graph)
    return graph, [(n, [u.op for u in users[id(n)]]) for n in graph.nodes() if id(n) in copies]


@pytest.mark.parametrize("phase", ["decode", "verify"])
def test_qwen35_gathers_no_q_or_gate_view(phase):
    graph, gathered = _gathered("qwen35-0.8b", phase)
    ops = [n.op for n in graph.nodes()]
    assert ops.count("mul_sigmoid") == 6 and "sigmoid" not in ops  # the 6 gated-attention layers
    # the q column view itself is not read either (its q and gate views are views of the product)
    attention = [(n.describe(), r) for n, r in gathered
                 if ATTENTION_READERS & set(r) or "view" in r or (n.name or "").endswith(("attn_q", "q_gate"))]
    assert not attention
    if phase == "decode":  # one token: every view of a decode step is read in place
        assert not gathered, [n.describe() for n, _ in gathered]


@pytest.mark.parametrize("spec", ["qwen3-tiny", "llama-tiny"])
def test_stacked_qkv_verify_gathers_nothing(spec):
    """Several rows of a stacked q|k|v product: q and k are read in place by the rope kernels, v by
    set_rows."""
    graph, gathered = _gathered(spec, "verify")
    assert sum(n.op == "set_rows" for n in graph.nodes()) == 2  # the graph has the V writes it reads in place
    assert not gathered, [(n.describe(), r) for n, r in gathered]


def _strided(m: int, heads: int, d: int, row: int, head: int, offset: int) -> tuple[Node, Node]:
    y = g.input("y", (m, row))
    return y, g.view(y, shape=(m, heads, d), strides=(row, head, 1), offset=offset)


def test_a_view_is_read_in_place_only_where_every_reader_takes_it():
    _, v = _strided(3, 2, 8, 40, 16, 8)
    a = g.input("a", (3, 2, 8))
    alone = Graph({"y": g.mul_sigmoid(a, v)})
    assert not layout.views_to_copy(alone)
    shared = Graph({"y": g.mul_sigmoid(a, v), "z": g.exp(v)})  # exp reads contiguous values
    assert layout.views_to_copy(shared) == {id(v)}
    as_x = Graph({"y": g.mul_sigmoid(v, a)})  # mul_sigmoid takes b strided, not a
    assert layout.views_to_copy(as_x) == {id(v)}
    assert layout.views_to_copy(Graph({"v": v, "y": g.mul_sigmoid(a, v)})) == {id(v)}  # an output: contiguous
    f16 = g.view(g.input("h", (3, 40), "f16"), shape=(3, 2, 8), strides=(40, 16, 1), offset=8)
    assert layout.views_to_copy(Graph({"y": g.mul_sigmoid(g.input("b", (3, 2, 8), "f16"), f16)})) == {id(f16)}
    odd = g.view(g.input("o", (3, 40)), shape=(3, 2, 8), strides=(40, 16, 2), offset=0)  # last axis strided
    assert layout.views_to_copy(Graph({"y": g.mul_sigmoid(a, odd)})) == {id(odd)}


def test_every_row_strided_rule_exists():
    assert set(ROW_STRIDED_INPUTS) <= set(RULES)
    assert set(ROW_STRIDED_INPUTS) == ATTENTION_READERS  # each is checked on the GPU below


# ---------------------------------------------------------------- the kernels (GPU suite)
# (rows m, heads, head_dim, row stride, head stride, offset): Qwen3.5's q|gate interleave, a stacked
# q|k|v row, a single decode row, and awkward sizes
LAYOUTS = [(1, 8, 256, 4096, 512, 0), (1, 8, 256, 4096, 512, 256), (5, 8, 256, 5120, 512, 256),
           (3, 4, 16, 128, 16, 64), (16, 2, 30, 131, 33, 3), (7, 3, 64, 200, 64, 7)]


def _run_both(outputs: dict[str, Node], updates: tuple = (), inputs: dict | None = None, state: dict | None = None,
              weights: Weights | None = None, copies: int = 0) -> tuple[dict, dict, dict, dict]:
    graph = Graph(outputs, list(updates))
    prog = get_backend("gpu").lower(graph, weights)
    assert len(prog.copies) == copies, "a strided view was gathered: the kernel's stride path went untested"
    ref_state = {k: v.copy() for k, v in (state or {}).items()}
    gpu_state = {k: v.copy() for k, v in (state or {}).items()}
    want = get_backend("reference").lower(graph, weights)(inputs, ref_state)
    got = prog(inputs, gpu_state)
    return want, got, ref_state, gpu_state


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("m,heads,d,row,head,offset", LAYOUTS)
def test_rope_kernels_read_strided_heads(m, heads, d, row, head, offset, rng):
    y, x = _strided(m, heads, d, row, head, offset)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    weights = Weights({"w": Weight("f32", (d,), w)})
    pos, rows = g.input("pos", (m,), "i32"), g.input("rows", (m,), "i32")
    cap = m + 5
    rope = {"n_dims": d - d % 2, "mode": "neox", "theta": 1e6}
    norm_rope = g.rms_norm_mul_rope(x, g.param("w", (d,)), pos, eps=1e-6, **rope)
    plain = g.rope(x, pos, **{**rope, "mode": "norm"})
    writes = (g.rms_norm_mul_rope_set_rows(g.state("k1", (cap, heads, d)), x, g.param("w", (d,)), pos, rows,
                                           eps=1e-6, **rope),
              g.rope_set_rows(g.state("k2", (cap, heads, d)), x, pos, rows, **rope),
              g.set_rows(g.state("v", (cap, heads, d)), x, rows))
    inputs = {"y": (rng.standard_normal((m, row)) * 2).astype(np.float32),
              "pos": rng.integers(0, 5000, m).astype(np.int32), "rows": rng.permutation(cap)[:m].astype(np.int32)}
    state = {k: rng.standard_normal((cap, heads, d)).astype(np.float32) for k in ("k1", "k2", "v")}
    want, got, ref_state, gpu_state = _run_both({"norm_rope": norm_rope, "rope": plain}, writes, inputs, state,
                                                weights)
    for k in want:
        _close(got[k], want[k])
    for k in state:
        _close(gpu_state[k], ref_state[k])


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("m,heads,d,row,head,offset", LAYOUTS)
def test_mul_sigmoid_reads_a_strided_gate_bit_for_bit(m, heads, d, row, head, offset, rng):
    """Against the reference, and bitwise against the unfused gpu kernels (sigmoid, then mul) over the
    gathered gate: the same float expression."""
    y, gate = _strided(m, heads, d, row, head, offset)
    a = g.input("a", (m, heads, d))
    inputs = {"y": (rng.standard_normal((m, row)) * 3).astype(np.float32),
              "a": rng.standard_normal((m, heads, d)).astype(np.float32)}
    want, got, _, _ = _run_both({"y": g.mul_sigmoid(a, gate)}, inputs=inputs)
    _close(got["y"], want["y"])
    unfused = get_backend("gpu").lower(Graph({"y": g.mul(a, g.sigmoid(gate))}), None)(inputs)
    assert np.array_equal(got["y"], unfused["y"])


def test_stacked_prefill_gathers_nothing():
    """Prefill projections stacked (q|k|v and gate|up, stack-projections without its row limit): every column
    view of the stacked products is read in place, the gate and up halves by swiglu_split."""
    graph = run_pipeline(load_graph("random:qwen3-tiny", "prefill"), STACKED_PREFILL)
    assert sum(n.op == "concat" for n in graph.nodes()) >= 4  # q|k|v and gate|up of both layers
    users = graph.users()
    assert not [(n.op, [u.op for u in users[id(n)]]) for n in graph.nodes() if id(n) in layout.views_to_copy(graph)]


# (rows, f, row stride of a, of b, offset of a, of b): a stacked gate|up row (b's half after a's), the halves
# interleaved the other way, odd widths and strides (the one-float kernel), a single row
SWIGLU_LAYOUTS = [(37, 96, 192, 192, 0, 96), (5, 64, 128, 128, 64, 0), (9, 30, 61, 61, 1, 31), (1, 12, 24, 24, 0, 12),
                  (513, 44, 88, 88, 0, 44), (6, 32, 40, 72, 4, 8), (7, 9, 23, 11, 2, 0)]  # the last two: sa != sb


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("rows,f,sa,sb,oa,ob", SWIGLU_LAYOUTS)
def test_swiglu_split_reads_strided_halves_bit_for_bit(rows, f, sa, sb, oa, ob, rng):
    """Against the reference, and bitwise against the contiguous kernels over gathered halves (copies=2 when
    an exp also reads them: the same float expression)."""
    width = max(sa, sb)  # both views inside one [rows, width] input
    y = g.input("y", (rows, width))
    a = g.view(y, shape=(rows, f), strides=(sa, 1), offset=oa)
    b = g.view(y, shape=(rows, f), strides=(sb, 1), offset=ob)
    inputs = {"y": (rng.standard_normal((rows, width)) * 3).astype(np.float32)}
    want, got, _, _ = _run_both({"s": g.swiglu_split(a, b)}, inputs=inputs)  # copies=0: read in place
    _close(got["s"], want["s"])
    _, gathered, _, _ = _run_both({"s": g.swiglu_split(a, b), "e": g.add(g.exp(a), g.exp(b))}, inputs=inputs,
                                  copies=2 if rows > 1 else 0)  # one row of a view is contiguous: never gathered
    assert np.array_equal(got["s"], gathered["s"])


@pytest.mark.gpu
@gpu_only
def test_a_gathered_view_is_read_contiguous_by_a_strided_rule(rng):
    """A view also read by a rule that needs it contiguous is gathered once; the strided rule then
    reads the gathered copy with contiguous strides."""
    y, gate = _strided(3, 4, 16, 130, 32, 16)
    a = g.input("a", (3, 4, 16))
    inputs = {"y": rng.standard_normal((3, 130)).astype(np.float32), "a": rng.standard_normal((3, 4, 16)).astype(
        np.float32)}
    want, got, _, _ = _run_both({"y": g.mul_sigmoid(a, gate), "e": g.exp(gate)}, inputs=inputs, copies=1)
    for k in want:
        _close(got[k], want[k])


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("phase", ["decode", "verify"])
def test_qwen35_program_launches_no_gather_for_attention(phase):
    from graphir.api import load

    model = load("random:qwen35-tiny", backend="reference", passes="")  # for its weights
    graph = run_pipeline(load_graph("random:qwen35-tiny", phase), "default")
    prog = get_backend("gpu").lower(graph, model.weights)
    users = graph.users()
    by_id = {id(n): n for n in graph.nodes()}
    readers = {op for i in prog.copies for op in (u.op for u in users[id(by_id[i])])}
    assert not readers & ATTENTION_READERS
    if phase == "decode":
        assert not prog.copies
