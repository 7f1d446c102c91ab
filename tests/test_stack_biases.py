"""stack-projections on biased projections (Qwen2's q/k/v) of unusual shapes: a bias shared by two projections or read
by another node, 2-D biases, biases of mixed or 16-bit dtypes, a bias add that is a graph output, one row of x, more
rows than max_rows. Each rewrite either stacks the biases into one add or leaves each bias added to its view (or
nothing stacked), and the passed graph's outputs equal the unpassed graph's on the reference backend. The biases are
random (1 + 0.1 * normal, test_passes.random_weights), never zero, so a dropped or misplaced bias fails.
"""

from __future__ import annotations

import pytest
from test_passes import N, assert_close, random_weights, run

from graphir.builder import g
from graphir.ir import Graph
from graphir.passes import run_pipeline

ROWS = {"q": 40, "k": 24, "v": 24}  # awkward: none a power of two, k and v alike (a shared bias fits both)


def biased(case: str, rows: int = N) -> Graph:
    """q, k, v = add(mul_mat(w, x), b) of one x [rows, 96], bent by `case`."""
    x = g.input("x", (rows, 96))
    out = {}
    for name, n in ROWS.items():
        shape = (1, n) if case == "bias_2d" else (n,)
        dtype = "f16" if case == "all_f16" or (case == "mixed_dtype" and name == "k") else "f32"
        bias = g.param("attn_kv.bias" if case == "shared" and name != "q" else f"attn_{name}.bias", shape, dtype)
        out[name] = g.add(g.mul_mat(g.param(f"attn_{name}.weight", (n, 96)), x), bias)
        if case == "read_elsewhere" and name == "k":
            out["k_bias_sq"] = g.mul(bias, bias)
        if case == "add_is_output" and name == "k":
            out["k_sq"] = g.mul(out[name], out[name])
    return Graph(out, meta={"case": case})


# case -> (rows of x, stacked mul_mats, bias adds after the pass: 1 when the biases are stacked)
CASES = {
    "plain": (N, 1, 1),
    "shared": (N, 1, 1),  # k and v read one bias Param: stacked twice over, each copy at its own rows
    "read_elsewhere": (N, 1, 1),
    "add_is_output": (N, 1, 1),
    "all_f16": (N, 1, 1),
    "one_row": (1, 1, 1),
    "bias_2d": (N, 1, 3),  # [1, rows] biases: not a projection's bias; each added to its view
    "mixed_dtype": (N, 1, 3),  # one concat can hold one dtype
    "past_max_rows": (17, 3, 3),  # compute-bound: nothing stacks
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_biased_group_stays_exact(case):
    rows, mul_mats, adds = CASES[case]
    graph = biased(case, rows)
    out = run_pipeline(graph, "stack-projections,dce", verify_each=True)
    nodes = list(out.nodes())
    assert sum(n.op == "mul_mat" for n in nodes) == mul_mats
    assert sum(n.op == "add" for n in nodes) == adds
    if adds == 1:
        (add,) = [n for n in nodes if n.op == "add"]
        assert add.src[0].op == "mul_mat" and add.src[1].op == "concat" and add.src[1].shape == (88,)
        assert all(out.outputs[k].op == "view" and out.outputs[k].src[0] is add for k in ROWS)
    weights = random_weights(graph)
    assert_close(run(graph, weights)[0], run(out, weights)[0], case)
