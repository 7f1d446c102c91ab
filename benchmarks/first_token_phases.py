"""Where a new process's time to the first token goes, phase by phase, on the cpu backend.

    python benchmarks/first_token_phases.py                 # SmolLM2, the README's 5-token prompt
    python benchmarks/first_token_phases.py --runs 7        # 7 fresh processes: median [min - max] per phase
    python benchmarks/first_token_phases.py --model random:llama-tiny --tokens 5

Run it with numba's cache warm (after one `graphir run`): it times what a second `graphir run` does
before its first token, in the order it does it, in this fresh interpreter: imports, resolving the
backend (`auto`, as `graphir run` without --backend: it looks for a GPU), load, the prompt's tokens,
the prefill graph and its passes (from the disk cache that earlier runs filled, GRAPHIR_NO_GRAPH_CACHE=1
to run them; the State buffers are sized from this graph), lowering, the first call (binding: kernels
loaded from numba's cache, weights stacked or repacked; then the run), the host sampling of the first
token and its text. Each phase has its wall time and this process's CPU time (user + system, both
cores): on a shared machine CPU time moves less with the load than wall time does.
`--numba-start-up` pays numba's full start-up (the typing and target contexts a compile needs, which a
cache load no longer does: backends/cpu/cache_load.py) on a line of its own before the first call, to
show what it would cost. `--runs N` runs the phases in N fresh processes (PYTHONDONTWRITEBYTECODE
unset, as after `pip install`) and prints each phase's median and range.
"""

from __future__ import annotations

import time

T0, C0 = time.perf_counter(), time.process_time()

import argparse  # noqa: E402  (after the clock starts)
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

TOTAL = "to the first token"


def phases(a: argparse.Namespace) -> list[tuple[str, float, float]]:
    """(phase, wall s, CPU s) of one process's way to its first token, in order."""
    times: list[tuple[str, float, float]] = []
    t = [time.perf_counter(), time.process_time()]

    def mark(name: str) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        times.append((name, now - t[0], cpu - t[1]))
        t[:] = [now, cpu]

    times.append(("interpreter start-up to here (argparse)", t[0] - T0, t[1] - C0))
    import graphir.cli  # noqa: F401  (what `graphir run` imports first)

    mark("import graphir.cli")
    from graphir.backends import registry

    backend = registry.resolve_backend(a.backend)
    mark(f"resolve backend {a.backend!r} -> {backend}")
    import graphir.backends.cpu  # noqa: F401

    mark("import the cpu backend (numba)")
    import numpy as np

    import graphir
    from graphir.generate import Settings

    m = graphir.load(a.model, backend="cpu")
    mark("graphir.load")
    ids = list(range(100, 100 + a.tokens)) if a.tokens else m.tokenizer.encode(a.prompt)
    m.reset()
    b = m.chunks(len(ids), last_only=True)[-1]
    mark("tokenize, plan the calls")
    m.programs.passed(m._graph(b, True), m.passes)
    m._ensure_state(m._graph(b, True))
    mark("prefill graph + passes, State")
    program = m._program(b, True)
    mark("lowering")
    if a.numba_start_up:
        from numba.core.registry import cpu_target

        cpu_target.target_context.refresh()
        cpu_target.typing_context.refresh()
        mark("numba's full start-up (not on the path)")
    rows = np.arange(b, dtype=np.int32)
    pos = np.concatenate([rows[len(ids):], rows[:len(ids)]])
    tokens = np.array([ids[0]] * (b - len(ids)) + ids, np.int32)
    feeds = {"tokens": tokens, "pos": pos, "kv_idx": pos, "kv_len": np.array([len(ids)], np.int32)}
    logits = program(feeds, m._state)["logits"][-1]
    mark("first call: bind (kernels from cache, weights) + run")
    token = Settings().sample(logits)
    m.tokenizer.stream().push(token)
    mark("sample, the token's text")
    program(feeds, m._state)
    mark("second call (the run alone)")
    on_path = [p for p in times if not p[0].startswith(("second", "numba's"))]
    times.append((TOTAL, sum(p[1] for p in on_path), sum(p[2] for p in on_path)))
    return times


def many(a: argparse.Namespace) -> None:
    """`--runs N`: the phases of N fresh processes, each phase's median [min - max] of wall and CPU time."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    args = [x for i, x in enumerate(sys.argv[1:]) if not x.startswith("--runs") and sys.argv[i] != "--runs"]
    runs = []
    for _ in range(a.runs):
        out = subprocess.run([sys.executable, __file__, *args, "--json"], env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr[-2000:])
        runs.append(json.loads(out.stdout.splitlines()[-1]))
    print(f"{a.runs} processes, load average before/after: {a.load} / {os.getloadavg()[0]:.2f}")
    print(f"{'phase':56s} {'wall s: median [min - max]':>27s} {'CPU s: median [min - max]':>27s}")
    for i, (name, _, _) in enumerate(runs[0]):
        wall = [r[i][1] for r in runs]
        cpu = [r[i][2] for r in runs]
        print(f"{name:56s} {statistics.median(wall):8.3f} [{min(wall):.3f} - {max(wall):.3f}]"
              f" {statistics.median(cpu):8.3f} [{min(cpu):.3f} - {max(cpu):.3f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", default="The capital of France is", help="the README's (5 tokens)")
    ap.add_argument("--tokens", type=int, default=None, help="prompt tokens instead of --prompt's (ids 100..)")
    ap.add_argument("--backend", default="auto", help="what to resolve, as `graphir run --backend` (runs on cpu)")
    ap.add_argument("--numba-start-up", action="store_true", help="time numba's full start-up on its own line")
    ap.add_argument("--runs", type=int, default=0, help="fresh processes to run and summarize (0: this one)")
    ap.add_argument("--json", action="store_true", help="print the phases as one JSON line")
    a = ap.parse_args()
    if a.runs:
        a.load = f"{os.getloadavg()[0]:.2f}"
        many(a)
        return
    times = phases(a)
    if a.json:
        print(json.dumps(times))
        return
    for name, wall, cpu in times:
        print(f"{name:56s} {wall:6.3f} s  (CPU {cpu:6.3f} s)")


if __name__ == "__main__":
    main()
