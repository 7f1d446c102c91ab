"""One line on stderr when numba starts compiling this backend's kernels: a cold on-disk cache, which
is the first run after an install (later processes load the machine code from the cache).

The note comes at import when the cache holds no entry for any of the backend's kernels (an install's
first run), so it precedes anything a command prints while the model runs; otherwise at numba's first "numba:compile"
event for this package (a stale entry), which numba fires only on a real compile, never on a cache load.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from numba.core import event
from numba.core.dispatcher import Dispatcher

NOTE = "graphir: compiling CPU kernels, first run only (kept in numba's cache for later runs)"
_PACKAGE = __name__.rpartition(".")[0] + "."


class _FirstCompileNote(event.Listener):
    def __init__(self) -> None:
        self.shown = False

    def on_start(self, ev: event.Event) -> None:
        if self.shown:
            return
        dispatcher = (ev.data or {}).get("dispatcher")
        module = getattr(getattr(dispatcher, "py_func", None), "__module__", None) or ""
        if module.startswith(_PACKAGE):
            self.show()

    def on_end(self, ev: event.Event) -> None:
        pass

    def show(self) -> None:
        self.shown = True
        print(NOTE, file=sys.stderr, flush=True)


_LISTENER = _FirstCompileNote()
event.register("numba:compile", _LISTENER)


def note_if_cold(modules: list[Any]) -> bool:
    """Print the note now if numba's cache has no index file for any kernel of `modules` (a cold cache); whether
    it is cold."""
    indexes = [getattr(getattr(getattr(d, "_cache", None), "_cache_file", None), "_index_path", None)
               for m in modules for d in vars(m).values() if isinstance(d, Dispatcher)]
    indexes = [i for i in indexes if i is not None]
    cold = bool(indexes) and not any(os.path.exists(i) for i in indexes)
    if cold and not _LISTENER.shown:
        _LISTENER.show()
    return cold
