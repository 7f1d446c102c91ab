"""On a cold numba cache, a helper process compiles part of a model's kernels while this one compiles
the rest: on 2 cores SmolLM2's first run after an install reaches its first token in 6.6-9.7 s, not 11.5-17.

numba compiles under one process-wide lock, so threads cannot share the work; processes can, and
numba's on-disk cache is where they meet. When a CPU Program binds its steps, lowering_rules records
the kernels they will call, in step order: matmul kernels ("matmul:q4_1:tile", "gemv:q8"), the integer-x
GEMVs of q8- / q16-activations ("intx:gemv_q16x") and numba kernels with the signature of their bound
arguments ("kernel:<module>:<name>:<i>"). The one-token products a prefill's weights get in decode are
the integer-x GEMV where the Program's pipeline runs q8- or q16-activations (the cpu pipeline), else the
repacked f32 GEMV ("gemv:q4").

On an empty cache (an install's first run) the backend's import starts the helper, `python -m
graphir.backends.cpu.precompile`, so its interpreter and numba's start-up overlap this process's model
load. While a Program binds, an integer-x GEMV's quantizer goes to it at once ("part:gemv_q16x", a
callee numba then loads from the cache when it compiles the GEMV). If two or more kernels have no cache
entry, `prepare` sends it the rest on stdin: the parts, then the jobs in reverse order (then what decode
steps call next: the one-token products of the same weights, the kernels again on one-row views, which
numba types as contiguous), and compiles them itself in step order, so the two meet in the middle. The
helper prints "running JOB" / "done JOB"; this process reads those lines itself when it looks (a reader
thread got no time while it compiled). A job the helper is running (or a part of it) is left for last
(then loaded from the cache); a job still queued there this process claims on the helper's stdin and
compiles (the helper skips it); a done one it loads.

The helper runs at this process's priority until this process has its first call's kernels, then at the
lowest (the parent's parallel kernels must never wait for the core it holds; at nice 19 from the start it
got almost no CPU beside any other busy program), and is killed at exit: numba writes a cache index last,
so a killed helper leaves nothing half-written to load. GRAPHIR_NO_PRECOMPILE=1 turns it off; on one CPU,
or off POSIX, it never starts.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import numba
import numpy as np

from graphir import flags

_jobs: dict[str, str] = {}  # job -> "queued", "running", "done" or "gone" (the helper ended first)
_proc: subprocess.Popen | None = None
_given = False  # prepare() has run: the helper has its jobs, or was stopped, or never started
_files: list[str] = []  # the signatures' pickle, removed when the helper is stopped
_buf = b""  # a progress line the helper has not finished writing


# the passes that give decode products integer x, and the module whose GEMV then runs them
INT_X_PASSES = {"q8-activations": "gemv_q8x", "q16-activations": "gemv_q16x"}


def int_x_products(pipeline: str | None) -> tuple[str, frozenset[str], int] | None:
    """(kernel module, weight dtypes, max_rows) of the first pass of `pipeline` that rewrites products to
    integer x (a later one finds none left to match), or None: what a Program's decode sibling will call."""
    from graphir.passes import PASSES, parse_pipeline

    for name, opts in parse_pipeline(pipeline or ""):
        if name in INT_X_PASSES:
            rewrite = PASSES[name]
            return INT_X_PASSES[name], frozenset(rewrite.impl.FORMATS), opts.get("max_rows",
                                                                               rewrite.options["max_rows"])
    return None


