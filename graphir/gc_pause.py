"""Python's cyclic garbage collector paused over blocks that allocate many long-lived objects and no garbage.

Importing numba and the cpu backend's kernels, and reading a GGUF vocabulary into a tokenizer, allocate a few
hundred thousand objects that live as long as the process. Each allocation burst triggers young collections,
whose survivors pile up until a full collection traverses every object in the process: on the 2-core machine
two full collections and ~25 middle ones before a second `graphir run`'s first token, 0.10-0.12 s of its ~1 s.
In `gc_paused()` nothing is collected; at its end what the block allocated goes untraversed into the oldest
generation (gc.freeze() then gc.unfreeze(): freezing empties the younger generations and zeroes the count that
starts the next collection), where later full collections see it as they see any other object. Nothing stays
frozen, so a cycle that dies later is collected as before; a garbage cycle made inside the block waits for the
next full collection.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collections in the block; what it allocated joins the oldest generation, untraversed. Where the
    collector is off already, nothing changes; where the caller froze objects (gc.freeze), they stay frozen and
    the block's objects stay in the younger generations."""
    if not gc.isenabled():
        yield
        return
    own_freeze = gc.get_freeze_count() == 0
    gc.disable()
    try:
        yield
    finally:
        if own_freeze:
            gc.freeze()
            gc.unfreeze()
        gc.enable()
