"""kernels.module on the host, with the compiler faked: which translation units a request compiles, in what order,
and how a kernel is found among a file's parts (the real compiles: tests/test_gpu_kernels_compile.py)."""

from __future__ import annotations

import threading

import pytest
from graphir.backends.gpu import kernels

cupy = pytest.importorskip("cupy")


def not_found():
    """What cuModuleGetFunction raises for a name a module lacks (made without its constructor, which asks the
    driver for the message: there is no driver here)."""
    error = cupy.cuda.driver.CUDADriverError
    return error.__new__(error)


class FakeUnit:
    def __init__(self, name: str, defines: tuple[str, ...]):
        part = next((d.split("=")[1] for d in defines if d.startswith("GRAPHIR_PART=")), "all")
        self.name, self.part = name, part
        self.kernels = {f"k_{name}_{part}"}

    def get_function(self, kernel: str) -> str:
        if kernel not in self.kernels:
            raise not_found()
        return f"{self.name}:{self.part}:{kernel}"


@pytest.fixture
def compiled(monkeypatch):
    """The units compiled, in the order the pool started them; kernels' caches empty before and after."""
    order, lock = [], threading.Lock()

    def fake(name, defines):
        with lock:
            order.append((name, defines))
        return FakeUnit(name, defines)

    monkeypatch.setattr(kernels, "_compile_unit", fake)
    kernels.clear()
    yield order
    kernels.clear()


def test_first_request_compiles_every_unit_of_every_source_once(compiled):
    m = kernels.module("rope.cu")
    assert m.get_function("k_rope.cu_all") == "rope.cu:all:k_rope.cu_all"
    kernels.module("matmul.cu")
    kernels.module("rope.cu")
    want = sorted((name, d) for name in kernels.SOURCES for d in kernels.unit_defines(name))
    assert sorted(compiled) == want  # each once, though rope.cu was asked for twice
    assert len(want) == len(kernels.SOURCES) + sum(n - 1 for n in kernels.PARTS.values())


def test_requested_source_is_submitted_first(compiled, monkeypatch):
    submitted = []
    real_submit = kernels._submit
    monkeypatch.setattr(kernels, "_submit", lambda name: submitted.append(name) or real_submit(name))
    kernels.module("attention.cu")
    assert submitted[0] == "attention.cu" and set(submitted) == set(kernels.SOURCES)


def test_a_kernel_is_found_in_the_part_that_defines_it(compiled):
    m = kernels.module("matmul.cu")
    assert len(m.units) == kernels.PARTS["matmul.cu"]
    last = kernels.PARTS["matmul.cu"] - 1
    assert m.get_function(f"k_matmul.cu_{last}") == f"matmul.cu:{last}:k_matmul.cu_{last}"
    assert m.get_function("k_matmul.cu_0") == "matmul.cu:0:k_matmul.cu_0"
    with pytest.raises(KeyError, match="matmul.cu: no kernel 'gemv_nothing'"):
        m.get_function("gemv_nothing")


def test_clear_compiles_again_with_the_options_of_now(compiled, monkeypatch):
    kernels.module("norm.cu")
    monkeypatch.setitem(kernels.SOURCES, "norm.cu", ("PLANTED=1",))
    kernels.module("norm.cu")
    assert ("norm.cu", ("PLANTED=1",)) not in compiled  # compiled already: the old options stand until clear()
    kernels.clear()
    kernels.module("norm.cu")
    assert ("norm.cu", ("PLANTED=1",)) in compiled


def test_unit_defines_number_the_parts():
    assert kernels.unit_defines("norm.cu") == [kernels.SOURCES["norm.cu"]]
    parts = kernels.unit_defines("matmul.cu")
    assert [d[-1] for d in parts] == [f"GRAPHIR_PART={k}" for k in range(kernels.PARTS["matmul.cu"])]
