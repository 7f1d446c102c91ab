"""Which cores other processes keep busy, read from /proc/stat: the cpu backend's `auto` thread count
(backends/cpu/threads.py) follows it.

`auto` uses numba's whole pool while the machine is quiet, and one thread fewer for each
core that other processes keep busy. It reads /proc/stat (the busy time of the CPUs this
process may run on) at most every WINDOW_S, at the start of a Program call, and subtracts this
process's own CPU time and the CPUs' steal time; where /proc/stat cannot be read it keeps the whole pool.
A new count takes effect once windows covering CONFIRM_S in a row have all asked for it.

Why steal is left out and one window is not enough, measured on the 2-core KVM VM (2026-12-02, SmolLM2
decode, 0.25 s windows; GRAPHIR_DEBUG_THREADS=1 prints each window):

    quiet, real-time priority (chrt -f 10): others 0.00-0.17 cores (steal left out), 768 windows
    the same beside 3 plain-priority `yes`: one window of 0.31-0.48 cores a second, 0.00-0.07 between
    /proc/stat's steal (the host running other VMs): 0.25-0.48 cores in 8 of 10173 windows, 2 in a row
    `taskset -c 1 yes`, plain priority: 0.75-0.81 cores in its first whole window at 2 threads, 0.95-1.08 at 1

The second row is the likeliest way a real-time benchmark dropped to 1 thread with nothing else running
when it started (BENCHMARKS.md, runs a6 and d2; reproduced with the one-window rule): programs started
meanwhile get 5% of each CPU, spent at once; one such window dropped a thread, they took the freed core
(0.95-1.24 cores), and decode stayed at 1 thread (65 tok/s against 93-95 at 2). /proc/stat counts steal
as busy and this process's CPU time leaves it out (PARAVIRT_TIME_ACCOUNTING), so steal read as another
program, though fewer threads do not give it back: it is left out. Two windows in a row (CONFIRM_S) keep
the second row's bursts, a short-lived process or one noisy window from moving the count, and still drop
to 1 thread 0.48 s after a hog starts (returning 0.50 s after it ends, measured); one window of CONFIRM_S
or more (the first after import, or after an idle gap) decides alone.

The watch starts at `import graphir` (graphir/__init__.py imports this module first, without numba), so a
process's first Program call, a prompt's prefill, already has a window behind it, and that first window
decides alone when it asks for fewer threads: measured on the 2-core VM beside one `yes` (2026-12-04), the
window began at the backend's import, the prefill came before WINDOW_S and ran on 2 threads, the first
token 0.29-0.31 s against 0.22-0.24 with `--threads 1`; beside the load of other graphir runs 1.55 s
against 0.16. A quiet first window that a burst crosses costs at most the CONFIRM_S it takes to return.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable

from graphir import flags

WINDOW_S = 0.25  # how often auto looks at the machine: long enough for 100 Hz jiffies to mean something
BUSY_CORES = 0.25  # others' use above this many cores counts a core as taken (quiet: <= 0.17; a hog: >= 0.75)
CONFIRM_S = 0.5  # a new count needs windows this long in a row asking for it: two 0.25 s windows


def _read_proc_stat(cpus: frozenset[int]) -> tuple[int, int] | None:
    """(busy, steal) jiffies summed over `cpus` (busy counts steal, as /proc/stat's non-idle time does),
    or None where /proc/stat is unreadable."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    busy = steal = 0
    for line in lines[1:]:
        if not line.startswith(b"cpu"):
            break
        fields = line.split()
        if int(fields[0][3:]) in cpus:
            v = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
            busy += sum(v) - v[3] - v[4]
            steal += v[7]
    return busy, steal


class LoadWatch:
    """auto's decision: the pool, less one thread per core that other processes keep busy.

    `stat` returns (busy, steal) jiffies of our CPUs (None: unknown), `own_cpu` this process's
    CPU seconds, `clock` seconds; all three are parameters so tests can drive a machine's load.
    """

    def __init__(self, cap: int, cpus: int, stat: Callable[[], tuple[int, int] | None],
                 own_cpu: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic,
                 hz: int = 100):
        self.cap, self.cpus, self.stat, self.own_cpu, self.clock, self.hz = cap, cpus, stat, own_cpu, clock, hz
        self.threads = cap
        self.others = 0.0  # cores other processes used over the last window (steal left out)
        self._pending: tuple[int, float] | None = None  # (count to change to, start of the first window asking)
        self._first = True  # no window has ended yet: the first one, asking for fewer threads, decides alone
        self._t = clock()
        self._sample = (stat(), own_cpu())

    def current(self) -> int:
        t = self.clock()
        if t - self._t < WINDOW_S:
            return self.threads
        stat, own = self.stat(), self.own_cpu()
        (prev_stat, prev_own), self._sample = self._sample, (stat, own)
        start, self._t = self._t, t
        if stat is None or prev_stat is None:
            return self.threads
        busy_s = (stat[0] - prev_stat[0]) / self.hz
        steal_s = (stat[1] - prev_stat[1]) / self.hz
        self.others = max(0.0, busy_s - steal_s - (own - prev_own)) / (t - start)
        taken = 0 if self.others < BUSY_CORES else math.ceil(self.others - BUSY_CORES)
        wanted = max(1, min(self.cap, self.cpus - taken))
        if self._first and wanted < self.threads:
            self.threads, self._pending = wanted, None
        else:
            self._confirm(wanted, start, t)
        self._first = False
        if flags.enabled("GRAPHIR_DEBUG_THREADS"):
            print(f"graphir threads: window {t - start:.3f} s, busy {busy_s:.2f} s, steal {steal_s:.2f} s, "
                  f"own {own - prev_own:.3f} s -> others {self.others:.3f} cores, wants {wanted}, "
                  f"uses {self.threads}", file=sys.stderr)
        return self.threads

    def _confirm(self, wanted: int, start: float, end: float) -> None:
        """Change the count once the windows since the first that asked for a change this way (fewer or more)
        span CONFIRM_S, by the least change any of them asked for; a window asking for the current count, or
        for a change the other way, starts over."""
        if wanted == self.threads:
            self._pending = None
            return
        if self._pending is None or (self._pending[0] > self.threads) != (wanted > self.threads):
            self._pending = (wanted, start)
        else:
            least = min(self._pending[0], wanted, key=lambda n: abs(n - self.threads))
            self._pending = (least, self._pending[1])
        if end - self._pending[1] >= CONFIRM_S:
            self.threads, self._pending = self._pending[0], None


def default_watch() -> LoadWatch:
    has_affinity = hasattr(os, "sched_getaffinity")  # Linux; elsewhere /proc/stat is absent anyway
    cpus = frozenset(os.sched_getaffinity(0) if has_affinity else range(os.cpu_count() or 1))
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return LoadWatch(len(cpus), len(cpus), lambda: _read_proc_stat(cpus), hz=hz)  # threads.py caps it at numba's pool


WATCH = default_watch()  # sampled from `import graphir` on, so the first Program call has a window behind it
