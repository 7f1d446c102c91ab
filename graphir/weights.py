"""The weight store: Param data lives here, never in the graph.

A Weight keeps its *storage* array exactly as the file had it:
  f32 -> float32, f16 -> float16, bf16 -> uint16 (raw bits), i32 -> int32,
  quantized types -> uint8 of shape [..., bytes_per_row] (ggml blocks, row-major).
`shape` is always the logical shape in numpy order (outermost first).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from graphir.errors import LoadError


@dataclass(frozen=True)
class Weight:
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class Weights(Mapping[str, Weight]):
    """A read-only name -> Weight mapping with a source label for error messages."""

    def __init__(self, items: Mapping[str, Weight] | None = None, source: str = "<memory>"):
        self._items: dict[str, Weight] = dict(items or {})
        self.source = source
        # Arrays a backend derives from these weights (dequantized copies, stacked projections),
        # built once and shared by every Program lowered against this store.
        self.derived: dict[tuple, object] = {}

    def __getitem__(self, name: str) -> Weight:
        try:
            return self._items[name]
        except KeyError:
            pass
        from graphir.tp import slice_weight  # a tensor-parallel slice `w@axis[a:b]`, derived on demand

        w = slice_weight(self, name)
        if w is None:
            raise LoadError(f"{self.source}: missing tensor {name!r}")
        return w

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def get(self, name: str, default: Weight | None = None) -> Weight | None:  # type: ignore[override]
        return self._items.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, name: str, weight: Weight) -> None:
        self._items[name] = weight

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._items.values())
