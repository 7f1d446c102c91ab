"""Device time of each step of a lowered gpu Program, each replayed alone.

A step (one Launch) is captured 20 times in a row into its own CUDA graph and the graph timed between
two CUDA events, so Python's launch cost is out while the kernel still pays its own launch-to-launch
gap, as it does inside the whole step's graph. A step that cannot be captured (a library call) is timed
once between events, its launch included. The sum over steps is not the captured step's time: there
the kernels overlap their neighbours' launches (programmatic dependent launch) and wait for each other.
`graphir bench` uses it for the Gated DeltaNet kernels' share of a decode step (issue 12);
benchmarks/profile_gpu_decode.py prints the whole table.
"""

from __future__ import annotations

from typing import Any

from .device import cupy, stream

# The kernels of a Gated DeltaNet layer's own ops: those that read and write its recurrent State (recurrent.cu:
# the conv step and the delta rule, the step kernels and the few-token ones), then delta_chunked.cu's chunked
# prefill and norm.cu's gated norm with z. Its projections are GEMVs like any layer's and are not counted.
DELTANET_STATE_KERNEL_PREFIXES = ("ssm_conv", "gated_delta_net")
DELTANET_KERNEL_PREFIXES = DELTANET_STATE_KERNEL_PREFIXES + ("gdn_", "rms_norm_mul_gate")


def is_deltanet_kernel(name: str) -> bool:
    return name.startswith(DELTANET_KERNEL_PREFIXES)


def step_times(program: Any, reps: int = 20) -> list[tuple[str, float]]:
    """(kernel name, device seconds a call) of each of the Program's steps, in order; the Program must be
    bound (called once)."""
    cp = cupy()
    s = stream()
    out: list[tuple[str, float]] = []
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    with s:
        for step in program._steps:
            step()  # loaded and warm
            name = getattr(step, "name", type(step).__name__)
            if not getattr(step, "capturable", False):
                start.record(s)
                step()
                stop.record(s)
                stop.synchronize()
                out.append((name, cp.cuda.get_elapsed_time(start, stop) / 1e3))
                continue
            s.begin_capture()
            for _ in range(reps):
                step()
            graph = s.end_capture()
            graph.launch(s)
            start.record(s)
            graph.launch(s)
            stop.record(s)
            stop.synchronize()
            out.append((name, cp.cuda.get_elapsed_time(start, stop) / 1e3 / reps))
    return out
