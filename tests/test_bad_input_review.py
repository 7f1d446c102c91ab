"""Bad input found by a fresh review: each case was a raw Python error (TypeError, ValueError, ZeroDivisionError),
a crash at the first token, or a silently wrong model. Now a LoadError/InputError naming the file, key or field
and the rule, before anything runs; the model stays usable."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from _model_helpers import write_gguf
from click.testing import CliRunner
from graphir.models import gemma3, llama, qwen35
from graphir.models.presets import PRESETS
from test_api_errors import hf_dir, raises, tiny_arrays

import graphir
from graphir.cli import main
from graphir.errors import InputError, LoadError

TINY, _ = PRESETS["llama-tiny"]


def shaped_arrays(config) -> dict[str, np.ndarray]:
    """Seeded f32 tensors of every Param shape of a llama `config` (zero-sized ones too)."""
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in llama.param_shapes(config).items()}


def cli_error(*args: str) -> str:
    """A failed `graphir` command's last stderr line: one `error: ...`, no traceback."""
    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 1 and isinstance(r.exception, (SystemExit, type(None))), repr(r.exception)
    assert "Traceback" not in r.output, r.output
    last = r.stderr.splitlines()[-1]
    assert last.startswith("error: "), r.stderr
    return last


# ---- what names the family ----

def test_gguf_architecture_that_is_not_a_string_is_named(tmp_path, monkeypatch):
    """general.architecture written as an array was `TypeError: unhashable type: 'list'`, a traceback from the CLI."""
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_architecture",
                        lambda self: self.add_array("general.architecture", ["llama"]))
    path = write_gguf(tmp_path / "m.gguf", TINY, tiny_arrays())
    with raises(LoadError, "m.gguf", "architecture ['llama'] is not supported"):
        graphir.load(str(path), backend="reference")
    assert "architecture ['llama'] is not supported" in cli_error("run", str(path), "--backend", "reference")


def test_hf_model_type_that_is_not_a_string_is_named(tmp_path):
    """A config.json without architectures and with a list for model_type was a TypeError."""
    d = hf_dir(tmp_path, architectures=None, model_type=["llama"])
    with raises(LoadError, "config.json", "model_type ['llama']"):
        graphir.load(str(d), backend="reference")


# ---- sizes of zero ----

@pytest.mark.parametrize("field", ["d_ff", "d_model", "head_dim", "n_layers"])
def test_a_zero_size_in_the_file_is_refused_at_load(tmp_path, field):
    """A GGUF whose tensors and metadata agree on a size of 0 loaded: d_ff 0 then raised ZeroDivisionError in the
    cpu matmul at the first token, d_model 0 in the cpu norm kernel (NaN on the reference), head_dim 0 at graph
    build (1 / sqrt(0)), and 0 layers 'unexpected inputs ['kv_idx', 'kv_len', 'pos']'."""
    config = dataclasses.replace(TINY, **{field: 0})
    path = write_gguf(tmp_path / "m.gguf", config, shaped_arrays(config), tokenizer=False)
    with raises(LoadError, "m.gguf", f"{field} 0 must be >= 1"):
        graphir.load(str(path), backend="cpu")


def test_an_empty_vocabulary_is_refused_at_load(tmp_path):
    config = dataclasses.replace(TINY, n_vocab=0)
    with raises(LoadError, str(tmp_path), "n_vocab 0 must be >= 1"):
        graphir.load(str(hf_dir(tmp_path, config=config, arrays=shaped_arrays(config))), backend="reference")


