"""What a first GPU run waits for while the kernels compile: every source whole and in turn, against kernels.module's
translation units side by side (every source, the two large ones in parts), each in a new process with an empty
CuPy kernel cache, then the same with the cache those runs filled.

    python benchmarks/bench_gpu_compile.py [--no-whole]

Prints the seconds per source compiled whole (NVRTC, as the backend compiled them until the parts), their sum, and
the wall time until kernels.module has every source, cold (an empty CuPy cache) and warm (the cache those runs
filled). --no-whole skips the whole-file runs.
"""

from __future__ import annotations

import argparse
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-whole", action="store_true", help="skip compiling every source whole and in turn")
    a = ap.parse_args()
    print(f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    with tempfile.TemporaryDirectory() as whole, tempfile.TemporaryDirectory() as units:
        if not a.no_whole:
            serial = run(SERIAL, whole)
            for name, s in sorted(serial.items(), key=lambda kv: -kv[1]):
                print(f"  {name:24} {s:7.2f} s whole")
            print(f"every source whole, in turn, cold: {sum(serial.values()):7.2f} s; "
                  f"warm (CuPy's disk cache): {sum(run(SERIAL, whole).values()):.2f} s")
        cold = run(PARALLEL, units)
        warm = run(PARALLEL, units)
        for what, t in (("cold", cold), ("warm", warm)):
            print(f"kernels.module, {what}: matmul.cu after {t['matmul.cu']:.2f} s, every source {t['all']:.2f} s")


if __name__ == "__main__":
    main()
