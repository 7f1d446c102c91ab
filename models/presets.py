"""Random-weight presets: real model shapes with seeded random weights, no download.

`random:<preset>` models are for shapes, speed and plumbing, never for text quality. They
use a byte-level tokenizer (ids 0-255 are bytes, then BOS and EOS), so any vocabulary of
258 or more works. Each family lists its presets; weights come from models.random_init.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Any

from graphir.errors import InputError
from graphir.weights import Weights

from .registry import PRESETS, family_of
from .tokenizer import TextStream, check_text, id_marker, int_ids

__all__ = ["PRESETS", "ByteTokenizer", "random_weights"]


def random_weights(config: Any, dtype: str = "f32", seed: int = 0) -> Weights:
    """Seeded random weights for every Param of `config` (its family's law), stored as `dtype`
    (f32, f16 or bf16)."""
    return family_of(config).random_weights(config, dtype, seed)


class ByteTokenizer:
    """Bytes as ids 0-255, then <|bos|> = 256 and <|eos|> = 257; the interface of models.tokenizer.Tokenizer.

    A random preset's vocabulary is larger (272 to 262,144 ids) and a random model generates any of them, so ids
    258..n_ids-1 decode to a visible "<|id N|>" (as a real vocabulary's reserved tokens print) rather than failing
    the stream at its first such token; only ids outside [0, n_ids) are an error."""

    BOS, EOS = 256, 257
    SPECIAL = {BOS: "<|bos|>", EOS: "<|eos|>"}

    def __init__(self, n_ids: int = 258) -> None:
        self.vocab_size = 258
        self.n_ids = max(int(n_ids), self.vocab_size)
        self.bos_id = self.BOS
        self.eos_ids: set[int] = {self.EOS}
        self.add_bos = False
        self.chat_template: str | None = None
        self.source = "byte tokenizer"

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        check_text(text, "byte tokenizer")
        return ([self.BOS] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.stream()(int_ids(ids, "byte tokenizer")))

    def token(self, i: int) -> str:
        if 0 <= i < 256:
            return bytes([i]).decode("latin-1")
        return self.SPECIAL.get(i) or self._marker(i)

    def stream(self) -> ByteStreamDecoder:
        return ByteStreamDecoder(self)

    def _marker(self, i: int) -> str:
        if not self.vocab_size <= i < self.n_ids:
            raise InputError(f"byte tokenizer: token id {i} out of range [0, {self.n_ids})")
        return id_marker(i)


class ByteStreamDecoder(TextStream):
    """Takes ids one at a time; returns text as soon as its UTF-8 sequence is complete."""

    def __init__(self, tokenizer: ByteTokenizer | None = None) -> None:
        self.tok = tokenizer or ByteTokenizer()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return self._utf8.decode(bytes([token_id]))
        return self._utf8.decode(b"", final=True) + self.tok.token(token_id)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
