"""Bad input raises InputError/LoadError naming the tensor, file or rule, before anything runs."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from _model_helpers import write_gguf
from graphir.backends.registry import resolve_backend
from graphir.models.loader import ours_to_hf
from graphir.models.presets import PRESETS, random_weights
from safetensors.numpy import load_file, save_file

import graphir
from graphir.errors import BackendError, GraphError, InputError, LoadError
from graphir.passes import BACKEND_PIPELINES
from graphir.quant import dequantize

TINY, _ = PRESETS["llama-tiny"]


@pytest.fixture(scope="module")
def model():
    return graphir.load("random:llama-tiny", backend="reference", passes="", ctx=16)


def tiny_arrays(config=TINY) -> dict[str, np.ndarray]:
    return {n: dequantize(w.data, w.dtype, w.shape) for n, w in random_weights(config).items()}


def hf_dir(tmp_path, config=TINY, arrays=None, **overrides):
    """A tiny HF llama directory from the preset's weights (HF names)."""
    arrays = tiny_arrays(config) if arrays is None else arrays
    save_file({ours_to_hf(n, config): a for n, a in arrays.items()}, str(tmp_path / "model.safetensors"))
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=config.n_vocab,
               hidden_size=config.d_model, intermediate_size=config.d_ff, num_hidden_layers=config.n_layers,
               num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
               head_dim=config.head_dim, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def raises(exc, *fragments):
    """pytest.raises whose message must contain every fragment (escaped)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


# ---- runtime input ----

def test_token_id_out_of_range(model):
    with raises(InputError, "token id 272", "index 2", "[0, 272)"):
        model.logits([1, 2, 272])
    with raises(InputError, "token id -1"):
        model.generate([-1, 3], 2)
    assert model.n_past == 0  # nothing ran


def test_empty_or_non_integer_prompt(model):
    with raises(InputError, "non-empty"):
        model.logits([])
    with raises(InputError, "integers"):
        model.logits([1.5, 2.0])


def test_prompt_plus_new_tokens_exceeding_ctx_fails_at_the_call(model):
    with raises(InputError, "10 tokens", "max_new_tokens 7", "context of 16"):
        model.generate(list(range(10)), 7)  # raised before the first next()
    assert len(list(model.generate(list(range(10)), 6, stop_at_eos=False))) == 6
    with raises(InputError, "context of 16"):
        model.logits(list(range(17)))
    model.reset()
    model.feed(list(range(10)))
    with raises(InputError, "7 tokens after 10", "context of 16"):
        model.feed(list(range(7)))


@pytest.mark.parametrize("kw, rule", [(dict(temperature=-0.5), "temperature"), (dict(top_p=2.0), "top_p"),
                                      (dict(top_k=-3), "top_k"), (dict(max_new_tokens=-1), "max_new_tokens"),
                                      # these were numpy's ValueError/TypeError, or '>=' between str and float
                                      (dict(seed=-1), "seed must be None or an int >= 0, got -1"),
                                      (dict(seed=1.5), "seed must be None or an int >= 0, got 1.5"),
                                      (dict(seed="7"), "seed must be None or an int >= 0, got '7'"),
                                      (dict(temperature="0.8"), "temperature must be a finite number >= 0, got '0.8'"),
                                      # inf drew uniformly from the vocabulary; --temperature refused it already
                                      (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
                                      (dict(top_p="0.9"), "top_p must be a number in (0, 1], got '0.9'")])
def test_bad_generation_options(model, kw, rule):
    args = {"max_new_tokens": 2, **kw}
    with raises(InputError, rule):
        model.generate([1, 2], **args)
    with raises(InputError, rule.split(" must")[0]):  # the speculative loop and chat check them alike
        model.generate([1, 2], draft="lookup", **args)


def test_numpy_seed_and_settings_are_taken(model):
    a = list(model.generate([1, 2], 4, temperature=np.float32(0.8), top_p=np.float64(0.9), seed=np.int64(3)))
    assert a == list(model.generate([1, 2], 4, temperature=0.8, top_p=0.9, seed=3))


@pytest.mark.parametrize("n, rule", [(0, "n_tokens must be an int >= 1, got 0"),
                                     (2.5, "n_tokens must be an int >= 1, got 2.5")])
def test_graph_token_count_is_checked(model, n, rule):
    """model.graph('prefill', 0) built the default 8-token graph (0 read as 'not given'); 2.5 failed at an Input's
    shape rather than naming n_tokens."""
    with raises(GraphError, rule):
        model.graph("prefill", n)
    assert model.graph("prefill", np.int64(3)).meta["n_tokens"] == 3


def test_a_graph_past_the_context_is_refused(model):
    """model.graph('prefill', 17) at ctx 16 was built, then failed at its first run (check(model, n_tokens=17)
    too) as set_rows' 'row index out of range 0..15 (got 0..16)'."""
    from graphir.check import check

    with raises(GraphError, "n_tokens=17 is past the model's context of 16 KV rows; load(..., ctx=N) to raise it"):
        model.graph("prefill", 17)
    with raises(GraphError, "n_tokens=17 is past the model's context of 16 KV rows"):
        check(model, n_tokens=17)
    assert model.graph("prefill", 16).meta["n_tokens"] == 16


