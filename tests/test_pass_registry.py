"""The pass registry, pipeline strings and flags; and TARGETED_CASES, the graph each pass must fire on.

Adding a pass without an entry in TARGETED_CASES fails this suite (test_every_pass_has_a_targeted_case);
tests/test_passes.py runs every pass on every case, the example and the tiny models.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from graphir import taint
from graphir.builder import g
from graphir.errors import GraphError
from graphir.ir import Graph, Node
from graphir.passes import PASSES, coverage, default_pipeline, parse_pipeline, register_pass, run_pipeline

N, D = 5, 96  # awkward token count; D a multiple of 32 so q8_0 weights fit


@dataclass(frozen=True)
class Case:
    build: Callable[[str], Graph]  # weight dtype -> graph
    effect: str  # an op that must appear after the pass, "fewer-nodes", "findings" (analysis passes) or
    # "f16-state" (State made f16)


def _x(name: str = "x") -> Node:
    return g.input(name, (N, D))


def _w(name: str, n_out: int, wtype: str) -> Node:
    return g.param(name, (n_out, D), wtype)


def case_identities(wtype: str) -> Graph:
    y = g.mul_mat(_w("w", 40, wtype), _x())  # [5, 40]
    y = g.reshape(y, shape=(N, 40))
    y = g.permute(y, axes=(0, 1))
    y = g.cont(g.cast(g.scale(y, s=1.0), dtype="f32"))
    y = g.view(y, shape=(N, 40), strides=(40, 1), offset=0)
    kept = g.cont(g.rows(y, 1, 3), name="kept")  # a real copy of a view: stays
    return Graph({"y": g.silu(y), "kept": kept}, meta={"case": "identities"})


def case_duplicates(wtype: str) -> Graph:
    x = _x()
    a = g.mul_mat(_w("w", 40, wtype), x, name="a")
    b = g.mul_mat(g.param("w", (40, D), wtype), g.input("x", (N, D)), name="b")  # same leaves, asked twice
    c = g.add(g.silu(a), g.silu(b), name="c")
    write = g.set_rows(g.state("cache", (8, 40)), c, g.input("rows", (N,), "i32"), name="cache_write")
    return Graph({"c": c, "d": g.mul(g.silu(a), g.sigmoid(b))}, updates=[write], meta={"case": "duplicates"})


def case_add_norm(wtype: str) -> Graph:
    s = g.add(_x("a"), _x("b"), name="blk.0.ffn_inp")
    h = g.mul(g.rms_norm(s, eps=1e-5, name="blk.0.ffn_norm"), g.param("blk.0.ffn_norm.weight", (D,)),
              name="blk.0.ffn_norm_w")
    out = g.add(s, g.mul_mat(_w("blk.0.ffn.weight", D, wtype), h), name="blk.0.out")
    # blocked: the raw norm of `out` is also an output, so it must stay materialized
    raw = g.rms_norm(out, eps=1e-5, name="blk.1.attn_norm")
    h2 = g.mul(raw, g.param("blk.1.attn_norm.weight", (D,)))
    return Graph({"out": out, "h2": h2, "raw": raw}, meta={"case": "add_norm"})


def case_projections(wtype: str) -> Graph:
    x = _x()
    q = g.mul_mat(_w("attn_q.weight", 40, wtype), x, name="q")  # [5, 40]
    k = g.mul_mat(_w("attn_k.weight", 24, wtype), x, name="k")  # [5, 24]
    v = g.mul_mat(_w("attn_v.weight", 24, "f16"), x, name="v")  # another dtype: not stacked with q, k
    x2 = g.silu(x)
    gate = g.mul_mat(_w("ffn_gate.weight", 72, wtype), x2, name="gate")
    up = g.mul_mat(_w("ffn_up.weight", 72, wtype), x2, name="up")
    again = g.mul_mat(_w("ffn_gate.weight", 72, wtype), x2, name="gate_again")  # same weight: stacked once
    return Graph({"q": q, "k": k, "v": v, "gate": gate, "up": g.add(up, again)}, meta={"case": "projections"})


def case_views(wtype: str) -> Graph:
    y = g.mul_mat(_w("w", 48, wtype), _x())  # [5, 48]
    heads = g.reshape(g.cols(y, 8, 24), shape=(N, 3, 8))  # [5, 3, 8], strides [48, 8, 1]
    t = g.permute(heads, axes=(1, 0, 2))  # [3, 5, 8]
    odd = g.reshape(g.view(y, shape=(N, 6), strides=(48, 2), offset=1), shape=(30,))  # needs a copy: stays
    # Qwen3.5's gated q: per head [q | gate] in columns 0..31, q and gate taken as views of that view
    q_gate = g.cols(y, 0, 32)  # [5, 32], strides [48, 1]
    halves = [g.view(q_gate, shape=(N, 2, 8), strides=(32, 16, 1), offset=o) for o in (0, 8)]
    return Graph({"t": g.cont(t), "odd": odd, "q": g.cont(halves[0]), "gate": g.cont(halves[1])},
                 meta={"case": "views"})


def case_swiglu(wtype: str) -> Graph:
    x = _x()
    a = g.mul_mat(_w("ffn_gate.weight", 40, wtype), x)
    b = g.mul_mat(_w("ffn_up.weight", 40, wtype), x)
    return Graph({"ab": g.mul(g.silu(a), b), "ba": g.mul(b, g.silu(a))}, meta={"case": "swiglu"})


def case_stacked_swiglu(wtype: str) -> Graph:
    """What stack-projections and swiglu-split leave of a decode FFN: the activation of the two halves
    of one stacked product (fused), next to one whose product is also an output (kept)."""
    x, half = _x(), 40

    def halves(name: str) -> tuple[Node, Node, Node]:
        y = g.mul_mat(_w(name, 2 * half, wtype), x)
        return y, *(g.view(y, shape=(N, half), strides=(2 * half, 1), offset=o) for o in (0, half))

    _, a, b = halves("blk.0.ffn_gate.weight+blk.0.ffn_up.weight")
    y1, a1, b1 = halves("blk.1.ffn_gate.weight+blk.1.ffn_up.weight")
    return Graph({"act": g.swiglu_split(a, b, name="blk.0.ffn_act"), "kept": g.swiglu_split(a1, b1), "y1": y1},
                 meta={"case": "stacked_swiglu"})


def _heads(name: str, wtype: str, x: Node) -> Node:
    return g.reshape(g.mul_mat(_w(name, 24, wtype), x), shape=(N, 3, 8))  # [5, 3, 8]


def case_rope_cache(wtype: str) -> Graph:
    x, pos, rows = _x(), g.input("pos", (N,), "i32"), g.input("rows", (N,), "i32")
    rope = {"n_dims": 8, "mode": "neox", "theta": 10000.0}
    q = g.rope(_heads("attn_q.weight", wtype, x), pos, **rope)
    k = g.rope(_heads("attn_k.weight", wtype, x), pos, name="k_rope", **rope)
    k_all = g.set_rows(g.state("k_cache", (16, 3, 8), "f16"), k, rows, name="k_cache_write")
    v_all = g.set_rows(g.state("v_cache", (16, 3, 8), "f16"), _heads("attn_v.weight", wtype, x), rows)
    o = g.flash_attn(q, k_all, v_all, pos, g.input("kv_len", (1,), "i32"), scale=0.35)
    # a flat cache: rope of the first 4 dims, reshaped to rows [n, 24] before the write
    flat = g.rope(_heads("attn_k2.weight", wtype, x), pos, n_dims=4, mode="norm")
    w2 = g.set_rows(g.state("flat_cache", (16, 24)), g.reshape(flat, shape=(N, 24)), rows)
    return Graph({"o": o}, updates=[w2], meta={"case": "rope_cache"})


def case_kv_cache(wtype: str) -> Graph:
    """f32 KV caches read by attention: one [ctx, heads, d], one flat [ctx, heads * d] read through a reshape
    (Qwen3.5's layout); and State that must stay f32: rows written but read by no attention (a recurrent
    steps buffer), a whole-buffer recurrent state."""
    x, pos, rows = _x(), g.input("pos", (N,), "i32"), g.input("rows", (N,), "i32")
    q = _heads("attn_q.weight", wtype, x)
    k_all = g.set_rows(g.state("blk.0.k_cache", (16, 3, 8)), _heads("attn_k.weight", wtype, x), rows)
    v_flat = g.reshape(_heads("attn_v.weight", wtype, x), shape=(N, 24))
    v_all = g.reshape(g.set_rows(g.state("blk.0.v_cache", (16, 24)), v_flat, rows), shape=(16, 3, 8))
    o = g.flash_attn(q, k_all, v_all, pos, g.input("kv_len", (1,), "i32"), scale=0.35)
    steps = g.set_rows(g.state("blk.1.ssm_steps", (16, 24)), v_flat, rows)
    recurrent = g.assign(g.state("blk.1.ssm_state", (N, D)), x)
    return Graph({"o": o}, updates=[steps, recurrent], meta={"case": "kv_cache"})


def case_qk_norm(wtype: str) -> Graph:
    x, pos = _x(), g.input("pos", (N,), "i32")
    q = g.mul(g.rms_norm(_heads("attn_q.weight", wtype, x), eps=1e-6), g.param("attn_q_norm.weight", (8,)))
    q = g.rope(q, pos, n_dims=8, mode="neox", theta=1e6, name="q_rope")
    k = g.mul(g.rms_norm(_heads("attn_k.weight", wtype, x), eps=1e-6), g.param("attn_k_norm.weight", (8,)))
    k_rope = g.rope(k, pos, n_dims=8, mode="neox", theta=1e6)  # k is also an output: not fused
    return Graph({"q": q, "k": k, "k_rope": k_rope}, meta={"case": "qk_norm"})


def case_baked_position(wtype: str) -> Graph:
    """The bug replay-lint exists for: a KV offset computed from the step, baked into a view."""
    pos = taint.step(3, "position")
    cache = g.state("k_cache", (16, D))
    past = g.rows(cache, start=pos - 1, count=2, name="k_past")  # [2, 96], offset (pos - 1) * 96
    return Graph({"y": g.mul_mat(_w("w", 40, wtype), past)}, meta={"case": "baked_position"})


def case_ssm_conv(wtype: str) -> Graph:
    """DeltaNet conv steps: silu of the conv output fuses; the layer whose raw conv is also an output does not."""
    x = g.mul_mat(_w("attn_qkv.weight", 40, wtype), _x())  # [5, 40]
    outs, updates = {}, []
    for i in range(2):
        s = g.state(f"blk.{i}.conv_state", (3, 40))
        conv = g.ssm_conv(x, s, g.param(f"blk.{i}.ssm_conv1d.weight", (40, 4)), name=f"blk.{i}.ssm_conv")
        updates.append(g.assign(s, g.item(conv, index=1)))
        outs[f"y{i}"] = g.silu(g.item(conv, index=0))
    outs["raw"] = g.item(conv, index=0)  # blocked: layer 1's pre-activation must stay
    return Graph(outs, updates, meta={"case": "ssm_conv"})


def case_delta_net(wtype: str) -> Graph:
    """Gated delta rules with gates from raw projections (fused), and one whose beta is not a sigmoid (not)."""
    x, hk, hv, dk, dv = _x(), 2, 4, 8, 6
    outs, updates = {}, []
    for i in range(2):
        q = g.l2_norm(g.input(f"q{i}", (N, hk, dk)), eps=1e-6)
        k = g.l2_norm(g.input(f"k{i}", (N, hk, dk)), eps=1e-6)
        alpha = g.mul_mat(_w(f"blk.{i}.ssm_alpha.weight", hv, wtype), x)  # [5, 4]; stacks with beta
        b = g.mul_mat(_w(f"blk.{i}.ssm_beta.weight", hv, wtype), x)
        a_neg = g.neg(g.exp(g.param(f"blk.{i}.A_log", (hv,))))  # HF's -exp(A_log)
        gate = g.mul(g.softplus(g.add(alpha, g.param(f"blk.{i}.ssm_dt.bias", (hv,)))), a_neg)
        beta = g.sigmoid(b) if i == 0 else g.scale(b, s=0.1, b=0.5)
        s = g.state(f"blk.{i}.ssm_state", (hv, dk, dv))
        res = g.gated_delta_net(q, k, g.input(f"v{i}", (N, hv, dv)), gate, beta, s, scale=dk ** -0.5,
                                name=f"blk.{i}.delta_net")
        updates.append(g.assign(s, g.item(res, index=1)))
        outs[f"o{i}"] = g.item(res, index=0)
    return Graph(outs, updates, meta={"case": "delta_net"})


def case_delta_net_l2(wtype: str) -> Graph:
    """Fused delta rules reading l2-normalized q, k: the norms join the op in layer 0; layer 1's
    normalized k is also an output, so its norms stay."""
    x, hk, hv, dk, dv = _x(), 2, 4, 8, 6
    outs, updates = {}, []
    for i in range(2):
        q = g.l2_norm(g.input(f"q{i}", (N, hk, dk)), eps=1e-6)
        k = g.l2_norm(g.input(f"k{i}", (N, hk, dk)), eps=1e-6)
        alpha = g.mul_mat(_w(f"blk.{i}.ssm_alpha.weight", hv, wtype), x)
        b = g.mul_mat(_w(f"blk.{i}.ssm_beta.weight", hv, wtype), x)
        s = g.state(f"blk.{i}.ssm_state", (hv, dk, dv))
        a_neg = g.neg(g.exp(g.param(f"blk.{i}.A_log", (hv,))))  # negative: the state decays
        res = g.gated_delta_net_raw(q, k, g.input(f"v{i}", (N, hv, dv)), alpha, b, a_neg,
                                    g.param(f"blk.{i}.ssm_dt.bias", (hv,)), s, scale=dk ** -0.5,
                                    name=f"blk.{i}.delta_net")
        updates.append(g.assign(s, g.item(res, index=1)))
        outs[f"o{i}"] = g.item(res, index=0)
        if i == 1:
            outs["k1"] = k
    return Graph(outs, updates, meta={"case": "delta_net_l2"})


def case_gated_norm(wtype: str) -> Graph:
    """Qwen3.5's gated output norm, silu(z) * (rms_norm(o) * w); in the second, the norm is also read."""
    x, heads, hd = _x(), 3, 32
    outs = {}
    for i in range(2):
        z = g.reshape(g.mul_mat(_w(f"blk.{i}.attn_gate.weight", heads * hd, wtype), x), shape=(N, heads, hd))
        normed = g.rms_norm(g.input(f"o{i}", (N, heads, hd)), eps=1e-6)
        scaled = g.mul(normed, g.param(f"blk.{i}.ssm_norm.weight", (hd,)), name=f"blk.{i}.ssm_norm")
        outs[f"y{i}"] = g.swiglu_split(z, scaled, name=f"blk.{i}.ssm_gated")
        if i == 1:
            outs["normed1"] = normed
    return Graph(outs, meta={"case": "gated_norm"})