def jobs_for(uses: Iterable[tuple[str, int | None]], int_x: tuple[str, frozenset[str], int] | None = None
             ) -> list[str]:
    """The kernel jobs, each once and in the order given, for weight uses (dtype, rows of x), rows
    None for get_rows: the choices lowering_rules._mul_mat and matmul.py make for those uses, or the
    integer-x GEMV for the products `int_x` (int_x_products) rewrites."""
    from .gemv_repacked import MAX_TOKENS, kind_of
    from .matmul import SUPPORTED, mode_for

    jobs: list[str] = []
    for dtype, rows in uses:
        if int_x and rows is not None and rows <= int_x[2] and dtype in int_x[1]:
            job = f"intx:{int_x[0]}"
        elif dtype not in SUPPORTED:
            continue
        else:
            kind = kind_of(dtype) if rows is not None and rows <= MAX_TOKENS else None
            job = f"gemv:{kind}" if kind else f"matmul:{dtype}:{'rows' if rows is None else mode_for(rows)}"
        if job not in jobs:
            jobs.append(job)
    return jobs


class _Jobs:
    """Jobs by name: "matmul:<dtype>:<mode>", "gemv:<kind>", or "kernel:<module>:<name>:<i>" for a
    numba dispatcher and signature (the i-th in `sigs`, which a helper reads from a pickle file)."""

    def __init__(self) -> None:
        self.sigs: list[tuple[str, str, tuple]] = []
        self.index: dict[tuple, str] = {}

    def kernel(self, dispatcher: Any, sig: tuple) -> str:
        f = dispatcher.py_func
        key = (f.__module__, f.__name__, sig)
        if key not in self.index:
            self.index[key] = f"kernel:{f.__module__}:{f.__name__}:{len(self.sigs)}"
            self.sigs.append(key)
        return self.index[key]


def one_row_variant(sig: tuple) -> tuple:
    """`sig` with its strided ('A') arrays C-contiguous: the same kernel called on one row, where the
    views a prefill passes (q, k of a fused QKV) are contiguous; decode then needs this variant too."""
    return tuple(t.copy(layout="C") if isinstance(t, numba.types.Array) and t.layout == "A" else t for t in sig)


def _dispatcher(job: str, sigs: list | None = None):
    """(dispatcher, signature or None) for a job name."""
    kind, *args = job.split(":")
    if kind == "matmul":
        from .matmul import _KERNELS

        return _KERNELS[tuple(args)], None
    if kind == "gemv":
        from .gemv_repacked import _KERNELS as GEMV

        return GEMV[args[0]], None
    if kind == "intx":
        return _int_x_kernel(args[0]), None
    module, name, i = args
    return getattr(importlib.import_module(module), name), sigs[int(i)][2]


def _int_x_kernel(module: str) -> Any:
    """The GEMV dispatcher that `module`'s prepare() binds (gemv_q8x, gemv_q16x: one for every weight format)."""
    kernels = importlib.import_module(f"{__package__}.{module}")
    return kernels.KERNELS["avx2" if kernels.AVX2 else "portable"]


def _compile_int_x(module: str) -> None:
    """Compile that GEMV (or load it from numba's cache) for the argument types every one of its calls has:
    one call on a 2 x 256 q8_0 weight of zeros (C arrays throughout; q4 weights' arrays have the same types)."""
    kernels = importlib.import_module(f"{__package__}.{module}")
    w = np.zeros((2, 8 * 34), np.uint8)
    kernels.prepare(w, "q8_0", np.zeros((1, 256), np.float32), np.zeros((1, 2), np.float32))()


def _has_index(dispatcher: Any) -> bool:
    """Whether numba's cache has an index for this kernel (a warm cache: nothing to share)."""
    index = getattr(getattr(getattr(dispatcher, "_cache", None), "_cache_file", None), "_index_path", None)
    return index is None or os.path.exists(index)


