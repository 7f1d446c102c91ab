"""Lowering a graph to a GPU Program: fixed kernel launches over one device arena.

lower():  verify -> fold Param-only subgraphs -> plan the arena by liveness (views that are not
contiguous get slots of their own) -> bind every node to its launches, all arguments fixed.

A call writes the Inputs into one pinned host buffer; then, in stream order: one host-to-device
copy of that buffer into the persistent Input buffers, the error flag cleared, the launches, and
the flag copied back into pinned host memory; then each output is copied into its own pinned host
buffer (or copied on the device with `device=True`) and the host waits once. Nothing is allocated,
compiled or looked up per call, and no launch argument depends on an Input's value: the same
launches replay at every position.

Capture: a Program whose steps are all the project's own kernels (no cuBLAS step; decode and
verify shapes) is captured into a CUDA graph on its second call, after a first call has loaded
every kernel, and replayed from then on: one graph launch, Input copy and flag read-back included,
instead of a Python launch per kernel (8.4 us each from Python, 0.9 us replayed, measured on an
H200). New State buffers (a rebind) drop the graph; the next call captures again.
GRAPHIR_NO_CAPTURE=1 turns capture off.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from graphir import flags
from graphir.dtypes import numpy_dtype
from graphir.errors import BackendError
from graphir.ir import Graph, Node
from graphir.lowering import ParamRef, fold_params
from graphir.memplan import MemPlan, plan_memory, result_types
from graphir.ops import OPS
from graphir.run_inputs import check_inputs, check_state
from graphir.verify import verify
from graphir.weights import Weights

from . import pdl
from .device import cupy, stream
from .launch import GpuParam, Launch, Lowering, dev
from .layout import view_layout, views_to_copy
from .lowering import lower_node, merge_kv_writes
from .matmul import bf16_stored_products, bf16_x_readers
from .recurrent import inplace_state

INPUT_ALIGN = 256  # bytes between Input buffers inside the one staging area
H2D, D2H = 1, 2  # cudaMemcpyKind (the same values on HIP)


def pinned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A numpy array in page-locked host memory: the device copies to and from it asynchronously,
    and a captured graph may copy from it (pageable memory it may not)."""
    dt = np.dtype(dtype)
    nbytes = max(int(np.prod(shape)) * dt.itemsize, 1)
    mem = cupy().cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, np.uint8, nbytes)[:int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)


