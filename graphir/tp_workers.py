"""Tensor parallelism with one process per rank: `graphir.load(spec, backend, tp=N)`.

    model = graphir.load("random:qwen3-8b", backend="gpu", tp=2)   # rank r on GPU r
    ids = list(model.generate(prompt_ids, 32))                      # the same interface as a Model
    model.close()                                                   # also at exit

The parent process starts N workers (multiprocessing "spawn": CUDA and numba's threads do not
survive fork). Worker r joins its ranks' collective group (gpu: an NCCL communicator, backends/gpu/
nccl.py, rank r on GPU r, small all-reduces over peer memory where the GPUs allow, p2p.py; cpu:
shared memory and a barrier, backends/cpu/host_collective.py) and loads the model as an ordinary
`Model` whose pipeline starts with `shard-tp{n=N,rank=r}`: every graph it lowers is rank r's
(graphir.tp.rank_graph), with its one-source collectives lowered to the group, so its decode step
(collectives included) is captured and replayed like any other.

Every rank runs the same calls in lockstep: the parent sends each command to all workers, and each
runs it on its Model. Sampling sees the same replicated logits (the LM head's all_gather) with the
same seed, so every rank draws the same ids and feeds them back itself; only rank 0 sends them to
the parent, one small message per token.

Failure never hangs: the parent waits on every worker's pipe and process sentinel at once. A worker
that raises reports its rank and error; a worker that dies is seen by its sentinel. Either way the
parent ends all workers (peers blocked in a collective on the dead rank included) and raises
TpWorkerError naming the rank and the cause. A worker whose parent dies exits.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from graphir.errors import BackendError, InputError
from graphir.generate import check_max_new_tokens

BACKENDS = ("gpu", "cpu")  # the backends with a collective between processes
JOIN_S = 5.0  # seconds a worker gets to exit after close() before it is killed
# Seconds the parent waits for any worker's message before calling it a hang (None: no limit, since a
# large model's load or prefill may take long; the GPU tests set one so a hang costs minutes, not hours).
REPLY_TIMEOUT_S: float | None = None
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off on these hosts (issue 16)


# spawn imports the parent's main script in each worker before the worker starts
_START_HINT = (" (its traceback is on stderr; a script that calls graphir.load(..., tp=N) when imported needs "
               "`if __name__ == '__main__':` around it, as with any multiprocessing 'spawn' start)")


class TpWorkerError(BackendError):
    """A tensor-parallel worker failed or died; every worker has been ended."""


@dataclass(frozen=True)
class LoadArgs:
    """What each worker passes to graphir.load (its pipeline gets shard-tp for its rank in front)."""

    spec: str
    backend: str
    dtype: str | None
    ctx: int | None
    passes: str
    threads: int | None


# ---------------------------------------------------------------- checks in the parent
def check_tp(tp: Any, backend: str, passes: str) -> None:
    """tp a count the backend can run, and a pipeline that does not shard by itself."""
    from graphir.passes import parse_pipeline

    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        raise InputError(f"tp must be an int >= 1 (processes, one per rank), got {tp!r}")
    if backend not in BACKENDS:
        raise InputError(f"tp={tp}: backend {backend!r} has no collective between processes; tensor parallelism "
                         f"runs on {' and '.join(BACKENDS)}. The reference backend runs all ranks in one graph: "
                         f"passes='shard-tp{{n={tp}}},default' with tp=1")
    if any(name == "shard-tp" for name, _ in parse_pipeline(passes)):
        raise InputError(f"tp={tp}: passes {passes!r} already hold shard-tp; tp=N puts shard-tp{{n=N,rank=r}} in "
                         f"front of each rank's pipeline itself")
    if backend == "gpu" and tp > gpu_count():
        raise InputError(f"tp={tp} needs {tp} GPUs (one process per GPU); CuPy sees {gpu_count()}")


def gpu_count() -> int:
    from graphir.backends.gpu.device import cupy

    return int(cupy().cuda.runtime.getDeviceCount())


# ---------------------------------------------------------------- the parent's side
class TensorParallelModel:
    """N worker processes running one model's ranks, with the Model interface a user needs:
    generate, logits, feed, reset, call (any function of a rank's Model), stats, close."""

    def __init__(self, args: LoadArgs, tp: int):
        self.tp, self.backend, self.source = tp, args.backend, args.spec
        self.passes = args.passes
        self.stats: dict[str, float] = {}
        self._closed = False
        self._pending: deque[int] | None = None  # ranks still owing a final reply to an abandoned stream
        self._ready = False  # every worker has loaded its rank
        self.reply_timeout_s = REPLY_TIMEOUT_S
        t0 = time.perf_counter()
        ctx = mp.get_context("spawn")
        link = None
        if args.backend == "cpu":
            from graphir.backends.cpu.host_collective import HostLink

            link = HostLink.create(ctx, tp)
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._inbox: list[deque] = [deque() for _ in range(tp)]
        for r in range(tp):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(r, tp, theirs, args, link), name=f"graphir-tp{r}", daemon=True)
            p.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(p)
        self._grace = [JOIN_S]  # seconds workers get to exit on close; 0 after a failure
        self._finalizer = weakref.finalize(self, _end_all, self._procs, self._conns, self._grace)  # also at exit
        if args.backend == "gpu":
            uid = self._receive(0, "making the NCCL unique id")
            for conn in self._conns[1:]:
                conn.send(uid)
        info = self._final("loading")
        self.config, self.tokenizer, self.eos_ids = info["config"], info["tokenizer"], info["eos_ids"]
        self._ready = True
        self.stats = {"load_s": time.perf_counter() - t0}

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- commands ----
    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(model, *args) on every rank's Model, in lockstep; rank 0's result. `fn` must be picklable
        (a module-level function, or a Model method such as Model.feed)."""
        self._send(("call", fn, args))
        value, stats = self._final(f"running {getattr(fn, '__qualname__', fn)}")
        self._add_stats(stats)
        return value

    def logits(self, token_ids: Iterable[int]) -> np.ndarray:
        """Logits f32 [n, vocab] of every position, from a fresh KV cache (Model.logits on every rank)."""
        from graphir.api import Model

        ids = self._check_ids(token_ids)
        self._check_room(0, len(ids))
        return self.call(Model.logits, ids)

    def feed(self, token_ids: Iterable[int], last_only: bool = False) -> np.ndarray:
        from graphir.api import Model

        ids = self._check_ids(token_ids)
        self._check_room(self.call(_n_past), len(ids))
        return self.call(Model.feed, ids, last_only)

    def _check_room(self, n_past: int, n: int) -> None:
        """The context checked here, as generate()'s arguments are: an error a rank raises ends every worker
        (a parent cannot tell it from a lost peer), so a prompt one token too long closed the model."""
        if n_past + n > self.config.ctx:
            raise InputError(f"{n} tokens after {n_past} exceed the context of {self.config.ctx} "
                             f"(load(..., ctx=N) to raise it)")

    def reset(self) -> None:
        from graphir.api import Model

        self.call(Model.reset)

    def generate(self, prompt_ids: Iterable[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True, draft: Any = None,
                 draft_len: int = 4) -> Iterator[int]:
        """Model.generate on every rank; the ids stream from rank 0. Arguments are checked here, before
        the workers see them. A stream dropped early lets the workers finish it (at most max_new_tokens);
        the next command waits for that."""
        from graphir.generate import check_sampling

        if draft is not None:
            raise InputError("speculative decoding (draft=) does not run with tp > 1 yet")
        ids = self._check_ids(prompt_ids)
        check_max_new_tokens(max_new_tokens)
        if len(ids) + max_new_tokens > self.config.ctx:
            raise InputError(f"prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens} exceeds the context "
                             f"of {self.config.ctx} (load(..., ctx=N) to raise it)")
        check_sampling(temperature, top_k, top_p, seed)
        self._send(("generate", ids, int(max_new_tokens), temperature, top_k, top_p, seed, stop_at_eos))
        self._pending = deque(range(self.tp))
        return self._stream()

    def _stream(self) -> Iterator[int]:
        while True:
            kind, value = self._receive(0, "generating")
            if kind == "token":
                yield value
                continue
            self._pending.popleft()
            self._add_stats(value)
            self._collect_pending("generating")
            return

    def close(self) -> None:
        """End the workers (each frees its device memory and communicator)."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> TensorParallelModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"<TensorParallelModel {c.arch} {self.source!r}: {self.tp} ranks ({self.backend}), "
                f"{c.n_layers} layers, vocab {c.n_vocab}, ctx {c.ctx}>")

    # ---- messages ----
    def _add_stats(self, rank0: dict[str, float]) -> None:
        """Rank 0's run stats (prefill/decode seconds and tokens); load_s stays the parent's wall time."""
        self.stats.update({k: v for k, v in rank0.items() if k != "load_s"})

    def _check_ids(self, token_ids: Iterable[int]) -> np.ndarray:
        from graphir.api import Model

        return Model._check_ids(self, token_ids)  # type: ignore[arg-type]  # needs only config and source

    def _send(self, msg: tuple) -> None:
        if self._closed:
            raise TpWorkerError(f"tensor-parallel model {self.source!r} is closed")
        self._collect_pending("finishing an earlier generate()")
        for r, conn in enumerate(self._conns):
            try:
                conn.send(msg)
            except (BrokenPipeError, OSError):
                self._receive(r, "taking a command")  # reports how the worker ended
                raise

    def _collect_pending(self, doing: str) -> None:
        """Final replies still owed by the ranks of a generate() stream (rank 0's tokens are dropped)."""
        while self._pending:
            r = self._pending[0]
            kind, value = self._receive(r, doing)
            if kind == "done":
                self._pending.popleft()
                if r == 0:
                    self._add_stats(value)
        self._pending = None

    def _final(self, doing: str) -> Any:
        """Every rank's final reply to the last command; rank 0's value."""
        self._pending = deque(range(self.tp))
        first = None
        while self._pending:
            r = self._pending.popleft()
            value = self._receive(r, doing)
            if r == 0:
                first = value
        self._pending = None
        return first

    def _receive(self, rank: int, doing: str) -> Any:
        """The next message from `rank`, watching every worker meanwhile: an error report or a death
        anywhere ends all workers and raises."""
        inbox = self._inbox[rank]
        while not inbox:
            ready = wait(self._conns + [p.sentinel for p in self._procs], self.reply_timeout_s)
            if not ready:
                self._fail(rank, f"no message from any worker for {self.reply_timeout_s} s while {doing} "
                                 f"(every worker still runs: a hang)")
            # an ended worker first: a peer's error (an NCCL error on a lost peer) is its consequence
            for r, p in enumerate(self._procs):
                if p.sentinel in ready:
                    self._take(r, doing)  # a report it sent before it ended comes first
                    self._fail(r, f"its process (pid {p.pid}) ended {_how(p)} while {doing}"
                                  + ("" if self._ready else _START_HINT))
            for r, conn in enumerate(self._conns):
                if conn in ready:
                    self._take(r, doing)
        return inbox.popleft()

    def _take(self, r: int, doing: str) -> None:
        conn = self._conns[r]
        try:
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "error":
                    _, kind, text, trace, blob = msg
                    self._fail(r, f"{kind}: {text} (while {doing})\n--- rank {r}'s traceback ---\n{trace}",
                               _unpickled(blob))
                self._inbox[r].append(msg[1])  # ("reply", value)
        except (EOFError, OSError):
            return  # the pipe closed: the sentinel says how the process ended

    def _fail(self, rank: int, cause: str, exc: BaseException | None = None) -> None:
        self._closed = True
        self._grace[0] = 0.0  # the others may be blocked in a collective with the failed rank: end them now
        self._finalizer()
        raise TpWorkerError(f"tensor-parallel rank {rank} of {self.tp} ({self.backend}, {self.source}): {cause}; "
                            f"all {self.tp} workers ended") from exc


