"""q16-activations: decode matmuls of q4_0 / q4_1 / q8_0 weights with x in 16-bit blocks (mul_mat -> mul_mat_q16x).

q8-activations with int16 codes of x (scale max |x| / 32767): the cpu's integer GEMV (backends/cpu/gemv_q16x.py,
`vpmaddwd`) at 1.02-1.20x q8x's time, where 8-bit x moves SmolLM2's top-2 logit margin by a median 0.066, past issue
13's near-tie of 0.05 (BENCHMARKS.md, "q8-activations against issue 13's greedy rule"); a numpy model put the need
at ~12 bits. x then moves by at most max|x| / 65534 a value. q8_0 weights (SmolLM2's LM head) too: their block sums
with 16-bit x are exact in int32 and rounded once to f32 (BENCHMARKS.md, "A 16-bit q8_0 head"). The gpu has no
kernel for it (lowering is an error).

The match rules are q8-activations' (a 2-D weight, at most max_rows rows of x, a stacked gate|up split back
into the product and swiglu_split), with mul_mat_q16x and its formats. The cpu pipeline runs it with max_rows 16,
the largest speculative verify call (graphir/passes/__init__.py CPU_PASSES): the kernel rounds and sums each row
of x on its own, so a verify row then equals the decode step at its position bit for bit (decode attention
chunks its keys as that step's, backends/cpu/attention.py), where f32 verify rows parted from 16-bit decode steps
at near-ties (issue 11). Prefill chunks of 8 take it too (BENCHMARKS.md, "Issue 11 on the cpu pipeline").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from graphir.ops.fused import Q16X_FORMATS
from graphir.passes import register_pass
from graphir.passes.q8_activations import Q8Activations


@register_pass("q16-activations", "mul_mat (and mul_mat_swiglu) of a q4_0/q4_1/q8_0 2-D weight by <= max_rows rows "
                                  "-> mul_mat_q16x (x in 16-bit blocks, integer dot products): decode GEMV, cpu")
@dataclass(frozen=True)
class Q16Activations(Q8Activations):
    OP: ClassVar[str] = "mul_mat_q16x"
    FORMATS: ClassVar[tuple[str, ...]] = Q16X_FORMATS
    WHY_NOT: ClassVar[str] = "has no 16-bit-activation GEMV"
