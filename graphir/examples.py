"""A small, self-contained example: a 2-layer Llama-style decoder built from `g` ops only.

It exists so the dumps, the CLI and the notebooks have a realistic graph before any real
model is loaded: same node names as the model builders (`blk.{i}.attn_q`, ...), runtime
Inputs for everything that changes per call, and a KV cache held in State.

Tokens are bytes (vocab 256), so a prompt needs no tokenizer: its UTF-8 bytes are the ids.
Weights are random, so the generated ids are meaningless; what matters is that prefill and
a replayed decode graph agree on the cache they share.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from graphir.builder import g
from graphir.errors import InputError
from graphir.ir import Graph, Node
from graphir.weights import Weight, Weights


@dataclass(frozen=True)
class ExampleConfig:
    n_layers: int = 2
    vocab: int = 256  # byte tokens
    dim: int = 64
    n_head: int = 4
    n_kv_head: int = 2  # GQA: two query heads per KV head
    head_dim: int = 16
    ffn_dim: int = 128
    ctx: int = 128  # KV capacity; the only build-time number besides n_tokens
    eps: float = 1e-5
    theta: float = 10000.0


PREFILL_TOKENS = 7  # the default prefill length of `graphir dump example`


def build_example(phase: str = "prefill", n_tokens: int | None = None,
                  config: ExampleConfig = ExampleConfig()) -> Graph:
    """The example decoder for `phase` ("prefill" or "decode"); decode is one token."""
    if phase not in ("prefill", "decode"):
        raise InputError(f"example: phase must be 'prefill' or 'decode', got {phase!r}")
    n = n_tokens if n_tokens is not None else (PREFILL_TOKENS if phase == "prefill" else 1)
    c = config
    tokens = g.input("tokens", (n,), "i32")
    pos = g.input("positions", (n,), "i32")
    kv_rows = g.input("kv_rows", (n,), "i32")  # cache row each new token's K/V goes to
    kv_len = g.input("kv_len", (1,), "i32")  # rows of the cache that are valid after the write
    x = g.get_rows(g.param("token_embd.weight", (c.vocab, c.dim)), tokens, name="inp_embd")  # [n, dim]
    for i in range(c.n_layers):
        x = _block(x, i, pos, kv_rows, kv_len, c)
    x = _norm(x, "output_norm", c)
    logits = g.mul_mat(g.param("output.weight", (c.vocab, c.dim)), x, name="result_output")  # [n, vocab]
    return Graph({"logits": logits}, meta={"model": "example", "phase": phase, "n_layers": c.n_layers})


def _norm(x: Node, name: str, c: ExampleConfig) -> Node:
    w = g.param(f"{name}.weight", (c.dim,))
    return g.mul(g.rms_norm(x, eps=c.eps, name=name), w, name=f"{name}_w")


def _block(x: Node, i: int, pos: Node, kv_rows: Node, kv_len: Node, c: ExampleConfig) -> Node:
    n = x.shape[0]
    p = f"blk.{i}"

    def w(name: str, n_out: int, n_in: int) -> Node:
        return g.param(f"{p}.{name}.weight", (n_out, n_in))

    h = _norm(x, f"{p}.attn_norm", c)
    q = g.mul_mat(w("attn_q", c.n_head * c.head_dim, c.dim), h, name=f"{p}.attn_q")
    k = g.mul_mat(w("attn_k", c.n_kv_head * c.head_dim, c.dim), h, name=f"{p}.attn_k")
    v = g.mul_mat(w("attn_v", c.n_kv_head * c.head_dim, c.dim), h, name=f"{p}.attn_v")
    # Unnamed on purpose: dumps place unnamed nodes in the layer of their sources.
    q = g.reshape(q, shape=(n, c.n_head, c.head_dim))  # [n, n_head, head_dim]
    k = g.reshape(k, shape=(n, c.n_kv_head, c.head_dim))  # [n, n_kv_head, head_dim]
    v = g.reshape(v, shape=(n, c.n_kv_head, c.head_dim))
    q = g.rope(q, pos, n_dims=c.head_dim, mode="neox", theta=c.theta, name=f"{p}.attn_q_rope")
    k = g.rope(k, pos, n_dims=c.head_dim, mode="neox", theta=c.theta, name=f"{p}.attn_k_rope")
    # f16 cache, as llama.cpp keeps it; attention reads the written cache, which orders it after the write.
    cache_k = g.set_rows(g.state(f"{p}.cache_k", (c.ctx, c.n_kv_head, c.head_dim), "f16"), k, kv_rows,
                         name=f"{p}.cache_k_write")
    cache_v = g.set_rows(g.state(f"{p}.cache_v", (c.ctx, c.n_kv_head, c.head_dim), "f16"), v, kv_rows,
                         name=f"{p}.cache_v_write")
    a = g.flash_attn(q, cache_k, cache_v, pos, kv_len, scale=1.0 / math.sqrt(c.head_dim), name=f"{p}.attn")
    a = g.reshape(a, shape=(n, c.n_head * c.head_dim))  # [n, n_head * head_dim]
    x = g.add(x, g.mul_mat(w("attn_output", c.dim, c.n_head * c.head_dim), a, name=f"{p}.attn_output"),
              name=f"{p}.attn_residual")
    h = _norm(x, f"{p}.ffn_norm", c)
    gate = g.mul_mat(w("ffn_gate", c.ffn_dim, c.dim), h, name=f"{p}.ffn_gate")
    up = g.mul_mat(w("ffn_up", c.ffn_dim, c.dim), h, name=f"{p}.ffn_up")
    act = g.swiglu_split(gate, up, name=f"{p}.ffn_swiglu")
    down = g.mul_mat(w("ffn_down", c.dim, c.ffn_dim), act, name=f"{p}.ffn_down")
    return g.add(x, down, name=f"{p}.ffn_residual")


def example_weights(graph: Graph, seed: int = 0) -> Weights:
    """Random f32 weights for every Param of `graph`: norms near 1, matrices small."""
    rng = np.random.default_rng(seed)
    out = Weights(source="<example weights>")
    for p in sorted(graph.params, key=lambda n: n.name or ""):
        if len(p.shape) == 1:
            data = 1.0 + 0.1 * rng.standard_normal(p.shape)
        else:
            data = rng.standard_normal(p.shape) / math.sqrt(p.shape[-1])  # keeps activations O(1)
        out.add(p.name, Weight("f32", p.shape, data.astype(np.float32)))
    return out


def example_inputs(token_ids: list[int] | np.ndarray, start: int) -> dict[str, np.ndarray]:
    """Runtime inputs for tokens placed at positions start..start+n-1 of the cache."""
    ids = np.asarray(token_ids, dtype=np.int32)
    positions = np.arange(start, start + len(ids), dtype=np.int32)
    return {"tokens": ids, "positions": positions, "kv_rows": positions.copy(),
            "kv_len": np.array([start + len(ids)], dtype=np.int32)}


@dataclass
class ExampleRun:
    prefill_logits: np.ndarray
    generated: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


def run_example(prompt_ids: list[int], max_new_tokens: int = 4, seed: int = 0, backend: str = "reference",
                config: ExampleConfig = ExampleConfig()) -> ExampleRun:
    """Prefill the prompt, then replay one decode Program per new token (greedy)."""
    from graphir.backends.registry import get_backend
    from graphir.run_inputs import new_state

    if not prompt_ids:
        raise InputError("example: the prompt is empty; give at least one token")
    if len(prompt_ids) + max_new_tokens > config.ctx:
        raise InputError(f"example: {len(prompt_ids)} prompt + {max_new_tokens} new tokens exceed the KV "
                         f"capacity {config.ctx}")
    lower = get_backend(backend).lower
    prefill = build_example("prefill", n_tokens=len(prompt_ids), config=config)
    weights = example_weights(prefill, seed)
    t0 = time.perf_counter()
    state = new_state(prefill)
    logits = lower(prefill, weights)(example_inputs(prompt_ids, 0), state)["logits"]
    run = ExampleRun(prefill_logits=logits, timings={"prefill_s": time.perf_counter() - t0})
    t1 = time.perf_counter()
    decode = lower(build_example("decode", config=config), weights)  # lowered once, replayed per token
    token = int(np.argmax(logits[-1]))
    for step in range(max_new_tokens):
        run.generated.append(token)
        if step + 1 < max_new_tokens:
            out = decode(example_inputs([token], len(prompt_ids) + step), state)
            token = int(np.argmax(out["logits"][-1]))
    run.timings["decode_s"] = time.perf_counter() - t1
    return run
