"""Whole models on the CPU backend (with the default passes): logits equal the reference backend's
(no passes) up to float32 reassociation, greedy SmolLM2 text is identical, and tiny HF-saved
models match transformers."""

from __future__ import annotations

import os

import numpy as np
import pytest
from graphir.backends.cpu import threads

import graphir

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REL_BACKENDS = 1e-4  # cpu vs reference: same math, different summation order (tiles, fused ops)
REL_HF = 1e-3  # vs transformers: torch's kernels and its own rope/attention formulation
TINY_PRESETS = ["random:llama-tiny", "random:qwen3-tiny", "random:qwen2-tiny", "random:qwen35-tiny"]
SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One numba thread: on 2 busy shared cores, waking a second thread per kernel made SmolLM2's prefill
    ~10x slower. Results do not depend on the thread count (test_results_do_not_depend_on_thread_count)."""
    threads.set_threads(1)
    yield
    threads.set_threads(None)


def assert_close(ours: np.ndarray, ref: np.ndarray, rel: float, what: str = "") -> None:
    assert ours.shape == ref.shape, what
    err, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert err <= rel * scale, f"{what}: max |diff| {err:.3g} > {rel} * max |logit| {scale:.3g}"


def pair(spec: str, **kw) -> tuple[graphir.Model, graphir.Model]:
    """The same model on cpu (default passes) and on the reference backend (no passes)."""
    return (graphir.load(spec, backend="cpu", passes="default", **kw),
            graphir.load(spec, backend="reference", passes="", **kw))


# ---------------------------------------------------------------- random presets
@pytest.mark.parametrize("spec", TINY_PRESETS)
def test_tiny_presets_cpu_equals_reference(spec):
    cpu, ref = pair(spec, ctx=64)
    ids = list(np.random.default_rng(0).integers(0, 256, 45))
    # the last 5 tokens: one call padded to 8, or 5 decode steps where padding would advance a recurrent state
    assert cpu.chunks(len(ids)) == ([32, 8, 1, 1, 1, 1, 1] if spec.endswith("qwen35-tiny") else [32, 8, 8])
    assert_close(cpu.logits(ids), ref.logits(ids), REL_BACKENDS, spec)
    for t in (7, 200, 65):  # decode steps continue the KV cache (and recurrent states)
        assert_close(cpu.feed([t]), ref.feed([t]), REL_BACKENDS, f"{spec} decode at {cpu.n_past}")
    assert cpu.n_past == ref.n_past == 48


# ---------------------------------------------------------------- SmolLM2-135M (Q4_1 GGUF)
@pytest.fixture(scope="module")
def smol():
    try:
        return pair("smollm2-135m")
    except graphir.LoadError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_smollm2_logits_cpu_equals_reference(smol):
    cpu, ref = smol
    ids = cpu.tokenizer.encode("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert_close(cpu.logits(ids), ref.logits(ids), REL_BACKENDS, "smollm2 prefill")


@pytest.mark.slow
@pytest.mark.parametrize("prompt", SMOL_PROMPTS)
def test_smollm2_greedy_text_cpu_equals_reference(smol, prompt):
    cpu, ref = smol
    ids = cpu.tokenizer.encode(prompt)
    got = list(cpu.generate(ids, 32, stop_at_eos=False))
    want = list(ref.generate(ids, 32, stop_at_eos=False))
    assert len(got) == 32
    assert cpu.tokenizer.decode(got) == ref.tokenizer.decode(want)
    assert got == want


@pytest.mark.slow
def test_results_do_not_depend_on_thread_count(smol):
    """Every output element is computed by one thread, so the thread count never reorders a sum."""
    cpu, _ = smol
    ids = cpu.tokenizer.encode("Gravity is the force that pulls two bodies together, said")
    one = cpu.logits(ids), cpu.feed([42])  # the tiled matmul path, then the one-token GEMV path
    threads.set_threads(threads.pool_size())
    try:
        two = cpu.logits(ids), cpu.feed([42])
    finally:
        threads.set_threads(1)
    assert np.array_equal(two[0], one[0]) and np.array_equal(two[1], one[1])


# ---------------------------------------------------------------- tiny HF models vs transformers
LONG = [int(t) for t in np.random.default_rng(1).integers(0, 300, 43)]  # chunks 32 + 8 + 3 (padded, or 3 x 1)


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen3", True), ("qwen35", False)])
def test_tiny_hf_models_on_cpu_match_transformers(tmp_path, arch, tied):
    pytest.importorskip("transformers")
    from test_models_hf import IDS, hf_logits, tiny_model  # the tiny models the reference backend is tested on
    from test_qwen35 import tiny_hf

    model = tiny_hf(tied=tied) if arch == "qwen35" else tiny_model(arch, tied)
    model.save_pretrained(tmp_path)
    ours = graphir.load(str(tmp_path), backend="cpu", passes="default")
    assert ours.config.arch == arch and ours.config.tied_embeddings == tied
    for ids in (IDS, LONG):
        assert_close(ours.logits(ids), hf_logits(model, ids), REL_HF, f"{arch} {len(ids)} tokens")
