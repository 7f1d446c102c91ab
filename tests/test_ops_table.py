"""The op table is complete: every op has a doc, a reference, a sane params schema and a formula test.

Fused ops may be registered by graphir/ops/fused.py (imported by graphir.ops),
so the passes package is imported first and those ops are held to the same rules.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

import graphir.ops
from graphir.builder import check_params
from graphir.errors import GraphError
from graphir.ir import LEAF_OPS

IMPORT_ERRORS: dict[str, str] = {}
for _mod in ("graphir.ops.fused", "graphir.ops.collective", "graphir.passes"):
    try:
        importlib.import_module(_mod)
    except Exception as e:  # noqa: BLE001 - recorded here so the op checks below still run, then failed
        IMPORT_ERRORS[_mod] = repr(e)

import test_collective_ops  # noqa: E402  (its @covers tests of the collective ops join OP_TESTS)
import test_ops  # noqa: E402
from test_ops import OP_TESTS  # noqa: E402  (after the imports that may register fused ops)

OPS = graphir.ops.OPS
NON_LEAF = sorted(n for n in OPS if n not in LEAF_OPS)


def test_fused_op_modules_import():
    # fused ops registered by a module that failed to import would escape the checks below
    assert not IMPORT_ERRORS, f"could not import {IMPORT_ERRORS}; fused ops registered there were not checked"


def test_leaves_are_in_the_table():
    assert set(LEAF_OPS) <= set(OPS)


def test_every_op_has_a_formula_test():
    missing = [n for n in NON_LEAF if n not in OP_TESTS]
    assert not missing, f"ops without a numpy-formula test in tests/test_ops.py (@covers): {missing}"


def test_registry_names_real_tests_of_real_ops():
    unknown = sorted(set(OP_TESTS) - set(OPS))
    assert not unknown, f"@covers names ops that are not in the table: {unknown}"
    for op, names in OP_TESTS.items():
        for name in names:
            fn = getattr(test_ops, name, None) or getattr(test_collective_ops, name, None)
            assert name.startswith("test_") and callable(fn), f"{op}: {name} is not a collected test"


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_definition_is_sane(name):
    d = OPS[name]
    assert d.name == name
    assert isinstance(d.doc, str) and d.doc.strip(), f"{name}: no doc string"
    lo, hi = d.arity
    assert 0 <= lo <= hi, f"{name}: arity {d.arity}"
    assert callable(d.infer), f"{name}: no shape rule"
    if name in LEAF_OPS:
        assert (lo, hi) == (0, 0)
        return
    assert callable(d.ref), f"{name}: no numpy reference"
    assert lo >= 1, f"{name}: a non-leaf op needs a source"
    if d.writes:
        assert not d.view and not d.multi, f"{name}: a write is neither a view nor multi-output"
    sig = inspect.signature(d.ref).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in sig):  # a **kwargs reference takes any params
        ref_names = {p.name for p in sig if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        extra = sorted(set(d.params) - ref_names)
        assert not extra, f"{name}: params {extra} are not taken by the reference"


@pytest.mark.parametrize("name", sorted(OPS))
def test_params_schema_defaults_are_valid(name):
    d = OPS[name]
    filled = {}
    for key, (typ, default) in d.params.items():
        types = typ if isinstance(typ, tuple) else (typ,)
        assert all(isinstance(t, type) for t in types), f"{name}.{key}: type {typ!r}"
        assert isinstance(key, str) and key.isidentifier(), f"{name}: param key {key!r}"
        if default is graphir.ops.REQUIRED:
            filled[key] = {int: 1, float: 1.0, str: "x", tuple: (1,), bool: True}[types[0]]
        else:
            assert isinstance(default, typ) and not (isinstance(default, bool) and bool not in types), \
                f"{name}.{key}: default {default!r} is not a {typ}"
    for key, allowed in d.choices.items():
        assert key in d.params, f"{name}: choices for unknown param {key!r}"
        default = d.params[key][1]
        assert default is graphir.ops.REQUIRED or default in allowed, f"{name}.{key}: default not among choices"
    # the builder's schema check accepts the defaults plus one value for each required key
    params = check_params(d, filled, name)
    assert set(params.as_dict()) == set(d.params)
    if any(v is graphir.ops.REQUIRED for _, v in d.params.values()):
        with pytest.raises(GraphError, match="missing required param"):
            check_params(d, {}, name)
