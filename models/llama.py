"""Llama-family decoders (Llama, SmolLM2; Qwen3 through options): config and graph builder.

Each block, pre-norm with residuals:
    x = x + attn(rms_norm(x) * attn_norm)          GQA, rope on q/k, KV written into State
    x = x + down(silu(gate(h)) * up(h)),  h = rms_norm(x) * ffn_norm
then logits = output(rms_norm(x) * output_norm), `output` being token_embd when tied.

Runtime values are Inputs, so one decode graph (n_tokens=1) serves every position:
    tokens [n] i32   token ids
    pos    [n] i32   their positions (rope, causal mask)
    kv_idx [n] i32   KV-cache rows to write (equal to pos for a linear cache)
    kv_len [1] i32   rows of the cache that are valid after this call's writes
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from graphir.builder import g
from graphir.errors import GraphError
from graphir.ir import Graph, Node

PHASES = ("prefill", "decode")
DEFAULT_PREFILL_TOKENS = 8


@dataclass(frozen=True)
class LlamaConfig:
    arch: str  # "llama" or "qwen3": names the family in dumps and errors
    n_vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 10000.0
    rope_mode: str = "neox"  # "norm" for GGUF llama files (Q/K rows permuted at conversion), else "neox"
    rms_eps: float = 1e-5
    qk_norm: bool = False  # Qwen3: RMS norm of each q/k head before rope
    tied_embeddings: bool = False  # no output.weight; token_embd.weight is the head
    context_length: int = 2048  # trained context
    ctx: int = 2048  # KV-cache capacity in rows (a build-time shape)


def param_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every Param the graph reads, with its shape (numpy order; matrices are [n_out, n_in])."""
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.n_vocab, c.d_model)}
    for i in range(c.n_layers):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (c.d_model,)
        shapes[b + "attn_q.weight"] = (q_dim, c.d_model)
        shapes[b + "attn_k.weight"] = (kv_dim, c.d_model)
        shapes[b + "attn_v.weight"] = (kv_dim, c.d_model)
        shapes[b + "attn_output.weight"] = (c.d_model, q_dim)
        if c.qk_norm:
            shapes[b + "attn_q_norm.weight"] = (c.head_dim,)
            shapes[b + "attn_k_norm.weight"] = (c.head_dim,)
        shapes[b + "ffn_norm.weight"] = (c.d_model,)
        shapes[b + "ffn_gate.weight"] = (c.d_ff, c.d_model)
        shapes[b + "ffn_up.weight"] = (c.d_ff, c.d_model)
        shapes[b + "ffn_down.weight"] = (c.d_model, c.d_ff)
    shapes["output_norm.weight"] = (c.d_model,)
    if not c.tied_embeddings:
        shapes["output.weight"] = (c.n_vocab, c.d_model)
    return shapes


def check_config(c: LlamaConfig) -> None:
    rules = [
        (c.n_heads % c.n_kv_heads == 0, f"n_heads {c.n_heads} must be a multiple of n_kv_heads {c.n_kv_heads}"),
        (c.head_dim % 2 == 0, f"head_dim {c.head_dim} must be even for rope"),
        (c.rope_mode in ("norm", "neox"), f"rope_mode must be 'norm' or 'neox', got {c.rope_mode!r}"),
        (c.ctx >= 1, f"ctx {c.ctx} must be >= 1"),
    ]
    for ok, rule in rules:
        if not ok:
            raise GraphError(f"{c.arch} config: {rule}")