@pytest.mark.parametrize("family, preset, field", [
    (gemma3, "gemma3-tiny", "d_ff"), (gemma3, "gemma3-tiny", "head_dim"), (gemma3, "gemma3-tiny", "n_layers"),
    (qwen35, "qwen35-tiny", "d_ff"), (qwen35, "qwen35-tiny", "ssm_k_dim"), (qwen35, "qwen35-tiny", "ssm_v_dim"),
    (qwen35, "qwen35-tiny", "n_layers"),
])
def test_other_families_refuse_zero_sizes(family, preset, field):
    config = dataclasses.replace(family.PRESETS[preset][0], **{field: 0})
    if field == "n_layers" and family is gemma3:
        config = dataclasses.replace(config, sliding=())
    with raises(LoadError, "m.gguf", f"{field} 0 must be >= 1"):
        family.weights_from_gguf(config, graphir.weights.Weights(source="m.gguf"))


# ---- numbers of the wrong kind ----

@pytest.mark.parametrize("key, value, rule", [
    # int() took 2.7 as 2 without a word (config.json's counts must be whole numbers already)
    ("block_count", 2.7, "llama.'block_count' must be a whole number, got 2.7"),
    ("context_length", 100.5, "llama.'context_length' must be a whole number, got 100.5"),
    # an infinite theta or eps loaded (config.json's must be finite already)
    ("rope.freq_base", float("inf"), "llama.'rope.freq_base' must be a finite number, got inf"),
    ("attention.layer_norm_rms_epsilon", float("inf"),
     "llama.'attention.layer_norm_rms_epsilon' must be a finite number, got inf"),
])
def test_gguf_numbers_of_the_wrong_kind_are_named(tmp_path, key, value, rule):
    path = write_gguf(tmp_path / "m.gguf", TINY, tiny_arrays(), skip_keys=(key,), extra={key: value})
    with raises(LoadError, "m.gguf", rule):
        graphir.load(str(path), backend="reference")


def test_whole_floats_are_still_counts(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", TINY, tiny_arrays(), skip_keys=("block_count",), extra={"block_count": 2.0})
    assert graphir.load(str(path), backend="reference").config.n_layers == 2


GEMMA_MD = {"general.architecture": "gemma3", "gemma3.context_length": 256, "gemma3.embedding_length": 64,
            "gemma3.block_count": 7, "gemma3.feed_forward_length": 96, "gemma3.attention.head_count": 4,
            "gemma3.attention.head_count_kv": 2, "gemma3.attention.key_length": 16,
            "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.attention.sliding_window": 16}


class Info:
    def __init__(self, shape):
        self.shape = shape


@pytest.mark.parametrize("change, rule", [
    # TypeError: 'float' / 'bool' object is not iterable
    ({"attention.sliding_window_pattern": 6.0}, "gemma3.attention.sliding_window_pattern = 6.0 must be"),
    ({"attention.sliding_window_pattern": True}, "gemma3.attention.sliding_window_pattern = True must be"),
    # ZeroDivisionError; ValueError; a negative or NaN factor loaded
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 0.0}, "gemma3.rope.scaling.factor 0.0 must be"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": "x"},
     "gemma3.'rope.scaling.factor' must be a number, got 'x'"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": -2.0}, "gemma3.rope.scaling.factor -2.0 must be"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": float("nan")},
     "gemma3.'rope.scaling.factor' must be a finite number, got nan"),
    # ValueError; a zero or NaN scale loaded
    ({"attention.scale": "x"}, "gemma3.'attention.scale' must be a number, got 'x'"),
    ({"attention.scale": 0.0}, "gemma3.attention.scale 0.0 must be > 0"),
    ({"attention.scale": float("nan")}, "gemma3.'attention.scale' must be a finite number, got nan"),
    ({"final_logit_softcapping": "x"}, "gemma3.'final_logit_softcapping' must be a number, got 'x'"),
    # ValueError: the truth value of an array is ambiguous
    ({"attn_logit_softcapping": np.array([1.0, 2.0])}, "gemma3.attn_logit_softcapping"),
])
def test_gemma3_gguf_metadata_of_the_wrong_kind_is_named(change, rule):
    md = {**GEMMA_MD, **{f"gemma3.{k}": v for k, v in change.items()}}
    with raises(LoadError, "m.gguf", rule):
        config = gemma3.config_from_gguf(md, {"token_embd.weight": Info((272, 64))}, "m.gguf")
        gemma3.weights_from_gguf(config, graphir.weights.Weights(source="m.gguf"))


