"""Each backend's pipeline by default: `auto` resolves to reference `default`, cpu `cpu`, gpu `gpu`, before any
cache key or benchmark record is made; `default` stays the exact f32 pipeline everywhere."""

from __future__ import annotations

import json
import shlex
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import graphir
from graphir import graph_cache
from graphir.cache import ProgramCache, key_parts
from graphir.cli import main
from graphir.errors import GraphError
from graphir.passes import default_pipeline, parse_pipeline, pipelines, resolve_pipeline, spell_pipeline
from graphir.speculative import VERIFY_BUCKETS

GPU = ["gemm-bf16", "attn-bf16", "gemm-bf16-out"]
CPU_SPELLED = "default,q16-activations{max_rows=16}"  # 16-bit x up to the largest speculative verify call (issue 11)


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_backend_pipelines_are_default_plus_their_passes() -> None:
    named = pipelines()
    assert named["default"] == default_pipeline()
    assert not {"q16-activations", *GPU} & set(named["default"])  # default stays the exact f32 pipeline
    assert named["cpu"] == [*default_pipeline(), f"q16-activations{{max_rows={max(VERIFY_BUCKETS)}}}"]
    assert named["gpu"] == [*default_pipeline(), *GPU]


def test_no_fusion_flag_applies_to_the_backend_pipelines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHIR_NO_FUSION", "1")
    assert pipelines()["gpu"] == [*default_pipeline(), *GPU]
    assert "stack-projections" not in pipelines()["gpu"]


@pytest.mark.parametrize("backend, want", [("reference", "default"), ("cpu", "cpu"), ("gpu", "gpu")])
def test_auto_resolves_to_the_backends_pipeline(backend: str, want: str) -> None:
    assert resolve_pipeline("auto", backend) == want  # gpu: by name, no device needed
    for spec in ("default", "", "dce,cse", "gpu"):  # anything else is kept as given
        assert resolve_pipeline(spec, backend) == spec


@pytest.mark.parametrize("found", ["cpu", "gpu"])
def test_auto_backend_is_resolved_first(monkeypatch: pytest.MonkeyPatch, found: str) -> None:
    from graphir.backends import registry

    monkeypatch.setattr(registry, "resolve_backend", lambda name: found if name == "auto" else name)
    assert resolve_pipeline("auto", "auto") == found


def test_auto_is_a_whole_pipeline_and_unknown_names_still_fail() -> None:
    with pytest.raises(GraphError, match=r"'auto' is the backend's pipeline"):
        parse_pipeline("auto,dce")
    with pytest.raises(GraphError, match=r"unknown pass 'nope'; known: default, cpu, gpu"):
        parse_pipeline("cpu,nope")
    with pytest.raises(GraphError, match="no pipeline for backend 'tpu'"):
        resolve_pipeline("auto", "tpu")


def test_spelled_pipelines_name_their_passes() -> None:
    assert spell_pipeline("cpu") == CPU_SPELLED
    assert parse_pipeline(spell_pipeline("cpu")) == parse_pipeline("cpu")
    assert spell_pipeline("gpu,kv-f16") == "default,gemm-bf16,attn-bf16,gemm-bf16-out,kv-f16"
    assert spell_pipeline("replay-lint{strict=0},default") == "replay-lint{strict=0},default"
    assert parse_pipeline(spell_pipeline("gpu")) == parse_pipeline("gpu")


def test_load_resolves_auto_per_backend() -> None:
    assert graphir.load("random:llama-tiny", backend="reference").passes == "default"
    assert graphir.load("random:llama-tiny", backend="cpu").passes == "cpu"
    assert graphir.load("random:llama-tiny", backend="cpu", passes="default").passes == "default"
    assert graphir.load("random:llama-tiny", backend="cpu", passes="").passes == ""


def test_cpu_default_rewrites_4_bit_decode_and_explicit_default_does_not() -> None:
    def ops(model: Any) -> set[str]:
        return {n.op for n in model.programs.passed(model._graph(1), model.passes).nodes()}

    assert "mul_mat_q16x" in ops(graphir.load("random:llama-tiny", backend="cpu", dtype="q4_1"))
    assert "mul_mat_q16x" not in ops(graphir.load("random:llama-tiny", backend="cpu", dtype="q4_1", passes="default"))


