"""What a first GPU run waits for while the kernels compile: every source whole and in turn, against kernels.module's
translation units side by side (every source, the two large ones in parts), each in a new process with an empty
CuPy kernel cache, then the same with the cache those runs filled.

    python benchmarks/bench_gpu_compile.py

Prints the seconds per source compiled whole (NVRTC, as the backend compiled them until the parts), their sum, and
the wall time until kernels.module has every source, cold and warm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SERIAL = """
import json, time
from graphir.backends.gpu import kernels
from graphir.backends.gpu.device import cupy
cp = cupy()
times = {}
for name in kernels.SOURCES:
    t = time.perf_counter()
    cp.RawModule(code=kernels.source(name), options=tuple(kernels.nvrtc_options(kernels.SOURCES[name]))).compile()
    times[name] = time.perf_counter() - t
print(json.dumps(times))
"""

PARALLEL = """
import json, time
from graphir.backends.gpu import kernels
t = time.perf_counter()
first = kernels.module("matmul.cu")
t_first = time.perf_counter() - t
for name in kernels.SOURCES:
    kernels.module(name)
print(json.dumps({"matmul.cu": t_first, "all": time.perf_counter() - t}))
"""


def run(code: str, cache: str) -> dict:
    env = {**os.environ, "CUPY_CACHE_DIR": cache, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    print(f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        serial = run(SERIAL, a)
        for name, s in sorted(serial.items(), key=lambda kv: -kv[1]):
            print(f"  {name:24} {s:7.2f} s whole")
        print(f"every source whole, in turn, cold: {sum(serial.values()):7.2f} s")
        cold = run(PARALLEL, b)
        print(f"kernels.module, units side by side, cold: matmul.cu after {cold['matmul.cu']:.2f} s, "
              f"every source after {cold['all']:.2f} s")
        warm_serial, warm = run(SERIAL, a), run(PARALLEL, b)
        print(f"warm (CuPy's disk cache): whole in turn {sum(warm_serial.values()):.2f} s, "
              f"kernels.module every source {warm['all']:.2f} s")


if __name__ == "__main__":
    main()
