"""Where a GPU decode token's time goes: the whole decode step generate() runs (which samples on the
device), the Program call alone, and the captured CUDA graph alone.

    python benchmarks/profile_gpu_decode.py [MODEL] [--prompt 128] [--tokens 200]
    python benchmarks/profile_gpu_decode.py smollm2-135m --dtype f32 --verify 8   # a speculative verify call

(graph alone) is what the GPU needs per token, Input copy and error-flag read included (on sm_90+
also captured once more without programmatic dependent launch, backends/gpu/pdl.py); (Program
call) adds writing the pinned Inputs, the id's copy back and the wait; (decode step) adds the
model's Python around it. The gaps are
host time per token, which the replay issue brings down.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import graphir


def per_call_us(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def graph_alone(program):
    """A call that launches the Program's captured graph (as it is when called) and waits for it."""
    from graphir.backends.gpu.device import stream

    s = stream()

    def launch_and_wait() -> None:
        program._graph_exec.launch(s)
        s.synchronize()

    return launch_and_wait


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--kernels", type=int, default=12, help="show the N kernels with the most device time")
    ap.add_argument("--defines", default="", help="kernel variants to time too, e.g. 'GEMV_NR=2;GEMV_NR=4' "
                    "(';' between variants, ',' between the -D options of one; 'X@FILES' compiles X into the "
                    "sources FILES names instead of --define-files: '*', 'a.cu+b.cu', or '-a.cu' for all but a.cu)")
    ap.add_argument("--define-files", default="matmul.cu", help="the kernel sources --defines applies to")
    ap.add_argument("--dtype", default=None, help="convert the weights on load (graphir.load's dtype=)")
    ap.add_argument("--passes", default="default", help="the pass pipeline (e.g. default,q8-activations)")
    ap.add_argument("--verify", type=int, default=0, help="profile the greedy verify call of this many tokens "
                    "(graphir/speculative.py) instead of the decode step")
    ap.add_argument("--gemvm", default=None, help="the 2..16-token float GEMV geometry (backends/gpu/matmul.py "
                    "GEMVM_CONFIGS) a verify call takes")
    ap.add_argument("--min-chunk", default="", help="decode attention's MIN_CHUNK values to time the captured "
                    "step at too, e.g. '64,32,16' (backends/gpu/attention.py; each lowers the step again)")
    ap.add_argument("--target-blocks", default="", help="decode attention's TARGET_BLOCKS values (its grid at full "
                    "context; 0: one wave, the shipped None) to time the captured step at too, e.g. '264,528,0'")
    ap.add_argument("--gemv1", default="", help="m == 1 GEMV choices (backends/gpu/matmul.py GEMV1_KERNEL) to time "
                    "the captured step with too, e.g. 'q4_0=v3r4+tc+tc@t2w8+tc@t4w4:4096/t1w8:0' (tc@TABLE: the "
                    "geometry by row tiles, as backends/gpu/gemv_tc.py geometry_for reads it; each lowers the step "
                    "again)")
    ap.add_argument("--tc-swiglu", default="", help="q4_0's fused gate|up + swiglu kernel choices (backends/gpu/"
                    "gemv_tc.py SW_GEOMETRY) to time the captured step with too, e.g. 'auto+t2w16+off' (off: the "
                    "plain product, then swiglu_halves_f32)")
    ap.add_argument("--sw-max-mib", default="", help="backends/gpu/matmul.py SW_MAX_BYTES values in MiB to time the "
                    "captured step with too, e.g. '32+0' (0: every gate|up product but q4_0's on tensor cores unfused)")
    args = ap.parse_args()
    if args.gemvm:
        from graphir.backends.gpu import matmul

        matmul.GEMVM_KERNEL = args.gemvm
    if args.verify:
        profile_verify(args)
        return
    from graphir.backends.gpu import pdl

    from graphir.generate import Settings

    model = graphir.load(args.model, backend="gpu", passes=args.passes, dtype=args.dtype)
    settings = Settings()  # greedy: the step returns the argmax id
    model.feed(np.arange(args.prompt) % 200 + 1, last_only=True)
    model._decode_sample(1, settings)
    model._decode_sample(2, settings)  # the decode Program is captured on its second call
    program = model._program(1, False, sampler=True)
    assert program.captured, "decode Program not captured"
    feed_us = per_call_us(lambda: model._decode_sample(3, settings), args.tokens)
    n = model.n_past
    feeds = {"tokens": np.array([3], np.int32), "pos": np.array([n], np.int32), "kv_idx": np.array([n], np.int32),
             "kv_len": np.array([n + 1], np.int32), "sampling": settings.row()[None]}
    call_us = per_call_us(lambda: program(feeds, model._state), args.tokens)
    graph_only = graph_alone(program)
    graph_us = per_call_us(graph_only, args.tokens)
    rows = [("Model decode step (whole step)", feed_us), ("Program call", call_us),
            ("captured graph alone (launch+sync)", graph_us)]
    if pdl.enabled():  # the same step captured again with each kernel waiting for the last to end
        rows.append(("  the same graph without PDL", recaptured_us(program, model._state, graph_only, args.tokens)))
    rows += variant_rows(program, model._state, graph_only, args)
    steps = len(program._steps)
    print(f"model {args.model}: decode step = {steps} kernels, captured (programmatic dependent launch: "
          f"{'on' if pdl.enabled() else 'off'}); context {n}")
    print(f"{'what':<34} {'us/token':>9}")
    for what, us in rows:
        print(f"{what:<34} {us:9.1f}")
    print(f"graph time per kernel: {graph_us / steps:.2f} us; host time per token: {feed_us - graph_us:.1f} us")
    if args.min_chunk:
        sweep_attention(model, settings, "MIN_CHUNK", [int(v) for v in args.min_chunk.split(",")], args.tokens)
    if args.target_blocks:
        sweep_attention(model, settings, "TARGET_BLOCKS", [int(v) or None for v in args.target_blocks.split(",")],
                        args.tokens)
    if args.gemv1:
        sweep_gemv1(model, settings, args.gemv1, args.tokens)
    if args.sw_max_mib:
        from graphir.backends.gpu import matmul

        def set_limit(v: str) -> None:
            matmul.SW_MAX_BYTES = int(v) << 20

        sweep(model, settings, "matmul.SW_MAX_BYTES (MiB)", set_limit, args.sw_max_mib.split("+"),
              str(matmul.SW_MAX_BYTES >> 20), args.tokens)
    if args.tc_swiglu:
        from graphir.backends.gpu import gemv_tc

        def set_sw(v: str) -> None:
            gemv_tc.SW_GEOMETRY = None if v == "off" else v

        sweep(model, settings, "gemv_tc.SW_GEOMETRY", set_sw, args.tc_swiglu.split("+"), gemv_tc.SW_GEOMETRY or "off",
              args.tokens)

    if args.kernels:
        kernel_table(program, args.kernels)


