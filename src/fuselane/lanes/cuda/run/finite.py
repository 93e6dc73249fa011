"""Which launch of a step made a non-finite value: the cuda lane's own account of NaN or inf logits.

When a step's logits are not finite, the lane runs the step again one launch at a time (eagerly, on the same
inputs: every launch rewrites what it wrote the first time) and checks each op's own output after it. The
first op whose output holds a NaN or an inf is named with its layer, so the error says where the lane's
numbers left the finite range instead of blaming the file; the cpu lane (the f32/f64 reference) tells
whether the file's weights would give the same.
"""

from __future__ import annotations

from typing import Any

from fuselane.errors import FuselaneError
from fuselane.explain import layer_of, op_name
from fuselane.graph.ir import Op


class NonFinite(FuselaneError):
    """A step of the cuda lane computed a NaN or an inf."""


def first_non_finite(step: Any) -> Op | None:
    """The first op of `step` (a bound `_Step`) whose own output buffer holds a non-finite value, running its
    launches one by one; None where every checked output stays finite. Outputs written into a table's rows (a
    cache) are not checked: the ops reading them are."""
    torch = step.torch
    for op, launches in step.bound:
        for launch in launches:
            launch()
        out = step.bufs.get(op.out)
        if launches and op.dst.row is None and out is not None and out.is_floating_point():
            if not bool(torch.isfinite(out).all()):
                return op
    return None


def explain_non_finite(step: Any) -> str:
    """The error a step with non-finite logits raises: the lane, the layer and the op that made the value."""
    op = first_non_finite(step)
    if op is None:
        where = "in its logits"
    else:
        layer = layer_of(op)
        where = f"{'at layer ' + str(layer) + ', ' if layer is not None else 'in '}{op_name(op)} ({op.out})"
    return (
        f"the cuda lane computed a non-finite value {where}; if `--lane cpu` gives finite logits, "
        "the cuda lane's numbers overflowed"
    )
