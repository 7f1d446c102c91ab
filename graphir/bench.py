"""`graphir bench`: load a model and measure what a user of it waits for, with wall-clock time.

    from graphir.bench import bench
    r = bench("smollm2-135m")               # load, TTFT (first and warm), prefill, decode, RSS, bound
    print(r["decode_tok_s_best"], r["bandwidth_limit_tok_s"])

What is measured (time.perf_counter, one process, in this order):
  load_s                  graphir.load(spec, backend, passes): file read, no lowering yet
  passes, pipeline        the pipeline as named ("auto" resolved: the backend's, e.g. "cpu") and spelled out
  ttft_first_s            the first generate() in this model: a prompt of prompt_tokens, then the first
                          sampled token; it includes building, passing and lowering the prefill graph
                          (and numba compiling its kernels, unless numba's cache on disk has them)
  ttft_warm_s             the same again, every Program already lowered
  prefill_tok_s_*         prefill_tokens fed at once from an empty cache (warm), best and median of repeats
  decode_tok_s_*          decode_tokens greedy tokens after a prompt of prompt_tokens (warm, EOS ignored),
                          counted from the first sampled token to the last, sampling included
  prefill_long_tok_s_*    the same at long_prefill_tokens (gpu default 4096), when asked for and the context fits
  decode_step_device_s    gpu: device time of one captured decode step (its graph replayed alone, CUDA events)
  host_us_per_token       gpu: best decode time per token minus decode_step_device_s: what Python and the
                          two small copies add per token, since the host waits for every token's id
  ttft_new_process_s      a new Python process: import, load, and the first token of the prompt, with the
                          kernel caches this run filled (what a second `graphir run` waits for)
  ttft_cold_process_s     the same with empty kernel caches (CUPY_CACHE_DIR and NUMBA_CACHE_DIR fresh):
                          what the very first run after install waits for
  peak_rss_bytes          getrusage's ru_maxrss so far (the whole process: Python, numba, the model)
  arena_bytes             sum of the arenas of the model's lowered Programs (CPU backend)
  weight_bytes            bytes of weights one decode token reads: every weight once (a tied embedding
                          once, as the head); an untied embedding only its one looked-up row
  bandwidth_bytes_s       a large copy (read + write bytes over the best time): numpy on the host, or a
                          device-to-device CuPy copy of 1 GiB for the gpu backend
  device_memory_bytes     gpu backend: bytes CuPy's memory pool holds at the end (weights, arenas, caches,
                          scratch): the peak, since the pool never returns memory; 0 on other backends
  state_bytes             recurrent State (conv windows, delta-rule states) one decode token reads and
                          writes: each State the decode graph assigns whole, twice its size; 0 without them
  bandwidth_limit_tok_s   (weight_bytes + state_bytes) / bandwidth: decode can not beat this at batch 1
  deltanet_share          gpu, models with Gated DeltaNet layers: their own kernels' (conv step, delta rule,
                          gated norm) share of a decode step's kernels, each replayed alone
                          (backends/gpu/kernel_times.py); the GEMVs of those layers not counted
  deltanet_floor_fraction gpu, the same models: state_bytes at the copy bandwidth over the device time of the
                          conv and delta-rule kernels (each alone), i.e. how near they run to their state
                          traffic's floor (issue 12's target is 85 %)
  draft_*                 with draft= (a model spec or "lookup"): greedy speculative decoding of decode_tokens
                          after the prompt against plain decoding, alternated in this run (best of repeats):
                          draft_decode_tok_s_best, draft_plain_tok_s_best, draft_speedup, draft_acceptance
                          (accepted / drafted), draft_tokens_per_verify, draft_equals_plain (greedy outputs equal)

When llama-cpp-python is importable and the model is a GGUF file, the same measurements run with
it in the same process for a same-run comparison, with as many threads as graphir's kernels may use
(`--threads N`, else numba's pool); otherwise `llama_cpp` is None and `llama_cpp_note` says why. It
is not a dependency. On the cpu backend `cpu_threads` records graphir's thread setting and, when it is
auto, the counts it had picked at the end of each timed decode run.
"""