def case_sigmoid_gate(wtype: str) -> Graph:
    """Qwen3.5's gated attention output attn * sigmoid(gate), in both operand orders (fused); one whose
    sigmoid is also an output and one that broadcasts the gate (both kept)."""
    x = _x()
    heads = [g.reshape(g.mul_mat(_w(f"blk.{i}.attn_q.weight", 24, wtype), x), shape=(N, 3, 8)) for i in range(4)]
    gate = g.reshape(g.mul_mat(_w("blk.0.attn_gate.weight", 24, wtype), x), shape=(N, 3, 8))
    kept = g.sigmoid(g.input("g2", (N, 3, 8)), name="blk.2.gate_sigmoid")
    return Graph({"ab": g.mul(heads[0], g.sigmoid(gate), name="blk.0.attn_gated"),
                  "ba": g.mul(g.sigmoid(g.input("g1", (N, 3, 8))), heads[1], name="blk.1.attn_gated"),
                  "shared": g.mul(heads[2], kept, name="blk.2.attn_gated"), "kept": kept,
                  "broadcast": g.mul(heads[3], g.sigmoid(g.input("g3", (N, 3, 1))), name="blk.3.attn_gated")},
                 meta={"case": "sigmoid_gate"})


def case_ffn(wtype: str) -> Graph:
    """A gated FFN: gate and up column-parallel, down row-parallel with an all_reduce (shard-tp);
    every projection a weight times many rows (gemm-bf16)."""
    x, d_ff = _x(), 64
    a = g.mul_mat(_w("blk.0.ffn_gate.weight", d_ff, wtype), x)
    b = g.mul_mat(_w("blk.0.ffn_up.weight", d_ff, wtype), x)
    down = g.param("blk.0.ffn_down.weight", (D, d_ff), wtype)
    return Graph({"y": g.add(x, g.mul_mat(down, g.mul(g.silu(a), b)))}, meta={"case": "ffn"})