def qwen35_md(**change):
    c = qwen35.PRESETS["qwen35-tiny"][0]
    md = {"embedding_length": c.d_model, "attention.head_count": c.n_heads, "attention.head_count_kv": c.n_kv_heads,
          "attention.key_length": c.head_dim, "ssm.time_step_rank": c.ssm_v_heads, "block_count": c.n_layers,
          "feed_forward_length": c.d_ff, "ssm.group_count": c.ssm_k_heads, "ssm.state_size": c.ssm_k_dim,
          "ssm.inner_size": c.ssm_v_heads * c.ssm_v_dim, "ssm.conv_kernel": c.ssm_conv_kernel,
          "attention.layer_norm_rms_epsilon": c.rms_eps, "context_length": 256, **change}
    return {"general.architecture": "qwen35", **{f"qwen35.{k}": v for k, v in md.items()}}


@pytest.mark.parametrize("change, rule", [
    ({"nextn_predict_layers": "x"}, "qwen35.'nextn_predict_layers' must be a number, got 'x'"),  # ValueError
    ({"feed_forward_length": ["a", "b"]}, "qwen35.'feed_forward_length' must be"),  # ValueError
])
def test_qwen35_gguf_metadata_of_the_wrong_kind_is_named(change, rule):
    tensors = {"token_embd.weight": Info((272, qwen35.PRESETS["qwen35-tiny"][0].d_model))}
    qwen35.config_from_gguf(qwen35_md(), tensors, "m.gguf")  # the unchanged keys load
    with raises(LoadError, "m.gguf", rule):
        qwen35.config_from_gguf(qwen35_md(**change), tensors, "m.gguf")


# ---- config.json flags ----

@pytest.mark.parametrize("field", ["tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"])
def test_hf_flags_must_be_booleans(tmp_path, field):
    """tie_word_embeddings "false" (a string) read as true: lm_head.weight was dropped as a tied copy and the
    model ran with the embedding as its head, other logits and no error; attention_bias "false" was refused as
    'attention_bias=true is not supported'."""
    with raises(LoadError, "config.json", f"{field} must be true or false, got 'false'"):
        graphir.load(str(hf_dir(tmp_path, **{field: "false"})), backend="reference")


def test_hf_flags_of_null_read_as_false(tmp_path):
    """As transformers' truth tests read them (a llama's defaults are false too)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    want = graphir.load(str(hf_dir(tmp_path / "a")), backend="reference").logits([1, 2, 3])
    d = hf_dir(tmp_path / "b")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(tie_word_embeddings=None, attention_bias=None)
    (d / "config.json").write_text(json.dumps(cfg))
    np.testing.assert_array_equal(graphir.load(str(d), backend="reference").logits([1, 2, 3]), want)


# ---- runtime ----

@pytest.mark.parametrize("ids", [None, 5])
def test_prompt_ids_that_are_no_sequence_are_named(ids):
    """generate(None, 4) was `TypeError: 'NoneType' object is not iterable`."""
    m = graphir.load("random:llama-tiny", backend="reference", ctx=16)
    want = list(m.generate([1, 2, 3], 4))
    for call in (lambda: m.generate(ids, 4), lambda: m.logits(ids), lambda: m.feed(ids),
                 lambda: m.generate(ids, 4, draft="lookup")):
        with raises(InputError, "token ids must be a non-empty 1-D sequence of integers", repr(ids)):
            call()
    assert list(m.generate([1, 2, 3], 4)) == want



@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_nan_logits_still_sample_an_id(backend):
    """A file whose head is NaN (a corrupt tensor) gives NaN logits; top-p kept no token and the draw was
    `IndexError: index -1 is out of bounds` (the host's first draw, and the cpu's in-graph draws). Now top-p keeps
    the first token of its order at least, as llama.cpp's min_keep does, and the ids stay in the vocabulary."""
    from graphir.api import Model
    from graphir.weights import Weight, Weights

    m = graphir.load("random:llama-tiny", backend=backend, ctx=16)
    weights = Weights(dict(m.weights.items()), source="nan head")
    head = weights["output.weight"]
    weights.add("output.weight", Weight(head.dtype, head.shape, np.full(head.shape, np.nan, np.float32)))
    nan = Model(m.config, weights, m.tokenizer, backend=backend, passes=m.passes, source="nan head")
    ids = list(nan.generate([1, 2, 3], 4, temperature=0.8, top_k=5, top_p=0.5, seed=1, stop_at_eos=False))
    assert len(ids) == 4 and all(0 <= i < m.config.n_vocab for i in ids)


CONCAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                   "{% endfor %}")  # SmolLM2's way: '+' on the content


@pytest.mark.parametrize("content", [5, None])
def test_chat_content_that_is_no_text_is_named(content):
    """A message's content of 5 or None reached the template's '+' as `TypeError: can only concatenate str (not
    "int") to str`."""
    from graphir.chat import render

    with raises(InputError, "messages[0]['content'] must be a string or a list of content parts", repr(content)):
        render(CONCAT_TEMPLATE, [{"role": "user", "content": content}])


def test_a_template_that_fails_on_python_values_is_one_line():
    """Content parts (a list, which templates of multimodal models take) given to a template that adds strings:
    the template's TypeError is a ChatTemplateError naming it."""
    from graphir.chat import ChatTemplateError, render

    with raises(ChatTemplateError, "chat template: TypeError: "):
        render(CONCAT_TEMPLATE, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


def gguf_tokenizer():
    from _model_helpers import MERGES, byte_level_tokens
    from graphir.models.tokenizer import Tokenizer

    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens":
          byte_level_tokens(272), "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.eos_token_id": 271}
    return Tokenizer.from_gguf(md, source="m.gguf")


@pytest.mark.parametrize("make", [gguf_tokenizer, lambda: graphir.load("random:llama-tiny", backend="reference")
                                  .tokenizer], ids=["gguf", "bytes"])
def test_tokenizer_arguments_of_the_wrong_type_are_named(make):
    """encode(None) and encode(b'ab') were AttributeErrors ('bytes' object has no attribute 'encode'); decode('ab')
    a ValueError from int('a'), decode([1.5]) decoded id 1."""
    tok = make()
    for text in (None, b"ab"):
        with raises(InputError, "text must be a str", type(text).__name__):
            tok.encode(text)
    for ids in ("ab", [1.5]):
        with raises(InputError, "token ids must be integers"):
            tok.decode(ids)
    assert tok.decode(tok.encode("ab")) == "ab"


@pytest.mark.parametrize("change, rule", [
    # bool() of an array: "The truth value of an array with more than one element is ambiguous"
    ({"tokenizer.ggml.add_bos_token": np.array([True, False])}, "tokenizer.ggml.add_bos_token must be true or false"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": np.zeros(272, np.float32),
      "tokenizer.ggml.add_space_prefix": np.array([1, 0])},
     "tokenizer.ggml.add_space_prefix must be true or false"),
    # float('a'): "could not convert string to float"; list(0.5): "'float' object is not iterable"
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": ["a"] * 272}, "tokenizer.ggml.scores"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": 0.5}, "tokenizer.ggml.scores"),
])
def test_gguf_tokenizer_metadata_of_the_wrong_kind_is_named(change, rule):
    from _model_helpers import MERGES, byte_level_tokens
    from graphir.models.tokenizer import Tokenizer

    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens":
          byte_level_tokens(272), "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.eos_token_id": 271, **change}
    with raises(LoadError, "m.gguf", rule):
        Tokenizer.from_gguf(md, source="m.gguf")


