"""Host side of KV slots: a model built with kv_slots=N (models/llama.py) keeps its KV cache in a pool of
N slots, and every call is fed a slot map, the pool slot of each of the sequence's positions.

    config = dataclasses.replace(model.config, kv_slots=N)   # graphs take the Input slot_map [ctx]
    inputs = slot_inputs(inputs, slot_map, N)               # kv_idx (positions) -> the slots they write

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
    return {**inputs, "kv_idx": slot_map[np.asarray(inputs["kv_idx"])], SLOT_MAP: slot_map}
