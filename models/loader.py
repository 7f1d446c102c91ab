"""Map GGUF files and HF directories to a model config plus Weights under our Param names.

Param names are llama.cpp's (token_embd.weight, blk.{i}.attn_q.weight, ...), so a GGUF file's
names pass through unchanged and HF names are renamed. Tensors keep the file's dtype.

Rope layout: convert_hf_to_gguf.py permutes the Q/K rows of `llama` models so that llama.cpp's
NORM rope (adjacent pairs) equals HF's rotate_half (NEOX, halves) on the original rows. Rather
than undo that permutation we pick the rope mode per source: GGUF llama -> "norm", HF -> "neox".
Qwen3 is NEOX in both (llama.cpp does not permute it).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphir.dtypes import DTYPES, FLOAT, QUANTIZED
from graphir.errors import GraphirError, LoadError
from graphir.quant import dequantize, quantize
from graphir.weights import Weight, Weights

from . import qwen3, qwen35
from .gguf_file import GGUFFile
from .hf_dir import load_hf_dir
from .llama import LlamaConfig, check_config, param_shapes
from .names import NameMap

ARCHITECTURES = ("llama", "qwen3", "qwen35")
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
DEFAULT_MAX_CTX = 4096  # default KV capacity cap: a full 40k-row cache of an 8B model is ~12 GB

# HF name -> ours; per-layer names are under model.layers.{i}. and blk.{i}.
HF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # a cached buffer in old checkpoints, not a weight
HF_NAMES = NameMap(HF_GLOBAL, HF_LAYER)


# ---------------------------------------------------------------- GGUF


def load_gguf(path: str | os.PathLike[str]) -> tuple[LlamaConfig, Weights, GGUFFile]:
    """(config, weights under our names, the parsed file for its tokenizer metadata)."""
    f = GGUFFile(path)
    md, label = f.metadata, f.label
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise LoadError(f"{label}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if arch == "qwen35":  # hybrid Gated DeltaNet: its own names and config keys
        config35 = qwen35.config_from_gguf(md, f.tensors, label)
        config35 = qwen35.with_ctx(config35, min(config35.context_length, DEFAULT_MAX_CTX))
        return config35, qwen35.weights_from_gguf(config35, f.weights()), f

    def key(name: str, default: Any = None) -> Any:
        v = md.get(f"{arch}.{name}", default)
        if v is None:
            raise LoadError(f"{label}: missing metadata key {arch}.{name!r}")
        return v

    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in f.tensors:
        raise LoadError(f"{label}: rope scaling ({scaling}, rope_freqs) is not supported")
    if "token_embd.weight" not in f.tensors:
        raise LoadError(f"{label}: missing tensor 'token_embd.weight'")
    d_model, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", d_model // n_heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise LoadError(f"{label}: partial rope ({arch}.rope.dimension_count != head_dim {head_dim}) is not supported")
    fields = dict(
        arch=arch,
        n_vocab=f.tensors["token_embd.weight"].shape[0],
        d_model=d_model,
        n_layers=int(key("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(key("feed_forward_length")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in f.tensors,
        context_length=int(key("context_length")),
    )
    fields["ctx"] = min(fields["context_length"], DEFAULT_MAX_CTX)
    config = qwen3.config(**fields) if arch == "qwen3" else LlamaConfig(rope_mode="norm", **fields)
    weights = f.weights()
    check_weights(config, weights)
    return config, weights, f


# ---------------------------------------------------------------- HF directories


def load_hf(path: str | os.PathLike[str]) -> tuple[LlamaConfig, Weights, dict[str, Any]]:
    """(config, weights renamed to ours, config.json as a dict)."""
    hf, raw = load_hf_dir(path)
    label = str(Path(path) / "config.json")
    if qwen35.is_hf_config(hf):
        config35 = qwen35.config_from_hf(hf, label)
        config35 = qwen35.with_ctx(config35, min(config35.context_length, DEFAULT_MAX_CTX))
        return config35, qwen35.weights_from_hf(config35, raw), hf
    config = hf_config(hf, label)
    out = Weights(source=raw.source)
    for hf_name, w in raw.items():
        ours = hf_to_ours(hf_name)
        if ours is None:
            if HF_IGNORED.match(hf_name):
                continue
            raise LoadError(f"{raw.source}: tensor {hf_name!r} has no place in the {config.arch} graph")
        if ours == "output.weight" and config.tied_embeddings:
            continue  # tied: the head is token_embd.weight; a saved lm_head copy is redundant
        out.add(ours, w)
    check_weights(config, out, hf_names=True)
    return config, out, hf


def hf_to_ours(name: str) -> str | None:
    return HF_NAMES.to_ours(name)


def ours_to_hf(name: str) -> str:
    return HF_NAMES.to_file(name)


def hf_config(hf: Mapping[str, Any], label: str) -> LlamaConfig:
    archs = hf.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise LoadError(f"{label}: architectures {archs} not supported (supported: {', '.join(HF_ARCHITECTURES)})")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise LoadError(f"{label}: {flag}=true is not supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise LoadError(f"{label}: rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported")
    try:
        d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        fields = dict(
            n_vocab=int(hf["vocab_size"]),
            d_model=d_model,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(hf.get("head_dim") or d_model // n_heads),
            d_ff=int(hf["intermediate_size"]),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
            context_length=int(hf.get("max_position_embeddings", 2048)),
        )
    except KeyError as e:
        raise LoadError(f"{label}: missing key {e.args[0]!r}") from None
    fields["ctx"] = min(fields["context_length"], DEFAULT_MAX_CTX)
    return qwen3.config(**fields) if arch == "qwen3" else LlamaConfig(arch="llama", rope_mode="neox", **fields)


# ---------------------------------------------------------------- checks and conversion


def check_weights(config: LlamaConfig, weights: Weights, hf_names: bool = False) -> None:
    """Every Param present with its shape and a usable dtype; no tensor left unused."""
    try:
        check_config(config)
    except GraphirError as e:
        raise LoadError(f"{weights.source}: {e}") from None
    expected = param_shapes(config)
    present = set(weights)  # not `in weights`: Weights.__getitem__ raises LoadError, not KeyError

    def label(name: str) -> str:
        return f"{name!r} (file name {ours_to_hf(name)!r})" if hf_names else repr(name)

    for name, shape in expected.items():
        if name not in present:
            raise LoadError(f"{weights.source}: missing tensor {label(name)}")
        w = weights[name]
        if tuple(w.shape) != shape:
            raise LoadError(f"{weights.source}: tensor {label(name)} has shape {list(w.shape)}, "
                            f"the {config.arch} config expects {list(shape)}")
        if len(shape) == 1 and w.dtype not in FLOAT:
            raise LoadError(f"{weights.source}: tensor {label(name)} is {w.dtype}; norm weights must be f32/f16/bf16")
        if w.dtype == "i32":
            raise LoadError(f"{weights.source}: tensor {label(name)} is i32; weights must be float or quantized")
    extra = sorted(present - set(expected))
    if extra:
        raise LoadError(f"{weights.source}: tensors {extra[:5]} are not used by the {config.arch} graph "
                        f"(config: {config.n_layers} layers, tied={config.tied_embeddings})")


def convert_weights(weights: Weights, dtype: str) -> Weights:
    """Every tensor re-stored as `dtype`. For quantized targets, 1-D weights (norms) become f32."""
    if dtype not in FLOAT and dtype not in QUANTIZED:
        raise LoadError(f"dtype {dtype!r} is not a weight type (use one of {', '.join(FLOAT + QUANTIZED)})")
    out = Weights(source=f"{weights.source} as {dtype}")
    for name, w in weights.items():
        # norms, and rows that are not whole blocks (a [C, 4] conv kernel), stay f32
        blocked = len(w.shape) >= 2 and w.shape[-1] % DTYPES[dtype].block == 0
        target = "f32" if dtype in QUANTIZED and not blocked else dtype
        if w.dtype == target:
            out.add(name, w)
            continue
        try:
            data = quantize(dequantize(w.data, w.dtype, w.shape), target)
        except GraphirError as e:
            raise LoadError(f"{weights.source}: tensor {name!r} cannot be converted to {target}: {e}") from None
        out.add(name, Weight(target, tuple(w.shape), data))
    return out


def with_ctx(config: LlamaConfig, ctx: int | None) -> LlamaConfig:
    return config if ctx is None else dataclasses.replace(config, ctx=int(ctx))
