"""Small questions rules ask of a schedule: which op is a given primitive or class, who alone reads a value."""

from __future__ import annotations

from fuselane.fuse.rewriter import Rewriter
from fuselane.fuse.views import class_of
from fuselane.graph.classes import ClassId
from fuselane.graph.ir import Op
from fuselane.graph.ops import Elementwise as Ew
from fuselane.graph.ops import ElementwiseOp


def op_at(r: Rewriter, i: int, *kinds: type | ClassId) -> Op | None:
    """The live op at slot i if it is one of `kinds` (primitive spec types or fused classes)."""
    op = r.s.slot(i)
    if op is None:
        return None
    for kind in kinds:
        if isinstance(kind, ClassId):
            if class_of(op) is kind:
                return op
        elif isinstance(op.sym, kind):
            return op
    return None


def is_add(op: Op, *, row: bool) -> bool:
    return isinstance(op.sym, Ew) and op.sym.op is ElementwiseOp.ADD and op.sym.row is row


def is_mul(op: Op, *, row: bool) -> bool:
    return isinstance(op.sym, Ew) and op.sym.op is ElementwiseOp.MUL and op.sym.row is row


def next_reader(r: Rewriter, i: int, *kinds: type | ClassId, operand: int | None = 0) -> int | None:
    """The sole reader of op i's output, if it is one of `kinds` and reads it as `operand` (None: any)."""
    op = r.s.get(i)
    j = r.sole_reader(op.out)
    if j is None or op_at(r, j, *kinds) is None:
        return None
    reader = r.s.get(j)
    if operand is not None and (len(reader.ins) <= operand or reader.ins[operand] != op.out):
        return None
    return j
