"""Tokenizers from a GGUF file's metadata or an HF tokenizer.json, on top of the `tokenizers` library.

GGUF keeps the vocabulary as `tokenizer.ggml.*` arrays; we rebuild the same pipeline HF uses:
  gpt2  (byte-level BPE): pre-tokenizer chosen by `tokenizer.ggml.pre`, BPE from tokens + merges,
        ByteLevel decoder.
  llama (SentencePiece BPE): "▁" for spaces, merges ranked by piece score, byte fallback for
        <0xXX> pieces; as transformers' GGUF converter does.
Control tokens (token_type 3) become special added tokens so "<|im_start|>" is one id.
"""

from __future__ import annotations

import codecs
import json
import operator
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from graphir.errors import InputError, LoadError
from graphir.gc_pause import gc_paused

from .hf_dir import read_text

# tokenizer.ggml.model values: tokenizer kinds, named after the models that introduced them
BPE_KIND, SPM_KIND = "gpt2", "llama"
# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes of the models' own tokenizer.json files (llama.cpp spells (?i:...) out by hand).
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    # use_regex=True applies GPT-2's regex: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False), _byte_level(use_regex=False)]
    )


# `tokenizer.ggml.pre` -> pre-tokenizer factory (factories: a PreTokenizer can't be shared safely across Tokenizers).
BPE_PRE_TOKENIZERS = {
    "default": lambda: _byte_level(use_regex=True),
    "gpt2": lambda: _byte_level(use_regex=True),
    # SmolLM: every digit on its own, then GPT-2's regex (HF's SmolLM2 tokenizer.json does the same).
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _byte_level(use_regex=True)]
    ),
    "qwen2": lambda: _split_then_bytes(QWEN2_REGEX),
    "deepseek-r1-qwen": lambda: _split_then_bytes(QWEN2_REGEX),
    "llama-bpe": lambda: _split_then_bytes(LLAMA3_REGEX),
    "llama3": lambda: _split_then_bytes(LLAMA3_REGEX),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# str.translate table: each byte-level char -> the latin-1 char of its byte. Chars below 256 that
# are not in the alphabet map to U+0100, which latin-1 cannot encode, so they take the fallback.
_TO_LATIN1 = {ord(c): b for b, c in _bytes_to_unicode().items()}
_TO_LATIN1.update({b: 0x100 for b in range(256) if b not in _TO_LATIN1})


def _byte_level_bytes(token: str) -> bytes:
    # As tokenizers' ByteLevel decoder: map each char back to its byte; a token with any char
    # outside the alphabet (an added token such as "日本") is taken as its UTF-8 instead.
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


def id_marker(i: int) -> str:
    """The text of a model's id that its tokenizer has no token for (a padded or random vocabulary's)."""
    return f"<|id {i}|>"


