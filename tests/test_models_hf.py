"""Tiny random HF Llama and Qwen3 models, saved with save_pretrained: graphir logits equal transformers'."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _model_helpers import permute_for_norm_rope, write_gguf  # noqa: E402
from graphir.models.loader import hf_to_ours  # noqa: E402

import graphir  # noqa: E402

IDS = [3, 17, 250, 99, 0, 299, 42, 42, 7, 128, 64]
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5)


def tiny_model(arch: str, tied: bool, seed: int = 0):
    """A tiny HF model with all weights redrawn at unit-ish scale (HF's 0.02 init and unit norms would
    hide mistakes), in float32, eager attention."""
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**TINY, rope_theta=5000.0, tie_word_embeddings=tied)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**TINY, rope_theta=1e6, tie_word_embeddings=tied)
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    model.config._attn_implementation = "eager"
    return model.eval()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def assert_close(ours: np.ndarray, ref: np.ndarray, rel: float = 1e-3) -> None:
    assert ours.shape == ref.shape
    err, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert err <= rel * scale, f"max |diff| {err:.3g} > {rel} * max |logit| {scale:.3g}"


@pytest.mark.parametrize("arch, tied", [("llama", False), ("llama", True), ("qwen3", True), ("qwen3", False)])
def test_f32_logits_match_transformers(tmp_path, arch, tied):
    model = tiny_model(arch, tied)
    model.save_pretrained(tmp_path)
    ours = graphir.load(str(tmp_path))
    assert ours.config.arch == arch and ours.config.tied_embeddings == tied
    assert ours.config.rope_mode == "neox"
    assert {w.dtype for w in ours.weights.values()} == {"f32"}
    assert_close(ours.logits(IDS), hf_logits(model, IDS))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype, file_dtype", [(torch.bfloat16, "bf16"), (torch.float16, "f16")])
def test_half_precision_files_keep_their_dtype(tmp_path, arch, dtype, file_dtype):
    model = tiny_model(arch, tied=False, seed=1).to(dtype)
    model.save_pretrained(tmp_path)
    ours = graphir.load(str(tmp_path))
    assert ours.weights["blk.0.attn_q.weight"].dtype == file_dtype
    assert ours.graph("decode").params[1].dtype in ("f16", "bf16")  # Params carry the stored dtype
    ref = hf_logits(model.float(), IDS)  # the same rounded weights, computed in f32
    assert_close(ours.logits(IDS), ref)
    converted = graphir.load(str(tmp_path), dtype="f32")
    assert converted.weights["blk.0.attn_q.weight"].dtype == "f32"
    assert_close(converted.logits(IDS), ref)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_conversion_matches_transformers(tmp_path, arch):
    """The same weights written as llama.cpp's converter would (llama: Q/K rows permuted for NORM rope)."""
    model = tiny_model(arch, tied=True, seed=2)
    model.save_pretrained(tmp_path / "hf")
    c = graphir.load(str(tmp_path / "hf")).config
    tensors = {}
    for hf_name, p in model.state_dict().items():
        name = hf_to_ours(hf_name)
        if name is None or name == "output.weight":  # tied: no output.weight in GGUF
            continue
        w = p.numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = permute_for_norm_rope(w, c.n_heads if "attn_q" in name else c.n_kv_heads)
        tensors[name] = w
    path = write_gguf(tmp_path / "tiny.gguf", c, tensors)
    ours = graphir.load(str(path))
    assert ours.config.rope_mode == ("norm" if arch == "llama" else "neox")
    assert_close(ours.logits(IDS), hf_logits(model, IDS))
