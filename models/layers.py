"""Graph pieces the decoder families share: the weighted RMS norm, GQA attention over a KV cache, the
gated FFN and the output head. Each builds nodes under block i's Param names (`blk.{i}.attn_q.weight`, ...)
through a family's ParamNodes; a family composes them in its own block order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from graphir.builder import g
from graphir.ir import Node

from .family import ParamNodes


class AttentionConfig(Protocol):
    """The config fields the attention pieces read."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float


def rms_norm_mul(x: Node, w: Node, eps: float, name: str) -> Node:
    """rms_norm(x) * w, w [last axis] broadcast over the rest (every norm of these families)."""
    return g.mul(g.rms_norm(x, eps=eps), w, name=name)


def project_heads(p: ParamNodes, weight: str, h: Node, heads: int, head_dim: int, bias: str | None = None) -> Node:
    """h [n, d_model] through `weight` (plus `bias` [heads * head_dim] when named), split into heads:
    [n, heads, head_dim]."""
    y = g.mul_mat(p(weight), h)  # [n, heads * head_dim]
    if bias is not None:
        y = g.add(y, p(bias))  # broadcast over tokens; stack-projections stacks it with its weight's rows
    return g.reshape(y, shape=(h.shape[0], heads, head_dim))


def norm_rope_qk(c: AttentionConfig, p: ParamNodes, b: str, q: Node, k: Node, pos: Node,
                 rope: Mapping[str, Any], qk_norm: bool = True) -> tuple[Node, Node]:
    """q and k RMS-normed per head when `qk_norm` (weights [head_dim] broadcast over heads), then roped."""
    if qk_norm:
        q = rms_norm_mul(q, p(b + "attn_q_norm.weight"), c.rms_eps, b + "attn_q_norm")
        k = rms_norm_mul(k, p(b + "attn_k_norm.weight"), c.rms_eps, b + "attn_k_norm")
    return g.rope(q, pos, name=b + "q_rope", **rope), g.rope(k, pos, name=b + "k_rope", **rope)


def attention_out(p: ParamNodes, b: str, o: Node) -> Node:
    """The attention result o [n, n_head, head_dim] through attn_output: [n, d_model]."""
    n, heads, dim = o.shape
    o = g.reshape(o, shape=(n, heads * dim))  # [n, n_head * head_dim]
    return g.mul_mat(p(b + "attn_output.weight"), o, name=b + "attn_out")


def slot_rows(cache: Node, slot_map: Node, name: str) -> Node:
    """The sequence's KV rows gathered from the pool [slots, n_kv, head_dim] through the slot map:
    [ctx, n_kv, head_dim], as many rows as the slot map has (never a logical length)."""
    slots, heads, dim = cache.shape
    pool = g.reshape(cache, shape=(slots, heads * dim))  # [slots, n_kv * head_dim]
    rows = g.get_rows(pool, slot_map, name=name)  # [ctx, n_kv * head_dim]
    return g.reshape(rows, shape=(slot_map.shape[0], heads, dim))  # [ctx, n_kv, head_dim]


def attention(c: AttentionConfig, p: ParamNodes, i: int, h: Node, pos: Node, kv_idx: Node, kv_len: Node, *,
              rope: Mapping[str, Any], scale: float, cache_rows: int, window: int = 0, qk_norm: bool = True,
              qkv_bias: bool = False, slot_map: Node | None = None) -> Node:
    """Block i's GQA attention of h [n, d_model]: q/k/v projections (with their biases when `qkv_bias`: Qwen2),
    q/k norms (when `qk_norm`) and
    `rope`, the new k/v rows written at kv_idx into State caches [cache_rows, n_kv, head_dim], flash_attn
    over the cache (over the slot map's rows when there is one) with `scale` and `window`, attn_output."""
    b, hd = f"blk.{i}.", c.head_dim

    def bias(x: str) -> str | None:
        return b + f"attn_{x}.bias" if qkv_bias else None

    q = project_heads(p, b + "attn_q.weight", h, c.n_heads, hd, bias("q"))  # [n, n_head, head_dim]
    k = project_heads(p, b + "attn_k.weight", h, c.n_kv_heads, hd, bias("k"))  # [n, n_kv, head_dim]
    v = project_heads(p, b + "attn_v.weight", h, c.n_kv_heads, hd, bias("v"))  # [n, n_kv, head_dim]
    q, k = norm_rope_qk(c, p, b, q, k, pos, rope, qk_norm)
    cache_shape = (cache_rows, c.n_kv_heads, hd)  # [ctx or slots, n_kv, head_dim]
    k_all = g.set_rows(g.state(b + "k_cache", cache_shape), k, kv_idx, name=b + "k_cache_write")
    v_all = g.set_rows(g.state(b + "v_cache", cache_shape), v, kv_idx, name=b + "v_cache_write")
    if slot_map is not None:  # kv_idx named slots; read the sequence's slots in position order
        k_all, v_all = slot_rows(k_all, slot_map, b + "k_slots"), slot_rows(v_all, slot_map, b + "v_slots")
    o = g.flash_attn(q, k_all, v_all, pos, kv_len, scale=scale, window=window, name=b + "attn")  # [n, n_head, hd]
    return attention_out(p, b, o)  # [n, d_model]


def gated_ffn(p: ParamNodes, i: int, h: Node, act: Callable[..., Node]) -> Node:
    """Block i's FFN: down(act(gate(h), up(h))); `act(gate, up, name=...)` joins the two [n, d_ff] halves."""
    b = f"blk.{i}."
    gate = g.mul_mat(p(b + "ffn_gate.weight"), h)  # [n, d_ff]
    up = g.mul_mat(p(b + "ffn_up.weight"), h)  # [n, d_ff]
    return g.mul_mat(p(b + "ffn_down.weight"), act(gate, up, name=b + "ffn_act"), name=b + "ffn_out")  # [n, d_model]


def output_head(c: Any, p: ParamNodes, x: Node, last_only: bool, name: str = "logits") -> Node:
    """Logits [n, n_vocab] of the last residual x [n, d_model] ([1, n_vocab] of its last row when
    `last_only`): output_norm, then the head (token_embd when the embeddings are tied)."""
    n = x.shape[0]
    if last_only and n > 1:
        x = g.rows(x, n - 1, 1, name="last_row")  # [1, d_model]
    x = rms_norm_mul(x, p("output_norm.weight"), c.rms_eps, "output_norm")
    head = p("token_embd.weight" if c.tied_embeddings else "output.weight")
    return g.mul_mat(head, x, name=name)  # [n or 1, n_vocab]
