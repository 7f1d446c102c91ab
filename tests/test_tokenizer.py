"""models.tokenizer against transformers' tokenizers for the same GGUF / tokenizer.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import pytest
from graphir.models.default_model import smollm2_path
from graphir.models.gguf_file import GGUFFile
from graphir.models.tokenizer import Tokenizer, _bytes_to_unicode

from graphir.errors import InputError, LoadError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TRICKY = [
    "12345 3.14159",
    "The capital of France is",
    "a  b   c    d",
    "  leading and trailing  ",
    "tabs\t\tand\nnew\n\nlines\r\n",
    "naïve café 日本語",
    "👋🏽 hello 🎉🎉",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "don't it's we're I'LL",
    "x<|endoftext|>y",
    "",
]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(smollm2_path()).metadata, source="smollm2")


@pytest.fixture(scope="module")
def hf_smol():
    from transformers import AutoTokenizer

    path = smollm2_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_smollm2_facts(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert smol.bos_id == 1 and smol.eos_ids == {2}
    assert smol.add_bos is False
    assert smol.chat_template is not None and "<|im_start|>" in smol.chat_template
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("hi", add_bos=True)[0] == 1
    assert smol.encode("12345") == [smol._tk.token_to_id(d) for d in "12345"]  # smollm: digits one by one


@pytest.mark.parametrize("text", TRICKY)
def test_smollm2_matches_transformers(smol: Tokenizer, hf_smol, text: str) -> None:
    ids = smol.encode(text)
    assert ids == hf_smol.encode(text, add_special_tokens=False)
    assert smol.decode(ids) == text == hf_smol.decode(ids)
    assert "".join(smol.stream()(ids)) == text


def test_stream_holds_incomplete_utf8(smol: Tokenizer) -> None:
    text = "👋🏽 naïve 日本語 🎉!"
    ids = smol.encode(text)
    stream = smol.stream()
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == smol.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens were held back: the emoji's bytes span several tokens
    # A stream cut inside a character: the held bytes come out as one U+FFFD at the end, as decode does.
    cut = smol.encode("👋")[:1]
    assert "".join(smol.stream()(cut)) == smol.decode(cut) == "\ufffd"


def test_stream_invalid_bytes_match_decode(smol: Tokenizer) -> None:
    byte_id = {b: smol._tk.token_to_id(c) for b, c in _bytes_to_unicode().items()}
    for seq in ([0x80, 0x41], [0xF0, 0x9F, 0x41, 0xE6, 0x97], [0xC3, 0xC3, 0xA9], [0xED, 0xA0, 0x80]):
        ids = [byte_id[b] for b in seq]
        assert "".join(smol.stream()(ids)) == smol.decode(ids), seq


def test_decode_rejects_bad_ids(smol: Tokenizer) -> None:
    with pytest.raises(InputError, match="token id 49152 out of range"):
        smol.decode([5, 49152])
    with pytest.raises(InputError, match="out of range"):
        smol.stream().push(-1)


def test_from_file_matches_transformers(tmp_path: Path, hf_smol) -> None:
    hf_smol.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.vocab_size == 49152 and tok.bos_id == 1 and tok.eos_ids == {0, 2}
    assert tok.chat_template == hf_smol.chat_template
    for text in TRICKY:
        ids = tok.encode(text)
        assert ids == hf_smol.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text == "".join(tok.stream()(ids))


# ---- small GGUF vocabularies ----


def write_vocab_gguf(path: Path, model: str, tokens: list[str], types: list[int], **extra) -> None:
    """A tokenizer-only GGUF with just enough llama hyper-parameters for transformers to read it."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    for key, val in extra.items():
        getattr(w, f"add_{key}")(val)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    u = _bytes_to_unicode()
    tokens = ["<|endoftext|>", "<|user|>", "<think>"] + [u[b] for b in range(256)]
    merge_pairs = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2"), ("12", "3"), ("Ċ", "Ċ"), ("Ġ", "Ġ"), ("'", "s")]
    merges = [f"{a} {b}" for a, b in merge_pairs]
    tokens += [a + b for a, b in merge_pairs]
    types = [3, 3, 4] + [1] * (len(tokens) - 3)
    return tokens, merges, types


