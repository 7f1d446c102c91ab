"""Programmatic dependent launch in captured gpu graphs (backends/gpu/pdl.py).

A kernel launched programmatically may start while the kernel before it still runs, so each kernel
must hold at PDL_WAIT before it touches anything an earlier kernel writes. The source checks run
everywhere (CI has no GPU); the rest is the GPU suite: a captured decode step with PDL equals the
same Program launched kernel by kernel, bitwise, at every position, and kernels compiled without
their wait (the planted bug) are caught by the same comparison.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
from _gpu_helpers import HAS_GPU, captured_and_launched, gpu_only
from graphir.backends.gpu import kernels, pdl
from graphir.backends.gpu.launch import Launch
from test_replay import step_inputs

import graphir

# PDL_ENTRY(), or PDL_ENTRY_EARLY after the declarations of what it reads (graph Inputs only)
ENTRY = re.compile(r"\{\s*(\\\s*)?(PDL_ENTRY\(\);|(int [\w, ]+;\s*(\\\s*)?)?PDL_ENTRY_EARLY\()")


def _kernel_bodies(text: str) -> list[tuple[str, str]]:
    """(name, the first 200 characters after the opening brace, macro line breaks and runs of blanks made one
    space) of every __global__ function."""
    out = []
    for m in re.finditer(r"__global__", text):
        head = text[m.end():text.index("{", m.end())]
        names = [n for n in re.findall(r"([\w#]+)\s*\(", head) if n != "__launch_bounds__" and not n.isupper()]
        body = re.sub(r"\s+", " ", re.sub(r"\\\n", " ", text[text.index("{", m.end()):][:2000]))
        out.append((names[0] if names else "?", body[:200]))
    return out


@pytest.mark.parametrize("name", sorted(kernels.SOURCES))
def test_every_kernel_waits_before_it_reads(name):
    text = (kernels.KERNEL_DIR / name).read_text()
    bodies = _kernel_bodies(text)
    assert bodies, f"{name}: no kernels found"
    for kernel, body in bodies:
        assert ENTRY.match(body), f"{name}: kernel {kernel} does not begin with PDL_ENTRY()"


def test_only_input_lengths_and_positions_are_read_before_the_wait():
    """attention.inputs_early: the decode kernels read pos and kv_len before their wait only where both are
    graph Inputs; a length or position that a node computes (a const here, a kernel's result in general) is
    read after it."""
    from _attention_cases import attention_graph
    from graphir.backends.gpu.attention import inputs_early

    from graphir.builder import g

    node = attention_graph("flash_attn", 1, 4, 37, 2, 64, 64, "f32", 0.125, 0).outputs["out"]
    assert inputs_early(node)
    q, k, v, pos, kv_len = node.src
    computed = g.const([5], "i32")
    for srcs in ((q, k, v, pos, computed), (q, k, v, computed, kv_len)):
        other = g.flash_attn(*srcs, scale=0.125)
        assert not inputs_early(other), [s.op for s in other.src]
    assert not inputs_early(None)  # a rule called without its node (tests' RuleRunner)


def test_kernel_arguments_pack_as_their_c_types():
    class FakeDeviceArray:
        class data:
            ptr = 0x7F0012345600

    packed = pdl.kernel_args((np.int32(-7), np.float32(0.5), np.int64(1 << 40), FakeDeviceArray()))
    assert [type(v) for v in packed] == [ctypes.c_int32, ctypes.c_float, ctypes.c_int64, ctypes.c_void_p]
    assert [v.value for v in packed] == [-7, 0.5, 1 << 40, 0x7F0012345600]
    with pytest.raises(graphir.errors.BackendError, match="cannot pass a kernel argument of type int"):
        pdl.kernel_args((3,))


def _decode_pair(spec: str, ctx: int):
    from graphir.backends.registry import get_backend

    from graphir.passes import run_pipeline

    model = graphir.load(spec, backend="gpu", passes="default", ctx=ctx)
    graph = run_pipeline(model.graph("decode"), "default")
    gpu = get_backend("gpu")
    return gpu.lower(graph, model.weights), gpu.lower(graph, model.weights), gpu.new_state(graph), gpu.new_state(graph)


def _first_difference(spec: str, ctx: int, monkeypatch) -> tuple[int | None, object]:
    """The first position where the captured (PDL) decode differs from the launched one (or None),
    and the captured Program."""
    captured, plain, s_cap, s_plain = _decode_pair(spec, ctx)
    tokens = np.random.default_rng(5).integers(0, 256, ctx)
    for pos in range(ctx):
        got, want = captured_and_launched(captured, plain, step_inputs(pos, tokens[pos]), s_cap, s_plain, monkeypatch,
                                          "logits")
        if not np.array_equal(got, want):
            return pos, captured
    assert captured.captured and not plain.captured
    return None, captured


def _kernel_after_kernel(program) -> int:
    """Launches that directly follow another launch in a Program's steps: the ones PDL overlaps."""
    steps = program._steps
    return sum(isinstance(a, Launch) and isinstance(b, Launch) for a, b in zip(steps, steps[1:]))


needs_pdl = pytest.mark.skipif(not HAS_GPU or not pdl.supported(), reason="needs an sm_90+ CUDA GPU")


@pytest.mark.gpu
@gpu_only
def test_pdl_is_used_where_the_gpu_has_it():
    import cupy as cp

    if not cp.cuda.runtime.is_hip and int(cp.cuda.Device().compute_capability) >= 90:
        assert pdl.enabled(), "an sm_90+ CUDA GPU must capture with programmatic dependent launch"


@pytest.mark.gpu
@needs_pdl
@pytest.mark.parametrize("spec", ["random:qwen3-tiny", "random:qwen35-tiny"])
def test_captured_decode_with_pdl_equals_launched_decode(spec, monkeypatch):
    overlapped = []
    real = pdl.launch
    monkeypatch.setattr(pdl, "launch", lambda *a: (overlapped.append(a[-1]), real(*a)))
    first, captured = _first_difference(spec, 96, monkeypatch)
    assert first is None
    expected = _kernel_after_kernel(captured)  # each such launch once a capture
    assert expected > 10 and len(overlapped) >= expected and len(overlapped) % expected == 0, (
        f"{spec}: {len(overlapped)} kernels launched programmatically, {expected} follow a kernel")


@pytest.mark.gpu
@needs_pdl
def test_kernels_without_their_wait_are_caught(monkeypatch):
    """The planted bug: every kernel compiled with PDL_WAIT removed. The captured step then reads
    what the kernel ahead has not written yet, and the comparison must see it."""
    planted = {k: v + ("GRAPHIR_TEST_SKIP_PDL_WAIT",) for k, v in kernels.SOURCES.items()}
    monkeypatch.setattr(kernels, "SOURCES", planted)
    kernels.clear()
    try:
        assert _first_difference("random:qwen3-tiny", 48, monkeypatch)[0] is not None
    finally:
        monkeypatch.undo()
        kernels.clear()
