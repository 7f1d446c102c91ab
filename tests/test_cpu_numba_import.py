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


def test_a_numba_config_file_is_read_as_before(tmp_path):
    (tmp_path / ".numba_config.yaml").write_text("debug_cache: 1\n")
    out = probe(tmp_path)
    assert "yaml imported: True" in out and "DEBUG_CACHE: 1" in out