from __future__ import annotations

import datetime
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from graphir.api import DEFAULT_MODEL, Model, load
from graphir.dtypes import numpy_dtype

TEXT = ("The quick brown fox jumps over the lazy dog. A language model reads its weights once for "
        "every token it writes, so memory bandwidth bounds how fast it can decode. ")

# Keys whose values are positive finite numbers in every result (the tests check them).
NUMBERS = ("load_s", "ttft_first_s", "ttft_warm_s", "prefill_tok_s_best", "prefill_tok_s_median",
           "decode_tok_s_best", "decode_tok_s_median", "peak_rss_bytes", "arena_bytes", "weight_bytes",
           "bandwidth_bytes_s", "bandwidth_limit_tok_s", "decode_fraction_of_limit")

_first_run_done = False  # the first bench() in a process also pays numba's kernel compilation


# ---------------------------------------------------------------- machine
def machine() -> dict[str, Any]:
    """CPU model, cores, numba threads and library versions of this machine."""
    import numba

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return {"cpu": cpu, "cores": os.cpu_count() or 1, "usable_cores": usable,
            "numba_threads": numba.get_num_threads(), "python": platform.python_version(),
            "numpy": np.__version__, "numba": numba.__version__, "platform": platform.platform()}


def measure_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a numpy copy of `megabytes` (read + write bytes, best of `repeats`)."""
    n = max(megabytes, 1) * (1 << 20) // 8
    src = np.ones(n, np.float64)
    dst = np.zeros(n, np.float64)  # both written once first, so no page fault lands in the timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def measure_device_bandwidth(megabytes: int = 1024, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device CuPy copy (read + write), best of `repeats`, after a warm-up
    (the first timings of an idle GPU run at low clocks)."""
    import cupy as cp

    src = cp.ones(megabytes * (1 << 20) // 4, cp.float32)
    dst = cp.empty_like(src)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(3):
        dst[...] = src
    best = float("inf")
    for _ in range(repeats):
        start.record()
        dst[...] = src
        stop.record()
        stop.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, stop) / 1e3)
    nbytes = src.nbytes
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()  # give the copy's buffers back
    return 2 * nbytes / best


def device_memory_bytes() -> int:
    import cupy as cp

    return int(cp.get_default_memory_pool().total_bytes())


def gpu_name() -> str:
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def peak_rss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb if sys.platform == "darwin" else kb * 1024)  # bytes on macOS, KiB on Linux


def checked_lengths(ctx: int, prefill_tokens: int, prompt_tokens: int, decode_tokens: int,
                    long_prefill_tokens: int | None, on_gpu: bool) -> int:
    """A ValueError where the runs do not fit the context; the long prefill's length (its default: 4096
    on the gpu where it fits, none elsewhere)."""
    if prefill_tokens > ctx or prompt_tokens + decode_tokens + 1 > ctx:
        raise ValueError(f"prefill {prefill_tokens} or prompt {prompt_tokens} + decode {decode_tokens} + 1 "
                         f"exceeds the model's context of {ctx}")
    if long_prefill_tokens is None:  # the default: the gpu's 4096 where it fits
        return 4096 if on_gpu and 4096 <= ctx else 0
    if long_prefill_tokens > ctx:  # asked for: dropped without a word, it looked measured
        raise ValueError(f"long prefill {long_prefill_tokens} exceeds the model's context of {ctx}")
    return long_prefill_tokens


def decode_weight_bytes(model: Model) -> int:
    """Weight bytes one decode token reads: all weights, an untied embedding table only as one row."""
    w = model.weights
    total = sum(x.nbytes for x in w.values())
    emb = w.get("token_embd.weight")
    if emb is not None and "output.weight" in w and emb.shape:
        total -= emb.nbytes - emb.nbytes // emb.shape[0]
    return total


