"""Every op of the table, run on the reference backend and checked against a numpy formula written here.

The expected values never call `OPS[...].ref`: each test restates the op's meaning in its own
words (loops, complex numbers, float64), so a wrong reference cannot agree with itself.
`OP_TESTS` records which tests cover which op; tests/test_ops_table.py fails on a gap.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import gguf
import numpy as np
import pytest
from _gpu_helpers import gpu_only
from graphir.backends.registry import get_backend

from graphir import g
from graphir.dtypes import QUANTIZED
from graphir.errors import BackendError, GraphError
from graphir.ir import Graph, Node
from graphir.quant import quantize, random_quantized
from graphir.weights import Weight, Weights

OP_TESTS: dict[str, list[str]] = {}


def covers(*ops: str) -> Callable:
    """Record that the decorated test checks `ops` against an independent formula."""

    def deco(fn: Callable) -> Callable:
        for name in ops:
            OP_TESTS.setdefault(name, []).append(fn.__name__)
        return fn

    return deco


# Every formula test runs on every backend: the reference defines the ops, and the compiled
# backends must meet the same independent formulas at the same tolerances. The gpu runs are the
# GPU suite (marker `gpu`), skipped where CuPy sees no device.
BACKENDS = ["reference", "cpu", pytest.param("gpu", marks=[pytest.mark.gpu, gpu_only])]
_backend = {"name": "reference"}


@pytest.fixture(autouse=True, params=BACKENDS)
def backend(request):
    _backend["name"] = request.param
    yield request.param
    _backend["name"] = "reference"


def run(outputs: Node | dict[str, Node], inputs: dict | None = None, *, weights: Weights | None = None,
        state: dict | None = None, updates: tuple[Node, ...] = ()) -> dict[str, np.ndarray]:
    graph = Graph(outputs if isinstance(outputs, dict) else {"out": outputs}, updates)
    return get_backend(_backend["name"]).lower(graph, weights)(inputs or {}, state)


def run1(out: Node, inputs: dict | None = None, **kw) -> np.ndarray:
    return run({"out": out}, inputs, **kw)["out"]


def close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-5, atol: float = 1e-5, dtype: str | None = None) -> None:
    assert got.shape == np.shape(want), f"shape {got.shape} != {np.shape(want)}"
    if dtype is not None:
        assert got.dtype == np.dtype(dtype), f"dtype {got.dtype} != {dtype}"
    np.testing.assert_allclose(got.astype(np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol)


def normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0, dtype=np.float32) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dtype)


def qtype(dtype: str) -> gguf.GGMLQuantizationType:
    return getattr(gguf.GGMLQuantizationType, dtype.upper())


def weights_of(**items: tuple[str, np.ndarray, tuple[int, ...]]) -> Weights:
    return Weights({k: Weight(dt, tuple(shape), raw) for k, (dt, raw, shape) in items.items()})


# ---------------------------------------------------------------- elementwise
BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
}
BROADCASTS = [((7, 511), (7, 511)), ((7, 511), (511,)), ((7, 511), (7, 1)), ((1, 1025), (1,)),
              ((3, 7, 1025), (1, 7, 1)), ((3, 1, 5), (3, 1, 1)), ((1,), (1,))]


@covers("add", "sub", "mul", "div")
@pytest.mark.parametrize("opname", list(BINARY))
@pytest.mark.parametrize("sa,sb", BROADCASTS)
def test_binary(opname, sa, sb, rng):
    a = normal(rng, sa)
    b = normal(rng, sb)
    b = np.where(np.abs(b) < 0.1, 0.5, b).astype(np.float32)  # keep div well conditioned
    out = run1(getattr(g, opname)(g.input("a", sa), g.input("b", sb)), {"a": a, "b": b})
    bb = np.broadcast_to(b.astype(np.float64), sa)
    close(out, BINARY[opname](a.astype(np.float64), bb), rtol=1e-6, atol=1e-6, dtype="float32")


@covers("add", "mul")
@pytest.mark.parametrize("opname", ["add", "mul"])
def test_binary_f16_keeps_a_dtype(opname, rng):
    a = normal(rng, (7, 33), dtype=np.float16)
    b = normal(rng, (33,))
    out = run1(getattr(g, opname)(g.input("a", a.shape, "f16"), g.input("b", b.shape)), {"a": a, "b": b})
    close(out, BINARY[opname](a.astype(np.float64), b.astype(np.float64)), rtol=2e-3, atol=2e-3, dtype="float16")


def _sigmoid64(x: np.ndarray) -> np.ndarray:
    return 0.5 + 0.5 * np.tanh(0.5 * x)  # the same function as 1/(1+e^-x), written another way


UNARY = {
    "neg": lambda x: 0.0 - x,
    "exp": lambda x: np.e ** x,
    "sigmoid": _sigmoid64,
    "silu": lambda x: x * _sigmoid64(x),
    "gelu": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
    "softplus": lambda x: np.where(x > 30, x + np.log1p(np.exp(-np.abs(x))), np.log1p(np.exp(np.minimum(x, 30)))),
}


@covers(*UNARY)
@pytest.mark.parametrize("opname", list(UNARY))
@pytest.mark.parametrize("shape", [(1,), (7, 511), (2, 1025)])
def test_unary(opname, shape, rng):
    x = normal(rng, shape, scale=3.0)
    out = run1(getattr(g, opname)(g.input("x", shape)), {"x": x})
    close(out, UNARY[opname](x.astype(np.float64)), rtol=2e-6, atol=2e-6, dtype="float32")


@covers("softplus", "sigmoid", "silu", "exp")
@pytest.mark.filterwarnings("error")  # no overflow warnings either
def test_unary_extremes_stay_finite():
    x = np.array([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 80.0, 100.0], np.float32)
    inp = g.input("x", x.shape)
    out = run({"sp": g.softplus(inp), "sg": g.sigmoid(inp), "si": g.silu(inp)}, {"x": x})
    x64 = x.astype(np.float64)
    close(out["sp"], np.maximum(x64, 0) + np.log1p(np.exp(-np.abs(x64))), rtol=1e-6, atol=1e-30)
    close(out["sg"], _sigmoid64(x64), rtol=1e-6, atol=1e-12)  # tanh form loses digits near 0
    close(out["si"], x64 * _sigmoid64(x64), rtol=1e-6, atol=1e-10)
    small = np.array([-5.0, 0.0, 2.5], np.float32)
    close(run1(g.exp(g.input("x", (3,))), {"x": small}), [math.exp(-5), 1.0, math.exp(2.5)], rtol=1e-6)


@covers("scale")
@pytest.mark.parametrize("s,b", [(2.5, None), (-0.5, 1.25), (2, 0), (0.0, -3.0)])
def test_scale(s, b, rng):
    x = normal(rng, (7, 511))
    kw = {"s": s} if b is None else {"s": s, "b": b}
    out = run1(g.scale(g.input("x", x.shape), **kw), {"x": x})
    close(out, x.astype(np.float64) * s + (b or 0.0), rtol=1e-6, atol=1e-6, dtype="float32")


@covers("swiglu_split")
@pytest.mark.parametrize("shape", [(1, 1), (7, 1025)])
def test_swiglu_split(shape, rng):
    a, b = normal(rng, shape, 3.0), normal(rng, shape)
    out = run1(g.swiglu_split(g.input("a", shape), g.input("b", shape)), {"a": a, "b": b})
    a64 = a.astype(np.float64)
    close(out, a64 / (1 + np.exp(-a64)) * b, rtol=2e-6, atol=2e-6)


@covers("mul_sigmoid")
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 511), (2, 3, 1025)])
def test_mul_sigmoid(shape, rng):
    a, b = normal(rng, shape), normal(rng, shape, 3.0)
    out = run1(g.mul_sigmoid(g.input("a", shape), g.input("b", shape)), {"a": a, "b": b})
    close(out, a.astype(np.float64) * _sigmoid64(b.astype(np.float64)), rtol=2e-6, atol=2e-6, dtype="float32")


@covers("mul_sigmoid")
def test_mul_sigmoid_reads_a_strided_gate(rng):
    """Qwen3.5's gated attention: the gate is the second half of each head of the q projection."""
    n, heads, d = 3, 4, 7
    y = normal(rng, (n, heads * 2 * d), 3.0)  # per head [q (d), gate (d)]
    attn = normal(rng, (n, heads, d))
    gate = g.view(g.input("y", y.shape), shape=(n, heads, d), strides=(heads * 2 * d, 2 * d, 1), offset=d)
    out = run1(g.mul_sigmoid(g.input("attn", attn.shape), gate), {"y": y, "attn": attn})
    want = attn.astype(np.float64) * _sigmoid64(y.reshape(n, heads, 2, d)[:, :, 1].astype(np.float64))
    close(out, want, rtol=2e-6, atol=2e-6, dtype="float32")


def test_mul_sigmoid_needs_equal_shapes():
    with pytest.raises(GraphError, match="must match"):
        g.mul_sigmoid(g.input("a", (3, 4)), g.input("b", (3, 1)))


# ---------------------------------------------------------------- norms
def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1]).astype(np.float64)


def _rms_norm(x, eps):
    out = [r / math.sqrt(sum(v * v for v in r) / len(r) + eps) for r in _rows(x)]
    return np.array(out).reshape(x.shape)


def _l2_norm(x, eps):
    out = [r / math.sqrt(sum(v * v for v in r) + eps) for r in _rows(x)]
    return np.array(out).reshape(x.shape)


def _layer_norm(x, eps):
    out = []
    for r in _rows(x):
        mu = sum(r) / len(r)
        var = sum((v - mu) ** 2 for v in r) / len(r)
        out.append((r - mu) / math.sqrt(var + eps))
    return np.array(out).reshape(x.shape)


NORMS = {"rms_norm": _rms_norm, "l2_norm": _l2_norm, "norm": _layer_norm}


