"""Check that a pass pipeline keeps the math: run a graph without and with it on the reference backend.

    report = check(graphir.load("random:llama-tiny"), passes="default")
    print(report.text())   # per-output and per-State errors, the first diverging named tensor
    assert report.ok

Both graphs see the same inputs and copies of the same State, in two cases:
  1. positions 0..n-1 on a zeroed State (the first prefill);
  2. positions P..P+n-1 (P = n + LATER_OFFSET) on a random State, as if P tokens came before
     (random KV rows, conv and recurrent states), so a pass that mishandles positions, the
     cache rows it reads or the state it carries shows here and not only at position 0.
Inputs are made by role (see `make_inputs`), so any model graph gets valid ones.

The first diverging tensor: models name their activations (`blk.3.attn_out`) and passes keep
the name of a node they replace, so nodes are matched across the two graphs by name. Names are
compared in the unrewritten graph's topological order and the first one beyond tolerance is
reported: the divergence starts at or just before it. A name is compared only where each graph
has exactly one array-valued (not multi-output) node with it.

Tolerance, DEFAULT_TOL = 1e-4 of the tensor's largest |value|: a pass must not change the math,
only regroup the same float32 operations (a stacked mul_mat sums in another blocking, a fused
norm accumulates once). That moves a value by a few ulps of its largest term, about 1e-7 of
max |value| per op, some 1e-6 after a 30-layer model: 1e-4 leaves a wide margin. Any real change
moves values by far more: in the tests, an rms_norm eps of 1e-2 instead of 1e-5 moves that norm
by 4e-3 and the logits by 2e-2; a swapped operand, by more than 1. Measured with `default`:
bitwise equal on SmolLM2-135M and the tiny Llama/Qwen3 presets (the fused ops' references make the
same numpy calls); 4e-6 on a tiny Qwen3.5 prefill, where the fused delta rule sums in another order.
Errors are relative to the tensor's largest |value|, not per element: elements near zero carry
no relative precision. f16 values get F16_TOL (one rounding of an f16 cache row may go the other
way); integer values must be equal.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphir import tp
from graphir.backends.reference import lower
from graphir.dtypes import numpy_dtype
from graphir.errors import GraphError
from graphir.ir import Graph
from graphir.passes import CoverageReport, run_pipeline
from graphir.run_inputs import new_state
from graphir.weights import Weights

DEFAULT_TOL = 1e-4
F16_TOL = 2e-3  # half an f16 ulp is 2^-11 of the value; a flipped rounding is one ulp, 2^-10 < 2e-3
LATER_OFFSET = 16  # case 2 starts this many rows after the new tokens' count


# ---------------------------------------------------------------- inputs
@dataclass
class Case:
    label: str
    inputs: dict[str, np.ndarray]
    state: dict[str, np.ndarray]


def make_inputs(graph: Graph, start: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Valid inputs by role: ids read by get_rows are in its table's range, lengths read by
    flash_attn cover the new rows, any other i32 input is a position or cache row start..start+n-1,
    float inputs are standard normal."""
    users = graph.users()
    out: dict[str, np.ndarray] = {}
    for x in graph.inputs:
        slots = [(u, i) for u in users[id(x)] for i, s in enumerate(u.src) if s is x]
        tables = [u.src[0] for u, i in slots if u.op == "get_rows" and i == 1]
        attns = [u for u, i in slots if u.op == "flash_attn" and i == 4]
        if x.dtype != "i32":
            out[x.name] = rng.standard_normal(x.shape).astype(np.float32)
        elif tables:
            out[x.name] = rng.integers(0, min(t.shape[0] for t in tables), x.shape).astype(np.int32)
        elif attns:
            out[x.name] = np.full(x.shape, start + attns[0].src[0].shape[0], np.int32)
        elif len(x.shape) == 1:
            out[x.name] = np.arange(start, start + x.shape[0], dtype=np.int32)
        else:
            raise GraphError(f"check: no rule makes valid values for input {x.name!r} {list(x.shape)} i32 "
                             f"(not token ids, a kv length or 1-D positions); pass inputs=")
    return out


