"""Shared fixtures: a seeded random generator. The session's passed graphs go to a fresh directory
(graphir/graph_cache.py), so no test reads what another checkout or version left in ~/.cache."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest


def pytest_configure(config) -> None:
    os.environ.setdefault("GRAPHIR_CACHE_DIR", tempfile.mkdtemp(prefix="graphir-test-cache-"))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
