"""What an op reads and writes: the facts every legality check (moving, merging ops) is built from.

A fused op reads its external inputs (its `ins`: what its parts read that no part of it writes) and writes
everything its parts write, internal values included, so a check never misses a conflict inside a fusion.
"""

from __future__ import annotations

from fuselane.graph.ir import Fused, Op


def reads(op: Op) -> tuple[str, ...]:
    """Tensors the op reads from outside itself."""
    return op.ins


def writes(op: Op) -> tuple[str, ...]:
    """Tensors the op writes: its destination, or for a fused op every part's."""
    if isinstance(op.sym, Fused):
        seen: dict[str, None] = {}
        for part in op.sym.parts:
            seen.update(dict.fromkeys(writes(part)))
        return tuple(seen)
    return (op.dst.buf,)


def producers(ops: list[Op], name: str) -> list[int]:
    """Indices of the ops that write `name`."""
    return [i for i, op in enumerate(ops) if name in writes(op)]


def readers(ops: list[Op], name: str) -> list[int]:
    """Indices of the ops that read `name`."""
    return [i for i, op in enumerate(ops) if name in reads(op)]