def random_state(graph: Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every State buffer filled with standard normal values (rows past kv_len too: never read)."""
    return {k: rng.standard_normal(v.shape, dtype=np.float32).astype(v.dtype) for k, v in new_state(graph).items()}


def _n_tokens(graph: Graph) -> int:
    """The new tokens' count: the longest 1-D i32 input (token ids, positions)."""
    return max((x.shape[0] for x in graph.inputs if x.dtype == "i32" and len(x.shape) == 1), default=1)


def _kv_capacity(graph: Graph) -> int | None:
    """The KV rows attention can read (the cache's first axis), or None without attention."""
    caps = [n.src[1].shape[0] for n in graph.nodes() if n.op == "flash_attn"]
    return min(caps) if caps else None


def make_cases(graph: Graph, seed: int = 0) -> list[Case]:
    """Case 1 at position 0 on a zeroed State; case 2 later, on a random State (if the cache has room)."""
    n, cap = _n_tokens(graph), _kv_capacity(graph)
    rng = np.random.default_rng(seed)
    cases = [Case(f"{_positions(0, n)} on a zeroed state", make_inputs(graph, 0, rng), new_state(graph))]
    later = n + LATER_OFFSET if cap is None else min(n + LATER_OFFSET, cap - n)
    if later > 0:
        cases.append(Case(f"{_positions(later, n)} on a random state (as if {later} tokens came before)",
                          make_inputs(graph, later, rng), random_state(graph, rng)))
    return cases


def _positions(start: int, n: int) -> str:
    return f"position {start}" if n == 1 else f"positions {start}..{start + n - 1}"


# ---------------------------------------------------------------- comparing
@dataclass(frozen=True)
class Diff:
    """One tensor compared: max |a - b| and that relative to max |a| (a: the unrewritten graph's)."""

    name: str
    max_abs: float
    rel: float  # 0 when equal; inf for a shape, dtype or NaN mismatch
    tol: float
    note: str = ""  # the op and type on each side, or why it could not be compared

    @property
    def ok(self) -> bool:
        return self.rel <= self.tol

    def text(self) -> str:
        verdict = "ok" if self.ok else f"DIVERGES (> {self.tol:.0e})"
        note = f"  [{self.note}]" if self.note else ""
        return f"{self.name!r}: max abs {self.max_abs:.3g}, rel {self.rel:.3g}  {verdict}{note}"


def compare(name: str, want: Any, got: Any, tol: float = DEFAULT_TOL, note: str = "") -> Diff:
    a, b = np.asarray(want), np.asarray(got)
    if a.shape != b.shape or a.dtype.kind != b.dtype.kind:
        return Diff(name, float("inf"), float("inf"), tol, f"{list(a.shape)} {a.dtype} vs {list(b.shape)} {b.dtype}")
    if a.dtype.kind in "iub":
        tol = 0.0
    elif a.dtype == np.float16 or b.dtype == np.float16:
        tol = max(tol, F16_TOL)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if not np.array_equal(np.isnan(a64), np.isnan(b64)):
        return Diff(name, float("inf"), float("inf"), tol, note or "NaN in one graph only")
    err = np.abs(np.nan_to_num(a64 - b64, nan=0.0))
    max_abs = float(err.max()) if err.size else 0.0
    scale = float(np.nanmax(np.abs(a64))) if a64.size else 0.0
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return Diff(name, max_abs, rel, tol, note)


def _named(graph: Graph, trace: dict[int, Any]) -> dict[str, tuple[Any, str]]:
    """name -> (value, "op [shape]") for names held by exactly one array-valued op node, in topological order."""
    nodes = graph.nodes()
    counts = Counter(n.name for n in nodes if n.name)
    return {n.name: (trace[i], f"{n.op} {list(n.shape)}") for i, n in enumerate(nodes)
            if n.name and counts[n.name] == 1 and not n.is_leaf and n.types is None}


# ---------------------------------------------------------------- the report
@dataclass
class CaseResult:
    label: str
    outputs: list[Diff]
    states: list[Diff]
    compared: int  # named tensors compared
    diverging: int  # of those, beyond tolerance
    unmatched: list[str]  # names of the unrewritten graph with no counterpart after the passes
    first_divergence: Diff | None

    @property
    def ok(self) -> bool:
        return self.first_divergence is None and all(d.ok for d in self.outputs + self.states)

    def text(self) -> str:
        lines = [self.label]
        lines += [f"  output {d.text()}" for d in self.outputs]
        bad = [d for d in self.states if not d.ok]
        if bad:
            lines += [f"  state {d.text()}" for d in bad]
        elif self.states:
            worst = max(self.states, key=lambda d: d.rel)
            lines.append(f"  state: {len(self.states)} buffers ok, worst {worst.text()}")
        gone = f", {len(self.unmatched)} names not in the rewritten graph" if self.unmatched else ""
        beyond = f", {self.diverging} beyond tolerance" if self.diverging else ", all within tolerance"
        lines.append(f"  named tensors: {self.compared} compared{beyond}{gone}")
        if self.first_divergence is not None:
            lines.append(f"  first diverging tensor: {self.first_divergence.text()}")
        return "\n".join(lines)


@dataclass
class CheckReport:
    pipeline: str
    tol: float
    phase: str
    nodes_before: int
    nodes_after: int
    cases: list[CaseResult]
    coverage: CoverageReport = field(default_factory=CoverageReport)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.cases)

    @property
    def first_divergence(self) -> Diff | None:
        """The first diverging named tensor of the first case that has one."""
        return next((c.first_divergence for c in self.cases if c.first_divergence is not None), None)

    def worst(self) -> Diff | None:
        """The output or State buffer furthest from its tolerance, over all cases."""
        diffs = [d for c in self.cases for d in c.outputs + c.states]
        return max(diffs, key=lambda d: d.rel / d.tol if d.tol else (0.0 if d.rel == 0 else float("inf")),
                   default=None)

    def summary(self) -> str:
        worst = self.worst()
        worst_text = f"worst {worst.name!r} rel {worst.rel:.3g}" if worst else "nothing compared"
        if self.ok:
            return f"ok: pipeline {self.pipeline!r} keeps every output and State within {self.tol:.0e} ({worst_text})"
        first = self.first_divergence
        where = f"; first diverging tensor {first.name!r} (rel {first.rel:.3g})" if first else ""
        return f"pipeline {self.pipeline!r} changes the math beyond {self.tol:.0e}: {worst_text}{where}"

    def text(self, coverage: bool = False, max_sites: int = 4, summary: bool = True) -> str:
        """The cases, then (if asked) the coverage report with `max_sites` sites per kind, then the summary."""
        head = (f"check: pipeline {self.pipeline!r} on the {self.phase} graph ({self.nodes_before} -> "
                f"{self.nodes_after} nodes), reference backend, tolerance {self.tol:.0e} of max |value|")
        parts = [head, *(f"case {i}: {c.text()}" for i, c in enumerate(self.cases, 1))]
        if coverage:
            parts.append("coverage:\n" + self.coverage.text(max_sites).rstrip("\n"))
        return "\n".join(parts + ([self.summary()] if summary else [])) + "\n"


