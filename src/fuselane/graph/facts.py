"""What an op reads and writes: the facts every legality check (moving, merging ops) is built from."""

from __future__ import annotations

from fuselane.graph.ir import Op


def reads(op: Op) -> tuple[str, ...]:
    """Tensors the op reads."""
    return op.ins


def writes(op: Op) -> tuple[str, ...]:
    """Tensors the op writes: its destination buffer (a whole buffer, rows of a table, or unit parts)."""
    return (op.dst.buf,)


def producers(ops: list[Op], name: str) -> list[int]:
    """Indices of the ops that write `name`."""
    return [i for i, op in enumerate(ops) if name in writes(op)]


def readers(ops: list[Op], name: str) -> list[int]:
    """Indices of the ops that read `name`."""
    return [i for i, op in enumerate(ops) if name in reads(op)]
