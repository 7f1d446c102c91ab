"""Tiny model files for tests: GGUF files written the way llama.cpp's converter writes them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from graphir.models.llama import LlamaConfig


def byte_level_tokens(n_vocab: int) -> list[str]:
    """A gpt2-style vocabulary: the 256 byte-level characters, "ab" (for MERGES), then <|tok257|>... up to n_vocab."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        chars.append(chr(b) if b in keep else chr(256 + extra))
        extra += b not in keep
    return chars + ["ab"] + [f"<|tok{i}|>" for i in range(257, n_vocab)]


MERGES = ["a b"]  # gguf-py writes an empty list with no element type, so keep one merge


def permute_for_norm_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Q/K row permutation for `llama` (halves -> adjacent pairs per head)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, c: LlamaConfig, tensors: Mapping[str, np.ndarray], arch: str | None = None,
               skip_keys: tuple[str, ...] = (), extra: Mapping[str, Any] | None = None, tokenizer: bool = True) -> Path:
    """A GGUF with llama.cpp's metadata keys for `c` (prefix `arch`, default c.arch) and f32/f16 `tensors`;
    `extra` adds more keys under the prefix (bool, int: uint32, float: float32, str, or a list: an array);
    tokenizer=False leaves the tokenizer's keys out but for the EOS id."""
    arch = arch or c.arch
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (extra or {}).items():
        add = {bool: w.add_bool, int: w.add_uint32, float: w.add_float32, str: w.add_string, list: w.add_array}
        add[type(value)](f"{arch}.{key}", value)
    keys = {
        "context_length": (c.context_length, w.add_uint32),
        "embedding_length": (c.d_model, w.add_uint32),
        "block_count": (c.n_layers, w.add_uint32),
        "feed_forward_length": (c.d_ff, w.add_uint32),
        "attention.head_count": (c.n_heads, w.add_uint32),
        "attention.head_count_kv": (c.n_kv_heads, w.add_uint32),
        "attention.key_length": (c.head_dim, w.add_uint32),
        "rope.dimension_count": (c.head_dim, w.add_uint32),
        "rope.freq_base": (c.rope_theta, w.add_float32),
        "attention.layer_norm_rms_epsilon": (c.rms_eps, w.add_float32),
    }
    for key, (value, add) in keys.items():
        if key not in skip_keys:
            add(f"{arch}.{key}", value)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(byte_level_tokens(c.n_vocab))
        w.add_token_merges(MERGES)
    w.add_eos_token_id(c.n_vocab - 1)
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def redraw_hf_weights(model: Any) -> None:
    """An HF transformers model's parameters redrawn at unit-ish scale, in place: HF's init (std 0.02, norms of
    exactly 1 or 0, zero biases) would hide a transposed weight, a dropped norm or a dropped bias. Matrices (and
    conv kernels) get std 1 / sqrt(fan-in), biases 0.5, norm weights 0.1 around what leaves x unscaled (0 for
    the norms that scale by 1 + w: Gemma 3's and Qwen3.5's, but for the DeltaNet's gated norm; 1 elsewhere).
    Qwen3.5's decay parameters (A_log, dt_bias) keep HF's init, which puts the rates in their working range."""
    import torch

    arch = model.config.model_type
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif p.ndim == 1:
                one_plus_w = arch.startswith("gemma3") or arch.startswith("qwen3_5") and "linear_attn.norm" not in name
                p.copy_(0.1 * torch.randn_like(p) + (0.0 if one_plus_w else 1.0))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1 if p.ndim == 3 else 1] ** 0.5)
