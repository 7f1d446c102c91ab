"""Collectives of one rank's graph between processes of one host: shared memory and a barrier.

The cpu backend's counterpart of NCCL (backends/gpu/nccl.py), so one-process-per-rank tensor
parallelism (graphir/tp_workers.py) runs, and is tested, without GPUs. The parent makes a
`HostLink` (one shared buffer with a slot per rank, and a barrier) and hands it to each worker
process it spawns; a worker joins it as `HostGroup(link, rank)` and makes that current (`use`).
The cpu lowering then runs a one-source `all_reduce` / `all_gather` through it.

An exchange moves `slot_bytes` per rank at a time: each rank writes its chunk into its slot, all
wait, each reads every slot, all wait again (so no slot is overwritten while a rank still reads it).
The sum is taken in rank order in f32, as the reference sums simulated ranks, so every rank gets
bitwise the same value and equals the all-ranks graph on the cpu backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from graphir.errors import BackendError
from graphir.ir import Node

SLOT_BYTES = 4 << 20  # per rank: a decode step's exchanges fit in one round; prefill logits take a few


@dataclass
class HostLink:
    """What a worker needs to join its group; picklable into a spawned process (only as a Process argument)."""

    ranks: int
    slot_bytes: int
    buffer: Any  # multiprocessing RawArray of ranks * slot_bytes bytes
    barrier: Any  # multiprocessing Barrier(ranks)

    @classmethod
    def create(cls, mp_context: Any, ranks: int, slot_bytes: int = SLOT_BYTES) -> HostLink:
        return cls(ranks, slot_bytes, mp_context.RawArray("b", ranks * slot_bytes), mp_context.Barrier(ranks))


class HostGroup:
    """This process's member (`rank`) of a HostLink's group."""

    def __init__(self, link: HostLink, rank: int):
        if not 0 <= rank < link.ranks:
            raise BackendError(f"HostGroup: rank {rank} is outside 0..{link.ranks - 1}")
        self.size, self.rank, self.link = link.ranks, rank, link
        whole = np.frombuffer(link.buffer, np.uint8)
        self._slots = whole.reshape(link.ranks, link.slot_bytes)

    def _slot(self, r: int, dtype: np.dtype, count: int) -> np.ndarray:
        return self._slots[r].view(dtype)[:count]

    def _rounds(self, x: np.ndarray) -> list[tuple[int, int]]:
        per = self.link.slot_bytes // x.dtype.itemsize
        return [(a, min(a + per, x.size)) for a in range(0, x.size, per)] or [(0, 0)]

    def all_reduce(self, x: np.ndarray, out: np.ndarray) -> None:
        """out = x_0 + ... + x_{n-1} over the ranks' x, summed in rank order in f32."""
        flat, dst = x.reshape(-1), out.reshape(-1)
        for a, b in self._rounds(flat):
            self._slot(self.rank, flat.dtype, b - a)[...] = flat[a:b]
            self.link.barrier.wait()
            total = self._slot(0, flat.dtype, b - a).astype(np.float32)
            for r in range(1, self.size):
                total += self._slot(r, flat.dtype, b - a)
            dst[a:b] = total
            self.link.barrier.wait()

    def all_gather(self, x: np.ndarray, pieces: np.ndarray) -> None:
        """pieces [ranks, *x.shape] = every rank's x, in rank order."""
        flat = x.reshape(-1)
        got = pieces.reshape(self.size, -1)
        for a, b in self._rounds(flat):
            self._slot(self.rank, flat.dtype, b - a)[...] = flat[a:b]
            self.link.barrier.wait()
            for r in range(self.size):
                got[r, a:b] = self._slot(r, flat.dtype, b - a)
            self.link.barrier.wait()


_current: HostGroup | None = None


def use(group: HostGroup | None) -> None:
    """Make `group` the one one-source collectives lower to on the cpu backend (None: none)."""
    global _current
    _current = group


def current(n: Node) -> HostGroup | None:
    """The current group for node n's collective (None when this process joined none), checked
    against its rank count."""
    if _current is not None and _current.size != n.params["ranks"]:
        raise BackendError(f"{n.describe()}: collective over {n.params['ranks']} ranks, but this process's host "
                           f"group has {_current.size}")
    return _current