def decode_state_bytes(model: Model) -> int:
    """Recurrent State bytes one decode token moves: each State the decode graph rewrites whole
    (`assign`: conv windows, delta-rule states) is read and written once. KV caches, written a row
    at a time, are left out: at a short context their rows are a small share."""
    graph = model.graph("decode")
    total = 0
    for u in graph.updates:
        if u.op == "assign":
            dst = u.src[0]
            total += 2 * int(np.prod(dst.shape)) * np.dtype(numpy_dtype(dst.dtype)).itemsize
    return total


def arena_bytes(model: Model) -> tuple[int, int]:
    """(sum of arena bytes, number of Programs) over the model's lowered Programs that report one."""
    entries = getattr(model.programs, "_programs", {})
    total = count = 0
    for entry in list(entries.values()):
        report = getattr(entry[1], "report", None)
        if callable(report):
            total += int(report().get("arena_bytes", 0))
            count += 1
    return total, count


def token_ids(model: Model, n: int) -> list[int]:
    """n deterministic ids: the tokenizer on TEXT repeated, or range ids when there is no tokenizer."""
    tok = model.tokenizer
    vocab = model.config.n_vocab
    ids: list[int] = []
    if tok is not None:
        text = TEXT
        while True:
            ids = [i for i in tok.encode(text) if i < vocab]
            if len(ids) >= n or not ids:
                break
            text += TEXT * max(1, (n - len(ids)) // max(len(ids), 1) + 1)
    if len(ids) < n:
        ids = [i % vocab for i in range(n)]
    return ids[:n]


def _rates(n: int, seconds: Sequence[float]) -> tuple[float, float]:
    return n / min(seconds), n / statistics.median(seconds)


# ---------------------------------------------------------------- graphir
def _ttft(model: Model, prompt: list[int], extra: int = 0) -> float:
    """Seconds from generate() to its first token; then `extra` more tokens are drawn (untimed)."""
    t0 = time.perf_counter()
    gen = model.generate(prompt, max_new_tokens=1 + extra, stop_at_eos=False)
    next(gen)
    dt = time.perf_counter() - t0
    for _ in gen:
        pass
    return dt


def _decode_s(model: Model, prompt: list[int], n: int) -> float:
    gen = model.generate(prompt, max_new_tokens=n + 1, stop_at_eos=False)
    next(gen)  # the prompt's token, from prefill
    t0 = time.perf_counter()
    count = sum(1 for _ in gen)
    dt = time.perf_counter() - t0
    assert count == n, (count, n)
    return dt


def _prefill_s(model: Model, ids: list[int]) -> float:
    model.reset()
    t0 = time.perf_counter()
    model.feed(ids, last_only=True)
    return time.perf_counter() - t0


def best_replay_s(replay: Callable[[Any], None], s: Any, reps: int = 20, rounds: int = 3) -> float:
    """Device seconds a `replay(s)`: `reps` calls back to back between two CUDA events on stream s, the
    best of `rounds` (what the GPU needs, without the host's launch gaps or one disturbed round)."""
    import cupy as cp

    start, stop = cp.cuda.Event(), cp.cuda.Event()
    best = float("inf")
    for _ in range(rounds):
        start.record(s)
        for _ in range(reps):
            replay(s)
        stop.record(s)
        stop.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, stop) / 1e3 / reps)
    return best


def _decode_step_device_s(model: Model) -> float:
    """Device seconds of one decode step: the captured launches of generate()'s step replayed alone."""
    from graphir.backends.gpu.device import stream

    program = model._program(1, False, sampler=True)
    if not program.captured:
        return float("nan")
    return best_replay_s(program.replay_once, stream())


