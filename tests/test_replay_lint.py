"""replay-lint and replay_diff: a per-step value baked into a cached graph is caught and named."""

from __future__ import annotations

import pickle

import pytest

from graphir import taint
from graphir.builder import g
from graphir.errors import GraphError
from graphir.examples import build_example
from graphir.ir import Graph
from graphir.passes import coverage, run_pipeline
from graphir.passes.replay_lint import replay_diff

CTX, DIM = 16, 8


def decode_step(pos: int, baked: str | None = None) -> Graph:
    """One decode step reading K rows 0..pos from a cache; `baked` picks a bug to plant."""
    p = taint.step(pos, "position")
    x = g.input("x", (1, DIM))
    cache = g.set_rows(g.state("k_cache", (CTX, DIM)), x, g.input("kv_idx", (1,), "i32"), name="k_cache_write")
    if baked == "view":  # the classic: slice the valid rows at build time
        keys = g.rows(cache, start=0, count=p + 1, name="k_valid")
    elif baked == "const":  # a position literal: numpy strips the taint, replay_diff still sees it
        keys = g.add(cache, g.const([[float(p)] * DIM]), name="k_shifted")
    else:  # right: the whole cache, the valid length is a runtime Input
        keys = cache
    scores = g.mul_mat(keys, x, name="scores")  # [1, rows]
    return Graph({"scores": scores}, meta={"phase": "decode"})


def test_step_ints_stay_tainted_through_arithmetic():
    p = taint.step(5, "position")
    for v in (p + 1, 1 + p, p - 1, 9 - p, p * 4, 4 * p, p // 2, 11 // p, p % 3, -p, (p + 1) * 64):
        assert isinstance(v, taint.StepInt) and v.origin == "position=5"
    assert p == 5 and hash(p) == hash(5) and int(p) + 0 == 5 and type(int(p)) is int
    kv = taint.step(2, "kv offset")
    assert (p + kv).origin == "position=5 and kv offset=2"
    assert pickle.loads(pickle.dumps(p)).origin == "position=5"


def test_params_keep_the_tainted_int():
    view = g.rows(g.state("c", (CTX, DIM)), start=taint.step(3, "position"), count=2)
    assert isinstance(view.params["offset"], taint.StepInt)
    assert taint.find_tainted(tuple(view.params)) == [view.params["offset"]]


def test_baked_view_is_caught_naming_the_node():
    graph = decode_step(6, baked="view")
    with pytest.raises(GraphError, match=r"view 'k_valid' \[7, 8\].*param shape=7 .*position=6.*Input"):
        run_pipeline(graph, "replay-lint")
    report = coverage(graph, "replay-lint{strict=0}")
    assert report["replay-lint"].rejected == [("view 'k_valid'", "param shape holds per-step position=6")]


def test_correct_graphs_pass():
    for graph in (decode_step(6), build_example("prefill"), build_example("decode")):
        assert run_pipeline(graph, "replay-lint") is graph


def test_replay_diff_finds_what_lost_its_taint():
    assert replay_diff(decode_step, 3, 9) == []
    (diff,) = replay_diff(lambda p: decode_step(p, baked="const"), 3, 9)
    assert diff.startswith("node %4 const [1, 8] f32: params {'value': [3.0,") and diff.endswith("(built at 3 vs 9)")
    assert run_pipeline(decode_step(3, baked="const"), "replay-lint")  # the const slipped past the pass
    diffs = replay_diff(lambda p: decode_step(p, baked="view"), 3, 9)
    assert any("'k_valid'" in d and "shape [4, 8] vs [10, 8]" in d for d in diffs), diffs


@pytest.mark.parametrize("spec", ["random:llama-tiny", "random:qwen35-tiny", "random:gemma3-tiny"])
@pytest.mark.parametrize("baked, message", [
    ("pos", r"flash_attn 'blk\.\d+\.attn'.*its query positions const 'pos' \[1\] i32 are not computed from Inputs"),
    ("kv_idx", r"set_rows 'blk\.\d+\.k_cache_write'.*writes KV rows at const 'kv_idx' \[1\] i32"),
    ("kv_len", r"its KV length bound const 'kv_len' \[1\] i32"),
])
def test_a_model_decode_graph_with_a_baked_position_is_flagged(spec, baked, message):
    """A decode graph whose position or KV write row was a Const (built at one position) passed the lint: every
    replay then attended as position 3 and overwrote KV row 3. The model's own graph, and after each backend's
    pipeline, stays clean."""
    import numpy as np

    import graphir
    from graphir.passes.rewrite import rewrite

    graph = graphir.load(spec, backend="reference").graph("decode")
    for pipeline in ("replay-lint", "cpu,replay-lint", "gpu,replay-lint"):
        run_pipeline(graph, pipeline)
    to_const = (lambda n, rw: n if n.op == "input" and n.name == baked else None,
                lambda n, rw: g.const(np.full(n.shape, 3), "i32", name=n.name))
    with pytest.raises(GraphError, match=message):
        run_pipeline(rewrite(graph, [to_const]), "replay-lint")
