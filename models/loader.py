"""Map GGUF files and HF directories to a model config plus Weights under our Param names.

The file says which family reads it (GGUF `general.architecture`, config.json `architectures`);
models.registry finds that family, which turns metadata into a config and tensors into our
Params (llama.cpp's names: token_embd.weight, blk.{i}.attn_q.weight, ...). Tensors keep the
file's dtype.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from graphir.dtypes import DTYPES, FLOAT, QUANTIZED
from graphir.errors import GraphirError, LoadError
from graphir.gc_pause import gc_paused
from graphir.quant import CONVERTIBLE, dequantize, quantize
from graphir.weights import Weight, Weights

from . import registry
from .family import ModelConfig, check_hf_fields
from .gguf_file import GGUFFile
from .hf_dir import load_hf_dir

DEFAULT_MAX_CTX = 4096  # default KV capacity cap: a full 40k-row cache of an 8B model is ~12 GB


def load_gguf(path: str | os.PathLike[str]) -> tuple[ModelConfig, Weights, GGUFFile]:
    """(config, weights under our names, the parsed file for its tokenizer metadata)."""
    with gc_paused():  # the header's vocabulary: ~100k strings in lists kept as long as the file (gc_pause.py)
        f = GGUFFile(path)
    family = registry.for_gguf(f.metadata, f.label)
    config = family.config_from_gguf(f.metadata, f.tensors, f.label)
    config = with_ctx(config, min(config.context_length, DEFAULT_MAX_CTX))
    return config, family.weights_from_gguf(config, f.weights()), f


def load_hf(path: str | os.PathLike[str]) -> tuple[ModelConfig, Weights, dict[str, Any]]:
    """(config, weights renamed to ours, config.json as a dict)."""
    hf, raw = load_hf_dir(path)
    label = str(Path(path) / "config.json")
    check_hf_fields(hf, label)
    family = registry.for_hf(hf, label)
    config = family.config_from_hf(hf, label)
    config = with_ctx(config, min(config.context_length, DEFAULT_MAX_CTX))
    return config, family.weights_from_hf(config, raw), hf


def ours_to_hf(name: str, config: ModelConfig) -> str:
    """The HF tensor name of our Param `name` in checkpoints of `config`'s family (tests write HF
    files with it)."""
    return registry.family_of(config).hf_names.to_file(name)


def check_dtype(dtype: str) -> None:
    """`dtype` names a weight type: load() and the command line ask before any file is read."""
    if dtype not in FLOAT and dtype not in QUANTIZED:
        raise LoadError(f"dtype {dtype!r} is not a weight type (use one of {', '.join(FLOAT + QUANTIZED)})")


def convert_weights(weights: Weights, dtype: str) -> Weights:
    """Every tensor re-stored as `dtype`. For quantized targets, 1-D weights (norms) become f32."""
    check_dtype(dtype)
    out = Weights(source=f"{weights.source} as {dtype}")
    block = DTYPES[dtype].block
    kept: list[tuple[str, int]] = []  # matrices left f32: (name, columns)
    converted = 0
    for name, w in weights.items():
        # norms, and rows that are not whole blocks (a [C, 4] conv kernel), stay f32
        blocked = len(w.shape) >= 2 and w.shape[-1] % block == 0
        target = "f32" if dtype in QUANTIZED and not blocked else dtype
        if len(w.shape) >= 2:
            if target == dtype:
                converted += 1
            else:
                kept.append((name, w.shape[-1]))
        if w.dtype == target:
            out.add(name, w)
            continue
        if target not in CONVERTIBLE:
            raise LoadError(f"{weights.source}: tensor {name!r} is {w.dtype}, and graphir has no quantizer for "
                            f"{target} ({target} weights are read from GGUF files as they are); convert to one of "
                            f"{', '.join(CONVERTIBLE)}")
        try:
            data = quantize(dequantize(w.data, w.dtype, w.shape), target)
        except GraphirError as e:
            raise LoadError(f"{weights.source}: tensor {name!r} cannot be converted to {target}: {e}") from None
        out.add(name, Weight(target, tuple(w.shape), data))
    # Said once, so that a model asked for as q4_0 that is mostly f32 does not pass unnoticed; a short conv kernel
    # left f32 beside converted projections is the expected case and says nothing.
    if kept and (not converted or any(cols > block for _, cols in kept)):
        names = ", ".join(f"{n} ({cols} columns)" for n, cols in kept[:3]) + (", ..." if len(kept) > 3 else "")
        print(f"graphir: {weights.source}: {len(kept)} matrices stay f32, not {dtype}: their rows are not whole "
              f"{block}-value blocks ({names})", file=sys.stderr)
    return out


def with_ctx(config: ModelConfig, ctx: int | None) -> ModelConfig:
    return config if ctx is None else dataclasses.replace(config, ctx=int(ctx))
