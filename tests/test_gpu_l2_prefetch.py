"""L2 prefetch of the next GEMV's weight by the decode add + norm kernel (backends/gpu/l2_prefetch.py).

On the host: which weight each add_rms_norm_mul of a real model graph hands over. On the GPU: with
GRAPHIR_L2_PREFETCH_MB set the decode norms run with prefetching blocks, and the logits and KV caches
are bitwise those without (a prefetch is a hint: a wrong address or size changes no value, so the
wiring is checked by what the launches carry).
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu_helpers import gpu_only, host
from graphir.backends.gpu import l2_prefetch

import graphir
from graphir.passes import run_pipeline


@pytest.mark.parametrize("spec", ["random:qwen3-tiny", "random:llama-tiny"])
def test_each_decode_norm_hands_over_the_weight_its_gemv_reads(spec):
    model = graphir.load(spec, backend="reference", ctx=32)
    graph = run_pipeline(model.graph("decode"), "default")
    users = graph.users()
    norms = [n for n in graph.nodes() if n.op == "add_rms_norm_mul"]
    got = {id(n): l2_prefetch.next_weight(n, users) for n in norms}
    assert norms and all(w is not None for w in got.values()), got
    for n in norms:
        w = got[id(n)]
        readers = [u for it in users[id(n)] if it.params["index"] == 0 for u in users[id(it)]]
        assert [u.src[0] for u in readers if u.op in l2_prefetch.GEMV_OPS] == [w]
    names = sorted(w.name or w.op for w in got.values())
    assert any("attn_q" in nm for nm in names) and any("ffn_gate" in nm for nm in names), names
    assert any(nm in ("output.weight", "token_embd.weight") for nm in names), names  # the head after output_norm


def test_no_weight_when_result_0_feeds_no_gemv():
    from graphir import g
    from graphir.ir import Graph

    a, b, w = g.input("a", (1, 8)), g.input("b", (1, 8)), g.param("w", (8,))
    fused = g.add_rms_norm_mul(a, b, w, eps=1e-6)
    graph = Graph({"y": g.silu(g.item(fused, index=0)), "r": g.item(fused, index=1)})
    assert l2_prefetch.next_weight(fused, graph.users()) is None


@pytest.mark.gpu
@gpu_only
def test_prefetching_norms_change_no_bit(monkeypatch):
    ids = list(np.random.default_rng(3).integers(0, 256, 9))
    runs = {}
    for mb in ("0", "1"):
        monkeypatch.setenv("GRAPHIR_L2_PREFETCH_MB", mb)
        model = graphir.load("random:qwen3-tiny", backend="gpu", passes="default", ctx=64)
        outs = [model.logits(ids)] + [model.feed([t]) for t in (7, 200, 65, 9)]
        launches = [s for _, prog, _ in model.programs._programs.values() for s in prog._steps]
        runs[mb] = ([host(o) for o in outs], {k: host(v) for k, v in model._state.items()}, launches)
    (off, off_state, off_steps), (on, on_state, on_steps) = runs["0"], runs["1"]
    wired = [s for s in on_steps if s.name.startswith("add_rms_norm_mul_v") and s.grid != (1,)]
    assert len(wired) == 2 * 2 + 1, [(s.name, s.grid) for s in on_steps]  # 2 layers x 2 norms, then output_norm
    assert all(s.grid == (1 + l2_prefetch.BLOCKS,) and int(s.args[-1]) > 0 for s in wired)
    assert not any(s.name.startswith("add_rms_norm_mul_v") and s.grid != (1,) and s.grid[0] > 1 and
                   int(s.args[-1]) > 0 for s in off_steps)
    for i, (a, b) in enumerate(zip(on, off)):
        np.testing.assert_array_equal(a, b, err_msg=f"call {i}")
    for k in off_state:
        np.testing.assert_array_equal(on_state[k], off_state[k], err_msg=f"state {k}")
