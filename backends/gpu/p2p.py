"""Small all-reduces over peer memory: one kernel reads every rank's part straight from its GPU.

A TP=2 Qwen3-8B decode step has 72 all-reduces of 16 KiB; as NCCL calls inside the captured step
they cost ~6.8 us each (495 us of a 3,854 us step, H200 pair, issue 16). Here each rank instead
maps every peer's buffer into its own address space once (CUDA IPC), and an all-reduce is one
kernel (p2p.cu): copy this rank's part into its own buffer, announce it with a flag in every
peer's memory, wait for theirs, sum all parts in rank order. No host work, no launch argument that
changes between calls (epochs live on the device), so it is captured and replayed like any kernel.

    comm = nccl.NcclCommunicator(n, uid, rank)
    comm.peers = p2p.join(comm)      # collective; None where peer memory cannot be used
    nccl.use(comm)                   # nccl.all_reduce now picks this kernel for small f32 tensors

The buffers are per lane (a block's 1024-element slice), not per all-reduce site: a rank runs all its
collectives in order on one stream, every rank the same ones, so one epoch count per lane orders them
all, and two buffers by epoch parity are enough (p2p.cu gives the argument). Slots per site would
need every rank to number the sites alike in whatever order it lowers its Programs, and would grow
with every Program and rebind; the per-lane count needs neither.

Which path an all-reduce takes (`path`): this kernel for f32 of 1..MAX_ELEMENTS elements (256 KiB:
decode and verify rows; larger prefill ones stay on NCCL, which is built for bandwidth) when the
communicator has a PeerGroup; NCCL otherwise, and always for all_gather.
GRAPHIR_TP_ALLREDUCE picks: `nccl` (the default: never this kernel, which measured slower than NCCL, see
DEFAULT_MODE), `auto` (CUDA only, when every pair of ranks' GPUs can access each other's memory),
`p2p` (also on HIP, untested there: hipMalloc
memory is coarse-grained, and a flag written by a peer during a kernel may not be seen until it ends).
GRAPHIR_TP_P2P_TIMEOUT_S (default 30) bounds a wait for a peer: past it the kernel reports the
missing rank through the Program's error flag (a BackendError naming the node) instead of hanging.
The default is long because a peer may legitimately lag by its host's compile or load time before
its first call; in `graphir.load(..., tp=N)` a dead worker is ended by the parent within a second.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from graphir.errors import BackendError
from graphir.ir import Node

from .device import cupy, stream
from .launch import Launch, Lowering, cdiv

MODE_ENV, TIMEOUT_ENV = "GRAPHIR_TP_ALLREDUCE", "GRAPHIR_TP_P2P_TIMEOUT_S"
MODES = ("auto", "nccl", "p2p")
# NCCL by default: on two H200s this kernel measured 8.84 us an all-reduce against NCCL's 6.64 (a captured
# chain of 72 of 16 KiB, 2026-12-01), and a TP=2 Qwen3-8B decode step's collectives 633 us against 495.
DEFAULT_MODE = "nccl"
DEFAULT_TIMEOUT_S = 30.0
# p2p.cu's layout (its #ifndef defaults; tests/test_gpu_p2p.py checks they agree)
MAX_RANKS, MAX_BLOCKS, CHUNK, DATA_OFF = 8, 64, 1024, 8192
MAX_ELEMENTS = MAX_BLOCKS * CHUNK  # f32 elements one call can carry: 256 KiB
ALLOC_BYTES = DATA_OFF + 2 * MAX_ELEMENTS * 4  # flags and epochs, then two data buffers
THREADS = 256  # a multiple of 64 (a gfx9 wavefront); 4 elements a thread for a full 1024-element lane
KERNEL = "all_reduce_p2p_f32"
HIP_CLOCK_HZ = 100e6  # wall_clock64's rate on gfx90a/gfx942 (CUDA's %globaltimer counts nanoseconds)
RECORD = 128  # bytes each rank contributes to join's exchange: a flag byte and its 64-byte IPC handle


def mode() -> str:
    """GRAPHIR_TP_ALLREDUCE, checked."""
    m = os.environ.get(MODE_ENV, DEFAULT_MODE).strip().lower() or DEFAULT_MODE
    if m not in MODES:
        raise BackendError(f"{MODE_ENV}={m!r}: expected one of {', '.join(MODES)}")
    return m


def wanted(is_hip: bool) -> bool:
    """Whether this process offers peer memory at all (join then checks the GPUs)."""
    m = mode()
    return m == "p2p" or (m == "auto" and not is_hip)


def timeout_s() -> float:
    v = os.environ.get(TIMEOUT_ENV, "")
    try:
        t = float(v) if v else DEFAULT_TIMEOUT_S
    except ValueError:
        raise BackendError(f"{TIMEOUT_ENV}={v!r}: expected seconds, e.g. 30") from None
    if not t > 0:
        raise BackendError(f"{TIMEOUT_ENV}={v!r}: must be > 0")
    return t


def eligible(dtype: Any, size: int) -> bool:
    """Whether an all-reduce of `size` elements of `dtype` fits the kernel (f32: activations are f32
    on this backend; f16 ones are cast to f32 scratch before any rule sees them)."""
    return np.dtype(dtype) == np.float32 and 1 <= size <= MAX_ELEMENTS


def path(group: PeerGroup | None, dtype: Any, size: int) -> str:
    """'p2p' or 'nccl': where nccl.all_reduce sends an all-reduce."""
    return "p2p" if group is not None and eligible(dtype, size) else "nccl"


def lanes(count: int) -> int:
    """Blocks of one call: lane b carries elements [b * CHUNK, (b + 1) * CHUNK)."""
    return cdiv(count, CHUNK)


def is_p2p_step(step: Any) -> bool:
    """Whether a Program step is this module's all-reduce kernel (bench_tp times them apart)."""
    return isinstance(step, Launch) and step.name == KERNEL