def _cached(job: str) -> bool:
    """The same for a "matmul:...", "gemv:..." or "intx:..." job."""
    return _has_index(_dispatcher(job)[0])


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare(recorded: list[tuple], pipeline: str | None = None) -> None:
    """Compile the kernels a just-bound Program's steps call (lowering_rules.RECORD, in step order),
    sharing them with a helper process when numba's cache is cold; otherwise leave them to compile
    (or load from the cache) at their first call, as numba does. `pipeline`: the passes the Program's
    graph came from, which say what its weights' one-token products call in decode."""
    global _given
    if _given or not _may_start():
        return
    _given = True  # the first Program's kernels decide; later Programs compile theirs at their first call
    names = _Jobs()
    cold, later = _cold_jobs(recorded, pipeline, names)
    if len(cold) < 2:  # nothing to share: the first cold kernel is this process's own
        if _proc is not None:
            _stop(_proc)
        return
    parts = {job: _parts(job) for job in cold}
    # the helper first compiles the parts of this process's jobs (unless noted() sent them), then works from the last
    # step back, while this process goes from the first step on; they meet midway
    theirs = [p for job in cold[1:] for p in parts[job] if p not in _jobs] + cold[:0:-1] + later
    if not _send_jobs(names.sigs, theirs):  # no helper: this process compiles everything, as without one
        return
    # jobs the helper was compiling (or a part of) when this process came to them: loaded from the cache last
    busy = []
    for job in cold:
        if state(job) == "running" or any(state(p) == "running" for p in parts[job]):
            busy.append(job)
        else:  # queued there: compile it here (its parts with it), telling the helper to skip it; or done: load it
            for j in (*parts[job], job):
                _claim(j)
            _compile(job, names.sigs)
    for job in busy:
        for j in (*parts[job], job):
            wait(j)
        _compile(job, names.sigs)
    _lowest_priority(_proc.pid)  # what it compiles now is for later steps, while this process's kernels run


def _cold_jobs(recorded: list[tuple], pipeline: str | None, names: _Jobs) -> tuple[list[str], list[str]]:
    """(the jobs of kernels with no cache entry yet, in step order; what decode steps call next: the kernels on
    one-row views (small: first), the one-token products)."""
    cold: list[str] = []
    rows1: list[str] = []
    later: list[str] = []
    int_x = int_x_products(pipeline)
    for use in recorded:
        if use[0] == "intx":
            new = [f"intx:{use[1]}"] if not _cached(f"intx:{use[1]}") else []
        elif use[0] == "mm":
            new = [j for j in jobs_for([use[1:]]) if not _cached(j)]
            if use[2] is not None and use[2] > 1:
                later += [j for j in jobs_for([(use[1], 1)], int_x) if j not in later and not _cached(j)]
        elif _has_index(use[1]):  # a warm start skips the signatures (typeof over the arguments)
            new = []
        else:
            sig = tuple(numba.typeof(a) for a in use[2])  # what the dispatcher itself computes at the call
            new = [names.kernel(use[1], sig)]
            if one_row_variant(sig) != sig:
                rows1.append(names.kernel(use[1], one_row_variant(sig)))
        cold += [j for j in new if j not in cold]
    return cold, [j for j in dict.fromkeys(rows1 + later) if j not in cold]


def _parts(job: str) -> list[str]:
    """Callees of `job`'s kernel that the helper may compile as jobs of their own before this process reaches the job:
    numba then loads the callee from its cache while it compiles the kernel (the callee's module linked in as if
    compiled in this process: the same machine code). The 16-bit-x GEMV's quantizer ("part:gemv_q16x"): 1.5-1.8 s
    of its 4.4-5.9 s on 2 cores, the longest job this process has before the first token."""
    if job != "intx:gemv_q16x":
        return []
    from . import gemv_q16x

    return ["part:gemv_q16x"] if gemv_q16x.AVX2 and not _has_index(gemv_q16x.quantize_x) else []


def _compile_part(module: str) -> None:
    """Compile `module`'s quantizer for the arrays its prepare() binds (x, its codes, scales and sums: 2-D C)."""
    kernels = importlib.import_module(f"{__package__}.{module}")
    f32 = numba.types.Array(numba.float32, 2, "C")
    kernels.quantize_x.compile((f32, f32.copy(dtype=numba.int16), f32, f32))


