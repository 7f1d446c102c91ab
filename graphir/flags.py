"""Debug flags, all read from environment variables at the moment they are used.

| variable                | effect                                                                  |
|-------------------------|-------------------------------------------------------------------------|
| GRAPHIR_VERIFY_PASSES=1 | `run_pipeline` runs the verifier after every pass and names the culprit |
| GRAPHIR_DUMP_PASSES=1   | `run_pipeline` prints a text dump (graphir.dump) after every pass       |
| GRAPHIR_NO_FUSION=1     | the `default` pipeline skips every fusion and keeps lint + cleanup only |
| GRAPHIR_DEBUG_CACHE=1   | cache misses say which key part changed; gpu Programs say when they (re)capture |
| GRAPHIR_NO_CAPTURE=1    | gpu Programs never capture into CUDA graphs (every call launches kernels) |
| GRAPHIR_NO_PDL=1        | captured gpu graphs: each kernel starts after the last one ends (no PDL) |
| GRAPHIR_NO_QUEUE=1      | gpu generate(): each decode step waits for the host (no step queued ahead) |
| GRAPHIR_NO_KV_MERGE=1   | gpu Programs launch q rope, the K and the V cache writes as three kernels, not one |
| GRAPHIR_NO_BF16_TWINS=1 | gpu Programs: a prefill GEMM's x is written as f32 and cast to bf16 (no bf16 twin) |
| GRAPHIR_REQUIRE_KERNEL_COMPILERS=1 | the kernel-compile tests fail, not skip, without NVRTC or hipcc (CI) |
| GRAPHIR_NO_PRECOMPILE=1 | cpu backend, cold numba cache: no helper process compiles matmul kernels meanwhile |
| GRAPHIR_NO_GRAPH_CACHE=1 | models run their pass pipelines every time instead of reading earlier results from disk |
| GRAPHIR_NO_WEIGHT_CACHE=1 | cpu backend: stacked and repacked weights derived in memory, never on disk |
| GRAPHIR_NO_HEADER_CACHE=1 | GGUF headers parsed every time, never read from or written to disk |
| GRAPHIR_NO_NRT_CACHE=1 | cpu backend: numba's runtime library compiled in every process, never kept on disk |
| GRAPHIR_DEBUG_THREADS=1 | cpu backend, auto threads: each window's busy, steal, own CPU and count, to stderr |

A flag is on when its variable is set to anything but "" or "0".
"""

from __future__ import annotations

import os

FLAGS: dict[str, str] = {
    "GRAPHIR_VERIFY_PASSES": "verify the graph after every pass",
    "GRAPHIR_DUMP_PASSES": "print a text dump after every pass",
    "GRAPHIR_NO_FUSION": "the default pipeline skips fusions",
    "GRAPHIR_DEBUG_CACHE": "print why each program-cache lookup missed, and gpu captures and recaptures",
    "GRAPHIR_NO_CAPTURE": "gpu Programs launch every kernel from Python, never from a captured graph",
    "GRAPHIR_NO_PDL": "captured gpu graphs without programmatic dependent launch (each kernel waits for the last)",
    "GRAPHIR_NO_QUEUE": "gpu generate() runs one decode step at a time, none queued ahead of the host",
    "GRAPHIR_NO_KV_MERGE": "gpu Programs launch each layer's q rope, K and V cache writes as three kernels",
    "GRAPHIR_NO_BF16_TWINS": "gpu Programs write each prefill GEMM's x in f32 and cast it, not as bf16 by its producer",
    "GRAPHIR_REQUIRE_KERNEL_COMPILERS": "kernel-compile tests fail without NVRTC or hipcc",
    "GRAPHIR_NO_PRECOMPILE": "cpu backend: this process compiles every kernel itself, with no helper process",
    "GRAPHIR_NO_GRAPH_CACHE": "run pass pipelines every time; never read or write passed graphs on disk",
    "GRAPHIR_NO_WEIGHT_CACHE": "cpu backend: derive stacked and repacked weights in memory, never on disk",
    "GRAPHIR_NO_HEADER_CACHE": "parse GGUF headers every time; never read or write parsed headers on disk",
    "GRAPHIR_NO_NRT_CACHE": "cpu backend: compile numba's runtime library in every process; never keep it on disk",
    "GRAPHIR_DEBUG_THREADS": "cpu backend: print each auto-threads window (busy, steal, own CPU, count) to stderr",
}


def enabled(name: str) -> bool:
    """Whether flag `name` (one of FLAGS) is on now."""
    if name not in FLAGS:
        raise KeyError(f"unknown flag {name!r}; known: {', '.join(FLAGS)}")
    return os.environ.get(name, "0") not in ("", "0")