def _deltanet_kernel_s(model: Model) -> tuple[float, float, float] | None:
    """(the Gated DeltaNet kernels, their conv and delta-rule kernels alone, all kernels) of generate()'s decode
    step in device seconds, each step replayed alone; None where the step is not captured."""
    from graphir.backends.gpu.kernel_times import DELTANET_STATE_KERNEL_PREFIXES, is_deltanet_kernel, step_times

    program = model._program(1, False, sampler=True)
    if not program.captured:
        return None
    times = step_times(program)
    mine = [(n, t) for n, t in times if is_deltanet_kernel(n)]
    state_kernels = sum(t for n, t in mine if n.startswith(DELTANET_STATE_KERNEL_PREFIXES))
    return sum(t for _, t in mine), state_kernels, sum(t for _, t in times)


NEW_PROCESS = """
import sys, time
t0 = time.perf_counter()
import graphir
m = graphir.load(sys.argv[1], backend=sys.argv[2], passes=sys.argv[3])
next(iter(m.generate([int(t) for t in sys.argv[4].split(",")], 1, stop_at_eos=False)))
print(time.perf_counter() - t0)
"""


def ttft_new_process(spec: str, backend: str, passes: str, prompt: list[int], cold: bool) -> float:
    """Wall seconds for a new interpreter to import graphir, load `spec` and yield its first token
    (interpreter start included). `cold`: empty kernel caches, as on the first run after install."""
    import subprocess
    import tempfile

    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        if cold:
            env["CUPY_CACHE_DIR"] = os.path.join(tmp, "cupy")
            env["NUMBA_CACHE_DIR"] = os.path.join(tmp, "numba")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", NEW_PROCESS, spec, backend, passes, ",".join(map(str, prompt))],
                       env=env, check=True, capture_output=True, text=True)
        return time.perf_counter() - t0