BPE_TEXTS = ["the theme", "12345 123", "a\n\n\nb", "it's IT'S", "x  \n  y", "<|user|>the<think>", "日本 👋"]


@pytest.mark.parametrize("pre", ["gpt2", "qwen2", "llama-bpe", "smollm"])
def test_bpe_pre_tokenizers_match_transformers(tmp_path: Path, pre: str) -> None:
    from transformers import AutoTokenizer

    tokens, merges, types = byte_level_vocab()
    write_vocab_gguf(tmp_path / "v.gguf", "gpt2", tokens, types, token_merges=merges, tokenizer_pre=pre,
                     eos_token_id=0, eot_token_id=1)  # fmt: skip
    tok = Tokenizer.from_gguf(GGUFFile(tmp_path / "v.gguf").metadata)
    assert tok.eos_ids == {0, 1} and tok.bos_id is None
    with pytest.raises(InputError, match="no BOS"):
        tok.encode("x", add_bos=True)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="v.gguf")
    for text in BPE_TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text == "".join(tok.stream()(ids))
        if pre == "smollm" and any(c.isdigit() for c in text):
            # transformers reads 'smollm' as plain GPT-2; llama.cpp and SmolLM2's tokenizer.json split digits first.
            assert all(tok.token(i) in "0123456789Ġ " for i in ids)
            continue
        assert ids == hf.encode(text, add_special_tokens=False), text
    assert tok.encode("<|user|>")[0] == 1 and tok.encode("<think>") == [2]


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "llo", "▁he", "▁hello", "▁w", "or", "▁wor",
              "▁world", "lo", "▁▁", "a", "b", "ab", "▁a"]  # fmt: skip
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    return tokens + pieces, types + [1] * len(pieces), scores


def test_sentencepiece_llama(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokens, types, scores = spm_vocab()
    write_vocab_gguf(tmp_path / "spm.gguf", "llama", tokens, types, token_scores=scores, bos_token_id=1,
                     eos_token_id=2, unk_token_id=0)  # fmt: skip
    tok = Tokenizer.from_gguf(GGUFFile(tmp_path / "spm.gguf").metadata)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert tok.add_bos and tok.bos_id == 1 and tok.eos_ids == {2}
    for text in ["hello world", "héllo wörld", "hello  world", "ab", "", "a\nb", "日本"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text), text
        assert tok.decode(ids[1:]) == text == "".join(tok.stream()(ids[1:]))
    # Where transformers' Metaspace differs, we follow llama.cpp (and Llama-2's tokenizer.json):
    # a space is prepended to every text fragment, also one that starts with a space or follows a special token.
    assert [tok.token(i) for i in tok.encode(" hello", add_bos=False)] == ["▁", "▁hello"]
    assert [tok.token(i) for i in tok.encode("<s>hello", add_bos=False)] == ["<s>", "▁hello"]


def test_gguf_tokenizer_errors() -> None:
    tokens, merges, types = byte_level_vocab()
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges}
    assert Tokenizer.from_gguf(base).vocab_size == len(tokens)
    cases = [
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens is missing"),
        ({"tokenizer.ggml.model": "bert"}, "tokenizer model 'bert' is not supported"),
        ({"tokenizer.ggml.pre": "falcon"}, "pre-tokenizer 'falcon' is not supported"),
        ({"tokenizer.ggml.merges": ["a b c"]}, r"merges\[0\] = 'a b c'"),
        ({"tokenizer.ggml.merges": None}, "needs tokenizer.ggml.merges"),
        ({"tokenizer.ggml.token_type": [1]}, "token_type has 1 entries"),
        ({"tokenizer.ggml.eos_token_id": 10**6}, "eos_token_id = 1000000 is not a token id"),
        ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.scores"),
    ]
    for patch, message in cases:
        with pytest.raises(LoadError, match=message) as e:
            Tokenizer.from_gguf({**base, **patch}, source="x.gguf")
        assert str(e.value).startswith("x.gguf: ")