def sweep_attention(model, settings, name: str, values: list, n: int) -> None:
    """The captured decode step lowered again at each value of decode attention's setting `name` (MIN_CHUNK:
    rows a split at least; TARGET_BLOCKS: the grid at full context, None for one wave)."""
    from graphir.backends.gpu import attention

    sweep(model, settings, f"decode attention {name}", lambda v: setattr(attention, name, v), values,
          getattr(attention, name), n)


def sweep_gemv1(model, settings, spec: str, n: int) -> None:
    """The captured decode step lowered again with each m == 1 GEMV choice of --gemv1 ("q4_0=v3r4+tc+tc@t2w8":
    "tc@CFG" is the tensor-core kernel in geometry CFG of backends/gpu/gemv_tc.py, "tc" its GEOMETRY)."""
    from graphir.backends.gpu import gemv_tc, matmul

    fmt, _, values = spec.partition("=")
    shipped_geometry = gemv_tc.GEOMETRY

    def set_value(v: str) -> None:
        kernel, _, cfg = v.partition("@")
        matmul.GEMV1_KERNEL[fmt] = kernel
        gemv_tc.GEOMETRY = cfg or shipped_geometry

    sweep(model, settings, f"GEMV1_KERNEL[{fmt}]", set_value, values.split("+"),
          f"{matmul.GEMV1_KERNEL[fmt]}@{shipped_geometry}", n)


def sweep(model, settings, label: str, set_value, values: list, shipped, n: int) -> None:
    """Time the captured graph alone after set_value(v) for each value, at the model's current context (a few
    tokens longer each time); the shipped value is set again after."""
    try:
        for v in values:
            set_value(v)
            model.programs.clear()
            model._decode_sample(3, settings)
            model._decode_sample(3, settings)  # captured on its second call
            program = model._program(1, False, sampler=True)
            assert program.captured, "decode Program not captured"
            us = per_call_us(graph_alone(program), n)
            print(f"{label} {v}: captured graph alone {us:8.1f} us (context {model.n_past})")
    finally:
        set_value(shipped)
        model.programs.clear()


