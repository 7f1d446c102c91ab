"""`graphir bench --tp N`: bench.bench's measurements taken inside the workers of a tensor-parallel model.

Every rank runs the same timed calls in lockstep (each rank's generate, feed and replays take part in
the same collectives); rank 0's timings are reported, in bench.bench's keys, so bench.render prints
them. What differs with tp:
  weight_bytes            the bytes one decode token reads on one rank: its slices of the weights
                          (a Param only looked up by get_rows, such as an untied embedding, counts one row)
  state_bytes             one rank's recurrent State read and written per token
  bandwidth_bytes_s       one GPU's (or the host's) copy bandwidth, measured by rank 0
  bandwidth_limit_tok_s   bandwidth / (weight_bytes + state_bytes): every rank reads its share at once
  collective_step_s       gpu: device seconds of the decode step's collectives alone (NCCL calls and the
                          peer-memory all-reduce kernels of backends/gpu/p2p.py, whichever the step holds),
                          captured into a graph of their own and replayed back to back (CUDA events on rank 0)
  collective_path         which path the decode step's all-reduces took: "p2p", "nccl" or "p2p+nccl", with
                          the counts in collective_counts (also printed as a note under the table)
  collective_share        collective_step_s / decode_step_device_s. The collectives alone run with no
                          compute between them and the ranks already in step; inside the step an
                          all-reduce also absorbs the wait for the slower rank, so this is a floor
Peers (llama.cpp, HF) and the new-process timings are not run with tp.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import numpy as np

from graphir import bench as B
from graphir.dtypes import numpy_dtype
from graphir.passes import spell_pipeline


def bench_tp(spec: str, backend: str, passes: str, prefill_tokens: int, prompt_tokens: int, decode_tokens: int,
             repeats: int, long_prefill_tokens: int | None, tp: int) -> dict[str, Any]:
    from graphir.api import load

    on_gpu = backend == "gpu"
    t0 = time.perf_counter()
    model = load(spec, backend=backend, passes=passes, tp=tp)
    load_s = time.perf_counter() - t0
    try:
        long_prefill_tokens = B.checked_lengths(model.config.ctx, prefill_tokens, prompt_tokens, decode_tokens,
                                                long_prefill_tokens, on_gpu)
        r = model.call(measure_rank, prefill_tokens, prompt_tokens, decode_tokens, repeats, long_prefill_tokens)
        source = model.source
    finally:
        model.close()
    p_best, p_med = B._rates(prefill_tokens, r["prefill_times"])
    d_best, d_med = B._rates(decode_tokens, r["decode_times"])
    lp_best, lp_med = B._rates(long_prefill_tokens, r["long_times"]) if r["long_times"] else (0.0, 0.0)
    limit = r["bandwidth"] / (r["weight_bytes"] + r["state_bytes"])
    step_s, coll_s = r["step_device_s"], r["collective_step_s"]
    counts = r["collective_counts"]
    path = collective_path(counts)
    return {
        "model": spec, "source": source, "backend": backend, "passes": passes, "pipeline": spell_pipeline(passes),
        "tp": tp,
        "prefill_tokens": prefill_tokens, "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens,
        "repeats": repeats, "first_bench_in_process": True,
        "load_s": load_s, "ttft_first_s": r["ttft_first"], "ttft_warm_s": r["ttft_warm"],
        "prefill_tok_s_best": p_best, "prefill_tok_s_median": p_med,
        "decode_tok_s_best": d_best, "decode_tok_s_median": d_med,
        "peak_rss_bytes": r["rss"], "arena_bytes": r["arena"], "programs": r["programs"],
        "weight_bytes": r["weight_bytes"], "state_bytes": r["state_bytes"],
        "bandwidth_bytes_s": r["bandwidth"], "bandwidth_limit_tok_s": limit, "decode_fraction_of_limit": d_best / limit,
        "device_memory_bytes": r["device_bytes"],
        "long_prefill_tokens": long_prefill_tokens, "prefill_long_tok_s_best": lp_best,
        "prefill_long_tok_s_median": lp_med,
        "decode_step_device_s": step_s if on_gpu else 0.0,
        "host_us_per_token": (1 / d_best - step_s) * 1e6 if on_gpu else 0.0,
        "collective_step_s": coll_s if on_gpu else 0.0,
        "collective_share": coll_s / step_s if on_gpu and step_s > 0 else 0.0,
        "collective_path": path, "collective_counts": counts,
        "ttft_new_process_s": 0.0, "ttft_cold_process_s": 0.0,
        "machine": {**B.machine(), **({"gpu": f"{tp} x {r['gpu']}"} if on_gpu else {})},
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "llama_cpp": None,
        "llama_cpp_note": "peers (llama.cpp, HF) are not run with tp" + (f"; {_describe(counts)}" if on_gpu else ""),
        "hf_eager": None, "hf_compiled": None, "hf_note": "",
    }


def measure_rank(model: Any, prefill_tokens: int, prompt_tokens: int, decode_tokens: int, repeats: int,
                 long_prefill_tokens: int) -> dict[str, Any]:
    """On every rank (through TensorParallelModel.call): bench.bench's timed calls on this rank's Model."""
    on_gpu = model.backend == "gpu"
    ids = B.token_ids(model, max(prefill_tokens, prompt_tokens, long_prefill_tokens))
    prompt, prefill = ids[:prompt_tokens], ids[:prefill_tokens]
    out: dict[str, Any] = {
        "ttft_first": B._ttft(model, prompt, extra=min(2, decode_tokens)),
        "ttft_warm": B._ttft(model, prompt),
    }
    B._prefill_s(model, prefill)
    out["prefill_times"] = [B._prefill_s(model, prefill) for _ in range(repeats)]
    out["decode_times"] = [B._decode_s(model, prompt, decode_tokens) for _ in range(repeats)]
    out["step_device_s"] = B._decode_step_device_s(model) if on_gpu else float("nan")
    out["collective_step_s"], out["collective_counts"] = collective_step_s(model) if on_gpu else (float("nan"), {})
    out["long_times"] = []
    if long_prefill_tokens:
        B._prefill_s(model, ids[:long_prefill_tokens])
        out["long_times"] = [B._prefill_s(model, ids[:long_prefill_tokens]) for _ in range(repeats)]
    out["rss"] = B.peak_rss_bytes()
    out["arena"], out["programs"] = B.arena_bytes(model)
    out["weight_bytes"], out["state_bytes"] = rank_decode_bytes(model)
    out["device_bytes"] = B.device_memory_bytes() if on_gpu else 0
    out["bandwidth"] = B.measure_device_bandwidth() if on_gpu else B.measure_bandwidth()
    out["gpu"] = B.gpu_name() if on_gpu else ""
    return out


def rank_decode_bytes(model: Any) -> tuple[int, int]:
    """(weight bytes, recurrent State bytes read + written) of one decode token on this rank: its decode
    graph after the passes (its weight slices, its States)."""
    graph = model.programs.passed(model._graph(1), model.passes)
    users = graph.users()
    weights = 0
    for p in graph.params:
        w = model.weights[p.name]
        row_only = all(u.op == "get_rows" and u.src[0] is p for u in users[id(p)])
        weights += w.nbytes // w.shape[0] if row_only and w.shape else w.nbytes
    state = sum(2 * int(np.prod(u.src[0].shape)) * np.dtype(numpy_dtype(u.src[0].dtype)).itemsize
                for u in graph.updates if u.op == "assign")
    return weights, state


def collective_steps(steps: list[Any]) -> list[Any]:
    """A Program's collective steps: NCCL calls and peer-memory all-reduce launches."""
    from graphir.backends.gpu import p2p
    from graphir.backends.gpu.nccl import NcclCall

    return [s for s in steps if isinstance(s, NcclCall) or p2p.is_p2p_step(s)]


