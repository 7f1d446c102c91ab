"""Qwen3.5 hybrid decoders (HF Qwen3_5ForCausalLM, llama.cpp `qwen35`): Gated DeltaNet beside gated attention.

Every block is pre-norm with residuals, x = x + mixer(rms_norm(x) * attn_norm), then the
SwiGLU FFN on rms_norm(x) * post_attention_norm. Layer i is a full-attention layer when
(i + 1) % full_attn_interval == 0, else a Gated DeltaNet layer:

  DeltaNet  qkv = conv_silu([q | k | v] = h @ attn_qkv)    causal depthwise conv, kernel K, carried state
            q, k = l2_norm per head (eps 1e-6);  beta = sigmoid(h @ ssm_beta)
            g = ssm_a * softplus(h @ ssm_alpha + ssm_dt)    ssm_a = -exp(A_log) < 0, so exp(g) is a decay
            S_t = e^g S + k (beta (v - k^T e^g S))^T;   o = (q / sqrt(d_k))^T S_t     (the gated delta rule)
            out = ssm_out(rms_norm(o) * ssm_norm * silu(h @ attn_gate))   per-head gated RMS norm
  attention q|gate = h @ attn_q (per head: d values of q, then d of the gate); q/k RMS-normed per head,
            NEOX rope on the first rope_dims (25%) of each head; out = attn_output(attn(q, k, v) * sigmoid(gate))

Weights are stored under llama.cpp's names with its conventions, so GGUF tensors pass through:
HF's zero-centred RMS norm weights (x * (1 + w)) are folded to 1 + w at load, A_log becomes
ssm_a = -exp(A_log), conv1d [C, 1, K] becomes [C, K]. The DeltaNet's own output norm is plain.

Value heads share key heads (v_heads = r * k_heads). HF groups them: v head h reads k head h // r.
llama.cpp's converter reorders v heads to tiled order (h reads k head h % k_heads) so ggml can
broadcast; `v_head_order` says which layout the weights use.

State, updated in place each call (so one decode program replays at every position):
    blk.{i}.conv_state [K-1, conv_dim]      the last K-1 conv inputs
    blk.{i}.ssm_state  [v_heads, d_k, d_v]  the recurrent state S
    blk.{i}.k_cache / v_cache [ctx, n_kv * head_dim]   attention layers
Recurrent state is not indexed by position: a new sequence must start from zeroed state
(`reset_recurrent`), and prefill chunks must not be padded.

Speculative decoding (graphir/speculative.py) cannot roll these states back by length, so it uses two
more phases. A "verify" graph is the prefill graph that also keeps the state after each of its tokens:
    blk.{i}.conv_steps [VERIFY_ROWS, K-1, conv_dim]   row step_rows[t]: the conv state after token t
    blk.{i}.ssm_steps  [VERIFY_ROWS, v_heads, d_k, d_v]
(Input "step_rows" [n]: run-time rows, so a 1-token drafting step can keep its state in row i). A
"commit" graph makes row state_row[0] (an Input) of both the current states: the state after the
last accepted token. Both are ordinary graphs, replayed at every position and acceptance pattern.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphir.builder import g
from graphir.errors import GraphError, LoadError
from graphir.ir import Graph, Node
from graphir.quant import dequantize
from graphir.weights import Weight, Weights

from . import random_init
from .family import (
    Family,
    ParamNodes,
    check_rules,
    checked_config,
    gguf_key,
    gguf_vocab,
    graph_meta,
    head_rules,
    hf_default_rope,
    rename_hf,
    size_rules,
    step_inputs,
)
from .family import check_weights as check_all_weights
from .layers import attention_out, gated_ffn, norm_rope_qk, output_head, project_heads, rms_norm_mul
from .names import HF_CAUSAL_LM_GLOBAL, HF_MLP, HF_SELF_ATTN, NameMap

L2_EPS = 1e-6  # HF's l2norm and the fla kernels hard-code it
RECURRENT_STATES = ("conv_state", "ssm_state")
# per-token state rows a verify graph keeps: the tokens of the largest speculative verify call
# (graphir.speculative.VERIFY_BUCKETS[-1]; a test holds the two equal)
VERIFY_ROWS = 16
STEP_ROWS = "step_rows"  # Input of "verify" graphs: the steps row each token's state goes to
STATE_ROW = "state_row"  # Input of the "commit" graph: the steps row that becomes the current state


@dataclass(frozen=True)
class Qwen35Config:
    n_vocab: int
    d_model: int
    n_layers: int
    n_heads: int  # attention layers
    n_kv_heads: int
    head_dim: int
    d_ff: int
    ssm_k_heads: int  # DeltaNet key/query heads
    ssm_v_heads: int  # DeltaNet value heads (a multiple of ssm_k_heads)
    ssm_k_dim: int
    ssm_v_dim: int
    ssm_conv_kernel: int = 4
    full_attn_interval: int = 4
    rope_dims: int = 0  # rotated dims per head; 0 means head_dim // 4 (partial_rotary_factor 0.25)
    rope_theta: float = 10_000_000.0
    rms_eps: float = 1e-6
    v_head_order: str = "grouped"  # "grouped" (HF) or "tiled" (llama.cpp GGUF)
    tied_embeddings: bool = False
    context_length: int = 262144
    ctx: int = 2048  # KV-cache capacity in rows
    arch: str = "qwen35"

    @property
    def n_rot(self) -> int:
        return self.rope_dims or self.head_dim // 4

    @property
    def conv_dim(self) -> int:
        return 2 * self.ssm_k_heads * self.ssm_k_dim + self.ssm_v_heads * self.ssm_v_dim


def is_recurrent(c: Qwen35Config, i: int) -> bool:
    """Layer i is a Gated DeltaNet layer (else full attention)."""
    return (i + 1) % c.full_attn_interval != 0


def param_shapes(c: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Every Param the graph reads, with its shape (numpy order; matrices are [n_out, n_in])."""
    d, hv, dv = c.d_model, c.ssm_v_heads, c.ssm_v_dim
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.n_vocab, d)}
    for i in range(c.n_layers):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (d,)
        if is_recurrent(c, i):
            shapes[b + "attn_qkv.weight"] = (c.conv_dim, d)
            shapes[b + "attn_gate.weight"] = (hv * dv, d)
            shapes[b + "ssm_beta.weight"] = (hv, d)
            shapes[b + "ssm_alpha.weight"] = (hv, d)
            shapes[b + "ssm_conv1d.weight"] = (c.conv_dim, c.ssm_conv_kernel)
            shapes[b + "ssm_a"] = (hv,)
            shapes[b + "ssm_dt.bias"] = (hv,)
            shapes[b + "ssm_norm.weight"] = (dv,)
            shapes[b + "ssm_out.weight"] = (d, hv * dv)
        else:
            shapes[b + "attn_q.weight"] = (2 * q_dim, d)  # q and its output gate, interleaved per head
            shapes[b + "attn_k.weight"] = (kv_dim, d)
            shapes[b + "attn_v.weight"] = (kv_dim, d)
            shapes[b + "attn_q_norm.weight"] = (c.head_dim,)
            shapes[b + "attn_k_norm.weight"] = (c.head_dim,)
            shapes[b + "attn_output.weight"] = (d, q_dim)
        shapes[b + "post_attention_norm.weight"] = (d,)
        shapes[b + "ffn_gate.weight"] = (c.d_ff, d)
        shapes[b + "ffn_up.weight"] = (c.d_ff, d)
        shapes[b + "ffn_down.weight"] = (d, c.d_ff)
    shapes["output_norm.weight"] = (d,)
    if not c.tied_embeddings:
        shapes["output.weight"] = (c.n_vocab, d)
    return shapes


