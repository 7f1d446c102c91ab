"""Collectives of one rank's graph over NCCL: one process per GPU, the calls on the Program's stream.

A graph from `graphir.tp.rank_graph` holds one-source `all_reduce` / `all_gather` nodes: this rank's
part, to be combined with the other processes' parts. A process that runs such graphs first joins
its ranks' communicator (`NcclCommunicator(n, unique_id, rank)`, the id made once by one rank with
`unique_id()` and handed to the others) and makes it current (`use`); lowering then turns each
collective into an NCCL call on `device.stream()`, a step like a kernel launch: it runs in stream
order and is captured into the decode step's CUDA graph with the rest of the step (NCCL supports
stream capture), so a replayed step drives its all-reduces without Python.

One process drives one GPU: capturing NCCL for two GPUs from one process and one thread hung on an
H200 pair (NCCL 2.28). NVLink multicast (NVLS) stays off on these hosts: NCCL_NVLS_ENABLE=0 is set
before NCCL reads its environment (`communicator` does it; the worker layer sets it at start).

Small f32 all-reduces (decode and verify rows) go to p2p.py's kernel instead when the communicator
has a PeerGroup (`comm.peers`, set by the worker layer after joining): one kernel over peer memory,
aimed at ~2-3 us against NCCL's measured ~6.8 us inside a captured step (not yet measured itself;
tests/test_gpu_p2p.py prints both). `p2p.path` says which call takes which.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from graphir.errors import BackendError
from graphir.ir import Node

from . import p2p
from .device import cupy, stream
from .launch import Launch, Lowering

_current: NcclCommunicator | None = None


def _nccl() -> Any:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # before NCCL's first call reads it (see the module doc)
    from cupy.cuda import nccl

    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        raise BackendError("NCCL is not available to CuPy (libnccl.so.2 not found); install nvidia-nccl-cu13 "
                           "for one process per GPU tensor parallelism")
    return nccl


def unique_id() -> Any:
    """A new NCCL unique id (made by one rank, sent to the others). The process that makes it hosts
    NCCL's bootstrap root, so it must outlive the communicator's setup."""
    cupy()
    return _nccl().get_unique_id()  # as CuPy makes it (bytes in CuPy 14): its NcclCommunicator takes that type


class NcclCommunicator:
    """This process's member of an n-rank NCCL communicator, on the current device (set it first).
    Joining blocks until all n ranks have joined."""

    def __init__(self, n: int, uid: Any, rank: int):
        if not 0 <= rank < n:
            raise BackendError(f"NcclCommunicator: rank {rank} is outside 0..{n - 1}")
        nccl = _nccl()
        self.size, self.rank = n, rank
        self.device = cupy().cuda.Device().id
        self._nccl = nccl
        self.comm = nccl.NcclCommunicator(n, uid, rank)
        self.peers: p2p.PeerGroup | None = None  # small all-reduces over peer memory (p2p.join)
        self._dtypes = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16}

    def nccl_dtype(self, a: Any, what: str) -> int:
        dt = self._dtypes.get(np.dtype(a.dtype))
        if dt is None:
            raise BackendError(f"{what}: NCCL collectives here take f32 or f16, got {a.dtype}")
        return dt

    def close(self) -> None:
        """Free the communicator and its PeerGroup (after every rank's work on them is done)."""
        if self.peers is not None:
            self.peers.close()  # uses the communicator for its barrier
            self.peers = None
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None


def use(comm: NcclCommunicator | None) -> None:
    """Make `comm` the communicator one-source collectives lower to (None: none; lowering them fails)."""
    global _current
    _current = comm


def current(n: Node) -> NcclCommunicator:
    """The communicator for node n's collective, checked against its rank count."""
    if _current is None:
        raise BackendError(f"{n.describe()}: a one-source {n.op} is one rank's part of a collective over "
                           f"{n.params['ranks']} ranks; it runs only in a process that joined an NCCL "
                           f"communicator (graphir.load(..., backend='gpu', tp=N) starts one per GPU). Lower "
                           f"the all-ranks graph (shard-tp without rank=) to run every rank in one Program")
    if _current.size != n.params["ranks"]:
        raise BackendError(f"{n.describe()}: collective over {n.params['ranks']} ranks, but this process's NCCL "
                           f"communicator has {_current.size}")
    return _current


class NcclCall:
    """One NCCL collective on the Program's stream, every argument fixed at lowering: a step that may
    run inside CUDA-graph capture, like a kernel launch."""

    __slots__ = ("fn", "name")
    capturable = True

    def __init__(self, fn: Callable[[int], None], name: str):
        self.fn, self.name = fn, name

    def __call__(self) -> None:
        try:
            self.fn(stream().ptr)
        except Exception as e:  # NcclError and CUDA errors: say which collective
            raise BackendError(f"NCCL {self.name}: {type(e).__name__}: {e}") from e


def all_reduce(n: Node, x: Any, y: Any, lw: Lowering) -> list[NcclCall | Launch]:
    """y = the sum of every rank's x (in place when x is y): the peer-memory kernel where p2p.path
    says so, else an NCCL sum. `lw`, the node's Lowering, carries the error flag the kernel reports a
    missing peer through."""
    comm = current(n)
    if x.shape != y.shape or x.dtype != y.dtype:
        raise BackendError(f"{n.describe()}: all_reduce of {list(x.shape)} {x.dtype} into {list(y.shape)} {y.dtype}")
    if p2p.path(comm.peers, x.dtype, x.size) == "p2p":
        return [comm.peers.all_reduce(n, x, y, lw)]
    dt = comm.nccl_dtype(x, n.describe())
    send, recv, count, op = x.data.ptr, y.data.ptr, x.size, comm._nccl.NCCL_SUM
    return [NcclCall(lambda s: comm.comm.allReduce(send, recv, count, dt, op, s), f"all_reduce {n.name or ''}")]


def all_gather_flat(n: Node, x: Any, pieces: Any) -> list[NcclCall]:
    """pieces [ranks, *x.shape] = every rank's x, in rank order (NCCL joins the flat buffers)."""
    comm = current(n)
    dt = comm.nccl_dtype(x, n.describe())
    if pieces.shape != (comm.size,) + tuple(x.shape) or pieces.dtype != x.dtype:
        raise BackendError(f"{n.describe()}: all_gather of {list(x.shape)} into {list(pieces.shape)}")
    send, recv, count = x.data.ptr, pieces.data.ptr, x.size
    return [NcclCall(lambda s: comm.comm.allGather(send, recv, count, dt, s), f"all_gather {n.name or ''}")]


def gather_is_flat(shape: tuple[int, ...], axis: int) -> bool:
    """Whether joining pieces of `shape` along `axis` equals joining their flat buffers (nothing
    before the axis repeats): then NCCL gathers straight into the result."""
    return math.prod(shape[:axis]) == 1
