"""What the GPU attention tests share (test_gpu_attention.py: flash_attn; test_gpu_attention_prefill.py:
flash_attn_bf16): one attention node's shapes and data, and two ways to run it on the gpu backend.

"graph" lowers a one-node Graph with get_backend("gpu") (the whole backend path); "rule" calls the op's
lowering rule directly on fixed device buffers and replays its steps, so the kernels are checked even
where the Program glue is not. Rows at and past kv_len hold GARBAGE, which the kernels must never read.
"""

from __future__ import annotations

import math

import numpy as np
from _gpu_helpers import host
from graphir.backends.registry import get_backend

from graphir import g
from graphir.errors import BackendError
from graphir.ir import Graph

GARBAGE = 1e3


def attention_graph(op: str, n_q, hq, cap, hk, d, dv, kvdtype, scale, window, state=False) -> Graph:
    leaf = g.state if state else g.input
    k, v = leaf("k", (cap, hk, d), kvdtype), leaf("v", (cap, hk, dv), kvdtype)
    node = getattr(g, op)(g.input("q", (n_q, hq, d)), k, v, g.input("pos", (n_q,), "i32"), g.input("len", (1,), "i32"),
                          scale=scale, window=window)
    return Graph({"out": node})


class AttentionCase:
    """Shapes of one attention node (of the subclass's `op`); `ref(...)` evaluates it on the reference backend."""

    op = "flash_attn"

    def __init__(self, n_q, hq, hk, d, dv, cap, kvdtype, window=0, scale=None):
        self.n_q, self.hq, self.hk, self.d, self.dv, self.cap = n_q, hq, hk, d, dv, cap
        self.kvdtype, self.window = kvdtype, window
        self.scale = 1.0 / math.sqrt(d) if scale is None else scale
        self.graph = attention_graph(self.op, n_q, hq, cap, hk, d, dv, kvdtype, self.scale, window)
        self.reference = get_backend("reference").lower(self.graph, None)

    def data(self, rng, kv_len):
        npdt = np.float32 if self.kvdtype == "f32" else np.float16
        q = (rng.standard_normal((self.n_q, self.hq, self.d)) * 1.5).astype(np.float32)
        k = rng.standard_normal((self.cap, self.hk, self.d)).astype(npdt)
        v = rng.standard_normal((self.cap, self.hk, self.dv)).astype(npdt)
        k[kv_len:], v[kv_len:] = GARBAGE, -GARBAGE
        return q, k, v

    def feeds(self, q, k, v, pos, kv_len):
        return {"q": q, "k": k, "v": v, "pos": np.asarray(pos, np.int32), "len": np.array([kv_len], np.int32)}

    def ref(self, *args):
        return self.reference(self.feeds(*args))["out"]


class GraphRunner:
    def __init__(self, case: AttentionCase):
        self.case, self.program = case, get_backend("gpu").lower(case.graph, None)

    def __call__(self, *args):
        return host(self.program(self.case.feeds(*args))["out"])


class RuleRunner:
    """The op's lowering rule on persistent device buffers: new values are copied in, pointers never change.
    `kernels`: the names of the kernels the rule chose."""

    def __init__(self, case: AttentionCase, kv_offset: int = 0):
        import cupy as cp
        from graphir.backends.gpu.attention import lower_flash_attn, lower_flash_attn_bf16
        from graphir.backends.gpu.launch import Lowering

        c = self.case = case
        kvdt = np.float32 if c.kvdtype == "f32" else np.float16

        def kv(width):  # kv_offset elements past an aligned address
            n = c.cap * c.hk * width
            return cp.zeros(n + kv_offset, kvdt)[kv_offset:].reshape(c.cap, c.hk, width)

        self.bufs = [cp.zeros((c.n_q, c.hq, c.d), np.float32), kv(c.d), kv(c.dv), cp.zeros((c.n_q,), np.int32),
                     cp.zeros((1,), np.int32)]
        self.out = cp.full((c.n_q, c.hq, c.dv), np.nan, np.float32)
        self.lw = Lowering(None)
        self.lw.code = 1
        rule = lower_flash_attn_bf16 if c.op == "flash_attn_bf16" else lower_flash_attn
        self.steps = rule(self.lw, None, self.bufs, [self.out], {"scale": c.scale, "window": c.window})
        self.kernels = [st.name for st in self.steps]

    def __call__(self, *args):
        for buf, host_array in zip(self.bufs, self.case.feeds(*args).values()):
            buf.set(np.ascontiguousarray(host_array))
        self.lw.errflag.fill(0)
        for step in self.steps:
            step()
        flag = self.lw.errflag.get()
        if flag[0]:
            raise BackendError(self.lw.messages[int(flag[0])].format(value=int(flag[1])))
        return self.out.get()
