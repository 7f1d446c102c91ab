"""q8-activations: decode matmuls of q4_0 / q4_1 / q8_0 weights with x in 8-bit blocks (mul_mat -> mul_mat_q8x).

A decode GEMV reads each weight once; at 4 bits a weight, decoding it to a float and multiplying in f32
takes ~3 GPU instructions a weight, more than the memory system needs to deliver it. With x rounded to
int8 per 32-value block (scale max |x| / 127, llama.cpp's q8_1 activations without the f16 scale), the
GEMV multiplies the weight's integer codes directly, four at a time (dp4a). Measured on an H200
(backends/gpu/gemv_q8x.py, Q8X_KERNEL's comment): faster for q4_0 at the large shapes (a 12288x4096 GEMV
at 57 % of copy bandwidth against 48 %, the LM head 83 % against 65 %), about even or slower at 4096 rows,
slower for q8_0: each block quantizes x itself, ~a third of its instructions. The gpu has no q4_1 kernel
(lowering a q4_1 mul_mat_q8x there is an error that says so). On the cpu (backends/cpu/gemv_q8x.py) x is
quantized once a call and the blocks' integer dot products are AVX2's vpmaddubsw / vpmaddwd, as in
llama.cpp; BENCHMARKS.md has its numbers on SmolLM2 (q4_1).

What it costs: each x value is rounded to 8 bits relative to its block's largest, an error of up to
max|x| / 254 per value (~0.4 % of the block's largest), where the f32 path is exact. The weight's own
rounding (q4_0, q4_1: 1/16 of its block's range) stays the larger error. It is opt-in
(`--passes default,q8-activations`); `graphir check --passes default,q8-activations` shows the cost.

Only matmuls of a 2-D q4_0 / q4_1 / q8_0 weight (a Param, or Params stacked by stack-projections) by at most
`max_rows` rows of x change: prefill is compute-bound on dequantized weights and stays in f32. On the cpu, greedy
speculative decoding equals plain decoding only if verify calls round x as decode steps do:
`q8-activations{max_rows=16}` (the cpu pipeline runs q16-activations so; the gpu's verify rows differ in the last
bits anyway, and its pipeline has neither pass). A fused
mul_mat_swiglu (its stacked gate|up product) is split back into the product, now mul_mat_q8x, and
swiglu_split of its two halves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from graphir.builder import contiguous_strides
from graphir.ir import Graph, Node
from graphir.ops.fused import Q8X_FORMATS
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, check_options, is_weight_matrix, rewrite


@register_pass("q8-activations", "mul_mat (and mul_mat_swiglu) of a q4_0/q4_1/q8_0 2-D weight by <= max_rows rows "
                                 "-> mul_mat_q8x (x in 8-bit blocks, integer dot products): decode GEMV")
@dataclass(frozen=True)
class Q8Activations:
    max_rows: int = 1
    OP: ClassVar[str] = "mul_mat_q8x"  # what a match becomes; q16-activations subclasses with its own three
    FORMATS: ClassVar[tuple[str, ...]] = Q8X_FORMATS
    WHY_NOT: ClassVar[str] = "has no integer-code GEMV"

    def __post_init__(self) -> None:
        check_options(0, max_rows=self.max_rows)

    def _match(self, n: Node, rw: Rewriter) -> Node | None:
        if n.op not in ("mul_mat", "mul_mat_swiglu"):
            return None
        w, x = n.src
        if not is_weight_matrix(w):
            return None  # an activation, or with batch axes
        if w.dtype not in self.FORMATS:
            rw.reject(n, f"weight dtype {w.dtype} {self.WHY_NOT} (only {', '.join(self.FORMATS)}): kept in f32")
            return None
        rows = math.prod(x.shape[:-1])
        if rows > self.max_rows:
            rw.reject(n, f"{rows} rows of x > max_rows={self.max_rows}: not a decode GEMV, kept in f32")
            return None
        return n

    def _rewrite(self, n: Node, rw: Rewriter) -> Node:
        rw.matched(n, self.OP)
        if n.op == "mul_mat":
            return rw.make(self.OP, *n.src, name=n.name)
        # mul_mat_swiglu: the stacked product in integer codes, then the activation of its halves (as swiglu-split
        # left it)
        y = rw.make(self.OP, *n.src, name=f"{n.name}.gate_up" if n.name else None)
        half, strides = n.shape[-1], contiguous_strides(y.shape)
        gate, up = (rw.make("view", y, shape=n.shape, strides=strides, offset=o) for o in (0, half))
        return rw.make("swiglu_split", gate, up, name=n.name)

    def __call__(self, graph: Graph) -> Graph:
        return rewrite(graph, [(self._match, self._rewrite)])
