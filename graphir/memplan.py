"""Buffer planning by liveness, shared by every compiling backend (cpu now, cuda next).

Each value a node produces lives in one *storage*:
  - params, states and inputs have storage of their own, outside the arena;
  - views (reshape, view, permute, transpose) and `item` alias their source's storage;
  - in-place writes (set_rows, assign, and fused writes) alias the State they write;
  - every other op gets a fresh arena slot.
A slot is live from the step that defines it to the last step that reads it or any alias
of it. Slots are placed first-fit in one arena, so a decode step allocates nothing and a
GPU backend can capture the whole step with fixed addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphir.dtypes import numpy_dtype
from graphir.ir import Graph, Node
from graphir.ops import OPS

ALIGN = 64  # bytes: one cache line on CPU; 16-byte vector loads on GPU need less


@dataclass(frozen=True)
class Slot:
    offset: int
    nbytes: int
    first: int  # step index that writes it
    last: int  # last step index that reads it (or an alias of it)


@dataclass
class MemPlan:
    # (id(node), result index) -> Slot, for arena-backed values
    slots: dict[tuple[int, int], Slot]
    # id(node) -> (id(base node), result index) of the storage it aliases
    alias: dict[int, tuple[int, int]]
    arena_bytes: int
    naive_bytes: int  # what one buffer per value would take, for the report


def storage_of(n: Node, alias: dict[int, tuple[int, int]]) -> tuple[int, int]:
    return alias.get(id(n), (id(n), 0))


def result_types(n: Node) -> list[tuple[tuple[int, ...], str]]:
    return list(n.types) if n.types is not None else [(n.shape, n.dtype)]


def plan_memory(graph: Graph, copies: set[int] = frozenset()) -> MemPlan:
    """Plan arena slots. `copies`: ids of view nodes the backend materializes (no alias)."""
    order = graph.nodes()
    step = {id(n): i for i, n in enumerate(order)}
    alias: dict[int, tuple[int, int]] = {}
    for n in order:
        d = OPS[n.op]
        if n.op == "item":
            alias[id(n)] = (id(n.src[0]), n.params["index"])
        elif (d.view and id(n) not in copies) or d.writes:
            alias[id(n)] = storage_of(n.src[0], alias)
    external = {id(n) for n in order if n.is_leaf}
    last: dict[tuple[int, int], int] = {}
    for n in order:
        for s in n.src:
            key = storage_of(s, alias)
            last[key] = max(last.get(key, -1), step[id(n)])
    end = len(order)
    for out in graph.outputs.values():  # outputs stay live until they are copied out
        last[storage_of(out, alias)] = end
    slots: dict[tuple[int, int], Slot] = {}
    live: list[Slot] = []
    naive = 0
    for n in order:
        if id(n) in alias or id(n) in external:
            continue
        i = step[id(n)]
        live = [s for s in live if s.last >= i]
        for k, (shape, dt) in enumerate(result_types(n)):
            nbytes = _nbytes(shape, dt)
            naive += nbytes
            slot = _place(live, nbytes, i, last.get((id(n), k), i))
            slots[(id(n), k)] = slot
            live.append(slot)
    arena = max((s.offset + s.nbytes for s in slots.values()), default=0)
    return MemPlan(slots, alias, arena, naive)


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = numpy_dtype(dtype).itemsize
    for s in shape:
        n *= s
    return max(n, 1)


def _place(live: list[Slot], nbytes: int, first: int, last: int) -> Slot:
    """Lowest aligned offset whose range overlaps no live slot."""
    offset = 0
    for s in sorted(live, key=lambda s: s.offset):
        if offset + nbytes <= s.offset:
            break
        offset = max(offset, -(-(s.offset + s.nbytes) // ALIGN) * ALIGN)
    return Slot(offset, nbytes, first, last)
