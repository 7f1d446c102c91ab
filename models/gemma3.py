"""The Gemma 3 family (text; HF Gemma3ForCausalLM, llama.cpp `gemma3`): config, graph, file names, presets.

Each block, with a norm before and after each sublayer:
    x = x + post_attention_norm(attn(attn_norm(x)))      GQA, q/k RMS-normed per head, NEOX rope
    x = x + post_ffw_norm(down(gelu_tanh(gate(h)) * up(h))),  h = ffn_norm(x)
where norm(x) = rms_norm(x) * w. The input is token_embd[tokens] * sqrt(d_model), the output
logits = head(output_norm(x)), soft-capped to cap * tanh(logits / cap) when the config has a cap.

Layers are sliding-window (query p sees keys p - window < j <= p) or global, in the file's pattern
(by default every 6th layer global). The two kinds have their own rope bases (local 10k, global 1M).
The window is a build-time constant of the attention op; positions are Inputs, so one decode graph
serves every position, before and past the window.

Weights use llama.cpp's names and its norm convention: HF's norms compute x * (1 + w) and the GGUF
converter stores 1 + w, so HF norm weights get the 1 added at load.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphir.builder import g
from graphir.errors import LoadError
from graphir.ir import Graph, Node
from graphir.quant import dequantize
from graphir.weights import Weight, Weights

from . import random_init
from .family import (
    Family,
    ParamNodes,
    check_rope_objects,
    check_rules,
    check_weights,
    checked_config,
    checked_gguf_weights,
    gguf_key,
    gguf_vocab,
    graph_meta,
    head_rules,
    no_state_to_reset,
    rename_hf,
    size_rules,
    step_inputs,
)
from .layers import attention, gated_ffn, output_head, rms_norm_mul
from .names import HF_CAUSAL_LM_GLOBAL, HF_MLP, HF_SELF_ATTN, NameMap

GLOBAL_EVERY = 6  # Gemma 3's pattern when a file states none: 5 sliding layers, then 1 global


@dataclass(frozen=True)
class Gemma3Config:
    n_vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    sliding: tuple[bool, ...]  # per layer: True for sliding-window attention, False for global
    sliding_window: int = 512  # keys a sliding layer sees, the query's own included
    rope_theta: float = 1_000_000.0  # global layers
    rope_theta_local: float = 10_000.0  # sliding layers
    rope_freq_scale: float = 1.0  # global layers' linear rope scaling (1 / factor)
    attn_scale: float = 0.0  # 0: 1 / sqrt(head_dim)
    final_softcap: float = 0.0  # 0: no soft-capping of the logits
    rms_eps: float = 1e-6
    tied_embeddings: bool = True
    context_length: int = 32768
    ctx: int = 2048  # KV-cache capacity in rows
    arch: str = "gemma3"


def layer_pattern(n_layers: int, every: int = GLOBAL_EVERY) -> tuple[bool, ...]:
    """Sliding flags with every `every`-th layer global."""
    return tuple((i + 1) % every != 0 for i in range(n_layers))


def param_shapes(c: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Every Param the graph reads, with its shape (numpy order; matrices are [n_out, n_in])."""
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.n_vocab, c.d_model)}
    for i in range(c.n_layers):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (c.d_model,)
        shapes[b + "attn_q.weight"] = (q_dim, c.d_model)
        shapes[b + "attn_k.weight"] = (kv_dim, c.d_model)
        shapes[b + "attn_v.weight"] = (kv_dim, c.d_model)
        shapes[b + "attn_q_norm.weight"] = (c.head_dim,)
        shapes[b + "attn_k_norm.weight"] = (c.head_dim,)
        shapes[b + "attn_output.weight"] = (c.d_model, q_dim)
        shapes[b + "post_attention_norm.weight"] = (c.d_model,)
        shapes[b + "ffn_norm.weight"] = (c.d_model,)
        shapes[b + "ffn_gate.weight"] = (c.d_ff, c.d_model)
        shapes[b + "ffn_up.weight"] = (c.d_ff, c.d_model)
        shapes[b + "ffn_down.weight"] = (c.d_model, c.d_ff)
        shapes[b + "post_ffw_norm.weight"] = (c.d_model,)
    shapes["output_norm.weight"] = (c.d_model,)
    if not c.tied_embeddings:
        shapes["output.weight"] = (c.n_vocab, c.d_model)
    return shapes