def state_shapes(c: Qwen35Config) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for i in range(c.n_layers):
        b = f"blk.{i}."
        if is_recurrent(c, i):
            out[b + "conv_state"] = (c.ssm_conv_kernel - 1, c.conv_dim)
            out[b + "ssm_state"] = (c.ssm_v_heads, c.ssm_k_dim, c.ssm_v_dim)
        else:
            out[b + "k_cache"] = out[b + "v_cache"] = (c.ctx, c.n_kv_heads * c.head_dim)
    return out


def reset_recurrent(config: Qwen35Config, state: Mapping[str, np.ndarray]) -> None:
    """Zero the conv and recurrent states (a new sequence); KV rows past kv_len are never read."""
    for name, buf in state.items():
        # a pass may derive State names from ours ("blk.0.ssm_conv@tp1of2", one rank's part): the kind
        # is the last dotted part before any "@"
        if name.rsplit(".", 1)[-1].split("@", 1)[0] in RECURRENT_STATES:
            buf[...] = 0


def check_config(c: Qwen35Config) -> None:
    rules = [
        *size_rules(c, ("n_vocab", "d_model", "n_layers", "head_dim", "d_ff", "ssm_k_dim", "ssm_v_dim")),
        *head_rules(c),
        (c.ssm_k_heads >= 1, f"ssm_k_heads {c.ssm_k_heads} must be >= 1"),  # before the modulo below
        (c.ssm_v_heads >= 1, f"ssm_v_heads {c.ssm_v_heads} must be >= 1"),
        (c.ssm_k_heads < 1 or c.ssm_v_heads % c.ssm_k_heads == 0,
         f"ssm_v_heads {c.ssm_v_heads} must be a multiple of ssm_k_heads {c.ssm_k_heads}"),
        (0 < c.n_rot <= c.head_dim and c.n_rot % 2 == 0, f"rope_dims {c.n_rot} must be even and in 2..{c.head_dim}"),
        (c.ssm_conv_kernel >= 2, f"ssm_conv_kernel {c.ssm_conv_kernel} must be >= 2"),
        (c.full_attn_interval >= 1, f"full_attn_interval {c.full_attn_interval} must be >= 1"),
        (c.v_head_order in ("grouped", "tiled"), f"v_head_order must be 'grouped' or 'tiled', got {c.v_head_order!r}"),
        (c.ctx >= 1, f"ctx {c.ctx} must be >= 1"),
        # as llama's: a negative eps failed inside a cpu kernel, a zero theta made the rotations NaN
        (c.rms_eps >= 0, f"rms_eps {c.rms_eps} must be >= 0"),
        (c.rope_theta > 0, f"rope_theta {c.rope_theta} must be > 0"),
    ]
    check_rules(c.arch, rules)


