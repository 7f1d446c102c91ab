"""Where a new process's time to the first token goes, phase by phase, on the cpu backend.

    python benchmarks/first_token_phases.py                 # SmolLM2, the README's 5-token prompt
    python benchmarks/first_token_phases.py --model random:llama-tiny --tokens 5

Run it with numba's cache warm (after one `graphir run`): it times what a second `graphir run`
does before its first token, in the order it does it, in this fresh interpreter: imports, load,
graph builds and passes (the decode graph too: the model's state buffers are sized from it; passed
graphs come from the disk cache that earlier runs filled, GRAPHIR_NO_GRAPH_CACHE=1 to run them),
lowering, numba's one-time start-up (its typing and target contexts, paid at the first kernel it
loads), and the first prefill call (binding: kernels loaded from the cache, weights repacked).
"""

from __future__ import annotations

import argparse
import time

T0 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=5, help="prompt tokens (padded to the prefill bucket)")
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
    from graphir.backends.registry import get_backend

    import graphir
    from graphir.run_inputs import new_state

    m = graphir.load(a.model, backend="cpu")
    mark("graphir.load")
    m.programs.passed(m.graph("decode"), m.passes)  # as a Model does: from disk when an earlier run made it
    mark("decode graph + passes (state buffers)")
    b = m.chunks(a.tokens)[-1]
    graph = m.programs.passed(m.graph("prefill", b, last_only=True), m.passes)
    mark(f"prefill graph ({b} tokens) + passes")
    program = get_backend("cpu").lower(graph, m.weights)
    mark("lowering")
    from numba.core.registry import cpu_target

    cpu_target.target_context.refresh()
    cpu_target.typing_context.refresh()
    mark("numba start-up (first kernel load pays it)")
    pos = np.arange(b, dtype=np.int32)
    feeds = {"tokens": pos + 100, "pos": pos, "kv_idx": pos, "kv_len": np.array([a.tokens], np.int32)}
    state = new_state(graph)
    program(feeds, state)
    mark("first call: bind (kernels from cache, repacking) + run")
    program(feeds, state)
    mark("second call (the run alone)")
    total = sum(s for name, s in times if not name.startswith("second"))
    for name, s in times:
        print(f"{name:48s} {s:6.3f} s")
    print(f"{'to the first logits':48s} {total:6.3f} s")


if __name__ == "__main__":
    main()
