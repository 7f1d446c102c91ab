"""Benchmark the numba CPU matmul kernels on SmolLM2-135M shapes.

    python benchmarks/bench_matmul.py [--reps N] [--prefill 512] [--layers 30] [--skip-prefill]

Model: d=576, ffn=1536, 9 heads x 64 (q/o 576x576), 3 kv heads x 64 (k/v 192x576),
vocab 49152; layer weights q4_1, output head (tied token_embd) q8_0. Each of the 30
layers gets its own random weights, so a decode step streams ~96 MB like the real
model (nothing stays in cache from one token to the next).

Reports per-matmul and whole-model times for decode (n_tok=1) and prefill
(n_tok=512, with and without the head: llama.cpp computes logits for the last prompt
token only), as GB/s of weight bytes, GFLOP/s, and the tok/s ceiling that the matmuls
alone allow. The whole-model pass runs twice: through `matmul()` and through
`prepare_matmul()` callables (validation done once, as a runtime with fixed buffers
would). Times are the minimum over --reps runs; the machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

D, FFN, KV, VOCAB = 576, 1536, 192, 49152
LAYER = [
    ("attn_q", D, D),
    ("attn_k", KV, D),
    ("attn_v", KV, D),
    ("attn_output", D, D),
    ("ffn_gate", FFN, D),
    ("ffn_up", FFN, D),
    ("ffn_down", D, FFN),
]


def quantize_rows(rng, n_out, n_in, qtype):
    """Random valid ggml blocks: quantize N(0, 0.05) floats with gguf-py, in chunks."""
    from gguf.quants import quantize

    out = []
    for r in range(0, n_out, 4096):
        m = min(4096, n_out - r)
        out.append(quantize((rng.standard_normal((m, n_in)) * 0.05).astype(np.float32), qtype))
    return np.concatenate(out)


def make_model(n_layers, seed=0):
    import gguf

    q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    layers = [{name: quantize_rows(rng, o, i, q.Q4_1) for name, o, i in LAYER} for _ in range(n_layers)]
    head = quantize_rows(rng, VOCAB, D, q.Q8_0)
    return layers, head


def timeit(fn, reps):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run(n_tok, layers, head, reps):
    from graphir.backends.cpu.matmul import matmul, prepare_matmul

    rng = np.random.default_rng(1)
    xd = rng.standard_normal((n_tok, D)).astype(np.float32)
    xf = rng.standard_normal((n_tok, FFN)).astype(np.float32)
    outs = {name: np.empty((n_tok, o), np.float32) for name, o, _ in LAYER}
    yh = np.empty((n_tok, VOCAB), np.float32)
    rows = []
    for name, o, i in LAYER:  # per matmul: layer 0's weights again and again (warm caches)
        w, x, y = layers[0][name], (xf if i == FFN else xd), outs[name]
        dt = timeit(lambda w=w, x=x, y=y: matmul(w, "q4_1", x, y), reps)
        rows.append((name, "q4_1", o, i, w.nbytes, dt))
    dt = timeit(lambda: matmul(head, "q8_0", xd, yh), reps if n_tok == 1 else max(1, reps // 3))
    rows.append(("output", "q8_0", VOCAB, D, head.nbytes, dt))

    def layers_pass():
        for lw in layers:
            for name, _, i in LAYER:
                matmul(lw[name], "q4_1", xf if i == FFN else xd, outs[name])

    prepared = [
        prepare_matmul(lw[name], "q4_1", xf if i == FFN else xd, outs[name])[0] for lw in layers for name, _, i in LAYER
    ]

    def prepared_pass():
        for f in prepared:
            f()

    n = reps if n_tok == 1 else max(1, reps // 5)
    return rows, timeit(layers_pass, n), timeit(prepared_pass, n)


def report(title, n_tok, rows, t_layers, t_prep, layers, head):
    n_layers = len(layers)
    flop_layer = sum(2 * o * i for _, o, i in LAYER) * n_tok
    bytes_layers = sum(w.nbytes for lw in layers for w in lw.values())
    print(f"\n== {title}: n_tok={n_tok} ==")
    print(f"{'matmul':12s} {'dtype':5s} {'shape':>12s} {'time':>10s} {'GB/s':>7s} {'GFLOP/s':>8s}")
    for name, dt_name, o, i, nb, dt in rows:
        shape = f"{o}x{i}"
        gflops = 2 * o * i * n_tok / dt / 1e9
        print(f"{name:12s} {dt_name:5s} {shape:>12s} {dt * 1e3:8.3f}ms {nb / dt / 1e9:7.2f} {gflops:8.1f}")
    t_head = rows[-1][-1]
    for label, tl in (("matmul()", t_layers), ("prepare_matmul()", t_prep)):
        per = tl / n_layers
        tot = tl + t_head
        flop_tot = flop_layer * n_layers + 2 * VOCAB * D * n_tok
        print(
            f"[{label}] one layer (7 matmuls, avg over {n_layers} distinct layers): {per * 1e3:.3f} ms, "
            f"{bytes_layers / n_layers / per / 1e9:.2f} GB/s, {flop_layer / per / 1e9:.1f} GFLOP/s"
        )
        print(
            f"[{label}] {n_layers} layers {tl * 1e3:.2f} ms + head {t_head * 1e3:.2f} ms = {tot * 1e3:.2f} ms: "
            f"{(bytes_layers + head.nbytes) / tot / 1e9:.2f} GB/s, {flop_tot / tot / 1e9:.1f} GFLOP/s, "
            f"ceiling {n_tok / tot:.1f} tok/s"
        )
        if n_tok > 1:
            print(
                f"[{label}] layers only (logits of the last token only, as llama.cpp): ceiling {n_tok / tl:.1f} tok/s"
            )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--skip-prefill", action="store_true")
    args = ap.parse_args()

    import numba

    t0 = time.perf_counter()
    import graphir.backends.cpu.matmul as mm

    t1 = time.perf_counter()
    mm.matmul(np.zeros((4, 360), np.uint8), "q4_1", np.ones((1, D), np.float32))
    t2 = time.perf_counter()
    print(
        f"numba {numba.__version__}, {numba.get_num_threads()} threads ({numba.threading_layer()}); "
        f"import {t1 - t0:.2f} s, first call (compile, or load from numba's cache) {t2 - t1:.2f} s"
    )

    t = time.perf_counter()
    layers, head = make_model(args.layers)
    print(
        f"random model: {sum(w.nbytes for lw in layers for w in lw.values()) / 1e6:.1f} MB q4_1 layers + "
        f"{head.nbytes / 1e6:.1f} MB q8_0 head (built in {time.perf_counter() - t:.1f} s)"
    )

    report("decode", 1, *run(1, layers, head, args.reps), layers, head)
    if not args.skip_prefill:
        report("prefill", args.prefill, *run(args.prefill, layers, head, max(2, args.reps // 5)), layers, head)


if __name__ == "__main__":
    main()
