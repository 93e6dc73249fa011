"""The binders of the rotations (`launch.BINDERS`): a bare rotation, a query's or key's with its norm and its
cache append (QkNormRope, QkNormRopeKvAppend, RopeKvAppend) and a layer's query and key in one launch
(RopeQkOneLaunch), each one `triton/rope.py` launch; `side` is also what the int8 QKV GEMV that turns the heads
in its epilogue reads of each rotation (`product_launch`). DeepSeek's pairs turn by their table
(`mla_launch`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fuselane.fuse.views import leaves
from fuselane.graph.ir import Op
from fuselane.graph.ops import Elementwise, RmsNorm, Rope, Yarn
from fuselane.lanes.cuda.run import mla_launch
from fuselane.lanes.cuda.run.mismatch import PlanMismatch


def _kernels():
    """The rope kernels, imported on first bind: the lane loads torch and Triton only when used."""
    from fuselane.lanes.cuda.triton import rope

    return rope


def positions(b: Any) -> tuple[Any, bool]:
    """What a rotation reads its positions from: the step's position (row i at pos + i), or a batch's own
    position a row."""
    return (b.paged.positions, True) if b.paged is not None else (b.bufs["pos"], False)


def rope(op: Op, b: Any):
    rope = _kernels()
    spec: Rope = op.sym  # type: ignore[assignment]
    if mla_launch.takes_rope(spec):  # DeepSeek's pairs: the table rotation
        return mla_launch.rope(op, b)
    x, out = heads_of(b.bufs[op.ins[0]], spec), b.bufs[op.out]
    pos, per_row = positions(b)
    args = dict(heads=spec.heads, hd=spec.hd, base=spec.base, rot=spec.rot, per_row=per_row, yarn=spec.yarn)
    return [lambda: rope.qk_norm_rope(x, out, pos, **args)]


def heads_of(x: Any, spec: Rope) -> Any:
    """A rotation's input as the rope kernels take it: a slice's view of heads apart as rows x heads x hd."""
    return x if x.is_contiguous() else x.view(spec.rows, spec.heads, spec.hd)


@dataclass(frozen=True, slots=True)
class Side:
    """One rotation as the rope kernels take it: input, output (a buffer, or the cache at the position), its
    shape, and the per-head norm it may take first."""

    x: Any
    out: Any
    heads: int
    hd: int
    base: float
    norm_w: Any
    eps: float
    pitch: int | None
    rot: int
    yarn: Yarn | None


def side(op: Op, b: Any) -> Side:
    found = leaves(op)
    r_op = next(p for p in found if isinstance(p.sym, Rope))
    spec: Rope = r_op.sym  # type: ignore[assignment]
    if mla_launch.takes_rope(spec):  # the fused rotations turn NEOX pairs
        raise PlanMismatch(f"{op.out}: a fused rotation of DeepSeek's pairs has no launch")
    n_op = next((p for p in found if isinstance(p.sym, RmsNorm)), None)
    w_op = next((p for p in found if isinstance(p.sym, Elementwise)), None)
    appended = op.dst.row is not None
    return Side(
        x=heads_of(b.bufs[(n_op or r_op).ins[0]], spec),
        out=b.bufs[op.dst.buf] if appended else b.bufs[r_op.out],
        heads=spec.heads,
        hd=spec.hd,
        base=spec.base,
        norm_w=b.vec[w_op.ins[1]] if w_op is not None else None,
        eps=n_op.sym.eps if n_op is not None else 0.0,  # type: ignore[union-attr]
        pitch=op.dst.row.pitch if appended else None,  # type: ignore[union-attr]
        rot=spec.rot,
        yarn=spec.yarn,
    )


def rope_class(op: Op, b: Any):
    rope = _kernels()
    s, (pos, per_row) = side(op, b), positions(b)
    args = dict(heads=s.heads, hd=s.hd, base=s.base, norm_w=s.norm_w, eps=s.eps, cache_row_pitch=s.pitch, rot=s.rot)
    args |= dict(per_row=per_row, yarn=s.yarn)
    return [lambda: rope.qk_norm_rope(s.x, s.out, pos, **args)]


def rope_qk(op: Op, b: Any):
    """A layer's query and key rotations in one launch (the key appended to its cache where it is)."""
    rope = _kernels()
    q_op, k_op = op.sym.parts  # type: ignore[union-attr]
    if side(q_op, b).pitch is not None:
        q_op, k_op = k_op, q_op
    q, k, (pos, per_row) = side(q_op, b), side(k_op, b), positions(b)
    args = dict(
        per_row=per_row,
        heads=q.heads,
        kv_heads=k.heads,
        hd=q.hd,
        base=q.base,
        q_norm_w=q.norm_w,
        k_norm_w=k.norm_w,
        eps=q.eps,
        k_cache_row_pitch=k.pitch,
        rot=q.rot,
        yarn=q.yarn,
    )
    return [lambda: rope.rope_q_k(q.x, k.x, q.out, k.out, pos, **args)]
