"""numba's on-disk cache and the first-run note, checked in fresh processes.

The cache is keyed by source file, not module name, so the backend imported by path
(`backends.cpu`, the repo root on sys.path) must be the installed `graphir.backends.cpu`,
or two names share, and poison, one set of cache entries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs one kernel from every kernel module against a numpy formula and prints, as JSON, whether each
# was right, the backend's module identity and numba's cache misses for the backend's kernels.
_PROBE = r"""
import importlib, json, sys
import numpy as np
import numba
name = sys.argv[1]
sys.path.insert(0, sys.argv[2])
cpu = importlib.import_module(name)
MODS = ("kernels", "matmul", "gemv_repacked", "gemv_q8x", "gemv_q16x", "recurrent")
K, MM, GR, QX, Q16, REC = (importlib.import_module(f"{name}.{m}") for m in MODS)
from graphir.quant import quantize
rng = np.random.default_rng(7)
x = rng.standard_normal((3, 64)).astype(np.float32)
ok = {}
o = np.empty_like(x); K.rms_norm(x, np.float32(1e-6), o)
ok["kernels"] = bool(np.allclose(o, x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-6), rtol=1e-5, atol=1e-6))
w = rng.standard_normal((7, 64)).astype(np.float32)
wq = quantize(w, "q8_0")
from graphir.quant import dequantize
wd = dequantize(wq, "q8_0", w.shape)
ok["matmul"] = bool(np.allclose(MM.matmul(wq, "q8_0", x), x @ wd.T, rtol=1e-4, atol=1e-4))
x1, y1 = x[:1].copy(), np.empty((1, 7), np.float32)
GR.prepare(wq, "q8_0", x1, y1)()
ok["gemv_repacked"] = bool(np.allclose(y1, x1 @ wd.T, rtol=1e-4, atol=1e-4))
y2 = np.empty((1, 7), np.float32)
QX.prepare(wq, "q8_0", x1, y2)()
from graphir.ops import OPS
ok["gemv_q8x"] = bool(np.allclose(y2, OPS["mul_mat_q8x"].ref(wd, x1), rtol=1e-5, atol=1e-5))
w4 = quantize(w, "q4_1")
y4 = np.empty((1, 7), np.float32)
Q16.prepare(w4, "q4_1", x1, y4)()
ok["gemv_q16x"] = bool(np.allclose(y4, OPS["mul_mat_q16x"].ref(dequantize(w4, "q4_1", w.shape), x1), rtol=1e-5,
                                   atol=1e-5))
o3 = np.empty((1,) + x.shape, np.float32); REC.l2_norm(x[None], np.float32(1e-6), o3)
ok["recurrent"] = bool(np.allclose(o3[0], x / np.sqrt((x * x).sum(1, keepdims=True) + 1e-6), rtol=1e-5, atol=1e-6))
misses = []
for mod in (K, MM, GR, QX, Q16, REC):
    for attr, d in vars(mod).items():
        if isinstance(d, numba.core.dispatcher.Dispatcher) and d.stats.cache_misses:
            misses.append(f"{mod.__name__}.{attr}")
print(json.dumps({"ok": ok, "misses": misses, "installed": all(
    sys.modules[f"{name}.{m}"] is importlib.import_module(f"graphir.backends.cpu.{m}")
    for m in MODS)}))
"""


def _probe(module: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ""}
    r = subprocess.run([sys.executable, "-c", _PROBE, module, str(ROOT)], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_both_module_paths_share_one_compiled_copy():
    first = _probe("graphir.backends.cpu")  # compiles into the cache if it is cold
    assert all(first["ok"].values()), first
    second = _probe("backends.cpu")  # by path: must load the same entries, compile nothing
    assert all(second["ok"].values()), second
    assert second["installed"], "backends.cpu.* are not the installed graphir.backends.cpu.* modules"
    assert second["misses"] == [], f"recompiled under the second module path: {second['misses']}"
    again = _probe("graphir.backends.cpu")  # and the installed name still finds its entries
    assert all(again["ok"].values()) and again["misses"] == [], again


_NOTE_PROBE = r"""
import numpy as np
from graphir.backends.cpu import kernels as K
x = np.linspace(-3, 3, 7, dtype=np.float32).reshape(1, 7)
o = np.empty_like(x)
K.silu(x, o)
assert np.allclose(o, x / (1 + np.exp(-x)), rtol=1e-6)
K.rms_norm(x, np.float32(1e-6), o)  # a second kernel compiles too, without a second note
"""


def test_first_compile_prints_one_note_and_a_cached_run_none(tmp_path):
    from graphir.backends.cpu.compile_note import NOTE

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}  # an empty cache: the first run after an install
    runs = [subprocess.run([sys.executable, "-c", _NOTE_PROBE], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    assert runs[0].stderr.splitlines().count(NOTE) == 1, runs[0].stderr
    assert NOTE not in runs[1].stderr, runs[1].stderr
