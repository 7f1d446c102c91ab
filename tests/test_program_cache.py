"""The program cache (graphir/cache.py): key parts, miss explanations, GRAPHIR_DEBUG_CACHE, LRU eviction,
hit counting, and one decode Program for a whole decode loop."""

from __future__ import annotations

import numba
import pytest
from graphir.models.presets import random_weights

import graphir
from graphir import g
from graphir.cache import ProgramCache, key_parts
from graphir.ir import Graph

PARTS = {"inputs", "states", "params", "shapes", "structure", "names", "meta", "passes", "backend"}
PROMPT = list(b"Graphir!")  # 8 tokens: one prefill chunk


@pytest.fixture(scope="module")
def tiny():
    return graphir.load("random:llama-tiny", ctx=32)


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    monkeypatch.delenv("GRAPHIR_DEBUG_CACHE", raising=False)


def misses_printed(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("graphir cache miss: ")]


def test_key_parts_are_named_and_stable(tiny):
    a, b = tiny.graph("decode"), tiny.graph("decode")
    parts = key_parts(a, "cpu", "default")
    assert set(parts) == PARTS
    assert parts["passes"] == "default" and parts["backend"] == "cpu"
    assert key_parts(b, "cpu", "default") == parts  # a rebuilt graph has the same key


def test_changing_n_tokens_changes_inputs_and_shapes(tiny):
    p8, p16 = (key_parts(tiny.graph("prefill", n), "reference", "") for n in (8, 16))
    changed = {k for k in PARTS if p8[k] != p16[k]}
    assert {"inputs", "shapes"} <= changed
    assert not changed & {"states", "structure", "names", "passes", "backend"}

    cache = ProgramCache()
    cache.get_program(tiny.graph("prefill", 8), tiny.weights)
    reason = cache.explain_miss(p16)
    assert reason.startswith("changed: ") and "inputs" in reason and "shapes" in reason
    assert "passes" not in reason and "backend" not in reason


def test_explain_miss_names_passes_backend_and_weights(tiny):
    graph = tiny.graph("decode")
    cache = ProgramCache()
    assert cache.explain_miss(key_parts(graph, "reference", "")) == "first program"
    cache.get_program(graph, tiny.weights, "reference", "")
    assert cache.explain_miss(key_parts(graph, "reference", "default")) == "changed: passes"
    assert cache.explain_miss(key_parts(graph, "cpu", "")) == "changed: backend"
    assert cache.explain_miss(key_parts(graph, "reference", "")) == "same key parts, different weights"


def test_a_miss_never_blames_the_weights_for_a_graph_change(tiny):
    """Every part of graph.signature() is a key part: a prefill graph of 1 token has the decode graph's
    structure and shapes but its own meta; renaming a Param reads other weights."""
    cache = ProgramCache()
    cache.get_program(tiny.graph("decode"), tiny.weights)
    assert cache.explain_miss(key_parts(tiny.graph("prefill", 1), "reference", "")) == "changed: meta"
    rec = tiny.graph("decode").to_records()
    (up,) = [n for n in rec["nodes"] if n.get("name") == "blk.1.ffn_up.weight"]
    up["name"] = "blk.0.ffn_up.weight"  # same shape, another layer's weights
    renamed = Graph.from_records(rec)
    assert renamed.signature() != tiny.graph("decode").signature()
    assert cache.explain_miss(key_parts(renamed, "reference", "")) == "changed: names"


