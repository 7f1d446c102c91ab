"""Coverage: for each pass, the sites it rewrote and the candidate sites it rejected, with why.

A fusion that silently stops firing (a model builder added a second user of an intermediate,
a weight changed dtype) shows up here as a rejected site with a reason, not as a slow run.
Passes record through `Rewriter.matched` / `Rewriter.reject`; `run_pipeline(report=...)`
points the recorder at the running pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from graphir.ir import Node


def site(n: Node) -> str:
    """How a report names a node: its name when it has one, else op and type."""
    return f"{n.op} {n.name!r}" if n.name else n.describe()


@dataclass
class PassCoverage:
    matched: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (site, reason)
    nodes_before: int = 0
    nodes_after: int = 0


@dataclass
class CoverageReport:
    passes: dict[str, PassCoverage] = field(default_factory=dict)

    def __getitem__(self, name: str) -> PassCoverage:
        return self.passes.setdefault(name, PassCoverage())

    def text(self, max_sites: int = 4) -> str:
        lines = []
        for name, pc in self.passes.items():
            lines.append(f"{name}: {len(pc.matched)} matched, {len(pc.rejected)} rejected, "
                         f"nodes {pc.nodes_before} -> {pc.nodes_after}")
            lines += [f"  + {s}" for s in pc.matched[:max_sites]]
            if len(pc.matched) > max_sites:
                lines.append(f"  + ... {len(pc.matched) - max_sites} more")
            lines += [f"  - {s}: {why}" for s, why in pc.rejected[:max_sites]]
            if len(pc.rejected) > max_sites:
                lines.append(f"  - ... {len(pc.rejected) - max_sites} more")
        return "\n".join(lines) + "\n"

    __str__ = text


_ACTIVE: ContextVar[PassCoverage | None] = ContextVar("graphir_pass_coverage", default=None)


@contextmanager
def recording(pc: PassCoverage | None) -> Iterator[None]:
    token = _ACTIVE.set(pc)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def record_match(n: Node, note: str = "") -> None:
    pc = _ACTIVE.get()
    if pc is not None:
        pc.matched.append(site(n) + (f" -> {note}" if note else ""))


def record_reject(n: Node, reason: str) -> None:
    pc = _ACTIVE.get()
    if pc is not None:
        pc.rejected.append((site(n), reason))
