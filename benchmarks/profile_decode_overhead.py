"""What a decode step pays around its kernels: numba dispatch, argument unboxing, parallel-region wake-ups.

    python benchmarks/profile_decode_overhead.py [MODEL] [--passes default,q16-activations] [--prompt 128]
        [--repeats 200] [--threads N]

For the cached decode Program, prints:
  * the step replayed as the Program runs it (`for step in steps: step()`), best and median ms, and the sum
    of the steps timed one by one (the per-step timer's own cost is the difference);
  * per op, microseconds a call inside the replay (after the step before it, with whatever that left in the
    caches) against the same step called 30 times in a row (hot): the difference is what a step pays for
    running cold, which a small kernel pays mostly in the Python and numba code around it;
  * per numba kernel the steps call (lowering_rules records them at bind time), microseconds a call through
    the dispatcher, through the compiled overload's entry point, and for a do-nothing kernel of the same
    argument types (serial and, for parallel kernels, with an empty prange over the threads): dispatch =
    dispatcher - entry point; unboxing + call ~ the do-nothing kernel's entry point; a wake-up ~ the empty
    parallel region less the serial do-nothing kernel.
Times are medians over --repeats calls in a row (hot caches: the kernels' own work is a lower bound).
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import numba
import numpy as np
from graphir.backends.cpu import precompile, threads
from graphir.backends.cpu.direct_call import first_call
from profile_decode import cpu_program  # beside this script


def decode_program(spec: str, passes: str, prompt: int):
    """(the cached decode Program, the kernels its steps call as lowering_rules recorded them at bind time)."""
    binds: list = []  # what each Program's bind recorded; the decode Program binds last
    prepare = precompile.prepare
    precompile.prepare = lambda rec, *rest: (binds.append(list(rec)), prepare(rec, *rest))[1]
    try:
        _, program = cpu_program(spec, passes, prompt)
    finally:
        precompile.prepare = prepare
    return program, [r for r in binds[-1] if r[0] == "kernel"]


def per_call_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


_NOOPS: dict[tuple[int, bool], object] = {}


def noop(arity: int, parallel: bool):
    """A jitted kernel of `arity` arguments and then `nth`, `scratch` that does nothing with them; parallel: each of
    nth threads stores one value into scratch (a body LLVM keeps, so the region is entered and joined)."""
    if (arity, parallel) not in _NOOPS:
        names = ", ".join(f"a{i}" for i in range(arity))
        body = "    for i in numba.prange(nth):\n        scratch[i] = i\n" if parallel else "    pass\n"
        scope: dict = {"numba": numba}
        exec(f"def f({names}, nth, scratch):\n{body}", scope)
        _NOOPS[arity, parallel] = numba.njit(parallel=parallel)(scope["f"])
    return _NOOPS[arity, parallel]


def replay_vs_hot(steps: list, ops: list[str], replays: int = 60, hot: int = 30) -> None:
    in_replay: list[list[int]] = [[] for _ in steps]
    for _ in range(replays):
        for i, s in enumerate(steps):
            t0 = time.perf_counter_ns()
            s()
            in_replay[i].append(time.perf_counter_ns() - t0)
    alone = [per_call_us(s, hot) for s in steps]
    by_op: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for i, op in enumerate(ops):
        row = by_op[op]
        row[0] += 1
        row[1] += statistics.median(in_replay[i]) / 1e3
        row[2] += alone[i]
    print(f"{'op':26s} {'calls':>5s} {'replay':>8s} {'hot':>8s}  us a call;  {'replay':>7s} {'hot':>7s}  ms a step")
    for op, (n, r, h) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
        print(f"{op:26s} {n:5d} {r / n:8.2f} {h / n:8.2f}             {r / 1e3:7.3f} {h / 1e3:7.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--passes", default="default,q16-activations")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    threads.set_threads(args.threads)
    program, kernels = decode_program(args.model, args.passes, args.prompt)
    threads.apply()
    nth = threads.numba.get_num_threads()
    steps = program._steps
    ops = collections.Counter(label.split()[2] for label in program._step_nodes)
    print(f"{args.model} {args.passes}: {len(steps)} steps, {nth} threads; by op: {dict(ops)}")

    whole, timed = [], []
    for _ in range(max(20, args.repeats // 5)):
        t0 = time.perf_counter()
        for s in steps:
            s()
        whole.append(time.perf_counter() - t0)
        total = 0.0
        for s in steps:
            t1 = time.perf_counter()
            s()
            total += time.perf_counter() - t1
        timed.append(total)
    print(f"step replayed: best {min(whole) * 1e3:.3f} median {statistics.median(whole) * 1e3:.3f} ms; "
          f"steps timed one by one: best {min(timed) * 1e3:.3f} median {statistics.median(timed) * 1e3:.3f} ms")

    replay_vs_hot(steps, [label.split()[2] for label in program._step_nodes])

    seen: dict[tuple, list] = {}
    for _, disp, kargs in kernels:
        key = (disp.py_func.__module__, disp.py_func.__name__, tuple(numba.typeof(a) for a in kargs))
        seen.setdefault(key, [disp, kargs, 0])[2] += 1
    print(f"{'kernel':36s} {'calls':>5s} {'disp':>7s} {'entry':>7s} {'noop':>7s} {'noop-ep':>7s} {'par-noop':>8s}  us")
    saved = 0.0
    scratch = np.zeros(nth, np.int64)
    for (mod, name, _), (disp, kargs, count) in seen.items():
        nop, par = noop(len(kargs), False), noop(len(kargs), True)
        nop_args = (*kargs, nth, scratch)
        us = [per_call_us(functools.partial(f, *a), args.repeats) for f, a in (
            (disp, kargs), (first_call(disp, *kargs), kargs), (nop, nop_args), (first_call(nop, *nop_args), nop_args),
            (first_call(par, *nop_args), nop_args))]
        saved += (us[0] - us[1]) * count
        print(f"{mod.split('.')[-1] + '.' + name:36s} {count:5d} " + " ".join(f"{u:7.2f}" for u in us))
    print(f"dispatcher - entry point, summed over the recorded calls: {saved / 1e3:.3f} ms a step")

if __name__ == "__main__":
    main()