def bench(spec: str = DEFAULT_MODEL, backend: str = "auto", passes: str = "auto", prefill_tokens: int = 512,
          prompt_tokens: int = 128, decode_tokens: int = 256, repeats: int = 3, bandwidth_mb: int = 256,
          llama_cpp: bool = True, llama_cpp_threads: int | None = None, long_prefill_tokens: int | None = None,
          new_process: bool = False, compare_hf: bool = False,
          hf_compiled: bool = True, draft: str | None = None, draft_len: int = 4, tp: int = 1,
          dtype: str | None = None) -> dict[str, Any]:
    """Measure `spec` on `backend` after `passes`; a flat dict (see the module docstring for each key).
    `tp` > 1: tensor parallel over that many processes, measured inside them (graphir/bench_tp.py).
    `dtype`: the weights converted on load (graphir.load's dtype=), e.g. q4_0 by the project's quantizer."""
    global _first_run_done
    for name, v in (("prefill_tokens", prefill_tokens), ("prompt_tokens", prompt_tokens),
                    ("decode_tokens", decode_tokens), ("repeats", repeats)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    first_in_process = not _first_run_done
    _first_run_done = True

    from graphir.backends.registry import resolve_backend
    from graphir.passes import resolve_pipeline, spell_pipeline

    backend = resolve_backend(backend)
    passes = resolve_pipeline(passes, backend)  # "auto": the backend's pipeline, named in the result
    if dtype is not None and (tp != 1 or new_process or compare_hf):
        raise ValueError("--dtype does not run with --tp, --new-process or --compare yet")
    if tp != 1:
        if new_process or compare_hf or draft:
            raise ValueError("--new-process, --compare and --draft do not run with --tp yet")
        from graphir.bench_tp import bench_tp

        return bench_tp(spec, backend, passes, prefill_tokens, prompt_tokens, decode_tokens, repeats,
                        long_prefill_tokens, tp)
    on_gpu = backend == "gpu"
    t0 = time.perf_counter()
    model = load(spec, backend=backend, passes=passes, dtype=dtype)
    load_s = time.perf_counter() - t0
    ctx = model.config.ctx
    long_prefill_tokens = checked_lengths(ctx, prefill_tokens, prompt_tokens, decode_tokens,
                                          long_prefill_tokens, on_gpu)
    ids = token_ids(model, max(prefill_tokens, prompt_tokens, long_prefill_tokens))
    prompt, prefill = ids[:prompt_tokens], ids[:prefill_tokens]

    ttft_first = _ttft(model, prompt, extra=min(2, decode_tokens))  # the extra tokens lower the decode Program
    ttft_warm = _ttft(model, prompt)
    _prefill_s(model, prefill)  # lowers prefill_tokens' buckets
    prefill_times = [_prefill_s(model, prefill) for _ in range(repeats)]
    decode_times, picked = [], []
    for _ in range(repeats):
        decode_times.append(_decode_s(model, prompt, decode_tokens))
        picked.append(_cpu_threads_now(backend))
    step_device_s = _decode_step_device_s(model) if on_gpu else float("nan")
    state_bytes = decode_state_bytes(model)
    deltanet_s = _deltanet_kernel_s(model) if on_gpu and state_bytes else None
    long_times: list[float] = []
    if long_prefill_tokens:
        _prefill_s(model, ids[:long_prefill_tokens])  # lowers its buckets
        long_times = [_prefill_s(model, ids[:long_prefill_tokens]) for _ in range(repeats)]
    rss = peak_rss_bytes()  # before the bandwidth copy and llama.cpp add their own memory
    arena, n_programs = arena_bytes(model)
    weight_bytes = decode_weight_bytes(model)
    device_bytes = device_memory_bytes() if on_gpu else 0  # before the bandwidth copy adds its 2 GiB
    bandwidth = measure_device_bandwidth() if on_gpu else measure_bandwidth(bandwidth_mb)

    p_best, p_med = _rates(prefill_tokens, prefill_times)
    d_best, d_med = _rates(decode_tokens, decode_times)
    lp_best, lp_med = _rates(long_prefill_tokens, long_times) if long_times else (0.0, 0.0)
    limit = bandwidth / (weight_bytes + state_bytes)
    result: dict[str, Any] = {
        "model": spec, "source": model.source, "backend": backend, "passes": passes, "pipeline": spell_pipeline(passes),
        "prefill_tokens": prefill_tokens, "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens,
        "repeats": repeats, "first_bench_in_process": first_in_process,
        "load_s": load_s, "ttft_first_s": ttft_first, "ttft_warm_s": ttft_warm,
        "prefill_tok_s_best": p_best, "prefill_tok_s_median": p_med,
        "decode_tok_s_best": d_best, "decode_tok_s_median": d_med,
        "peak_rss_bytes": rss, "arena_bytes": arena, "programs": n_programs, "weight_bytes": weight_bytes,
        "state_bytes": state_bytes,
        "bandwidth_bytes_s": bandwidth, "bandwidth_limit_tok_s": limit, "decode_fraction_of_limit": d_best / limit,
        "device_memory_bytes": device_bytes,
        "long_prefill_tokens": long_prefill_tokens, "prefill_long_tok_s_best": lp_best,
        "prefill_long_tok_s_median": lp_med,
        "decode_step_device_s": step_device_s if on_gpu else 0.0,
        "deltanet_share": deltanet_s[0] / deltanet_s[2] if deltanet_s else 0.0,
        "deltanet_floor_fraction": state_bytes / bandwidth / deltanet_s[1] if deltanet_s and deltanet_s[1] else 0.0,
        "host_us_per_token": (1 / d_best - step_device_s) * 1e6 if on_gpu else 0.0,
        "ttft_new_process_s": 0.0, "ttft_cold_process_s": 0.0,
        "machine": {**machine(), **({"gpu": gpu_name()} if on_gpu else {})},
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "llama_cpp": None, "llama_cpp_note": "", "hf_eager": None, "hf_compiled": None, "hf_note": "",
        "cpu_threads": _cpu_threads_note(backend, picked),
    }
    if compare_hf:
        from graphir.bench_hf import hf_peers

        result["hf_eager"], result["hf_compiled"], result["hf_note"] = hf_peers(
            model, prefill, prompt, decode_tokens, repeats, compiled=hf_compiled)
    if draft:
        from graphir import speculative

        drafter = draft if draft == speculative.LOOKUP else load(draft, backend=backend, passes=passes, ctx=ctx)
        result["draft"] = draft
        result.update(speculative.bench_draft(model, drafter, prompt, decode_tokens + 1, draft_len, repeats))
    del model
    if new_process:
        result["ttft_new_process_s"] = ttft_new_process(spec, backend, passes, prompt, cold=False)
        result["ttft_cold_process_s"] = ttft_new_process(spec, backend, passes, prompt, cold=True)
    if llama_cpp and dtype is not None:  # graphir ran converted weights; llama.cpp would run the file as stored
        result["llama_cpp_note"] = f"no llama.cpp comparison: --dtype {dtype} converted the weights graphir ran"
    elif llama_cpp:
        result["llama_cpp"], result["llama_cpp_note"] = _maybe_llama_cpp(
            result["source"], prefill, prompt, decode_tokens, repeats, llama_cpp_threads or _peer_threads())
    else:
        result["llama_cpp_note"] = "llama.cpp comparison not requested"
    return result


def _cpu_threads_now(backend: str) -> int | None:
    """The thread count the cpu backend's next kernel would use (None on other backends)."""
    if backend != "cpu":
        return None
    from graphir.backends.cpu.threads import threads_now

    return threads_now()


def _cpu_threads_note(backend: str, picked: list[int | None]) -> str:
    """'N (fixed)', or 'auto: a, b, c' (the counts at the end of each timed decode run); '' off the cpu."""
    if backend != "cpu":
        return ""
    from graphir.backends.cpu.threads import get_threads

    fixed = get_threads()
    return f"{fixed} (fixed)" if fixed is not None else "auto: " + ", ".join(str(n) for n in picked)


def _peer_threads() -> int:
    """Threads for a CPU peer: graphir's fixed setting, else numba's pool (the most graphir's kernels use)."""
    from graphir.backends.cpu.threads import get_threads, pool_size

    return get_threads() or pool_size()


# ---------------------------------------------------------------- llama.cpp (optional)
def _maybe_llama_cpp(source: str, prefill: list[int], prompt: list[int], decode_tokens: int, repeats: int,
                     threads: int) -> tuple[dict[str, Any] | None, str]:
    if not source.lower().endswith(".gguf"):
        return None, "no llama.cpp comparison: the model is not a GGUF file"
    try:
        import llama_cpp
    except ImportError:
        return None, "llama-cpp-python is not installed: no same-run llama.cpp comparison"
    try:
        return _bench_llama_cpp(llama_cpp, source, prefill, prompt, decode_tokens, repeats, threads), \
            f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}, n_threads={threads}, same run"
    except Exception as e:  # a comparison must never sink the benchmark itself
        return None, f"llama.cpp comparison failed: {type(e).__name__}: {e}"


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on one GGUF, timed as graphir's runs are: greedy (temp 0), the cache reset
    before every run (no prefix reuse). benchmarks/bench_cpu_*.py interleave it with graphir's runs."""

    def __init__(self, llama_cpp: Any, path: str, prefill: list[int], prompt: list[int], decode_tokens: int,
                 threads: int):
        self.prefill, self.prompt, self.decode_tokens = prefill, prompt, decode_tokens
        n_ctx = max(len(prefill), len(prompt) + decode_tokens + 1) + 16
        t0 = time.perf_counter()
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.load_s = time.perf_counter() - t0

    def ttft_s(self) -> float:
        self.llm.reset()
        t = time.perf_counter()
        next(iter(self.llm.generate(self.prompt, temp=0.0, top_k=1, reset=True)))
        return time.perf_counter() - t

    def prefill_s(self) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(self.prefill)
        return time.perf_counter() - t

    def decode_s(self) -> float:
        """decode_tokens greedy tokens after the prompt, counted from the first sampled one."""
        self.llm.reset()
        gen = iter(self.llm.generate(self.prompt, temp=0.0, top_k=1, reset=True))
        next(gen)
        t = time.perf_counter()
        for _ in range(self.decode_tokens):
            next(gen)
        return time.perf_counter() - t


