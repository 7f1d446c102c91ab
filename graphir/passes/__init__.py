"""Passes: registered Graph -> Graph functions, composed by pipeline strings.

    run_pipeline(graph, "dce,cse,fuse-add-rms-norm-mul")
    run_pipeline(graph, "replay-lint{strict=0},default")

A pass is a function or a frozen dataclass registered with `@register_pass(name, description)`;
a dataclass's fields are its options, written `name{field=value,...}` (xDSL style).
`default` keeps every product in f32; `cpu` and `gpu` add each backend's fast passes; `auto` (what
`graphir.load` and `graphir run` use by default) is the backend's own, named by resolve_pipeline.
Every pass returns a new Graph with the same output names, updates and meta. See graphir/flags.py
for GRAPHIR_VERIFY_PASSES, GRAPHIR_DUMP_PASSES and GRAPHIR_NO_FUSION.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graphir import flags
from graphir.errors import GraphError
from graphir.ir import Graph
from graphir.passes.report import CoverageReport, recording
from graphir.speculative import VERIFY_BUCKETS


@dataclass(frozen=True)
class Pass:
    name: str
    description: str
    impl: Callable[..., Any]  # a Graph -> Graph function, or a dataclass whose instances are one

    @property
    def options(self) -> dict[str, Any]:
        """Option name -> default (empty for plain functions)."""
        if not dataclasses.is_dataclass(self.impl):
            return {}
        return {f.name: f.default for f in dataclasses.fields(self.impl)}

    def configured(self, **options: Any) -> Callable[[Graph], Graph]:
        if not dataclasses.is_dataclass(self.impl):
            if options:
                raise GraphError(f"pass {self.name!r} takes no options, got {sorted(options)}")
            return self.impl
        unknown = set(options) - set(self.options)
        if unknown:
            raise GraphError(f"pass {self.name!r}: unknown options {sorted(unknown)}; it takes {sorted(self.options)}")
        try:
            return self.impl(**options)
        except GraphError as e:  # the pass's own checks of its values (rewrite.check_options), named here
            raise GraphError(f"pass {self.name!r}: {e}") from None

    def __call__(self, graph: Graph, **options: Any) -> Graph:
        return self.configured(**options)(graph)


PASSES: dict[str, Pass] = {}


def register_pass(name: str, description: str) -> Callable:
    def deco(impl: Callable) -> Callable:
        if not isinstance(name, str) or not re.fullmatch(r"[\w-]+", name):  # what a pipeline string can name
            raise GraphError(f"pass name {name!r} cannot be written in a pipeline; use letters, digits, '_' and '-'")
        if name in PASSES or name in (AUTO, "default", *BACKEND_PASSES):  # pipeline names
            raise GraphError(f"pass {name!r} is registered twice")
        PASSES[name] = Pass(name, description, impl)
        return impl

    return deco


# The pipeline `graphir run` uses: lint, clean, then the fusions in dependency order.
CLEANUP = ["dce", "cse"]
FUSIONS = [
    "stack-projections",  # before swiglu-split and the rope fusions: those then match on the views
    "fold-reshape-view",  # stacked Q/K/V views are reshaped into heads: make that one strided view
    "swiglu-split",
    "fuse-add-rms-norm-mul",
    "fuse-qk-norm-rope",  # before fuse-rope-set-rows: Qwen3's K then fuses its norm and its cache write
    "fuse-rope-set-rows",
    "fuse-ssm-conv-silu",  # recurrent layers (Qwen3.5 DeltaNet): conv + silu, delta rule + its gates
    "fuse-gated-delta-net-raw",
    "fuse-gated-delta-net-l2",  # after -raw: q/k's l2 norms join the fused delta rule
    "fuse-rms-norm-mul-gate",  # after swiglu-split: Qwen3.5's gated output norm
    "fuse-mul-sigmoid",  # Qwen3.5's gated attention output: the gate view read in place by one kernel
    "fuse-mul-mat-swiglu",  # after stack-projections and swiglu-split: the gate|up GEMV stores the activation
]


def default_pipeline() -> list[str]:
    fusions = [] if flags.enabled("GRAPHIR_NO_FUSION") else FUSIONS
    return ["replay-lint", *CLEANUP, *fusions, *CLEANUP]


# Each backend's fast path: default, then passes that trade exact f32 for speed where that backend gains.
GPU_PASSES = [
    "gemm-bf16",  # prefill GEMMs on tensor cores: Qwen3-8B's prefill ~5x f32's (BENCHMARKS.md, fourteenth session)
    "attn-bf16",  # prefill attention on tensor cores; decode (<= 16 queries) stays f32
    "gemm-bf16-out",  # after gemm-bf16: gate and up stored in bf16, half the bytes the activation reads
]
CPU_PASSES = [
    # 16-bit x and integer dot products for 4-bit decode GEMVs: 1.09-1.17x the f32 path's decode, greedy text
    # unchanged on issue 13's 57 prompts (BENCHMARKS.md, "16-bit activations end to end"). Up to the largest
    # verify call's rows: a verify row then computes what a decode step at its position does, bit for bit, so
    # greedy speculative output equals plain decoding's (issue 11); 8- and 16-row calls (prompt chunks of 8 too)
    # pay for it, the integer GEMV going row by row (BENCHMARKS.md, "Issue 11 on the cpu pipeline")
    f"q16-activations{{max_rows={VERIFY_BUCKETS[-1]}}}",
]

BACKEND_PASSES = {"cpu": CPU_PASSES, "gpu": GPU_PASSES}  # pipeline name -> what it adds to default

AUTO = "auto"  # the backend's own pipeline: BACKEND_PIPELINES, resolved by resolve_pipeline
BACKEND_PIPELINES = {"reference": "default", "cpu": "cpu", "gpu": "gpu"}  # the oracle stays exact


def pipelines() -> dict[str, list[str]]:
    """Named pipelines -> their passes in order; a name expands in place inside a pipeline string.
    Read when asked, so GRAPHIR_NO_FUSION applies to the call that reads it."""
    default = default_pipeline()
    return {"default": default, **{name: [*default, *extra] for name, extra in BACKEND_PASSES.items()}}


def resolve_pipeline(spec: str, backend: str) -> str:
    """`spec` with "auto" replaced by `backend`'s pipeline name (BACKEND_PIPELINES); any other spec as given.
    Backend "auto" is resolved first (gpu when CuPy sees a device, else cpu); a named backend needs no device."""
    if spec != AUTO:
        return spec
    from graphir.backends.registry import resolve_backend

    backend = resolve_backend(backend)
    if backend not in BACKEND_PIPELINES:
        raise GraphError(f"passes 'auto': no pipeline for backend {backend!r}; known: {', '.join(BACKEND_PIPELINES)}")
    return BACKEND_PIPELINES[backend]


def spell_pipeline(spec: str) -> str:
    """`spec` with each backend pipeline name (cpu, gpu) written out as default and its passes: what a benchmark
    records, so that its numbers stay attributable after such a pipeline gains a pass."""
    items = [item.strip() for item in re.split(r",(?![^{]*\})", spec) if item.strip()]
    return ",".join(",".join(["default", *BACKEND_PASSES[item]]) if item in BACKEND_PASSES else item
                    for item in items)


_ITEM = re.compile(r"\s*([\w-]+)\s*(?:\{([^}]*)\})?\s*(?:,|$)")


def parse_pipeline(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """`"a,b{x=1,y=foo}"` -> [("a", {}), ("b", {"x": 1, "y": "foo"})]; `default` expands in place.
    Parsing checks every name and option without running anything: callers validate with it."""
    if not isinstance(spec, str):  # run_pipeline(graph, None) was "'NoneType' object is not subscriptable"
        raise GraphError(f"pipeline must be a string of pass names (\"\" for none), got {spec!r}")
    out: list[tuple[str, dict[str, Any]]] = []
    pos = 0
    while spec[pos:].strip():
        m = _ITEM.match(spec, pos)
        if not m or m.end() == pos:
            raise GraphError(f"pipeline {spec!r}: cannot parse at {spec[pos:]!r}; write name,name{{opt=value}}")
        pos = m.end()
        name, opts = m[1], _parse_options(spec, m[2] or "")
        named = pipelines()
        if name == AUTO:
            raise GraphError(f"pipeline {spec!r}: 'auto' is the backend's pipeline, a whole --passes value on its "
                             f"own (resolve_pipeline); with other passes name one: {', '.join(named)}")
        if name in named:
            if opts:
                raise GraphError(f"pipeline {spec!r}: {name} takes no options; spell its passes out instead")
            out += parse_pipeline(",".join(named[name]))  # its entries may carry options (cpu's max_rows)
        elif name not in PASSES:
            raise GraphError(f"pipeline {spec!r}: unknown pass {name!r}; "
                             f"known: {', '.join([*named, *sorted(PASSES)])}")
        else:
            out.append((name, _typed_options(PASSES[name], opts)))
    return out


def _parse_options(spec: str, text: str) -> dict[str, str]:
    opts = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise GraphError(f"pipeline {spec!r}: option {part!r} needs a value (key=value)")
        if key.strip() in opts:  # the last one won without a word: {max_rows=1,max_rows=16} read as 16
            raise GraphError(f"pipeline {spec!r}: option {key.strip()!r} is given twice")
        opts[key.strip()] = value.strip()
    return opts


def _typed_options(p: Pass, opts: dict[str, str]) -> dict[str, Any]:
    defaults = p.options
    out: dict[str, Any] = {}
    for key, text in opts.items():
        if key not in defaults:
            raise GraphError(f"pass {p.name!r}: unknown option {key!r}; it takes {sorted(defaults) or 'none'}")
        kind = type(defaults[key])
        if kind not in (bool, int, float, str):  # NoneType(text) was a TypeError; a list default split nothing
            given = "no default" if defaults[key] is dataclasses.MISSING else f"a default of {defaults[key]!r}"
            raise GraphError(f"pass {p.name!r}: option {key} has {given}, so a pipeline string cannot set it; give "
                             f"the field a bool, int, float or str default")
        try:
            out[key] = _parse_bool(text) if kind is bool else kind(text)
        except ValueError:
            raise GraphError(f"pass {p.name!r}: option {key}={text!r} is not a {kind.__name__}") from None
    p.configured(**out)  # the pass's own checks of its values (a negative row count, ...), before anything runs
    return out


def _parse_bool(text: str) -> bool:
    # every other word was False, so a typo (strict=ture) silently turned an option off
    words = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
    if text.lower() not in words:
        raise ValueError(text)
    return words[text.lower()]


def run_pipeline(graph: Graph, pipeline: str, verify_each: bool | None = None,
                 report: CoverageReport | None = None) -> Graph:
    """Run the passes of `pipeline` in order; verify after each if asked (or GRAPHIR_VERIFY_PASSES=1)."""
    from graphir.verify import verify

    verify_each = flags.enabled("GRAPHIR_VERIFY_PASSES") if verify_each is None else verify_each
    seen: dict[str, int] = {}
    for name, opts in parse_pipeline(pipeline):
        seen[name] = seen.get(name, 0) + 1
        pc = None if report is None else report[name if seen[name] == 1 else f"{name}#{seen[name]}"]
        before = len(graph)
        try:
            with recording(pc):
                result = PASSES[name](graph, **opts)
        except GraphError as e:
            if name in str(e):  # the pass named itself ("replay-lint: ...", "shard-tp: ...")
                raise
            # the rewrite walker's errors ("rewrite of silu 'act' ...") named no pass, in a pipeline of twenty
            raise GraphError(f"pass {name!r}: {e}") from None
        except Exception as e:  # a pass's own bug: its traceback stands, and says which pass it was in
            e.add_note(f"graphir: raised in pass {name!r} of the pipeline {pipeline!r}")
            raise
        graph = _checked_result(name, graph, result)
        if pc is not None:
            pc.nodes_before, pc.nodes_after = before, len(graph)
        if verify_each:
            try:
                verify(graph)
            except GraphError as e:
                raise GraphError(f"after pass {name!r}: {e}") from None
        if flags.enabled("GRAPHIR_DUMP_PASSES"):
            from graphir.dump import dump_text

            print(f"# after pass {name}\n{dump_text(graph)}", end="")
    return graph


def _checked_result(name: str, before: Graph, after: Any) -> Graph:
    """A pass's result, held to the contract every caller relies on: a Graph with the same output names.
    Unchecked, a pass that returned None or a dict failed in the next pass or in len() ("object of type
    'NoneType' has no len()"), and one that renamed an output passed, so check() reported rel inf for it."""
    if not isinstance(after, Graph):
        raise GraphError(f"pass {name!r} returned {type(after).__name__}, not a Graph"
                         + (" (a missing return?)" if after is None else ""))
    if list(after.outputs) != list(before.outputs):
        raise GraphError(f"pass {name!r} changed the output names {list(before.outputs)} to {list(after.outputs)}; "
                         f"a pass keeps every output under its name")
    return after


def coverage(graph: Graph, pipeline: str = "default") -> CoverageReport:
    """Run `pipeline` on `graph` and report, per pass, the sites matched and rejected (`.text()` renders).

    A pass that runs twice reports its second run as "name#2"."""
    report = CoverageReport()
    run_pipeline(graph, pipeline, report=report)
    return report


# Importing the pass modules registers them.
from graphir.passes import (  # noqa: E402,F401
    attn_bf16,
    cleanup,
    fuse_gate,
    fuse_norm,
    fuse_rope,
    fuse_ssm,
    gemm_bf16,
    kv_f16,
    q8_activations,
    q16_activations,
    replay_lint,
    shard_tp,
    stack,
    swiglu,
    views,
)

__all__ = ["PASSES", "Pass", "register_pass", "run_pipeline", "parse_pipeline", "coverage", "CoverageReport",
           "default_pipeline", "pipelines", "resolve_pipeline", "spell_pipeline", "AUTO", "BACKEND_PIPELINES",
           "BACKEND_PASSES", "CPU_PASSES", "GPU_PASSES"]
