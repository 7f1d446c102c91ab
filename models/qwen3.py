"""Qwen3 dense decoders: the Llama block plus an RMS norm of every q and k head before rope.

Rope is NEOX (rotate halves) in both HF and GGUF files: llama.cpp does not permute Qwen3's Q/K.
"""

from __future__ import annotations

from typing import Any

from .llama import LlamaConfig, build, param_shapes

__all__ = ["config", "build", "param_shapes"]


def config(**fields: Any) -> LlamaConfig:
    """A LlamaConfig with Qwen3's fixed options (arch, q/k norms, neox rope, theta 1e6, eps 1e-6)."""
    defaults = {"arch": "qwen3", "qk_norm": True, "rope_mode": "neox", "rope_theta": 1_000_000.0, "rms_eps": 1e-6}
    return LlamaConfig(**{**defaults, **fields})