def case_bf16_ffn(wtype: str) -> Graph:
    """What gemm-bf16 leaves of a prefill FFN: gate and up products read only by swiglu_split (rounded by
    gemm-bf16-out), next to a product that is also an output and one that an add reads (both kept)."""
    x, d_ff = _x(), 64
    gate = g.mul_mat_bf16(_w("blk.0.ffn_gate.weight", d_ff, wtype), x)
    up = g.mul_mat_bf16(_w("blk.0.ffn_up.weight", d_ff, wtype), x)
    down = g.param("blk.0.ffn_down.weight", (D, d_ff), wtype)
    shown = g.mul_mat_bf16(_w("blk.1.ffn_gate.weight", d_ff, wtype), x)
    added = g.mul_mat_bf16(_w("blk.1.ffn_up.weight", d_ff, wtype), x)
    return Graph({"y": g.add(x, g.mul_mat_bf16(down, g.swiglu_split(gate, up))),
                  "z": g.swiglu_split(shown, g.add(added, added)), "shown": shown}, meta={"case": "bf16_ffn"})


def case_attention(wtype: str) -> Graph:
    """Causal attention over a KV cache: a prefill of 19 queries (more than attn-bf16's max_decode_queries:
    it rewrites it) and a decode-sized one of 2 queries (kept in f32)."""
    outs = {}
    n = 19
    x = g.input("x", (n, D))
    for i, n_q in enumerate((n, 2)):
        q = g.reshape(g.mul_mat(_w(f"blk.{i}.attn_q.weight", 32, wtype), x), shape=(n, 4, 8))  # [19, 4 heads, 8]
        q = g.rows(q, 0, n_q)
        k, v = g.state(f"blk.{i}.k_cache", (32, 2, 8)), g.state(f"blk.{i}.v_cache", (32, 2, 8))
        outs[f"o{i}"] = g.flash_attn(q, k, v, g.input(f"pos{i}", (n_q,), "i32"), g.input(f"len{i}", (1,), "i32"),
                                     scale=0.35, name=f"blk.{i}.attn")
    return Graph(outs, meta={"case": "attention"})



