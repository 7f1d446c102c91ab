"""The Llama family (Llama, SmolLM2; Qwen2/2.5 and Qwen3 through options): config, graph builder, file names, presets.

Each block, pre-norm with residuals:
    x = x + attn(rms_norm(x) * attn_norm)          GQA, rope on q/k, KV written into State
    x = x + down(silu(gate(h)) * up(h)),  h = rms_norm(x) * ffn_norm
then logits = output(rms_norm(x) * output_norm), `output` being token_embd when tied.

Runtime values are Inputs, so one decode graph (n_tokens=1) serves every position:
    tokens [n] i32   token ids
    pos    [n] i32   their positions (rope, causal mask)
    kv_idx [n] i32   KV-cache rows to write (equal to pos for a linear cache)
    kv_len [1] i32   rows of the cache that are valid after this call's writes

KV slots (config kv_slots = N > 0): the KV cache is a pool of N slots, as paged and slot-mapped caches
keep it. One more Input, slot_map [ctx] i32, names the slot of each of the sequence's positions; kv_idx
then holds the slots the new tokens write (slot_map[pos]), and attention gathers the sequence's rows
through the slot map: [ctx] rows, the slot map's own length, masked by kv_len. Nothing is sized from a
logical length the slot map could disagree with (replay-lint checks that every view over KV spans the
pool and every gather over it reads an Input); the host picks slots (graphir/kv_slots.py).

Rope layout: convert_hf_to_gguf.py permutes the Q/K rows of `llama` models so that llama.cpp's
NORM rope (adjacent pairs) equals HF's rotate_half (NEOX, halves) on the original rows. Rather
than undo that permutation we pick the rope mode per source: GGUF llama -> "norm", HF -> "neox".
Qwen2 and Qwen3 are NEOX in both (llama.cpp does not permute them).

Qwen2 (and 2.5) is Llama with biases on the q, k and v projections (o_proj has none): `qkv_bias`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from graphir.builder import g
from graphir.errors import LoadError
from graphir.ir import Graph, Node
from graphir.weights import Weights

from . import random_init
from .family import (
    SLOT_MAP,
    Family,
    ParamNodes,
    check_rules,
    check_weights,
    checked_config,
    checked_gguf_weights,
    gguf_key,
    gguf_vocab,
    graph_meta,
    head_rules,
    hf_default_rope,
    no_state_to_reset,
    rename_hf,
    size_rules,
    step_inputs,
)
from .layers import attention, gated_ffn, output_head, rms_norm_mul
from .names import HF_CAUSAL_LM_GLOBAL, HF_MLP, HF_SELF_ATTN, NameMap


@dataclass(frozen=True)
class LlamaConfig:
    arch: str  # "llama", "qwen2" or "qwen3": names the family in dumps and errors
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
    qkv_bias: bool = False  # Qwen2: q, k and v projections add a bias [their rows] (o_proj has none)
    tied_embeddings: bool = False  # no output.weight; token_embd.weight is the head
    context_length: int = 2048  # trained context
    ctx: int = 2048  # KV-cache capacity in rows (a build-time shape); with kv_slots, the positions a slot map holds
    kv_slots: int = 0  # 0: the cache is ctx rows indexed by position; N: a pool of N slots addressed by slot_map


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
        if c.qkv_bias:
            shapes[b + "attn_q.bias"] = (q_dim,)
            shapes[b + "attn_k.bias"] = (kv_dim,)
            shapes[b + "attn_v.bias"] = (kv_dim,)
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
        *size_rules(c, ("n_vocab", "d_model", "n_layers", "head_dim", "d_ff")),
        *head_rules(c),
        (c.head_dim % 2 == 0, f"head_dim {c.head_dim} must be even for rope"),
        (c.rope_mode in ("norm", "neox"), f"rope_mode must be 'norm' or 'neox', got {c.rope_mode!r}"),
        (c.ctx >= 1, f"ctx {c.ctx} must be >= 1"),
        # a negative eps ran into a ZeroDivisionError in the cpu kernels; theta 0 made every rotation NaN
        (c.rms_eps >= 0, f"rms_eps {c.rms_eps} must be >= 0"),
        (c.rope_theta > 0, f"rope_theta {c.rope_theta} must be > 0"),
        (c.kv_slots >= 0, f"kv_slots {c.kv_slots} must be >= 0 (0: no slot pool)"),
    ]
    check_rules(c.arch, rules)


def build(c: LlamaConfig, phase: str = "prefill", n_tokens: int | None = None,
          dtypes: Mapping[str, str] | None = None, last_only: bool = False) -> Graph:
    """The forward graph for `n_tokens` tokens (decode: 1). `dtypes` maps Param names to their stored
    dtypes; `last_only` computes logits for the last token only."""
    check_config(c)
    n, tokens, pos, kv_idx, kv_len = step_inputs(c.arch, phase, n_tokens)
    # the slot of each position; passed only when there is a pool, so _attention keeps its plain signature
    slots = {"slot_map": g.input(SLOT_MAP, (c.ctx,), "i32")} if c.kv_slots else {}
    p = ParamNodes(param_shapes(c), dtypes)

    x = g.get_rows(p("token_embd.weight"), tokens, name="token_embd")  # [n, d_model]
    for i in range(c.n_layers):
        h = rms_norm_mul(x, p(f"blk.{i}.attn_norm.weight"), c.rms_eps, f"blk.{i}.attn_norm")
        x = g.add(x, _attention(c, p, i, h, pos, kv_idx, kv_len, **slots), name=f"blk.{i}.attn_res")
        h = rms_norm_mul(x, p(f"blk.{i}.ffn_norm.weight"), c.rms_eps, f"blk.{i}.ffn_norm")
        x = g.add(x, gated_ffn(p, i, h, _silu_times), name=f"blk.{i}.out")
    logits = output_head(c, p, x, last_only)  # [n or 1, n_vocab]
    return Graph({"logits": logits}, meta=graph_meta(c, phase, n, last_only))


def _attention(c: LlamaConfig, p: ParamNodes, i: int, h: Node, pos: Node, kv_idx: Node, kv_len: Node,
               slot_map: Node | None = None) -> Node:
    rope = {"n_dims": c.head_dim, "mode": c.rope_mode, "theta": float(c.rope_theta)}
    return attention(c, p, i, h, pos, kv_idx, kv_len, rope=rope, scale=1.0 / math.sqrt(c.head_dim),
                     cache_rows=c.kv_slots or c.ctx, qk_norm=c.qk_norm, qkv_bias=c.qkv_bias, slot_map=slot_map)


def _silu_times(gate: Node, up: Node, name: str) -> Node:
    # written unfused on purpose: the swiglu-split pass must find this pattern in real model graphs
    return g.mul(g.silu(gate), up, name=name)  # [n, d_ff]


# Each arch's fixed options; fields a file states (theta, eps) override the defaults
_ARCH_OPTIONS: dict[str, dict[str, Any]] = {
    "llama": {"rope_mode": "neox"},  # a llama GGUF asks for "norm" (its permuted Q/K rows)
    "qwen2": {"qkv_bias": True, "rope_mode": "neox", "rope_theta": 1_000_000.0, "rms_eps": 1e-6},
    "qwen3": {"qk_norm": True, "rope_mode": "neox", "rope_theta": 1_000_000.0, "rms_eps": 1e-6},
}


def arch_config(arch: str, **fields: Any) -> LlamaConfig:
    """A LlamaConfig of `arch` with that arch's fixed options (_ARCH_OPTIONS) under `fields`."""
    return LlamaConfig(**{**_ARCH_OPTIONS[arch], "arch": arch, **fields})