# ---------------------------------------------------------------- the graph
def build(c: Qwen35Config, phase: str = "prefill", n_tokens: int | None = None,
          dtypes: Mapping[str, str] | None = None, last_only: bool = False) -> Graph:
    """The forward graph for `n_tokens` tokens (decode: 1); inputs tokens/pos/kv_idx/kv_len as in llama.py.
    State writes of the DeltaNet layers are the graph's `updates`. Phases "verify" and "commit": see the
    module doc (speculative decoding)."""
    check_config(c)
    if phase == "commit":
        return build_commit(c)
    verify = phase == "verify"
    n, tokens, pos, kv_idx, kv_len = step_inputs(c.arch, "prefill" if verify else phase, n_tokens)
    if verify and n > VERIFY_ROWS:
        raise GraphError(f"{c.arch}: a verify graph keeps at most VERIFY_ROWS={VERIFY_ROWS} per-token states, "
                         f"got n_tokens={n}")
    step_rows = g.input(STEP_ROWS, (n,), "i32") if verify else None
    p = ParamNodes(param_shapes(c), dtypes)

    updates: list[Node] = []
    x = g.get_rows(p("token_embd.weight"), tokens, name="token_embd")  # [n, d_model]
    for i in range(c.n_layers):
        h = rms_norm_mul(x, p(f"blk.{i}.attn_norm.weight"), c.rms_eps, f"blk.{i}.attn_norm")
        if is_recurrent(c, i):
            mixed = _delta_net(c, p, i, h, updates, step_rows)
        else:
            mixed = _attention(c, p, i, h, pos, kv_idx, kv_len)
        x = g.add(x, mixed, name=f"blk.{i}.attn_res")
        h = rms_norm_mul(x, p(f"blk.{i}.post_attention_norm.weight"), c.rms_eps, f"blk.{i}.ffn_norm")
        x = g.add(x, gated_ffn(p, i, h, g.swiglu_split), name=f"blk.{i}.out")
    logits = output_head(c, p, x, last_only)  # [n or 1, n_vocab]
    return Graph({"logits": logits}, updates, meta=graph_meta(c, phase, n, last_only))


def _heads(y: Node, start: int, heads: int, dim: int, name: str) -> Node:
    """Columns start.. of y [n, cols] as [n, heads, dim], a strided view (no copy)."""
    n, cols = y.shape
    return g.view(y, shape=(n, heads, dim), strides=(cols, dim, 1), offset=start, name=name)


