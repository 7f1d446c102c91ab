"""Where a new process's time to the first token goes, phase by phase, on the cpu backend.

    python benchmarks/first_token_phases.py                 # SmolLM2, the README's 5-token prompt
    python benchmarks/first_token_phases.py --model random:llama-tiny --tokens 5

Run it with numba's cache warm (after one `graphir run`): it times what a second `graphir run` does
before its first token, in the order it does it, in this fresh interpreter: imports, load, the prompt's
tokens, the prefill graph and its passes (from the disk cache that earlier runs filled,
GRAPHIR_NO_GRAPH_CACHE=1 to run them; the State buffers are sized from this graph), lowering, the first
call (binding: kernels loaded from numba's cache, weights stacked or repacked; then the run), the host
sampling of the first token and its text. `--numba-start-up` pays numba's full start-up (the typing
and target contexts a compile needs, which a cache load no longer does: backends/cpu/cache_load.py)
on a line of its own before the first call, to show what it would cost.
"""

from __future__ import annotations

import argparse
import time

T0 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", default="The capital of France is", help="the README's (5 tokens)")
    ap.add_argument("--tokens", type=int, default=None, help="prompt tokens instead of --prompt's (ids 100..)")
    ap.add_argument("--numba-start-up", action="store_true", help="time numba's full start-up on its own line")
    a = ap.parse_args()
    times: list[tuple[str, float]] = []
    t = [time.perf_counter()]

    def mark(name: str) -> None:
        now = time.perf_counter()
        times.append((name, now - t[0]))
        t[0] = now

    times.append(("argparse (after the interpreter started)", t[0] - T0))
    import graphir.cli  # noqa: F401  (what `graphir run` imports first)

    mark("import graphir.cli")
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
    mark(f"tokenize ({len(ids)} tokens), plan the calls")
    graph = m.programs.passed(m._graph(b, True), m.passes)
    m._ensure_state(m._graph(b, True))
    mark(f"prefill graph ({b} tokens) + passes, State")
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
    text = m.tokenizer.stream().push(token)
    mark(f"sample, the token's text {text!r}")
    program(feeds, m._state)
    mark("second call (the run alone)")
    total = sum(s for name, s in times if not name.startswith(("second", "numba's")))
    for name, s in times:
        print(f"{name:56s} {s:6.3f} s")
    print(f"{'to the first token (' + str(len(graph.states)) + ' States)':56s} {total:6.3f} s")


if __name__ == "__main__":
    main()