def accessible(my_device: int, devices: list[int], can_access: Any) -> bool:
    """Every other rank's GPU can be read and written from mine (one GPU shared is fine too)."""
    return all(d == my_device or can_access(my_device, d) for d in devices)


class PeerGroup:
    """This rank's buffer and its peers', mapped in this process. Made by `join`; closed with the
    communicator (`NcclCommunicator.close`), after every rank's last call."""

    def __init__(self, comm: Any, local_ptr: int, peer_ptrs: dict[int, int]):
        cp = cupy()
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.local_ptr, self.peer_ptrs = local_ptr, peer_ptrs
        ptrs = [local_ptr if r == self.rank else peer_ptrs[r] for r in range(self.size)]
        self.bases = cp.asarray(np.array(ptrs, np.uint64))  # kernel argument: rank r's buffer here
        self.timeout_s = timeout_s()  # read at lowering; tests lower it to see a timeout quickly
        self.is_hip = bool(cp.cuda.runtime.is_hip)

    def timeout_ticks(self) -> np.int64:
        return np.int64(self.timeout_s * (HIP_CLOCK_HZ if self.is_hip else 1e9))

    def all_reduce(self, n: Node, x: Any, y: Any, lw: Lowering) -> Launch:
        """The kernel launch for y = sum of every rank's x (x may be y), reporting through lw's flag."""
        if not eligible(x.dtype, x.size) or x.size != y.size or y.dtype != x.dtype:
            raise BackendError(f"{n.describe()}: peer all_reduce takes f32 of 1..{MAX_ELEMENTS} elements, got "
                               f"{list(x.shape)} {x.dtype} into {list(y.shape)} {y.dtype}")
        code = lw.code_arg(f"all_reduce over peer memory: rank {{value}} did not arrive within {self.timeout_s:g} s "
                           f"({TIMEOUT_ENV}; a dead or stalled peer, or ranks running different collectives); "
                           f"this rank's peer group refuses every later call")
        args = (x, y, np.int32(x.size), self.bases, np.int32(self.rank), np.int32(self.size), self.timeout_ticks(),
                lw.errflag, code)
        return Launch("p2p.cu", KERNEL, lanes(x.size), THREADS, args)

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's, once no rank can still read it: a barrier
        first, since a peer may still be summing from this buffer when this rank's last call ends."""
        if self.local_ptr is None:
            return
        rt = cupy().cuda.runtime
        _barrier(self.comm)
        for ptr in self.peer_ptrs.values():
            rt.ipcCloseMemHandle(ptr)
        rt.free(self.local_ptr)
        self.local_ptr, self.peer_ptrs = None, {}


def join(comm: Any) -> PeerGroup | None:
    """Collective over comm's ranks (each calls it once, after the communicator): this rank's
    PeerGroup, or None on every rank where any rank cannot use peer memory (GRAPHIR_TP_ALLREDUCE,
    HIP, more than MAX_RANKS ranks, a pair of GPUs without peer access). Every rank decides from
    the same gathered facts, so all take the same path."""
    cp = cupy()
    rt = cp.cuda.runtime
    device = cp.cuda.Device().id
    willing = comm.size <= MAX_RANKS and wanted(bool(rt.is_hip))
    facts = _all_gather_bytes(comm, np.array([device, int(willing)], np.int64).tobytes())
    devices = [int(np.frombuffer(f, np.int64)[0]) for f in facts]
    ok = all(np.frombuffer(f, np.int64)[1] for f in facts) and accessible(device, devices, rt.deviceCanAccessPeer)
    local_ptr, record = None, bytearray(RECORD)
    if ok:
        local_ptr = rt.malloc(ALLOC_BYTES)  # its own allocation: an IPC handle names a whole one, not a pool block
        rt.memset(local_ptr, 0, ALLOC_BYTES)  # epochs and flags start at 0 (peers write flags only in calls)
        rt.deviceSynchronize()
        handle = bytes(rt.ipcGetMemHandle(local_ptr))
        record[0], record[1:1 + len(handle)] = 1, handle
    records = _all_gather_bytes(comm, bytes(record))
    if not all(r[0] for r in records):
        if local_ptr is not None:
            rt.free(local_ptr)
        return None
    peers = {r: rt.ipcOpenMemHandle(bytes(records[r][1:65]), rt.cudaIpcMemLazyEnablePeerAccess)
             for r in range(comm.size) if r != comm.rank}
    return PeerGroup(comm, local_ptr, peers)


def _all_gather_bytes(comm: Any, data: bytes) -> list[bytes]:
    """Every rank's `data` (all the same length), in rank order, through NCCL on the device."""
    cp = cupy()
    send = cp.asarray(np.frombuffer(data, np.uint8))
    recv = cp.empty((comm.size, len(data)), np.uint8)
    s = stream()
    comm.comm.allGather(send.data.ptr, recv.data.ptr, len(data), comm._nccl.NCCL_UINT8, s.ptr)
    s.synchronize()
    return [bytes(row) for row in cp.asnumpy(recv)]


def _barrier(comm: Any) -> None:
    """Returns once every rank's stream has drained up to its own barrier call."""
    s = stream()
    s.synchronize()
    _all_gather_bytes(comm, b"\0")
