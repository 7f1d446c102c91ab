"""The interface every model family provides, and the checks they share.

A family is one module under models/ that ends with `FAMILY = Family(...)`: hyperparameters from a
GGUF file or an HF config.json, its tensors under our Param names, the graph builder, its `random:`
presets and how a new sequence resets its state (llama.cpp gives each architecture the same three
parts: hyperparameters, tensors, graph). models/registry.py lists the families; everything else
(graphir.load, the loaders, the presets, the CLI) reaches a family only through the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from graphir.builder import g
from graphir.dtypes import FLOAT
from graphir.errors import GraphError, GraphirError, LoadError
from graphir.ir import Graph, Node
from graphir.weights import Weights

from .names import NameMap


class ModelConfig(Protocol):
    """The fields every family's config has; the runtime reads no others."""

    arch: str  # names the family's variant in dumps and errors ("llama", "qwen3", "gemma3", ...)
    n_vocab: int
    d_model: int
    n_layers: int
    tied_embeddings: bool
    context_length: int  # trained context
    ctx: int  # KV-cache capacity in rows (a build-time shape)


@dataclass(frozen=True)
class Family:
    name: str
    config_type: type  # a family's configs are instances of this type, and no other family's are
    gguf_archs: tuple[str, ...]  # values of general.architecture it reads
    hf_architectures: tuple[str, ...]  # config.json "architectures" entries it reads
    # (GGUF metadata, {tensor name: info with a numpy-order .shape}, file label) -> config
    config_from_gguf: Callable[[Mapping[str, Any], Mapping[str, Any], str], Any]
    weights_from_gguf: Callable[[Any, Weights], Weights]  # checked, under our Param names
    config_from_hf: Callable[[Mapping[str, Any], str], Any]  # config.json -> config
    weights_from_hf: Callable[[Any, Weights], Weights]  # HF-named tensors -> ours, converted and checked
    hf_names: NameMap  # our Param names <-> HF tensor names
    param_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    # build(config, phase, n_tokens, dtypes, last_only) -> Graph
    build: Callable[..., Graph]
    presets: Mapping[str, tuple[Any, str]]  # random:<name> -> (config, weight dtype)
    random_weights: Callable[[Any, str, int], Weights]  # (config, dtype, seed)
    # a new sequence: bring State not indexed by position back to its start (KV rows need nothing,
    # rows at or past kv_len are never read)
    reset_state: Callable[[Any, Mapping[str, np.ndarray]], None]
    hf_model_types: tuple[str, ...] = ()  # config.json "model_type" values, when "architectures" is absent
    # config -> the config.json an HF transformers model of the same shapes is built from (`graphir
    # bench --compare hf`); None where the family has no such mapping (the comparison is skipped)
    config_to_hf: Callable[[Any], dict[str, Any]] | None = None
    # (our Param name, its f32 values) -> the values in HF's convention, where a family stores a tensor
    # differently from HF (None: the same values)
    tensor_to_hf: Callable[[str, np.ndarray], np.ndarray] | None = None
    default_chat_template: str | None = None  # for files that carry none


PHASES = ("prefill", "decode")
SLOT_MAP = "slot_map"  # Input [ctx] i32 of graphs with a KV slot pool (kv_slots): the pool slot of each position
DEFAULT_PREFILL_TOKENS = 8


def step_inputs(arch: str, phase: str, n_tokens: int | None) -> tuple[int, Node, Node, Node, Node]:
    """(n, tokens, pos, kv_idx, kv_len): the token count of a `phase` graph, checked, and the Inputs
    every family's graph takes (ids, positions and KV write rows [n], the KV length [1])."""
    if phase not in PHASES:
        raise GraphError(f"{arch}: phase must be one of {PHASES}, got {phase!r}")
    if phase == "decode" and n_tokens not in (None, 1):
        raise GraphError(f"{arch}: decode graphs take 1 token, got n_tokens={n_tokens}")
    n = 1 if phase == "decode" else (DEFAULT_PREFILL_TOKENS if n_tokens is None else n_tokens)  # 0 is no default
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise GraphError(f"{arch}: n_tokens must be an int >= 1, got {n!r}")
    n = int(n)
    return (n, g.input("tokens", (n,), "i32"), g.input("pos", (n,), "i32"), g.input("kv_idx", (n,), "i32"),
            g.input("kv_len", (1,), "i32"))


def graph_meta(c: ModelConfig, phase: str, n: int, last_only: bool) -> dict[str, Any]:
    """The meta of a family's graph: its arch, phase, token count, KV capacity and whether only the
    last token's logits are computed."""
    return {"arch": c.arch, "phase": phase, "n_tokens": n, "ctx": c.ctx, "last_only": bool(last_only and n > 1)}