# ---------------------------------------------------------------- check
def check(model_or_graph: Any, weights: Weights | None = None, passes: str = "default",
          inputs: Mapping[str, np.ndarray] | None = None, tol: float = DEFAULT_TOL, *, phase: str = "prefill",
          n_tokens: int | None = None, state: Mapping[str, np.ndarray] | None = None, seed: int = 0) -> CheckReport:
    """Run `passes` on a graph (or a loaded model's `phase` graph) and compare both on the reference backend.

    `inputs` (with an optional `state`) replaces the generated cases with that one run."""
    # tol -1 reported 'changes the math beyond -1e+00: worst rel 0'; tol "1e-3" and seed -1 were a TypeError from
    # a comparison and numpy's 'expected non-negative integer'
    if isinstance(tol, bool) or not isinstance(tol, (int, float, np.integer, np.floating)) or not tol >= 0:
        raise GraphError(f"check: tol must be a number >= 0, got {tol!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise GraphError(f"check: seed must be an int >= 0, got {seed!r}")
    graph, weights = _graph_and_weights(model_or_graph, weights, phase, n_tokens)
    coverage = CoverageReport()
    after = run_pipeline(graph, passes, verify_each=True, report=coverage)
    if inputs is not None:
        st = dict(state) if state is not None else new_state(graph)
        cases = [Case("given inputs", dict(inputs), st)]
    else:
        cases = make_cases(graph, seed)
    before_prog, after_prog = lower(graph, weights), lower(after, weights)
    results = [_check_case(graph, after, before_prog, after_prog, c, tol) for c in cases]
    return CheckReport(passes, tol, str(graph.meta.get("phase", phase)), len(graph), len(after), results, coverage)


def _graph_and_weights(model_or_graph: Any, weights: Weights | None, phase: str,
                       n_tokens: int | None) -> tuple[Graph, Weights | None]:
    if isinstance(model_or_graph, Graph):
        return model_or_graph, weights
    if hasattr(model_or_graph, "graph") and hasattr(model_or_graph, "weights"):  # a graphir.load() model
        return model_or_graph.graph(phase, n_tokens), weights if weights is not None else model_or_graph.weights
    raise GraphError(f"check: expected a Graph or a loaded model (graphir.load), got {type(model_or_graph).__name__}")


def _run(program: Any, case: Case) -> tuple[dict, dict, dict]:
    # each run writes its own copy, in the dtypes its graph declares (kv-f16: the same KV rows rounded to f16)
    dtypes = {n.name: numpy_dtype(n.dtype) for n in program.graph.states}
    state = {k: v.astype(dtypes.get(k, v.dtype)) for k, v in case.state.items()}
    trace: dict[int, Any] = {}
    if "tp" in program.graph.meta:  # a sharded graph: rank-local States cut from, and written back to, the whole
        local = tp.shard_state(program.graph, state)
        outputs = program(case.inputs, local, trace=trace)
        return outputs, tp.gather_state(program.graph, local, state), trace
    outputs = program(case.inputs, state, trace=trace)
    return outputs, state, trace


def _check_case(before: Graph, after: Graph, before_prog: Any, after_prog: Any, case: Case,
                tol: float) -> CaseResult:
    out_a, state_a, trace_a = _run(before_prog, case)
    out_b, state_b, trace_b = _run(after_prog, case)
    outputs = [compare(k, out_a[k], out_b[k], tol) if k in out_b else
               Diff(k, float("inf"), float("inf"), tol, "missing after the passes") for k in out_a]
    states = [compare(k, state_a[k], state_b[k], tol) if k in state_b else
              Diff(k, float("inf"), float("inf"), tol, "not a State after the passes") for k in state_a]
    named_a, named_b = _named(before, trace_a), _named(after, trace_b)
    diffs = [compare(name, value, named_b[name][0], tol, f"{where} -> {named_b[name][1]}")
             for name, (value, where) in named_a.items() if name in named_b]
    diverging = [d for d in diffs if not d.ok]
    unmatched = [name for name in named_a if name not in named_b]
    return CaseResult(case.label, outputs, states, len(diffs), len(diverging), unmatched,
                      diverging[0] if diverging else None)