def _bench_llama_cpp(llama_cpp: Any, path: str, prefill: list[int], prompt: list[int], decode_tokens: int,
                     repeats: int, threads: int) -> dict[str, Any]:
    """The same numbers with llama.cpp."""
    llm = LlamaCpp(llama_cpp, path, prefill, prompt, decode_tokens, threads)
    first, warm = llm.ttft_s(), llm.ttft_s()
    llm.prefill_s()
    p_best, p_med = _rates(len(prefill), [llm.prefill_s() for _ in range(repeats)])
    d_best, d_med = _rates(decode_tokens, [llm.decode_s() for _ in range(repeats)])
    return {"load_s": llm.load_s, "ttft_first_s": first, "ttft_warm_s": warm, "prefill_tok_s_best": p_best,
            "prefill_tok_s_median": p_med, "decode_tok_s_best": d_best, "decode_tok_s_median": d_med}


# ---------------------------------------------------------------- report
def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


ROWS: tuple[tuple[str, str, Any], ...] = (
    ("load", "load_s", lambda v: f"{v:.2f} s"),
    ("TTFT, first run (lowering included)", "ttft_first_s", lambda v: f"{v:.3f} s"),
    ("TTFT, warm", "ttft_warm_s", lambda v: f"{v:.3f} s"),
    ("prefill tok/s, best", "prefill_tok_s_best", lambda v: f"{v:.1f}"),
    ("prefill tok/s, median", "prefill_tok_s_median", lambda v: f"{v:.1f}"),
    ("long prefill tok/s, best", "prefill_long_tok_s_best", lambda v: f"{v:.1f}"),
    ("decode tok/s, best", "decode_tok_s_best", lambda v: f"{v:.1f}"),
    ("decode tok/s, median", "decode_tok_s_median", lambda v: f"{v:.1f}"),
    ("speculative decode tok/s, best", "draft_decode_tok_s_best", lambda v: f"{v:.1f}"),
    ("plain decode tok/s, best (alternated with it)", "draft_plain_tok_s_best", lambda v: f"{v:.1f}"),
    ("speculative speedup", "draft_speedup", lambda v: f"{v:.2f}x"),
    ("draft acceptance", "draft_acceptance", lambda v: f"{v:.2f}"),
    ("tokens per verify call", "draft_tokens_per_verify", lambda v: f"{v:.2f}"),
    ("speculative output = plain greedy", "draft_equals_plain", lambda v: "yes" if v else "NO"),
    ("peak RSS", "peak_rss_bytes", _mib),
    ("arena (all Programs)", "arena_bytes", _mib),
    ("device memory (gpu, peak)", "device_memory_bytes", _mib),
    ("weight bytes per decode token", "weight_bytes", _mib),
    ("recurrent state bytes per decode token (read + write)", "state_bytes", _mib),
    ("copy bandwidth (read + write)", "bandwidth_bytes_s", lambda v: f"{v / 1e9:.2f} GB/s"),
    ("bandwidth-limit tok/s", "bandwidth_limit_tok_s", lambda v: f"{v:.1f}"),
    ("decode / limit", "decode_fraction_of_limit", lambda v: f"{100 * v:.1f} %"),
    ("decode step, device only", "decode_step_device_s", lambda v: f"{v * 1e6:.0f} us"),
    ("DeltaNet kernels' share of the decode step", "deltanet_share", lambda v: f"{100 * v:.1f} %"),
    ("DeltaNet state kernels / state-traffic floor", "deltanet_floor_fraction", lambda v: f"{100 * v:.1f} %"),
    ("host time per decode token", "host_us_per_token", lambda v: f"{v:.1f} us"),
    ("collectives alone per decode step (tp, device)", "collective_step_s", lambda v: f"{v * 1e6:.0f} us"),
    ("collectives' share of the decode step (tp, a floor)", "collective_share", lambda v: f"{100 * v:.1f} %"),
    ("TTFT, new process (caches warm)", "ttft_new_process_s", lambda v: f"{v:.2f} s"),
    ("TTFT, new process (caches cold)", "ttft_cold_process_s", lambda v: f"{v:.2f} s"),
)


