"""numba's NRT library kept on disk (backends/cpu/nrt_cache.py): a later process reads it instead of compiling
it, a damaged or mismatched entry is compiled as numba does, and GRAPHIR_NO_NRT_CACHE=1 keeps nothing.

Each probe is a fresh process on its own NUMBA_CACHE_DIR and GRAPHIR_CACHE_DIR; its kernel is the parallel
attention kernel, which allocates inside (the NRT's functions), compared with a numpy formula.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_cpu_cache_load import attention_case

# the attention case run three times: each call allocates and frees through the NRT's functions
_PROBE = r"""
import json
import numpy as np
from graphir.backends.cpu import kernels as K, nrt_cache
seen = {"read": None, "written": 0}
_read, _write = nrt_cache.read, nrt_cache.write
def read(path):
    state = _read(path)
    seen["read"] = state is not None
    return state
def write(path, state):
    seen["written"] += 1
    _write(path, state)
nrt_cache.read, nrt_cache.write = read, write
""" + attention_case(calls=3) + r"""
print(json.dumps({**seen, "close": bool(np.allclose(out, ref, rtol=1e-5, atol=1e-6))}))
"""


def _run(tmp_path, **env: str) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "GRAPHIR_CACHE_DIR": str(tmp_path / "graphir"),
           "GRAPHIR_NO_PRECOMPILE": "1", **env}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _entries(tmp_path) -> list:
    return sorted((tmp_path / "graphir" / "nrt").glob("*.bin"))


def test_a_later_process_reads_the_kept_library(tmp_path):
    assert _run(tmp_path) == {"read": False, "written": 1, "close": True}  # compiles the kernel (and the NRT)
    warm = _run(tmp_path)  # loads the kernel from numba's cache: the NRT for its config, compiled once more or read
    assert warm["close"] and warm["read"] is not None
    assert _run(tmp_path) == {"read": True, "written": 0, "close": True}


def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path):
    _run(tmp_path)
    _run(tmp_path)
    for entry in _entries(tmp_path):
        data = bytearray(entry.read_bytes())
        data[-100] ^= 0xFF  # inside the object code or the bitcode
        entry.write_bytes(bytes(data))
    assert _run(tmp_path) == {"read": False, "written": 1, "close": True}
    assert _run(tmp_path) == {"read": True, "written": 0, "close": True}


def test_a_different_config_misses(tmp_path):
    _run(tmp_path)
    _run(tmp_path)
    n = len(_entries(tmp_path))
    assert _run(tmp_path, NUMBA_OPT="1")["read"] is False  # another optimization level: compiled, kept apart
    assert len(_entries(tmp_path)) == n + 1


def test_the_flag_keeps_nothing(tmp_path):
    assert _run(tmp_path, GRAPHIR_NO_NRT_CACHE="1") == {"read": None, "written": 0, "close": True}
    assert _run(tmp_path, GRAPHIR_NO_NRT_CACHE="1") == {"read": None, "written": 0, "close": True}
    assert not _entries(tmp_path)
