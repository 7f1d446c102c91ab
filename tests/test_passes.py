"""Every registered pass (and `default`), generated from the registry, checked three ways:

1. outputs and final State equal the unrewritten graph's on the reference backend (same inputs,
   copies of the same random state), on every TARGETED_CASES graph (f32 and q8_0 weights),
   the example decoder and the tiny llama / qwen3 / qwen2 models, prefill and decode;
2. the verifier passes after the pass;
3. the pass fires where it must: on its targeted case, and (coverage matched > 0) on model graphs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache

import numpy as np
import pytest
from graphir.backends.reference import lower
from test_pass_registry import TARGETED_CASES, N, case_add_norm, case_identities, case_projections

from graphir.builder import g
from graphir.dump import dump_text
from graphir.errors import GraphError
from graphir.examples import build_example, example_weights
from graphir.ir import Graph
from graphir.passes import PASSES, coverage, run_pipeline
from graphir.quant import quantize, random_quantized
from graphir.run_inputs import new_state
from graphir.weights import Weight, Weights

WTYPES = ("f32", "q8_0")
OPTIONS = {"replay-lint": "{strict=0}",  # the baked-position case must still run through every pass
           "gemm-bf16": "{min_rows=1}"}  # the small test graphs have a few rows: rewrite every matmul
# Passes that change rounding on purpose, and the normalized mean squared error (sum (got - want)^2 /
# sum want^2, ggml test-backend-ops' measure) their results keep. gemm-bf16 rounds both matmul
# operands to 8 significant bits (relative error <= 2^-9 each). An element-wise bound does not fit
# it: where attention logits are large, a rounded logit moves one softmax weight by 10-20 % (measured
# 1.35x a 1e-2 element bound on the rope-cache case, q8_0) while the whole output stays close. Measured
# over every source here: NMSE 5e-7 .. 6.4e-5; a wrong operand or a lost rounding gives NMSE ~1.
# attn-bf16 rounds q, k, v and the softmax weights the same way: NMSE 5e-6 .. 2.2e-5 where it fires.
# kv-f16 rounds each K and V element once (relative error <= 2^-11, so NMSE <= 2^-22 = 2.4e-7 for the
# cache rows themselves); attention turns it into score shifts of up to scale * sum |q| |k| 2^-11
# (the bound tests/test_kv_f16.py derives and checks). Measured NMSE 6.5e-8 .. 1.2e-6 (q8_0 kv_cache case).
# q8-activations rounds x to 8 bits per block of 32: an error uniform in +-d/2 a value, d = max |x| / 127 (~2.5
# sigma of normal x / 127), so NMSE ~ (2.5 / 127)^2 / 12 = 3e-5 per product, doubled in silu(gate) * up.
# Measured 2.6e-5 (q) .. 1.1e-4 (the swiglu activation) on its case; a lost scale or code gives NMSE ~1.
# q16-activations the same at 16 bits: (2.5 / 32767)^2 / 12 = 4.9e-10 per product. Measured 3.6e-10 .. 1.1e-9 on
# its case; 8-bit codes would give ~3e-5.
# gemm-bf16-out rounds gate and up products to bf16 (relative error uniform in +-2^-9: NMSE 2^-18 / 3 = 1.3e-6 a
# value, about twice that through silu(gate) * up). Measured 2.4e-6 (f32) and 9.1e-6 (q8_0) on its case.
ROUNDING = {"gemm-bf16": 1e-4, "gemm-bf16-out": 3e-5, "attn-bf16": 1e-4, "kv-f16": 1e-5, "q8-activations": 4e-4,
            "q16-activations": 1e-8}
# shard-tp's graphs hold each rank's State under its own name: tests/test_shard_tp.py compares them
# with the unsharded graph through graphir.tp.shard_state.
VALUE_PASSES = sorted(set(PASSES) - {"shard-tp"})
KV_OFFSET = 2  # new tokens go to cache rows 2..; rows 0..1 hold (random) earlier keys
MODELS = ("llama-tiny", "qwen3-tiny", "qwen2-tiny")
MODEL_FUSIONS = {  # fusions `default` must apply to each tiny model
    "llama-tiny": ("stack-projections", "fold-reshape-view", "fuse-add-rms-norm-mul", "fuse-rope-set-rows",
                   "fuse-mul-mat-swiglu"),
    "qwen3-tiny": ("stack-projections", "fold-reshape-view", "fuse-add-rms-norm-mul", "fuse-qk-norm-rope",
                   "fuse-rope-set-rows", "fuse-mul-mat-swiglu"),
    # q/k/v biases: stacked with their weights, so the rope and KV-write fusions still read views of one product
    "qwen2-tiny": ("stack-projections", "fold-reshape-view", "fuse-add-rms-norm-mul", "fuse-rope-set-rows",
                   "fuse-mul-mat-swiglu"),
}  # Qwen3.5's list: tests/test_qwen35.py test_passes_fire_on_the_model_graph


# ---------------------------------------------------------------- data
def random_weights(graph: Graph, seed: int = 0) -> Weights:
    rng = np.random.default_rng(seed)
    out = Weights(source="<test weights>")
    for p in sorted({p.name: p for p in graph.params}.values(), key=lambda p: p.name):
        if p.dtype in ("f32", "f16", "bf16"):
            v = 1 + 0.1 * rng.standard_normal(p.shape) if len(p.shape) == 1 else \
                rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
            data = quantize(v.astype(np.float32), p.dtype)
        else:
            data = random_quantized(rng, p.dtype, p.shape)
        out.add(p.name, Weight(p.dtype, p.shape, data))
    return out


def random_inputs(graph: Graph, seed: int = 1) -> dict[str, np.ndarray]:
    """Inputs by role: token ids in range, positions and KV rows KV_OFFSET.., kv_len covering them."""
    rng = np.random.default_rng(seed)
    users = graph.users()
    out = {}
    for x in sorted(graph.inputs, key=lambda n: n.name):  # by name: a pass may reorder the graph's Inputs
        readers = [(u.op, u.src.index(x)) for u in users[id(x)]]
        if x.name in out:  # the same Input asked for twice
            continue
        if x.dtype != "i32":
            out[x.name] = rng.standard_normal(x.shape).astype(np.float32)
        elif ("get_rows", 1) in readers:
            table = next(u.src[0] for u in users[id(x)] if u.op == "get_rows")
            out[x.name] = rng.integers(0, table.shape[0], x.shape).astype(np.int32)
        elif ("flash_attn", 4) in readers or ("flash_attn_bf16", 4) in readers:
            n_q = next(u.src[0].shape[0] for u in users[id(x)] if u.op in ("flash_attn", "flash_attn_bf16"))
            out[x.name] = np.array([KV_OFFSET + n_q], np.int32)
        else:
            out[x.name] = np.arange(KV_OFFSET, KV_OFFSET + x.shape[0], dtype=np.int32)
    return out


def random_state(graph: Graph, seed: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in sorted(new_state(graph).items())}


def run(graph: Graph, weights: Weights) -> tuple[dict, dict]:
    """Outputs and final State of one reference run on the fixed random inputs and state."""
    state = random_state(graph)
    outputs = lower(graph, weights)(random_inputs(graph), state)
    return outputs, state


def assert_close(want: dict, got: dict, what: str, nmse: float | None = None) -> None:
    """Element-wise close; for a pass that rounds on purpose, normalized MSE at most `nmse` instead."""
    assert want.keys() == got.keys(), what
    for k in want:
        a, b = np.asarray(want[k], np.float64), np.asarray(got[k], np.float64)
        if nmse is not None:
            err = float(((b - a) ** 2).sum() / max(float((a * a).sum()), 1e-30))
            assert err <= nmse, f"{what}: {k}: normalized MSE {err:.3g} > {nmse:g}"
            continue
        tol = 2e-3 if want[k].dtype == np.float16 else 1e-4  # an f16 cache row may round the other way
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol * max(1.0, np.abs(a).max()), err_msg=f"{what}: {k}")


# ---------------------------------------------------------------- graph sources
def _model_graph(model: str, phase: str) -> Callable[[], tuple[Graph, Weights]]:
    def build() -> tuple[Graph, Weights]:
        m = load_model(model)
        return (m.graph("prefill", 7) if phase == "prefill" else m.graph("decode")), m.weights

    return build


@cache
def load_model(name: str):
    try:
        from graphir.api import load
    except ImportError as e:  # graphir.api is written by another part of the project
        pytest.skip(f"graphir.api is not importable ({e}); model graphs untested")
    return load(f"random:{name}")


def _targeted(case: str, wtype: str) -> Callable[[], tuple[Graph, Weights]]:
    def build() -> tuple[Graph, Weights]:
        graph = TARGETED_CASES[case].build(wtype)
        return graph, random_weights(graph)

    return build


SOURCES: dict[str, Callable[[], tuple[Graph, Weights]]] = {
    **{f"{c}-{w}": _targeted(c, w) for c in TARGETED_CASES for w in WTYPES},
    **{f"example-{ph}": (lambda ph=ph: (build_example(ph), example_weights(build_example(ph)))) for ph in
       ("prefill", "decode")},
    **{f"{m}-{ph}": _model_graph(m, ph) for m in MODELS for ph in ("prefill", "decode")},
}


@cache
def source(name: str) -> tuple[Graph, Weights, tuple[dict, dict]]:
    graph, weights = SOURCES[name]()
    return graph, weights, run(graph, weights)


# ---------------------------------------------------------------- 1 + 2: same values, verified
@pytest.mark.parametrize("src", sorted(SOURCES))
@pytest.mark.parametrize("name", [*VALUE_PASSES, "default"])
def test_pass_keeps_values(name: str, src: str):
    graph, weights, (want_out, want_state) = source(src)
    if name == "default" and src.startswith("replay-lint"):  # default lints strictly: the baked position fails
        with pytest.raises(GraphError, match="k_past"):
            run_pipeline(graph, name)
        return
    out = run_pipeline(graph, name + OPTIONS.get(name, ""), verify_each=True)
    got_out, got_state = run(out, weights)
    tol = ROUNDING.get(name)
    assert_close(want_out, got_out, f"{name} on {src}: outputs", tol)
    assert_close(want_state, got_state, f"{name} on {src}: state", tol)


# ---------------------------------------------------------------- 3: fires where it must
@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("name", sorted(TARGETED_CASES))
def test_pass_fires_on_its_targeted_case(name: str, wtype: str):
    case = TARGETED_CASES[name]
    graph = case.build(wtype)
    report = coverage(graph, name + OPTIONS.get(name, ""))
    pc = report[name]
    out = run_pipeline(graph, name + OPTIONS.get(name, ""))
    if case.effect == "findings":  # an analysis: reports, changes nothing
        assert pc.rejected and not pc.matched and out.signature() == graph.signature()
        return
    assert pc.matched, report.text()
    if case.effect == "f16-state":  # kv-f16: KV caches f16, every other State as it was
        before = {n.name: n.dtype for n in graph.states}
        after = {n.name: n.dtype for n in out.states}
        changed = {k for k in before if after[k] != before[k]}
        assert changed and all(after[k] == "f16" for k in changed) and pc.rejected, report.text()
        assert all(after[k] == "f32" for k in after if "cache" not in k)
        return
    if case.effect == "fewer-nodes":
        assert len(out) < len(graph)
    else:
        assert case.effect in {n.op for n in out} - {n.op for n in graph}


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("model", MODELS)
def test_default_fuses_model_graphs(model: str, phase: str):
    graph, _, _ = source(f"{model}-{phase}")
    report = coverage(graph, "default")
    for name in MODEL_FUSIONS[model]:
        assert report[name].matched, f"{name} did not fire on {model} {phase}:\n{report.text()}"
    assert report["cse#2"].nodes_after < len(graph) + 2 * graph.meta.get("n_layers", 2)  # views are cheap, no blowup


# ---------------------------------------------------------------- specific rules
def test_dce_removes_each_identity_and_keeps_real_copies():
    out = PASSES["dce"](case_identities("f32"))
    ops = [n.op for n in out]
    assert ops.count("cont") == 1 and not {"reshape", "permute", "cast", "scale"} & set(ops)
    assert out.outputs["y"].src[0].op == "mul_mat"


def test_dce_keeps_reads_of_state():
    s = g.state("s", (4, 8))
    graph = Graph({"y": g.silu(g.cont(s))})
    assert [n.op for n in PASSES["dce"](graph)].count("cont") == 1


def test_cse_merges_duplicates_not_names():
    out = PASSES["cse"](TARGETED_CASES["cse"].build("f32"))
    ops = [n.op for n in out]
    assert ops.count("mul_mat") == 1 and ops.count("param") == 1 and ops.count("input") == 2  # x, rows
    assert ops.count("set_rows") == 1 and ops.count("silu") == 1


def test_stack_views_land_on_the_original_outputs():
    graph = case_projections("q8_0")
    out = PASSES["stack-projections"](graph)
    q, k, v = (out.outputs[n] for n in "qkv")
    assert q.op == k.op == "view" and q.src[0] is k.src[0] and v.op == "mul_mat"
    assert (q.params["offset"], k.params["offset"]) == (0, 40) and (q.shape, k.shape) == ((N, 40), (N, 24))
    stacked = q.src[0].src[0]
    assert stacked.op == "concat" and stacked.dtype == "q8_0" and stacked.shape == (64, 96)
    gate, again = out.outputs["gate"], out.outputs["up"].src[1]
    assert gate.params["offset"] == again.params["offset"] == 0 and gate.src[0].src[0].shape == (144, 96)


def _biased_projections(biased: str, raw_too: bool = False) -> Graph:
    """q [N, 40], k and v [N, 24] of one x, each in `biased` plus its bias; `raw_too` also outputs q's product."""
    x = g.input("x", (N, 96))
    out = {}
    for name, rows in (("q", 40), ("k", 24), ("v", 24)):
        y = out[name + "_raw"] = g.mul_mat(g.param(f"attn_{name}.weight", (rows, 96)), x)
        if name in biased:
            out[name] = g.add(y, g.param(f"attn_{name}.bias", (rows,)))
    keep = {k: v for k, v in out.items() if not k.endswith("_raw") or (raw_too and k == "q_raw") or k[0] not in biased}
    return Graph(keep, meta={"case": "biased projections"})