def test_from_file_errors(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="file not found"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(LoadError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")


def test_byte_tokenizer_prints_a_random_presets_other_ids():
    """A random preset's vocabulary is larger than the byte tokenizer's 258 ids and a random model generates the
    rest too: they print as markers, in a stream and in decode alike, and `graphir run random:qwen3-0.6b` (vocab
    151,936) streams text instead of failing at its first token; ids past the model's vocabulary stay an error."""
    from graphir.models.presets import ByteTokenizer

    import graphir

    tok = ByteTokenizer(400)
    ids = [104, 0xC3, 300, 0xA9, 257, 399]
    assert tok.decode(ids) == "h\ufffd<|id 300|>\ufffd<|eos|><|id 399|>"
    assert "".join(tok.stream()(ids)) == tok.decode(ids)
    assert tok.decode([0xC3, 0xA9]) == "\u00e9" and tok.token(300) == "<|id 300|>"
    for bad in (400, -1):
        with pytest.raises(InputError, match=f"token id {bad} out of range \\[0, 400\\)"):
            tok.decode([bad])
    model = graphir.load("random:qwen3-tiny", backend="reference")
    assert model.tokenizer.n_ids == model.config.n_vocab == 272
    out = list(model.generate(model.tokenizer.encode("hello"), 40))
    assert max(out) >= 258, "the test needs an id past the bytes"  # seeded: ids 258..271 come up in 40 tokens
    assert model.tokenizer.decode(out).count("<|id ") == sum(258 <= i for i in out)


def byte_level_tokenizer_json(path: Path) -> Path:
    """A 258-id byte-level BPE tokenizer.json (the 256 byte symbols, <s>, </s>; no merges)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": 256, "</s>": 257})
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.save(str(path))
    return path


def test_a_model_vocabulary_past_the_tokenizers_prints_its_other_ids(tmp_path: Path) -> None:
    """An HF model's embedding often has more rows than its tokenizer has ids (Qwen3: 151,936 against 151,669),
    and a model can generate those ids: they print as <|id N|> markers, as a random preset's do, in decode and in
    a stream alike (`graphir run` on such a directory failed at the first one: 'token id 805 out of range
    [0, 258)'); ids past the model's vocabulary stay an error."""
    from test_api_errors import hf_dir

    import graphir

    d = hf_dir(tmp_path)  # the llama-tiny preset's weights: vocab 272
    byte_level_tokenizer_json(d / "tokenizer.json")
    model = graphir.load(str(d), backend="reference")
    tok = model.tokenizer
    assert (tok.vocab_size, tok.n_ids) == (258, 272)
    ids = tok.encode("hé") + [260] + tok.encode("!") + [271]
    assert tok.decode(ids) == "hé<|id 260|>!<|id 271|>" == "".join(tok.stream()(ids))
    assert tok.token(260) == "<|id 260|>"
    with pytest.raises(InputError, match=r"token id 272 out of range \[0, 272\)"):
        tok.decode([272])
    out = list(model.generate(tok.encode("hello"), 40, stop_at_eos=False))
    assert max(out) >= 258, "the test needs an id past the tokenizer's"
    text = tok.decode(out)
    assert "".join(tok.stream()(out)) == text and text.count("<|id ") == sum(i >= 258 for i in out)


def test_named_chat_templates_take_the_default(tmp_path: Path) -> None:
    """tokenizer_config.json may hold chat_template as a list of {"name", "template"} (transformers picks "default"):
    it read as no template at all ('no chat template in the model's files')."""
    byte_level_tokenizer_json(tmp_path / "tokenizer.json")
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ messages[0].content }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert Tokenizer.from_file(tmp_path / "tokenizer.json").chat_template == "{{ messages[0].content }}"


def test_text_that_is_not_unicode_is_named(smol: Tokenizer) -> None:
    """A byte the terminal could not decode reaches -p as a lone surrogate ('\\udcff'): encode raised the
    tokenizers library's 'TextInputSequence must be str', the byte tokenizer a UnicodeEncodeError."""
    from graphir.models.presets import ByteTokenizer

    for tok in (smol, ByteTokenizer()):
        with pytest.raises(InputError, match=r"text is not valid UTF-8: '\\udcff' at index 2"):
            tok.encode("ab\udcffcd")