def _tile_heads(x: Node, times: int, name: str) -> Node:
    """[n, h, d] -> [n, h * times, d] with head j = x head j % h (llama.cpp's tiled v-head order)."""
    out = x
    for _ in range(times - 1):
        out = g.concat(out, x, axis=1)
    return out.replace(name=name) if times > 1 else x


def build_commit(c: Qwen35Config) -> Graph:
    """Row state_row[0] of every DeltaNet layer's conv_steps and ssm_steps becomes its current state."""
    row = g.input(STATE_ROW, (1,), "i32")
    updates = []
    for i in range(c.n_layers):
        if is_recurrent(c, i):
            for kind, steps in (("conv", "conv_steps"), ("ssm", "ssm_steps")):
                state = g.state(f"blk.{i}.{kind}_state", state_shapes(c)[f"blk.{i}.{kind}_state"])
                kept = g.state(f"blk.{i}.{steps}", (VERIFY_ROWS, *state.shape))
                flat = g.reshape(kept, shape=(VERIFY_ROWS, math.prod(state.shape)))  # [rows, state elements]
                picked = g.get_rows(flat, row, name=f"blk.{i}.{steps}_pick")  # [1, state elements]
                updates.append(g.assign(state, g.reshape(picked, shape=state.shape), name=f"blk.{i}.{kind}_commit"))
    return Graph({}, updates, meta=graph_meta(c, "commit", 1, False))


def _conv_steps(c: Qwen35Config, b: str, qkv: Node, conv_state: Node, step_rows: Node,
                updates: list[Node]) -> Node:
    """The conv's input rows [state; x] [K-1+n, conv_dim], with the state after each token written to
    conv_steps: token t's state is rows t+1..t+K-1, so all of them are one overlapping view."""
    n, ch, hist = qkv.shape[0], c.conv_dim, c.ssm_conv_kernel - 1
    rows = g.concat(conv_state, qkv, axis=0, name=b + "conv_rows")  # [K-1+n, conv_dim]
    after = g.view(rows, shape=(n, hist, ch), strides=(ch, ch, 1), offset=ch, name=b + "conv_after")
    kept = g.state(b + "conv_steps", (VERIFY_ROWS, hist, ch))  # [rows, K-1, conv_dim]
    updates.append(g.set_rows(kept, g.cont(after), step_rows, name=b + "conv_steps_write"))
    return rows