class Tokenizer:
    """Text <-> token ids, plus the BOS/EOS facts and chat template generation needs."""

    def __init__(
        self,
        tk: tokenizers.Tokenizer,
        *,
        vocab_size: int,
        bos_id: int | None,
        eos_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
        byte_level: bool,
        source: str,
    ):
        self._tk = tk
        self.vocab_size = vocab_size
        # the model's vocabulary, set by load(): an embedding may have more rows than the tokenizer has ids
        # (Qwen3's HF files: 151,936 against 151,669), and ids vocab_size..n_ids-1 decode to "<|id N|>" markers,
        # as a random preset's byte tokenizer prints them, rather than failing the stream
        self.n_ids = vocab_size
        self.bos_id = bos_id
        self.eos_ids: set[int] = set(eos_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.source = source
        self._byte_level = byte_level
        self._bytes_of: dict[int, bytes] = {}

    def _token_bytes(self, i: int) -> bytes:
        """The exact bytes of id i in a byte-level vocabulary, which let streaming decode byte by byte; worked out
        when an id is first streamed (the whole table of 49k ids took 0.04-0.06 s before a new process's first
        token's text)."""
        b = self._bytes_of.get(i)
        if b is None:
            b = self._bytes_of[i] = _byte_level_bytes(self._tk.id_to_token(i) or "")
        return b

    # ---- construction ----

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], source: str = "GGUF metadata") -> Tokenizer:
        """Build from a GGUF file's metadata (GGUFFile(path).metadata)."""
        kind = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise LoadError(f"{source}: tokenizer.ggml.tokens is missing or not a list of strings")
        # an array (0.2 ms to find the few control ids; a list of numpy scalars compared one by one took 12-19 ms)
        types = np.asarray(metadata.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens)))
        if types.ndim != 1 or len(types) != len(tokens):
            raise LoadError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        if kind not in (BPE_KIND, SPM_KIND):
            raise LoadError(f"{source}: tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")
        with gc_paused():  # ~150k short-lived and long-lived containers, no garbage cycles (gc_pause.py)
            if kind == BPE_KIND:
                tk = _gguf_bpe(metadata, tokens, source)
            else:
                tokens, file_order = _spm_spelling(tokens)
                tk = _gguf_spm(metadata, tokens, types, source, file_order)
        # Control tokens are matched in text and are special; user-defined ones are matched but not special.
        control, user = ([tokens[i] for i in np.flatnonzero(types == k)] for k in (TOKEN_CONTROL, TOKEN_USER_DEFINED))
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        # (whitespace runs, spelled "▁▁" like the vocabulary, match the normalized text, where spaces are "▁")
        tk.add_tokens([AddedToken(t, special=False, normalized=not t.strip("▁")) for t in user])
        bos = _token_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens), source)
        eos = [_token_id(metadata, f"tokenizer.ggml.{k}_token_id", len(tokens), source) for k in ("eos", "eot", "eom")]
        add_bos = _flag(metadata, "tokenizer.ggml.add_bos_token", kind == SPM_KIND, source)
        template = metadata.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise LoadError(f"{source}: tokenizer.chat_template must be a string, got {template!r}")
        return cls(
            tk,
            vocab_size=len(tokens),
            bos_id=bos,
            eos_ids=[e for e in eos if e is not None],
            add_bos=add_bos,
            chat_template=template if isinstance(template, str) else None,
            byte_level=kind == BPE_KIND,
            source=source,
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load an HF tokenizer.json; tokenizer_config.json, generation_config.json, config.json and
        chat_template.jinja beside it supply BOS/EOS, add_bos and the chat template when present."""
        path = Path(path)
        if not path.is_file():
            raise LoadError(f"{path}: file not found")
        try:
            tk = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception for bad JSON and bad models
            raise LoadError(f"{path}: not a valid tokenizer.json: {e}") from None
        tcfg, gcfg, mcfg = (
            _optional_json(path.parent / name)
            for name in ("tokenizer_config.json", "generation_config.json", "config.json")
        )

        def tok_id(v: Any) -> int | None:
            content = v.get("content") if isinstance(v, dict) else v
            return tk.token_to_id(content) if isinstance(content, str) else None

        bos = tok_id(tcfg.get("bos_token"))
        if bos is None:
            bos = _int_or_none(mcfg.get("bos_token_id"))
        eos = {tok_id(tcfg.get("eos_token"))}
        for cfg in (gcfg, mcfg):  # generation_config's list is what generate() stops on
            v = cfg.get("eos_token_id")
            eos.update(v if isinstance(v, list) else [v])
        eos_ids = [e for e in eos if isinstance(e, int) and not isinstance(e, bool)]
        add_bos = tcfg.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):  # "yes" was ignored without a word
            raise LoadError(f"{path.parent / 'tokenizer_config.json'}: add_bos_token must be true or false, "
                            f"got {add_bos!r}")
        if add_bos is None:  # does the post-processor put BOS first?
            ids = tk.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and len(ids) > 1 and ids[0] == bos
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates, as transformers writes several: it renders "default"
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if template is not None and not isinstance(template, str):  # 7 read as no template at all
            raise LoadError(f"{path.parent / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                            f"{{name, template}} objects, got {template!r}")
        jinja = path.parent / "chat_template.jinja"
        if jinja.is_file():
            template = read_text(jinja)
        decoder = json.loads(tk.to_str()).get("decoder") or {}
        byte_level = decoder.get("type") == "ByteLevel"
        return cls(
            tk,
            vocab_size=tk.get_vocab_size(with_added_tokens=True),
            bos_id=bos,
            eos_ids=eos_ids,
            add_bos=add_bos,
            chat_template=template if isinstance(template, str) else None,
            byte_level=byte_level,
            source=str(path),
        )

    # ---- use ----

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token text such as "<|im_start|>" maps to its single id.
        BOS is prepended when `add_bos`, or by default when the model's files ask for it."""
        check_text(text, self.source)
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise InputError(f"{self.source}: BOS requested but the tokenizer has no BOS token")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens included, so encode(decode(ids)) round-trips (ids past the tokenizer's
        own print as markers, see n_ids)."""
        ids = int_ids(ids, self.source)
        self._check_ids(ids)
        pieces, run = [], []
        for i in ids:
            if i < self.vocab_size:
                run.append(i)
                continue
            pieces += [self._tk.decode(run, skip_special_tokens=False), id_marker(i)]
            run = []
        return "".join(pieces) + self._tk.decode(run, skip_special_tokens=False)

    def token(self, i: int) -> str:
        """The vocabulary string of one id (byte-level or ▁-encoded, as stored)."""
        self._check_ids([i])
        return (self._tk.id_to_token(i) or "") if i < self.vocab_size else id_marker(i)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)

    def _check_ids(self, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.n_ids]
        if bad:
            raise InputError(f"{self.source}: token id {bad[0]} out of range [0, {self.n_ids})")

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab={self.vocab_size}, bos={self.bos_id}, eos={sorted(self.eos_ids)})"


def check_text(text: str, source: str) -> None:
    """`text` is UTF-8 encodable: a byte the terminal could not decode reaches argv as a lone surrogate
    ('\udcff'), which the tokenizers library refused as 'TextInputSequence must be str'."""
    if not isinstance(text, str):  # None or bytes: "'bytes' object has no attribute 'encode'"
        raise InputError(f"{source}: text must be a str, got {type(text).__name__} {text!r:.60}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{source}: text is not valid UTF-8: {text[e.start]!r} at index {e.start} (a byte that "
                         f"was not decoded as UTF-8)") from None


def int_ids(ids: Iterable[int], source: str) -> list[int]:
    """`ids` as ints: a string or a float was int()'s ValueError, or decoded 1.5 as id 1."""
    try:
        return [operator.index(i) for i in ids]
    except TypeError:
        raise InputError(f"{source}: token ids must be integers, got {ids!r:.60}") from None


class TextStream:
    """Base of streaming decoders: `push(id) -> str` and `flush() -> str`; calling one on a list of
    ids yields the non-empty pieces, then the flushed rest."""

    def push(self, token_id: int) -> str:
        raise NotImplementedError

    def flush(self) -> str:
        raise NotImplementedError

    def __call__(self, ids: Iterable[int]) -> Iterator[str]:
        for i in ids:
            if piece := self.push(i):
                yield piece
        if piece := self.flush():
            yield piece


class StreamDecoder(TextStream):
    """Turns ids arriving one at a time into text pieces whose concatenation is decode(all ids).

    A piece is only emitted once its UTF-8 is complete: an emoji split over tokens comes out whole.
    Byte-level vocabularies are decoded byte-exactly with an incremental UTF-8 decoder; others by
    re-decoding a small window and holding back text that ends in U+FFFD (an unfinished character).
    """

    MAX_HOLD = 8  # tokens held back at most before a U+FFFD is taken as real

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = 0  # window start: text of ids[_prefix:_read] was already emitted
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one id; return the text that became final ("" while a character is incomplete)."""
        self.tok._check_ids([token_id])
        if self.tok._byte_level:
            if token_id >= self.tok.vocab_size:  # a marker ends any unfinished character, as decode() has it
                return self._utf8.decode(b"", final=True) + id_marker(token_id)
            return self._utf8.decode(self.tok._token_bytes(token_id))
        self._ids.append(token_id)
        done = self.tok.decode(self._ids[self._prefix : self._read])
        text = self.tok.decode(self._ids[self._prefix :])
        held = len(self._ids) - self._read
        if len(text) > len(done) and (not text.endswith("\ufffd") or held >= self.MAX_HOLD):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(done) :]
        return ""

    def flush(self) -> str:
        """The text still held back at the end of the stream (incomplete bytes become U+FFFD)."""
        if self.tok._byte_level:
            return self._utf8.decode(b"", final=True)
        done = self.tok.decode(self._ids[self._prefix : self._read])
        text = self.tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(done) :]


# ---- GGUF vocabularies ----


def _gguf_bpe(metadata: dict[str, Any], tokens: list[str], source: str) -> tokenizers.Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in BPE_PRE_TOKENIZERS:
        raise LoadError(
            f"{source}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(BPE_PRE_TOKENIZERS)})"
        )
    raw_merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(raw_merges, list):
        raise LoadError(f"{source}: a gpt2 tokenizer needs tokenizer.ggml.merges")
    merges = []
    for i, m in enumerate(raw_merges):
        pair = m.split(" ") if isinstance(m, str) else ()
        if len(pair) != 2:
            raise LoadError(f"{source}: tokenizer.ggml.merges[{i}] = {m!r} is not two tokens separated by a space")
        merges.append((pair[0], pair[1]))
    vocab = {t: i for i, t in enumerate(tokens)}  # the last id wins for a duplicate string, as in llama.cpp
    try:
        tk = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    except Exception as e:
        raise LoadError(f"{source}: cannot build the BPE model: {e}") from None
    tk.pre_tokenizer = BPE_PRE_TOKENIZERS[pre]()
    tk.decoder = decoders.ByteLevel()
    return tk


def _spm_spelling(tokens: list[str]) -> tuple[list[str], bool]:
    """(tokens with whitespace-only pieces spelled in "▁", whether merges follow the file order).
    Gemma's vocabularies spell those pieces with real spaces (no other SentencePiece vocabulary holds
    a raw space), and their scores do not follow the merge order, the file order does (as
    transformers' gemma_tokenizer handles them)."""
    if not any(" " in t and not t.strip() for t in tokens):
        return tokens, False
    return ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens], True


