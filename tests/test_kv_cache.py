"""The KV cache: any way of cutting the tokens into calls gives the logits of one prefill."""

from __future__ import annotations

import numpy as np
import pytest

import graphir

IDS = [72, 101, 108, 108, 111, 44, 32, 256, 119, 111, 114, 108, 100]  # 13 tokens
PRESETS = ["random:llama-tiny", "random:qwen3-tiny"]


@pytest.fixture(scope="module", params=PRESETS)
def model(request):
    return graphir.load(request.param, backend="reference", passes="")


@pytest.fixture(scope="module")
def one_prefill(model):
    model.prefill_buckets = (len(IDS),)
    try:
        return model.logits(IDS)
    finally:
        model.prefill_buckets = graphir.api.PREFILL_BUCKETS


def assert_rows_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), f"position {step}"


def test_token_by_token_decode_matches_one_prefill(model, one_prefill):
    model.reset()
    rows = [model.feed([t]) for t in IDS]
    assert all(r.shape == (1, model.config.n_vocab) for r in rows)
    assert_rows_close(np.concatenate(rows), one_prefill)


# the last chunk is padded up to a bucket, or is one decode step for a single last token (api.Model.chunks)
@pytest.mark.parametrize("buckets, chunks", [((7,), [7, 7]), ((3,), [3, 3, 3, 3, 1]), ((8, 3), [8, 8]),
                                             (graphir.api.PREFILL_BUCKETS, [8, 8])])
def test_chunked_prefill_matches_one_prefill(model, one_prefill, buckets, chunks):
    model.prefill_buckets = buckets
    try:
        assert model.chunks(len(IDS)) == chunks
        assert_rows_close(model.logits(IDS), one_prefill)
    finally:
        model.prefill_buckets = graphir.api.PREFILL_BUCKETS


def test_feeding_continues_the_cache(model, one_prefill):
    model.reset()
    first = model.feed(IDS[:5])
    last = model.feed(IDS[5:], last_only=True)
    assert model.n_past == len(IDS)
    assert_rows_close(first, one_prefill[:5])
    assert_rows_close(last, one_prefill[-1:])


def test_reset_forgets_the_cache(model, one_prefill):
    model.reset()
    model.feed([1, 2, 3])  # rows the next sequence must not see
    model.reset()
    assert_rows_close(model.feed(IDS), one_prefill)


def test_one_decode_graph_serves_every_position(model):
    decode = model.graph("decode")
    assert decode.signature() == model.graph("decode").signature()
    assert [n.name for n in decode.inputs] == ["tokens", "pos", "kv_idx", "kv_len"]
    assert {n.name for n in decode.states} == {f"blk.{i}.{kv}_cache" for i in range(model.config.n_layers)
                                               for kv in "kv"}
    model.programs.clear()
    list(model.generate(IDS, 20, stop_at_eos=False))  # prompt 8+1*5, then 19 decode steps
    # the prompt's chunk graphs (at most one per bucket) and the decode step that samples in the graph
    assert len(model.programs) <= 3
    lowered = len(model.programs)
    list(model.generate(IDS[::-1], 20, stop_at_eos=False))  # other tokens at the same positions
    assert len(model.programs) == lowered
    assert model.stats["prefill_tokens"] == len(IDS) and model.stats["decode_tokens"] == 19


def test_last_only_takes_the_last_row_before_the_output_norm(model):
    graph = model.graph("prefill", 8, last_only=True)
    assert graph.outputs["logits"].shape == (1, model.config.n_vocab)
    assert any(n.name == "last_row" and n.op == "view" for n in graph)


def test_gpu_buckets_take_long_prompts_in_few_large_calls():
    """The gpu backend's plan (GPU_PREFILL_BUCKETS, GPU_CALL_COST): one call for 4096 tokens, and a
    few for awkward lengths, each bucket a power of two; the same planner as the cpu's."""
    model = graphir.load("random:llama-tiny", backend="reference", ctx=8192)
    model.prefill_buckets, model.call_cost = graphir.api.GPU_PREFILL_BUCKETS, graphir.api.GPU_CALL_COST
    assert model.chunks(4096) == [4096]
    for n in (7, 600, 1025, 5000):
        plan = model.chunks(n)
        assert len(plan) <= 4 and sum(plan) >= n and set(plan) <= set(graphir.api.GPU_PREFILL_BUCKETS), (n, plan)