HF_ROWS = (("logits vs graphir (max diff / max |logit|)", "logits_rel_diff", lambda v: f"{v:.1e}"),)
# rows shown only when the result has them (non-zero)
OPTIONAL = frozenset({"device_memory_bytes", "state_bytes", "prefill_long_tok_s_best", "decode_step_device_s",
                      "host_us_per_token", "ttft_new_process_s", "ttft_cold_process_s", "collective_step_s",
                      "collective_share", "deltanet_share", "deltanet_floor_fraction"})


def header_lines(result: dict[str, Any], command: str | None = None) -> list[str]:
    m = result["machine"]
    gpu = f"; GPU {m['gpu']}" if m.get("gpu") else ""
    lines = [f"machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), "
             f"numba threads {m['numba_threads']}{gpu}; python {m['python']}, numpy {m['numpy']}, numba {m['numba']}",
             f"date: {result['date']}"]
    if result.get("cpu_threads"):
        lines.append(f"cpu backend threads: {result['cpu_threads']}")
    if command:
        lines.append(f"command: {command}")
    if result.get("draft"):
        lines.append(f"speculative: draft {result['draft']}, draft_len {result['draft_len']}")
    tp = f" | tp {result['tp']} (rank 0's timings)" if result.get("tp", 1) > 1 else ""
    lines.append(f"model: {result['source']} | backend {result['backend']}{tp} | passes {_passes_text(result)}"
                 f" | prefill {result['prefill_tokens']}, prompt {result['prompt_tokens']}, "
                 f"decode {result['decode_tokens']}, repeats {result['repeats']}")
    return lines