# ---- load specs ----

def test_unknown_specs_backend_and_ctx(tmp_path):
    with raises(LoadError, "random:nope", "qwen3-tiny"):
        graphir.load("random:nope")
    with raises(LoadError, "no such file"):
        graphir.load(str(tmp_path / "missing.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"1234")
    with raises(LoadError, "not a .gguf file"):
        graphir.load(str(tmp_path / "weights.bin"))
    with raises(BackendError, "unknown backend 'tpu'"):
        graphir.load("random:llama-tiny", backend="tpu")
    with raises(InputError, "ctx"):
        graphir.load("random:llama-tiny", ctx=0)
    with raises(LoadError, "dtype 'f64'"):
        graphir.load(str(hf_dir(tmp_path)), dtype="f64")


def test_load_takes_numpy_integers_for_ctx_and_kv_slots():
    """As generate() takes them for max_new_tokens and top_k (load refused np.int64(16): 'ctx must be an int')."""
    m = graphir.load("random:llama-tiny", backend="reference", ctx=np.int64(16), kv_slots=np.int32(12))
    assert (m.config.ctx, m.kv_capacity) == (16, 12) and type(m.config.ctx) is int
    with raises(InputError, "ctx must be an int >= 1"):
        graphir.load("random:llama-tiny", ctx=np.float64(16))


def test_a_context_too_large_to_allocate_names_ctx():
    """ctx=10**14 loads (nothing is allocated yet); the first call's State buffers cannot be: one InputError naming
    the size and the knob (it was numpy's _ArrayMemoryError traceback, 'Unable to allocate 11.4 PiB')."""
    m = graphir.load("random:llama-tiny", backend="reference", ctx=10**14)
    with raises(InputError, "random:llama-tiny", "context of 100000000000000 tokens", "PiB", "ctx=N", "--ctx N"):
        m.logits([1, 2])


def test_load_defaults_are_the_clis():
    m = graphir.load("random:llama-tiny")
    assert (m.backend, m.passes) == (resolve_backend("auto"), BACKEND_PIPELINES[m.backend])  # passes "auto"


def test_bad_dtype_fails_at_load_before_any_file_is_read(tmp_path):
    """A dtype that is no weight type is refused before the file is read (it was after, here a missing file's
    LoadError came first)."""
    with raises(LoadError, "dtype 'q4' is not a weight type"):
        graphir.load(str(tmp_path / "missing.gguf"), dtype="q4")


def test_bad_pipeline_fails_at_load_before_any_file_is_read(tmp_path):
    with raises(GraphError, "pipeline 'nonsense'", "unknown pass 'nonsense'", "known: default, "):
        graphir.load(str(tmp_path / "missing.gguf"), passes="nonsense")
    with raises(GraphError, "pass 'dce'", "unknown option 'x'"):
        graphir.load("random:llama-tiny", passes="dce{x=1}")
    with raises(InputError, "passes must be a pipeline string", "None"):
        graphir.load("random:llama-tiny", passes=None)


# ---- HF directories ----

def test_hf_dir_loads(tmp_path):
    m = graphir.load(str(hf_dir(tmp_path)))
    assert m.config.rope_mode == "neox" and m.tokenizer is None
    assert m.logits([1, 2, 3]).shape == (3, TINY.n_vocab)


def test_hf_unknown_architecture(tmp_path):
    with raises(LoadError, "config.json", "MambaForCausalLM", "not supported"):
        graphir.load(str(hf_dir(tmp_path, architectures=["MambaForCausalLM"])))


def test_hf_missing_tensor_names_both_names(tmp_path):
    arrays = tiny_arrays()
    del arrays["blk.1.ffn_up.weight"]
    with raises(LoadError, "missing tensor 'blk.1.ffn_up.weight'", "model.layers.1.mlp.up_proj.weight"):
        graphir.load(str(hf_dir(tmp_path, arrays=arrays)))


def test_hf_wrong_shape(tmp_path):
    with raises(LoadError, "blk.0.ffn_gate.weight", "[96, 64]", "expects [80, 64]"):
        graphir.load(str(hf_dir(tmp_path, intermediate_size=80)))


def test_hf_unused_tensor(tmp_path):
    d = hf_dir(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with raises(LoadError, "q_proj.bias", "no place"):
        graphir.load(str(d))


def test_hf_unsupported_options(tmp_path):
    with raises(LoadError, "attention_bias"):
        graphir.load(str(hf_dir(tmp_path, attention_bias=True)))
    with raises(LoadError, "rope scaling", "llama3"):
        graphir.load(str(hf_dir(tmp_path, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4})))


@pytest.mark.parametrize("field, value, rule", [
    ("rms_norm_eps", "x", "rms_norm_eps must be a finite number, got 'x'"),
    ("max_position_embeddings", None, "max_position_embeddings must be a whole number, got None"),
    ("hidden_size", 64.5, "hidden_size must be a whole number, got 64.5"),
    ("vocab_size", True, "vocab_size must be a whole number, got True"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "1e4"}, "rope_theta must be a finite number"),
    ("architectures", "LlamaForCausalLM", "architectures must be a list of class names"),
])
def test_hf_config_field_of_the_wrong_type_is_named(tmp_path, field, value, rule):
    """A config.json value of the wrong type names the file and the field (these were ValueError and
    TypeError tracebacks from float()/int(), or a list of supported names holding the one given)."""
    with raises(LoadError, "config.json", rule):
        graphir.load(str(hf_dir(tmp_path, **{field: value})))


@pytest.mark.parametrize("field, value, rule", [
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("rms_norm_eps", -1.0, "rms_eps -1.0 must be >= 0"),
    ("rope_theta", 0, "rope_theta 0.0 must be > 0"),
])
def test_hf_config_values_the_graph_cannot_honour(tmp_path, field, value, rule):
    """A llama config with GELU loaded and ran SiLU (wrong text, no error); a negative eps ran into a
    ZeroDivisionError inside a cpu kernel at the first token."""
    with raises(LoadError, rule):
        graphir.load(str(hf_dir(tmp_path, **{field: value})), backend="cpu")


# ---- GGUF files ----

def test_gguf_loads(tmp_path):
    m = graphir.load(str(write_gguf(tmp_path / "ok.gguf", TINY, tiny_arrays())))
    assert dataclasses.replace(m.config, rms_eps=TINY.rms_eps) == TINY  # eps went through f32
    assert m.tokenizer.eos_ids == {TINY.n_vocab - 1} and m.eos_ids == {TINY.n_vocab - 1}


def test_gguf_without_tokenizer_loads_without_one_and_runs_from_ids(tmp_path):
    """Weights alone, as an HF folder without tokenizer.json: the model loads with no tokenizer, its EOS from the
    file, and computes what the same file with a tokenizer does; `graphir run` says why it cannot encode a prompt."""
    from click.testing import CliRunner

    from graphir.cli import main

    bare = graphir.load(str(write_gguf(tmp_path / "bare.gguf", TINY, tiny_arrays(), tokenizer=False)))
    full = graphir.load(str(write_gguf(tmp_path / "full.gguf", TINY, tiny_arrays())))
    assert bare.tokenizer is None and bare.eos_ids == full.eos_ids == {TINY.n_vocab - 1}
    ids = [3, 17, 250, 9, 101]
    np.testing.assert_array_equal(np.asarray(bare.logits(ids)), np.asarray(full.logits(ids)))
    assert list(bare.generate(ids, 4)) == list(full.generate(ids, 4))
    r = CliRunner().invoke(main, ["run", str(tmp_path / "bare.gguf"), "--backend", "reference", "-n", "2"])
    assert r.exit_code != 0 and "has no tokenizer (no tokenizer.ggml.tokens)" in r.output
    assert "Traceback" not in r.output


def test_gguf_with_a_malformed_token_list_is_refused(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_token_list", lambda self, tokens: self.add_array(
        "tokenizer.ggml.tokens", [1, 2, 3]))
    with raises(LoadError, "tokenizer.ggml.tokens is missing or not a list of strings"):
        graphir.load(str(write_gguf(tmp_path / "m.gguf", TINY, tiny_arrays())))


