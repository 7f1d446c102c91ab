"""The family interface: every registered family is complete and found by its file kinds and presets,
and no module outside models/<family>.py (and the registry) names a family: no import of a family
module, no comparison with an architecture string, no use of a family's config class."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
from graphir.models import registry
from graphir.models.family import Family

import graphir
from graphir.errors import LoadError

ROOT = Path(__file__).resolve().parent.parent
FAMILY_MODULES = {f.config_type.__module__.rsplit(".", 1)[-1] for f in registry.FAMILIES}
ALLOWED = {ROOT / "models" / f"{m}.py" for m in FAMILY_MODULES} | {ROOT / "models" / "registry.py"}
ARCH_STRINGS = {s for f in registry.FAMILIES
                for s in (f.name, *f.gguf_archs, *f.hf_architectures, *f.hf_model_types,
                          *(config.arch for config, _ in f.presets.values()))}
CONFIG_CLASSES = {f.config_type.__name__ for f in registry.FAMILIES}


def family_violations(path: Path) -> list[str]:
    """Lines of `path` that name a family: imports, architecture-string tests, config classes."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            names = {a.name for a in node.names}
            if set(parts) & FAMILY_MODULES or (parts[-1:] in (["models"], [""]) and names & FAMILY_MODULES):
                flag(node, f"imports a family module ({node.module}: {sorted(names)})")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if set(a.name.split(".")) & FAMILY_MODULES:
                    flag(node, f"imports a family module ({a.name})")
        elif isinstance(node, ast.Compare):
            consts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            if set(consts) & ARCH_STRINGS:
                flag(node, f"compares with an architecture string {sorted(set(consts) & ARCH_STRINGS)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("startswith", "endswith"):
            consts = {c.value for c in node.args if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if any(a.startswith(c) or a.endswith(c) for a in ARCH_STRINGS for c in consts if len(c) > 2):
                flag(node, f"tests a string against an architecture prefix {sorted(consts)}")
        elif isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in CONFIG_CLASSES:
                flag(node, f"uses a family's config class {name}")
    return found


def test_nothing_outside_a_family_names_a_family():
    files = [p for d in ("graphir", "backends", "models") for p in sorted((ROOT / d).rglob("*.py"))]
    bad = [v for p in files if p not in ALLOWED for v in family_violations(p)]
    assert len(files) > 40 and not bad, "\n".join(bad)


def test_the_check_catches_each_kind_of_violation(tmp_path, monkeypatch):
    """Planted violations, one of each kind, are all reported."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    src = tmp_path / "planted.py"
    src.write_text("from graphir.models import qwen35\nimport graphir.models.gemma3\nfrom .llama import build\n"
                   "if c.arch == 'qwen3':\n    pass\nif md['a'].startswith('gemma'):\n    pass\n"
                   "x = isinstance(c, Gemma3Config)\n")
    kinds = [v.split(": ", 1)[1].split(" ")[0:2] for v in family_violations(src)]
    assert len(kinds) == 6, kinds


@pytest.mark.parametrize("family", registry.FAMILIES, ids=lambda f: f.name)
def test_every_family_is_complete_and_its_presets_run(family: Family):
    assert family.gguf_archs and family.hf_architectures and family.presets
    for config, _ in family.presets.values():
        assert registry.family_of(config) is family
        assert registry.for_gguf({"general.architecture": family.gguf_archs[0]}, "x") is family
        assert registry.for_hf({"architectures": [family.hf_architectures[0]]}, "x") is family
        shapes = family.param_shapes(config)
        for ours in shapes:  # every Param has an HF name that maps back to it
            assert family.hf_names.to_ours(family.hf_names.to_file(ours)) == ours, ours
    tiny = next(n for n in family.presets if n.endswith("-tiny"))
    m = graphir.load(f"random:{tiny}", backend="reference", passes="")
    logits = m.logits([5, 1, 7, 2, 9, 11, 3])
    assert logits.shape == (7, m.config.n_vocab) and np.isfinite(logits).all() and logits.std() > 0.1


def test_unknown_architectures_name_the_supported_ones():
    with pytest.raises(LoadError, match=r"f\.gguf: architecture 'mamba' is not supported \(supported: .*gemma3"):
        registry.for_gguf({"general.architecture": "mamba"}, "f.gguf")
    with pytest.raises(LoadError, match=r"config\.json: architectures \['BertModel'\] not supported .*Gemma3For"):
        registry.for_hf({"architectures": ["BertModel"]}, "config.json")


@pytest.mark.parametrize("hf, rule", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
      "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "rope scaling 'yarn' is not supported"),  # a card's YaRN block added beside a transformers 5 save's parameters
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling 'linear' is not supported"),
    ({"rope_scaling": "yarn"}, "rope_scaling must be an object, got str 'yarn'"),
])
def test_hf_rope_scaling_is_refused_under_either_key(hf, rule):
    from graphir.models.family import hf_default_rope

    with pytest.raises(LoadError, match=re.escape(f"cfg.json: {rule}")):
        hf_default_rope(hf, "cfg.json")


def test_hf_default_rope_parameters_are_read():
    from graphir.models.family import hf_default_rope

    assert hf_default_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": None},
                           "cfg.json")["rope_theta"] == 5e5
    assert hf_default_rope({}, "cfg.json") == {}