@pytest.mark.parametrize("biased, raw_too, stacked_bias", [("qkv", False, True), ("qv", False, False),
                                                           ("qkv", True, False)])
def test_stack_adds_a_groups_biases_once(biased, raw_too, stacked_bias):
    """Qwen2's q/k/v: all biased, one add of the stacked biases and the views in the bias adds' places; a projection
    without a bias, or a product read elsewhere too, leaves each bias added to its view. Same values either way."""
    graph = _biased_projections(biased, raw_too)
    out = run_pipeline(graph, "stack-projections,dce", verify_each=True)
    mms, adds = [n for n in out.nodes() if n.op == "mul_mat"], [n for n in out.nodes() if n.op == "add"]
    assert len(mms) == 1 and mms[0].shape == (N, 88)
    if stacked_bias:
        assert len(adds) == 1 and adds[0].src[0] is mms[0] and adds[0].src[1].shape == (88,)
        assert [(out.outputs[k].op, out.outputs[k].params["offset"]) for k in "qkv"] == [("view", 0), ("view", 40),
                                                                                         ("view", 64)]
        assert all(out.outputs[k].src[0] is adds[0] for k in "qkv")
    else:
        assert len(adds) == len(biased) and all(a.src[0].op == "view" and a.src[1].op == "param" for a in adds)
    weights = random_weights(graph)
    assert_close(run(graph, weights)[0], run(out, weights)[0], f"biased {biased}")