def qwen3_config(**fields: Any) -> LlamaConfig:
    """A LlamaConfig with Qwen3's fixed options (arch, q/k norms, neox rope, theta 1e6, eps 1e-6)."""
    return arch_config("qwen3", **fields)


def qwen2_config(**fields: Any) -> LlamaConfig:
    """A LlamaConfig with Qwen2's fixed options (arch, q/k/v biases, neox rope, theta 1e6, eps 1e-6)."""
    return arch_config("qwen2", **fields)


# ---------------------------------------------------------------- GGUF files (llama.cpp `llama`, `qwen2`, `qwen3`)
GGUF_ARCHS = ("llama", "qwen2", "qwen3")


def config_from_gguf(md: Mapping[str, Any], tensors: Mapping[str, Any], label: str = "gguf") -> LlamaConfig:
    arch = md.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise LoadError(f"{label}: architecture {arch!r} is not one of {GGUF_ARCHS}")
    key = gguf_key(md, arch, label)
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensors:
        raise LoadError(f"{label}: rope scaling ({scaling}, rope_freqs) is not supported")
    if "token_embd.weight" not in tensors:
        raise LoadError(f"{label}: missing tensor 'token_embd.weight'")
    d_model, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", d_model // max(n_heads, 1)))  # n_heads 0: check_config names it
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise LoadError(f"{label}: partial rope ({arch}.rope.dimension_count != head_dim {head_dim}) is not supported")
    fields = dict(
        n_vocab=gguf_vocab(tensors, label),
        d_model=d_model,
        n_layers=int(key("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(key("feed_forward_length")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in tensors,
        context_length=int(key("context_length")),
    )
    return arch_config(arch, **fields, **({"rope_mode": "norm"} if arch == "llama" else {}))


def weights_from_gguf(config: LlamaConfig, weights: Weights) -> Weights:
    """GGUF tensors already carry our names: check them and pass them through."""
    return checked_gguf_weights(config, weights, check_config, param_shapes(config))


# ---------------------------------------------------------------- HF checkpoints
# Mistral's checkpoints are llama's graph (llama.cpp converts them to `llama` GGUFs); see config_from_hf for its window
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                    "MistralForCausalLM": "llama"}
HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    **HF_SELF_ATTN,
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **HF_MLP,
}
HF_QKV_BIAS = {"self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias"}  # Qwen2's (qkv_bias)
HF_ACTIVATIONS = ("silu", "swish")  # transformers' names of the same function
HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # a cached buffer in old checkpoints, not a weight
HF_NAMES = NameMap(HF_CAUSAL_LM_GLOBAL, {**HF_LAYER, **HF_QKV_BIAS})
# without qkv_bias a bias in the file has no place in the graph: said with the file's name, as any other stranger
_HF_NAMES_NO_BIAS = NameMap(HF_CAUSAL_LM_GLOBAL, HF_LAYER)