def test_program_cache_keys_on_the_resolved_pipeline() -> None:
    model = graphir.load("random:llama-tiny", backend="cpu", ctx=32)
    graph = model._graph(8)
    assert key_parts(graph, "cpu", "cpu")["passes"] != key_parts(graph, "cpu", "default")["passes"]
    sig = graph.signature()
    entries = {p: graph_cache._entry(sig, p) for p in ("default", "cpu", "gpu")}
    assert len(set(entries.values())) == 3 and None not in entries.values()
    assert graph_cache._entry(sig, CPU_SPELLED) == entries["cpu"]  # the pass list, not the name
    assert graph_cache._entry(sig, "default,q16-activations") != entries["cpu"]  # its options are part of it

    cache = ProgramCache()
    first = cache.get_program(graph, model.weights, "cpu", "auto")
    assert cache.get_program(graph, model.weights, "cpu", "cpu") is first  # "auto" was keyed as "cpu"
    assert (cache.hits, cache.misses) == (1, 1)
    cache.get_program(graph, model.weights, "cpu", "default")
    assert cache.misses == 2
    assert {key[3] for key in cache._programs} == {"cpu", "default"}


def test_model_programs_never_key_on_auto() -> None:
    model = graphir.load("random:llama-tiny", backend="cpu", ctx=32)
    model.logits(np.arange(5))
    assert {key[3] for key in model.programs._programs} == {"cpu"}
    assert {key[1] for key in model.programs._passed} == {"cpu"}


def test_cli_lists_the_backend_pipelines() -> None:
    lines = invoke("passes").stdout.splitlines()
    for name in ("cpu", "gpu"):
        assert f"{name} = {', '.join(pipelines()[name])}" in lines


@pytest.mark.parametrize("command, default", [("run", "auto"), ("chat", "auto"), ("bench", "auto"),
                                              ("check", "default"), ("coverage", "default"), ("dump", None)])
def test_cli_passes_defaults(command: str, default: str | None) -> None:
    (option,) = [p for p in main.commands[command].params if p.name == "pipeline"]
    assert option.default == default


@pytest.mark.parametrize("backend, want", [("reference", "default"), ("cpu", "cpu")])
def test_cli_run_loads_with_the_backends_pipeline(monkeypatch: pytest.MonkeyPatch, backend: str, want: str) -> None:
    seen: list[str] = []

    def load(spec: str, backend: str, passes: str, ctx: int | None = None, dtype: str | None = None) -> Any:
        seen.append(passes)
        raise graphir.LoadError("stop here")

    monkeypatch.setitem(sys.modules, "graphir.api", types.SimpleNamespace(load=load))
    r = CliRunner().invoke(main, ["run", "--backend", backend])
    assert r.exit_code == 1 and seen == [want]
    assert f"on {backend} (passes {want})" in r.stderr
    r = CliRunner().invoke(main, ["run", "--backend", backend, "--passes", "default"])
    assert seen == [want, "default"]


@pytest.mark.parametrize("args, message", [(["run", "--passes", "nope"], "unknown pass 'nope'"),
                                           (["run", "--passes", "auto,dce"], "'auto' is the backend's pipeline"),
                                           (["check", "-p", "auto"], "'auto' is the backend's pipeline")])
def test_cli_bad_pipelines_fail_before_loading(args: list[str], message: str) -> None:
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.output


def test_cli_bench_prints_and_records_the_resolved_pipeline(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = invoke("bench", "random:llama-tiny", "--backend", "cpu", "--prefill", "8", "--prompt", "8", "--decode", "4",
               "--repeats", "1", "--no-llama-cpp", "--json", str(out))
    assert r.exit_code == 0, r.output
    assert f"| passes cpu ({CPU_SPELLED}) |" in r.stdout
    data = json.loads(out.read_text())
    assert (data["passes"], data["pipeline"]) == ("cpu", CPU_SPELLED)
    assert f"--passes {shlex.quote(CPU_SPELLED)}" in data["command"]  # quoted: braces stay one shell word