def test_rejections_name_the_site_and_the_reason():
    report = coverage(case_add_norm("f32"), "fuse-add-rms-norm-mul")
    (site, why), = report["fuse-add-rms-norm-mul"].rejected
    assert site == "add 'blk.0.out'" and "blk.1.attn_norm has another user" in why
    report = coverage(TARGETED_CASES["fuse-qk-norm-rope"].build("f32"), "fuse-qk-norm-rope")
    assert len(report["fuse-qk-norm-rope"].rejected) == 1


def test_rope_set_rows_needs_the_rope_to_be_cache_only():
    x, pos, rows = g.input("x", (N, 3, 8)), g.input("pos", (N,), "i32"), g.input("rows", (N,), "i32")
    k = g.rope(x, pos, n_dims=8, name="k_rope")
    graph = Graph({"k": k}, updates=[g.set_rows(g.state("c", (16, 3, 8)), k, rows)])
    report = coverage(graph, "fuse-rope-set-rows")
    assert not report["fuse-rope-set-rows"].matched and "other users" in report["fuse-rope-set-rows"].rejected[0][1]


def test_mul_mat_swiglu_only_where_the_product_is_read_by_the_activation_alone():
    out = PASSES["fuse-mul-mat-swiglu"](TARGETED_CASES["fuse-mul-mat-swiglu"].build("q4_0"))
    assert out.outputs["act"].op == "mul_mat_swiglu" and out.outputs["act"].name == "blk.0.ffn_act"
    assert out.outputs["kept"].op == "swiglu_split" and out.outputs["kept"].src[0].src[0] is out.outputs["y1"]
    report = coverage(TARGETED_CASES["fuse-mul-mat-swiglu"].build("q4_0"), "fuse-mul-mat-swiglu")
    (_, why), = report["fuse-mul-mat-swiglu"].rejected
    assert "another reader" in why


