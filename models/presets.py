"""Random-weight presets: real model shapes with seeded random weights, no download.

`random:<preset>` models are for shapes, speed and plumbing, never for text quality. They
use a byte-level tokenizer (ids 0-255 are bytes, then BOS and EOS), so any vocabulary of
258 or more works.

Weights are deterministic in (preset, seed, tensor name). Tensors above LAZY_NUMEL elements
are cheap to make: a short random vector viewed with overlapping rows (row r starts STEP
elements after row r-1), so an 8B preset costs a few MB and a fraction of a second, not 16 GB.
A backend that needs contiguous data materializes one tensor at a time.
"""

from __future__ import annotations

import codecs
import zlib
from collections.abc import Iterable

import numpy as np
from numpy.lib.stride_tricks import as_strided

from graphir.errors import InputError
from graphir.quant import quantize
from graphir.weights import Weight, Weights

from . import qwen3, qwen35
from .llama import LlamaConfig, param_shapes
from .tokenizer import TextStream

LAZY_NUMEL = 1 << 16
STEP = 3

_QWEN3_VOCAB = 151936
PRESETS: dict[str, tuple[LlamaConfig, str]] = {
    "llama-tiny": (LlamaConfig(arch="llama", n_vocab=272, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_dim=16, d_ff=96, rope_mode="norm", context_length=256, ctx=256), "f32"),
    "qwen3-tiny": (qwen3.config(n_vocab=272, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                d_ff=96, tied_embeddings=True, context_length=256, ctx=256), "f32"),
    "qwen3-0.6b": (qwen3.config(n_vocab=_QWEN3_VOCAB, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                                head_dim=128, d_ff=3072, tied_embeddings=True, context_length=40960), "bf16"),
    "qwen3-1.7b": (qwen3.config(n_vocab=_QWEN3_VOCAB, d_model=2048, n_layers=28, n_heads=16, n_kv_heads=8,
                                head_dim=128, d_ff=6144, tied_embeddings=True, context_length=40960), "bf16"),
    "qwen3-8b": (qwen3.config(n_vocab=_QWEN3_VOCAB, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                              head_dim=128, d_ff=12288, tied_embeddings=False, context_length=40960), "bf16"),
}  # fmt: skip


PRESETS.update(qwen35.PRESETS)


def random_weights(config: LlamaConfig, dtype: str = "f32", seed: int = 0) -> Weights:
    """Seeded random weights for every Param of `config`, stored as `dtype` (f32, f16 or bf16).

    Matrices (the embedding too) have std 1/sqrt(n_in), so activations and logits keep about
    unit scale; norm weights are 1 + 0.1 * normal.
    """
    if isinstance(config, qwen35.Qwen35Config):
        return qwen35.random_weights(config, dtype, seed)
    out = Weights(source=f"random:{config.arch} seed {seed}")
    for name, shape in param_shapes(config).items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if len(shape) == 1:
            values = quantize(1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32), dtype)
        else:
            values = _matrix(rng, shape, np.float32(1.0 / np.sqrt(shape[1])), dtype)
        out.add(name, Weight(dtype, shape, values))
    return out


def _matrix(rng: np.random.Generator, shape: tuple[int, ...], scale: np.float32, dtype: str) -> np.ndarray:
    n_out, n_in = shape
    if n_out * n_in <= LAZY_NUMEL:
        return quantize(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)
    base = quantize(rng.standard_normal((n_out - 1) * STEP + n_in, dtype=np.float32) * scale, dtype)
    view = as_strided(base, shape=shape, strides=(STEP * base.itemsize, base.itemsize))  # [n_out, n_in]
    view.flags.writeable = False
    return view


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
