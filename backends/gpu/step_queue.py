"""Decode steps queued ahead of the host, so the device never waits for Python between tokens.

A Program call is synchronous: Inputs in, replay, outputs out, wait. Between two decode steps the
device then idles for the host's share of a token (the Python loop, the input rows, the copy back):
21-141 us measured on an H200 host, 0.5-11 % of a step. A StepQueue keeps the next step queued
while the host reads the last one's id:

    q = StepQueue(program, state, feedback=("token", "tokens"))
    q.push(inputs_0)                       # the first step's token comes from the host
    q.push(inputs_1, feed_back=True)       # this step's token: the last step's sampled id, on the device
    ids = q.pop()["token"]                 # waits for step 0 only; step 1 is already queued behind it

Every pushed step reads its Inputs from its own pinned host buffer (DEPTH of them, used in turn), so
writing step i+1's rows never races the copy of step i's; with `feed_back`, a device-to-device copy
then puts the last step's output (the sampled id) into the Input it feeds, so the host need not know
it yet. Outputs and the error flag come back into the slot's own pinned buffers, read by pop() after
the slot's event. Nothing in the replayed work changes between steps: the launches are the Program's
own, captured once without the copies (`GpuProgram.launch_core`); positions, KV rows and sampling rows
still arrive as Input values, never as launch arguments.

What the caller owns: a step pushed ahead is a step run. With a KV cache that is free to take back
(its rows past the sequence's length are never read), but a recurrent State cannot be rolled back,
so api.Model only queues ahead where an unused step can do no harm (see Model._queue_ahead).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from graphir.errors import BackendError
from graphir.run_inputs import check_inputs

from .device import cupy, stream
from .program import D2H, H2D, GpuProgram, pinned

D2D = 3  # cudaMemcpyDeviceToDevice (the same value on HIP)
DEPTH = 2  # steps in flight: the one the host waits for and the one queued behind it


class _Slot:
    """One in-flight step's pinned Inputs, outputs and error flag, and the event that says they are done."""

    def __init__(self, program: GpuProgram):
        cp = cupy()
        self.host = pinned((program._input_bytes,), np.uint8)
        self.inputs = {name: self.host[o:o + a.nbytes].view(a.dtype).reshape(a.shape)
                       for name, o in program.input_offsets.items()
                       for a in [program.input_host[name]]}
        self.outputs = {name: pinned(v.shape, v.dtype) for name, v in program.outputs.items()}
        self.flag = pinned((2,), np.int32)
        self.event = cp.cuda.Event(block=False, disable_timing=True)


class StepQueue:
    """Steps of one Program on one set of State buffers, at most DEPTH in flight. `feedback`: (output,
    Input) of equal shape and dtype, for pushes with feed_back=True."""

    def __init__(self, program: GpuProgram, state: Mapping[str, Any], feedback: tuple[str, str] | None = None):
        with stream():
            program.bind(state)
        if program.host_state:
            raise BackendError("StepQueue: the State must be device arrays (numpy State is mirrored per call)")
        self.program, self.state = program, state
        self._bound = program._bound_state
        self.slots = [_Slot(program) for _ in range(DEPTH)]
        self.pushed = self.popped = 0
        self.feedback: tuple[Any, Any] | None = None
        if feedback is not None:
            out_name, in_name = feedback
            out, dst = program.outputs.get(out_name), program.input_buffers.get(in_name)
            if out is None or dst is None or out.shape != dst.shape or out.dtype != dst.dtype:
                raise BackendError(f"StepQueue: cannot feed output {out_name!r} back into Input {in_name!r} "
                                   f"(both must exist with one shape and dtype)")
            self.feedback = (out, dst)

    depth = DEPTH

    @property
    def in_flight(self) -> int:
        return self.pushed - self.popped

    def push(self, inputs: Mapping[str, np.ndarray], feed_back: bool = False) -> None:
        """Queue one step behind those in flight. With `feed_back`, the fed-back Input's value given here is
        replaced on the device by the last step's output."""
        if self.in_flight >= DEPTH:
            raise BackendError(f"StepQueue: {DEPTH} steps in flight already; pop() one first")
        if self.program._bound_state != self._bound:
            raise BackendError("StepQueue: the Program was bound to other State buffers since the queue was made")
        if feed_back and (self.feedback is None or self.pushed == 0):
            raise BackendError("StepQueue: feed_back needs a feedback pair and a step before it")
        feeds = check_inputs(self.program.graph, inputs)
        slot = self.slots[self.pushed % DEPTH]
        for name, arr in feeds.items():
            slot.inputs[name][...] = arr
        p, rt = self.program, cupy().cuda.runtime
        with stream() as s:
            rt.memcpyAsync(p._input_dev.data.ptr, slot.host.ctypes.data, p._input_bytes, H2D, s.ptr)
            if feed_back:
                out, dst = self.feedback
                rt.memcpyAsync(dst.data.ptr, out.data.ptr, out.nbytes, D2D, s.ptr)
            p.launch_core(s)
            for name, v in p.outputs.items():
                rt.memcpyAsync(slot.outputs[name].ctypes.data, v.data.ptr, v.nbytes, D2H, s.ptr)
            flag = p.lw.errflag
            rt.memcpyAsync(slot.flag.ctypes.data, flag.data.ptr, flag.nbytes, D2H, s.ptr)
            slot.event.record(s)
        self.pushed += 1

    def pop(self) -> dict[str, np.ndarray]:
        """The oldest step's outputs, once it is done; a kernel's error report raises here."""
        if self.in_flight == 0:
            raise BackendError("StepQueue: no step in flight")
        slot = self.slots[self.popped % DEPTH]
        slot.event.synchronize()
        self.popped += 1
        self.program.raise_if_flagged(slot.flag)
        return {name: h.copy() for name, h in slot.outputs.items()}

    def drain(self) -> None:
        """Wait for every step in flight, dropping their outputs and error reports."""
        while self.in_flight:
            slot = self.slots[self.popped % DEPTH]
            slot.event.synchronize()
            self.popped += 1
