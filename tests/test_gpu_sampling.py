"""Sampling on the device (the GPU suite, marker `gpu`): the `sample` op's draws follow the
probabilities of an independent formula (chi-square), and seeded generation on the gpu backend is
reproducible. Exact draws for chosen u are in tests/test_ops.py (every backend)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _gpu_helpers import gpu_only
from graphir.backends.registry import get_backend

import graphir
from graphir import g
from graphir.ir import Graph

pytestmark = [pytest.mark.gpu, gpu_only]


def probabilities(x: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
    """The distribution a draw follows, restated with a plain sort: top-k, softmax at t, top-p."""
    order = sorted(range(x.size), key=lambda i: (-float(x[i]), i))
    if 0 < k < x.size:
        order = order[:k]
    w = np.exp((x[order].astype(np.float64) - float(x[order[0]])) / t)
    before = np.concatenate([[0.0], np.cumsum(w)[:-1]])
    keep = before < p * w.sum()
    probs = np.zeros(x.size)
    probs[np.asarray(order)[keep]] = w[keep] / w[keep].sum()
    return probs


def chi2_upper(df: int, z: float = 4.26) -> float:
    """The chi-square value exceeded with probability ~1e-5 (z = 4.26), Wilson-Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("vocab,t,k,p", [(1000, 1.0, 0, 1.0), (1000, 0.8, 50, 0.9), (151936, 1.2, 40, 0.95),
                                         (7, 2.0, 0, 0.999)])
def test_device_draws_follow_the_distribution(vocab, t, k, p):
    rng = np.random.default_rng(vocab)
    x = (rng.standard_normal(vocab) * 2).astype(np.float32)
    draws = 20000
    rows = 2000  # one Program call samples `rows` rows of the same logits, each with its own u
    graph = Graph({"id": g.sample(g.input("x", (rows, vocab)), g.input("s", (rows, 4)))})
    program = get_backend("gpu").lower(graph)
    xs = np.tile(x, (rows, 1))
    ids = []
    for _ in range(draws // rows):
        s = np.column_stack([np.full(rows, t), np.full(rows, k), np.full(rows, p), rng.random(rows)])
        ids.append(program({"x": xs, "s": s.astype(np.float32)})["id"])
    counts = np.bincount(np.concatenate(ids), minlength=vocab)
    probs = probabilities(x, t, k, p)
    assert counts[probs == 0].sum() == 0, "drew a token outside the kept set"
    expected = probs * draws
    big = expected >= 5  # pool the rare tokens into one cell, as the test requires
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert stat < chi2_upper(len(obs) - 1), f"chi-square {stat:.1f} over {len(obs) - 1} degrees of freedom"


def test_seeded_generation_is_reproducible():
    model = graphir.load("random:qwen3-tiny", backend="gpu", ctx=128)
    prompt = list(b"Once upon a time")

    def run(seed):
        return list(model.generate(prompt, 24, temperature=1.0, top_k=50, top_p=0.95, seed=seed, stop_at_eos=False))

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c
    assert model._program(1, False, sampler=True).captured
    assert set(model._program(1, False, sampler=True).graph.outputs) == {"token"}  # no logits come back


@pytest.mark.parametrize("vocab", [4095, 4097, 10000, 248320])
def test_greedy_picks_the_first_largest_across_argmax_blocks(vocab):
    """Greedy rows (temperature 0, or top_k 1) of wide vocabularies: the largest logit is found by
    blocks of 4096 logits and merged; ties go to the lowest id, within and across blocks."""
    rng = np.random.default_rng(vocab)
    rows = 6
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    top = x.max() + 1.0
    x[1, [vocab - 1, 5]] = top  # a tie in the first and the last block: id 5
    x[2, [4096 % vocab, vocab // 2]] = top  # a tie across blocks (or one block when vocab <= 4096)
    x[3, vocab - 1] = top  # the very last id
    x[4, [17, 18]] = top  # a tie inside one block
    s = np.array([[0.0, 0, 1.0, 0.5], [0.0, 0, 1.0, 0.9], [1.3, 1, 0.9, 0.1]] * 2, np.float32)
    program = get_backend("gpu").lower(Graph({"id": g.sample(g.input("x", x.shape), g.input("s", s.shape))}))
    got = program({"x": x, "s": s})["id"]
    assert got.tolist() == np.argmax(x, axis=1).tolist()  # numpy: the first occurrence of the maximum
