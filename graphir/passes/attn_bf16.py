"""attn-bf16: prefill attention in bfloat16 (flash_attn -> flash_attn_bf16), on tensor cores.

Prefill attention is compute-bound (each K/V tile serves many queries): in f32 it runs on the
GPU's CUDA cores, in bf16 on its tensor cores at many times the rate. The rewrite rounds q, k, v
and the softmax weights to bf16 and keeps scores, softmax and sums in f32 (graphir/ops/fused.py
states the exact meaning). It is opt-in, as gemm-bf16 is, and runs after it:
`--passes default,gemm-bf16,attn-bf16`; `graphir check --passes default,attn-bf16` shows what the
rounding costs.

Only attention of more than `max_decode_queries` queries changes: a decode step (a few queries)
reads the whole KV cache for little arithmetic, is bandwidth-bound, and stays exact. The default
is the gpu backend's own split (DECODE_MAX_QUERIES in backends/gpu/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphir.ir import Graph, Node
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, check_options, rewrite


@register_pass("attn-bf16", "flash_attn of > max_decode_queries queries -> flash_attn_bf16 "
                            "(bf16 q, k, v and weights, f32 softmax): tensor-core prefill attention")
@dataclass(frozen=True)
class AttnBf16:
    max_decode_queries: int = 16  # backends/gpu/attention.py DECODE_MAX_QUERIES

    def __post_init__(self) -> None:
        check_options(0, max_decode_queries=self.max_decode_queries)

    def _match(self, n: Node, rw: Rewriter) -> Node | None:
        if n.op != "flash_attn":
            return None
        n_q = n.src[0].shape[0]
        if n_q <= self.max_decode_queries:
            rw.reject(n, f"{n_q} queries <= max_decode_queries={self.max_decode_queries}: "
                         "decode is bandwidth-bound, kept in f32")
            return None
        return n

    def _rewrite(self, n: Node, rw: Rewriter) -> Node:
        rw.matched(n, "flash_attn_bf16")
        return rw.make("flash_attn_bf16", *n.src, name=n.name, **n.params.as_dict())

    def __call__(self, graph: Graph) -> Graph:
        return rewrite(graph, [(self._match, self._rewrite)])
