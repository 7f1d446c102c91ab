"""replay-lint for the gpu lowering: no launch may depend on the value of an Input.

The graph-level `replay-lint` pass proves that no view, offset or shape of the graph comes from a
run-time value. This lint proves the same of what the gpu backend made of it: every kernel
argument, grid, block and shared-memory size is fixed at binding, so it must come out identical
however the Input buffers are filled when the Program binds. A rule that read a position or a KV
row from the device while lowering (`int(kv_len.get()[0])` to size a grid, a KV offset passed as a
number) would bake that value into every replay: the captured-graph version of a view fixed at
build time.

    from graphir.backends.gpu.replay_lint import lint
    problems = lint(program)            # [] when every launch is independent of the Inputs

How: bind the Program twice, its Input buffers filled with different plausible values each time
(small ints, different in every element between the two bindings: random bytes would make every
index out of range, and two out-of-range values could bake in the same clamped result), and
compare the launches. Device arrays compare by role (which Input buffer, else dtype and shape),
since scratch is allocated anew per binding; numbers compare by value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .device import cupy, stream
from .launch import Launch
from .program import GpuProgram, new_state


def _arg_role(a: Any, inputs: dict[int, str]) -> Any:
    cp = cupy()
    if isinstance(a, cp.ndarray):
        name = inputs.get(int(a.data.ptr))
        return ("input", name) if name is not None else ("array", str(a.dtype), tuple(a.shape))
    return ("value", type(a).__name__, a.item() if isinstance(a, np.generic) else a)


def launches(program: GpuProgram) -> list[tuple[Any, ...]]:
    """The bound Program's steps, each as (kernel, grid, block, shared, argument roles)."""
    inputs = {int(buf.data.ptr): name for name, buf in program.input_buffers.items()}
    out = []
    for step in program._steps:
        if isinstance(step, Launch):
            out.append((step.label, step.grid, step.block, step.shared,
                        tuple(_arg_role(a, inputs) for a in step.args)))
        else:
            out.append((getattr(step, "name", type(step).__name__),))
    return out


def lint(program: GpuProgram, state: dict[str, Any] | None = None, seed: int = 0) -> list[str]:
    """Problems found (empty: every launch is fixed independently of the Inputs). `state`: device
    State buffers to bind against (fresh zeroed ones by default)."""
    cp = cupy()
    state = state if state is not None else new_state(program.graph)
    rng = np.random.default_rng(seed)
    base = {name: rng.integers(0, 4, buf.shape) for name, buf in program.input_buffers.items()}
    seen = []
    for shift in (0, 1 + rng.integers(0, 4)):
        with stream():
            for name, buf in program.input_buffers.items():
                vals = base[name] + shift if buf.dtype.kind in "iu" else rng.random(buf.shape) + shift
                buf.set(vals.astype(buf.dtype))
            program._bind(state)
            cp.cuda.get_current_stream().synchronize()
        seen.append(launches(program))
    program._bound_state = None  # the next call binds again, with its own Inputs in place
    a, b = seen
    if len(a) != len(b):
        return [f"the Program has {len(a)} steps with one set of Input values and {len(b)} with another"]
    problems = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            what = [f"{k}: {u!r} vs {v!r}" for k, u, v in zip(("kernel", "grid", "block", "shared", "args"), x, y,
                                                                strict=False) if u != v]
            problems.append(f"step {i} ({x[0]}) depends on the Inputs' values: " + "; ".join(what))
    return problems