def config_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The config.json of the HF model with these shapes (the inverse of config_from_hf). Llama GGUF
    files store Q/K rows permuted for the "norm" rope; their tensors are not HF's, so they have none."""
    if c.rope_mode != "neox":
        raise LoadError(f"{c.arch}: rope mode {c.rope_mode!r} (a llama GGUF's permuted Q/K) has no HF equivalent")
    arch = next(a for a, ours in HF_ARCHITECTURES.items() if ours == c.arch)
    return {"architectures": [arch], "model_type": c.arch, "vocab_size": c.n_vocab, "hidden_size": c.d_model,
            "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
            "head_dim": c.head_dim, "intermediate_size": c.d_ff, "rope_theta": c.rope_theta,
            "rms_norm_eps": c.rms_eps, "tie_word_embeddings": c.tied_embeddings,
            "max_position_embeddings": c.context_length,
            # Qwen2's q/k/v biases are its architecture's, not a flag; Llama's attention_bias would add o_proj's too
            **({} if c.qkv_bias else {"attention_bias": False, "mlp_bias": False})}


def config_from_hf(hf: Mapping[str, Any], label: str = "config.json") -> LlamaConfig:
    archs = hf.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise LoadError(f"{label}: architectures {archs} not supported (supported: {', '.join(HF_ARCHITECTURES)})")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if hf.get(flag):
            raise LoadError(f"{label}: {flag}=true is not supported")
    # Qwen2's configs list a kind per layer; anything but full attention would need windowed layers
    other = sorted({t for t in hf.get("layer_types") or () if t != "full_attention"})
    if other:
        raise LoadError(f"{label}: layer_types {other} are not supported (only full_attention)")
    # the graph's FFN is SwiGLU: any other activation loaded and ran SiLU without a word
    if hf.get("hidden_act", "silu") not in HF_ACTIVATIONS:
        raise LoadError(f"{label}: hidden_act {hf.get('hidden_act')!r} is not supported ({', '.join(HF_ACTIVATIONS)})")
    rope = hf_default_rope(hf, label)
    try:
        d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        fields = dict(
            n_vocab=int(hf["vocab_size"]),
            d_model=d_model,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(hf.get("head_dim") or d_model // max(n_heads, 1)),  # n_heads 0: check_config names it
            d_ff=int(hf["intermediate_size"]),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
            context_length=int(hf.get("max_position_embeddings", 2048)),
        )
    except KeyError as e:
        raise LoadError(f"{label}: missing key {e.args[0]!r}") from None
    # Mistral 7B v0.1: each query sees its last `window` keys (Qwen3's files carry a sliding_window too, unused
    # unless use_sliding_window, which is refused above)
    window = hf.get("sliding_window") if "MistralForCausalLM" in archs else None
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise LoadError(f"{label}: sliding_window {window!r} must be null or an int >= 1")
        # up to `window` positions a sliding window is full causal attention, so the context stops there
        # rather than the graph growing a window mask that no llama graph has
        fields["context_length"] = min(fields["context_length"], window)
    return arch_config(arch, **fields)


def weights_from_hf(config: LlamaConfig, raw: Weights) -> Weights:
    checked_config(config, check_config, raw.source)
    names = HF_NAMES if config.qkv_bias else _HF_NAMES_NO_BIAS
    out = rename_hf(config, raw, names, lambda name: bool(HF_IGNORED.match(name)))
    check_weights(config, out, param_shapes(config), HF_NAMES.to_file)
    return out


# ---------------------------------------------------------------- random presets
_QWEN3_VOCAB = 151936  # Qwen2.5's too
PRESETS: dict[str, tuple[LlamaConfig, str]] = {
    "llama-tiny": (LlamaConfig(arch="llama", n_vocab=272, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_dim=16, d_ff=96, rope_mode="norm", context_length=256, ctx=256), "f32"),
    # q_dim 96 != d_model 64, 3 query heads a KV head, d_ff 160: rows still whole q8_0/q4_0 blocks; the other tiny
    # presets' 272 ids, so that they draft for each other (speculative decoding needs one vocabulary)
    "qwen2-tiny": (qwen2_config(n_vocab=272, d_model=64, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=16,
                                d_ff=160, tied_embeddings=True, context_length=256, ctx=256), "f32"),
    # Qwen/Qwen2.5-0.5B's shapes (its config.json)
    "qwen2.5-0.5b": (qwen2_config(n_vocab=_QWEN3_VOCAB, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                                  head_dim=64, d_ff=4864, tied_embeddings=True, context_length=32768), "bf16"),
    "qwen3-tiny": (qwen3_config(n_vocab=272, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                d_ff=96, tied_embeddings=True, context_length=256, ctx=256), "f32"),
    "qwen3-0.6b": (qwen3_config(n_vocab=_QWEN3_VOCAB, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                                head_dim=128, d_ff=3072, tied_embeddings=True, context_length=40960), "bf16"),
    "qwen3-1.7b": (qwen3_config(n_vocab=_QWEN3_VOCAB, d_model=2048, n_layers=28, n_heads=16, n_kv_heads=8,
                                head_dim=128, d_ff=6144, tied_embeddings=True, context_length=40960), "bf16"),
    "qwen3-8b": (qwen3_config(n_vocab=_QWEN3_VOCAB, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                              head_dim=128, d_ff=12288, tied_embeddings=False, context_length=40960), "bf16"),
}  # fmt: skip


def random_weights(config: LlamaConfig, dtype: str = "f32", seed: int = 0) -> Weights:
    return random_init.random_weights(config.arch, param_shapes(config), dtype, seed, _random_bias)


def _random_bias(name: str, shape: tuple[int, ...], rng: Any) -> Any:
    # biases centred on 0 with about q/k/v's own scale (the norms' law, 1 + 0.1 * normal, would shift every row alike)
    return 0.5 * rng.standard_normal(shape) if name.endswith(".bias") else None


FAMILY = Family(
    name="llama",
    config_type=LlamaConfig,
    gguf_archs=GGUF_ARCHS,
    hf_architectures=tuple(HF_ARCHITECTURES),
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
    config_to_hf=config_to_hf,
)
