"""Cold compile time of one decode attention kernel (SmolLM2's decode_attention_d64_g3 by default), each run a fresh
process on empty numba and graphir caches, and where numba's compile of it goes.

    python benchmarks/compile_decode_attention.py                 # 3 runs, contiguous q (a decode step's)
    python benchmarks/compile_decode_attention.py --layout A -n 5  # strided q (the prefill call's view of fused QKV)
    python benchmarks/compile_decode_attention.py --passes         # one run, time by numba pass, LLVM, and helper

A first run of the README's command compiles this kernel twice (layout A before the first token, C for decode).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import collections, sys, time
import numba
import numpy as np
from numba.core import compiler_machinery as cm, event as ev
from graphir.backends.cpu import attention as ATT

layout, d, hq, hk, passes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
excl, llvm, stack = collections.Counter(), [0.0], []
if passes:  # exclusive time per (function, pass); LLVM time from numba's llvm_lock events
    class LLVM(ev.Listener):
        def on_start(self, e): self.t = time.perf_counter()
        def on_end(self, e): llvm[0] += time.perf_counter() - self.t
    ev.register("numba:llvm_lock", LLVM())
    run_pass = cm.PassManager._runPass
    def timed(self, index, pss, state):
        stack.append([state.func_id.func_name if state.func_id else "?", pss.name(), time.perf_counter(), 0.0])
        try:
            return run_pass(self, index, pss, state)
        finally:
            fn, name, t0, child = stack.pop()
            dt = time.perf_counter() - t0
            excl[(fn, name)] += dt - child
            if stack:
                stack[-1][3] += dt
    cm.PassManager._runPass = timed
n = 8
qkv = np.zeros((n, (hq + 2 * hk) * d), np.float32)
q = qkv[:, :hq * d].reshape(n, hq, d) if layout == "A" else np.zeros((n, hq, d), np.float32)
k = np.zeros((512, hk, d), np.float32)
kernel, args = ATT.bind_decode(q, k, k, np.arange(n, dtype=np.int32), np.array([n], np.int32), np.float32(0.125), 0,
                               np.zeros((n, hq, d), np.float32))
sig = tuple(numba.typeof(a) for a in args)
t0 = time.perf_counter()
kernel.compile(sig)
print(f"{kernel.py_func.__name__} (q layout {layout}): compile {time.perf_counter() - t0:.2f} s")
if passes:
    by_fn = collections.Counter()
    for (fn, _), t in excl.items():
        by_fn["the kernel's parfor body" if fn.startswith("__numba_parfor_gufunc") else fn] += t
    print(f"  numba passes {sum(excl.values()):.2f} s, of which LLVM {llvm[0]:.2f} s; by function:")
    for fn, t in by_fn.most_common(10):
        print(f"    {t:5.2f} s  {fn}")
    print("  slowest passes (function, pass):")
    for (fn, name), t in excl.most_common(6):
        print(f"    {t:5.2f} s  {fn[:32]} {name}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=3, help="runs (each a fresh process on empty caches)")
    ap.add_argument("--layout", choices=("C", "A"), default="C", help="q contiguous (C) or a strided view (A)")
    ap.add_argument("--shape", default="64,9,3", help="head dim, q heads, KV heads (default SmolLM2's)")
    ap.add_argument("--passes", action="store_true", help="one run, with time by numba pass and function")
    a = ap.parse_args()
    d, hq, hk = (int(x) for x in a.shape.split(","))
    for _ in range(1 if a.passes else a.n):
        with tempfile.TemporaryDirectory() as numba_dir, tempfile.TemporaryDirectory() as graphir_dir:
            env = {**os.environ, "NUMBA_CACHE_DIR": numba_dir, "GRAPHIR_CACHE_DIR": graphir_dir}
            r = subprocess.run([sys.executable, "-c", _CHILD, a.layout, str(d), str(hq), str(hk),
                                "1" if a.passes else "0"], env=env, capture_output=True, text=True)
            print(r.stdout, end="" if r.returncode == 0 else r.stderr[-2000:])


if __name__ == "__main__":
    main()