def test_mul_sigmoid_only_where_the_sigmoid_has_no_other_reader():
    graph = TARGETED_CASES["fuse-mul-sigmoid"].build("f32")
    out = PASSES["fuse-mul-sigmoid"](graph)
    for name, x in (("ab", graph.outputs["ab"].src[0]), ("ba", graph.outputs["ba"].src[1])):
        fused = out.outputs[name]
        assert fused.op == "mul_sigmoid" and fused.name == graph.outputs[name].name
        assert fused.src[0].op == "reshape" and fused.src[0].src[0].op == x.src[0].op  # x first, then the gate
        assert fused.src[1].op != "sigmoid"
    assert out.outputs["ba"].src[1].name == "g1" and out.outputs["ba"].src[0].op == "reshape"
    assert out.outputs["shared"].op == "mul" and out.outputs["shared"].src[1] is out.outputs["kept"]
    assert out.outputs["broadcast"].op == "mul"
    rejected = dict(coverage(graph, "fuse-mul-sigmoid")["fuse-mul-sigmoid"].rejected)
    assert "another reader" in rejected["mul 'blk.2.attn_gated'"] and "broadcast" in rejected["mul 'blk.3.attn_gated'"]


def test_view_of_a_view_folds_into_one_view_of_the_base():
    """Qwen3.5's q and gate, views of the q column view of the stacked product, become views of the
    product itself (nothing reads the column view then): strides compose as numpy's would."""
    out = PASSES["fold-reshape-view"](TARGETED_CASES["fold-reshape-view"].build("f32"))
    q, gate = out.outputs["q"].src[0], out.outputs["gate"].src[0]
    assert q.op == gate.op == "view" and q.src[0].op == gate.src[0].op == "mul_mat"
    assert (q.params["strides"], q.params["offset"], gate.params["offset"]) == ((48, 16, 1), 0, 8)


