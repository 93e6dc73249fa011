"""`fuselane explain --tp N`: each rank's plan (its graph at its slice's widths, fused for the lane) and the
collectives in it, so what a split model would launch on each device can be read before any device runs it.

On `--lane cpu` the plans are the rank executor's (`executor.RankShim`, which the CPU process check runs);
on `--lane cuda` they are the cuda lane's, whose shim says why it cannot run them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fuselane.explain import (
    context_of,
    make_shim,
    model_source,
    op_name,
    rows_of,
    to_json,
)
from fuselane.explain import render as render_one
from fuselane.fuse.optimizer import optimize
from fuselane.graph.ir import Form, Fused, Op
from fuselane.models import recognizer
from fuselane.parallel.executor import RankShim
from fuselane.parallel.ops import COLLECTIVES
from fuselane.parallel.ranks import rank_config, rank_shapes


def _collectives(op: Op) -> list[tuple[str, str]]:
    """The collective primitives an op runs (itself, or parts of a fused op), each with what it writes."""
    if isinstance(op.sym, Fused):
        return [c for part in op.sym.parts for c in _collectives(part)]
    return [(type(op.sym).__name__, op.out)] if isinstance(op.sym, COLLECTIVES) else []


def rank_plans(
    model: str,
    tp: int,
    *,
    lane: str = "cpu",
    form: str = "decode",
    rows: int | None = None,
    knobs: Sequence[str] = (),
    held: Sequence[str] = (),
    ctx: int | None = None,
) -> dict[str, Any]:
    """Every rank's plan as `explain`'s JSON at a context of `ctx` rows (`explain.context_of`), each with the
    collectives its schedule runs."""
    name, cfg, tensors = model_source(model)
    shim = RankShim(np.dtype(np.float32), tuple(held)) if lane == "cpu" else make_shim(lane, knobs, held, form)
    n = rows_of(form, rows, ctx)
    ctx = context_of(cfg, ctx, n, form)
    ranks = []
    for rank in range(tp):
        rc = rank_config(cfg, tp, rank)
        graph = recognizer(rc).recognize(rc, rank_shapes(cfg, tensors, tp, rank), Form(form), rows=n, ctx=ctx)
        plan = optimize(graph, shim, held=held, check=False)
        data = to_json(name, cfg, plan, form) | {"rank": rank}
        data["collectives"] = [
            {"step": i, "op": kind, "output": out, "in": op_name(op)}
            for i, op in enumerate(plan.ops)
            for kind, out in _collectives(op)
        ]
        ranks.append(data)
    return {"tp": tp, "ranks": ranks}


def render(data: dict[str, Any]) -> str:
    """Each rank's plan, then its collectives."""
    parts = []
    for rank in data["ranks"]:
        lines = [f"=== rank {rank['rank']} of {data['tp']} ===", render_one(rank), "", "collectives:"]
        lines += [f"  {c['step']:4d}  {c['op']:<10} -> {c['output']} (in {c['in']})" for c in rank["collectives"]]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)