def case_decode_matmuls(wtype: str) -> Graph:
    """One decode step's projections (1 row of x): a q4_0 weight and a stacked q4_0 gate|up activation (q8- and
    q16-activations rewrite both whatever wtype is), a weight of wtype (q8-activations rewrites it where q8_0;
    kept where f32, and by q16-activations), and the same q4_0 weight times N rows (prefill: kept)."""
    x1, xn = g.input("x1", (1, D)), _x()
    q = g.mul_mat(_w("blk.0.attn_q.weight", 40, "q4_0"), x1, name="q")
    o = g.mul_mat(_w("blk.0.attn_output.weight", 24, wtype), x1, name="o")
    act = g.mul_mat_swiglu(_w("blk.0.ffn_gate.weight+blk.0.ffn_up.weight", 2 * 40, "q4_0"), x1, name="blk.0.ffn_act")
    pre = g.mul_mat(_w("blk.0.attn_q.weight", 40, "q4_0"), xn, name="q_prefill")
    return Graph({"q": q, "o": o, "act": act, "pre": pre}, meta={"case": "decode_matmuls"})

TARGETED_CASES: dict[str, Case] = {
    "shard-tp": Case(case_ffn, "all_reduce"),
    "gemm-bf16": Case(case_ffn, "mul_mat_bf16"),
    "gemm-bf16-out": Case(case_bf16_ffn, "mul_mat_bf16_rounded"),
    "attn-bf16": Case(case_attention, "flash_attn_bf16"),
    "q8-activations": Case(case_decode_matmuls, "mul_mat_q8x"),
    "q16-activations": Case(case_decode_matmuls, "mul_mat_q16x"),
    "kv-f16": Case(case_kv_cache, "f16-state"),
    "dce": Case(case_identities, "fewer-nodes"),
    "cse": Case(case_duplicates, "fewer-nodes"),
    "fuse-add-rms-norm-mul": Case(case_add_norm, "add_rms_norm_mul"),
    "stack-projections": Case(case_projections, "concat"),
    "fold-reshape-view": Case(case_views, "fewer-nodes"),
    "swiglu-split": Case(case_swiglu, "swiglu_split"),
    "fuse-rope-set-rows": Case(case_rope_cache, "rope_set_rows"),
    "fuse-qk-norm-rope": Case(case_qk_norm, "rms_norm_mul_rope"),
    "replay-lint": Case(case_baked_position, "findings"),
    "fuse-ssm-conv-silu": Case(case_ssm_conv, "ssm_conv_silu"),
    "fuse-gated-delta-net-raw": Case(case_delta_net, "gated_delta_net_raw"),
    "fuse-gated-delta-net-l2": Case(case_delta_net_l2, "fewer-nodes"),
    "fuse-rms-norm-mul-gate": Case(case_gated_norm, "rms_norm_mul_gate"),
    "fuse-mul-sigmoid": Case(case_sigmoid_gate, "mul_sigmoid"),
    "fuse-mul-mat-swiglu": Case(case_stacked_swiglu, "mul_mat_swiglu"),
}


