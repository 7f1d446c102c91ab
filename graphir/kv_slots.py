"""Host side of KV slots: a model built with kv_slots=N (models/llama.py) keeps its KV cache in a pool of
N slots, and every call is fed a slot map, the pool slot of each of the sequence's positions.

    config = dataclasses.replace(model.config, kv_slots=N)   # graphs take the Input slot_map [ctx]
    inputs = slot_inputs(inputs, slot_map, N)               # kv_idx (positions) -> the slots they write

graphir.load(spec, kv_slots=N) gives a Model that does this itself: it owns a SlotPool (a free list; each
position of its sequence holds a slot) and feeds the slot map on every call, prefill, decode and verify.

The slots need not follow the positions (a paged or shared pool hands them out in any order); the
graph gathers the sequence's rows through the map, so shuffled slots give the logits contiguous
ones do. The map is checked before a call, so a bad one fails without touching the cache.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from graphir.errors import InputError
from graphir.models.family import SLOT_MAP


def check_slot_map(slot_map: np.ndarray, pool: int, positions: np.ndarray) -> None:
    """Every entry is a slot of the pool (the graph gathers them all), and the `positions` a call reads or
    writes have slots of their own (two sharing one would read each other's rows)."""
    slot_map = np.asarray(slot_map)
    bad = np.flatnonzero((slot_map < 0) | (slot_map >= pool))
    if bad.size:
        j = int(bad[0])
        raise InputError(f"slot map: position {j} holds slot {int(slot_map[j])}, outside the pool of {pool} slots "
                         f"(0..{pool - 1})")
    positions = np.unique(np.asarray(positions))
    slots = slot_map[positions]
    order = np.argsort(slots, kind="stable")
    same = np.flatnonzero(slots[order][1:] == slots[order][:-1])
    if same.size:
        a, b = positions[order[same[0]]], positions[order[same[0] + 1]]
        raise InputError(f"slot map: positions {int(a)} and {int(b)} share slot {int(slots[order[same[0]]])}; each "
                         f"position a call reads or writes needs a slot of its own")


def slot_inputs(inputs: Mapping[str, np.ndarray], slot_map: np.ndarray, pool: int) -> dict[str, np.ndarray]:
    """The Inputs of a call on a slot-pool graph: `inputs` as for a contiguous cache (kv_idx holding positions)
    with kv_idx turned into the slots of those positions and the slot map added; checked first."""
    slot_map = np.asarray(slot_map, np.int32)
    used = int(inputs["kv_len"][0])
    check_slot_map(slot_map, pool, np.concatenate([np.arange(used), np.asarray(inputs["kv_idx"])]))
    return mapped_inputs(inputs, slot_map)


def mapped_inputs(inputs: Mapping[str, np.ndarray], slot_map: np.ndarray) -> dict[str, np.ndarray]:
    """slot_inputs without its check, for a slot map that is right by construction (a SlotPool's: every
    slot it hands out comes off its free list once): the per-token path skips a sort over the context."""
    return {**inputs, "kv_idx": slot_map[np.asarray(inputs["kv_idx"])], SLOT_MAP: slot_map}


class SlotPool:
    """The slots one sequence's KV rows live in, for a Model loaded with kv_slots=N: a free list of the pool's
    slots and the slot map [ctx] fed to every call. Positions 0..held-1 hold slots of their own; the rest
    point at slot 0, which the graph gathers but the KV length masks. Rewinding the sequence (a reset, the
    rejected drafts of a verify call, a call's padding rows) gives the slots past it back to the free list,
    first in line for the next call."""

    def __init__(self, n_slots: int, ctx: int):
        self.n_slots = n_slots
        self.free: list[int] = list(range(n_slots))  # handed out from the front
        self.slot_map = np.zeros(ctx, np.int32)
        self.held = 0

    def hold(self, n: int) -> None:
        """Give positions held..n-1 slots from the free list; an InputError, changing nothing, when too few
        are free."""
        need = n - self.held
        if need > len(self.free):
            raise InputError(f"KV slot pool exhausted: positions {self.held}..{n - 1} need {need} slots, "
                             f"{len(self.free)} of the pool's {self.n_slots} are free (load(..., kv_slots=N) "
                             f"to raise it)")
        if need > 0:
            self.slot_map[self.held:n] = self.free[:need]
            del self.free[:need]
            self.held = n

    def release(self, n: int) -> None:
        """Positions n.. give their slots back (put first in the free list, so the next call reuses them)."""
        if n < self.held:
            self.free[:0] = self.slot_map[n:self.held].tolist()
            self.slot_map[n:self.held] = 0
            self.held = n

    def shuffle_free(self, rng: np.random.Generator) -> None:
        """Permute the free list (tests: slots handed out in no particular order must not change a result)."""
        self.free = [self.free[i] for i in rng.permutation(len(self.free))]