def check_config(c: Gemma3Config) -> None:
    rules = [
        *size_rules(c, ("n_vocab", "d_model", "n_layers", "head_dim", "d_ff")),
        *head_rules(c),
        (c.head_dim % 2 == 0, f"head_dim {c.head_dim} must be even for rope"),
        (len(c.sliding) == c.n_layers, f"the layer pattern has {len(c.sliding)} entries for {c.n_layers} layers"),
        (c.sliding_window >= 1, f"sliding_window {c.sliding_window} must be >= 1"),
        (c.final_softcap >= 0, f"final_softcap {c.final_softcap} must be >= 0 (0: none)"),
        (c.ctx >= 1, f"ctx {c.ctx} must be >= 1"),
        # as llama's: a negative eps failed inside a cpu kernel, a zero theta made the rotations NaN
        (c.rms_eps >= 0, f"rms_eps {c.rms_eps} must be >= 0"),
        (c.rope_theta > 0 and c.rope_theta_local > 0,
         f"rope_theta {c.rope_theta} and rope_theta_local {c.rope_theta_local} must be > 0"),
    ]
    check_rules(c.arch, rules)


def build(c: Gemma3Config, phase: str = "prefill", n_tokens: int | None = None,
          dtypes: Mapping[str, str] | None = None, last_only: bool = False) -> Graph:
    """The forward graph for `n_tokens` tokens (decode: 1); inputs tokens/pos/kv_idx/kv_len as in llama.py."""
    check_config(c)
    n, tokens, pos, kv_idx, kv_len = step_inputs(c.arch, phase, n_tokens)
    p = ParamNodes(param_shapes(c), dtypes)

    x = g.get_rows(p("token_embd.weight"), tokens)  # [n, d_model]
    x = g.scale(x, s=math.sqrt(c.d_model), name="token_embd")
    for i in range(c.n_layers):
        b = f"blk.{i}."
        h = rms_norm_mul(x, p(b + "attn_norm.weight"), c.rms_eps, b + "attn_norm")
        a = rms_norm_mul(_attention(c, p, i, h, pos, kv_idx, kv_len), p(b + "post_attention_norm.weight"),
                         c.rms_eps, b + "post_attention_norm")
        x = g.add(x, a, name=b + "attn_res")
        h = rms_norm_mul(x, p(b + "ffn_norm.weight"), c.rms_eps, b + "ffn_norm")
        f = rms_norm_mul(gated_ffn(p, i, h, _gelu_times), p(b + "post_ffw_norm.weight"), c.rms_eps,
                         b + "post_ffw_norm")
        x = g.add(x, f, name=b + "out")
    logits = output_head(c, p, x, last_only, "logits" if not c.final_softcap else "logits_raw")  # [n or 1, n_vocab]
    if c.final_softcap:
        # cap * tanh(y / cap) = 2 cap * sigmoid(2 y / cap) - cap: no tanh op needed
        s = g.sigmoid(g.scale(logits, s=2.0 / c.final_softcap))
        logits = g.scale(s, s=2.0 * c.final_softcap, b=-c.final_softcap, name="logits")
    return Graph({"logits": logits}, meta=graph_meta(c, phase, n, last_only))


def _attention(c: Gemma3Config, p: ParamNodes, i: int, h: Node, pos: Node, kv_idx: Node, kv_len: Node) -> Node:
    local = c.sliding[i]
    rope = {"n_dims": c.head_dim, "mode": "neox", "theta": float(c.rope_theta_local if local else c.rope_theta),
            "freq_scale": 1.0 if local else float(c.rope_freq_scale)}
    return attention(c, p, i, h, pos, kv_idx, kv_len, rope=rope, scale=c.attn_scale or 1.0 / math.sqrt(c.head_dim),
                     cache_rows=c.ctx, window=c.sliding_window if local else 0)


