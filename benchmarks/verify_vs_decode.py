"""Where a speculative verify call's rows part from the decode steps they stand for, tensor by tensor.

    python benchmarks/verify_vs_decode.py MODEL [--backend gpu] [--dtype f32] [--passes auto] [--prompt 20] [--tokens 5]

After a prompt, one verify call reads --tokens tokens (its bucket); then the same tokens run as decode
steps from the same State. Both graphs (after the model's passes) are lowered again with every uniquely
named tensor that has a row per token as an extra output, and row t of each is compared with decode step
t's: the first tensor in the verify graph's order that is not bitwise equal is the one to look at. Greedy
speculative decoding equals plain greedy decoding only where the logits are (tests/test_speculative.py).
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import numpy as np
from graphir.backends.registry import get_backend

import graphir
from graphir import speculative as sp
from graphir.ir import Graph


def host(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def probe(graph: Graph, rows: int) -> Graph:
    """`graph` with each uniquely named op tensor of `rows` rows added as an output."""
    nodes = graph.nodes()
    counts = Counter(n.name for n in nodes if n.name)
    extra = {n.name: n for n in nodes if n.name and counts[n.name] == 1 and not n.is_leaf and n.types is None
             and n.shape and n.shape[0] == rows and n.name not in graph.outputs}
    for n in nodes:  # the results of a named multi-output op (the delta rule's output, say), as "name[i]"
        if n.op == "item" and n.src[0].name and n.shape and n.shape[0] == rows:
            extra.setdefault(f"{n.src[0].name}[{n.params['index']}]", n)
    return Graph({**graph.outputs, **extra}, graph.updates, graph.meta)


def run(model: graphir.Model, graph: Graph, inputs: dict, state: dict) -> dict[str, np.ndarray]:
    from graphir.run_inputs import new_state

    backend = get_backend(model.backend)
    missing = [n for n in graph.states if n.name not in state]
    if missing:  # per-token state rows of a recurrent verify graph
        state.update(getattr(backend, "new_state", new_state)(Graph({n.name: n for n in missing})))
    program = model.programs.get_program(graph, model.weights, model.backend, "")  # lowered once, replayed
    return {k: host(v) for k, v in program(model._slot_inputs(inputs), state).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--backend", default="gpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--passes", default="auto", help="the pass pipeline (graphir.load's passes=)")
    ap.add_argument("--prompt", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=5)
    ap.add_argument("--show", type=int, default=8, help="diverging tensors listed")
    args = ap.parse_args()
    model = graphir.load(args.model, backend=args.backend, ctx=max(256, args.prompt + 64), dtype=args.dtype,
                         passes=args.passes)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.n_vocab, args.prompt).tolist()
    tokens = rng.integers(0, model.config.n_vocab, args.tokens).tolist()
    model.reset()
    model.feed(prompt)
    start = {k: v.copy() for k, v in model._state.items()}
    n, m = model.n_past, len(tokens)

    b = sp.verify_bucket(m, model.kv_capacity - n)
    keep = b > 1 and sp.keeps_states(model)
    verify = model.programs.passed(sp.verify_graph(model, b, greedy=False), model.passes)
    out = run(model, probe(verify, b), sp.verify_inputs(n, tokens, b, keep), {k: v.copy() for k, v in start.items()})
    real = slice(0, m) if keep else slice(b - m, b)  # the rows of the real tokens
    rows = {k: v[real] for k, v in out.items()}

    decode = probe(model.programs.passed(model._graph(1), model.passes), 1)
    state, steps = {k: v.copy() for k, v in start.items()}, []
    for t, tok in enumerate(tokens):
        p = np.array([n + t], np.int32)
        steps.append(run(model, decode, {"tokens": np.array([tok], np.int32), "pos": p, "kv_idx": p.copy(),
                                         "kv_len": np.array([n + t + 1], np.int32)}, state))

    print(f"{args.model} on {args.backend} ({model.passes}): {m} tokens after {n}, verify bucket {b}"
          f"{', per-token states' if keep else ''}; {len(rows)} verify tensors, {len(steps[0])} decode tensors")
    order = [k for k in rows if k not in verify.outputs] + list(verify.outputs)  # topological, outputs last
    compared, diverging = 0, []
    for name in order:
        if name not in steps[0] or rows[name].shape[1:] != steps[0][name].shape[1:]:
            continue
        compared += 1
        want = np.concatenate([s[name] for s in steps]).astype(np.float64)
        got = rows[name].astype(np.float64)
        if not np.array_equal(got, want):
            bad = [t for t in range(m) if not np.array_equal(got[t], want[t])]
            scale = float(np.abs(want).max()) or 1.0
            diverging.append((name, float(np.abs(got - want).max()) / scale, bad))
    print(f"compared {compared} tensors bit for bit: {len(diverging)} differ")
    for name, rel, bad in diverging[:args.show]:
        print(f"  {name:40s} max |diff| / max |value| {rel:.3g}, rows {bad}")
    if "logits" in rows:
        print("logits bitwise equal" if not any(d[0] == "logits" for d in diverging) else "logits differ")


if __name__ == "__main__":
    main()
