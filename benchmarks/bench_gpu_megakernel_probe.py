"""Can one persistent kernel run a whole decode step faster than one kernel an op? A probe for issue 10.

Qwen3-0.6B's decode step is 258 kernels and ~820 us, where its weight bytes at copy bandwidth take ~280 us
(BENCHMARKS.md, "the per-kernel floor"): most of the step is kernel boundaries and the latency chains of the
small ops between GEMVs, while DRAM idles. benchmarks/megakernel_probe.cu runs the whole step (28 layers of
norms, q|k|v, q/k norm and rope, the KV write, attention, o, gate|up with swiglu, down; the final norm and the
LM head) as one cooperative kernel, a block an SM: each block streams its weight tiles for the whole step
through a shared-memory ring with TMA bulk copies, ahead of their use, so weight traffic continues while
attention and the hand-offs between stages run; activations pass between blocks as 8-byte (value,
generation) words that readers poll, with no grid barrier. The position is read on the device (replay-safe).

Random bf16 weights with Qwen3-0.6B's shapes (or --preset 8b), a KV cache of random bf16 rows before the
step's position; checked against an f32 cupy evaluation of the same step (logits, and the KV row written),
then timed as the best of 5 batches of launches. Printed: us a step, the weight bytes at the copy bandwidth
measured in the same run over that, and block 0's time in each stage (from %globaltimer at each barrier).

    python benchmarks/bench_gpu_megakernel_probe.py [--preset 0.6b] [--layers 28] [--pos 128] [--reps 20]
        [--slots 6]

Compare with the backend's captured step in the same call: `python benchmarks/profile_gpu_decode.py
random:qwen3-0.6b --kernels 0`. Exits non-zero when a check fails (gpu_suite.sh runs it).

Measured (one H200, 2026-12-03, BENCHMARKS.md twenty-third session): 855-884 us a step at position 128
(32 % of the bytes at copy bandwidth), against the backend's captured step of 814 us at context 195 (258
kernels): not faster. A stage's work is 1.2-2.7 us a block, but handing its output to the next stage costs
2.4-4.1 us (the last writer's words to every block's complete view), five hand-offs a layer: the same order as
the PDL kernel boundaries they replace. The weight stream is not the limit (every layer reading layer 0's
weights from L2: 828 us).
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np
from bench_gpu_launch_floor import best_replay_us  # this directory is on sys.path when run as a script

from graphir.bench import measure_device_bandwidth

PROBE = Path(__file__).with_name("megakernel_probe.cu")
PRESETS = {  # hidden, query heads, kv heads, intermediate, vocab, layers (head dim 128)
    "0.6b": (1024, 16, 8, 3072, 151936, 28),  # the kernel's shared buffers fit hidden <= 1024, inter <= 3072, 16 heads
}
D = 128
THREADS = 8 * 32  # MK_THREADS
SLOT_BYTES = 32768
CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2  # cuda.h CUlaunchAttributeID
EPS, THETA = 1e-6, 1e6


class Model(ctypes.Structure):  # megakernel_probe.cu's Model, field for field
    _fields_ = [(n, ctypes.c_void_p) for n in ("layers", "head", "out_norm", "h0", "h", "qkv", "part", "f", "logits",
                                                "pos", "epoch", "stamps")] + \
               [(n, ctypes.c_int) for n in ("n_layers", "hidden", "n_q", "n_kv", "inter", "vocab", "ctx")] + \
               [("eps", ctypes.c_float), ("rope_theta", ctypes.c_float)]


def bf16(cp, shape, scale, rng) -> tuple:
    """(bf16 bits, their f32 values) of N(0, scale^2) draws."""
    f = rng.standard_normal(shape, dtype=cp.float32) * np.float32(scale)
    bits = (f.view(cp.uint32) >> 16).astype(cp.uint16)
    return bits, bits_to_f32(cp, bits)


def round_bf16(cp, x):
    """Round to nearest even bf16, as the kernel stores the cache."""
    u = x.astype(cp.float32).view(cp.uint32)
    u = (u + cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1))) & cp.uint32(0xFFFF0000)
    return u.view(cp.float32)


def bits_to_f32(cp, bits):
    return (bits.astype(cp.uint32) << 16).view(cp.float32)


def f32_to_bits(cp, x):
    """The bf16 bits of values that are already bf16."""
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)


def rmsnorm(cp, x, w):
    return x / cp.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS) * w


def rope(cp, x, pos: int):
    """NeoX halves: pairs (i, i + 64), angle pos * theta^(-2i/128)."""
    i = cp.arange(D // 2, dtype=cp.float64)
    ang = pos * THETA ** (-2 * i / D)
    c, s = cp.cos(ang).astype(cp.float32), cp.sin(ang).astype(cp.float32)
    a, b = x[..., : D // 2], x[..., D // 2:]
    return cp.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def reference(cp, w, h0, pos: int, caches):
    """The step in f32: logits and each layer's (k, v) rows as the cache should hold them."""
    hidden, n_q, n_kv, inter, vocab, _ = w["shape"]
    h, rows = h0.copy(), []
    for lw, (kc, vc) in zip(w["layers"], caches):
        a = rmsnorm(cp, h, lw["attn_norm"])
        qkv = lw["wqkv"][1] @ a
        q = qkv[: n_q * D].reshape(n_q, D)
        k = qkv[n_q * D:(n_q + n_kv) * D].reshape(n_kv, D)
        v = qkv[(n_q + n_kv) * D:].reshape(n_kv, D)
        q = rope(cp, rmsnorm(cp, q, lw["q_norm"]), pos)
        k = round_bf16(cp, rope(cp, rmsnorm(cp, k, lw["k_norm"]), pos))
        v = round_bf16(cp, v)
        rows.append((k, v))
        keys = cp.concatenate([kc[:, :pos], k[:, None]], axis=1)  # [n_kv, pos + 1, D]
        vals = cp.concatenate([vc[:, :pos], v[:, None]], axis=1)
        grp = n_q // n_kv
        s = cp.einsum("hd,htd->ht", q, cp.repeat(keys, grp, axis=0)) / np.float32(np.sqrt(D))
        p = cp.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        o = cp.einsum("ht,htd->hd", p, cp.repeat(vals, grp, axis=0)).reshape(-1)
        h = h + lw["wo"][1] @ o
        gu = lw["wgu"][1] @ rmsnorm(cp, h, lw["ffn_norm"])
        g, u = gu[0::2], gu[1::2]
        h = h + lw["wd"][1] @ (g / (1 + cp.exp(-g)) * u)
    return w["head"][1] @ rmsnorm(cp, h, w["out_norm"]), rows


