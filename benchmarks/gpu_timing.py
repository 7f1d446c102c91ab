"""Timing for the GPU kernel benchmarks: fixed launches replayed from a captured CUDA graph.

Replaying removes the ~8 us Python launch cost, so the time is the kernels' own. The first
timings after the GPU sat idle run at low clocks: every measurement warms up first.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def replay_seconds(run: Callable[[], None], iters: int) -> tuple[float, str]:
    """(seconds per call of `run`, "graph" or "loop"): best of 3 batches of `iters` replays of `run`
    captured into a CUDA graph, or of Python calls where capture fails."""
    import cupy as cp

    # The timing stream does not wait for the legacy default stream, where callers fill inputs and outputs
    # (a fill still running there once made a checked GEMV row read as wrong): everything before goes first.
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(3):
            run()  # warm up: kernel loading, clocks
        runner, how = run, "loop"
        try:
            stream.begin_capture()
            run()
            graph = stream.end_capture()
            runner, how = (lambda: graph.launch(stream)), "graph"
        except Exception as e:  # capture unavailable: time the Python launches
            print(f"  (graph capture failed: {e}; timing a Python loop)")
        for _ in range(5):
            runner()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        best = math.inf
        for _ in range(3):
            start.record(stream)
            for _ in range(iters):
                runner()
            stop.record(stream)
            stop.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, stop) / 1e3 / iters)
    return best, how
