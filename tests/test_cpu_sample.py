"""The cpu backend's sample rule (greedy rows by argmax over the f32 row, other rows by the reference's
sample_row) against the reference backend, bit for bit: ties, NaN logits, leading axes, mixed settings."""

from __future__ import annotations

import numpy as np
import pytest
from graphir.backends.registry import get_backend

from graphir import g
from graphir.ir import Graph


def _sample_both(x: np.ndarray, settings: np.ndarray) -> tuple[np.ndarray, np.ndarray, object]:
    node = g.sample(g.input("x", x.shape), g.input("s", settings.shape))
    feeds = {"x": x, "s": settings}
    cpu = get_backend("cpu").lower(Graph({"out": node}))
    ref = get_backend("reference").lower(Graph({"out": node}))
    return cpu(feeds)["out"], ref(feeds)["out"], cpu


@pytest.mark.parametrize("vocab", [1, 7, 1025, 49152])
def test_cpu_sample_equals_the_reference(vocab):
    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 4, size=(6, vocab)).astype(np.float32)  # ties for the maximum
    x[3, vocab // 2] = np.nan  # the reference's argmax returns the first NaN; so must the f32 one
    x[4] = rng.standard_normal(vocab).astype(np.float32) * 3
    settings = np.array([[0.0, 0, 1.0, 0.5],     # greedy: temperature 0
                         [1.5, 1.7, 1.0, 0.9],   # greedy: top_k truncates to 1
                         [-1.0, 40, 0.3, 0.2],   # greedy: temperature below 0
                         [0.0, 0, 1.0, 0.1],     # greedy over a row with a NaN
                         [0.8, 40, 0.9, 0.37],   # sampled
                         [2.0, 0, 1.0, 0.999]],  # sampled, no cuts
                        np.float32)
    ours, ref, cpu = _sample_both(x, settings)
    assert ours.dtype == ref.dtype == np.int32
    np.testing.assert_array_equal(ours, ref)
    assert ours[3] == vocab // 2 and ours[0] == list(x[0]).index(x[0].max())
    assert "_sample" in cpu._steps[0].__qualname__  # the rule ran, not the numpy reference


def test_cpu_sample_leading_axes_and_settings_read_each_call():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 300)).astype(np.float32)
    settings = np.zeros((2, 3, 4), np.float32)
    node = g.sample(g.input("x", x.shape), g.input("s", settings.shape))
    cpu = get_backend("cpu").lower(Graph({"out": node}))
    ref = get_backend("reference").lower(Graph({"out": node}))
    for temperature in (0.0, 0.7):
        settings[..., 0], settings[..., 1], settings[..., 2] = temperature, 20, 0.95
        settings[..., 3] = rng.uniform(0, 1, (2, 3))
        feeds = {"x": x, "s": settings}
        ours = cpu(feeds)["out"]
        assert ours.shape == (2, 3)
        np.testing.assert_array_equal(ours, ref(feeds)["out"])