def build(cp, shape, ctx: int, rng):
    hidden, n_q, n_kv, inter, vocab, n_layers = shape
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n, dtype=cp.float32)).astype(cp.float32)  # noqa: E731
    layers = []
    for _ in range(n_layers):
        layers.append({
            "wqkv": bf16(cp, ((n_q + 2 * n_kv) * D, hidden), hidden ** -0.5, rng),
            "wo": bf16(cp, (hidden, n_q * D), (n_q * D) ** -0.5, rng),
            "wgu": bf16(cp, (2 * inter, hidden), hidden ** -0.5, rng),
            "wd": bf16(cp, (hidden, inter), inter ** -0.5, rng),
            "attn_norm": norm(hidden), "ffn_norm": norm(hidden), "q_norm": norm(D), "k_norm": norm(D),
            "kc": bf16(cp, (n_kv, ctx, D), 1.0, rng)[:1], "vc": bf16(cp, (n_kv, ctx, D), 1.0, rng)[:1],
        })
    return {"shape": shape, "layers": layers, "head": bf16(cp, (vocab, hidden), hidden ** -0.5, rng),
            "out_norm": norm(hidden)}


def launcher(cp, w, bufs, ctx: int, slots: int, defines: tuple[str, ...] = ()):
    """A run(stream) that launches the probe kernel cooperatively over every SM."""
    from graphir.backends.gpu import pdl

    hidden, n_q, n_kv, inter, vocab, n_layers = w["shape"]
    fn = cp.RawKernel(PROBE.read_text(), "decode_step", options=("-std=c++17", f"-DMK_SLOTS={slots}", *defines))
    shared = 1024 + slots * SLOT_BYTES + 4 * (3072 + 1024 + 8) + 4 * (3 * D + 8 * (2 + D) + 3 * D)
    fn.max_dynamic_shared_size_bytes = shared
    keys = ("wqkv", "wo", "wgu", "wd", "attn_norm", "ffn_norm", "q_norm", "k_norm", "kc", "vc")
    table = np.array([[(lw[k][0] if isinstance(lw[k], tuple) else lw[k]).data.ptr for k in keys]
                      for lw in w["layers"]], dtype=np.uint64)
    layers = cp.asarray(table)
    ptr = lambda a: a.data.ptr  # noqa: E731
    m = Model(ptr(layers), ptr(w["head"][0]), ptr(w["out_norm"]), ptr(bufs["h0"]), ptr(bufs["h"]), ptr(bufs["qkv"]),
              ptr(bufs["part"]), ptr(bufs["f"]), ptr(bufs["logits"]), ptr(bufs["pos"]), ptr(bufs["epoch"]),
              ptr(bufs["stamps"]), n_layers, hidden, n_q, n_kv, inter, vocab, ctx, EPS, THETA)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(m))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    attr = pdl._LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_COOPERATIVE, value=1)
    fn_ptr = fn.kernel.ptr  # the CUfunction

    def run(s) -> None:
        cfg = pdl._LaunchConfig(sms, 1, 1, THREADS, 1, 1, shared, s.ptr, ctypes.pointer(attr), 1)
        err = pdl._driver_launch()(ctypes.byref(cfg), fn_ptr, params, None)
        if err:
            raise RuntimeError(f"cooperative launch of decode_step failed: CUresult {err}")

    run.keep = (fn, layers, m, params)  # alive as long as the launcher
    return run


