"""A table of kernels made when first looked up: a process pays only for the kernels its model calls."""

from __future__ import annotations

import threading
from typing import Any


class LazyTable(dict):
    """key -> kernel, filled by `make(key)` (a dict of entries: the key's, and any made with it) the first time a key
    in the table's range (`valid(key)`) is looked up; a key outside it raises KeyError. Lookups of a kernel not yet
    made hold one lock, so two threads never make it twice."""

    def __init__(self, valid, make):
        super().__init__()
        self._valid, self._make, self._lock = valid, make, threading.Lock()

    def __missing__(self, key: Any) -> Any:
        if not self._valid(key):
            raise KeyError(key)
        with self._lock:
            if key not in self:
                self.update(self._make(key))
        return self[key]
