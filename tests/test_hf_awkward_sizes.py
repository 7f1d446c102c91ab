"""Tiny HF models of every family with awkward sizes, on every backend, against transformers.

The other HF comparisons (test_models_hf.py, test_qwen35.py, test_gemma3.py) use powers of two (hidden 64, head dim
16) and run on the reference and cpu backends only; the GPU suite (`-m gpu`) never ran them. Here hidden sizes, head
dims, feed-forward widths and vocabularies are odd (72, 24, 200, 1031 ...), a key/value head serves 3-5 query heads,
and the 29-token prompt is no bucket's size, so row tails, head strides and bucket padding all show. Each backend
runs the `default` pipeline (f32 activations) on the saved f32 weights: a 29-token prefill, then 8 decode steps,
compared with transformers' logits of the whole 37 tokens at the same positions.

The bound is REL of the largest |logit|, against transformers run in f64, so that what is measured is graphir's own
f32 rounding (measured 2026-12-04, reference / cpu: llama 7.2e-7 / 9.1e-7, qwen3 9.0e-7 / 5.4e-7, qwen2 5.8e-7 /
3.9e-7, gemma3 7.8e-7 / 5.1e-7, qwen35 3.4e-5 / 2.5e-5, where the delta rule carries rounding along the sequence:
transformers' own f32 run is 9.7e-5 from its f64 one there; gpu in BENCHMARKS.md). 1e-4 still sees a dropped rms eps
(2e-4 to 6e-4 of that scale, test_models_hf.py); a sliding window one key too wide fails gemma3 by 0.11 (tried).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _gpu_helpers import gpu_only, host
from _model_helpers import redraw_hf_weights

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import graphir  # noqa: E402

REL = 1e-4
VOCAB = 1031
PROMPT, STEPS = 29, 8


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=72, intermediate_size=200, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=5000.0,
        tie_word_embeddings=False))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=80, intermediate_size=136, num_hidden_layers=2, num_attention_heads=5,
        num_key_value_heads=1, head_dim=40, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True))


def _qwen2():  # q/k/v biases; q_dim 120 != hidden 72
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=72, intermediate_size=200, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=40, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True))


def _gemma3():
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=72, intermediate_size=152, num_hidden_layers=7, num_attention_heads=3,
        num_key_value_heads=1, head_dim=40, sliding_window=5, max_position_embeddings=256, query_pre_attn_scalar=40,
        rms_norm_eps=1e-6, tie_word_embeddings=True))


def _qwen35():
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=72, intermediate_size=200, num_hidden_layers=4, num_attention_heads=3,
        num_key_value_heads=1, head_dim=24, linear_conv_kernel_dim=4, linear_key_head_dim=12,
        linear_value_head_dim=20, linear_num_key_heads=1, linear_num_value_heads=3, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False))


FAMILIES = {"llama": _llama, "qwen3": _qwen3, "qwen2": _qwen2, "gemma3": _gemma3, "qwen35": _qwen35}
BACKENDS = ["reference", "cpu", pytest.param("gpu", marks=[pytest.mark.gpu, gpu_only])]


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, directory, token ids, transformers' logits for all of them)."""
    model = FAMILIES[request.param]()
    torch.manual_seed(0)
    redraw_hf_weights(model)
    model.config._attn_implementation = "eager"
    model.eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    ids = [int(t) for t in np.random.default_rng(5).integers(1, VOCAB, PROMPT + STEPS)]
    with torch.no_grad():  # in f64, so that only graphir's f32 rounding is measured (HF's own f32 chunked delta
        logits = model.double()(torch.tensor([ids])).logits[0].numpy()  # rule is 1.2e-4 off on the qwen35 case)
    return request.param, path, ids, logits


@pytest.mark.parametrize("backend", BACKENDS)
def test_awkward_sizes_match_transformers(saved, backend):
    family, path, ids, want = saved
    model = graphir.load(str(path), backend=backend, passes="default")
    assert model.config.n_vocab == VOCAB
    rows = [host(model.logits(ids[:PROMPT]))]
    rows += [host(model.feed([t])).reshape(1, -1) for t in ids[PROMPT:]]
    got = np.concatenate(rows)
    assert got.shape == want.shape
    scale = float(np.abs(want).max())
    for i in range(len(ids)):
        err = float(np.abs(got[i] - want[i]).max()) / scale
        what = "prefill" if i < PROMPT else "decode step"
        assert err <= REL, f"{family} on {backend}: {what} at position {i}: max |diff| {err:.3g} of max |logit|"


def test_quantizing_rows_that_are_not_whole_blocks_says_so(saved, capsys):
    """A quantized dtype keeps a matrix whose rows are not whole blocks (72 columns for q8_0's 32) in f32, and says
    so once on stderr instead of reporting a q8_0 model that is mostly f32; whole-block matrices are quantized."""
    family, path, ids, want = saved
    model = graphir.load(str(path), backend="reference", dtype="q8_0")
    kept = {n for n, w in model.weights.items() if len(w.shape) == 2 and w.shape[-1] % 32}
    err = capsys.readouterr().err
    assert kept and all(model.weights[n].dtype == "f32" for n in kept)
    assert "matrices stay f32, not q8_0: their rows are not whole 32-value blocks" in err, err
    assert err.count("matrices stay f32") == 1
    whole = [n for n, w in model.weights.items() if len(w.shape) == 2 and w.shape[-1] % 32 == 0]
    assert all(model.weights[n].dtype == "q8_0" for n in whole)


def test_a_type_no_matrix_can_take_says_so(capsys):
    """random:llama-tiny's rows of 64 and 96 values hold no 256-value q4_k block: every matrix stays f32, said once;
    Qwen3.5's [C, 4] conv kernel left f32 beside converted projections says nothing."""
    model = graphir.load("random:llama-tiny", backend="reference", dtype="q4_k")
    assert {w.dtype for w in model.weights.values()} == {"f32"}
    assert capsys.readouterr().err.count("matrices stay f32, not q4_k") == 1
    graphir.load("random:qwen35-tiny", backend="reference", dtype="q8_0")
    assert "stay f32" not in capsys.readouterr().err
