"""What the GPU suite shares: whether a device is here, the skip mark for when it is not, a device
array's host copy, the norm-wise closeness every whole-tensor comparison uses, and one step of a
captured Program beside its launched twin."""

from __future__ import annotations

import numpy as np
import pytest
from graphir.backends.gpu.device import available

HAS_GPU = available()
gpu_only = pytest.mark.skipif(not HAS_GPU, reason="no GPU here: CuPy sees no CUDA/HIP device")


def host(x) -> np.ndarray:
    """x on the host: a CuPy array copied back, anything else as a numpy array."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def captured_and_launched(captured, launched, feeds: dict[str, np.ndarray], s_cap, s_launched, monkeypatch,
                          output: str):
    """`output` of one call of a captured Program and of its twin called with GRAPHIR_NO_CAPTURE=1 (every
    kernel launched from Python), each on its own State."""
    got = captured(feeds, s_cap)[output]
    monkeypatch.setenv("GRAPHIR_NO_CAPTURE", "1")
    want = launched(feeds, s_launched)[output]
    monkeypatch.delenv("GRAPHIR_NO_CAPTURE")
    return got, want


def assert_rel_close(got: np.ndarray, want: np.ndarray, rel: float, what: str) -> None:
    """max |got - want| <= rel * max |want| over the whole tensor. Elementwise rtol cannot express it:
    values near zero carry the absolute error of a sum over many terms."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err, scale = float(np.abs(got.astype(np.float64) - want).max()), float(np.abs(want).max())
    assert err <= rel * scale, f"{what}: max |diff| {err:.3g} > {rel} * max |want| {scale:.3g}"
