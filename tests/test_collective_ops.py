"""The collective ops (graphir/ops/collective.py) against numpy formulas, on the reference and cpu backends.

Simulated ranks: one source per rank, so the sum and the gather are plain math written out here
(a loop over ranks in float64). One rank's form (one source) is typed like NCCL's result and refused
by the numpy backends, which cannot talk to other ranks. `covers` records these tests in
test_ops.OP_TESTS, which tests/test_ops_table.py checks.
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu_helpers import gpu_only
from graphir.backends.registry import get_backend
from test_ops import covers

from graphir import g
from graphir.errors import BackendError, GraphError
from graphir.ir import Graph

BACKENDS = ["reference", "cpu", pytest.param("gpu", marks=[pytest.mark.gpu, gpu_only])]
SIZES = [1, 7, 511, 1025]


def run(backend: str, out, feeds: dict) -> np.ndarray:
    return get_backend(backend).lower(Graph({"out": out}), None)(feeds)["out"]


def pieces(rng: np.random.Generator, ranks: int, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {f"x{r}": (rng.standard_normal(shape) + 0.5).astype(np.float32) for r in range(ranks)}


@covers("all_reduce")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("cols", SIZES)
def test_all_reduce_sums_the_ranks(backend, ranks, cols, rng):
    feeds = pieces(rng, ranks, (3, cols))
    out = g.all_reduce(*(g.input(k, v.shape) for k, v in feeds.items()), ranks=ranks)
    want = np.zeros((3, cols))
    for r in range(ranks):
        want += feeds[f"x{r}"].astype(np.float64)
    got = run(backend, out, feeds)
    assert got.shape == (3, cols) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@covers("all_gather")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("widths", [(1,), (7, 7), (511, 1, 2), (3, 1025, 4, 1)])
def test_all_gather_joins_uneven_pieces_in_rank_order(backend, axis, widths, rng):
    shapes = [(w, 5) if axis == 0 else (5, w) for w in widths]
    feeds = {f"x{r}": (rng.standard_normal(s) + 0.5).astype(np.float32) for r, s in enumerate(shapes)}
    out = g.all_gather(*(g.input(k, v.shape) for k, v in feeds.items()), axis=axis, ranks=len(widths))
    total = sum(widths)
    want = np.zeros((total, 5) if axis == 0 else (5, total), np.float32)
    start = 0
    for r, w in enumerate(widths):  # rank r's piece lands after ranks 0..r-1's
        if axis == 0:
            want[start:start + w] = feeds[f"x{r}"]
        else:
            want[:, start:start + w] = feeds[f"x{r}"]
        start += w
    np.testing.assert_array_equal(run(backend, out, feeds), want)


def test_one_ranks_form_is_typed_like_nccl_and_refused_by_numpy_backends():
    x = g.input("x", (2, 7))
    gathered = g.all_gather(x, axis=1, ranks=4)
    assert gathered.shape == (2, 28)  # NCCL gathers equal pieces
    summed = g.all_reduce(x, ranks=4)
    assert summed.shape == (2, 7)
    feeds = {"x": np.ones((2, 7), np.float32)}
    for out in (summed, gathered):
        with pytest.raises(BackendError, match="holds one rank of 4; it needs a backend that exchanges data"):
            run("reference", out, feeds)


@pytest.mark.parametrize("build, rule", [
    (lambda a, b: g.all_reduce(a, b, ranks=3), "takes 1 source .* or 3 .*got 2"),
    (lambda a, b: g.all_reduce(a, g.input("c", (2, 8)), ranks=2), "sums equal shapes"),
    (lambda a, b: g.all_gather(a, g.input("c", (3, 7)), axis=1, ranks=2), "differs from source 0 .* outside axis 1"),
    (lambda a, b: g.all_reduce(a, g.input("i", (2, 7), "i32"), ranks=2), "must be a float tensor"),
    (lambda a, b: g.all_gather(a, b, axis=2, ranks=2), "axis 2 is out of range"),
])
def test_bad_collectives_name_the_rule(build, rule):
    a, b = g.input("a", (2, 7)), g.input("b", (2, 7))
    with pytest.raises(GraphError, match=rule):
        build(a, b)
