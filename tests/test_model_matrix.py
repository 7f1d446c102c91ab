"""Every tiny model family on the gpu and cpu backends against the reference, across the weight types and pipelines
a user can pick: the cases a user meets that the per-kernel tests and the whole-model tests do not combine.

For each (backend, family, weight type, pipeline) the backend and the reference load the same seeded weights with
the same pipeline and the same prefill chunks (so the same ops: bf16 activations where the gpu's `gemm-bf16` asks for
them, 16-bit activation codes under the cpu's `q16-activations`, f16 KV rows under `kv-f16`) and must agree on a
45-token prefill (the backend's chunks), on decode steps after it, on a 3-token call (a verify-sized product), and on
a prefill of a single token into a fresh cache. Each comparison is the largest difference over the largest logit, so
a wrong row, head, block or position fails it by orders of magnitude.
Families: llama, qwen3 (q/k norms, neox rope), qwen2 (q/k/v biases, stacked with their weights), qwen35 (Gated
DeltaNet layers), gemma3 (sliding windows, GeGLU, embedding scale).
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu_helpers import assert_rel_close, gpu_only, host
from _model_helpers import redraw_hf_weights

import graphir

FAMILIES = ["random:llama-tiny", "random:qwen3-tiny", "random:qwen2-tiny", "random:qwen35-tiny", "random:gemma3-tiny"]
DTYPES = [None, "f16", "bf16", "q8_0", "q4_0"]
# |backend - reference| / max |reference logit|, for every weight type: both compute in f32 from the same weights (the
# gpu's q4_0 products keep f32 x too: gemv_tc splits x into two f16 halves, ~2^-22)
REL = 1e-3
# "auto" is the backend's own pipeline: on the gpu bf16 prefill products and attention, on the cpu 16-bit activation
# codes for quantized products. The reference runs the same ops, so only summation order separates them, but a
# rounding that falls the other way moves a value by 2^-8 (bf16) or a code step of itself, hence the wider bound.
PIPELINES = {"default": 1.0, "auto": 10.0, "default,kv-f16": 1.0}
BACKENDS = [pytest.param("gpu", marks=[pytest.mark.gpu, gpu_only]), "cpu"]


def _calls(model) -> list[np.ndarray]:
    ids = [int(t) for t in np.random.default_rng(3).integers(1, 256, 45)]
    out = [model.logits(ids)]
    out += [model.feed([t]) for t in (7, 200, 65, 11)]
    out.append(model.feed([3, 4, 5]))
    model.reset()
    out.append(model.feed([9]))
    return [host(o) for o in out]


@pytest.mark.parametrize("passes", list(PIPELINES))
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d) for d in DTYPES])
@pytest.mark.parametrize("spec", FAMILIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_family_dtype_pipeline_equals_reference(backend, spec, dtype, passes):
    model = graphir.load(spec, backend=backend, passes=passes, dtype=dtype, ctx=64)
    ref = graphir.load(spec, backend="reference", passes=model.passes, dtype=dtype, ctx=64)  # "auto" resolved
    # the gpu cuts a prompt into its own buckets (45 tokens: one padded call where the reference runs 32 + 8 + 5),
    # and gemm-bf16 rounds a product by its rows: the same chunks on both, or the two round different products
    ref.prefill_buckets, ref.call_cost = model.prefill_buckets, model.call_cost
    rel = REL * PIPELINES[passes]
    got, want = _calls(model), _calls(ref)
    what = ["prefill 45", "decode 1", "decode 2", "decode 3", "decode 4", "3-token call", "fresh 1-token prefill"]
    for w, a, b in zip(what, got, want):
        assert_rel_close(a, b, rel, f"{backend} {spec} dtype={dtype} passes={passes}: {w}")


# ---------------------------------------------------------------- every weight type, rows wide enough for K-quants
# The presets' rows (64 and 96 inputs) hold no 256-value super-block, so above q4_k, q5_k, q6_k and iq4_xs would stay
# f32 (models/loader.py convert_weights); and q4_1, q5_0, q5_1 are not in DTYPES. Tiny HF models with 256-wide rows
# take every type, and Qwen3.5's (DeltaNet projections, 256 x 256 heads) too.
WIDE = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1,
            head_dim=128, max_position_embeddings=128, rms_norm_eps=1e-6)
K_QUANTS = ["q4_k", "q5_k", "q6_k", "iq4_xs"]
ALL_QUANTIZED = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", *K_QUANTS]


def _wide_hf(family: str, path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**WIDE, num_hidden_layers=2))
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
            **WIDE, num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=1, linear_num_value_heads=2))
    redraw_hf_weights(model)
    model.save_pretrained(path)


@pytest.fixture(scope="module", params=["llama", "qwen35"])
def wide(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"wide-{request.param}")
    _wide_hf(request.param, path)
    return str(path)


def _wide_model(path: str, dtype: str, backend: str):
    """The model at `path` with every matrix as `dtype`: converted by graphir's quantizer where it has one (as
    `graphir.load(dtype=)` does), else (the K-quants and iq4_xs, which only GGUF files bring) random valid blocks."""
    if dtype not in K_QUANTS:
        return graphir.load(path, backend=backend, passes="default", dtype=dtype, ctx=64)
    from graphir.api import Model
    from graphir.quant import random_quantized
    from graphir.weights import Weight, Weights

    f32 = graphir.load(path, backend="reference", ctx=64)
    rng = np.random.default_rng(7)
    weights = Weights(source=f"{path} as random {dtype}")
    for name, w in f32.weights.items():
        quantize = len(w.shape) == 2 and w.shape[-1] % 256 == 0
        weights.add(name, Weight(dtype, w.shape, random_quantized(rng, dtype, w.shape)) if quantize else w)
    return Model(f32.config, weights, f32.tokenizer, backend=backend, passes="default", eos_ids=f32.eos_ids,
                 source=weights.source)


@pytest.mark.parametrize("dtype", ALL_QUANTIZED)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_weight_type_equals_reference(backend, wide, dtype):
    model = _wide_model(wide, dtype, backend)
    matrices = [w for n, w in model.weights.items() if len(w.shape) == 2 and "ssm_conv" not in n]
    assert matrices and all(w.dtype == dtype for w in matrices), {w.dtype for w in matrices}
    ref = _wide_model(wide, dtype, "reference")
    ref.prefill_buckets, ref.call_cost = model.prefill_buckets, model.call_cost
    what = ["prefill 45", "decode 1", "decode 2", "decode 3", "decode 4", "3-token call", "fresh 1-token prefill"]
    for w, a, b in zip(what, _calls(model), _calls(ref)):
        assert_rel_close(a, b, REL, f"{backend} {wide} dtype={dtype}: {w}")
