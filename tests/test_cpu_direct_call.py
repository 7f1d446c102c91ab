"""Bound kernel calls that skip numba's dispatcher (backends/cpu/direct_call.py), the CPU Program that puts
them in its step list, and matmul._num_threads' ctypes lookup."""

from __future__ import annotations

import functools
import subprocess
import sys

import numba
import numpy as np
import pytest
from graphir.backends.cpu import kernels as K
from graphir.backends.cpu.direct_call import KernelCall, entry_point, unwrap
from graphir.backends.registry import get_backend

import graphir
from graphir import g
from graphir.errors import BackendError
from graphir.ir import Graph
from graphir.weights import Weight, Weights


@numba.njit
def _scale_into(x, a, out):
    for i in range(x.shape[0]):
        out[i] = x[i] * a


@numba.njit("void(float64[::1], float64, float64[::1])")
def _scale_into_f64(x, a, out):
    for i in range(x.shape[0]):
        out[i] = x[i] * a


def test_kernel_call_goes_to_the_entry_point_after_its_first_call():
    x, out = np.arange(5, dtype=np.float32), np.zeros(5, np.float32)
    step = KernelCall(_scale_into, x, np.float32(3), out)
    assert step.direct is None
    step()
    np.testing.assert_array_equal(out, x * 3)
    sig = tuple(numba.typeof(a) for a in (x, np.float32(3), out))
    assert isinstance(step.direct, functools.partial)
    assert step.direct.func is _scale_into.overloads[sig].entry_point
    x[:] = [5, 4, 3, 2, 1]  # the bound arrays are read at each call
    step()
    np.testing.assert_array_equal(out, np.float32([15, 12, 9, 6, 3]))
    other = lambda: None  # noqa: E731
    assert unwrap([step, other]) == [step.direct, other]


def test_a_kernel_call_not_yet_run_stays_in_the_step_list():
    step = KernelCall(_scale_into, np.ones(3, np.float32), np.float32(2), np.zeros(3, np.float32))
    assert unwrap([step]) == [step]


def test_arguments_the_dispatcher_converts_keep_the_dispatcher():
    # an int scale for a kernel compiled for float64 only: the dispatcher converts it, the entry point would not
    x, out = np.arange(4, dtype=np.float64), np.zeros(4)
    assert entry_point(_scale_into_f64, (x, 2, out)) is None
    step = KernelCall(_scale_into_f64, x, 2, out)
    step()
    step()
    assert step.direct is None
    np.testing.assert_array_equal(out, x * 2)


def test_the_entry_point_raises_as_the_dispatcher_does():
    dst, src = np.zeros((4, 3), np.float32), np.ones((1, 3), np.float32)
    idx = np.array([1], np.int32)
    step = KernelCall(K.set_rows, dst, src, idx)
    step()
    assert step.direct is not None and dst[1].tolist() == [1, 1, 1]
    idx[0] = 4
    with pytest.raises(IndexError, match="set_rows: row index out of range"):
        step()


def test_num_threads_uses_numba_ctypes_function_once_threads_are_launched():
    # in a new process, so that matmul is imported before numba has launched its threads
    code = ("import numba\nfrom graphir.backends.cpu import matmul as MM\n"
            "assert MM._num_threads() == numba.get_num_threads()\n"
            "assert MM._raw_num_threads is not None\n"
            "numba.set_num_threads(1)\n"
            "assert MM._num_threads() == 1\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def _programs(model: graphir.Model) -> list:
    return [p for _, p, _ in model.programs._programs.values()]


def test_program_calls_its_kernels_directly_from_its_second_call_with_the_same_results():
    model = graphir.load("random:qwen3-tiny", backend="cpu", passes="default", ctx=64)
    ids = list(np.random.default_rng(1).integers(0, 256, 13))
    first = [model.feed(ids, last_only=True)] + [model.feed([t]) for t in (7, 200, 65)]  # dispatchers, then direct
    model.reset()
    again = [model.feed(ids, last_only=True)] + [model.feed([t]) for t in (7, 200, 65)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    for program in _programs(model):
        assert program._unwrapped
        assert not any(isinstance(s, KernelCall) for s in program._steps)
    decode = next(p for p in _programs(model) if p.graph.inputs[0].shape == (1,))
    direct = [s for s in decode._steps if isinstance(s, functools.partial)]
    assert len(direct) >= 3 * 2  # per layer at least set_rows, rope_set_rows and an add_rms_norm_mul


def test_program_bad_token_id_in_a_weight_table_is_a_backend_error():
    table = np.random.default_rng(2).standard_normal((9, 4)).astype(np.float32)
    node = g.get_rows(g.param("emb", (9, 4), "f32"), g.input("ids", (2,), "i32"))
    program = get_backend("cpu").lower(Graph({"out": node}), Weights({"emb": Weight("f32", (9, 4), table)}))
    out = program({"ids": np.array([8, 0], np.int32)})["out"]
    np.testing.assert_array_equal(out, table[[8, 0]])
    for bad in (-1, 9):
        with pytest.raises(BackendError, match=rf"get_rows: id {bad} out of range 0\.\.8"):
            program({"ids": np.array([0, bad], np.int32)})


@numba.njit
def _scale_ro(x, a, out):
    for i in range(x.shape[0]):
        out[i] = x[i] * a


def test_first_call_types_arrays_itself_and_takes_a_read_only_overload(tmp_path):
    """first_call compiles for the types numba's typeof gives (arrays typed without typeof), and where the kernel has
    one overload typed with read-only inputs (matmul's, compiling disabled) calls it as the dispatcher would."""
    from graphir.backends.cpu.direct_call import first_call

    x, out = np.arange(6, dtype=np.float32), np.zeros(6, np.float32)
    ro = numba.types.Array(numba.float32, 1, "C", readonly=True)
    _scale_ro.compile((ro, numba.float32, numba.float32[::1]))
    _scale_ro.disable_compile()
    call = first_call(_scale_ro, x, np.float32(2), out)
    np.testing.assert_array_equal(out, x * 2)
    assert call is next(iter(_scale_ro.overloads.values())).entry_point
    call(x, np.float32(3), out)
    np.testing.assert_array_equal(out, x * 3)
    assert len(_scale_ro.overloads) == 1
    # a memmap is typed as an ndarray, as typeof types it
    fresh = numba.njit(_scale_into.py_func)
    x.tofile(tmp_path / "x.bin")
    first_call(fresh, np.memmap(tmp_path / "x.bin", np.float32, mode="r+"), np.float32(2), out)
    np.testing.assert_array_equal(out, x * 2)
    assert list(fresh.overloads) == [tuple(numba.typeof(a) for a in (x, np.float32(2), out))]
