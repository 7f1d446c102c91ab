"""q16-activations: decode matmuls of q4_0 / q4_1 weights with x in 16-bit blocks (mul_mat -> mul_mat_q16x).

q8-activations with int16 codes of x (scale max |x| / 32767): the cpu's integer GEMV (backends/cpu/gemv_q16x.py,
`vpmaddwd`) at 1.02-1.20x q8x's time, where 8-bit x moves SmolLM2's top-2 logit margin by a median 0.066, past issue
13's near-tie of 0.05 (BENCHMARKS.md, "q8-activations against issue 13's greedy rule"); a numpy model put the need
at ~12 bits. x then moves by at most max|x| / 65534 a value. q8_0 weights (SmolLM2's LM head) stay in f32:
their codes times 16-bit ones pass 2^24 a block, so the block sums would no longer be exact as f32 (and the
head at 8 bits alone moves the margin by a median 0.032). The gpu has no kernel for it (lowering is an error).

The match rules are q8-activations' (a 2-D weight, at most max_rows rows of x, a stacked gate|up split back
into the product and swiglu_split), with mul_mat_q16x and its formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from graphir.ops.fused import Q16X_FORMATS
from graphir.passes import register_pass
from graphir.passes.q8_activations import Q8Activations


@register_pass("q16-activations", "mul_mat (and mul_mat_swiglu) of a q4_0/q4_1 2-D weight by <= max_rows rows "
                                  "-> mul_mat_q16x (x in 16-bit blocks, integer dot products): decode GEMV, cpu")
@dataclass(frozen=True)
class Q16Activations(Q8Activations):
    OP: ClassVar[str] = "mul_mat_q16x"
    FORMATS: ClassVar[tuple[str, ...]] = Q16X_FORMATS
    # q8_0: its block sums with 16-bit x would pass 2^24, no longer exact as f32 (the module docstring)
    WHY_NOT: ClassVar[str] = "has no 16-bit-activation GEMV"