def test_every_pass_has_a_targeted_case():
    missing = sorted(set(PASSES) - set(TARGETED_CASES))
    assert not missing, f"passes without a TARGETED_CASES entry in tests/test_pass_registry.py: {missing}"
    assert not set(TARGETED_CASES) - set(PASSES), "TARGETED_CASES names a pass that is not registered"


@pytest.mark.parametrize("name", sorted(PASSES))
def test_pass_has_name_and_one_line_description(name):
    p = PASSES[name]
    assert p.name == name and p.description and "\n" not in p.description


def test_unknown_pass_lists_known_ones():
    with pytest.raises(GraphError, match=r"unknown pass 'fuse-everything'.*known: default, cpu, gpu, attn-bf16, cse"):
        parse_pipeline("dce,fuse-everything")


def test_pipeline_options_are_dataclass_fields():
    assert parse_pipeline("dce, replay-lint{strict=0} ,cse") == [("dce", {}), ("replay-lint", {"strict": False}),
                                                                 ("cse", {})]
    assert PASSES["replay-lint"].options == {"strict": True}
    with pytest.raises(GraphError, match=r"replay-lint.*unknown option 'loud'"):
        parse_pipeline("replay-lint{loud=1}")
    with pytest.raises(GraphError, match="needs a value"):
        parse_pipeline("replay-lint{strict}")
    with pytest.raises(GraphError, match="takes no options"):
        PASSES["dce"](case_identities("f32"), level=2)
    with pytest.raises(GraphError, match="cannot parse"):
        parse_pipeline("dce;cse")