def _unpickled(blob: bytes | None) -> BaseException | None:
    """A worker's exception, to chain to TpWorkerError; None when it does not travel (some classes
    cannot be rebuilt from their pickled args): the message and traceback text carry it anyway."""
    try:
        return pickle.loads(blob) if blob is not None else None
    except Exception:
        return None


def _how(p: Any) -> str:
    p.join(0.5)
    code = p.exitcode
    if code is None:
        return "(still running)"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"with exit code {code}"


def _end_all(procs: list, conns: list[Connection], grace: list[float]) -> None:
    """Ask each worker to close, then end those that do not within grace[0] seconds (peers stuck in a
    collective on a dead rank)."""
    for conn in conns:
        try:
            conn.send(("close",))
        except (BrokenPipeError, OSError):
            pass
    deadline = time.monotonic() + grace[0]
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.0))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for conn in conns:
        conn.close()


# ---------------------------------------------------------------- the worker's side
_rank: int | None = None  # in a worker process: its rank


def worker_rank() -> int | None:
    """This process's rank when it is a tensor-parallel worker (for functions passed to `call`), else None."""
    return _rank


def _worker_main(rank: int, n: int, conn: Connection, args: LoadArgs, link: Any) -> None:
    global _rank
    _rank = rank
    os.environ.update(_NCCL_ENV)
    _exit_with_parent()
    try:
        group = _join_group(rank, n, conn, args.backend, link)
        model = _load_rank(args, rank, n)
        info = {"config": model.config, "tokenizer": model.tokenizer, "eos_ids": model.eos_ids}
        conn.send(("reply", info if rank == 0 else None))
        _serve(rank, conn, model)
        del model, info
        gc.collect()  # its Programs (captured graphs that call the communicator) go before the communicator
        if hasattr(group, "close"):  # a clean close only: after an error, peers may never join its teardown
            group.close()
    except (EOFError, KeyboardInterrupt):
        pass  # the parent went away, or ended us
    except BaseException as e:  # report anything, then exit: the parent ends the other ranks
        _report(conn, e)