class GpuProgram:
    def __init__(self, graph: Graph, weights: Weights | None):
        t0 = time.perf_counter()
        cp = cupy()
        self.graph = verify(graph)
        self.weights = weights if weights is not None else Weights()
        self.order = graph.nodes()
        self.ids = graph.ids()
        self.folded = fold_params(graph, self.weights)
        self.copies = views_to_copy(graph)
        self.bf16_readers = bf16_x_readers(graph, self.copies)
        self.bf16_products = bf16_stored_products(graph)
        self.plan: MemPlan = plan_memory(graph, self.copies)
        self.arena = cp.empty(max(self.plan.arena_bytes, 1), np.uint8)
        self._init_inputs()
        self._state_names = [n.name for n in self.graph.states]
        self._flag_host = pinned((2,), np.int32)  # the error flag, read back once per call
        self._outputs_host: dict[str, np.ndarray] = {}
        self.lw = Lowering(self.weights)  # replaced by each _bind: its scratch belongs to one binding
        self._bound_state: tuple[int, ...] | None = None
        self._checked_state: tuple[int, ...] | None = None
        self._host_state = False  # numpy State buffers: mirrored on the device every call
        self._mirrors: dict[str, Any] = {}  # device copies of numpy State buffers
        self._steps: list[Any] = []
        self._capturable = False
        self._outputs: dict[str, Any] = {}
        self._code_node: dict[int, Node] = {}  # error code -> node, for the current binding
        self._graph_exec: Any = None  # the captured CUDA graph, once there is one
        self._core_exec: Any = None  # the launches alone, captured for queued steps (step_queue.py)
        self._calls_since_bind = 0
        self._inplace, self._skip_assign = self._plan_inplace_states()
        if not self.graph.states:  # nothing to wait for: bind now, so a bad graph fails at lowering
            self._bind({})
            self._bound_state = ()
        self.lower_s = time.perf_counter() - t0

    def _init_inputs(self) -> None:
        """All Inputs live in one device buffer, filled from one pinned host buffer per call."""
        cp = cupy()
        self.input_offsets = offsets = {}
        at = 0
        for n in self.graph.inputs:
            offsets[n.name] = at
            at += -(-max(numpy_dtype(n.dtype).itemsize * n.numel, 1) // INPUT_ALIGN) * INPUT_ALIGN
        self._input_bytes = max(at, INPUT_ALIGN)
        self._input_dev = cp.empty(self._input_bytes, np.uint8)
        host = self._input_host_bytes = pinned((self._input_bytes,), np.uint8)
        self.input_host: dict[str, np.ndarray] = {}
        self.input_buffers: dict[str, Any] = {}
        for n in self.graph.inputs:
            npd = numpy_dtype(n.dtype)
            nbytes = npd.itemsize * n.numel
            o = offsets[n.name]
            self.input_host[n.name] = host[o:o + nbytes].view(npd).reshape(n.shape)
            self.input_buffers[n.name] = self._input_dev[o:o + nbytes].view(npd).reshape(n.shape)

    def _plan_inplace_states(self) -> tuple[dict[int, Node], set[int]]:
        """Recurrent steps that write their new state straight into the State they read: where the
        graph's only use of the new state (result 1) is `assign(S, it)` and nothing else reads S,
        the kernel gets S as that output and the assign launches nothing (one copy and one more pass
        over the state saved per layer). Returns {id(node): S} and the ids of the assigns skipped."""
        users = self.graph.users()
        outputs = {id(o) for o in self.graph.outputs.values()}
        inplace: dict[int, Node] = {}
        skip: set[int] = set()
        for n in self.order:
            j = inplace_state(n)
            if j is None or n.src[j].op != "state":
                continue
            st = n.src[j]
            items = [u for u in users[id(n)] if u.op == "item" and u.params["index"] == 1]
            if len(items) != 1 or id(items[0]) in outputs:
                continue
            readers = users[id(items[0])]
            a = readers[0] if len(readers) == 1 else None
            if a is None or a.op != "assign" or a.src[0] is not st or users[id(a)]:
                continue
            if all(u is n or u is a for u in users[id(st)]):
                inplace[id(n)] = st
                skip.add(id(a))
        return inplace, skip

    # ---------------------------------------------------------------- binding
    def _slot_array(self, n: Node, k: int) -> Any:
        slot = self.plan.slots[(id(n), k)]
        shape, dt = result_types(n)[k]
        npd = numpy_dtype(dt)
        count = int(np.prod(shape))
        return self.arena[slot.offset:slot.offset + count * npd.itemsize].view(npd).reshape(shape)

    def _leaf(self, n: Node, state: Mapping[str, Any]) -> Any:
        cp = cupy()
        if n.op == "input":
            return self.input_buffers[n.name]
        if n.op == "state":
            return state[n.name]
        if n.op == "param":
            return GpuParam(ParamRef(n, self.weights))
        return cp.asarray(np.asarray(n.params["value"], numpy_dtype(n.dtype)).reshape(n.shape))  # const

    def _bind(self, state: Mapping[str, Any]) -> None:
        cp = cupy()
        if self._graph_exec is not None and flags.enabled("GRAPHIR_DEBUG_CACHE"):
            print(f"graphir gpu: Program {self.graph.meta.get('phase', '')} rebinds to new State buffers; its "
                  f"captured graph is dropped and captured again on the second call", file=sys.stderr)
        self.lw = Lowering(self.weights)  # a rebind must not keep the last binding's scratch alive
        self.lw.bf16_readers = self.bf16_readers
        self.lw.bf16_products = self.bf16_products
        self._code_node = {}
        env: dict[int, Any] = {}
        node_steps: list[tuple[Node, list]] = []
        for i, n in enumerate(self.order):
            d = OPS[n.op]
            if n.is_leaf:
                env[id(n)] = self._leaf(n, state)
            elif id(n) in self.folded:
                f = self.folded[id(n)]
                env[id(n)] = GpuParam(f) if isinstance(f, ParamRef) else cp.asarray(f)
            elif n.op == "item":
                env[id(n)] = env[id(n.src[0])][n.params["index"]]
            elif id(n) in self._skip_assign:  # its value was written in place (_plan_inplace_states)
                env[id(n)] = env[id(n.src[0])]
            elif d.view and id(n) not in self.copies:  # a contiguous alias at an element offset
                src = dev(env[id(n.src[0])])
                _, _, offset = view_layout(n)
                env[id(n)] = src.reshape(-1)[offset:offset + n.numel].reshape(n.shape)
            else:
                ins = [env[id(s)] for s in n.src]
                outs = None if d.writes else [self._slot_array(n, k) for k in range(len(result_types(n)))]
                if id(n) in self._inplace:
                    outs[1] = env[id(self._inplace[id(n)])]
                self.lw.code = i + 1
                self._code_node[i + 1] = n
                node_steps.append((n, lower_node(self.lw, n, ins, outs)))
                env[id(n)] = ins[0] if d.writes else (outs if d.multi else outs[0])
        self._steps = steps = merge_kv_writes(node_steps)
        self._capturable = all(getattr(step, "capturable", False) for step in steps)
        self._outputs = {name: dev(env[id(n)]) for name, n in self.graph.outputs.items()}
        self._outputs_host = {name: pinned(v.shape, v.dtype) for name, v in self._outputs.items()}
        for name, v in self._outputs.items():
            if not v.flags.c_contiguous:  # every output is an arena slot or a State: contiguous by plan
                raise BackendError(f"gpu backend: output {name!r} is not contiguous in device memory")
        self._graph_exec = self._core_exec = None  # captured against the old buffers: capture again
        self._calls_since_bind = 0

    @property
    def capturable(self) -> bool:
        """Every step is one of the project's kernels (cuBLAS cannot run inside a capture)."""
        return self._capturable

    @property
    def captured(self) -> bool:
        """Calls, or queued steps (step_queue.py), replay a captured CUDA graph."""
        return self._graph_exec is not None or self._core_exec is not None

    def replay_once(self, s: Any) -> None:
        """One replay of the captured launches on stream s, nothing copied in or out: for timing a step's
        device work alone (bench, profiles). The queued steps' graph when there is one, else the calls'."""
        graph = self._core_exec if self._core_exec is not None else self._graph_exec
        if graph is None:
            raise BackendError("replay_once: this Program has not been captured (it captures on its second call)")
        graph.launch(s)

    def _capture(self, copies: bool = True) -> Any:
        """A CUDA graph of one call's work (`copies=False`: the flag cleared and the launches only)."""
        if flags.enabled("GRAPHIR_DEBUG_CACHE"):
            print(f"graphir gpu: capturing {len(self._steps)} launches of Program "
                  f"{self.graph.meta.get('phase', '')} into a CUDA graph", file=sys.stderr)
        s = stream()
        s.begin_capture()
        try:
            self._run_steps(s, overlap=pdl.enabled(), copies=copies)
        finally:
            graph = s.end_capture()
        return graph

    def _may_capture(self) -> bool:
        """From the second call on: the first loaded every kernel, and a capture needs them loaded."""
        return self._calls_since_bind >= 2 and self.capturable and not flags.enabled("GRAPHIR_NO_CAPTURE")

    def launch_core(self, s: Any) -> None:
        """The flag cleared and the launches, without the Input and flag copies (step_queue.py makes its
        own), from a captured graph of their own from the second call on."""
        self._calls_since_bind += 1
        if self._core_exec is None and self._may_capture():
            self._core_exec = self._capture(copies=False)
        if self._core_exec is not None:
            self._core_exec.launch(s)
        else:
            self._run_steps(s, copies=False)

    def _run_steps(self, s: Any, overlap: bool = False, copies: bool = True) -> None:
        """Inputs in, flag cleared, the launches, flag out: everything a call does between writing the
        pinned Inputs and reading the pinned outputs, and exactly what a capture records. `overlap`:
        a kernel that follows another kernel is launched programmatically dependent on it (pdl.py).
        `copies=False` leaves out the Input copy and the flag read-back."""
        rt = cupy().cuda.runtime
        if copies:
            rt.memcpyAsync(self._input_dev.data.ptr, self._input_host_bytes.ctypes.data, self._input_bytes, H2D,
                           s.ptr)
        flag = self.lw.errflag
        rt.memsetAsync(flag.data.ptr, 0, flag.nbytes, s.ptr)
        after_kernel = False
        for step in self._steps:
            is_kernel = isinstance(step, Launch)
            if overlap and is_kernel and after_kernel:
                step.launch_overlapped(s.ptr)
            else:
                step()
            after_kernel = is_kernel
        if copies:
            rt.memcpyAsync(self._flag_host.ctypes.data, flag.data.ptr, flag.nbytes, D2H, s.ptr)

    # ---------------------------------------------------------------- running
    def _device_state(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[Any, np.ndarray]]]:
        """State as device arrays. numpy buffers get device mirrors, uploaded now and written back
        after the call (the path tests and the reference comparison use; models keep State on the device)."""
        cp = cupy()
        dev_state, back = {}, []
        for n in self.graph.states:
            buf = state[n.name]
            if isinstance(buf, np.ndarray):
                m = self._mirrors.get(n.name)
                if m is None or m.shape != buf.shape or m.dtype != buf.dtype:
                    m = self._mirrors[n.name] = cp.empty(buf.shape, buf.dtype)
                m.set(buf)
                back.append((m, buf))
                buf = m
            dev_state[n.name] = buf
        return dev_state, back

    def bind(self, state: Mapping[str, Any]) -> list[tuple[Any, np.ndarray]]:
        """Check new State buffers once and bind the launches to them (nothing to do for the buffers
        already bound). Returns the numpy State buffers to write back after the call with their mirrors."""
        given = tuple([id(state.get(name)) for name in self._state_names])
        if given != self._checked_state:  # new buffers: check them once, not on every replayed call
            check_state(self.graph, state)  # shape and dtype: numpy and CuPy buffers alike
            self._checked_state = given
            self._host_state = any(isinstance(state[n.name], np.ndarray) for n in self.graph.states)
        if self._host_state:
            dev_state, back = self._device_state(state)
            key = tuple(id(dev_state[name]) for name in self._state_names)
        else:
            dev_state, back, key = state, [], given
        if key != self._bound_state:
            self._bind(dev_state)
            self._bound_state = key
        return back

    @property
    def host_state(self) -> bool:
        """The bound State is numpy, mirrored on the device around each call."""
        return self._host_state

    def __call__(self, inputs: Mapping[str, np.ndarray], state: dict[str, Any] | None = None,
                 device: bool = False) -> dict[str, Any]:
        """Run once. State buffers (CuPy or numpy) are updated in place. `device=True` returns the
        outputs as CuPy arrays (copies, safe across calls) instead of numpy."""
        feeds = check_inputs(self.graph, inputs)
        state = state if state is not None else {}
        with stream() as s:  # everything in order on the one stream, uploads and binding included
            back = self.bind(state)
            for name, arr in feeds.items():
                self.input_host[name][...] = arr
            self._calls_since_bind += 1
            if self._graph_exec is None and self._may_capture():
                self._graph_exec = self._capture()
            if self._graph_exec is not None:
                self._graph_exec.launch(s)
            else:
                self._run_steps(s)
            if device:
                outs = {name: v.copy() for name, v in self._outputs.items()}
            else:
                rt = cupy().cuda.runtime
                for name, v in self._outputs.items():
                    h = self._outputs_host[name]
                    rt.memcpyAsync(h.ctypes.data, v.data.ptr, v.nbytes, D2H, s.ptr)
            s.synchronize()
            self.raise_if_flagged(self._flag_host)
            if not device:
                outs = {name: h.copy() for name, h in self._outputs_host.items()}
            for m, buf in back:
                m.get(out=buf)
        return outs

    def raise_if_flagged(self, flag_host: np.ndarray) -> None:
        """A kernel's report of a bad run-time value (the error flag read back), as a BackendError."""
        code, value = (int(v) for v in flag_host)
        if code:
            n = self._code_node[code]
            msg = self.lw.messages.get(code, "bad run-time value {value}").format(value=value)
            raise BackendError(f"gpu backend, node %{self.ids[id(n)]} {n.describe()}: {msg}")

    @property
    def outputs(self) -> dict[str, Any]:
        """The bound outputs' device arrays (overwritten by the next call)."""
        return self._outputs

    def report(self) -> dict[str, float]:
        return {
            "nodes": len(self.order),
            "steps": len(self._steps),
            "arena_bytes": self.plan.arena_bytes,
            "unplanned_bytes": self.plan.naive_bytes,
            "lower_s": self.lower_s,
            "captured": self.captured,
        }


def new_state(graph: Graph) -> dict[str, Any]:
    """Zeroed State buffers on the device (KV caches, conv and recurrent states)."""
    cp = cupy()
    return {n.name: cp.zeros(n.shape, numpy_dtype(n.dtype)) for n in graph.states}


def lower(graph: Graph, weights: Weights | None = None, **options: Any) -> GpuProgram:
    return GpuProgram(graph, weights)
