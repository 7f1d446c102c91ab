"""Tiny random HF Llama and Qwen3 models, saved with save_pretrained: graphir logits equal transformers'.

The tolerance is REL of the largest |logit|. Measured 2026-11-30 (reference and cpu backends, with
and without the default passes): at most 9.2e-7 on every case below. REL = 1e-5 leaves 10x for other
CPUs' summation orders (f32 results differ in the last bits across SIMD widths), and still sees an rms
eps of 0 instead of 1e-5, which moves the logits by 2e-4..6e-4 of that scale (test_a_wrong_rms_eps_is_seen).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _model_helpers import permute_for_norm_rope, redraw_hf_weights, write_gguf  # noqa: E402
from graphir.models.llama import HF_NAMES  # noqa: E402

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
    redraw_hf_weights(model)
    model.config._attn_implementation = "eager"
    return model.eval()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


REL = 1e-5  # f32 arithmetic on both sides; see the module doc for the measured error


def rel_error(ours: np.ndarray, ref: np.ndarray) -> float:
    assert ours.shape == ref.shape
    return float(np.abs(ours - ref).max()) / float(np.abs(ref).max())


def assert_close(ours: np.ndarray, ref: np.ndarray, rel: float = REL) -> None:
    err = rel_error(ours, ref)
    assert err <= rel, f"max |diff| {err:.3g} of max |logit| > {rel}"


def hf_reloaded_f32(path) -> torch.nn.Module:
    """The saved model read back by transformers in f32. Not `model.float()`: `.to(bf16)` also rounds
    the rotary inv_freq buffer, which moves the logits by up to 1e-3 of their scale."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


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
    ref = hf_logits(hf_reloaded_f32(tmp_path), IDS)  # the same rounded weights, computed in f32
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
        name = HF_NAMES.to_ours(hf_name)
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


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_wrong_rms_eps_is_seen(tmp_path, arch):
    """The tolerance is tight enough to tell rms eps 1e-5 from 0: the same weights with the file's eps
    set to 0 fail the comparison (REL 1e-3 let them pass)."""
    model = tiny_model(arch, tied=False)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = graphir.load(str(tmp_path))
    assert ours.config.rms_eps == 0.0
    assert rel_error(ours.logits(IDS), hf_logits(model, IDS)) > 10 * REL


@pytest.mark.parametrize("window", [None, 16, 4096])
def test_mistral_is_llamas_graph_within_its_window(tmp_path, window):
    """MistralForCausalLM checkpoints load as llama. Mistral 7B v0.1's sliding window is full causal attention up to
    `window` positions, so the context stops there (16 here); null (v0.2 on) or a window past the context keeps the
    context. The logits equal transformers' with the window in force."""
    torch.manual_seed(3)
    cfg = transformers.MistralConfig(**TINY, rope_theta=1e6, sliding_window=window)
    model = transformers.MistralForCausalLM(cfg)
    redraw_hf_weights(model)
    model.config._attn_implementation = "eager"
    model.save_pretrained(tmp_path)
    ours = graphir.load(str(tmp_path))
    assert ours.config.arch == "llama" and ours.config.context_length == min(window or 128, 128)
    ids = IDS[: min(len(IDS), ours.config.context_length)]
    assert_close(ours.logits(ids), hf_logits(model.eval(), ids))


def test_hf_sliding_window_settings_that_are_not_honoured_are_refused(tmp_path):
    """Qwen3 with use_sliding_window: true would need windowed layers the graph does not have (it loaded and ran
    full attention); a Mistral window that is no positive int names the field."""
    model = tiny_model("qwen3", tied=True)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True, "sliding_window": 8}))
    with pytest.raises(graphir.LoadError, match="use_sliding_window=true is not supported"):
        graphir.load(str(tmp_path))
    cfg = {**cfg, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(graphir.LoadError, match="sliding_window 0 must be null or an int >= 1"):
        graphir.load(str(tmp_path))