@pytest.mark.parametrize("inner,shape,strides,offset", [
    (((8, 4096), (5120, 1), 0), (8, 8, 256), (4096, 512, 1), 256),  # Qwen3.5's gate, 8 rows
    (((1, 4096), (5120, 1), 7), (1, 8, 256), (4096, 512, 1), 0),
    (((4, 6), (12, 2), 1), (2, 3), (6, 2), 1),
    (((3, 4), (1, 3), 0), (2, 2), (4, 1), 5),
    (((5, 24), (48, 1), 0), (5, 24), (24, 1), 0),
    (((5, 24), (48, 1), 0), (4, 24), (24, 1), 20),  # rows straddle the inner rows: no single view
    (((2, 6), (6, 1), 0), (3, 4), (4, 1), 0),  # a reshape across the inner rows: contiguous, one view
])
def test_compose_strides_agrees_with_numpy(inner, shape, strides, offset):
    from numpy.lib.stride_tricks import as_strided

    from graphir.passes.views import compose_strides

    base = np.arange(100000, dtype=np.int64)
    ishape, istrides, ioffset = inner
    flat = np.ascontiguousarray(as_strided(base[ioffset:], ishape, tuple(s * 8 for s in istrides))).reshape(-1)
    want = as_strided(flat[offset:], shape, tuple(s * 8 for s in strides))
    got = compose_strides(inner, shape, strides, offset)
    straddles = inner[0] == (5, 24) and offset == 20
    assert (got is None) == straddles
    if got is not None:
        assert np.array_equal(as_strided(base[got[1]:], shape, tuple(s * 8 for s in got[0])), want)