def test_default_expands_and_no_fusion_flag(monkeypatch):
    names = [n for n, _ in parse_pipeline("default")]
    assert names == default_pipeline() and "fuse-add-rms-norm-mul" in names and names[-2:] == ["dce", "cse"]
    monkeypatch.setenv("GRAPHIR_NO_FUSION", "1")
    assert not [n for n, _ in parse_pipeline("default") if n.startswith(("fuse", "stack", "swiglu"))]


def test_register_twice_fails():
    with pytest.raises(GraphError, match="registered twice"):
        register_pass("dce", "again")(lambda graph: graph)


@pytest.mark.parametrize("name", sorted(PASSES))
def test_pass_keeps_outputs_updates_and_meta(name):
    if name == "shard-tp":
        pytest.skip("shard-tp gives each rank its own State updates and records its plan in meta['tp'] "
                    "(tests/test_shard_tp.py checks both)")
    graph = TARGETED_CASES["fuse-rope-set-rows"].build("f32")  # has outputs, an update and meta
    out = PASSES[name](graph)
    assert list(out.outputs) == list(graph.outputs) and len(out.updates) == len(graph.updates)
    assert out.meta == graph.meta


def test_verify_flag_names_the_pass(monkeypatch):
    @register_pass("test-break-shape", "a broken pass, for this test only")
    def broken(graph: Graph) -> Graph:
        out = graph.outputs["y"]
        return Graph({**graph.outputs, "y": out.replace(shape=(1, 1))})  # its names kept: run_pipeline checks them

    try:
        graph = case_identities("f32")
        run_pipeline(graph, "test-break-shape")  # flag off: no verifier
        monkeypatch.setenv("GRAPHIR_VERIFY_PASSES", "1")
        with pytest.raises(GraphError, match="after pass 'test-break-shape'"):
            run_pipeline(graph, "dce,test-break-shape")
    finally:
        del PASSES["test-break-shape"]


def test_dump_flag_prints_after_each_pass(monkeypatch, capsys):
    monkeypatch.setenv("GRAPHIR_DUMP_PASSES", "1")
    run_pipeline(case_swiglu("f32"), "swiglu-split,dce")
    text = capsys.readouterr().out
    assert "# after pass swiglu-split" in text and "# after pass dce" in text and "swiglu_split(" in text


def test_coverage_report_counts_and_renders():
    report = coverage(case_projections("f32"), "cse,stack-projections,cse")
    assert set(report.passes) == {"cse", "stack-projections", "cse#2"}
    pc = report["stack-projections"]
    assert len(pc.matched) == 2 and pc.nodes_after > pc.nodes_before
    assert any("v" in s and "f16" in why for s, why in pc.rejected), pc.rejected
    assert "stack-projections: 2 matched, 1 rejected" in report.text()


