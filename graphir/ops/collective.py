"""Collective ops for tensor parallelism, registered into graphir.ops.OPS.

A collective has two forms, told apart by how many sources it has:
  - simulated ranks: one source per rank (`ranks` sources, in rank order). The whole sharded model is
    one graph holding every rank's branch, and the reference (and cpu, through it) compute the
    collective as plain math, so CI tests sharding without GPUs;
  - one rank's graph (`graphir.tp.rank_graph`): one source, this rank's. Only a backend that talks to
    the other ranks (NCCL, one process per GPU) can run it; the numpy reference says so and stops.
"""

from __future__ import annotations

import numpy as np

from graphir.errors import GraphError
from graphir.ops.core import REQUIRED, Type, need, need_float, op

MAX_RANKS = 64


def _sources(ts: list[Type], p: dict, what: str) -> None:
    need(p["ranks"] >= 1, f"ranks={p['ranks']} must be >= 1")
    need(len(ts) in (1, p["ranks"]),
         f"{what} over {p['ranks']} ranks takes 1 source (one rank's graph) or {p['ranks']} (simulated ranks), "
         f"got {len(ts)}")
    for i, t in enumerate(ts):
        need_float(t, f"source {i}")
        need(t[1] == ts[0][1], f"source {i} is {t[1]}, source 0 is {ts[0][1]}: ranks exchange one dtype")


def _one_rank(xs: tuple, ranks: int, what: str) -> None:
    if len(xs) != ranks:
        raise GraphError(f"{what}: this graph holds one rank of {ranks}; it needs a backend that exchanges data "
                         f"between ranks (one process per rank), not the numpy reference")


def _all_reduce_infer(ts: list[Type], p: dict) -> Type:
    _sources(ts, p, "all_reduce")
    for i, t in enumerate(ts):
        need(t[0] == ts[0][0], f"source {i} is {list(t[0])}, source 0 is {list(ts[0][0])}: an all_reduce sums "
                               f"equal shapes")
    return ts[0]


def _all_reduce_ref(*xs: np.ndarray, ranks: int) -> np.ndarray:
    _one_rank(xs, ranks, "all_reduce")
    total = xs[0].astype(np.float32)  # summed in rank order, in f32, as NCCL's ring does for f32
    for x in xs[1:]:
        total = total + x.astype(np.float32, copy=False)
    return total.astype(xs[0].dtype, copy=False)


op("all_reduce", (1, MAX_RANKS),
   "sum over ranks: every rank gets x_0 + ... + x_{ranks-1} (sources in rank order; one source: this rank's)",
   {"ranks": (int, REQUIRED)})((_all_reduce_infer, _all_reduce_ref))


def _all_gather_infer(ts: list[Type], p: dict) -> Type:
    _sources(ts, p, "all_gather")
    s0 = ts[0][0]
    ax = p["axis"]
    need(-len(s0) <= ax < len(s0), f"axis {ax} is out of range for {list(s0)}")
    ax %= len(s0)
    for i, (s, _) in enumerate(ts):
        need(len(s) == len(s0) and all(a == b for k, (a, b) in enumerate(zip(s, s0)) if k != ax),
             f"source {i} {list(s)} differs from source 0 {list(s0)} outside axis {ax}")
    # one rank's graph: NCCL gathers equal pieces, so the result is `ranks` times this rank's
    total = s0[ax] * p["ranks"] if len(ts) == 1 else sum(s[ax] for s, _ in ts)
    return s0[:ax] + (total,) + s0[ax + 1:], ts[0][1]


def _all_gather_ref(*xs: np.ndarray, axis: int, ranks: int) -> np.ndarray:
    _one_rank(xs, ranks, "all_gather")
    return np.concatenate(xs, axis=axis)


op("all_gather", (1, MAX_RANKS),
   "every rank gets its pieces joined along axis in rank order: concat(x_0, ..., x_{ranks-1}) "
   "(sources in rank order; one source: this rank's, all pieces equal)",
   {"axis": (int, REQUIRED), "ranks": (int, REQUIRED)})((_all_gather_infer, _all_gather_ref))