class ParamNodes:
    """Param leaves with the weight store's dtypes (default f32), one node per name; shared by the
    model families, each giving its own name -> shape table."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str] | None):
        self.shapes = shapes
        self.dtypes = dtypes or {}
        self.nodes: dict[str, Node] = {}

    def __call__(self, name: str) -> Node:
        if name not in self.nodes:
            self.nodes[name] = g.param(name, self.shapes[name], self.dtypes.get(name, "f32"))
        return self.nodes[name]


def build(c: LlamaConfig, phase: str = "prefill", n_tokens: int | None = None,
          dtypes: Mapping[str, str] | None = None, last_only: bool = False) -> Graph:
    """The forward graph for `n_tokens` tokens (decode: 1). `dtypes` maps Param names to their stored
    dtypes; `last_only` computes logits for the last token only."""
    check_config(c)
    if phase not in PHASES:
        raise GraphError(f"{c.arch}: phase must be one of {PHASES}, got {phase!r}")
    if phase == "decode" and n_tokens not in (None, 1):
        raise GraphError(f"{c.arch}: decode graphs take 1 token, got n_tokens={n_tokens}")
    n = 1 if phase == "decode" else (n_tokens or DEFAULT_PREFILL_TOKENS)
    if n < 1:
        raise GraphError(f"{c.arch}: n_tokens must be >= 1, got {n}")
    p = ParamNodes(param_shapes(c), dtypes)
    tokens = g.input("tokens", (n,), "i32")
    pos = g.input("pos", (n,), "i32")
    kv_idx = g.input("kv_idx", (n,), "i32")
    kv_len = g.input("kv_len", (1,), "i32")

    x = g.get_rows(p("token_embd.weight"), tokens, name="token_embd")  # [n, d_model]
    for i in range(c.n_layers):
        h = _norm(x, p(f"blk.{i}.attn_norm.weight"), c.rms_eps, f"blk.{i}.attn_norm")
        x = g.add(x, _attention(c, p, i, h, pos, kv_idx, kv_len), name=f"blk.{i}.attn_res")
        h = _norm(x, p(f"blk.{i}.ffn_norm.weight"), c.rms_eps, f"blk.{i}.ffn_norm")
        x = g.add(x, _ffn(p, i, h), name=f"blk.{i}.out")
    if last_only and n > 1:
        x = g.rows(x, n - 1, 1, name="last_row")  # [1, d_model]
    x = _norm(x, p("output_norm.weight"), c.rms_eps, "output_norm")
    head = p("token_embd.weight" if c.tied_embeddings else "output.weight")
    logits = g.mul_mat(head, x, name="logits")  # [n or 1, n_vocab]
    meta = {"arch": c.arch, "phase": phase, "n_tokens": n, "ctx": c.ctx, "last_only": bool(last_only and n > 1)}
    return Graph({"logits": logits}, meta=meta)


def _norm(x: Node, w: Node, eps: float, name: str) -> Node:
    return g.mul(g.rms_norm(x, eps=eps), w, name=name)


def _attention(c: LlamaConfig, p: ParamNodes, i: int, h: Node, pos: Node, kv_idx: Node, kv_len: Node) -> Node:
    n, b = h.shape[0], f"blk.{i}."
    q = g.reshape(g.mul_mat(p(b + "attn_q.weight"), h), shape=(n, c.n_heads, c.head_dim))  # [n, n_head, head_dim]
    k = g.reshape(g.mul_mat(p(b + "attn_k.weight"), h), shape=(n, c.n_kv_heads, c.head_dim))  # [n, n_kv, head_dim]
    v = g.reshape(g.mul_mat(p(b + "attn_v.weight"), h), shape=(n, c.n_kv_heads, c.head_dim))  # [n, n_kv, head_dim]
    if c.qk_norm:  # per-head RMS norm, weight [head_dim] broadcast over heads
        q = _norm(q, p(b + "attn_q_norm.weight"), c.rms_eps, b + "attn_q_norm")
        k = _norm(k, p(b + "attn_k_norm.weight"), c.rms_eps, b + "attn_k_norm")
    rope = {"n_dims": c.head_dim, "mode": c.rope_mode, "theta": float(c.rope_theta)}
    q = g.rope(q, pos, name=b + "q_rope", **rope)
    k = g.rope(k, pos, name=b + "k_rope", **rope)
    cache_shape = (c.ctx, c.n_kv_heads, c.head_dim)  # [ctx, n_kv, head_dim]
    k_all = g.set_rows(g.state(b + "k_cache", cache_shape), k, kv_idx, name=b + "k_cache_write")
    v_all = g.set_rows(g.state(b + "v_cache", cache_shape), v, kv_idx, name=b + "v_cache_write")
    o = g.flash_attn(q, k_all, v_all, pos, kv_len, scale=1.0 / math.sqrt(c.head_dim), name=b + "attn")
    o = g.reshape(o, shape=(n, c.n_heads * c.head_dim))  # [n, n_head * head_dim]
    return g.mul_mat(p(b + "attn_output.weight"), o, name=b + "attn_out")  # [n, d_model]


def _ffn(p: ParamNodes, i: int, h: Node) -> Node:
    b = f"blk.{i}."
    gate = g.mul_mat(p(b + "ffn_gate.weight"), h)  # [n, d_ff]
    up = g.mul_mat(p(b + "ffn_up.weight"), h)  # [n, d_ff]
    # written unfused on purpose: the swiglu-split pass must find this pattern in real model graphs
    act = g.mul(g.silu(gate), up, name=b + "ffn_act")  # [n, d_ff]
    return g.mul_mat(p(b + "ffn_down.weight"), act, name=b + "ffn_out")  # [n, d_model]