def test_debug_flag_prints_the_miss_reason(tiny, monkeypatch, capsys):
    cache = ProgramCache()
    graph = tiny.graph("decode")
    cache.get_program(graph, tiny.weights)
    assert capsys.readouterr().err == ""  # flag off: silent
    monkeypatch.setenv("GRAPHIR_DEBUG_CACHE", "1")
    cache.get_program(tiny.graph("decode"), tiny.weights)  # a hit prints nothing
    cache.get_program(graph, tiny.weights, "reference", "default")
    cache.get_program(tiny.graph("prefill", 8), tiny.weights)
    other = random_weights(tiny.config, seed=1)
    cache.get_program(graph, other)
    assert misses_printed(capsys.readouterr().err) == [
        "graphir cache miss: changed: passes",
        "graphir cache miss: changed: inputs, params, shapes, meta",
        "graphir cache miss: same key parts, different weights",
    ]
    monkeypatch.setenv("GRAPHIR_DEBUG_CACHE", "0")
    cache.get_program(tiny.graph("prefill", 16), tiny.weights)
    assert capsys.readouterr().err == ""


def test_hits_and_misses_are_counted(tiny):
    cache = ProgramCache()
    first = cache.get_program(tiny.graph("decode"), tiny.weights)
    for _ in range(3):
        assert cache.get_program(tiny.graph("decode"), tiny.weights) is first
    cache.get_program(tiny.graph("decode"), tiny.weights, "reference", "default")
    assert (cache.hits, cache.misses, len(cache)) == (3, 2, 2)
    cache.clear()
    assert len(cache) == 0
    assert cache.get_program(tiny.graph("decode"), tiny.weights) is not first
    assert cache.misses == 3


def test_lru_evicts_the_least_recently_used(tiny):
    cache = ProgramCache(max_entries=2)
    a, b, c = (tiny.graph("prefill", n) for n in (2, 3, 4))
    pa = cache.get_program(a, tiny.weights)
    cache.get_program(b, tiny.weights)
    assert cache.get_program(a, tiny.weights) is pa  # a is now the most recent
    cache.get_program(c, tiny.weights)  # evicts b
    assert len(cache) == 2 and (cache.hits, cache.misses) == (1, 3)
    assert cache.get_program(a, tiny.weights) is pa and cache.get_program(c, tiny.weights)
    assert cache.misses == 3
    cache.get_program(b, tiny.weights)  # lowered again, evicting a
    assert cache.misses == 4
    assert cache.get_program(a, tiny.weights) is not pa


def test_decode_loop_lowers_the_decode_program_once(monkeypatch, capsys):
    before = numba.get_num_threads()
    numba.set_num_threads(1)  # a tiny model: a second thread's wake-up costs more than the work
    try:
        model = graphir.load("random:qwen3-tiny", backend="cpu", passes="default", ctx=64)
        monkeypatch.setenv("GRAPHIR_DEBUG_CACHE", "1")
        tokens = model.generate(PROMPT, 51, stop_at_eos=False)
        next(tokens)  # the prefill: one 8-token program
        assert (model.programs.misses, model.programs.hits) == (1, 0)
        assert misses_printed(capsys.readouterr().err) == ["graphir cache miss: first program"]
        rest = list(tokens)  # the decode loop: 50 tokens, one Program
    finally:
        numba.set_num_threads(before)
    assert len(rest) == 50 and model.stats["decode_tokens"] == 50
    assert (model.programs.misses, model.programs.hits) == (2, 49)
    (miss,) = misses_printed(capsys.readouterr().err)
    assert "inputs" in miss and "shapes" in miss  # the decode graph differs from the prefill one in its shapes


# ---------------------------------------------------------------- the real key (graph.signature()), not key_parts
def rows_graph(n_rows: int, n_cols: int = 8) -> Graph:
    """rms_norm of an Input [n_rows, n_cols], plus its first two rows: the graphs below differ only in
    the Input's shape."""
    x = g.input("x", (n_rows, n_cols))
    return Graph({"y": g.rms_norm(x, eps=1e-5), "head": g.rows(x, 0, 2)})


def kv_graph(capacity: int) -> Graph:
    """Attention of one query over a KV Input of `capacity` rows: only the K and V Inputs' shapes depend
    on the capacity (the output is [1, 2, 8] either way), so a key without Input shapes would hand a
    Program planned for one capacity to a cache of another."""
    q, k, v = g.input("q", (1, 2, 8)), g.input("k", (capacity, 1, 8)), g.input("v", (capacity, 1, 8))
    pos, kv_len = g.input("pos", (1,), "i32"), g.input("kv_len", (1,), "i32")
    return Graph({"o": g.flash_attn(q, k, v, pos, kv_len, scale=0.35)})