def test_a_rule_that_wires_in_a_replaced_source_by_hand_fails():
    """The rewrite walker's check: reading an old node the walk already replaced is an error, not a
    silently stale subgraph; rw.make swaps old sources for their rebuilt versions."""
    from graphir.builder import make
    from graphir.passes.rewrite import rewrite

    x = g.input("x", (3, 4))
    graph = Graph({"y": g.mul(g.silu(x), x)})
    to_sigmoid = (lambda n, rw: n if n.op == "silu" else None, lambda n, rw: rw.make("sigmoid", n.src[0]))
    by_hand = (lambda n, rw: n if n.op == "mul" else None, lambda n, rw: make("add", *n.src))
    with pytest.raises(GraphError, match=r"rewrite of mul.*reads the old silu.*rw\.make"):
        rewrite(graph, [to_sigmoid, by_hand])
    with_make = (lambda n, rw: n if n.op == "mul" else None, lambda n, rw: rw.make("add", *n.src))
    out = rewrite(graph, [to_sigmoid, with_make])
    assert [n.op for n in out.nodes() if n.op not in ("input",)] == ["sigmoid", "add"]


@pytest.mark.parametrize("result, message", [
    (lambda graph: None, r"pass 'test-bad-result' returned NoneType, not a Graph \(a missing return\?\)"),
    (lambda graph: graph.outputs, r"pass 'test-bad-result' returned dict, not a Graph"),
    (lambda graph: Graph({"renamed": graph.outputs["y"], "kept": graph.outputs["kept"]}, graph.updates, graph.meta),
     r"pass 'test-bad-result' changed the output names \['y', 'kept'\] to \['renamed', 'kept'\]"),
])
def test_a_pass_that_breaks_the_result_contract_is_named(result, message):
    """A pass returning None (or a dict) failed later as "object of type 'NoneType' has no len()" (coverage, check,
    or the next pass); one renaming an output ran, and check() reported 'worst logits rel inf'."""
    register_pass("test-bad-result", "a broken pass, for this test only")(result)
    try:
        graph = case_identities("f32")
        for run in (lambda: run_pipeline(graph, "test-bad-result"), lambda: run_pipeline(graph, "test-bad-result,dce"),
                    lambda: coverage(graph, "test-bad-result")):
            with pytest.raises(GraphError, match=message):
                run()
    finally:
        del PASSES["test-bad-result"]


def test_a_bool_option_takes_only_bool_words():
    """strict=ture (any word but 1/true/yes) parsed as False: a typo silently turned replay-lint's strict mode off."""
    assert parse_pipeline("replay-lint{strict=TRUE}") == [("replay-lint", {"strict": True})]
    assert parse_pipeline("replay-lint{strict=off}") == [("replay-lint", {"strict": False})]
    with pytest.raises(GraphError, match=r"pass 'replay-lint': option strict='ture' is not a bool"):
        parse_pipeline("replay-lint{strict=ture}")


@pytest.mark.parametrize("name", ["my pass", "my.pass", "", "a,b", "x{y}"])
def test_a_pass_name_a_pipeline_cannot_spell_is_refused(name):
    """register_pass("my.pass", ...) registered a pass that no pipeline could run ("cannot parse at '.pass'")."""
    with pytest.raises(GraphError, match="cannot be written in a pipeline"):
        register_pass(name, "unreachable")(lambda graph: graph)
    assert name not in PASSES


def test_an_option_a_pipeline_cannot_type_is_named():
    """A dataclass pass with `rank: int | None = None` failed on 'p{rank=1}' with "NoneType takes no arguments"."""
    @register_pass("test-none-option", "a pass whose option defaults to None, for this test only")
    @dataclass(frozen=True)
    class NoneOption:
        rank: int | None = None
        n: int = 1

        def __call__(self, graph: Graph) -> Graph:
            return graph

    try:
        assert parse_pipeline("test-none-option{n=2}") == [("test-none-option", {"n": 2})]
        with pytest.raises(GraphError, match=r"pass 'test-none-option': option rank has a default of None, so a "
                                             r"pipeline string cannot set it"):
            parse_pipeline("test-none-option{rank=1}")
    finally:
        del PASSES["test-none-option"]