def _delta_net(c: Qwen35Config, p: ParamNodes, i: int, h: Node, updates: list[Node],
               step_rows: Node | None = None) -> Node:
    b = f"blk.{i}."
    n = h.shape[0]
    hk, hv, dk, dv = c.ssm_k_heads, c.ssm_v_heads, c.ssm_k_dim, c.ssm_v_dim
    qkv = g.mul_mat(p(b + "attn_qkv.weight"), h, name=b + "attn_qkv")  # [n, conv_dim]
    z = g.mul_mat(p(b + "attn_gate.weight"), h, name=b + "attn_gate")  # [n, hv * dv]
    beta_raw = g.mul_mat(p(b + "ssm_beta.weight"), h, name=b + "ssm_beta")  # [n, hv]
    alpha = g.mul_mat(p(b + "ssm_alpha.weight"), h, name=b + "ssm_alpha")  # [n, hv]

    conv_state = g.state(b + "conv_state", (c.ssm_conv_kernel - 1, c.conv_dim))  # [K-1, conv_dim]
    conv_in = conv_state
    if step_rows is not None:  # the conv then reads the state through the rows it keeps (one reader of the State)
        rows = _conv_steps(c, b, qkv, conv_state, step_rows, updates)
        conv_in = g.view(rows, shape=conv_state.shape, strides=(c.conv_dim, 1), offset=0, name=b + "conv_old")
    conv = g.ssm_conv(qkv, conv_in, p(b + "ssm_conv1d.weight"), name=b + "ssm_conv")
    updates.append(g.assign(conv_state, g.item(conv, index=1), name=b + "conv_state_write"))
    y = g.silu(g.item(conv, index=0), name=b + "conv_silu")  # [n, conv_dim]

    q = g.l2_norm(_heads(y, 0, hk, dk, b + "q"), eps=L2_EPS, name=b + "q_l2")  # [n, hk, dk]
    k = g.l2_norm(_heads(y, hk * dk, hk, dk, b + "k"), eps=L2_EPS, name=b + "k_l2")  # [n, hk, dk]
    v = _heads(y, 2 * hk * dk, hv, dv, b + "v")  # [n, hv, dv]
    if c.v_head_order == "tiled" and hv != hk:
        q = _tile_heads(q, hv // hk, b + "q_tiled")  # [n, hv, dk]
        k = _tile_heads(k, hv // hk, b + "k_tiled")
    beta = g.sigmoid(beta_raw, name=b + "beta")  # [n, hv]
    gate = g.mul(g.softplus(g.add(alpha, p(b + "ssm_dt.bias"))), p(b + "ssm_a"), name=b + "gate")  # [n, hv], <= 0

    ssm_state = g.state(b + "ssm_state", (hv, dk, dv))  # [hv, dk, dv]
    gdn = g.gated_delta_net(q, k, v, gate, beta, ssm_state, scale=1.0 / math.sqrt(dk), steps=step_rows is not None,
                            name=b + "delta_net")
    updates.append(g.assign(ssm_state, g.item(gdn, index=1), name=b + "ssm_state_write"))
    if step_rows is not None:  # the state after each token [n, hv, dk, dv]
        kept = g.state(b + "ssm_steps", (VERIFY_ROWS, hv, dk, dv))
        updates.append(g.set_rows(kept, g.item(gdn, index=2), step_rows, name=b + "ssm_steps_write"))
    o = g.item(gdn, index=0)  # [n, hv, dv]

    o = rms_norm_mul(o, p(b + "ssm_norm.weight"), c.rms_eps, b + "ssm_norm")  # per head
    o = g.mul(o, g.silu(g.reshape(z, shape=(n, hv, dv))), name=b + "ssm_gated")  # [n, hv, dv]
    o = g.reshape(o, shape=(n, hv * dv))  # [n, hv * dv]
    return g.mul_mat(p(b + "ssm_out.weight"), o, name=b + "ssm_out")  # [n, d_model]


def _attention(c: Qwen35Config, p: ParamNodes, i: int, h: Node, pos: Node, kv_idx: Node, kv_len: Node) -> Node:
    b = f"blk.{i}."
    n, hd = h.shape[0], c.head_dim
    qg = g.mul_mat(p(b + "attn_q.weight"), h, name=b + "attn_q")  # [n, n_head * 2 * head_dim]
    row = (2 * c.n_heads * hd, 2 * hd, 1)
    q = g.view(qg, shape=(n, c.n_heads, hd), strides=row, offset=0, name=b + "q")  # [n, n_head, head_dim]
    gate = g.view(qg, shape=(n, c.n_heads, hd), strides=row, offset=hd, name=b + "q_gate")
    k = project_heads(p, b + "attn_k.weight", h, c.n_kv_heads, hd)  # [n, n_kv, head_dim]
    v = project_heads(p, b + "attn_v.weight", h, c.n_kv_heads, hd)  # [n, n_kv, head_dim]
    q, k = norm_rope_qk(c, p, b, q, k, pos, {"n_dims": c.n_rot, "mode": "neox", "theta": float(c.rope_theta)})
    # Cache rows are whole tokens, [ctx, n_kv * head_dim]; attention reads them as [ctx, n_kv, head_dim].
    row, heads = c.n_kv_heads * hd, (c.ctx, c.n_kv_heads, hd)
    k_all = g.set_rows(g.state(b + "k_cache", (c.ctx, row)), g.reshape(k, shape=(n, row)), kv_idx,
                       name=b + "k_cache_write")
    v_all = g.set_rows(g.state(b + "v_cache", (c.ctx, row)), g.reshape(v, shape=(n, row)), kv_idx,
                       name=b + "v_cache_write")
    k_all, v_all = g.reshape(k_all, shape=heads), g.reshape(v_all, shape=heads)  # [ctx, n_kv, head_dim]
    o = g.flash_attn(q, k_all, v_all, pos, kv_len, scale=1.0 / math.sqrt(hd), name=b + "attn")  # [n, n_head, hd]
    o = g.mul(o, g.sigmoid(gate), name=b + "attn_gated")
    return attention_out(p, b, o)  # [n, d_model]


# ---------------------------------------------------------------- HF checkpoints
HF_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    **HF_SELF_ATTN,
    **HF_MLP,
}
# Zero-centred RMS norms: HF computes x * (1 + w); we (and llama.cpp) store 1 + w.
HF_CENTERED = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
               "output_norm.weight")
