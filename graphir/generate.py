"""Model-agnostic generation: sampling settings, the device-side sampling head, and the
prefill-then-decode loop.

What a draw means is defined once, by the `sample` op (graphir.ops.sample_row): top-k, then
temperature and softmax, then top-p, then a draw in token-id order with a uniform number u.
`make_sampler` applies it to host logits; `with_sampler` appends it to a graph so a backend
samples on its own device and returns one id per step instead of the logits. Both take u from
one seeded numpy Generator, one number per token, so a seed gives the same draws on every backend
(up to float rounding at the edges of the kept set).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

import numpy as np

from graphir.builder import Builder
from graphir.errors import GraphError, InputError
from graphir.ir import Graph
from graphir.ops import SAMPLING_FIELDS, sample_row

Sampler = Callable[[np.ndarray], int]
SAMPLING_INPUT = "sampling"  # the Input that carries (temperature, top_k, top_p, u) per row
TOKEN_OUTPUT = "token"


def _number(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def check_sampling(temperature: float, top_k: int, top_p: float, seed: int | None = None) -> None:
    """Each setting of its type and range (a string or a negative seed reached a comparison or numpy's
    SeedSequence and failed there, without naming the setting)."""
    if not (_number(temperature) and 0.0 <= temperature < float("inf")):  # as --temperature (FiniteFloatRange)
        raise InputError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not (isinstance(top_k, (int, np.integer)) and top_k >= 0):
        raise InputError(f"top_k must be an int >= 0 (0: off), got {top_k!r}")
    if not (_number(top_p) and 0.0 < top_p <= 1.0):
        raise InputError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if seed is not None and not (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed >= 0):
        raise InputError(f"seed must be None or an int >= 0, got {seed!r}")


def check_max_new_tokens(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise InputError(f"max_new_tokens must be an int >= 0, got {n!r}")


class Settings:
    """Checked sampling settings and their random stream: `row()` is the next draw's settings row."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        check_sampling(temperature, top_k, top_p, seed)
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def row(self) -> np.ndarray:
        """(temperature, top_k, top_p, u) as f32 [len(SAMPLING_FIELDS)]; draws u (greedy draws none)."""
        u = 0.0 if self.greedy else self.rng.random()
        # u just below 1 must stay below 1 in f32, or the draw could fall past the kept mass
        return np.array([self.temperature, self.top_k, self.top_p, min(u, 1.0 - 2.0 ** -24)], np.float32)

    def sample(self, logits: np.ndarray) -> int:
        """The next draw from host logits [vocab] (what the in-graph sampler does on the device)."""
        return sample_row(logits, *self.row().tolist())


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> Sampler:
    """logits [vocab] -> token id, on the host. `seed` makes draws reproducible."""
    return Settings(temperature, top_k, top_p, seed).sample


def with_sampler(graph: Graph) -> Graph:
    """`graph` with its logits sampled inside the graph: one more Input ("sampling", f32 [rows, 4])
    and one output ("token", i32 [rows]) in place of the logits, so a step returns ids, not logits."""
    logits = graph.outputs.get("logits")
    if logits is None or len(graph.outputs) != 1:
        raise GraphError(f"with_sampler: the graph must have exactly one output 'logits', has {sorted(graph.outputs)}")
    g = Builder()
    settings = g.input(SAMPLING_INPUT, logits.shape[:-1] + (len(SAMPLING_FIELDS),), "f32")
    token = g.sample(logits, settings, name="sampled_token")
    return Graph({TOKEN_OUTPUT: token}, graph.updates, {**graph.meta, "sampler": True})


def generate(prefill: Callable[[list[int]], int], step: Callable[[int], int], prompt_ids: list[int],
             max_new_tokens: int, eos_ids: Collection[int] = (), stop_at_eos: bool = True) -> Iterator[int]:
    """Yield up to max_new_tokens ids. `prefill(ids)` reads the prompt and returns the first new id;
    `step(id)` feeds one id and returns the next. An EOS id ends the loop unyielded."""
    if max_new_tokens <= 0:
        return
    token = prefill(list(prompt_ids))
    for i in range(max_new_tokens):
        if stop_at_eos and token in eos_ids:
            return
        yield token
        if i + 1 < max_new_tokens:
            token = step(token)
