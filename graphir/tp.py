"""Tensor parallelism around the `shard-tp` pass: slice names, rank-local State, one rank's graph.

The pass (graphir/passes/shard_tp.py) makes one graph holding all N ranks' branches. Two kinds
of leaves appear in it:
  - sliced Params, named by the slice: `blk.0.ffn_down.weight@1[0:48]` is columns 0..47 of
    `blk.0.ffn_down.weight`; `w@0[0:16,32:48]` joins two row ranges. The name says what to cut,
    so any weight store derives the slice from the stored weight (`slice_weight`, reached through
    `Weights.__getitem__`) without knowing the rank plan; ranks that hold the same heads (a KV
    head replicated over ranks) share one Param. Quantized weights are cut at block boundaries.
  - rank-local States, named `<state>@tp<r>of<N>`: each rank writes its own buffer, so a State
    is never shared between ranks. graph.meta["tp"]["states"] maps each to the slice of the
    unsharded State it holds, so `shard_state` / `gather_state` convert buffers both ways.
`rank_graph(graph, r)` extracts what one process (one GPU) runs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from graphir.builder import make
from graphir.dtypes import DTYPES
from graphir.errors import GraphError, LoadError
from graphir.ir import Graph, Node, toposort
from graphir.ops import OPS
from graphir.weights import Weight, Weights

COLLECTIVES = ("all_reduce", "all_gather")
_SLICE = re.compile(r"^(?P<base>.+)@(?P<axis>\d+)\[(?P<ranges>\d+:\d+(?:,\d+:\d+)*)\]$")


# ---------------------------------------------------------------- index lists <-> names
def ranges(idx: Sequence[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 5, 6] -> [(0, 3), (5, 7)]: runs of consecutive indices, in order."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def slice_name(base: str, axis: int, idx: Sequence[int]) -> str:
    return f"{base}@{axis}[{','.join(f'{a}:{b}' for a, b in ranges(idx))}]"


def parse_slice_name(name: str) -> tuple[str, int, list[tuple[int, int]]] | None:
    m = _SLICE.match(name)
    if m is None:
        return None
    spans = [tuple(int(v) for v in r.split(":")) for r in m["ranges"].split(",")]
    return m["base"], int(m["axis"]), spans  # type: ignore[return-value]


def state_name(base: str, rank: int, ranks: int) -> str:
    return f"{base}@tp{rank}of{ranks}"


# ---------------------------------------------------------------- sliced weights
def slice_weight(weights: Weights, name: str) -> Weight | None:
    """The Weight a slice name stands for (cached in weights.derived), or None if `name` is no slice name."""
    parsed = parse_slice_name(name)
    if parsed is None:
        return None
    key = ("tp-slice", name)
    if key in weights.derived:
        return weights.derived[key]  # type: ignore[return-value]
    base, axis, spans = parsed
    w = weights[base]
    d = DTYPES[w.dtype]
    if axis >= len(w.shape) or any(not 0 <= a < b <= w.shape[axis] for a, b in spans):
        raise LoadError(f"{weights.source}: slice {name!r} is outside tensor {base!r} {list(w.shape)}")
    last = axis == len(w.shape) - 1
    pieces = []
    for a, b in spans:
        if last and d.quantized:
            if a % d.block or b % d.block:
                raise LoadError(f"{weights.source}: slice {name!r} cuts {w.dtype} blocks of {d.block} columns; "
                                f"a quantized tensor splits only at block boundaries")
            a, b = a // d.block * d.block_bytes, b // d.block * d.block_bytes  # storage is [..., row bytes]
        pieces.append(np.take(w.data, np.arange(a, b), axis=axis))
    shape = list(w.shape)
    shape[axis] = sum(b - a for a, b in spans)
    out = Weight(w.dtype, tuple(shape), np.ascontiguousarray(np.concatenate(pieces, axis=axis)))
    weights.derived[key] = out
    return out


# ---------------------------------------------------------------- rank-local State
def _state_specs(graph: Graph) -> dict[str, list]:
    tp = graph.meta.get("tp")
    if not tp:
        raise GraphError("graph is not sharded (no meta['tp']); run the shard-tp pass first")
    return dict(tp["states"])  # local name -> [unsharded name, axis, [[start, stop], ...], rank]


def _take(axis: int, spans: Sequence[Sequence[int]]) -> tuple:
    """The index of a State's part: its [start, stop) spans along `axis`."""
    return (slice(None),) * axis + (np.concatenate([np.arange(a, b) for a, b in spans]),)


def shard_state(graph: Graph, full: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """State buffers for a sharded graph, cut from the unsharded graph's buffers (copies for rank-local
    States; a State the pass left whole is passed through)."""
    specs = _state_specs(graph)
    out: dict[str, np.ndarray] = {}
    for n in graph.states:
        if n.name in specs:
            base, axis, spans, _ = specs[n.name]
            out[n.name] = np.ascontiguousarray(full[base][_take(axis, spans)])
        else:
            out[n.name] = full[n.name]
    return out


def gather_state(graph: Graph, local: Mapping[str, np.ndarray], full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Write rank-local State buffers back into the unsharded ones, in place; returns `full`.
    A slice held by several ranks (a replicated KV head) is written by each: they hold equal values."""
    for name, (base, axis, spans, _) in _state_specs(graph).items():
        full[base][_take(axis, spans)] = local[name]
    return full


# ---------------------------------------------------------------- one rank's graph
def rank_graph(graph: Graph, rank: int) -> Graph:
    """What rank `rank` runs alone: its branch, the replicated nodes, and collectives reduced to its one
    source (a backend that talks to the other ranks computes them). Other ranks' States never appear."""
    tp = graph.meta.get("tp")
    if not tp:
        raise GraphError("rank_graph: graph is not sharded (no meta['tp']); run the shard-tp pass first")
    n_ranks = int(tp["ranks"])
    if not 0 <= rank < n_ranks:
        raise GraphError(f"rank_graph: rank {rank} is outside 0..{n_ranks - 1}")
    specs = _state_specs(graph)
    theirs = {name for name, spec in specs.items() if spec[3] != rank}
    updates = [u for u in graph.updates if _written_state(u).name not in theirs]
    memo: dict[int, Node] = {}
    for n in toposort(list(graph.outputs.values()) + updates):
        if n.op in COLLECTIVES and len(n.src) == n_ranks > 1:
            memo[id(n)] = _local_collective(n, memo[id(n.src[rank])])
        else:
            src = tuple(memo[id(s)] for s in n.src)
            memo[id(n)] = n if all(a is b for a, b in zip(src, n.src)) else n.replace(src=src)
    mine = {k: v for k, v in specs.items() if k not in theirs}
    out = Graph({k: memo[id(v)] for k, v in graph.outputs.items()}, [memo[id(u)] for u in updates],
                {**graph.meta, "tp": {**tp, "rank": rank, "states": mine}})
    leaked = sorted(n.name for n in out.states if n.name in theirs)
    if leaked:
        raise GraphError(f"rank_graph: rank {rank} reads other ranks' States {leaked}: a rank branch crosses ranks "
                         f"outside a collective")
    return out


def _written_state(u: Node) -> Node:
    while OPS[u.op].writes:
        u = u.src[0]
    return u


def _local_collective(n: Node, mine: Node) -> Node:
    local = make(n.op, mine, name=n.name, **n.params.as_dict())
    if local.shape != n.shape:
        raise GraphError(f"rank_graph: {n.describe()} gathers unequal pieces ({[list(s.shape) for s in n.src]}); "
                         f"one rank's all_gather needs equal pieces")
    return local