HF_SKIPPED = re.compile(r"^(mtp\.|model\.visual\.|model\.mtp\.)|rotary_emb\.inv_freq$")
HF_NAMES = NameMap(HF_CAUSAL_LM_GLOBAL, HF_LAYER)


def config_from_hf(hf: Mapping[str, Any], label: str = "config.json") -> Qwen35Config:
    """The config of an HF Qwen3_5ForCausalLM (or the text part of Qwen3_5ForConditionalGeneration)."""
    text = {**hf, **(hf.get("text_config") or {})}
    if text.get("attention_bias"):
        raise LoadError(f"{label}: attention_bias=true is not supported")
    if not text.get("attn_output_gate", True):
        raise LoadError(f"{label}: attn_output_gate=false is not supported")
    if text.get("hidden_act", "silu") != "silu":
        raise LoadError(f"{label}: hidden_act {text.get('hidden_act')!r} is not supported (silu only)")
    rope = hf_default_rope(text, label)
    try:
        n_layers, d_model = int(text["num_hidden_layers"]), int(text["hidden_size"])
        head_dim = int(text.get("head_dim") or d_model // max(int(text["num_attention_heads"]), 1))
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        interval = int(text.get("full_attention_interval", 4))
        fields = dict(
            n_vocab=int(text["vocab_size"]),
            d_model=d_model,
            n_layers=n_layers,
            n_heads=int(text["num_attention_heads"]),
            n_kv_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
            head_dim=head_dim,
            d_ff=int(text["intermediate_size"]),
            ssm_k_heads=int(text.get("linear_num_key_heads", 16)),
            ssm_v_heads=int(text.get("linear_num_value_heads", 32)),
            ssm_k_dim=int(text.get("linear_key_head_dim", 128)),
            ssm_v_dim=int(text.get("linear_value_head_dim", 128)),
            ssm_conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            full_attn_interval=interval,
            rope_dims=int(head_dim * partial),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))),
            rms_eps=float(text.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            context_length=int(text.get("max_position_embeddings", 262144)),
        )
    except KeyError as e:
        raise LoadError(f"{label}: missing key {e.args[0]!r}") from None
    kinds = text.get("layer_types")
    if interval < 1:  # before the layer pattern below divides by it
        raise LoadError(f"{label}: full_attention_interval {interval} must be >= 1")
    if kinds is not None:
        want = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        if list(kinds) != want:
            raise LoadError(f"{label}: layer_types {kinds} is not every {interval}th layer full attention")
    return Qwen35Config(**fields)


def hf_to_param_name(name: str) -> str | None:
    """Our Param name for an HF tensor name; None for tensors the text graph does not use."""
    return HF_NAMES.to_ours(name.replace("model.language_model.", "model.", 1))


def param_to_hf_name(name: str) -> str:
    return HF_NAMES.to_file(name)


def _f32(w: Weight) -> np.ndarray:
    return np.asarray(dequantize(w.data, w.dtype, tuple(w.shape)), np.float32)


def hf_tensor(ours: str, w: Weight) -> Weight:
    """An HF tensor in our convention: 1 + w for zero-centred norms, ssm_a = -exp(A_log), conv [C, K]."""
    rest = ours.split(".", 2)[-1] if ours.startswith("blk.") else ours
    if rest in HF_CENTERED:
        return Weight("f32", tuple(w.shape), 1.0 + _f32(w))
    if rest == "ssm_a":
        return Weight("f32", tuple(w.shape), -np.exp(_f32(w)))
    if rest == "ssm_conv1d.weight" and len(w.shape) == 3:
        shape = (w.shape[0], w.shape[2])  # [C, 1, K] -> [C, K]
        return Weight(w.dtype, shape, w.data.reshape(shape))
    return w