def collective_counts(steps: list[Any]) -> dict[str, int]:
    """How many of the collective steps took each path."""
    from graphir.backends.gpu import p2p

    counts = {"all_reduce_p2p": 0, "all_reduce_nccl": 0, "all_gather_nccl": 0}
    for s in steps:
        if p2p.is_p2p_step(s):
            counts["all_reduce_p2p"] += 1
        else:
            counts["all_gather_nccl" if s.name.startswith("all_gather") else "all_reduce_nccl"] += 1
    return counts


def collective_path(counts: dict[str, int]) -> str:
    """Which path the all-reduces took: "p2p", "nccl", "p2p+nccl", or "none"."""
    paths = [p for p in ("p2p", "nccl") if counts.get(f"all_reduce_{p}")]
    return "+".join(paths) or "none"


def _describe(counts: dict[str, int]) -> str:
    return (f"decode all-reduces: {collective_path(counts)} ({counts.get('all_reduce_p2p', 0)} over peer memory, "
            f"{counts.get('all_reduce_nccl', 0)} NCCL; {counts.get('all_gather_nccl', 0)} NCCL all_gathers)")


def collective_step_s(model: Any) -> tuple[float, dict[str, int]]:
    """Device seconds of the decode step's collectives alone (NCCL calls and peer-memory all-reduce
    kernels): captured into a CUDA graph of their own and replayed 20 times back to back, best of 3
    (every rank replays, or the calls would wait forever; the peer kernels' epochs advance alike on
    every rank, so the step's own graph stays in step afterwards). With the step's path counts."""
    from graphir.backends.gpu.device import stream

    program = model._program(1, False, sampler=True)
    calls = collective_steps(program._steps)
    counts = collective_counts(calls)
    if not calls:
        return float("nan"), counts
    s = stream()
    with s:
        s.begin_capture()
        try:
            for call in calls:
                call()
        finally:
            graph = s.end_capture()
        graph.launch(s)  # warm-up
        best = B.best_replay_s(graph.launch, s)
    return best, counts