def print_stages(t, n_layers: int) -> None:
    """When each stage's inputs were in and its work done, over the blocks (min / median / max, us from the
    earliest block's q|k|v inputs of the same layer; mean over the layers after the first)."""
    rel = []
    for layer in range(1, n_layers):
        s = t[:, 10 * layer: 10 * layer + 10]
        rel.append((s - s[:, 0].min()) / 1e3)
    rel = np.mean(rel, axis=0) if rel else (t[:, :10] - t[:, 0].min()) / 1e3  # [block, 10]
    print(f"{'stage':>10} {'inputs in: min / median / max':>32} {'work done: min / median / max':>32}")
    for i, name in enumerate(("q|k|v", "attention", "o", "gate|up", "down")):
        cells = [" / ".join(f"{f(rel[:, 2 * i + j]):6.2f}" for f in (np.min, np.median, np.max)) for j in (0, 1)]
        print(f"{name:>10} {cells[0]:>32} {cells[1]:>32}")
    nxt = (t[:, 10 * n_layers] - t[:, 10 * (n_layers - 1)].min()) / 1e3
    print(f"a layer (the last's start to the head's inputs, median over blocks): {np.median(nxt):.2f} us; first "
          f"layer (launch to layer 1's inputs, median): {np.median(t[:, 10] - t[:, 0].min()) / 1e3:.2f} us; head "
          f"(inputs in to done, median): {np.median(t[:, 10 * n_layers + 1] - t[:, 10 * n_layers]) / 1e3:.2f} us")