def tensor_to_hf(ours: str, a: np.ndarray) -> np.ndarray:
    """hf_tensor's inverse on an f32 array: w - 1 for zero-centred norms, A_log = log(-ssm_a), conv [C, 1, K]."""
    rest = ours.split(".", 2)[-1] if ours.startswith("blk.") else ours
    if rest in HF_CENTERED:
        return a - 1.0
    if rest == "ssm_a":
        return np.log(-a)
    if rest == "ssm_conv1d.weight":
        return a.reshape(a.shape[0], 1, a.shape[1])
    return a


def config_to_hf(c: Qwen35Config) -> dict[str, Any]:
    """The config.json of an HF Qwen3_5ForCausalLM of these shapes (config_from_hf's inverse)."""
    if c.v_head_order != "grouped":
        raise LoadError(f"{c.arch}: value heads in llama.cpp's tiled order have no HF equivalent")
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": c.n_vocab,
            "hidden_size": c.d_model, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
            "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "intermediate_size": c.d_ff,
            "linear_num_key_heads": c.ssm_k_heads, "linear_num_value_heads": c.ssm_v_heads,
            "linear_key_head_dim": c.ssm_k_dim, "linear_value_head_dim": c.ssm_v_dim,
            "linear_conv_kernel_dim": c.ssm_conv_kernel, "full_attention_interval": c.full_attn_interval,
            "layer_types": ["linear_attention" if is_recurrent(c, i) else "full_attention" for i in range(c.n_layers)],
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                                "partial_rotary_factor": c.n_rot / c.head_dim},
            "rms_norm_eps": c.rms_eps, "tie_word_embeddings": c.tied_embeddings,
            "max_position_embeddings": c.context_length}


def weights_from_hf(config: Qwen35Config, raw: Weights) -> Weights:
    """HF tensors (by HF name) renamed and converted to our Params; unused vision/MTP tensors are skipped."""
    checked_config(config, check_config, raw.source)
    # the multimodal checkpoint keeps the text model under model.language_model.
    text = Weights({k.replace("model.language_model.", "model.", 1): w for k, w in raw.items()}, source=raw.source)
    out = rename_hf(config, text, HF_NAMES, lambda name: bool(HF_SKIPPED.search(name)), hf_tensor)
    check_weights(config, out, hf_names=True)
    return out


# ---------------------------------------------------------------- GGUF files (llama.cpp arch "qwen35")
GGUF_ARCH = "qwen35"


