"""Stack scratch and reinterpreting views for the cpu kernels (backends/cpu/stack_array.py) against numpy's."""

from __future__ import annotations

import sys

import numpy as np
from graphir.backends.cpu.stack_array import as_f32, as_i32, bits_as_f32, stack_f32, stack_i32
from numba import njit


@njit
def _scratch_sums(x):
    a = stack_f32(8)
    b = stack_i32(8)
    for i in range(8):
        a[i] = x[i] * np.float32(2.0)
        b[i] = np.int32(i)
    s = np.float32(0.0)
    for i in range(8):
        s += a[i] + np.float32(b[i])
    return s


@njit
def _views(x, k):
    bits = as_i32(x)
    back = as_f32(bits)
    return bits[k], back[k], bits_as_f32(bits[k])


@njit
def _view_out(x):
    return as_i32(x)


def test_stack_scratch_is_private_to_each_call():
    x = np.arange(8, dtype=np.float32)
    for _ in range(3):
        assert _scratch_sums(x) == np.float32(2 * x.sum() + 28)


def test_views_read_the_same_bits_as_numpy_views():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(64), [0.0, -0.0, np.inf, -np.inf, 1e-40, np.nan]]).astype(np.float32)
    for k in range(x.size):
        bits, back, scalar = _views(x, k)
        assert bits == x.view(np.int32)[k]
        assert np.float32(back).view(np.int32) == x.view(np.int32)[k]
        assert np.float32(scalar).view(np.int32) == x.view(np.int32)[k]


def test_a_view_holds_a_reference_to_the_array_it_views():
    """The view shares the array's memory and counts as a reference (one missing incref freed memory twice: a
    malloc abort in a SmolLM2 run)."""
    x = np.linspace(-3, 3, 50, dtype=np.float32)
    before = sys.getrefcount(x)
    for k in range(2000):
        _views(x, k % 50)
    assert sys.getrefcount(x) == before
    v = _view_out(x)
    assert np.shares_memory(v, x) and np.array_equal(v, x.view(np.int32))
    del x
    assert v.sum() == v.sum()  # still readable: the view keeps the memory alive