def main() -> None:
    import cupy as cp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="0.6b")
    ap.add_argument("--layers", type=int, default=0, help="layers (default: the preset's)")
    ap.add_argument("--pos", type=int, default=128, help="the step's position (keys before it: random cache rows)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--slots", type=int, default=6, help="ring slots of 32 KiB a block")
    ap.add_argument("--defines", default="", help="';'-separated kernel macros, e.g. 'MK_POLL_SLEEP=100;MK_NO_WAIT' "
                    "(MK_NO_WAIT: measurement only, its results are wrong)")
    ap.add_argument("--same-weights", action="store_true", help="every layer reads layer 0's weights (they stay in "
                    "L2: what the step costs when the weight stream is not the limit)")
    args = ap.parse_args()
    shape = list(PRESETS[args.preset])
    if args.layers:
        shape[5] = args.layers
    hidden, n_q, n_kv, inter, vocab, n_layers = shape
    if (hidden, n_q * D, inter) != (1024, 2048, 3072):
        raise SystemExit("the probe kernel is compiled for Qwen3-0.6B's widths (MK_HIDDEN, MK_ATT, MK_INTER)")
    if not 0 <= args.pos < args.ctx - 1:
        raise SystemExit(f"--pos {args.pos} must lie in [0, --ctx {args.ctx} - 1): the probe also runs pos + 1")
    bw = measure_device_bandwidth()
    rng = cp.random.default_rng(0)
    w = build(cp, tuple(shape), args.ctx, rng)
    if args.same_weights:
        for lw in w["layers"][1:]:
            lw.update({k: w["layers"][0][k] for k in ("wqkv", "wo", "wgu", "wd")})
    n_st = 5 * n_layers  # stages before the head
    u64 = lambda n: cp.zeros(n, cp.uint64)  # noqa: E731  LL words (value, generation)
    bufs = {"h0": rng.standard_normal(hidden, dtype=cp.float32), "h": u64(hidden), "qkv": u64((n_q + 2 * n_kv) * D),
            "part": u64(n_q * 4 * 132), "f": u64(inter), "logits": cp.zeros(vocab, cp.float32),
            "pos": cp.asarray([args.pos], cp.int32), "epoch": cp.zeros(2 + 5 * n_layers, cp.uint32),
            "stamps": cp.zeros((cp.cuda.Device().attributes["MultiProcessorCount"], 2 * n_st + 2), cp.uint64)}
    defines = tuple(f"-D{d}" for d in args.defines.split(";") if d)
    run = launcher(cp, w, bufs, args.ctx, args.slots, defines)
    s = cp.cuda.Stream(non_blocking=True)
    # Two positions through the same launcher (the position is a device value); the second step's keys
    # include the row the first step wrote.
    failed = []
    for pos in (args.pos, args.pos + 1):
        caches = [(bits_to_f32(cp, lw["kc"][0]), bits_to_f32(cp, lw["vc"][0])) for lw in w["layers"]]
        want, rows = reference(cp, w, bufs["h0"], pos, caches)
        bufs["pos"][...] = pos
        bufs["logits"].fill(0)
        cp.cuda.Device().synchronize()  # the cupy work above ran on the default stream, the kernel runs on s
        run(s)
        s.synchronize()
        got = bufs["logits"]
        err = float(cp.abs(got - want).max() / cp.abs(want).max())
        # a KV element may round to the bf16 neighbour of the f32 reference's (sums in another order)
        kv_bad = 0
        for lw, row in zip(w["layers"], rows):
            for c, r in zip(("kc", "vc"), row):
                diff = cp.abs(bits_to_f32(cp, lw[c][0][:, pos]) - r)
                kv_bad += int((diff > 2.0 ** -7 * cp.abs(r) + 1e-4 * cp.abs(r).max()).sum())
        same_argmax = int(got.argmax()) == int(want.argmax())
        ok = err < 1e-3 and kv_bad == 0 and same_argmax
        print(f"check at position {pos}: max |logit error| / max |logit| {err:.2e}, argmax "
              f"{'equal' if same_argmax else 'DIFFERS'}, KV elements off by more than a bf16 ulp: {kv_bad}"
              f"{'' if ok else '  MISMATCH'}")
        if not ok:
            failed.append(pos)
    wbytes = sum(lw[k][0].nbytes for lw in w["layers"] for k in ("wqkv", "wo", "wgu", "wd")) + w["head"][0].nbytes
    floor = wbytes / bw * 1e6
    us = best_replay_us(run, s, args.reps)
    t = cp.asnumpy(bufs["stamps"]).astype(np.int64)  # [block, 10 a layer + 2]: (inputs in, work done) a stage
    print(f"(the timed launches all run position {args.pos + 1})")
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; preset {args.preset}, {n_layers} layers, position {args.pos}; "
          f"{wbytes / 1e9:.3f} GB of bf16 weights: {floor:.1f} us at copy bandwidth")
    print(f"megakernel step: {us:.1f} us ({1e6 / us:.0f} tok/s), {100 * floor / us:.1f} % of the bytes at copy "
          f"bandwidth; {THREADS} threads a block, {args.slots} slots of {SLOT_BYTES // 1024} KiB"
          + (f"; defines {args.defines}" if args.defines else "") + ("; same weights" if args.same_weights else ""))
    print_stages(t, n_layers)
    if failed and "MK_NO_WAIT" not in args.defines:  # MK_NO_WAIT's results are wrong by design
        raise SystemExit(f"the probe's step differs from the f32 reference at position(s) {failed}")


if __name__ == "__main__":
    main()
