"""gemm-bf16: large matmuls in bfloat16 (mul_mat -> mul_mat_bf16), the precision tensor cores run fast.

A prefill matmul of many tokens is compute-bound; in f32 it runs on the GPU's f32 units, in bf16
on its tensor cores at many times the rate. The rewrite rounds both operands to bf16 (weights
stored as bf16 are already exact) and keeps f32 accumulation, the precision HF transformers and
llama.cpp use for prefill. It is opt-in (`--passes default,gemm-bf16`): the default pipeline keeps
every product in f32, and `graphir check --passes default,gemm-bf16` shows what the rounding costs.

Only matmuls of a 2-D weight (a Param, or Params stacked by stack-projections) with at least
`min_rows` rows of x change: decode steps and speculative verify calls (up to 16 rows: the gpu
backend's GEMV_MAX_TOKENS, whose GEMV is captured where cuBLAS cannot be) are bandwidth-bound, read
the weight once either way, and stay exact.

gemm-bf16-out, run after it (`--passes default,gemm-bf16,gemm-bf16-out`), also rounds the result of a
bf16 product that only swiglu_split reads (a prefill's gate and up) to bf16, as HF transformers' bf16
projections leave it. The activation reads a [tokens, d_ff] pair of them: stored as bf16 they are half
the bytes for the GEMM to write and the activation to read (the gpu backend does; Qwen3-8B, 4096
tokens: two [4096, 12288] products a layer, 400 MB in f32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphir.ir import Graph, Node
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, check_options, is_weight_matrix, rewrite


@register_pass("gemm-bf16", "mul_mat of a 2-D weight by >= min_rows rows -> mul_mat_bf16 "
                            "(bf16 operands, f32 accumulation): tensor-core prefill")
@dataclass(frozen=True)
class GemmBf16:
    min_rows: int = 17

    def __post_init__(self) -> None:
        check_options(1, min_rows=self.min_rows)

    def _match(self, n: Node, rw: Rewriter) -> Node | None:
        if n.op != "mul_mat":
            return None
        w, x = n.src
        if not is_weight_matrix(w):
            return None  # an activation, or with batch axes
        rows = math.prod(x.shape[:-1])
        if rows < self.min_rows:
            rw.reject(n, f"{rows} rows of x < min_rows={self.min_rows}: bandwidth-bound, kept in f32")
            return None
        return n

    def _rewrite(self, n: Node, rw: Rewriter) -> Node:
        rw.matched(n, "mul_mat_bf16")
        return rw.make("mul_mat_bf16", *n.src, name=n.name)

    def __call__(self, graph: Graph) -> Graph:
        return rewrite(graph, [(self._match, self._rewrite)])


@register_pass("gemm-bf16-out", "mul_mat_bf16 read only by swiglu_split -> mul_mat_bf16_rounded "
                                "(result rounded to bf16): the prefill activation's inputs in half the bytes")
def gemm_bf16_out(graph: Graph) -> Graph:
    def match(n: Node, rw: Rewriter) -> Node | None:
        if n.op != "mul_mat_bf16":
            return None
        user = rw.sole_user(n)
        if user is None or user.op != "swiglu_split":
            rw.reject(n, "read by something other than one swiglu_split (or a graph output): its f32 result kept")
            return None
        return n

    def rounded(n: Node, rw: Rewriter) -> Node:
        rw.matched(n, "mul_mat_bf16_rounded")
        return rw.make("mul_mat_bf16_rounded", *n.src, name=n.name)

    return rewrite(graph, [(match, rounded)])