def test_qwen3_k_norm_rope_goes_to_the_cache_in_one_op():
    graph, _, _ = source("qwen3-tiny-decode")
    ops = [n.op for n in run_pipeline(graph, "default")]
    layers = graph.meta.get("n_layers", 2)
    assert ops.count("rms_norm_mul_rope_set_rows") == layers and ops.count("rms_norm_mul_rope") == layers  # K; Q
    assert ops.count("set_rows") == layers  # V only


def filecheck(text: str, checks: list[str]) -> None:
    """A tiny FileCheck: CHECK lines match in order (regex; [[V:re]] binds V, [[V]] reuses it); CHECK-NOT
    lines must not match between the previous CHECK and the next."""
    lines, i, env, nots = text.splitlines(), 0, {}, []

    def compile_(pat: str) -> re.Pattern:
        pat = re.sub(r"\[\[(\w+):([^\]]+)\]\]", lambda m: f"(?P<{m[1]}>{m[2]})", pat)
        return re.compile(re.sub(r"\[\[(\w+)\]\]", lambda m: re.escape(env[m[1]]), pat))

    for check in checks:
        kind, pat = check.split(": ", 1)
        if kind == "CHECK-NOT":
            nots.append(pat)
            continue
        rx = compile_(pat)
        while i < len(lines) and not rx.search(lines[i]):
            assert not any(compile_(p).search(lines[i]) for p in nots), f"CHECK-NOT {nots} matched {lines[i]!r}"
            i += 1
        assert i < len(lines), f"no line matches {pat!r} in:\n{text}"
        env.update(rx.search(lines[i]).groupdict())
        nots, i = [], i + 1


def test_golden_dump_after_fuse_add_rms_norm_mul():
    text = dump_text(run_pipeline(case_add_norm("f32"), "fuse-add-rms-norm-mul"))
    filecheck(text, [
        r'CHECK-NOT: = rms_norm\(.*"blk.0.ffn_norm"',
        r'CHECK: %[[F:\d+]] = add_rms_norm_mul\(%\d+, %\d+, %\d+\) \(\[5, 96\] f32, \[5, 96\] f32\) '
        r'\{eps=1e-05\} "blk.0.ffn_norm"',
        r'CHECK: %[[RES:\d+]] = item\(%[[F]]\) \[5, 96\] f32 \{index=1\} "blk.0.ffn_inp"',
        r'CHECK: = item\(%[[F]]\) \[5, 96\] f32 \{index=0\} "blk.0.ffn_norm_w"',
        r'CHECK: = add\(%[[RES]], %\d+\) \[5, 96\] f32 "blk.0.out"',
        r'CHECK: = rms_norm\(.*"blk.1.attn_norm"',
    ])


def test_replay_lint_strict_raises_naming_the_node():
    with pytest.raises(GraphError, match=r"k_past.*param offset=192 .*position=3"):
        run_pipeline(TARGETED_CASES["replay-lint"].build("f32"), "default")


@pytest.mark.parametrize("shape,strides,new", [
    ((5, 24), (48, 1), (5, 3, 8)), ((5, 24), (48, 1), (120,)), ((1, 64), (128, 1), (1, 4, 16)),
    ((4, 6), (12, 2), (2, 2, 6)), ((4, 6), (12, 2), (24,)), ((3, 1, 8), (8, 5, 1), (3, 2, 4)), ((2, 3), (1, 2), (6,)),
])
def test_reshape_strides_agrees_with_numpy(shape, strides, new):
    from numpy.lib.stride_tricks import as_strided

    from graphir.passes.views import reshape_strides

    base = np.arange(1000, dtype=np.int64)  # covers every view below
    a = as_strided(base, shape, tuple(s * 8 for s in strides))
    b = a.view()
    try:
        b.shape = new  # numpy refuses when the reshape needs a copy
        want = tuple(s // 8 for s in b.strides)
    except AttributeError:
        want = None
    got = reshape_strides(shape, strides, new)
    if want is None or got is None:
        assert got == want
    else:  # strides of size-1 axes are arbitrary: compare the elements reached
        assert np.array_equal(as_strided(base, new, tuple(s * 8 for s in got)), a.reshape(new))