def noted(use: tuple) -> None:
    """A kernel use lowering_rules has just recorded while a Program binds: an integer-x GEMV's part goes to a started
    helper at once, ~0.5 s before the binding (its weights repacked) ends and prepare() sends the rest."""
    if _proc is None or _given or use[0] != "intx":
        return
    for part in _parts(f"intx:{use[1]}"):
        if part not in _jobs and _send("", [part]):
            _jobs[part] = "queued"


def start() -> None:
    """Start the helper now, before its jobs are known (the backend's import on a cold cache, the first run after
    an install): its interpreter, imports and numba's start-up (~0.6 s on 2 cores) then overlap this process's
    model load instead of delaying the helper's first kernel. prepare() sends the jobs, or stops it."""
    global _proc
    if _proc is not None or _given or not _may_start():
        return
    # the helper imports this process's graphir: -P keeps the working directory off its path (python -m puts it
    # first, so a checkout there would give the helper other sources, whose kernels land under other cache keys)
    import graphir

    root = os.path.dirname(os.path.dirname(os.path.abspath(graphir.__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    try:
        env = {**os.environ, "PYTHONWARNINGS": "ignore", _HELPER_ENV: "1", "PYTHONPATH": path}
        _proc = subprocess.Popen([sys.executable, "-P", "-m", __name__], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    except OSError:  # no helper: prepare() tries again, and without one this process compiles everything
        return
    os.set_blocking(_proc.stdout.fileno(), False)
    atexit.register(_stop, _proc)


_HELPER_ENV = "GRAPHIR_PRECOMPILE_HELPER"  # set in the helper, whose import of the backend must not start another


def _may_start() -> bool:
    # POSIX only: the progress pipe is read with select and non-blocking reads
    return os.name == "posix" and bool(sys.executable) and _cpus() >= 2 and not flags.enabled("GRAPHIR_NO_PRECOMPILE") \
        and _HELPER_ENV not in os.environ


def _send_jobs(sigs: list, jobs: list[str]) -> bool:
    """Give the helper (started now unless start() did) the rest of its jobs, their signatures in a pickle file."""
    start()
    if _proc is None:
        return False
    try:
        with tempfile.NamedTemporaryFile("wb", suffix=".pkl", delete=False) as f:
            pickle.dump(sigs, f)
    except (OSError, pickle.PicklingError):
        _stop(_proc)
        return False
    _files.append(f.name)
    if not _send(f.name, jobs, last=True):
        return False
    _jobs.update(dict.fromkeys(jobs, "queued"))
    return True


def _send(sigs_file: str, jobs: list[str], last: bool = False) -> bool:
    """One line to the helper: "+SIGS_FILE<tab>JOB JOB ..." queues jobs, "end" follows the last (a line without "+"
    claims a job: _claim)."""
    try:
        _proc.stdin.write(f"+{sigs_file}\t{' '.join(jobs)}\n{'end' + chr(10) if last else ''}".encode())
        _proc.stdin.flush()
    except OSError:  # the helper has ended
        return False
    return True


def _lowest_priority(pid: int) -> None:
    """nice 19 for the helper: this process's parallel kernels must never wait for the core it holds. Until then it
    runs at this process's priority: at nice 19 beside any other busy program on 2 cores it got almost no CPU, and
    this process waited for its kernels (2x their compile time at load ~1)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 19)
    except (OSError, AttributeError):
        pass


def _claim(job: str) -> None:
    """Tell the helper this process compiles `job` (it skips the job if it has not started it yet)."""
    if _jobs.get(job) == "queued":
        try:
            _proc.stdin.write(f"{job}\n".encode())
            _proc.stdin.flush()
        except OSError:  # the helper has ended
            pass


def _poll(timeout: float = 0.0) -> None:
    """Read the helper's progress lines that have arrived (waiting up to `timeout` s for the first).
    Read here, on the calling thread: a reader thread got no time while this thread compiled."""
    global _buf
    if _proc is None or _proc.stdout.closed:
        return
    fd = _proc.stdout.fileno()
    if timeout and not select.select([fd], [], [], timeout)[0]:
        return
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:  # the helper ended: whatever it had not finished is ours to compile
            _proc.stdout.close()
            for job, st in _jobs.items():
                if st != "done":
                    _jobs[job] = "gone"
            break
        _buf += chunk
    *lines, _buf = _buf.split(b"\n")
    for line in lines:
        st, _, job = line.decode().strip().partition(" ")
        if job in _jobs:
            _jobs[job] = st


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    while _files:
        try:
            os.unlink(_files.pop())
        except OSError:
            pass


WAIT_S = 600  # a helper stuck this long on one kernel is ignored: this process compiles it itself


def wait(job: str) -> None:
    """Return when the helper is not compiling `job` (done, gone, queued there, or never given it)."""
    deadline = time.monotonic() + WAIT_S
    while state(job) == "running" and time.monotonic() < deadline:
        _poll(timeout=0.5)


def state(job: str) -> str | None:
    """The helper's state of `job` ("queued", "running", "done", "gone"), or None when never given it."""
    _poll()
    return _jobs.get(job)


def _compile(job: str, sigs: list | None = None) -> None:
    kind, *args = job.split(":")
    if kind == "matmul":
        from .matmul import _compile as compile_matmul

        compile_matmul(*args)
    elif kind == "gemv":
        from .gemv_repacked import _compile as compile_gemv

        compile_gemv(*args)
    elif kind == "intx":
        _compile_int_x(args[0])
    elif kind == "part":
        _compile_part(args[0])
    elif kind == "kernel":
        dispatcher, sig = _dispatcher(job, sigs)
        dispatcher.compile(sig)
    else:
        raise ValueError(f"precompile: unknown job {job!r} (matmul:<dtype>:<mode>, gemv:<q4|q8>, "
                         f"intx:<module>, part:<module> or kernel:...)")


def _helper() -> None:
    """The helper process: compile the jobs that come on stdin in order, skipping those the parent has claimed (lines
    of _send and _claim); end after the last list ("end") or when stdin closes. It runs at the parent's priority
    until the parent lowers it (_lowest_priority)."""
    if hasattr(os, "sched_setscheduler"):
        try:  # a parent at real-time priority (benchmarks run under chrt) would make this one real-time too
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass
    from numba.core.registry import cpu_target

    cpu_target.target_context.refresh()  # numba's start-up for a compile (~0.2 s), while the parent still loads
    cpu_target.typing_context.refresh()
    queue: list[tuple[str, list]] = []  # (job, the signatures of its list)
    claimed: set[str] = set()
    lines = _Lines(sys.stdin.fileno())
    ended = False
    while True:
        for line in lines.read(block=not queue and not ended):
            if line.startswith("+"):
                sigs_file, _, names = line[1:].partition("\t")
                sigs = _load_sigs(sigs_file) if sigs_file else []
                queue += [(job, sigs) for job in names.split()]
            elif line == "end":
                ended = True
            else:
                claimed.add(line)
        if not queue and (lines.closed or ended):
            return
        if not queue:
            continue
        job, sigs = queue.pop(0)
        if job in claimed:
            continue
        print("running", job, flush=True)
        _compile(job, sigs)
        print("done", job, flush=True)


def _load_sigs(path: str) -> list:
    with open(path, "rb") as f:
        return pickle.load(f)


class _Lines:
    """Whole lines from a file descriptor: read(block=True) waits for at least one (or the end of the input)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pending, self.closed = fd, b"", False
        os.set_blocking(fd, False)

    def read(self, block: bool) -> list[str]:
        while not self.closed:
            if block and b"\n" not in self.pending:
                select.select([self.fd], [], [])
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                chunk = None
            if chunk == b"":
                self.closed = True
            elif chunk:
                self.pending += chunk
            if not block or b"\n" in self.pending:
                break
        *lines, self.pending = self.pending.split(b"\n")
        return [line.decode() for line in lines]


if __name__ == "__main__":
    _helper()
