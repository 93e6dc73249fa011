"""Rules over a tensor-parallel rank's collectives: the all-reduce that makes a partial sum whole, fused with
the residual add and the next norm that read it (one launch where the lane's collective can run an epilogue).
"""

from __future__ import annotations

from fuselane.fuse.patterns import next_reader, op_at
from fuselane.fuse.rewriter import Rewriter
from fuselane.fuse.rule import Rule
from fuselane.graph.classes import ClassId as C
from fuselane.parallel.ops import AllReduce


def allreduce_norm(r: Rewriter, i: int) -> None:
    if op_at(r, i, AllReduce) is None:
        return
    j = next_reader(r, i, C.ADD_NORM, operand=None, rule="allreduce_norm")
    if j is not None:
        r.try_fuse("allreduce_norm", C.ALLREDUCE_NORM, [i, j], j)


PARALLEL_RULES = [
    # s = allreduce(p); AddNorm(x, s) -> AllreduceNorm: the sum, the residual add and the next norm in one op
    Rule("allreduce_norm", (C.ALLREDUCE_NORM,), allreduce_norm),
]