def _flag(metadata: dict[str, Any], key: str, default: bool, source: str) -> bool:
    """A GGUF bool; bool() of an array raised numpy's 'truth value ... is ambiguous'."""
    v = metadata.get(key, default)
    if not isinstance(v, (bool, np.bool_)):
        raise LoadError(f"{source}: {key} must be true or false, got {v!r}")
    return bool(v)


def _gguf_spm(metadata: dict[str, Any], tokens: list[str], types: np.ndarray, source: str,
              file_order: bool) -> tokenizers.Tokenizer:
    scores = metadata.get("tokenizer.ggml.scores", [])
    numbers = isinstance(scores, np.ndarray) and scores.dtype.kind in "fiu"  # strings were float()'s ValueError
    if not numbers or len(scores) != len(tokens):
        raise LoadError(f"{source}: a llama tokenizer needs one tokenizer.ggml.scores number per token")
    if file_order:
        scores = [-i for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    # Every split of a piece into two known pieces is a merge, ranked by the merged piece's score,
    # then longer left and right halves first (transformers' generate_merges; stable sorts).
    merges = []
    for piece, score in zip(tokens, scores, strict=True):
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend(((-float(score), -len(lr[0]), -len(lr[1])), lr) for lr in local)
    merges.sort(key=lambda sm: sm[0])
    unk = _token_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens), source)
    bpe = models.BPE(
        vocab,
        [lr for _, lr in merges],
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tk = tokenizers.Tokenizer(bpe)
    prefix = _flag(metadata, "tokenizer.ggml.add_space_prefix", True, source)
    tk.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")]
    )
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return tk


def _token_id(metadata: dict[str, Any], key: str, n: int, source: str) -> int | None:
    v = metadata.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < n:
        raise LoadError(f"{source}: {key} = {v!r} is not a token id in [0, {n})")
    return v


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    text = read_text(path)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise LoadError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise LoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
