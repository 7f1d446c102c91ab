"""Seeded random weights for `random:` presets, shared by the families (no family imports another).

Weights are deterministic in (seed, tensor name). Tensors above LAZY_NUMEL elements are cheap to
make: a short random vector viewed with overlapping rows (row r starts STEP elements after row
r-1), so an 8B preset costs a few MB and a fraction of a second, not 16 GB. A backend that needs
contiguous data materializes one tensor at a time.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping

import numpy as np
from numpy.lib.stride_tricks import as_strided

from graphir.quant import quantize
from graphir.weights import Weight, Weights

LAZY_NUMEL = 1 << 16
STEP = 3


def rng_for(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def matrix(rng: np.random.Generator, shape: tuple[int, ...], scale: np.float32, dtype: str) -> np.ndarray:
    """normal * scale as `dtype`, [n_out, n_in]; large ones as an overlapping-rows view."""
    n_out, n_in = shape
    if n_out * n_in <= LAZY_NUMEL:
        return quantize(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)
    base = quantize(rng.standard_normal((n_out - 1) * STEP + n_in, dtype=np.float32) * scale, dtype)
    view = as_strided(base, shape=shape, strides=(STEP * base.itemsize, base.itemsize))  # [n_out, n_in]
    view.flags.writeable = False
    return view


def random_weights(arch: str, shapes: Mapping[str, tuple[int, ...]], dtype: str = "f32", seed: int = 0,
                   special: Callable[[str, tuple[int, ...], np.random.Generator], np.ndarray | None] | None = None
                   ) -> Weights:
    """Matrices (the embedding too) with std 1/sqrt(n_in), so activations and logits keep about unit
    scale; 1-D weights (norms) 1 + 0.1 * normal. `special(name, shape, rng)` may return f32 values
    for a tensor that needs another law (decay gates, biases), or None."""
    out = Weights(source=f"random:{arch} seed {seed}")
    for name, shape in shapes.items():
        rng = rng_for(seed, name)
        values = special(name, shape, rng) if special else None
        if values is not None:
            values = quantize(values.astype(np.float32), dtype)
        elif len(shape) == 1:
            values = quantize(1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32), dtype)
        else:
            values = matrix(rng, shape, np.float32(1.0 / np.sqrt(shape[1])), dtype)
        out.add(name, Weight(dtype, shape, values))
    return out
