"""The model families, and how the rest of graphir finds one: by config, GGUF architecture, HF
config.json or preset name. This is the only module outside a family that names families;
adding one is a new module under models/ and one entry in FAMILIES."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graphir.errors import GraphError, LoadError

from . import gemma3, llama, qwen35
from .family import Family, ModelConfig

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen35.FAMILY, gemma3.FAMILY)

_BY_CONFIG = {f.config_type: f for f in FAMILIES}
_BY_GGUF = {arch: f for f in FAMILIES for arch in f.gguf_archs}
_BY_HF = {arch: f for f in FAMILIES for arch in f.hf_architectures}
_BY_HF_TYPE = {t: f for f in FAMILIES for t in f.hf_model_types}
PRESETS: dict[str, tuple[Any, str]] = {name: p for f in FAMILIES for name, p in f.presets.items()}
if len(PRESETS) != sum(len(f.presets) for f in FAMILIES):
    raise GraphError("two families define the same random: preset name")


def family_of(config: ModelConfig) -> Family:
    try:
        return _BY_CONFIG[type(config)]
    except KeyError:
        raise GraphError(f"config type {type(config).__name__} belongs to no registered family "
                         f"(families: {', '.join(f.name for f in FAMILIES)})") from None


def for_gguf(md: Mapping[str, Any], label: str) -> Family:
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or arch not in _BY_GGUF:  # an array here is unhashable: not a TypeError
        raise LoadError(f"{label}: architecture {arch!r} is not supported (supported: {', '.join(_BY_GGUF)})")
    return _BY_GGUF[arch]


def for_hf(hf: Mapping[str, Any], label: str) -> Family:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    by_type = _BY_HF_TYPE.get(model_type) if isinstance(model_type, str) else None  # a list is unhashable
    found = next((_BY_HF[a] for a in archs if a in _BY_HF), None) or by_type
    if found is None:
        also = "" if model_type is None else f"; model_type {model_type!r} names no family either"
        raise LoadError(f"{label}: architectures {archs} not supported (supported: {', '.join(_BY_HF)}){also}")
    return found