def test_gguf_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", TINY, tiny_arrays(), arch="mamba")
    with raises(LoadError, "m.gguf", "architecture 'mamba' is not supported"):
        graphir.load(str(path))


def test_gguf_missing_metadata(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", TINY, tiny_arrays(), skip_keys=("block_count",))
    with raises(LoadError, "m.gguf", "llama.'block_count'"):
        graphir.load(str(path))


@pytest.mark.parametrize("key, value, rule", [
    ("context_length", "4096", "llama.'context_length' must be a number, got '4096'"),
    ("attention.layer_norm_rms_epsilon", "x", "llama.'attention.layer_norm_rms_epsilon' must be a number, got 'x'"),
    ("attention.head_count_kv", [2, 2], "llama.'attention.head_count_kv' must be a number, got [2, 2]"),
    ("attention.head_count_kv", 0, "n_kv_heads 0 must be >= 1"),
    ("attention.head_count", 0, "n_heads 0 must be >= 1"),
])
def test_gguf_metadata_of_the_wrong_type_or_zero_heads_is_named(tmp_path, key, value, rule):
    """A metadata value int()/float() cannot take, or a head count of 0, names the key or the rule (these were
    ValueError, TypeError and ZeroDivisionError tracebacks)."""
    path = write_gguf(tmp_path / "m.gguf", TINY, tiny_arrays(), skip_keys=(key,), extra={key: value})
    with raises(LoadError, "m.gguf", rule):
        graphir.load(str(path))


def test_hf_zero_heads_is_named(tmp_path):
    with raises(LoadError, str(tmp_path), "n_heads 0 must be >= 1"):
        graphir.load(str(hf_dir(tmp_path, num_attention_heads=0, head_dim=None)))


def test_gguf_missing_tensor(tmp_path):
    arrays = tiny_arrays()
    del arrays["blk.0.attn_v.weight"]
    with raises(LoadError, "m.gguf", "missing tensor 'blk.0.attn_v.weight'"):
        graphir.load(str(write_gguf(tmp_path / "m.gguf", TINY, arrays)))


def test_gguf_wrong_shape(tmp_path):
    arrays = tiny_arrays()
    arrays["blk.1.attn_output.weight"] = arrays["blk.1.attn_output.weight"][:, :32]
    with raises(LoadError, "blk.1.attn_output.weight", "[64, 32]", "expects [64, 64]"):
        graphir.load(str(write_gguf(tmp_path / "m.gguf", TINY, arrays)))


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_transposed_tensor_is_refused(tmp_path, fmt):
    # The config's dimensions in the other order ([n_in, n_out] for [n_out, n_in]): as many elements, the same
    # sizes, and still not the tensor the graph multiplies by.
    arrays = tiny_arrays()
    name = "blk.1.ffn_down.weight"
    n_out, n_in = arrays[name].shape
    assert n_out != n_in
    arrays[name] = np.ascontiguousarray(arrays[name].T)
    with raises(LoadError, name, f"[{n_in}, {n_out}]", f"expects [{n_out}, {n_in}]"):
        graphir.load(str(hf_dir(tmp_path, arrays=arrays) if fmt == "hf" else
                         write_gguf(tmp_path / "m.gguf", TINY, arrays)))


def test_gguf_rope_scaling_refused(tmp_path):
    arrays = tiny_arrays()
    arrays["rope_freqs.weight"] = np.ones(TINY.head_dim // 2, np.float32)
    with raises(LoadError, "rope scaling"):
        graphir.load(str(write_gguf(tmp_path / "m.gguf", TINY, arrays)))


# ---- files that are not text ----

def tokenizer_dir(tmp_path):
    """A tiny HF llama directory with a word-level tokenizer.json beside it."""
    from tokenizers import Tokenizer, models

    d = hf_dir(tmp_path)
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(d / "tokenizer.json"))
    return d


BINARY = b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01"


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json", "chat_template.jinja", "model.safetensors.index.json"])
def test_binary_side_files_name_the_file(tmp_path, name):
    d = tokenizer_dir(tmp_path)
    assert graphir.load(str(d), backend="reference").tokenizer.vocab_size == 2
    (d / name).write_bytes(BINARY)
    with raises(LoadError, str(d / name)):
        graphir.load(str(d), backend="reference")


def test_non_object_side_json_names_the_file(tmp_path):
    d = tokenizer_dir(tmp_path)
    (d / "tokenizer_config.json").write_text("[1, 2]")
    with raises(LoadError, str(d / "tokenizer_config.json"), "JSON object"):
        graphir.load(str(d), backend="reference")