def _exit_with_parent() -> None:
    """A daemon thread that ends this worker when its parent dies (a collective would wait forever)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)
    threading.Thread(target=watch, name="graphir-tp-parent-watch", daemon=True).start()


def _join_group(rank: int, n: int, conn: Connection, backend: str, link: Any) -> Any:
    """This rank's collective group, made current for lowering."""
    if backend == "cpu":
        from graphir.backends.cpu import host_collective

        group = host_collective.HostGroup(link, rank)
        host_collective.use(group)
        return group
    from graphir.backends.gpu import nccl, p2p
    from graphir.backends.gpu.device import cupy

    cupy().cuda.Device(rank).use()  # before anything touches the device: the stream, weights, State
    if rank == 0:
        uid = nccl.unique_id()
        conn.send(("reply", ("uid", uid)))
    else:
        _, uid = conn.recv()
    comm = nccl.NcclCommunicator(n, uid, rank)
    # small all-reduces over peer memory (backends/gpu/p2p.py); None: all on NCCL. Closed with comm.
    comm.peers = p2p.join(comm)
    nccl.use(comm)
    return comm


def _load_rank(args: LoadArgs, rank: int, n: int) -> Any:
    """The Model whose graphs are rank `rank`'s; the decode graph is sharded now, so a model that cannot
    be split fails at load, not at the first token."""
    from graphir.api import load

    passes = f"shard-tp{{n={n},rank={rank}}}" + (f",{args.passes}" if args.passes else "")
    model = load(args.spec, backend=args.backend, dtype=args.dtype, ctx=args.ctx, passes=passes,
                 threads=args.threads)
    model._ensure_state()
    return model


