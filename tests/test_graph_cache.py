"""Passed graphs on disk (graphir/graph_cache.py): a second process, here a second ProgramCache, reads
what the first one's pipeline made, and never a result the current code would not make."""

from __future__ import annotations

import numpy as np
import pytest

import graphir
from graphir import graph_cache
from graphir.cache import ProgramCache
from graphir.errors import GraphError
from graphir.passes import PASSES, register_pass, run_pipeline


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHIR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GRAPHIR_NO_GRAPH_CACHE", raising=False)
    return tmp_path / "passed"


@pytest.fixture(scope="module")
def model():
    return graphir.load("random:qwen35-tiny", backend="reference", passes="default")


def _no_pipeline(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the pipeline ran: the disk cache was not used")
    monkeypatch.setattr("graphir.passes.run_pipeline", fail)


def test_a_second_cache_reads_the_first_ones_result(cache_dir, model, monkeypatch):
    graph = model.graph("decode")
    first = ProgramCache().passed(graph, "default")
    assert len(list(cache_dir.glob("*.json"))) == 1
    _no_pipeline(monkeypatch)
    second = ProgramCache().passed(graph, "default")
    assert second is not first and second.signature() == first.signature()
    assert second.signature() == run_pipeline(graph, "default").signature()  # what the pipeline makes


def test_cached_graphs_give_the_same_logits(cache_dir):
    ids = [5, 17, 99, 3, 250, 42]
    fresh = graphir.load("random:qwen3-tiny", backend="reference", passes="default").logits(ids)
    assert list(cache_dir.glob("*.json"))  # the first model wrote its passed graphs
    again = graphir.load("random:qwen3-tiny", backend="reference", passes="default").logits(ids)
    assert np.array_equal(fresh, again)


def test_other_code_other_pipeline_other_graph_miss(cache_dir, model, monkeypatch):
    decode, prefill = model.graph("decode"), model.graph("prefill", 8)
    ProgramCache().passed(decode, "default")
    assert graph_cache.load(decode.signature(), "default") is not None
    assert graph_cache.load(prefill.signature(), "default") is None  # another structure
    assert graph_cache.load(decode.signature(), "dce,cse") is None  # another pipeline
    monkeypatch.setenv("GRAPHIR_NO_FUSION", "1")  # `default` expands to other passes
    assert graph_cache.load(decode.signature(), "default") is None
    monkeypatch.delenv("GRAPHIR_NO_FUSION")
    monkeypatch.setattr(graph_cache, "code_hash", lambda: "an edited pass")
    assert graph_cache.load(decode.signature(), "default") is None


def test_passes_from_outside_graphir_are_never_cached(cache_dir, model):
    @register_pass("test-outside-identity", "a pass defined by a test: its code is not in the cache key")
    def outside(graph):
        return graph

    try:
        ProgramCache().passed(model.graph("decode"), "dce,test-outside-identity")
        assert not list(cache_dir.glob("*.json"))
    finally:
        del PASSES["test-outside-identity"]


def test_corrupt_entry_runs_the_pipeline(cache_dir, model):
    graph = model.graph("decode")
    want = ProgramCache().passed(graph, "default").signature()
    for f in cache_dir.glob("*.json"):
        f.write_text("{not json")
    assert ProgramCache().passed(graph, "default").signature() == want


def test_flag_turns_it_off(cache_dir, model, monkeypatch):
    monkeypatch.setenv("GRAPHIR_NO_GRAPH_CACHE", "1")
    ProgramCache().passed(model.graph("decode"), "default")
    assert not cache_dir.exists() or not list(cache_dir.glob("*.json"))


def test_a_failing_pipeline_stores_nothing(cache_dir, model):
    with pytest.raises(GraphError):
        ProgramCache().passed(model.graph("decode"), "dce,no-such-pass")
    assert not cache_dir.exists() or not list(cache_dir.glob("*.json"))
