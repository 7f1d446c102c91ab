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
from .tokenizer import TextStream

__all__ = ["PRESETS", "ByteTokenizer", "random_weights"]


def random_weights(config: Any, dtype: str = "f32", seed: int = 0) -> Weights:
    """Seeded random weights for every Param of `config` (its family's law), stored as `dtype`
    (f32, f16 or bf16)."""
    return family_of(config).random_weights(config, dtype, seed)


class ByteTokenizer:
    """Bytes as ids 0-255, then <|bos|> = 256 and <|eos|> = 257; the interface of models.tokenizer.Tokenizer."""

    BOS, EOS = 256, 257
    SPECIAL = {BOS: "<|bos|>", EOS: "<|eos|>"}

    def __init__(self) -> None:
        self.vocab_size = 258
        self.bos_id = self.BOS
        self.eos_ids: set[int] = {self.EOS}
        self.add_bos = False
        self.chat_template: str | None = None
        self.source = "byte tokenizer"

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        return ([self.BOS] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(ByteStreamDecoder()(ids))

    def token(self, i: int) -> str:
        return self.SPECIAL.get(i) or bytes([i]).decode("latin-1")

    def stream(self) -> ByteStreamDecoder:
        return ByteStreamDecoder()


class ByteStreamDecoder(TextStream):
    """Takes ids one at a time; returns text as soon as its UTF-8 sequence is complete."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id in ByteTokenizer.SPECIAL:
            return self._utf8.decode(b"", final=True) + ByteTokenizer.SPECIAL[token_id]
        if not 0 <= token_id < 256:
            raise InputError(f"byte tokenizer: token id {token_id} out of range [0, 258)")
        return self._utf8.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