LLAMA_MD = {"general.architecture": "llama", "llama.context_length": 256, "llama.embedding_length": 64,
            "llama.block_count": 2, "llama.feed_forward_length": 96, "llama.attention.head_count": 4,
            "llama.attention.head_count_kv": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5}


@pytest.mark.parametrize("family, md", [(llama, LLAMA_MD), (gemma3, GEMMA_MD), (qwen35, qwen35_md())],
                         ids=["llama", "gemma3", "qwen35"])
def test_a_0d_token_embedding_is_named(family, md):
    """GGUF allows n_dims 0; the vocabulary read from token_embd.weight's shape[0] was an IndexError."""
    with raises(LoadError, "m.gguf", "token_embd.weight has shape [], expected [n_vocab, d_model]"):
        family.config_from_gguf(md, {"token_embd.weight": Info(())}, "m.gguf")


def test_hf_layer_types_that_are_no_list_are_named(tmp_path):
    """layer_types 5 was `TypeError: 'int' object is not iterable` in every family."""
    with raises(LoadError, "config.json", "layer_types must be a list of strings, got 5"):
        graphir.load(str(hf_dir(tmp_path, layer_types=5)), backend="reference")


GEMMA_HF = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 272, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 7, "num_attention_heads": 4}


@pytest.mark.parametrize("change, rule", [
    ({"rope_scaling": 5}, "rope_scaling must be an object, got int 5"),  # dict(5): a TypeError
    ({"rope_parameters": {"full_attention": 5}}, "rope_parameters of full_attention layers must be an object"),
    # 1 / factor: a ZeroDivisionError
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope factor 0.0 of full_attention layers must be > 0"),
])
def test_gemma3_hf_rope_of_the_wrong_kind_is_named(change, rule):
    with raises(LoadError, "config.json", rule):
        gemma3.config_from_hf({**GEMMA_HF, **change}, "config.json")


# ---- tokenizer side files ----

@pytest.mark.parametrize("key, value, rule", [
    ("chat_template", 7, "chat_template must be a string or a list of {name, template} objects, got 7"),
    ("add_bos_token", "yes", "add_bos_token must be true or false, got 'yes'"),
])
def test_hf_tokenizer_config_values_of_the_wrong_kind_are_named(tmp_path, key, value, rule):
    """chat_template 7 read as no template at all and add_bos_token "yes" was ignored (BOS then probed from the
    post-processor), both without a word."""
    from graphir.models.tokenizer import Tokenizer
    from test_tokenizer import byte_level_tokenizer_json

    byte_level_tokenizer_json(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({key: value}))
    with raises(LoadError, "tokenizer_config.json", rule):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({key: None}))  # null: as if absent
    Tokenizer.from_file(tmp_path / "tokenizer.json")


def test_gguf_chat_template_that_is_no_string_is_named():
    """A GGUF tokenizer.chat_template array read as no template at all."""
    from _model_helpers import MERGES, byte_level_tokens
    from graphir.models.tokenizer import Tokenizer

    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens":
          byte_level_tokens(272), "tokenizer.ggml.merges": MERGES, "tokenizer.chat_template": ["{{ x }}"]}
    with raises(LoadError, "m.gguf", "tokenizer.chat_template must be a string, got ['{{ x }}']"):
        Tokenizer.from_gguf(md, source="m.gguf")
    md["tokenizer.chat_template"] = "{{ x }}"
    assert Tokenizer.from_gguf(md, source="m.gguf").chat_template == "{{ x }}"


@pytest.mark.parametrize("spec", ["", "  "])
def test_an_empty_model_spec_is_named(spec, tmp_path, monkeypatch):
    """"" read as the current folder: 'config.json: file not found', or whatever model sat in the working
    directory loaded without a word."""
    monkeypatch.chdir(hf_dir(tmp_path))  # a loadable model where "" would have pointed
    with raises(InputError, f"the model is {spec!r}", "random:<preset>"):
        graphir.load(spec, backend="reference")
    assert "the model is ''" in cli_error("run", "", "-n", "1", "--backend", "reference")
