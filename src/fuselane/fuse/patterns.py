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


def _takes(r: Rewriter, j: int, name: str, kinds: tuple[type | ClassId, ...], operand: int | None) -> bool:
    """Whether the op at slot j is one of `kinds` reading `name` as `operand` (None: any)."""
    if op_at(r, j, *kinds) is None:
        return False
    ins = r.s.get(j).ins
    return operand is None or (len(ins) > operand and ins[operand] == name)


def next_reader(
    r: Rewriter, i: int, *kinds: type | ClassId, operand: int | None = 0, rule: str | None = None
) -> int | None:
    """The sole reader of op i's output, if it is one of `kinds` and reads it as `operand` (None: any).

    Where one of several readers would have been taken, `rule` (when given) records why not, for `explain`."""
    name = r.s.get(i).out
    j = r.sole_reader(name)
    if j is None:
        if rule is not None:
            r.no_match(rule, i, lambda: _shared(r, i, name, kinds, operand))
        return None
    # a reader before op i reads an older value of the name, not op i's result
    return j if j > i and _takes(r, j, name, kinds, operand) else None


def _shared(r: Rewriter, i: int, name: str, kinds: tuple[type | ClassId, ...], operand: int | None) -> str | None:
    """Why a reader of op i's `name` of the wanted kind was not taken: the other readers, or None if none is."""
    takers = [j for j in r.s.readers(name) if j > i and _takes(r, j, name, kinds, operand)]
    return r.other_readers(name, takers[0]) if takers else None