@pytest.mark.parametrize("build, sizes", [(rows_graph, (3, 4)), (kv_graph, (16, 32))])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_graphs_differing_only_in_an_input_shape_get_their_own_programs(build, sizes, backend):
    cache = ProgramCache()
    a, b = build(sizes[0]), build(sizes[1])
    pa = cache.get_program(a, None, backend)
    assert cache.get_program(build(sizes[0]), None, backend) is pa  # the same graph, rebuilt: the same Program
    pb = cache.get_program(b, None, backend)
    assert pb is not pa
    assert cache.get_program(build(sizes[1]), None, backend) is pb
    assert (cache.hits, cache.misses, len(cache)) == (2, 2, 2)


def test_a_graph_structure_is_passed_once(monkeypatch):
    """The model asks for its decode graph after the passes (to size the State) before lowering it;
    the pipeline runs once for that structure and lowering reuses the result."""
    import graphir.passes

    runs = []
    real = graphir.passes.run_pipeline
    monkeypatch.setattr(graphir.passes, "run_pipeline", lambda g_, p: runs.append(p) or real(g_, p))
    monkeypatch.setenv("GRAPHIR_NO_GRAPH_CACHE", "1")  # an earlier test's result on disk would skip the run
    model = graphir.load("random:llama-tiny", backend="cpu", passes="default")
    model.feed([1])  # State for the passed decode graph, then its Program
    assert runs == ["default"]
    assert model.programs.passed(model.graph("decode"), "default") is model.programs.passed(model._graph(1), "default")
    assert runs == ["default"]


def test_one_graph_under_two_pipelines_gets_each_pipelines_result(tiny, monkeypatch):
    """The passed-graph cache keys on the pipeline too: one structure passed under two pipelines, in either order,
    gives each its own result (a shared entry would lower one pipeline's graph under the other's name)."""
    monkeypatch.setenv("GRAPHIR_NO_GRAPH_CACHE", "1")  # the in-memory cache alone
    graph = tiny.graph("decode")
    fused = lambda gr: any(n.op == "add_rms_norm_mul" for n in gr.nodes())  # noqa: E731
    for first, second in (("default", "dce"), ("dce", "default")):
        cache = ProgramCache()
        results = {first: cache.passed(graph, first), second: cache.passed(graph, second)}
        assert fused(results["default"]) and not fused(results["dce"]), (first, second)


def test_no_fusion_set_after_a_program_was_cached_gets_a_new_one(tiny, monkeypatch, capsys):
    """GRAPHIR_NO_FUSION is read when used, so `default` expands to fewer passes once it is set; the in-memory caches
    keyed on the string 'default' alone and kept serving the fused Program (the disk cache keys on the expansion)."""
    monkeypatch.setenv("GRAPHIR_NO_GRAPH_CACHE", "1")
    fused = lambda gr: any(n.op == "add_rms_norm_mul" for n in gr.nodes())  # noqa: E731
    cache, graph = ProgramCache(), tiny.graph("prefill", 4)
    first = cache.get_program(graph, tiny.weights, "reference", "default")
    assert fused(first.graph)
    monkeypatch.setenv("GRAPHIR_NO_FUSION", "1")
    monkeypatch.setenv("GRAPHIR_DEBUG_CACHE", "1")
    second = cache.get_program(graph, tiny.weights, "reference", "default")
    assert second is not first and not fused(second.graph) and not fused(cache.passed(graph, "default"))
    assert misses_printed(capsys.readouterr().err) == ["graphir cache miss: changed: passes"]
    monkeypatch.delenv("GRAPHIR_NO_FUSION")
    assert cache.get_program(graph, tiny.weights, "reference", "default") is first
