"""Kernels loaded from numba's cache without numba's compiler start-up (backends/cpu/cache_load.py).

Each probe is a fresh process on its own NUMBA_CACHE_DIR: the first compiles (numba's full start-up),
the second loads from the cache. The kernel is the parallel attention kernel, which allocates inside
(the NRT) and runs on numba's thread pool (the parallel runtime), compared with a numpy formula.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


# The probes' case (also tests/test_cpu_nrt_cache.py's): `calls` runs of the parallel attention kernel on a small
# GQA cache, `out` and its numpy formula `ref` left for the probe's report.
def attention_case(calls: int = 1) -> str:
    return f"""
rng = np.random.default_rng(5)
n, hq, hk, d, cap, kv = 3, 6, 2, 24, 11, 7
q = rng.standard_normal((n, hq, d)).astype(np.float32)
k = rng.standard_normal((cap, hk, d)).astype(np.float32)
v = rng.standard_normal((cap, hk, d)).astype(np.float32)
pos = np.array([4, 5, 6], np.int32)
out = np.full((n, hq, d), np.nan, np.float32)
for _ in range({calls}):
    K.attention(q, k, v, pos, np.array([kv], np.int32), np.float32(0.2), 0, out)
ref = np.empty_like(out)
for t in range(n):
    for h in range(hq):
        keys = slice(0, min(kv, pos[t] + 1))
        s = 0.2 * (k[keys, h // (hq // hk)] @ q[t, h])
        p = np.exp(s - s.max())
        ref[t, h] = (p / p.sum()) @ v[keys, h // (hq // hk)]
"""


_ATTENTION = r"""
import json, sys
import numpy as np
from graphir.backends.cpu import kernels as K
from numba.core import base
refreshes = []
_refresh = base.BaseContext.refresh
base.BaseContext.refresh = lambda self: (refreshes.append(1), _refresh(self))[1]  # numba's full start-up
""" + attention_case() + r"""
print(json.dumps({"close": bool(np.allclose(out, ref, rtol=1e-5, atol=1e-6)),
                  "compiled": sum(K.attention.stats.cache_misses.values()),
                  "refreshed": bool(refreshes), "registries": "numba.np.linalg" in sys.modules}))
"""

# a function of another package: numba loads it as it always did
_FOREIGN = r"""
import json, sys
import numpy as np
import numba
import graphir.backends.cpu  # noqa: F401  (installs the short path for its own kernels)
from numba.core import base
refreshes = []
_refresh = base.BaseContext.refresh
base.BaseContext.refresh = lambda self: (refreshes.append(1), _refresh(self))[1]  # numba's full start-up

@numba.njit(cache=True)
def total(x):
    return x.sum()

ok = total(np.arange(7.0)) == 21.0
print(json.dumps({"close": bool(ok), "compiled": sum(total.stats.cache_misses.values()),
                  "refreshed": bool(refreshes)}))
"""


def _run(script: str, cache_dir: str, cwd: str | None = None) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir, "GRAPHIR_NO_PRECOMPILE": "1"}
    out = subprocess.run([sys.executable, "-c", script] if cwd is None else [sys.executable, script], env=env,
                         capture_output=True, text=True, timeout=600, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cached_kernel_loads_without_numba_registries(tmp_path):
    cold = _run(_ATTENTION, str(tmp_path))
    assert cold["close"] and cold["compiled"] == 1 and cold["refreshed"]  # compiling needs numba's start-up
    warm = _run(_ATTENTION, str(tmp_path))
    assert warm == {"close": True, "compiled": 0, "refreshed": False, "registries": False}


def test_other_packages_functions_load_as_numba_loads_them(tmp_path):
    script = tmp_path / "foreign.py"
    script.write_text(_FOREIGN)
    cache = str(tmp_path / "cache")
    assert _run(str(script), cache, cwd=str(tmp_path))["compiled"] == 1
    assert _run(str(script), cache, cwd=str(tmp_path)) == {"close": True, "compiled": 0, "refreshed": True}


# the symbols each light load adds (from the object's symbol table) against numba's own load (from the bitcode)
_SYMBOLS = r"""
import json, sys
import numpy as np
from graphir.backends.cpu import elf_symbols, kernels as K
from numba.core.registry import cpu_target
if sys.argv[1] == "numba":
    elf_symbols.defined = lambda obj: None  # every load takes numba's own path
x = np.random.default_rng(3).standard_normal((4, 40)).astype(np.float32)
out = np.empty_like(x)
K.rms_norm(x, 1e-5, out)
lib = K.rms_norm.overloads[K.rms_norm.signatures[0]].library
engine = cpu_target.target_context.codegen()._engine
print(json.dumps({"out": out.tolist(), "light": "_graphir_bitcode" in lib.__dict__,
                  "symbols": sorted(engine._defined_symbols)}))
"""


def test_a_light_load_defines_the_symbols_numba_reads_from_the_bitcode(tmp_path):
    script = tmp_path / "symbols.py"
    script.write_text(_SYMBOLS)
    cache = str(tmp_path / "cache")
    _run_args(script, cache, "light")  # compiles
    light, full = _run_args(script, cache, "light"), _run_args(script, cache, "numba")
    assert light["light"] and not full["light"]
    assert light["symbols"] == full["symbols"] and len(full["symbols"]) > 10
    assert light["out"] == full["out"]


# a kernel loaded light, then linked into one compiled in the same process (its bitcode parsed then)
_LINKED = r"""
import json, sys
import numpy as np
from graphir.backends.cpu import kernels as K
row = np.ones(40, np.float32)
K._inv_rms(row, 1e-5)
lib = K._inv_rms.overloads[K._inv_rms.signatures[0]].library
light = "_graphir_bitcode" in lib.__dict__
x = np.random.default_rng(3).standard_normal((4, 40)).astype(np.float32)
out = np.empty_like(x)
if sys.argv[1] == "both":
    K.rms_norm(x, 1e-5, out)  # compiled: links _inv_rms's overload, loaded from the cache
ref = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + np.float32(1e-5))
print(json.dumps({"light": light, "close": bool(np.allclose(out, ref, rtol=1e-5)),
                  "rms_norm_compiled": sum(K.rms_norm.stats.cache_misses.values())}))
"""


def test_a_kernel_loaded_light_links_into_a_kernel_compiled_later(tmp_path):
    script = tmp_path / "linked.py"
    script.write_text(_LINKED)
    cache = str(tmp_path / "cache")
    assert not _run_args(script, cache, "inv_rms")["light"]  # compiles _inv_rms alone; rms_norm stays uncached
    assert _run_args(script, cache, "both") == {"light": True, "close": True, "rms_norm_compiled": 1}


def _run_args(script, cache_dir: str, arg: str) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir, "GRAPHIR_NO_PRECOMPILE": "1"}
    out = subprocess.run([sys.executable, str(script), arg], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