@covers(*NORMS)
@pytest.mark.parametrize("opname", list(NORMS))
@pytest.mark.parametrize("shape", [(1, 1), (7, 511), (2, 3, 1025)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_norms(opname, shape, eps, rng):
    x = normal(rng, shape, scale=2.0) + 0.5
    out = run1(getattr(g, opname)(g.input("x", shape), eps=eps), {"x": x})
    close(out, NORMS[opname](x, eps), rtol=1e-5, atol=1e-5, dtype="float32")


def small_for_eps(rng: np.random.Generator, shape: tuple[int, ...], eps: float, per_row_sum: bool = False):
    """Rows whose mean square (sum of squares if per_row_sum) is about eps: eps moves the result by
    ~30%, so a kernel that drops or mis-scales eps cannot pass a 1e-5 tolerance."""
    n = 1 if not per_row_sum else shape[-1]
    return normal(rng, shape, scale=math.sqrt(eps / n))


def eps_moves(want: np.ndarray, without_eps: np.ndarray) -> bool:
    """The test's own guard: with eps dropped the expected values move by over 10% of their size."""
    return float(np.abs(want - without_eps).max()) > 0.1 * float(np.abs(want).max())


@covers(*NORMS)
@pytest.mark.parametrize("opname", list(NORMS))
@pytest.mark.parametrize("shape", [(1, 4), (7, 511), (2, 3, 1025)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_norms_where_eps_matters(opname, shape, eps, rng):
    x = small_for_eps(rng, shape, eps, per_row_sum=opname == "l2_norm")
    want = NORMS[opname](x, eps)
    assert eps_moves(want, NORMS[opname](x, 0.0))
    out = run1(getattr(g, opname)(g.input("x", shape), eps=eps), {"x": x})
    close(out, want, rtol=1e-5, atol=1e-5, dtype="float32")


# ---------------------------------------------------------------- reductions
@covers("sum_rows", "mean")
@pytest.mark.parametrize("shape", [(1, 1), (7, 511), (2, 3, 1025)])
def test_sum_rows_and_mean(shape, rng):
    x = normal(rng, shape)
    inp = g.input("x", shape)
    out = run({"s": g.sum_rows(inp), "m": g.mean(inp)}, {"x": x})
    sums = np.array([math.fsum(r) for r in _rows(x)]).reshape(shape[:-1] + (1,))
    close(out["s"], sums, rtol=1e-5, atol=1e-4, dtype="float32")
    close(out["m"], sums / shape[-1], rtol=1e-5, atol=1e-6, dtype="float32")


@covers("argmax")
@pytest.mark.parametrize("shape", [(1, 1), (7, 11), (3, 1025)])
def test_argmax_first_on_ties(shape, rng):
    x = rng.integers(-3, 4, size=shape).astype(np.float32)  # many ties
    out = run1(g.argmax(g.input("x", shape)), {"x": x})
    want = [list(r).index(max(r)) for r in x.reshape(-1, shape[-1])]
    assert out.dtype == np.int32 and out.shape == shape[:-1]
    assert out.reshape(-1).tolist() == want


@covers("top_k")
@pytest.mark.parametrize("shape,k", [((1, 1), 1), ((7, 11), 3), ((7, 11), 11), ((2, 511), 40)])
def test_top_k_ties(shape, k, rng):
    x = rng.integers(-4, 5, size=shape).astype(np.float32)  # ties: lower index first
    out = run1(g.top_k(g.input("x", shape), k=k), {"x": x})
    want = [sorted(range(shape[-1]), key=lambda i, r=r: (-r[i], i))[:k] for r in x.reshape(-1, shape[-1])]
    assert out.dtype == np.int32 and out.shape == shape[:-1] + (k,)
    assert out.reshape(-1, k).tolist() == want


def _kept_loops(x: list[float], t: float, k: int, p: float) -> list[tuple[int, float]]:
    """(id, weight) of the tokens a draw may return, in id order: the k largest (lower id first on
    ties), weighted by exp((x - max) / t), then the most likely while the mass before them is < p."""
    ranked = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if 0 < k < len(x):
        ranked = ranked[:k]
    w = {i: math.exp((x[i] - x[ranked[0]]) / t) for i in ranked}
    total, before, kept = sum(w.values()), 0.0, []
    for i in ranked:
        if before >= p * total:
            break
        kept.append(i)
        before += w[i]
    return sorted((i, w[i]) for i in kept)


def _p_between(x: list[float], t: float, k: int, j: int) -> float:
    """A top_p halfway between keeping j and j + 1 survivors of top_k: far from any rounding edge."""
    kept = _kept_loops(x, t, k, 1.0)
    w = sorted((wi for _, wi in kept), reverse=True)
    return (sum(w[:j]) + w[j] / 2) / sum(w) if j < len(w) else 1.0


SAMPLE_CASES = [  # vocab, logits kind, temperature, top_k, top_p (None: halfway after 3 survivors)
    (1, "normal", 1.0, 0, 1.0),
    (7, "normal", 0.7, 0, 1.0),
    (7, "ints", 1.0, 3, 1.0),          # ties at the top_k cut
    (511, "normal", 1.3, 40, 1.0),
    (511, "ints", 1.0, 0, None),       # ties at the top_p cut
    (1025, "normal", 0.8, 0, None),
    (1025, "normal", 2.0, 300, None),  # both cuts
    (2500, "ints", 1.0, 200, 1.0),     # more ids than threads, ties everywhere
]


@covers("sample")
@pytest.mark.parametrize("vocab,kind,t,k,p", SAMPLE_CASES)
def test_sample_draws_each_kept_token_from_its_interval(vocab, kind, t, k, p, rng):
    x = (rng.integers(-6, 7, size=vocab) if kind == "ints" else rng.standard_normal(vocab) * 3).astype(np.float32)
    xs = x.astype(np.float64).tolist()
    p = _p_between(xs, t, k, 3) if p is None else p
    kept = _kept_loops(xs, t, k, p)
    total = sum(w for _, w in kept)
    # u at the middle of each kept token's share of [0, 1) in id order (the widest 16 of them),
    # plus u = 0, which lands on the first kept id
    cum, mids = 0.0, []
    for i, w in kept:
        mids.append(((cum + w / 2) / total, i, w / total))
        cum += w
    cases = [(0.0, kept[0][0])] + [(u, i) for u, i, _ in sorted(mids, key=lambda c: -c[2])[:16]]
    rows = len(cases)
    settings = np.array([[t, k, p, u] for u, _ in cases], np.float32)
    out = run1(g.sample(g.input("x", (rows, vocab)), g.input("s", (rows, 4))),
               {"x": np.tile(x, (rows, 1)), "s": settings})
    assert out.dtype == np.int32 and out.shape == (rows,)
    assert out.tolist() == [i for _, i in cases]


@covers("sample")
@pytest.mark.parametrize("vocab", [1, 7, 1025])
def test_sample_greedy_is_first_argmax(vocab, rng):
    x = rng.integers(-2, 3, size=(3, vocab)).astype(np.float32)  # ties for the maximum
    settings = np.array([[0.0, 0, 1.0, 0.5], [1.5, 1, 1.0, 0.9], [0.0, 50, 0.3, 0.99]], np.float32)
    out = run1(g.sample(g.input("x", (3, vocab)), g.input("s", (3, 4))), {"x": x, "s": settings})
    assert out.tolist() == [list(r).index(max(r)) for r in x]


# ---------------------------------------------------------------- mul_mat
def _matmul_loops(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x @ w^T with w's batch axes broadcast onto x's, batch by batch."""
    w, x = w.astype(np.float64), x.astype(np.float64)
    wb = (1,) * (x.ndim - w.ndim) + w.shape[:-2]
    w = w.reshape(wb + w.shape[-2:])
    out = np.zeros(x.shape[:-1] + (w.shape[-2],))
    for idx in itertools.product(*(range(n) for n in x.shape[:-2])):
        widx = tuple(i if n > 1 else 0 for i, n in zip(idx, wb, strict=True))
        out[idx] = x[idx] @ w[widx].T
    return out


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


@covers("mul_mat")
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n", [1, 7])
def test_mul_mat_float_weights(dtype, n, rng):
    n_out, n_in = 511, 1025
    w32 = normal(rng, (n_out, n_in), 0.1)
    if dtype == "f32":
        raw, wf = w32, w32
    elif dtype == "f16":
        raw = w32.astype(np.float16)
        wf = raw.astype(np.float32)
    else:
        raw = (w32.view(np.uint32) >> np.uint32(16)).astype(np.uint16)  # truncate to bf16 bits
        wf = _bf16_to_f32(raw)
    x = normal(rng, (n, n_in))
    out = run1(g.mul_mat(g.param("w", (n_out, n_in), dtype), g.input("x", x.shape)), {"x": x},
               weights=weights_of(w=(dtype, raw, (n_out, n_in))))
    close(out, x.astype(np.float64) @ wf.astype(np.float64).T, rtol=1e-4, atol=1e-4, dtype="float32")


@covers("mul_mat")
@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("n", [1, 7])
def test_mul_mat_quantized_weights(dtype, n, rng):
    n_out, n_in = 511, 512
    raw = random_quantized(rng, dtype, (n_out, n_in))
    wf = gguf.quants.dequantize(raw, qtype(dtype)).reshape(n_out, n_in)
    assert np.isfinite(wf).all() and np.abs(wf).max() > 0
    x = normal(rng, (n, n_in))
    out = run1(g.mul_mat(g.param("w", (n_out, n_in), dtype), g.input("x", x.shape)), {"x": x},
               weights=weights_of(w=(dtype, raw, (n_out, n_in))))
    close(out, _matmul_loops(wf, x), rtol=1e-4, atol=1e-3, dtype="float32")


@covers("mul_mat_swiglu")
@pytest.mark.parametrize("dtype", ["f32", "bf16", "q4_0", "q8_0", "q4_k"])
@pytest.mark.parametrize("n,half", [(1, 1), (1, 511), (3, 7), (7, 511)])
def test_mul_mat_swiglu(dtype, n, half, rng):
    n_in = 512
    if dtype in ("f32", "bf16"):
        w32 = normal(rng, (2 * half, n_in), 0.1)
        raw = w32 if dtype == "f32" else (w32.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        wf = w32 if dtype == "f32" else _bf16_to_f32(raw)
    else:
        raw = random_quantized(rng, dtype, (2 * half, n_in))
        wf = gguf.quants.dequantize(raw, qtype(dtype)).reshape(2 * half, n_in)
    x = normal(rng, (n, n_in))
    out = run1(g.mul_mat_swiglu(g.param("w", (2 * half, n_in), dtype), g.input("x", x.shape)), {"x": x},
               weights=weights_of(w=(dtype, raw, (2 * half, n_in))))
    y = x.astype(np.float64) @ wf.astype(np.float64).T
    gate, up = y[:, :half], y[:, half:]  # the first half of w's rows gates, the second is up
    close(out, gate / (1 + np.exp(-gate)) * up, rtol=1e-4, atol=1e-3, dtype="float32")


def test_mul_mat_swiglu_needs_an_even_row_count():
    with pytest.raises(GraphError, match="even"):
        g.mul_mat_swiglu(g.param("w", (7, 32)), g.input("x", (1, 32)))


@covers("mul_mat")
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_mul_mat_quantize_then_multiply(dtype, rng):
    w32 = normal(rng, (33, 96))
    raw = quantize(w32, dtype)
    wf = gguf.quants.dequantize(raw, qtype(dtype)).reshape(w32.shape)
    assert np.abs(wf - w32).max() < 0.5  # the quantizer is roughly right; exactness is test_quant's job
    x = normal(rng, (7, 96))
    out = run1(g.mul_mat(g.param("w", w32.shape, dtype), g.input("x", x.shape)), {"x": x},
               weights=weights_of(w=(dtype, raw, w32.shape)))
    close(out, _matmul_loops(wf, x), rtol=1e-4, atol=1e-4)


@covers("mul_mat")
@pytest.mark.parametrize("sw,sx", [((3, 1, 5, 16), (3, 4, 7, 16)), ((5, 16), (2, 7, 16)), ((1, 5, 16), (4, 1, 16)),
                                   ((2, 3, 1, 16), (2, 3, 1, 16))])
@pytest.mark.parametrize("xdtype", ["f32", "f16"])
def test_mul_mat_batched_broadcast(sw, sx, xdtype, rng):
    npdt = np.float32 if xdtype == "f32" else np.float16
    w, x = normal(rng, sw), normal(rng, sx, dtype=npdt)
    out = run1(g.mul_mat(g.input("w", sw), g.input("x", sx, xdtype)), {"w": w, "x": x})
    assert out.shape == sx[:-1] + (sw[-2],)
    close(out, _matmul_loops(w, x), rtol=1e-5, atol=1e-5, dtype="float32")


def _to_bf16_frexp(a: np.ndarray) -> np.ndarray:
    """Round to bfloat16's 8 significant bits, ties to even (numpy's round), via frexp: m in [0.5, 1)."""
    m, e = np.frexp(a.astype(np.float64))
    return np.ldexp(np.round(m * 256) / 256, e)


@covers("mul_mat_bf16")
@pytest.mark.parametrize("dtype", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("n", [1, 7, 40])
def test_mul_mat_bf16_rounds_both_operands(dtype, n, rng):
    n_out, n_in = 511, 1024
    w32 = normal(rng, (n_out, n_in), 0.1)
    raw = quantize(w32, dtype) if dtype != "f32" else w32
    wf = gguf.quants.dequantize(raw, qtype(dtype)).reshape(n_out, n_in) if dtype == "q8_0" else \
        _bf16_to_f32(raw) if dtype == "bf16" else w32
    x = normal(rng, (n, n_in))
    x[0, :3] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)]  # exact ties: rounding to even decides them
    out = run1(g.mul_mat_bf16(g.param("w", (n_out, n_in), dtype), g.input("x", x.shape)), {"x": x},
               weights=weights_of(w=(dtype, raw, (n_out, n_in))))
    want = _to_bf16_frexp(x) @ _to_bf16_frexp(wf).T
    assert np.abs(want - x.astype(np.float64) @ wf.astype(np.float64).T).max() > 1e-3  # the rounding shows
    close(out, want, rtol=1e-5, atol=1e-5, dtype="float32")



@covers("mul_mat_bf16_rounded")
@pytest.mark.parametrize("n", [1, 7, 40])
def test_mul_mat_bf16_rounded_rounds_operands_and_result(n, rng):
    n_out, n_in = 511, 1024
    w = normal(rng, (n_out, n_in), 0.1)
    x = normal(rng, (n, n_in))
    out = run1(g.mul_mat_bf16_rounded(g.param("w", (n_out, n_in)), g.input("x", x.shape)), {"x": x},
               weights=weights_of(w=("f32", w, (n_out, n_in))))
    xb, wb = _to_bf16_frexp(x), _to_bf16_frexp(w)
    exact = xb @ wb.T
    want = _to_bf16_frexp(exact)
    # every result is a bf16 value (8 significant bits), the float64 product's rounding up to the f32 sum's error
    # (random-walk sized, sqrt(n_in) 2^-24 sum |terms|; it can cross a rounding boundary, by one step, where the
    # product lies near one: under 1 % of them here, mostly small results of much cancellation)
    assert np.array_equal(out, _to_bf16_frexp(out))
    ulp = np.ldexp(1.0, np.frexp(np.maximum(np.abs(out), np.abs(want)))[1] - 8)
    assert np.all(np.abs(out - want) <= ulp + np.sqrt(n_in) * 2.0 ** -24 * (np.abs(xb) @ np.abs(wb).T))
    assert (out != want).mean() < 0.01
    assert np.abs(out - exact).max() > 1e-3  # the result's rounding shows

def q8x_activations(n: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """x [n, n_in] for mul_mat_q8x: normal values, an outlier, an all-zero block (scale 0) and, where the
    block's max is 127 (scale 1, so x's own values are rounded), the rounding's hard cases: ties both
    ways, 0.49999997 (floor(v + 0.5) in f32 would round it up), -0.5."""
    x = normal(rng, (n, n_in))
    x[0, -1] = 40.0
    if n_in >= 64:
        x[-1, 32:64] = 0.0
    x[0, :7] = [127.0, 2.5, -2.5, 0.5, -0.5, 0.49999997, -126.5]
    return x


@covers("mul_mat_q8x")
@pytest.mark.parametrize("dtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("n,n_out,n_in", [(1, 1, 32), (1, 7, 64), (1, 511, 1024), (3, 1025, 96), (1, 33, 4096)])
def test_mul_mat_q8x_rounds_x_to_8_bit_blocks(dtype, n, n_out, n_in, rng):
    """x's codes are gguf's own q8_0 codes of x (its scale kept in f32), the weight gguf's dequantized blocks;
    the product in float64. Tolerance: an f32 sum of n_in / 32 block terms, each rounded twice (the scales'
    product, then the fma), in any order: (n_in / 32 + 2) * 2^-24 * the sum of |terms|."""
    raw = random_quantized(rng, dtype, (n_out, n_in))
    wf = gguf.quants.dequantize(raw, qtype(dtype)).reshape(n_out, n_in).astype(np.float64)
    x = q8x_activations(n, n_in, rng)
    blocks = gguf.quants.quantize(x, qtype("q8_0")).reshape(n, n_in // 32, 34)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float64)  # [n, n_in / 32, 32]
    d = (np.abs(x).reshape(n, -1, 32).max(axis=-1) / np.float32(127)).astype(np.float64)  # [n, n_in / 32]
    assert q[0, 0, :7].tolist() == [127, 3, -3, 1, -1, 0, -127] and (n_in < 64 or not q[-1, 1].any())
    terms = np.einsum("obi,nbi->nob", wf.reshape(n_out, -1, 32), q) * d[:, None, :]  # [n, n_out, n_in / 32]
    out = run1(g.mul_mat_q8x(g.param("w", (n_out, n_in), dtype), g.input("x", x.shape)), {"x": x},
               weights=weights_of(w=(dtype, raw, (n_out, n_in))))
    assert out.shape == (n, n_out) and out.dtype == np.float32
    bound = (n_in // 32 + 2) * 2.0 ** -24 * np.abs(terms).sum(axis=-1) + 1e-30
    err = np.abs(out - terms.sum(axis=-1))
    assert (err <= bound).all(), f"max error {err.max():.3g}, {(err > bound).sum()} outputs past the bound"
    assert np.abs(out - x.astype(np.float64) @ wf.T).max() > 1e-4  # x's rounding shows


def test_mul_mat_q8x_needs_a_block_quantized_weight():
    with pytest.raises(GraphError, match="dtype f32; mul_mat_q8x takes the integer codes of q4_0, q4_1, q8_0"):
        g.mul_mat_q8x(g.param("w", (7, 32)), g.input("x", (1, 32)))
    with pytest.raises(GraphError, match="must be a 2-D weight"):
        g.mul_mat_q8x(g.param("w", (2, 7, 32), "q8_0"), g.input("x", (1, 32)))

def x_codes16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q float64 [n, n_in / 32, 32], d float64 [n, n_in / 32]) of 16-bit block codes, written apart from
    int_blocks: d = fl32(max |x| / 32767), v = fl32(x * fl32(1 / d)), then half away from zero as trunc(v +- 0.5)
    in float64 (exact for |v| <= 32767.5, so 0.49999997 stays 0)."""
    xb = x.reshape(x.shape[0], -1, 32)
    d = np.abs(xb).max(axis=-1) / np.float32(32767)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)  # no d here is below 2^-126
    v = (xb * inv[..., None]).astype(np.float64)
    return np.trunc(v + np.copysign(0.5, v)), d.astype(np.float64)


@covers("mul_mat_q16x")
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("n,n_out,n_in", [(1, 1, 32), (2, 7, 96), (1, 511, 160), (3, 33, 1536)])
def test_mul_mat_q16x_rounds_x_to_16_bit_blocks(dtype, n, n_out, n_in, rng, backend):
    """x's codes from x_codes16, the weight gguf's dequantized blocks (exact in f32 for random_quantized), the
    product in float64; the tolerance is test_mul_mat_q8x's (n_in / 32 + 2) * 2^-24 * the sum of |terms|. The gpu
    has no kernel: lowering says so, naming the node."""
    raw = random_quantized(rng, dtype, (n_out, n_in))
    if backend == "gpu":
        with pytest.raises(BackendError, match=r"mul_mat_q16x 'proj'.*no gpu kernel"):
            run1(g.mul_mat_q16x(g.param("w", (n_out, n_in), dtype), g.input("x", (n, n_in)), name="proj"),
                 {"x": normal(rng, (n, n_in))}, weights=weights_of(w=(dtype, raw, (n_out, n_in))))
        return
    wf = gguf.quants.dequantize(raw, qtype(dtype)).reshape(n_out, n_in).astype(np.float64)
    x = q8x_activations(n, n_in, rng)
    x[-1, :7] = [32767.0, 2.5, -2.5, 0.5, -0.5, 0.49999997, -32766.5]  # scale 1: 16-bit rounding's hard cases
    q, d = x_codes16(x)
    assert q[-1, 0, :7].tolist() == [32767, 3, -3, 1, -1, 0, -32767] and (n_in < 64 or not q[-1, 1].any())
    terms = np.einsum("obi,nbi->nob", wf.reshape(n_out, -1, 32), q) * d[:, None, :]  # [n, n_out, n_in / 32]
    out = run1(g.mul_mat_q16x(g.param("w", (n_out, n_in), dtype), g.input("x", x.shape)), {"x": x},
               weights=weights_of(w=(dtype, raw, (n_out, n_in))))
    assert out.shape == (n, n_out) and out.dtype == np.float32
    bound = (n_in // 32 + 2) * 2.0 ** -24 * np.abs(terms).sum(axis=-1) + 1e-30
    err = np.abs(out - terms.sum(axis=-1))
    assert (err <= bound).all(), f"max error {err.max():.3g}, {(err > bound).sum()} outputs past the bound"
    exact = x.astype(np.float64) @ wf.T
    assert 0 < np.abs(out[:1] - exact[:1]).max() < 1e-3 * np.abs(exact[:1]).max()  # x's rounding shows, 16 bits' worth


def test_mul_mat_q16x_takes_q4_0_q4_1_q8_0_weights_only():
    with pytest.raises(GraphError, match="dtype q5_0; mul_mat_q16x takes the integer codes of q4_0, q4_1, q8_0"):
        g.mul_mat_q16x(g.param("w", (7, 32), "q5_0"), g.input("x", (1, 32)))
    with pytest.raises(GraphError, match="must be a 2-D weight"):
        g.mul_mat_q16x(g.param("w", (2, 7, 32), "q4_1"), g.input("x", (1, 32)))


# ---------------------------------------------------------------- get_rows
@covers("get_rows")
@pytest.mark.parametrize("dtype,rows,dim", [("f32", 1025, 7), ("f16", 511, 64), ("q8_0", 513, 64), ("q4_1", 37, 96),
                                            ("bf16", 9, 1)])
@pytest.mark.parametrize("ids", [[0], "last", [3, 0, 3, 3, 1, 8, 2]])
def test_get_rows(dtype, rows, dim, ids, rng):
    ids = np.array([rows - 1] if ids == "last" else ids, np.int32)
    if dtype in ("q8_0", "q4_1"):
        shape = (rows, dim)
        raw = quantize(normal(rng, shape), dtype) if dtype == "q8_0" else random_quantized(rng, dtype, shape)
        table = gguf.quants.dequantize(raw, qtype(dtype)).reshape(rows, dim)
    elif dtype == "bf16":
        raw = rng.integers(0, 2**16, size=(rows, dim)).astype(np.uint16) & np.uint16(0xBFFF)  # finite values
        table = _bf16_to_f32(raw)
    else:
        raw = normal(rng, (rows, dim), dtype=np.float16 if dtype == "f16" else np.float32)
        table = raw.astype(np.float32)
    out = run1(g.get_rows(g.param("emb", (rows, dim), dtype), g.input("ids", ids.shape, "i32")), {"ids": ids},
               weights=weights_of(emb=(dtype, raw, (rows, dim))))
    want = np.stack([table[i] for i in ids.tolist()])
    close(out, want, rtol=0, atol=0, dtype="float32")


@covers("get_rows")
@pytest.mark.parametrize("bad", [-1, 9])
def test_get_rows_out_of_range_is_an_error(bad, rng):
    table = normal(rng, (9, 4))
    ids = np.array([0, bad], np.int32)
    node = g.get_rows(g.input("t", (9, 4)), g.input("ids", (2,), "i32"))
    with pytest.raises(BackendError, match=rf"get_rows.*id {bad} out of range 0\.\.8"):
        run1(node, {"t": table, "ids": ids})


# ---------------------------------------------------------------- rope
def _rope_complex(x: np.ndarray, pos: np.ndarray, n_dims: int, mode: str, theta: float, freq_scale: float):
    """Rotate each pair (a, b) as the complex number a + ib by e^{i * pos * freq_scale * theta^(-2i/n_dims)}."""
    x64 = x.astype(np.float64)
    y = x64.copy()
    half = n_dims // 2
    for i in range(half):
        angle = pos.astype(np.float64) * freq_scale * theta ** (-2.0 * i / n_dims)  # [n]
        rot = np.exp(1j * angle)[:, None]  # [n, 1] over heads
        lo, hi = (2 * i, 2 * i + 1) if mode == "norm" else (i, i + half)
        z = (x64[:, :, lo] + 1j * x64[:, :, hi]) * rot
        y[:, :, lo], y[:, :, hi] = z.real, z.imag
    return y


@covers("rope")
@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("n_dims", [64, 32, 2])
@pytest.mark.parametrize("theta,freq_scale", [(1e4, 1.0), (1e6, 1.0), (1e4, 0.25)])
def test_rope(mode, n_dims, theta, freq_scale, rng):
    n, heads, hd = 7, 3, 64
    pos = np.sort(rng.choice(np.arange(1, 8191), n - 2, replace=False))
    pos = np.concatenate([[0], pos, [8191]]).astype(np.int32)
    rng.shuffle(pos)  # positions need not be sorted or contiguous
    x = normal(rng, (n, heads, hd))
    out = run1(g.rope(g.input("x", x.shape), g.input("pos", (n,), "i32"), n_dims=n_dims, mode=mode, theta=theta,
                      freq_scale=freq_scale), {"x": x, "pos": pos})
    want = _rope_complex(x, pos, n_dims, mode, theta, freq_scale)
    close(out, want, rtol=1e-5, atol=1e-5, dtype="float32")
    np.testing.assert_array_equal(out[..., n_dims:], x[..., n_dims:])  # dims past n_dims pass through


@covers("rope")
@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_rope_single_token_default_params(mode, rng):
    x = normal(rng, (1, 1, 8))
    pos = np.array([8191], np.int32)
    out = run1(g.rope(g.input("x", x.shape), g.input("pos", (1,), "i32"), n_dims=8, mode=mode), {"x": x, "pos": pos})
    close(out, _rope_complex(x, pos, 8, mode, 10000.0, 1.0), rtol=1e-5, atol=1e-5)
    # a rotation keeps each pair's length
    close(np.linalg.norm(out), np.linalg.norm(x), rtol=1e-5)


# ---------------------------------------------------------------- softmax
def _softmax_rows(x: np.ndarray, scale: float, mask: np.ndarray | None) -> np.ndarray:
    z = x.astype(np.float64) * scale
    if mask is not None:
        z = z + np.broadcast_to(mask.astype(np.float64), x.shape)
    out = np.empty_like(z)
    for idx in np.ndindex(*z.shape[:-1]):
        r = z[idx]
        e = np.exp(r - r.max())
        out[idx] = e / e.sum()
    return out


@covers("softmax")
@pytest.mark.parametrize("shape", [(7, 1), (3, 7, 511), (2, 1025)])
@pytest.mark.parametrize("scale", [None, 0.125, 3.0])
@pytest.mark.parametrize("mask_kind", [None, "full", "row", "causal"])
def test_softmax(shape, scale, mask_kind, rng):
    x = normal(rng, shape, 2.0)
    kw = {} if scale is None else {"scale": scale}
    mask = None
    if mask_kind == "full":
        mask = normal(rng, shape)
    elif mask_kind == "row":
        mask = normal(rng, (1, shape[-1]))
    elif mask_kind == "causal":  # -inf above the diagonal; each row keeps at least column 0
        rows, cols = shape[-2], shape[-1]
        mask = np.where(np.arange(cols)[None, :] <= np.arange(rows)[:, None], 0.0, -np.inf).astype(np.float32)
    xin = g.input("x", shape)
    node = g.softmax(xin, **kw) if mask is None else g.softmax(xin, g.input("m", mask.shape), **kw)
    feeds = {"x": x} if mask is None else {"x": x, "m": mask}
    out = run1(node, feeds)
    close(out, _softmax_rows(x, 1.0 if scale is None else scale, mask), rtol=1e-5, atol=1e-6, dtype="float32")


# ---------------------------------------------------------------- flash_attn
def _visible_keys(q, k, pos, kv_len, window):
    """(i, h, kh, keys) for each query row i and head h that sees a key: its kv head kh (GQA) and the key
    rows j < kv_len it sees, j <= pos[i] and, with a window, pos[i] - j < window."""
    n_q, hq, _ = q.shape
    hk = k.shape[1]
    for i in range(n_q):
        for h in range(hq):
            keys = [j for j in range(kv_len) if j <= pos[i] and (window == 0 or pos[i] - j < window)]
            if keys:
                yield i, h, h // (hq // hk), keys


def _attention_loops(q, k, v, pos, kv_len, scale, window):
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for i, h, kh, keys in _visible_keys(q, k, pos, kv_len, window):
        s = np.array([float(np.dot(q[i, h].astype(np.float64), k[j, kh].astype(np.float64))) * scale
                      for j in keys])
        p = np.exp(s - s.max())
        p /= p.sum()
        out[i, h] = sum(pj * v[j, kh].astype(np.float64) for pj, j in zip(p, keys, strict=True))
    return out


@covers("flash_attn")
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
def test_flash_attn(group, window, kvdtype, rng):
    cap, kv_len, hk, d, dv = 37, 20, 2, 16, 8
    pos = np.array([0, 5, 13, 19, 1, 19], np.int32)  # a query at 0, non-contiguous, repeated
    npdt = np.float32 if kvdtype == "f32" else np.float16
    q = normal(rng, (len(pos), hk * group, d))
    k, v = normal(rng, (cap, hk, d), dtype=npdt), normal(rng, (cap, hk, dv), dtype=npdt)
    scale = 1 / math.sqrt(d)
    node = g.flash_attn(g.input("q", q.shape), g.input("k", k.shape, kvdtype), g.input("v", v.shape, kvdtype),
                        g.input("pos", pos.shape, "i32"), g.input("len", (1,), "i32"), scale=scale, window=window)
    feeds = {"q": q, "k": k, "v": v, "pos": pos, "len": np.array([kv_len], np.int32)}
    out = run1(node, feeds)
    close(out, _attention_loops(q, k, v, pos, kv_len, scale, window), rtol=1e-5, atol=1e-5, dtype="float32")
    # rows at and past kv_len do not matter
    k2, v2 = k.copy(), v.copy()
    k2[kv_len:], v2[kv_len:] = 1e3, -1e3
    np.testing.assert_allclose(run1(node, {**feeds, "k": k2, "v": v2}), out, rtol=1e-6)


@covers("flash_attn")
@pytest.mark.parametrize("kv_len", [20, 0, 36])
@pytest.mark.parametrize("group", [1, 4])
def test_flash_attn_queries_at_and_past_kv_len(kv_len, group, rng):
    """No window: only kv_len bounds what a query at or past kv_len sees (the causal mask allows the rows
    after it), so the rows from kv_len on hold huge values that would dominate any sum reading them."""
    cap, hk, d, dv = 37, 2, 16, 8
    pos = np.minimum([kv_len, kv_len + 5, cap - 1, max(kv_len - 1, 0)], cap - 1).astype(np.int32)
    q = normal(rng, (len(pos), hk * group, d))
    k, v = normal(rng, (cap, hk, d)), normal(rng, (cap, hk, dv))
    k[kv_len:], v[kv_len:] = 50.0, -1e4
    node = g.flash_attn(g.input("q", q.shape), g.input("k", k.shape), g.input("v", v.shape),
                        g.input("pos", pos.shape, "i32"), g.input("len", (1,), "i32"), scale=1 / math.sqrt(d))
    out = run1(node, {"q": q, "k": k, "v": v, "pos": pos, "len": np.array([kv_len], np.int32)})
    want = _attention_loops(q, k, v, pos, kv_len, 1 / math.sqrt(d), 0)
    assert (np.abs(want) < 10).all()  # every query saw only real rows (or none, which gives 0)
    close(out, want, rtol=1e-5, atol=1e-5, dtype="float32")


@covers("flash_attn")
def test_flash_attn_no_visible_key_gives_zero(rng):
    # query at position 30 with window 5 may see keys 26..30, but only 0..9 are valid: nothing is visible
    q, k, v = normal(rng, (2, 4, 8)), normal(rng, (16, 1, 8)), normal(rng, (16, 1, 8))
    pos = np.array([30, 9], np.int32)
    node = g.flash_attn(g.input("q", q.shape), g.input("k", k.shape), g.input("v", v.shape),
                        g.input("pos", (2,), "i32"), g.input("len", (1,), "i32"), scale=0.7, window=5)
    out = run1(node, {"q": q, "k": k, "v": v, "pos": pos, "len": np.array([10], np.int32)})
    np.testing.assert_array_equal(out[0], 0.0)
    close(out, _attention_loops(q, k, v, pos, 10, 0.7, 5), rtol=1e-5, atol=1e-6)
    out0 = run1(node, {"q": q, "k": k, "v": v, "pos": pos, "len": np.array([0], np.int32)})
    np.testing.assert_array_equal(out0, 0.0)
    with pytest.raises(BackendError, match="kv_len 17 outside 0..16"):
        run1(node, {"q": q, "k": k, "v": v, "pos": pos, "len": np.array([17], np.int32)})


@covers("flash_attn")
def test_flash_attn_long_prefill(rng):
    n, hq, hk, d = 129, 4, 1, 32
    q, k, v = normal(rng, (n, hq, d)), normal(rng, (n, hk, d)), normal(rng, (n, hk, d))
    pos = np.arange(n, dtype=np.int32)
    node = g.flash_attn(g.input("q", q.shape), g.input("k", k.shape), g.input("v", v.shape),
                        g.input("pos", (n,), "i32"), g.input("len", (1,), "i32"), scale=0.2)
    out = run1(node, {"q": q, "k": k, "v": v, "pos": pos, "len": np.array([n], np.int32)})
    # with window 0 and positions 0..n-1 this is masked softmax attention
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), np.repeat(k, hq, 1).astype(np.float64)) * 0.2
    s = s + np.triu(np.full((n, n), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    close(out, np.einsum("hqk,khd->qhd", p, np.repeat(v, hq, 1).astype(np.float64)), rtol=1e-5, atol=1e-5)


def _attention_bf16_loops(q, k, v, pos, kv_len, scale, window):
    """flash_attn_bf16 restated: bf16 q, k, v (frexp rounding), f32 scores in the log2 domain, weights
    2^(s - M) rounded to bf16 with M = ceil(max s), the weighted mean of v over their sum (float64)."""
    qb, kb, vb = (_to_bf16_frexp(a.astype(np.float32)) for a in (q, k, v))
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for i, h, kh, keys in _visible_keys(q, k, pos, kv_len, window):
        s = np.array([np.float32(np.dot(qb[i, h], kb[j, kh])) * np.float32(scale * math.log2(math.e))
                      for j in keys], np.float32)
        w = _to_bf16_frexp(2.0 ** (s.astype(np.float64) - math.ceil(s.max())))
        out[i, h] = sum(wj * vb[j, kh] for wj, j in zip(w, keys, strict=True)) / w.sum()
    return out


@covers("flash_attn_bf16")
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("kvdtype", ["f32", "f16"])
def test_flash_attn_bf16_rounds_q_k_v_and_weights(group, window, kvdtype, rng):
    cap, kv_len, hk, d, dv = 37, 20, 2, 16, 8
    pos = np.array([0, 5, 13, 19, 1, 19, 30], np.int32)  # a query at 0, repeated, one past kv_len
    npdt = np.float32 if kvdtype == "f32" else np.float16
    q = normal(rng, (len(pos), hk * group, d), 2.0)
    k, v = normal(rng, (cap, hk, d), dtype=npdt), normal(rng, (cap, hk, dv), dtype=npdt)
    k[kv_len:], v[kv_len:] = 1e3, -1e3  # never read
    scale = 1 / math.sqrt(d)
    args = (g.input("q", q.shape), g.input("k", k.shape, kvdtype), g.input("v", v.shape, kvdtype),
            g.input("pos", pos.shape, "i32"), g.input("len", (1,), "i32"))
    feeds = {"q": q, "k": k, "v": v, "pos": pos, "len": np.array([kv_len], np.int32)}
    out = run1(g.flash_attn_bf16(*args, scale=scale, window=window), feeds)
    want = _attention_bf16_loops(q, k, v, pos, kv_len, scale, window)
    # The gpu's scores differ in the last f32 bits (tensor-core summation order, an approximate exp2),
    # which can move a weight across a bf16 rounding boundary (rarely): one bf16 step of a weight moves
    # a row of few keys by up to ~2^-7 |v_j - out|, under 1e-2 of max |out|. tests/test_gpu_attention_prefill.py
    # bounds the rows such flips leave alone much tighter. Exact elsewhere.
    atol = 1e-2 * np.abs(want).max() if _backend["name"] == "gpu" else 1e-5
    close(out, want, rtol=1e-5, atol=atol, dtype="float32")
    exact = _attention_loops(q, k, v, pos, kv_len, scale, window)
    assert 1e-3 < np.abs(out - exact).max() < 2e-2 * np.abs(exact).max()  # the rounding shows, and stays small
    for name in "qkv":  # fed already rounded, each input gives the same result: the op rounds it itself
        rounded = _to_bf16_frexp(feeds[name].astype(np.float32)).astype(feeds[name].dtype)
        np.testing.assert_array_equal(run1(g.flash_attn_bf16(*args, scale=scale, window=window),
                                           {**feeds, name: rounded}), out)


@covers("flash_attn_bf16")
def test_flash_attn_bf16_no_visible_key_and_bad_kv_len(rng):
    q, k, v = normal(rng, (2, 4, 8)), normal(rng, (16, 1, 8)), normal(rng, (16, 1, 8))
    pos = np.array([30, -1], np.int32)  # window 5 at 30 sees 26..30, past kv_len 10; -1 sees nothing
    node = g.flash_attn_bf16(g.input("q", q.shape), g.input("k", k.shape), g.input("v", v.shape),
                             g.input("pos", (2,), "i32"), g.input("len", (1,), "i32"), scale=0.7, window=5)
    np.testing.assert_array_equal(run1(node, {"q": q, "k": k, "v": v, "pos": pos, "len": np.array([10], np.int32)}),
                                  0.0)
    with pytest.raises(BackendError, match="kv_len 17 outside 0..16"):
        run1(node, {"q": q, "k": k, "v": v, "pos": pos, "len": np.array([17], np.int32)})


# ---------------------------------------------------------------- layout
def _strided(x: np.ndarray, shape, strides, offset) -> np.ndarray:
    flat = [float(v) for v in np.nditer(x, order="C")]  # the row-major element sequence
    out = np.zeros(shape, x.dtype)
    for idx in itertools.product(*(range(n) for n in shape)):
        out[idx] = flat[offset + sum(i * s for i, s in zip(idx, strides, strict=True))]
    return out


@covers("view")
@pytest.mark.parametrize("shape,strides,offset", [((3, 4), (13, 2), 5), ((2, 3, 2), (0, 4, 1), 1), ((1,), (1,), 90),
                                                  ((7, 13), (13, 1), 0), ((13, 7), (1, 13), 0), ((0, 4), (4, 1), 91)])
def test_view(shape, strides, offset, rng):
    x = normal(rng, (7, 13))
    out = run1(g.view(g.input("x", x.shape), shape=shape, strides=strides, offset=offset), {"x": x})
    close(out, _strided(x, shape, strides, offset), rtol=0, atol=0, dtype="float32")


@covers("view", "transpose")
def test_view_of_a_transposed_value_reads_its_logical_order(rng):
    x = normal(rng, (3, 5))
    t = g.transpose(g.input("x", x.shape))  # [5, 3]
    out = run1(g.view(t, shape=(2, 3), strides=(3, 1), offset=6), {"x": x})
    close(out, _strided(x.T.copy(), (2, 3), (3, 1), 6), rtol=0, atol=0)


@covers("view")
def test_rows_and_cols_helpers(rng):
    x = normal(rng, (7, 13))
    xin = g.input("x", x.shape)
    out = run({"r": g.rows(xin, 2, 4), "c": g.cols(xin, 11, 2)}, {"x": x})
    close(out["r"], np.array([x[i] for i in range(2, 6)]), rtol=0, atol=0)
    close(out["c"], np.array([[row[11], row[12]] for row in x]), rtol=0, atol=0)


@covers("reshape")
@pytest.mark.parametrize("src_t", [False, True])
def test_reshape(src_t, rng):
    x = normal(rng, (7, 12))
    xin = g.input("x", x.shape)
    src = g.transpose(xin) if src_t else xin
    logical = x.T if src_t else x
    flat = [logical[idx] for idx in itertools.product(*(range(n) for n in logical.shape))]
    out = run1(g.reshape(src, shape=(3, 4, 7)), {"x": x})
    close(out, np.array(flat).reshape(3, 4, 7), rtol=0, atol=0)


@covers("permute")
@pytest.mark.parametrize("shape,axes", [((2, 3, 4, 5), (3, 0, 2, 1)), ((7, 1, 5), (1, 0, 2)), ((4, 6), (1, 0)),
                                        ((3, 4, 5), (0, 1, 2))])
def test_permute(shape, axes, rng):
    x = normal(rng, shape)
    out = run1(g.permute(g.input("x", shape), axes=axes), {"x": x})
    assert out.shape == tuple(shape[a] for a in axes)
    for idx in itertools.product(*(range(n) for n in out.shape)):
        src = [0] * len(shape)
        for i, a in enumerate(axes):  # result axis i is source axis axes[i]
            src[a] = idx[i]
        assert out[idx] == x[tuple(src)]


@covers("transpose", "cont")
@pytest.mark.parametrize("shape", [(1, 7), (3, 7, 5)])
def test_transpose_and_cont(shape, rng):
    x = normal(rng, shape)
    t = g.transpose(g.input("x", shape))
    out = run({"t": t, "c": g.cont(t)}, {"x": x})
    want = np.zeros(shape[:-2] + (shape[-1], shape[-2]), np.float32)
    for idx in itertools.product(*(range(n) for n in shape)):
        want[idx[:-2] + (idx[-1], idx[-2])] = x[idx]
    close(out["t"], want, rtol=0, atol=0)
    close(out["c"], want, rtol=0, atol=0)
    assert out["c"].flags.c_contiguous


@covers("concat")
@pytest.mark.parametrize("sa,sb,axis", [((7, 5), (1, 5), 0), ((7, 5), (7, 511), -1), ((2, 3, 4), (2, 1, 4), 1),
                                        ((2, 3, 4), (2, 3, 1), 2), ((2, 3, 4), (5, 3, 4), -3)])
@pytest.mark.parametrize("dtype", ["f32", "i32"])
def test_concat(sa, sb, axis, dtype, rng):
    if dtype == "f32":
        a, b = normal(rng, sa), normal(rng, sb)
    else:
        a, b = rng.integers(-9, 9, sa).astype(np.int32), rng.integers(-9, 9, sb).astype(np.int32)
    out = run1(g.concat(g.input("a", sa, dtype), g.input("b", sb, dtype), axis=axis), {"a": a, "b": b})
    ax = axis % len(sa)
    want = np.zeros(tuple(x + y if i == ax else x for i, (x, y) in enumerate(zip(sa, sb, strict=True))), a.dtype)
    want[(slice(None),) * ax + (slice(0, sa[ax]),)] = a
    want[(slice(None),) * ax + (slice(sa[ax], None),)] = b
    assert out.dtype == a.dtype
    np.testing.assert_array_equal(out, want)


@covers("cast")
@pytest.mark.parametrize("src,dst", [("f32", "f16"), ("f32", "i32"), ("f16", "f32"), ("i32", "f32"), ("f32", "f32"),
                                     ("f16", "i32")])
def test_cast(src, dst, rng):
    if src == "i32":
        x = rng.integers(-1000, 1000, (7, 5)).astype(np.int32)
    else:
        x = (rng.standard_normal((7, 5)) * 50).astype(np.float16 if src == "f16" else np.float32)
        x[0, :4] = [-2.7, -0.5, 0.5, 2.7]
    out = run1(g.cast(g.input("x", x.shape, src), dtype=dst), {"x": x})
    if dst == "i32":
        want = np.array([math.trunc(float(v)) for v in x.reshape(-1)]).reshape(x.shape)  # toward zero
        assert out.dtype == np.int32
        np.testing.assert_array_equal(out, want)
    else:
        assert out.dtype == (np.float16 if dst == "f16" else np.float32)
        tol = 1e-3 if dst == "f16" else 0
        close(out, x.astype(np.float64), rtol=tol, atol=0)


# ---------------------------------------------------------------- in-place writes
@covers("set_rows")
@pytest.mark.parametrize("sdtype", ["f32", "f16"])
def test_set_rows_into_state(sdtype, rng):
    cap, d = 37, 16
    npdt = np.float32 if sdtype == "f32" else np.float16
    cache = g.state("kv", (cap, d), sdtype)
    written = g.set_rows(cache, g.input("src", (5, d)), g.input("idx", (5,), "i32"))
    graph_out = {"all": written, "row": g.rows(written, 2, 1)}
    init = normal(rng, (cap, d), dtype=npdt)
    state = {"kv": init.copy()}
    before = init.copy()
    for idx in ([30, 2, 7, 0, 36], [1, 3, 5, 8, 2]):
        src = normal(rng, (5, d))
        idx = np.array(idx, np.int32)
        out = run(graph_out, {"src": src, "idx": idx}, state=state)
        want = before.copy()
        for i, r in enumerate(idx.tolist()):
            want[r] = src[i].astype(npdt)
        np.testing.assert_array_equal(state["kv"], want)  # written rows updated, the rest untouched
        np.testing.assert_array_equal(out["all"], want)
        np.testing.assert_array_equal(out["row"], want[2:3])
        before = want


@covers("set_rows")
def test_set_rows_chained_writes_and_update_only(rng):
    cache = g.state("kv", (8, 3))
    w1 = g.set_rows(cache, g.input("a", (2, 3)), g.input("ia", (2,), "i32"))
    w2 = g.set_rows(w1, g.input("b", (1, 3)), g.input("ib", (1,), "i32"))
    a, b = normal(rng, (2, 3)), normal(rng, (1, 3))
    state = {"kv": np.zeros((8, 3), np.float32)}
    out = run({}, {"a": a, "ia": np.array([4, 6], np.int32), "b": b, "ib": np.array([6], np.int32)}, state=state,
              updates=(w2,))
    assert out == {}
    want = np.zeros((8, 3), np.float32)
    want[4], want[6] = a[0], b[0]  # the later write wins on row 6
    np.testing.assert_array_equal(state["kv"], want)
    with pytest.raises(BackendError, match="row index out of range"):
        run({}, {"a": a, "ia": np.array([4, 8], np.int32), "b": b, "ib": np.array([0], np.int32)}, state=state,
            updates=(w2,))


@covers("assign")
def test_assign_accumulates_across_calls(rng):
    s = g.state("acc", (3, 5))
    new = g.assign(s, g.add(s, g.input("x", (3, 5))))
    state = {"acc": np.zeros((3, 5), np.float32)}
    xs = [normal(rng, (3, 5)) for _ in range(3)]
    for i, x in enumerate(xs):
        out = run({"acc": new}, {"x": x}, state=state)
        want = np.sum(np.stack(xs[: i + 1]).astype(np.float64), axis=0)
        close(state["acc"], want, rtol=1e-6, atol=1e-6)
        close(out["acc"], want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- recurrent ops
def _conv_loops(seq: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y[t, c] = sum_j w[c, j] * seq[t + j, c] for the rows after the first kernel-1 (the initial state)."""
    k = w.shape[1]
    n = seq.shape[0] - (k - 1)
    y = np.zeros((n, seq.shape[1]))
    for t in range(n):
        for c in range(seq.shape[1]):
            y[t, c] = sum(float(w[c, j]) * float(seq[t + j, c]) for j in range(k))
    return y


@covers("ssm_conv", "item")
@pytest.mark.parametrize("channels,kernel", [(7, 4), (511, 4), (1, 2)])
def test_ssm_conv_carries_state(channels, kernel, rng):
    w = normal(rng, (channels, kernel))
    init = normal(rng, (kernel - 1, channels))
    state = {"conv": init.copy()}

    def step(n: int, x: np.ndarray) -> np.ndarray:
        s = g.state("conv", (kernel - 1, channels))
        res = g.ssm_conv(g.input("x", (n, channels)), s, g.param("w", w.shape))
        y = g.item(res, index=0)
        upd = g.assign(s, g.item(res, index=1))
        return run({"y": y}, {"x": x}, state=state, updates=(upd,),
                   weights=weights_of(w=("f32", w, w.shape)))["y"]

    x1, x2 = normal(rng, (7, channels)), normal(rng, (1, channels))
    y1, y2 = step(7, x1), step(1, x2)
    seq = np.concatenate([init, x1, x2]).astype(np.float64)
    want = _conv_loops(seq, w)
    close(y1, want[:7], rtol=1e-5, atol=1e-5, dtype="float32")
    close(y2, want[7:], rtol=1e-5, atol=1e-5)
    close(state["conv"], seq[-(kernel - 1):], rtol=0, atol=0)  # the last kernel-1 inputs


def _gdn_loops(q, k, v, gate, beta, s0, scale):
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    s = s0.astype(np.float64).copy()
    out = np.zeros((n, hv, dv))
    for t in range(n):
        for h in range(hv):
            kh = h // (hv // hk)  # v head h reads k head h // (hv/hk)
            kt, qt = k[t, kh].astype(np.float64), q[t, kh].astype(np.float64) * scale
            st = s[h] * math.exp(gate[t, h])  # [dk, dv]
            predicted = np.array([sum(kt[a] * st[a, b] for a in range(dk)) for b in range(dv)])
            delta = beta[t, h] * (v[t, h] - predicted)
            st = st + np.outer(kt, delta)
            out[t, h] = [sum(qt[a] * st[a, b] for a in range(dk)) for b in range(dv)]
            s[h] = st
    return out, s


@covers("gated_delta_net", "item")
@pytest.mark.parametrize("hk,ratio", [(2, 2), (1, 1)])
def test_gated_delta_net_carries_state(hk, ratio, rng):
    hv, dk, dv = hk * ratio, 8, 6
    scale = 1 / math.sqrt(dk)
    s0 = normal(rng, (hv, dk, dv), 0.3)
    state = {"S": s0.copy()}

    def step(n):
        q, k, v = normal(rng, (n, hk, dk), 0.5), normal(rng, (n, hk, dk), 0.5), normal(rng, (n, hv, dv))
        gate = -np.log1p(np.exp(normal(rng, (n, hv))))  # log of a decay in (0, 1)
        beta = 1 / (1 + np.exp(-normal(rng, (n, hv))))
        gate, beta = gate.astype(np.float32), beta.astype(np.float32)
        s = g.state("S", (hv, dk, dv))
        res = g.gated_delta_net(g.input("q", q.shape), g.input("k", k.shape), g.input("v", v.shape),
                                g.input("g", gate.shape), g.input("beta", beta.shape), s, scale=scale)
        upd = g.assign(s, g.item(res, index=1))
        before = state["S"].copy()
        o = run({"o": g.item(res, index=0)}, {"q": q, "k": k, "v": v, "g": gate, "beta": beta}, state=state,
                updates=(upd,))["o"]
        want_o, want_s = _gdn_loops(q, k, v, gate, beta, before, scale)
        close(o, want_o, rtol=1e-4, atol=1e-5, dtype="float32")
        close(state["S"], want_s, rtol=1e-4, atol=1e-5)

    step(5)
    step(1)


# ---------------------------------------------------------------- f16 activations keep their dtype
F16_CASES: dict[str, tuple[dict, Callable]] = {
    **{name: ({}, fn) for name, fn in UNARY.items()},
    **{name: ({"eps": 1e-5}, lambda x, fn=fn: fn(x, 1e-5)) for name, fn in NORMS.items()},
    "scale": ({"s": 0.5, "b": 1.0}, lambda x: x * 0.5 + 1.0),
    "softmax": ({"scale": 0.5}, lambda x: _softmax_rows(x, 0.5, None)),
    "sum_rows": ({}, lambda x: x.sum(-1, keepdims=True)),
    "mean": ({}, lambda x: x.mean(-1, keepdims=True)),
}


@covers(*F16_CASES)
@pytest.mark.parametrize("opname", list(F16_CASES))
def test_f16_activations(opname, rng):
    x = normal(rng, (7, 33), dtype=np.float16)
    params, fn = F16_CASES[opname]
    out = run1(getattr(g, opname)(g.input("x", x.shape, "f16"), **params), {"x": x})
    close(out, fn(x.astype(np.float64)), rtol=5e-3, atol=5e-3, dtype="float16")


@covers("rope", "swiglu_split", "get_rows")
def test_f16_rope_swiglu_get_rows(rng):
    x = normal(rng, (3, 2, 8), dtype=np.float16)
    pos = np.array([0, 7, 4000], np.int32)
    out = run1(g.rope(g.input("x", x.shape, "f16"), g.input("p", (3,), "i32"), n_dims=8, mode="neox"),
               {"x": x, "p": pos})
    close(out, _rope_complex(x, pos, 8, "neox", 1e4, 1.0), rtol=5e-3, atol=5e-3, dtype="float16")
    a, b = normal(rng, (3, 5), dtype=np.float16), normal(rng, (3, 5), dtype=np.float16)
    out = run1(g.swiglu_split(g.input("a", a.shape, "f16"), g.input("b", b.shape, "f16")), {"a": a, "b": b})
    close(out, UNARY["silu"](a.astype(np.float64)) * b, rtol=5e-3, atol=5e-3, dtype="float16")
    t = normal(rng, (4, 3), dtype=np.float16)
    ids = np.array([3, 0], np.int32)
    out = run1(g.get_rows(g.input("t", t.shape, "f16"), g.input("i", (2,), "i32")), {"t": t, "i": ids})
    close(out, t[[3, 0]], rtol=0, atol=0, dtype="float32")


# ---------------------------------------------------------------- fused ops (graphir/ops/fused.py)
@covers("add_rms_norm_mul", "item")
# gpu: 1020 / 1028 / 4096 / 8192 columns take the register kernels of 1, 2, 4 and 8 float4 a thread (a partial
# last group in the first two), 8196 and the odd sizes the generic kernel
@pytest.mark.parametrize("shape", [(1, 1), (7, 511), (3, 1025), (2, 1020), (1, 1028), (5, 4096), (1, 8192), (2, 8196)])
def test_add_rms_norm_mul(shape, rng):
    a, b, w = normal(rng, shape), normal(rng, shape), normal(rng, shape[-1:])
    res = g.add_rms_norm_mul(g.input("a", shape), g.input("b", shape), g.param("w", w.shape), eps=1e-6)
    out = run({"y": g.item(res, index=0), "s": g.item(res, index=1)}, {"a": a, "b": b},
              weights=weights_of(w=("f32", w, w.shape)))
    s = a.astype(np.float64) + b
    close(out["s"], s, rtol=1e-6, atol=1e-6, dtype="float32")
    close(out["y"], _rms_norm(s, 1e-6) * w, rtol=1e-5, atol=1e-5, dtype="float32")


@covers("rms_norm_mul_rope")
@pytest.mark.parametrize("mode,hd,n_dims", [("norm", 64, 64), ("neox", 64, 64), ("neox", 64, 32), ("norm", 30, 30),
                                            ("neox", 100, 64), ("neox", 256, 256)])
def test_rms_norm_mul_rope(mode, hd, n_dims, rng):
    n, heads = 7, 3
    x, w = normal(rng, (n, heads, hd)), normal(rng, (hd,))
    pos = np.array([0, 3, 9, 100, 8191, 2, 4095], np.int32)
    node = g.rms_norm_mul_rope(g.input("x", x.shape), g.param("w", w.shape), g.input("pos", (n,), "i32"), eps=1e-6,
                               n_dims=n_dims, mode=mode, theta=1e6)
    out = run1(node, {"x": x, "pos": pos}, weights=weights_of(w=("f32", w, w.shape)))
    want = _rope_complex(_rms_norm(x, 1e-6) * w, pos, n_dims, mode, 1e6, 1.0)
    close(out, want, rtol=1e-5, atol=1e-5, dtype="float32")


@covers("rms_norm_mul_rope", "rms_norm_mul_rope_set_rows")
@pytest.mark.parametrize("n", [1, 5])
def test_rms_norm_mul_rope_reads_q_and_k_heads_of_stacked_rows(n, rng):
    """q and k as a model's verify call gives them: heads cut from stacked q|k|v rows [n, 3 * heads * hd], a token
    stride no [rows, hd] view spans (the cpu packs them for its kernel; one row is such a view)."""
    cap, heads, hd = 11, 2, 32
    y, w = normal(rng, (n, 3 * heads * hd)), normal(rng, (hd,))
    pos, idx = rng.integers(0, 5000, n).astype(np.int32), rng.permutation(cap)[:n].astype(np.int32)
    stacked, positions = g.input("y", y.shape), g.input("pos", (n,), "i32")
    q, k = (g.view(stacked, shape=(n, heads, hd), strides=(3 * heads * hd, hd, 1), offset=o)
            for o in (0, heads * hd))
    rope = {"eps": 1e-6, "n_dims": hd, "mode": "neox", "theta": 1e6}
    write = g.rms_norm_mul_rope_set_rows(g.state("k", (cap, heads, hd)), k, g.param("w", w.shape), positions,
                                         g.input("idx", (n,), "i32"), **rope)
    init = normal(rng, (cap, heads, hd))
    state = {"k": init.copy()}
    out = run({"q": g.rms_norm_mul_rope(q, g.param("w", w.shape), positions, **rope)},
              {"y": y, "pos": pos, "idx": idx}, state=state, updates=(write,),
              weights=weights_of(w=("f32", w, w.shape)))
    x = y.reshape(n, 3, heads, hd)
    close(out["q"], _rope_complex(_rms_norm(x[:, 0], 1e-6) * w, pos, hd, "neox", 1e6, 1.0), dtype="float32")
    want = init.astype(np.float64)
    want[idx] = _rope_complex(_rms_norm(x[:, 1], 1e-6) * w, pos, hd, "neox", 1e6, 1.0)
    close(state["k"], want)


@covers("add_rms_norm_mul", "item")
# gpu: 4 and 4096 columns take the register kernels (1 and 4 float4 a thread), 511 the generic one
@pytest.mark.parametrize("shape", [(1, 4), (7, 511), (3, 4096)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_add_rms_norm_mul_where_eps_matters(shape, eps, rng):
    a, b = small_for_eps(rng, shape, eps / 2), small_for_eps(rng, shape, eps / 2)  # mean square of a + b ~ eps
    w = normal(rng, shape[-1:])
    res = g.add_rms_norm_mul(g.input("a", shape), g.input("b", shape), g.param("w", w.shape), eps=eps)
    out = run({"y": g.item(res, index=0), "s": g.item(res, index=1)}, {"a": a, "b": b},
              weights=weights_of(w=("f32", w, w.shape)))
    s = a.astype(np.float64) + b
    want = _rms_norm(s, eps) * w
    assert eps_moves(want, _rms_norm(s, 0.0) * w)
    close(out["s"], s, rtol=1e-6, atol=1e-9, dtype="float32")
    close(out["y"], want, rtol=1e-5, atol=1e-5, dtype="float32")


@covers("rms_norm_mul_rope")
@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_mul_rope_where_eps_matters(mode, eps, rng):
    n, heads, hd = 5, 3, 64
    x, w = small_for_eps(rng, (n, heads, hd), eps), normal(rng, (hd,))
    pos = np.array([0, 3, 100, 8191, 2], np.int32)
    node = g.rms_norm_mul_rope(g.input("x", x.shape), g.param("w", w.shape), g.input("pos", (n,), "i32"), eps=eps,
                               n_dims=hd, mode=mode, theta=1e6)
    out = run1(node, {"x": x, "pos": pos}, weights=weights_of(w=("f32", w, w.shape)))
    want = _rope_complex(_rms_norm(x, eps) * w, pos, hd, mode, 1e6, 1.0)
    assert eps_moves(want, _rope_complex(_rms_norm(x, 0.0) * w, pos, hd, mode, 1e6, 1.0))
    close(out, want, rtol=1e-5, atol=1e-5, dtype="float32")


@covers("rope_set_rows")
@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("row_shape", [(2, 16), (32,)])
def test_rope_set_rows(mode, row_shape, rng):
    cap, n, heads, hd = 37, 3, 2, 16
    x = normal(rng, (n, heads, hd))
    pos, idx = np.array([8191, 0, 17], np.int32), np.array([36, 0, 5], np.int32)
    cache = g.state("k", (cap,) + row_shape)
    w = g.rope_set_rows(cache, g.input("x", x.shape), g.input("pos", (n,), "i32"), g.input("idx", (n,), "i32"),
                        n_dims=hd, mode=mode, theta=1e4)
    init = normal(rng, (cap,) + row_shape)
    state = {"k": init.copy()}
    run({}, {"x": x, "pos": pos, "idx": idx}, state=state, updates=(w,))
    roped = _rope_complex(x, pos, hd, mode, 1e4, 1.0)
    want = init.astype(np.float64)
    for i, r in enumerate(idx.tolist()):
        want[r] = roped[i].reshape(row_shape)
    close(state["k"], want, rtol=1e-5, atol=1e-5)


@covers("rms_norm_mul_rope_set_rows")
@pytest.mark.parametrize("mode,hd,n_dims", [("neox", 64, 64), ("norm", 30, 30), ("neox", 100, 64), ("neox", 256, 256)])
@pytest.mark.parametrize("row_shape", ["heads", "flat"])
def test_rms_norm_mul_rope_set_rows(mode, hd, n_dims, row_shape, rng):
    cap, n, heads, eps = 37, 3, 2, 1e-6
    shape = (heads, hd) if row_shape == "heads" else (heads * hd,)
    x, w = small_for_eps(rng, (n, heads, hd), eps), normal(rng, (hd,))
    pos, idx = np.array([8191, 0, 17], np.int32), np.array([36, 0, 5], np.int32)
    cache = g.state("k", (cap,) + shape)
    write = g.rms_norm_mul_rope_set_rows(cache, g.input("x", x.shape), g.param("w", w.shape),
                                         g.input("pos", (n,), "i32"), g.input("idx", (n,), "i32"), eps=eps,
                                         n_dims=n_dims, mode=mode, theta=1e6)
    init = normal(rng, (cap,) + shape)
    state = {"k": init.copy()}
    run({}, {"x": x, "pos": pos, "idx": idx}, state=state, updates=(write,), weights=weights_of(w=("f32", w, w.shape)))
    roped = _rope_complex(_rms_norm(x, eps) * w, pos, n_dims, mode, 1e6, 1.0)
    assert eps_moves(roped, _rope_complex(_rms_norm(x, 0.0) * w, pos, n_dims, mode, 1e6, 1.0))
    want = init.astype(np.float64)
    for i, r in enumerate(idx.tolist()):
        want[r] = roped[i].reshape(shape)
    close(state["k"], want, rtol=1e-5, atol=1e-5)


@covers("ssm_conv_silu")
def test_ssm_conv_silu(rng):
    channels, kernel, n = 9, 4, 6
    w, init, x = normal(rng, (channels, kernel)), normal(rng, (kernel - 1, channels)), normal(rng, (n, channels))
    s = g.state("conv", init.shape)
    res = g.ssm_conv_silu(g.input("x", x.shape), s, g.param("w", w.shape))
    state = {"conv": init.copy()}
    y = run({"y": g.item(res, index=0)}, {"x": x}, state=state, updates=(g.assign(s, g.item(res, index=1)),),
            weights=weights_of(w=("f32", w, w.shape)))["y"]
    seq = np.concatenate([init, x]).astype(np.float64)
    pre = _conv_loops(seq, w)
    close(y, pre / (1 + np.exp(-pre)), rtol=1e-5, atol=1e-5, dtype="float32")
    close(state["conv"], seq[-(kernel - 1):], rtol=0, atol=0)


def _l2(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def _gdn_vectorized(q, k, v, gate, beta, s0, scale):
    """_gdn_loops with numpy products over dk (float64): fast enough for d 128 and 32 heads."""
    n, hk, _ = q.shape
    hv = v.shape[1]
    s = s0.astype(np.float64).copy()
    out = np.zeros((n, hv, v.shape[2]))
    for t in range(n):
        for h in range(hv):
            kt, qt = k[t, h // (hv // hk)].astype(np.float64), q[t, h // (hv // hk)].astype(np.float64) * scale
            st = s[h] * math.exp(gate[t, h])
            st = st + np.outer(kt, beta[t, h] * (v[t, h] - kt @ st))
            out[t, h], s[h] = qt @ st, st
    return out, s


@covers("gated_delta_net_raw", "item", "assign")
@pytest.mark.parametrize("n,hk,hv,dk,dv", [(1, 1, 1, 64, 64), (5, 1, 2, 8, 6), (7, 2, 4, 128, 128),
                                           (3, 16, 32, 128, 128), (20, 1, 3, 7, 5)])
@pytest.mark.parametrize("eps", [1e-6, None])
def test_gated_delta_net_raw_l2(n, hk, hv, dk, dv, eps, rng):
    """l2_eps: q and k l2-normalized inside the op. The state goes back through assign, the pattern a
    gpu Program runs in place (the kernel writes the State it reads), here at decode and prefill sizes."""
    # |k| ~ 1 keeps the rule stable without the norm; with it, rows of norm ~2 sqrt(dk) must be normalized
    qk_scale = 2.0 if eps is not None else dk ** -0.5
    q, k, v = normal(rng, (n, hk, dk), qk_scale), normal(rng, (n, hk, dk), qk_scale), normal(rng, (n, hv, dv))
    alpha, b = normal(rng, (n, hv)), normal(rng, (n, hv))
    a_neg, dt = -np.exp(normal(rng, (hv,))), normal(rng, (hv,))
    s0 = normal(rng, (hv, dk, dv), 0.3)
    s = g.state("S", s0.shape)
    res = g.gated_delta_net_raw(*(g.input(nm, x.shape) for nm, x in zip("qkvab", (q, k, v, alpha, b), strict=True)),
                                g.param("a_neg", (hv,)), g.param("dt", (hv,)), s, scale=dk ** -0.5, l2_eps=eps)
    state = {"S": s0.copy()}
    o = run({"o": g.item(res, index=0)}, {"q": q, "k": k, "v": v, "a": alpha, "b": b}, state=state,
            updates=(g.assign(s, g.item(res, index=1)),),
            weights=weights_of(a_neg=("f32", a_neg, (hv,)), dt=("f32", dt, (hv,))))["o"]
    gate = a_neg * np.log1p(np.exp(alpha.astype(np.float64) + dt))
    beta = 1 / (1 + np.exp(-b.astype(np.float64)))
    qn, kn = (q, k) if eps is None else (_l2(q, eps), _l2(k, eps))
    want_o, want_s = _gdn_vectorized(qn, kn, v, gate, beta, s0, dk ** -0.5)
    # without the norm, |k| ~ 2 sqrt(dk) makes the un-normalized rule a different (unstable) result
    if eps is not None:
        assert np.abs(_gdn_vectorized(q, k, v, gate, beta, s0, dk ** -0.5)[0] - want_o).max() > 0.1
    close(o, want_o, rtol=1e-4, atol=1e-4, dtype="float32")
    close(state["S"], want_s, rtol=1e-4, atol=1e-4)


@covers("gated_delta_net_raw", "item")
@pytest.mark.parametrize("n,hk,hv,dk,dv", [(5, 2, 4, 16, 12), (4, 1, 2, 128, 128), (16, 1, 1, 7, 5)])
def test_gated_delta_net_raw_keeps_every_steps_state(n, hk, hv, dk, dv, rng):
    """steps=True: a third result holds the state after each token (a speculative verify's rollback)."""
    q, k, v = normal(rng, (n, hk, dk)), normal(rng, (n, hk, dk)), normal(rng, (n, hv, dv))
    alpha, b = normal(rng, (n, hv)), normal(rng, (n, hv))
    a_neg, dt = -np.exp(normal(rng, (hv,))), normal(rng, (hv,))
    s0 = normal(rng, (hv, dk, dv), 0.3)
    res = g.gated_delta_net_raw(*(g.input(nm, x.shape) for nm, x in zip("qkvab", (q, k, v, alpha, b), strict=True)),
                                g.param("a_neg", (hv,)), g.param("dt", (hv,)), g.input("S", s0.shape),
                                scale=dk ** -0.5, l2_eps=1e-6, steps=True)
    out = run({"steps": g.item(res, index=2), "last": g.item(res, index=1)},
              {"q": q, "k": k, "v": v, "a": alpha, "b": b, "S": s0},
              weights=weights_of(a_neg=("f32", a_neg, (hv,)), dt=("f32", dt, (hv,))))
    gate = a_neg * np.log1p(np.exp(alpha.astype(np.float64) + dt))
    beta = 1 / (1 + np.exp(-b.astype(np.float64)))
    for t in range(n):  # the state after token t is the final state of the first t + 1 tokens
        want = _gdn_vectorized(_l2(q[:t + 1], 1e-6), _l2(k[:t + 1], 1e-6), v[:t + 1], gate[:t + 1], beta[:t + 1], s0,
                               dk ** -0.5)[1]
        close(out["steps"][t], want, rtol=1e-4, atol=1e-4)
    close(out["last"], out["steps"][-1], rtol=0, atol=0)


@covers("rms_norm_mul_gate")
@pytest.mark.parametrize("shape", [(1, 1, 7), (5, 4, 128), (3, 2, 511), (2, 1025)])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm_mul_gate(shape, eps, rng):
    x, w, z = small_for_eps(rng, shape, eps), normal(rng, shape[-1:]), normal(rng, shape, 3.0)
    node = g.rms_norm_mul_gate(g.input("x", shape), g.param("w", w.shape), g.input("z", shape), eps=eps)
    out = run1(node, {"x": x, "z": z}, weights=weights_of(w=("f32", w, w.shape)))
    z64 = z.astype(np.float64)
    want = _rms_norm(x, eps) * w * (z64 / (1 + np.exp(-z64)))
    assert eps_moves(want, _rms_norm(x, 0.0) * w * (z64 / (1 + np.exp(-z64))))
    close(out, want, rtol=1e-5, atol=1e-5, dtype="float32")


@covers("gated_delta_net_raw")
def test_gated_delta_net_raw(rng):
    n, hk, hv, dk, dv = 5, 1, 2, 8, 6
    q, k, v = normal(rng, (n, hk, dk), 0.5), normal(rng, (n, hk, dk), 0.5), normal(rng, (n, hv, dv))
    alpha, b = normal(rng, (n, hv)), normal(rng, (n, hv))
    a_neg, dt = -np.exp(normal(rng, (hv,))), normal(rng, (hv,))
    s0 = normal(rng, (hv, dk, dv), 0.3)
    s = g.state("S", s0.shape)
    res = g.gated_delta_net_raw(*(g.input(nm, x.shape) for nm, x in zip("qkvab", (q, k, v, alpha, b), strict=True)),
                                g.param("a_neg", (hv,)), g.param("dt", (hv,)), s, scale=0.25)
    state = {"S": s0.copy()}
    o = run({"o": g.item(res, index=0)}, {"q": q, "k": k, "v": v, "a": alpha, "b": b}, state=state,
            updates=(g.assign(s, g.item(res, index=1)),),
            weights=weights_of(a_neg=("f32", a_neg, (hv,)), dt=("f32", dt, (hv,))))["o"]
    z = alpha.astype(np.float64) + dt
    gate = a_neg * np.log1p(np.exp(z))  # a_neg * softplus(alpha + dt)
    beta = 1 / (1 + np.exp(-b.astype(np.float64)))
    want_o, want_s = _gdn_loops(q, k, v, gate, beta, s0, 0.25)
    close(o, want_o, rtol=1e-4, atol=1e-5, dtype="float32")
    close(state["S"], want_s, rtol=1e-4, atol=1e-5)
