"""kv-f16: keep KV caches in float16, as llama.cpp does by default.

A decode step at long context is bound by reading every visible K and V row (SmolLM2-135M: 46 KB a
position in f32, 47 MB a token at 1k keys); f16 rows halve that. The writes round each new row to
f16 (round to nearest even, the cast's meaning in set_rows) and attention widens the rows exactly,
so the only change to the math is that one rounding of K and V. Opt-in: `--passes default,kv-f16`.

A KV cache is recognised by what the graph does with it, not by its name: a State that a row write
(set_rows or its fused forms) fills and whose written rows reach flash_attn's k or v operand through
layout ops (views, reshapes, a KV-slot gather). Other row-written State (Qwen3.5's per-token
conv/ssm steps) and whole-buffer recurrent State stay f32. Every node over a changed State is
rebuilt with its op's own dtype rule, so an op that cannot take an f16 cache fails at the pass,
naming the node, rather than running on a wrong dtype.

Prefill and decode graphs of a model must agree on a State's dtype: run both through the same
pipeline (a Model does).
"""

from __future__ import annotations

from graphir.ir import Graph, Node
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, rewrite

ROW_WRITES = ("set_rows", "rope_set_rows", "rms_norm_mul_rope_set_rows")
ATTENTION = ("flash_attn", "flash_attn_bf16")
# ops that pass a cache's rows through to attention unchanged in value (their first source)
LAYOUT = ("view", "reshape", "permute", "transpose", "cont", "get_rows")


def _written_state(n: Node) -> Node | None:
    """The State whose row-written contents `n` is (through layout ops), or None."""
    written = False
    while n.op in LAYOUT or n.op in ROW_WRITES:
        written = written or n.op in ROW_WRITES
        n = n.src[0]
    return n if n.op == "state" and written else None


def kv_cache_states(graph: Graph) -> set[str]:
    """Names of the States that are KV caches: row-written and read as attention's k or v."""
    found = set()
    for n in graph.nodes():
        if n.op in ATTENTION:
            for operand in n.src[1:3]:
                state = _written_state(operand)
                if state is not None:
                    found.add(state.name)
    return found


def _row_written(graph: Graph) -> dict[str, Node]:
    out = {}
    for n in graph.nodes():
        if n.op in ROW_WRITES:
            state = _written_state(n)
            if state is not None:
                out[state.name] = state
    return out


@register_pass("kv-f16", "KV caches (row-written State read by attention) -> f16: half the bytes a decode "
                         "step reads, rows rounded to f16 once when written")
def kv_f16(graph: Graph) -> Graph:
    caches = kv_cache_states(graph)
    for name, state in _row_written(graph).items():
        if name not in caches:
            Rewriter.reject(state, "row-written State not read by attention (recurrent steps): kept f32")

    def cache_leaf(n: Node, rw: Rewriter) -> Node | None:
        # the cache itself: same name and shape, f16 elements
        return n if n.op == "state" and n.name in caches and n.dtype == "f32" else None

    def to_f16(n: Node, rw: Rewriter) -> Node:
        rw.matched(n, "f16 KV cache")
        return n.replace(dtype="f16")

    def reads_changed(n: Node, rw: Rewriter) -> Node | None:
        # a reader of a changed node: its dtype rule decides again (set_rows and views become f16,
        # attention stays f32, an op that takes no f16 raises a GraphError naming it)
        return n if n.src and any(rw.new(s).dtype != s.dtype for s in n.src) else None

    def remake(n: Node, rw: Rewriter) -> Node:
        return rw.make(n.op, *n.src, name=n.name, **n.params.as_dict())

    return rewrite(graph, [(cache_leaf, to_f16), (reads_changed, remake)])
