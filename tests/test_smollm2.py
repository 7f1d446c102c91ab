"""SmolLM2-135M Q4_1 GGUF: graphir's reference backend against transformers on the same file.

transformers dequantizes the GGUF to f32 (and un-permutes Q/K for its NEOX rope); graphir keeps
Q4_1/Q8_0 storage, dequantizes exactly the same values, and uses NORM rope on the permuted
rows. Both compute in f32, so greedy tokens must agree exactly.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from graphir.models.default_model import smollm2_path  # noqa: E402

import graphir  # noqa: E402

pytestmark = pytest.mark.slow
N_NEW = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def ours():
    try:
        return graphir.load("smollm2-135m", backend="reference", passes="")
    except graphir.LoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def hf():
    path = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens through transformers' KV cache, without stopping at EOS."""
    out = []
    with torch.no_grad():
        step = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            out.append(int(step.logits[0, -1].argmax()))
            step = model(torch.tensor([[out[-1]]]), past_key_values=step.past_key_values, use_cache=True)
    return out


def test_config_and_storage(ours):
    c = ours.config
    assert (c.arch, c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim) == \
           ("llama", 30, 576, 1536, 9, 3, 64)
    assert (c.n_vocab, c.rope_theta, c.rope_mode, c.tied_embeddings) == (49152, 1e5, "norm", True)
    assert ours.weights["token_embd.weight"].dtype == "q8_0"
    assert ours.weights["blk.0.attn_q.weight"].dtype == "q4_1"
    assert "output.weight" not in set(ours.weights)


def test_prompt_logits_match(ours, hf):
    ids = ours.tokenizer.encode(PROMPTS[0])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = ours.logits(ids)
    assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_transformers(ours, hf, prompt):
    ids = ours.tokenizer.encode(prompt)
    got = list(ours.generate(ids, N_NEW, stop_at_eos=False))
    assert got == hf_greedy(hf, ids, N_NEW), ours.tokenizer.decode(got)
    if prompt == PROMPTS[0]:
        assert ours.tokenizer.decode(got).startswith(" Paris.")