class ParamNodes:
    """Param leaves with the weight store's dtypes (default f32), one node per name, from a family's
    name -> shape table."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str] | None):
        self.shapes = shapes
        self.dtypes = dtypes or {}
        self.nodes: dict[str, Node] = {}

    def __call__(self, name: str) -> Node:
        if name not in self.nodes:
            self.nodes[name] = g.param(name, self.shapes[name], self.dtypes.get(name, "f32"))
        return self.nodes[name]


def no_state_to_reset(config: Any, state: Mapping[str, np.ndarray]) -> None:
    """reset_state of families whose only State is the KV cache."""


def check_weights(config: Any, weights: Weights, shapes: Mapping[str, tuple[int, ...]],
                  file_name: Callable[[str], str] | None = None) -> None:
    """Every Param present with its shape and a usable dtype (1-D norms and biases float); no tensor
    left unused. `file_name` maps our name to the file's, for messages about HF files."""

    def label(name: str) -> str:
        return f"{name!r} (file name {file_name(name)!r})" if file_name else repr(name)

    present = set(weights)  # not `in weights`: Weights.__getitem__ raises LoadError, not KeyError
    for name, shape in shapes.items():
        if name not in present:
            raise LoadError(f"{weights.source}: missing tensor {label(name)}")
        w = weights[name]
        if tuple(w.shape) != shape:
            raise LoadError(f"{weights.source}: tensor {label(name)} has shape {list(w.shape)}, "
                            f"the {config.arch} config expects {list(shape)}")
        if len(shape) == 1 and w.dtype not in FLOAT:
            raise LoadError(f"{weights.source}: tensor {label(name)} is {w.dtype}; 1-D weights must be f32/f16/bf16")
        if w.dtype == "i32":
            raise LoadError(f"{weights.source}: tensor {label(name)} is i32; weights must be float or quantized")
    extra = sorted(present - set(shapes))
    if extra:
        raise LoadError(f"{weights.source}: tensors {extra[:5]} are not used by the {config.arch} graph "
                        f"(config: {config.n_layers} layers, tied={config.tied_embeddings})")


def checked_gguf_weights(config: Any, weights: Weights, check: Callable[[Any], None],
                         shapes: Mapping[str, tuple[int, ...]]) -> Weights:
    """GGUF tensors that already carry our names and conventions: `config` checked, then the tensors
    against `shapes`; they pass through as they are."""
    checked_config(config, check, weights.source)
    check_weights(config, weights, shapes)
    return weights


def size_rules(config: Any, fields: tuple[str, ...]) -> list[tuple[bool, str]]:
    """Each of a config's `fields` >= 1: a file whose tensors and metadata agreed on a size of 0 loaded, then
    divided by zero (1 / sqrt(head_dim) at build, the cpu matmul and norm kernels at the first token)."""
    return [(getattr(config, f) >= 1, f"{f} {getattr(config, f)} must be >= 1") for f in fields]


def head_rules(config: Any) -> list[tuple[bool, str]]:
    """Attention heads: at least one of each, and whole groups of query heads per key/value head (the count of
    key/value heads checked first: the modulo divides by it)."""
    q, kv = config.n_heads, config.n_kv_heads
    return [(q >= 1, f"n_heads {q} must be >= 1"), (kv >= 1, f"n_kv_heads {kv} must be >= 1"),
            (kv < 1 or q % kv == 0, f"n_heads {q} must be a multiple of n_kv_heads {kv}")]


def check_rules(arch: str, rules: list[tuple[bool, str]]) -> None:
    """A family's config checks: the first (ok, rule) that fails is a GraphError naming it."""
    for ok, rule in rules:
        if not ok:
            raise GraphError(f"{arch} config: {rule}")


def checked_config(config: Any, check: Callable[[Any], None], source: str) -> Any:
    """`config` after `check(config)`, a GraphError from it re-raised as a LoadError naming `source`."""
    try:
        check(config)
    except GraphirError as e:
        raise LoadError(f"{source}: {e}") from None
    return config


# GGUF metadata the families read as real numbers (under the arch prefix); every other number they read is a count
GGUF_REAL = frozenset({"rope.freq_base", "rope.freq_base_swa", "rope.scaling.factor",
                       "attention.layer_norm_rms_epsilon", "attention.scale", "final_logit_softcapping"})


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def gguf_key(md: Mapping[str, Any], arch: str, label: str, per_layer: tuple[str, ...] = ()) -> Callable[..., Any]:
    """key(name, default=None): metadata `{arch}.{name}`, a number (or, for the names in `per_layer`, an array
    of them: some files store a count per layer); a missing key without a default names it, and so does a value
    the family's int()/float() could not take (a string, or an array where it reads one number), a count that is
    not whole (int() took a block_count of 2.7 as 2) and a real number that is not finite (as config.json's)."""

    def key(name: str, default: Any = None) -> Any:
        v = md.get(f"{arch}.{name}", default)
        if v is None:
            raise LoadError(f"{label}: missing metadata key {arch}.{name!r}")
        items = list(v) if name in per_layer and isinstance(v, (list, tuple, np.ndarray)) else [v]
        shown = v.tolist() if isinstance(v, np.ndarray) else v
        where = f"{label}: metadata key {arch}.{name!r}"
        if not all(_is_number(x) for x in items):
            raise LoadError(f"{where} must be a number, got {shown!r}")
        if name in GGUF_REAL:
            if not all(np.isfinite(x) for x in items):
                raise LoadError(f"{where} must be a finite number, got {shown!r}")
        elif not all(float(x).is_integer() for x in items):
            raise LoadError(f"{where} must be a whole number, got {shown!r}")
        return v

    return key


