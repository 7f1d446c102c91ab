"""The cpu backend's thread count: auto follows other programs' load; a fixed count is obeyed; results
do not depend on it."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from graphir.backends.cpu import threads as T

import graphir
from graphir.errors import InputError


class FakeMachine:
    """/proc/stat and our process's CPU time, advanced by `run(seconds, ours, others)` in cores."""

    def __init__(self) -> None:
        self.t = 0.0
        self.busy = 0  # jiffies, 100 Hz
        self.own = 0.0
        self.readable = True
        self.reads = 0

    def run(self, seconds: float, ours: float, others: float) -> None:
        self.t += seconds
        self.busy += round((ours + others) * seconds * 100)
        self.own += ours * seconds

    def watch(self, cap: int, cpus: int) -> T.LoadWatch:
        return T.LoadWatch(cap, cpus, self.stat, own_cpu=lambda: self.own, clock=lambda: self.t, hz=100)

    def stat(self) -> tuple[int, int] | None:
        self.reads += 1
        return (self.busy, 0) if self.readable else None


def test_auto_uses_the_pool_on_a_quiet_machine_and_one_thread_beside_a_hog():
    m = FakeMachine()
    w = m.watch(cap=2, cpus=2)
    assert w.current() == 2
    m.run(0.3, ours=1.9, others=0.05)  # background noise stays under BUSY_CORES
    assert w.current() == 2
    m.run(0.3, ours=1.4, others=0.6)  # a hog takes its share of a core
    assert w.current() == 1
    m.run(0.1, ours=1.0, others=1.0)  # inside a window: no new decision
    assert w.current() == 1
    m.run(0.3, ours=1.0, others=1.0)  # still busy: keep one thread
    assert w.current() == 1
    m.run(0.3, ours=1.0, others=0.0)  # the hog ended
    assert w.current() == 2


def test_auto_drops_one_thread_per_busy_core_never_below_one():
    m = FakeMachine()
    w = m.watch(cap=8, cpus=8)
    m.run(0.5, ours=6.0, others=1.6)
    assert w.current() == 6
    m.run(0.5, ours=1.0, others=7.0)
    assert w.current() == 1
    w = m.watch(cap=4, cpus=8)  # the pool caps it even on a quiet machine with more cores
    m.run(0.5, ours=4.0, others=0.0)
    assert w.current() == 4


def test_auto_keeps_the_pool_where_proc_stat_is_unreadable():
    m = FakeMachine()
    m.readable = False
    w = m.watch(cap=2, cpus=2)
    m.run(0.5, ours=0.5, others=1.5)
    assert w.current() == 2
    reads = m.reads
    m.run(0.1, ours=0.5, others=1.5)
    assert w.current() == 2 and m.reads == reads  # tried once a window, not at every call


def test_set_threads_validates_and_fixes_the_count():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InputError, match="threads must be an int >= 1"):
            T.set_threads(bad)
    with pytest.raises(InputError, match=r"threads=\d+ exceeds numba's pool of \d+ threads"):
        T.set_threads(T.pool_size() + 1)
    try:
        T.set_threads(1)
        assert T.get_threads() == 1 and T.threads_now() == 1
        T.apply()
        assert numba.get_num_threads() == 1
    finally:
        T.set_threads(None)
    assert T.get_threads() is None


def test_logits_do_not_depend_on_the_thread_count():
    """Rows of every matmul and (query, head) tasks of attention are computed whole by one thread,
    so the count changes who computes what, never the arithmetic: logits are bitwise equal."""
    model = graphir.load("random:llama-tiny", backend="cpu", dtype="q4_1")
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    runs = []
    try:
        for n in sorted({1, T.pool_size()}):
            T.set_threads(n)
            runs.append((model.logits(ids), model.feed([7])))
    finally:
        T.set_threads(None)
    ref = graphir.load("random:llama-tiny", backend="reference", dtype="q4_1").logits(ids)
    np.testing.assert_allclose(runs[0][0], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    for logits, step in runs[1:]:
        np.testing.assert_array_equal(logits, runs[0][0])
        np.testing.assert_array_equal(step, runs[0][1])


def test_load_sets_threads_and_checks_them_before_reading_files():
    with pytest.raises(InputError, match="threads must be an int >= 1"):
        graphir.load("/no/such/model.gguf", threads=0)
    try:
        graphir.load("random:llama-tiny", backend="cpu", threads=1)
        assert T.get_threads() == 1
        graphir.load("random:llama-tiny", backend="cpu")  # None leaves the setting as it is
        assert T.get_threads() == 1
    finally:
        T.set_threads(None)


def test_cli_threads_option():
    from click.testing import CliRunner

    from graphir.cli import main

    try:
        r = CliRunner().invoke(main, ["run", "random:llama-tiny", "--backend", "cpu", "-n", "2", "--threads", "1"])
        assert r.exit_code == 0, r.output
        assert T.get_threads() == 1
    finally:
        T.set_threads(None)
    r = CliRunner().invoke(main, ["run", "random:llama-tiny", "--threads", "0"])
    assert r.exit_code == 2 and "--threads" in r.output


@pytest.mark.parametrize("shape", [(1, 1536), (7, 1025), (9, 1025), (17, 511)])
def test_swiglu_serial_and_parallel_kernels_equal_the_formula(shape, rng):
    """Small inputs take the serial kernel, large ones the parallel one (PARALLEL_MIN_ELEMENTS)."""
    from graphir.backends.cpu import kernels as K
    from graphir.backends.cpu.lowering_rules import PARALLEL_MIN_ELEMENTS

    a = (3 * rng.standard_normal(shape)).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    a64 = a.astype(np.float64)
    want = a64 / (1 + np.exp(-a64)) * b
    for kernel in (K.swiglu, K.swiglu_split):
        out = np.empty_like(a)
        kernel(a, b, out)
        np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6)
    assert (a.size >= PARALLEL_MIN_ELEMENTS) == (shape[0] >= 9)  # both sides of the threshold are covered