def _serve(rank: int, conn: Connection, model: Any) -> None:
    while True:
        msg = conn.recv()
        kind = msg[0]
        if kind == "close":
            return
        if kind == "call":
            _, fn, args = msg
            value = fn(model, *args)
            conn.send(("reply", (value if rank == 0 else None, dict(model.stats))))
        elif kind == "generate":
            _, ids, n_new, temperature, top_k, top_p, seed, stop_at_eos = msg
            for token in model.generate(ids, n_new, temperature, top_k, top_p, seed, stop_at_eos):
                if rank == 0:
                    conn.send(("reply", ("token", token)))
            conn.send(("reply", ("done", dict(model.stats))))
        else:
            raise BackendError(f"tensor-parallel worker {rank}: unknown command {kind!r}")


def _n_past(model: Any) -> int:
    """A rank's sequence length (a module-level function: call() pickles it)."""
    return model.n_past


def _report(conn: Connection, e: BaseException) -> None:
    try:
        blob = pickle.dumps(e)
    except Exception:  # an exception that does not pickle travels as text only
        blob = None
    try:
        conn.send(("error", type(e).__name__, str(e), traceback.format_exc(), blob))
    except (BrokenPipeError, OSError):
        pass


def load(spec: str, backend: str, dtype: str | None, ctx: int | None, passes: str, threads: int | None,
         tp: int) -> TensorParallelModel:
    """`graphir.load(..., tp=N)` for N > 1 (api.load checks the rest first)."""
    check_tp(tp, backend, passes)
    return TensorParallelModel(LoadArgs(str(spec), backend, dtype, ctx, passes, threads), int(tp))