def profile_verify(args) -> None:
    """A b-token greedy verify call at position --prompt: the whole call, the Program call, its captured
    graph alone (when every step can be captured), and the kernel table."""

    from graphir import speculative as sp

    model = graphir.load(args.model, backend="gpu", passes=args.passes, dtype=args.dtype)
    model.feed(np.arange(args.prompt) % 200 + 1, last_only=True)
    tokens = list(range(3, 3 + args.verify))
    for _ in range(3):  # the Program is captured on its second call
        sp.verify(model, tokens, greedy=True)
    b = sp.verify_bucket(len(tokens), model.kv_capacity - model.n_past)
    program = sp.verify_program(model, b, greedy=True)
    steps = program._steps
    others = sorted({getattr(s, "name", type(s).__name__) for s in steps if not getattr(s, "capturable", False)})
    print(f"model {args.model} ({args.dtype or 'as stored'}): verify call of {len(tokens)} tokens (bucket {b}) = "
          f"{len(steps)} steps, captured: {program.captured}; steps that cannot be captured: {others or 'none'}")
    rows = [("verify() whole call", per_call_us(lambda: sp.verify(model, tokens, greedy=True), args.tokens))]
    if program.captured:
        rows.append(("captured graph alone (launch+sync)", per_call_us(graph_alone(program), args.tokens)))
        rows += variant_rows(program, model._state, graph_alone(program), args)
    for what, us in rows:
        print(f"{what:<34} {us:9.1f} us")
    if args.kernels:
        kernel_table(program, args.kernels)


def variant_rows(program, state, graph_only, args) -> list[tuple[str, float]]:
    """(label, us) of the captured Program with each --defines variant's kernels (and without PDL, where it is
    on), then the shipped kernels bound again."""
    from graphir.backends.gpu import pdl

    rows = []
    for variant in filter(None, args.defines.split(";")):
        variant, _, fileset = variant.partition("@")
        defines, files = tuple(variant.split(",")), define_files(fileset or args.define_files)
        where = f" in {fileset}" if fileset else ""
        rows.append((f"  kernels with -D{' -D'.join(defines)}{where}",
                     recaptured_us(program, state, graph_only, args.tokens, defines, True, files)))
        if pdl.enabled():
            rows.append(("    and without PDL", recaptured_us(program, state, graph_only, args.tokens, defines, False,
                                                              files)))
    recaptured_us(program, state, graph_only, 1, pdl_on=True)  # back to the shipped kernels
    return rows


def define_files(spec: str) -> tuple[str, ...]:
    """Kernel sources from a --defines file set: "a.cu,b.cu" (or '+' between names), "*" for every source,
    "-a.cu+b.cu" for every source but those."""
    from graphir.backends.gpu import kernels

    names = spec.lstrip("-").replace("+", ",").split(",")
    if spec == "*":
        return tuple(kernels.SOURCES)
    if spec.startswith("-"):
        return tuple(k for k in kernels.SOURCES if k not in names)
    return tuple(names)


def recaptured_us(program, state, graph_only, n: int, defines: tuple[str, ...] = (), pdl_on: bool = False,
                  files: tuple[str, ...] = ()) -> float:
    """The decode graph's time after binding it again with the kernel sources `files` compiled with
    `defines` added, and capturing it with or without programmatic dependent launch."""
    from graphir.backends.gpu import kernels
    from graphir.backends.gpu.device import stream

    shipped = dict(kernels.SOURCES)
    kernels.SOURCES.update({k: v + defines for k, v in shipped.items() if k in files})
    kernels.clear()
    os.environ["GRAPHIR_NO_PDL"] = "0" if pdl_on else "1"
    try:
        with stream():
            program._bind(state)
            program._run_steps(stream())  # loads every kernel before the capture
            program._graph_exec = program._capture()
        return per_call_us(graph_only, n)
    finally:
        del os.environ["GRAPHIR_NO_PDL"]
        kernels.SOURCES.update(shipped)
        kernels.clear()


def kernel_table(program, top: int) -> None:
    """Device time per kernel name, each step of the decode Program replayed alone (kernel_times.py)."""
    from graphir.backends.gpu.kernel_times import step_times

    per: dict[str, list[float]] = {}
    for name, sec in step_times(program):
        per.setdefault(name, []).append(sec * 1e6)
    total = sum(sum(v) for v in per.values())
    print(f"{'kernel':<34} {'calls':>5} {'us/call':>8} {'us/step':>8} {'share':>6}")
    for name, v in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{name:<34} {len(v):5d} {sum(v) / len(v):8.2f} {sum(v):8.1f} {100 * sum(v) / total:5.1f}%")
    print(f"{'sum of kernels, each replayed alone':<34} {sum(len(v) for v in per.values()):5d} {'':>8} {total:8.1f}")


if __name__ == "__main__":
    main()