def _gelu_times(gate: Node, up: Node, name: str) -> Node:
    return g.mul(g.gelu(gate), up, name=name)  # [n, d_ff]


# ---------------------------------------------------------------- GGUF files (llama.cpp `gemma3`)
GGUF_ARCH = "gemma3"
_BIG_27B_LAYERS = 62  # llama.cpp scales the 27B model's queries by 1/sqrt(d_model / n_heads), not head_dim


def config_from_gguf(md: Mapping[str, Any], tensors: Mapping[str, Any], label: str = "gguf") -> Gemma3Config:
    key = gguf_key(md, GGUF_ARCH, label)
    if md.get("general.architecture") != GGUF_ARCH:
        raise LoadError(f"{label}: architecture {md.get('general.architecture')!r} is not {GGUF_ARCH!r}")
    if "token_embd.weight" not in tensors:
        raise LoadError(f"{label}: missing tensor 'token_embd.weight'")
    cap = md.get(f"{GGUF_ARCH}.attn_logit_softcapping")
    if cap is not None and not (isinstance(cap, (int, float)) and cap == 0):  # an array: refused, not a ValueError
        raise LoadError(f"{label}: {GGUF_ARCH}.attn_logit_softcapping is not supported (Gemma 2's attention cap)")
    d_model, n_heads, n_layers = int(key("embedding_length")), int(key("attention.head_count")), int(key("block_count"))
    head_dim = int(key("attention.key_length", d_model // max(n_heads, 1)))  # n_heads 0: check_config names it
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise LoadError(f"{label}: {GGUF_ARCH}.attention.value_length must equal key_length {head_dim}")
    window = key("attention.sliding_window")
    if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 1:
        raise LoadError(f"{label}: {GGUF_ARCH}.attention.sliding_window = {window!r} must be an int >= 1")
    scaling = md.get(f"{GGUF_ARCH}.rope.scaling.type", "none")
    if scaling not in ("none", "linear", None):
        raise LoadError(f"{label}: {GGUF_ARCH}.rope.scaling.type {scaling!r} is not supported (none, linear)")
    factor = float(key("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    if factor <= 0:  # 0 was a ZeroDivisionError below; a negative factor turned the rotations back
        raise LoadError(f"{label}: {GGUF_ARCH}.rope.scaling.factor {factor} must be > 0")
    if f"{GGUF_ARCH}.attention.scale" in md:
        scale = float(key("attention.scale"))
        if scale <= 0:  # the config's 0 stands for 1 / sqrt(head_dim); a file's 0 is no scale
            raise LoadError(f"{label}: {GGUF_ARCH}.attention.scale {scale} must be > 0")
    else:
        scale = 1.0 / math.sqrt(d_model / max(n_heads, 1) if n_layers == _BIG_27B_LAYERS else head_dim)
    return Gemma3Config(
        n_vocab=gguf_vocab(tensors, label),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(key("feed_forward_length")),
        sliding=_gguf_pattern(md, n_layers, label),
        sliding_window=int(window),
        rope_theta=float(key("rope.freq_base", 1_000_000.0)),
        rope_theta_local=float(key("rope.freq_base_swa", 10_000.0)),
        rope_freq_scale=1.0 / factor,
        attn_scale=float(scale),
        final_softcap=float(key("final_logit_softcapping", 0.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in tensors,
        context_length=int(key("context_length")),
    )


def _gguf_pattern(md: Mapping[str, Any], n_layers: int, label: str) -> tuple[bool, ...]:
    """`gemma3.attention.sliding_window_pattern`: absent (every 6th layer global, as llama.cpp assumes),
    a period, or one flag per layer (true: sliding)."""
    name = f"{GGUF_ARCH}.attention.sliding_window_pattern"
    v = md.get(name)
    if v is None:
        return layer_pattern(n_layers)
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        if v < 1:
            raise LoadError(f"{label}: {name} = {v} must be >= 1")
        return layer_pattern(n_layers, int(v))
    if not isinstance(v, (list, np.ndarray)):  # a float or bool was a TypeError (not iterable)
        raise LoadError(f"{label}: {name} = {v!r} must be a period (an int >= 1) or one flag per layer")
    flags = [bool(f) for f in v]
    if len(flags) != n_layers:
        raise LoadError(f"{label}: {name} has {len(flags)} entries for block_count {n_layers}")
    return tuple(flags)


def weights_from_gguf(config: Gemma3Config, weights: Weights) -> Weights:
    """GGUF tensors already carry our names and norm convention: check them and pass them through."""
    return checked_gguf_weights(config, weights, check_config, param_shapes(config))


# ---------------------------------------------------------------- HF checkpoints
HF_ARCHITECTURES = ("Gemma3ForCausalLM",)
HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    **HF_SELF_ATTN,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    **HF_MLP,
}
HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
HF_NAMES = NameMap(HF_CAUSAL_LM_GLOBAL, HF_LAYER)
HF_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def config_from_hf(hf: Mapping[str, Any], label: str = "config.json") -> Gemma3Config:
    """The config of an HF Gemma3ForCausalLM (model_type gemma3_text)."""
    for flag in ("attention_bias", "use_bidirectional_attention", "attn_logit_softcapping"):
        if hf.get(flag):
            raise LoadError(f"{label}: {flag}={hf[flag]!r} is not supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in HF_ACTIVATIONS:
        raise LoadError(f"{label}: hidden_activation {act!r} is not supported ({', '.join(HF_ACTIVATIONS)})")
    try:
        n_layers, d_model = int(hf["num_hidden_layers"]), int(hf["hidden_size"])
        n_heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or d_model // max(n_heads, 1))  # n_heads 0: check_config names it
        global_rope, local_rope = _hf_rope(hf, label)
        window = hf.get("sliding_window")
        return Gemma3Config(
            n_vocab=int(hf["vocab_size"]),
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            d_ff=int(hf["intermediate_size"]),
            sliding=_hf_pattern(hf, n_layers, label),
            sliding_window=int(window) if window else int(hf.get("max_position_embeddings", 131072)),
            rope_theta=global_rope[0],
            rope_theta_local=local_rope[0],
            rope_freq_scale=global_rope[1],
            attn_scale=_hf_query_scale(hf, head_dim, label),
            final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(hf.get("tie_word_embeddings", True)),
            context_length=int(hf.get("max_position_embeddings", 131072)),
        )
    except KeyError as e:
        raise LoadError(f"{label}: missing key {e.args[0]!r}") from None


def _hf_query_scale(hf: Mapping[str, Any], head_dim: int, label: str) -> float:
    scalar = hf.get("query_pre_attn_scalar", head_dim)
    if not float(scalar) > 0:  # 0 ** -0.5 was a ZeroDivisionError
        raise LoadError(f"{label}: query_pre_attn_scalar = {scalar} must be > 0")
    return float(scalar) ** -0.5


def _hf_pattern(hf: Mapping[str, Any], n_layers: int, label: str) -> tuple[bool, ...]:
    kinds = hf.get("layer_types")
    if kinds is None:
        every = int(hf.get("sliding_window_pattern", GLOBAL_EVERY))
        if every < 1:  # as the GGUF key: 0 divided by zero, a negative period made a pattern nobody wrote
            raise LoadError(f"{label}: sliding_window_pattern = {every} must be >= 1")
        return layer_pattern(n_layers, every)
    bad = [k for k in kinds if k not in ("sliding_attention", "full_attention")]
    if len(kinds) != n_layers or bad:
        raise LoadError(f"{label}: layer_types must list 'sliding_attention'/'full_attention' for each of "
                        f"{n_layers} layers, got {list(kinds)}")
    return tuple(k == "sliding_attention" for k in kinds)


def _hf_rope(hf: Mapping[str, Any], label: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """((theta, freq_scale) of global layers, the same of sliding layers). transformers 5 writes
    rope_parameters per layer kind; older configs rope_theta, rope_local_base_freq and rope_scaling."""
    check_rope_objects(hf, label)  # dict(5) below was a TypeError
    params = hf.get("rope_parameters") or {}
    if "full_attention" not in params:
        legacy = dict(hf.get("rope_scaling") or {})
        params = {"full_attention": {**legacy, "rope_theta": hf.get("rope_theta", 1_000_000.0)},
                  "sliding_attention": {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}}
    out = []
    for kind, theta in (("full_attention", 1_000_000.0), ("sliding_attention", 10_000.0)):
        p = params.get(kind) or {}
        if not isinstance(p, Mapping):
            raise LoadError(f"{label}: rope_parameters of {kind} layers must be an object, got {p!r}")
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ("default", "linear"):
            raise LoadError(f"{label}: rope_type {rope_type!r} of {kind} layers is not supported (default, linear)")
        factor = float(p.get("factor", 1.0)) if rope_type == "linear" else 1.0
        if not factor > 0:  # 1 / 0 below was a ZeroDivisionError
            raise LoadError(f"{label}: rope factor {factor} of {kind} layers must be > 0")
        out.append((float(p.get("rope_theta", theta)), 1.0 / factor))
    return out[0], out[1]


def hf_tensor(ours: str, w: Weight) -> Weight:
    """HF norm weights w become 1 + w (f32): our norms multiply by the stored weight."""
    if ours.endswith("norm.weight"):
        return Weight("f32", tuple(w.shape), 1.0 + np.asarray(dequantize(w.data, w.dtype, tuple(w.shape)), np.float32))
    return w


def weights_from_hf(config: Gemma3Config, raw: Weights) -> Weights:
    checked_config(config, check_config, raw.source)
    out = rename_hf(config, raw, HF_NAMES, lambda name: bool(HF_IGNORED.match(name)), hf_tensor)
    check_weights(config, out, param_shapes(config), HF_NAMES.to_file)
    return out


# ---------------------------------------------------------------- chat
# Gemma's turn format, for GGUF files that carry no template: turns are <start_of_turn>{user|model}\n
# text <end_of_turn>\n; a system message is prefixed to the first user turn (Gemma has no system role);
# roles must alternate. Written for graphir from the documented format.
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set prefix = messages[0]['content'] + '\n\n' -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set prefix = '' -%}
{%- set turns = messages -%}
{%- endif -%}
{%- for m in turns -%}
{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('roles must alternate user, assistant, user, ... after an optional system message') }}
{%- endif -%}
{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}
{{- (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\n' }}
{%- endif -%}
"""


# ---------------------------------------------------------------- random presets
PRESETS: dict[str, tuple[Gemma3Config, str]] = {
    # 7 layers: the 6th is global, the rest slide over 16 keys
    "gemma3-tiny": (Gemma3Config(n_vocab=272, d_model=64, n_layers=7, n_heads=4, n_kv_heads=2, head_dim=16,
                                 d_ff=96, sliding=layer_pattern(7), sliding_window=16, context_length=256,
                                 ctx=256), "f32"),
    # google/gemma-3-270m: 18 layers, [5 sliding, 1 global] x 3
    "gemma3-270m": (Gemma3Config(n_vocab=262144, d_model=640, n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256,
                                 d_ff=2048, sliding=layer_pattern(18), sliding_window=512,
                                 context_length=32768), "bf16"),
}  # fmt: skip


def random_weights(config: Gemma3Config, dtype: str = "f32", seed: int = 0) -> Weights:
    """Seeded random weights (models.random_init); the embedding has std 1/sqrt(d_model) like every
    matrix, so after the sqrt(d_model) input scale activations have about unit size."""
    return random_init.random_weights(config.arch, param_shapes(config), dtype, seed)


FAMILY = Family(
    name="gemma3",
    config_type=Gemma3Config,
    gguf_archs=(GGUF_ARCH,),
    hf_architectures=HF_ARCHITECTURES,
    hf_model_types=("gemma3_text",),
    config_from_gguf=config_from_gguf,
    weights_from_gguf=weights_from_gguf,
    config_from_hf=config_from_hf,
    weights_from_hf=weights_from_hf,
    hf_names=HF_NAMES,
    param_shapes=param_shapes,
    build=build,
    presets=PRESETS,
    random_weights=random_weights,
    reset_state=no_state_to_reset,
    default_chat_template=CHAT_TEMPLATE,
)