def _passes_text(result: dict[str, Any]) -> str:
    """The pipeline as named, and spelled out where the name is a backend's (cpu, gpu), whose passes may change."""
    name, spelled = result["passes"] or "(none)", result.get("pipeline") or ""
    return f"{name} ({spelled})" if spelled and spelled != name else name


PEERS = (("llama_cpp", "llama.cpp (same run)"), ("hf_eager", "HF eager (same run)"),
         ("hf_compiled", "HF static+compile (same run)"))


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(column titles, rows of text): graphir, then each peer that ran (llama.cpp, HF)."""
    peers = [(title, result[key]) for key, title in PEERS if result.get(key)]
    columns = ["metric", "graphir"] + [title for title, _ in peers]
    rows = []
    for label, key, fmt in ROWS + HF_ROWS:
        if key in OPTIONAL and not result.get(key):
            continue  # e.g. device memory off the gpu backend
        row = [label, fmt(result[key]) if key in result else ""]
        row += [fmt(other[key]) if key in other else "" for _, other in peers]
        if any(cell for cell in row[1:]):
            rows.append(row)
    return columns, rows


def render(result: dict[str, Any], command: str | None = None, file: Any = None, plain: bool = False) -> None:
    """Print the header lines and the table: with rich unless `plain` or rich is missing, else plain text."""
    file = file or sys.stdout
    columns, rows = table_rows(result)
    notes = [result[k] for k in ("llama_cpp_note", "hf_note") if result.get(k)]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        plain = True
    if plain:
        widths = [max(len(r[i]) for r in [columns] + rows) for i in range(len(columns))]
        for line in header_lines(result, command):
            print(line, file=file)
        for r in [columns] + rows:
            cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
            print("  ".join(cells), file=file)
        for note in notes:
            print(note, file=file)
        return
    console = Console(file=file, width=120, highlight=False, soft_wrap=True)
    for line in header_lines(result, command):
        console.print(line, markup=False)
    table = Table(*columns)
    for c in table.columns[1:]:
        c.justify = "right"
    for r in rows:
        table.add_row(*r)
    console.print(table)
    for note in notes:
        console.print(note, markup=False)