def test_a_rule_whose_replacement_has_another_shape_fails_naming_it():
    """Readers of a replaced node are rebuilt keeping their own shapes, so silu(x) [3, 4] replaced by mean(x) [3, 1]
    passed run_pipeline; only the verifier at lowering caught it, naming the reader: "mul ... b [3, 4] does not
    broadcast onto a [3, 1]"."""
    from graphir.passes.rewrite import rewrite

    x = g.input("x", (3, 4))
    graph = Graph({"y": g.mul(g.silu(x, name="act"), x)})
    to_mean = (lambda n, rw: n if n.op == "silu" else None, lambda n, rw: rw.make("mean", n.src[0], name=n.name))
    with pytest.raises(GraphError, match=r"rewrite of silu 'act' \[3, 4\] f32: the replacement mean 'act' \[3, 1\] "
                                         r"f32 has another shape; its readers expect \[3, 4\]"):
        rewrite(graph, [to_mean])


def test_an_error_inside_a_pass_names_the_pass():
    """A rewrite error ("rewrite of mul ...: the replacement reads the old silu") named no pass, and a pass's own
    exception said nothing of the pipeline it was raised in."""
    from graphir.passes.rewrite import rewrite

    by_hand = (lambda n, rw: n if n.op == "mul" else None, lambda n, rw: g.add(*n.src))
    to_sigmoid = (lambda n, rw: n if n.op == "silu" else None, lambda n, rw: rw.make("sigmoid", n.src[0]))
    register_pass("test-stale", "a broken pass, for this test only")(
        lambda graph: rewrite(graph, [to_sigmoid, by_hand]))

    @register_pass("test-raises", "a pass that raises, for this test only")
    def raises(graph: Graph) -> Graph:
        raise ValueError("boom")

    try:
        x = g.input("x", (3, 4))
        graph = Graph({"y": g.mul(g.silu(x), x)})
        with pytest.raises(GraphError, match=r"^pass 'test-stale': rewrite of mul .* reads the old silu"):
            run_pipeline(graph, "dce,test-stale")
        with pytest.raises(ValueError, match="boom") as info:
            run_pipeline(graph, "dce,test-raises")
        assert info.value.__notes__ == ["graphir: raised in pass 'test-raises' of the pipeline 'dce,test-raises'"]
        with pytest.raises(GraphError, match=r"^replay-lint: "):  # a pass that names itself is left as it is
            run_pipeline(case_baked_position("f32"), "replay-lint")
    finally:
        del PASSES["test-stale"], PASSES["test-raises"]


def test_a_repeated_option_or_a_pipeline_that_is_no_string_is_refused():
    """{max_rows=1,max_rows=16} read as 16 without a word; run_pipeline(graph, None) was "'NoneType' object is not
    subscriptable"."""
    with pytest.raises(GraphError, match=r"option 'max_rows' is given twice"):
        parse_pipeline("q16-activations{max_rows=1,max_rows=16}")
    with pytest.raises(GraphError, match=r'pipeline must be a string of pass names \("" for none\), got None'):
        run_pipeline(case_identities("f32"), None)


@pytest.mark.parametrize("spec, rule", [
    ("stack-projections{max_rows=-3}", "max_rows=-3 must be >= 0"),
    ("gemm-bf16{min_rows=0}", "min_rows=0 must be >= 1"),
    ("q8-activations{max_rows=-1}", "'q8-activations': option max_rows=-1 must be >= 0"),
    ("q16-activations{max_rows=-2}", "'q16-activations': option max_rows=-2 must be >= 0"),
    ("attn-bf16{max_decode_queries=-1}", "max_decode_queries=-1 must be >= 0"),
    ("shard-tp{n=0}", "n=0 must be >= 1"),
    ("shard-tp{rank=-4}", "rank=-4 must be >= -1"),
])
def test_a_count_option_out_of_range_is_refused_when_parsed(spec, rule):
    """A negative row count matched nothing without a word (stack-projections{max_rows=-3} stacked nothing and
    `graphir check` passed): the pass refuses it, and parsing the pipeline already says so."""
    with pytest.raises(GraphError, match=re.escape(rule)):
        parse_pipeline(spec)
    name, value = spec.rstrip("}").split("{")
    key, number = value.split("=")
    with pytest.raises(GraphError, match=re.escape(rule)):
        PASSES[name].configured(**{key: int(number)})


def test_count_options_at_their_bounds_are_taken():
    for spec in ("stack-projections{max_rows=0}", "gemm-bf16{min_rows=1}", "q16-activations{max_rows=0}",
                 "attn-bf16{max_decode_queries=0}", "shard-tp{n=1,rank=-1}", "shard-tp{n=2,rank=0}"):
        assert parse_pipeline(spec)
