"""Graphs computed from Params and Consts alone (folded at lowering by compiling backends) give the reference's
values on every host backend: a researcher looking at a weight, a stacked weight or rows of an embedding."""

from __future__ import annotations

import numpy as np
import pytest
from graphir.backends.registry import get_backend

from graphir import g
from graphir.ir import Graph
from graphir.quant import quantize
from graphir.weights import Weight, Weights

W = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)


def _weights(dtype: str) -> Weights:
    return Weights({"w": Weight(dtype, (4, 32), W if dtype == "f32" else quantize(W, dtype))})


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", ["f32", "q4_0"])
@pytest.mark.parametrize("build", [
    lambda p: p,
    lambda p: g.concat(p, p, axis=0),
    lambda p: g.get_rows(p, g.const([3, 0, 3], "i32")),
], ids=["param", "stacked", "const-rows"])
def test_param_only_outputs_match_the_reference(backend, dtype, build):
    """On the cpu a Param output (or a stacked one) came back as a 0-d object array holding a ParamRef, and
    get_rows of a Param at i32 const ids was an IndexError: the fold read every const as f32."""
    graph = Graph({"y": build(g.param("w", (4, 32), dtype))})
    want = get_backend("reference").lower(graph, _weights(dtype))({}, {})["y"]
    got = get_backend(backend).lower(graph, _weights(dtype))({}, {})["y"]
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
