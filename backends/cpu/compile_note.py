"""One line on stderr when numba starts compiling this backend's kernels: a cold on-disk cache, which
is the first run after an install (later processes load the machine code from the cache).

numba fires its "numba:compile" event only on a real compile, never on a cache load, so the note
appears exactly when a user would otherwise wait in silence.
"""

from __future__ import annotations

import sys

from numba.core import event

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
            self.shown = True
            print(NOTE, file=sys.stderr, flush=True)

    def on_end(self, ev: event.Event) -> None:
        pass


event.register("numba:compile", _FirstCompileNote())