def gguf_vocab(tensors: Mapping[str, Any], label: str) -> int:
    """The vocabulary of a GGUF file: token_embd.weight's rows (a 0-d tensor, which GGUF allows, was an IndexError)."""
    shape = tuple(tensors["token_embd.weight"].shape)
    if len(shape) != 2:
        raise LoadError(f"{label}: token_embd.weight has shape {list(shape)}, expected [n_vocab, d_model]")
    return int(shape[0])


# config.json fields the families read as numbers; null stands for "derive it" only in HF_NULLABLE (the families
# read those with `or`): anywhere else int()/float() of a string or null raised a bare ValueError/TypeError
HF_WHOLE = frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "intermediate_size", "max_position_embeddings", "sliding_window",
                      "sliding_window_pattern", "full_attention_interval", "linear_num_key_heads",
                      "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                      "linear_conv_kernel_dim"})
HF_REAL = frozenset({"rms_norm_eps", "rope_theta", "rope_local_base_freq", "partial_rotary_factor", "factor",
                     "query_pre_attn_scalar", "final_logit_softcapping"})
HF_NULLABLE = frozenset({"num_key_value_heads", "head_dim", "sliding_window", "final_logit_softcapping"})
# flags the families read with bool(): the string "false" read as true (a tied head, its lm_head.weight dropped);
# null reads as false, as transformers' truth tests read it
HF_FLAGS = frozenset({"tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"})


def check_hf_fields(hf: Mapping[str, Any], label: str) -> None:
    """The numbers of an HF config (nested ones too: text_config, rope_parameters) are numbers of their kind,
    and architectures is a list: a LoadError naming the field, before a family converts any of them."""
    archs = hf.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise LoadError(f"{label}: architectures must be a list of class names, got {archs!r}")

    def walk(d: Mapping[str, Any]) -> None:
        for key, v in d.items():
            if isinstance(v, Mapping):
                walk(v)
            elif v is None and key in HF_NULLABLE | HF_FLAGS | {"layer_types"}:
                continue
            elif key == "layer_types" and not (isinstance(v, list) and all(isinstance(t, str) for t in v)):
                raise LoadError(f"{label}: layer_types must be a list of strings, got {v!r}")
            elif key in HF_FLAGS and not isinstance(v, bool):
                raise LoadError(f"{label}: {key} must be true or false, got {v!r}")
            elif key in HF_WHOLE and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                          and float(v).is_integer()):
                raise LoadError(f"{label}: {key} must be a whole number, got {v!r}")
            elif key in HF_REAL and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                         and np.isfinite(v)):
                raise LoadError(f"{label}: {key} must be a finite number, got {v!r}")

    walk(hf)


def hf_default_rope(hf: Mapping[str, Any], label: str) -> Mapping[str, Any]:
    """An HF config's rope parameters (transformers 5's rope_parameters, older configs' rope_scaling, or
    none), which must be the default rope: rope scaling is not supported. Both keys are checked: transformers
    also applies a legacy rope_scaling found beside rope_parameters (Qwen2.5's cards say to add a YaRN block to
    config.json, which a transformers 5 save already gives rope_parameters)."""
    check_rope_objects(hf, label)
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise LoadError(f"{label}: rope scaling {kind!r} is not supported")
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def check_rope_objects(hf: Mapping[str, Any], label: str) -> None:
    """An HF config's rope_parameters and rope_scaling, where present, are objects (5 was a TypeError or an
    AttributeError wherever a family read them)."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key)
        if rope is not None and not isinstance(rope, Mapping):
            raise LoadError(f"{label}: {key} must be an object, got {type(rope).__name__} {rope!r}")


def rename_hf(config: Any, raw: Weights, names: NameMap, skipped: Callable[[str], bool],
              convert: Callable[[str, Any], Any] = lambda ours, w: w) -> Weights:
    """HF tensors renamed to our Params (through `convert`); a tied checkpoint's lm_head copy is dropped,
    tensors `skipped` says the text graph never reads are left out, any other stranger is an error."""
    out = Weights(source=raw.source)
    for hf_name, w in raw.items():
        ours = names.to_ours(hf_name)
        if ours is None:
            if skipped(hf_name):
                continue
            raise LoadError(f"{raw.source}: tensor {hf_name!r} has no place in the {config.arch} graph")
        if ours == "output.weight" and config.tied_embeddings:
            continue  # tied: the head is token_embd.weight; a saved lm_head copy is redundant
        out.add(ours, convert(ours, w))
    return out
