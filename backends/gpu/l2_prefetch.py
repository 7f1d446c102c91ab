"""L2 prefetch of a decode GEMV's weight by the latency-bound kernel before it.

A decode step's small kernels (the residual add + norm before the q|k|v and gate|up GEMVs) wait on a
few dependent round trips with one block busy and DRAM idle. Here that kernel gets extra blocks that
only ask L2 for the first bytes of the weight the next GEMV streams (common.cuh l2_prefetch), so the
GEMV finds them there. Wired after lowering, from the graph: the GEMV is the mul_mat (or
mul_mat_swiglu) reading the norm's result 0. Only single-row (decode) norms take it.

GRAPHIR_L2_PREFETCH_MB: bytes a weight (in MiB; 0 or unset: none). An experiment, measured in
BENCHMARKS.md; nothing is prefetched unless it is set.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from graphir.ir import Node

from .launch import GpuParam, Launch, i32

BLOCKS = 32  # prefetching blocks beside the norm's one: each thread asks for a few 128-byte lines
GEMV_OPS = ("mul_mat", "mul_mat_swiglu")


def prefetch_bytes() -> int:
    return int(float(os.environ.get("GRAPHIR_L2_PREFETCH_MB", "0") or 0) * 2**20)


def next_weight(n: Node, users: dict[int, list[Node]]) -> Node | None:
    """The weight of the GEMV that reads result 0 of n (as x), or None."""
    for item in users.get(id(n), []):
        if item.op == "item" and item.params["index"] == 0:
            for u in users.get(id(item), []):
                if u.op in GEMV_OPS and u.src[1] is item and u.src[0] is not item:
                    return u.src[0]
    return None


def wire(node_steps: list[tuple[Node, list]], users: dict[int, list[Node]], env: dict[int, Any]) -> None:
    """Give each decode add_rms_norm_mul launch the next GEMV's weight to prefetch (in place)."""
    budget = prefetch_bytes()
    if budget <= 0:
        return
    for n, steps in node_steps:
        if n.op != "add_rms_norm_mul" or len(steps) != 1:
            continue
        st = steps[0]
        if not (isinstance(st, Launch) and st.name.startswith("add_rms_norm_mul_v") and st.grid == (1,)):
            continue
        w = next_weight(n, users)
        raw = env.get(id(w)) if w is not None else None
        if not isinstance(raw, GpuParam):
            continue
        st.grid = (1 + BLOCKS,)
        st.args = st.args[:-3] + (i32(1), raw.raw, np.int64(min(budget, raw.raw.nbytes)))
