"""Every tiny model family on the gpu backend against the reference, across the weight types and pipelines a user
can pick: the cases a user meets that the per-kernel tests and the three-family whole-model test do not combine.

For each (family, weight type, pipeline) the gpu and the reference backend load the same seeded weights with the
same pipeline and the same prefill chunks (so the same ops: bf16 activations where `gemm-bf16` asks for them, f16 KV
rows under `kv-f16`) and must agree on a 45-token prefill (the gpu's chunks), on decode steps after it, on a
3-token call (a verify-sized product), and on a prefill of a single token into a fresh cache. Each comparison is the
largest difference over the largest logit, so a wrong row, head, block or position fails it by orders of magnitude.
Families: llama, qwen3 (q/k norms, neox rope), qwen35 (Gated DeltaNet layers), gemma3 (sliding windows, GeGLU,
embedding scale).
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu_helpers import assert_rel_close, gpu_only, host

import graphir

FAMILIES = ["random:llama-tiny", "random:qwen3-tiny", "random:qwen35-tiny", "random:gemma3-tiny"]
# dtype -> bound on |gpu - reference| / max |reference logit|: both backends compute in f32 from the same
# weights; q8_0 and q4_0 products on the gpu keep f32 x (gemv_tc splits x into two f16 halves, ~2^-22).
DTYPES = {None: 1e-3, "f16": 1e-3, "bf16": 1e-3, "q8_0": 1e-3, "q4_0": 1e-3}
# "auto" is the gpu's own pipeline (bf16 prefill products and attention), which rounds activations to bf16:
# the reference runs the same ops, so only summation order separates them, but a bf16 rounding that falls the
# other way moves a value by 2^-8 of itself, hence the wider bound.
PIPELINES = {"default": 1.0, "auto": 10.0, "default,kv-f16": 1.0}


def _calls(model) -> list[np.ndarray]:
    ids = [int(t) for t in np.random.default_rng(3).integers(1, 256, 45)]
    out = [model.logits(ids)]
    out += [model.feed([t]) for t in (7, 200, 65, 11)]
    out.append(model.feed([3, 4, 5]))
    model.reset()
    out.append(model.feed([9]))
    return [host(o) for o in out]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("passes", list(PIPELINES))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=[str(d) for d in DTYPES])
@pytest.mark.parametrize("spec", FAMILIES)
def test_family_dtype_pipeline_gpu_equals_reference(spec, dtype, passes):
    gpu_passes = passes
    ref_passes = "gpu" if passes == "auto" else passes  # the reference's own "auto" is "default"
    rel = DTYPES[dtype] * PIPELINES[passes]
    gpu = graphir.load(spec, backend="gpu", passes=gpu_passes, dtype=dtype, ctx=64)
    ref = graphir.load(spec, backend="reference", passes=ref_passes, dtype=dtype, ctx=64)
    # the gpu cuts a prompt into its own buckets (45 tokens: one padded call where the reference runs 32 + 8 + 5),
    # and gemm-bf16 rounds a product by its rows: the same chunks on both, or the two round different products
    ref.prefill_buckets, ref.call_cost = gpu.prefill_buckets, gpu.call_cost
    got, want = _calls(gpu), _calls(ref)
    what = ["prefill 45", "decode 1", "decode 2", "decode 3", "decode 4", "3-token call", "fresh 1-token prefill"]
    for w, a, b in zip(what, got, want):
        assert_rel_close(a, b, rel, f"{spec} dtype={dtype} passes={passes}: {w}")