def config_from_gguf(md: Mapping[str, Any], tensors: Mapping[str, Any], label: str = "gguf") -> Qwen35Config:
    """The config of a llama.cpp `qwen35` GGUF; `tensors` maps names to anything with a numpy-order `shape`."""

    key = gguf_key(md, GGUF_ARCH, label, per_layer=("attention.head_count", "attention.head_count_kv",
                                                    "feed_forward_length"))

    def scalar(v: Any) -> int:  # some hybrid files store per-layer arrays; take the nonzero value
        if isinstance(v, (list, tuple, np.ndarray)):
            nz = [int(x) for x in v if int(x)]
            return nz[0] if nz else 0
        return int(v)

    if md.get("general.architecture") != GGUF_ARCH:
        raise LoadError(f"{label}: architecture {md.get('general.architecture')!r} is not {GGUF_ARCH!r}")
    if "token_embd.weight" not in tensors:
        raise LoadError(f"{label}: missing tensor 'token_embd.weight'")
    d_model, n_heads = int(key("embedding_length")), scalar(key("attention.head_count"))
    head_dim = int(key("attention.key_length", d_model // max(n_heads, 1)))  # n_heads 0: check_config names it
    hv = int(key("ssm.time_step_rank"))
    mtp = int(key("nextn_predict_layers", 0))  # MTP blocks come after the trunk: unused
    fields = dict(
        n_vocab=gguf_vocab(tensors, label),
        d_model=d_model,
        n_layers=int(key("block_count")) - mtp,
        n_heads=n_heads,
        n_kv_heads=scalar(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=scalar(key("feed_forward_length")),
        ssm_k_heads=int(key("ssm.group_count")),
        ssm_v_heads=hv,
        ssm_k_dim=int(key("ssm.state_size")),
        ssm_v_dim=int(key("ssm.inner_size")) // max(hv, 1),  # hv 0: check_config names ssm_v_heads
        ssm_conv_kernel=int(key("ssm.conv_kernel")),
        full_attn_interval=int(key("full_attention_interval", 4)),
        rope_dims=int(key("rope.dimension_count", head_dim // 4)),
        rope_theta=float(key("rope.freq_base", 10_000_000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        v_head_order="tiled",
        tied_embeddings="output.weight" not in tensors,
        context_length=int(key("context_length")),
    )
    return Qwen35Config(**fields)


def weights_from_gguf(config: Qwen35Config, weights: Weights) -> Weights:
    """GGUF tensors already carry our names and conventions: drop the MTP blocks (blk.{n_layers}..), check
    the rest and pass them through."""
    mtp = re.compile(r"blk\.(\d+)\.")
    keep = {k: w for k, w in weights.items() if not ((m := mtp.match(k)) and int(m.group(1)) >= config.n_layers)}
    out = weights if len(keep) == len(weights) else Weights(keep, source=weights.source)
    checked_config(config, check_config, weights.source)
    check_weights(config, out)
    return out


def check_weights(config: Qwen35Config, weights: Weights, hf_names: bool = False) -> None:
    """Every Param present with its shape; no tensor left unused."""
    check_all_weights(config, weights, param_shapes(config), param_to_hf_name if hf_names else None)


# ---------------------------------------------------------------- random presets
PRESETS: dict[str, tuple[Qwen35Config, str]] = {
    "qwen35-tiny": (Qwen35Config(n_vocab=272, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                                 d_ff=96, ssm_k_heads=2, ssm_v_heads=4, ssm_k_dim=16, ssm_v_dim=16,
                                 tied_embeddings=True, context_length=256, ctx=256), "f32"),
    # Qwen/Qwen3.5-0.8B (text): 24 layers, [3 DeltaNet, 1 attention] x 6
    "qwen35-0.8b": (Qwen35Config(n_vocab=248320, d_model=1024, n_layers=24, n_heads=8, n_kv_heads=2, head_dim=256,
                                 d_ff=3584, ssm_k_heads=16, ssm_v_heads=16, ssm_k_dim=128, ssm_v_dim=128,
                                 rope_theta=10_000_000.0, tied_embeddings=True, context_length=262144), "bf16"),
    # a 9.0B-parameter hybrid for GPU benchmarks: Qwen3.5's layer pattern and head sizes at d_model 4096
    # (32 layers: [3 DeltaNet, 1 attention] x 8; 16 key / 32 value DeltaNet heads of 128); our own
    # scaling, not a published checkpoint's config
    "qwen35-9b": (Qwen35Config(n_vocab=248320, d_model=4096, n_layers=32, n_heads=16, n_kv_heads=4, head_dim=256,
                               d_ff=12288, ssm_k_heads=16, ssm_v_heads=32, ssm_k_dim=128, ssm_v_dim=128,
                               rope_theta=10_000_000.0, context_length=262144, ctx=8192), "bf16"),
}  # fmt: skip


def random_weights(config: Qwen35Config, dtype: str = "f32", seed: int = 0) -> Weights:
    """Seeded random weights (models.random_init) with DeltaNet gates that decay (ssm_a in
    [-1.6, -0.01]), dt biases near 1 and a conv kernel of unit gain."""

    def special(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray | None:
        rest = name.split(".", 2)[-1]
        if rest == "ssm_a":
            return -np.exp(rng.uniform(np.log(0.01), np.log(1.6), shape))
        if rest == "ssm_dt.bias":
            return np.ones(shape, np.float32)
        if rest == "ssm_conv1d.weight":
            return rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])
        return None

    return random_init.random_weights(config.arch, param_shapes(config), dtype, seed, special)


FAMILY = Family(
    name="qwen35",
    config_type=Qwen35Config,
    gguf_archs=(GGUF_ARCH,),
    hf_architectures=HF_ARCHITECTURES,
    hf_model_types=("qwen3_5", "qwen3_5_text"),
    config_from_gguf=config_from_gguf,
    weights_from_gguf=weights_from_gguf,
    config_from_hf=config_from_hf,
    weights_from_hf=weights_from_hf,
    hf_names=HF_NAMES,
    param_shapes=param_shapes,
    build=build,
    presets=PRESETS,
    random_weights=random_weights,
    reset_state=reset_recurrent,
    config_to_hf=config_to_hf,
    tensor_to_hf=tensor_to_hf,
)
