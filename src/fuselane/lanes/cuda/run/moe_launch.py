"""The binders of a mixture's classes (`launch.BINDERS`): each fused op of a mixture is one launch of the
`triton.moe` kernels. Expert ids are the int32 view of their f32 activation buffer, on the device.

- RouterTopk, MoeTokenSort: `route` (scores, top-k, weights; the chunk's order by expert);
- MoeGateUpAct (and its GluActMulQuant): `gate_up`, int8 where the plan quantized its activation and the
  int8 GEMV takes the format, writing its own int8 form where the plan asks; experts in a grid format take
  `grid.experts` (f32 activations, no folded shared expert);
- MoeDownCombine, SharedExpertFusion, MoeDeferredFinalize (and its NormQuant): `down_combine`, with the
  arrays the fused op adds in, the folded shared expert's down rows, and the next norm; the folded expert's
  gate/up SwiGLU and gate score ride the kept experts' gate/up launch (`triton/moe/shared.py`).

A chunk past the GEMV's rows (`moe_kernels.moe_grouped`) whose experts the grouped GEMM takes multiplies them on
the tensor cores instead (`grouped`): the routing launch also counts each expert's pairs (a buffer the
three launches share, by the order's name), and gate/up and down are each still one launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fuselane.errors import FuselaneError
from fuselane.fuse.views import class_of, leaves
from fuselane.gguf.formats import Format
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Op
from fuselane.graph.ops import (
    Elementwise,
    ElementwiseOp,
    ExpertChoice,
    ExpertMatmul,
    ExpertSort,
    Gating,
    Matmul,
    Moe,
    RmsNorm,
    RouteWeights,
    RowScale,
    TopK,
    Unary,
    UnaryOp,
)
from fuselane.lanes.cuda.plan import kernels, moe_kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.run.mismatch import PlanMismatch
from fuselane.lanes.cuda.run.product_launch import grid_table

# The producers a RouterTopk holds where it routes in the launch that norms its input (`route_in_norm`).
NORMS_ROUTED = (C.NORM_QUANT, C.GEMV_NORM_EPILOGUE)

# b.scratch's key of the folded shared experts by the expert ids their mixture reads (`gate_up_act`)
_RIDERS = "moe-shared-riders"
# b.scratch's key of the kept experts' gate/up format by those ids, where they read int8 (else None)
_KEPT_INT8 = "moe-kept-int8"


def _mismatch(message: str) -> Exception:
    return PlanMismatch(message)


def _ids(b, name: str) -> Any:
    """The int32 view of an expert-id (or pair-order) buffer."""
    import torch

    return b.bufs[name].view(torch.int32)


def _of(found: list[Op], kind: type) -> list[Op]:
    return [x for x in found if isinstance(x.sym, kind)]


_FORMATS_BY_ORDER = "moe-formats-by-order"  # the scratch key of `_expert_formats`' map


def _order(b, found: Op, rows: int) -> tuple[Any, str] | None:
    """A chunk's sorted pairs (int32) and the order's name, where the expert product `found` reads them and
    the chunk is the grouped GEMM's."""
    if len(found.ins) < 4 or not moe_kernels.moe_grouped(rows, _expert_formats(b, found.ins[3])):
        return None
    return _ids(b, found.ins[3]), found.ins[3]


def _expert_formats(b, order_name: str) -> set:
    """The formats of the expert matrices whose products read the sorted pairs `order_name`: the routing launch
    that sorts them and the products that read them decide the grouped GEMM alike (`moe_kernels.moe_grouped`). The
    graph is walked once a bound plan (kept in its scratch), not once a launch."""
    by_order = b.scratch.get(_FORMATS_BY_ORDER)
    if by_order is None:
        by_order = b.scratch[_FORMATS_BY_ORDER] = {}
        for p in (p for op in b.g.ops for p in leaves(op) if isinstance(p.sym, ExpertMatmul) and len(p.ins) > 3):
            if p.ins[1] in b.raw:
                by_order.setdefault(p.ins[3], set()).add(b.raw[p.ins[1]][1])
    return by_order.get(order_name, set())


def _counts(b, order_name: str, experts: int, device) -> Any:
    """The pairs each expert takes, written by the routing launch that writes `order_name`."""
    import torch

    return b.scratch.setdefault(f"moe-counts:{order_name}", torch.zeros(experts, dtype=torch.int32, device=device))


def _amax_key(x_name: str, rows: int, k: int) -> str:
    """The scratch of the row scales the routing launch of activation `x_name` writes (`route.RowScales`)."""
    return f"moe-amax:{x_name}:{rows}x{k}"


@dataclass(frozen=True, slots=True)
class _Routing:
    """A routing fused op's parts: its router product, top-k, weights, chunk sort (None in a step) and gating."""

    mm: Op
    top: Op
    rw: Op
    sort: Op | None
    choice: Op | None

    @property
    def spec(self) -> RouteWeights:
        return self.rw.sym  # type: ignore[return-value]


def _routing(op: Op) -> _Routing:
    found = leaves(op)
    mms, tops, rws, sorts = (_of(found, t) for t in (Matmul, TopK, RouteWeights, ExpertSort))
    if len(mms) != 1 or len(tops) != 1 or len(rws) != 1:
        raise _mismatch(f"{op.out}: routing launches with its router product, top-k and weights together")
    choices = _of(found, ExpertChoice)  # DeepSeek's gating: the top-k ranks the choice scores
    return _Routing(mms[0], tops[0], rws[0], sorts[0] if sorts else None, choices[0] if choices else None)


def _gating(b, rt: _Routing) -> dict:
    bias = b.vec[rt.choice.ins[1]] if rt.choice is not None and rt.choice.sym.bias else None  # type: ignore[union-attr]
    return dict(sigmoid=rt.spec.gating is Gating.SIGMOID, bias=bias, scale=rt.spec.scale)


def route_topk(op: Op, b) -> list:
    """RouterTopk and MoeTokenSort: one `route` launch; a RouterTopk holding the norm its router reads, the
    projection's launch that routes in its norm (`route_in_norm`)."""
    from fuselane.lanes.cuda.triton.moe import route

    if class_of(op.sym.parts[0]) in NORMS_ROUTED:  # type: ignore[union-attr]
        return _route_in_norm(op, b)
    rt = _routing(op)
    spec, mm = rt.spec, rt.mm
    x = b.bufs[mm.ins[0]].view(spec.rows, -1)
    w, fmt = b.raw[mm.ins[1]]
    ids, weights, scores = _ids(b, rt.top.out), b.bufs[rt.rw.out], b.bufs[mm.out]
    order = _ids(b, rt.sort.out) if rt.sort is not None else None
    grouped = rt.sort is not None and moe_kernels.moe_grouped(spec.rows, _expert_formats(b, rt.sort.out))
    counts = _counts(b, rt.sort.out, spec.experts, x.device) if grouped else None  # type: ignore[union-attr]
    counter = b.scratch.setdefault(f"moe-route:{op.out}", route.counters(x.device, spec.rows))
    args = (spec.experts, spec.k, spec.renorm, ids, weights, scores, counter, order, counts)
    # one scratch a shape: the layers' routing launches run one after another, each writing before it reads
    scratch = None
    if order is not None:
        key = f"moe-sort:{spec.rows}x{spec.experts}x{spec.k}"
        scratch = b.scratch.setdefault(key, route.sort_scratch(x.device, spec.rows, spec.experts, spec.k))
    amax = None
    if order is not None and counts is not None:  # the grouped GEMM's: each row's f16 scale (`route.RowScales`)
        # one a shape (the layers' launches run one after another, each layer's routing writing them before its
        # gate/up and down read them), found by the activation's name
        shape = f"moe-amax:{spec.rows}x{spec.k}x{x.shape[1]}"
        if shape not in b.scratch:
            b.scratch[shape] = route.row_scales(x.device, spec.rows, spec.k, x.shape[1])
        amax = b.scratch[_amax_key(mm.ins[0], spec.rows, spec.k)] = b.scratch[shape]
    gating = _gating(b, rt) | dict(scratch=scratch, amax=amax)
    return [lambda: route.route(x, w, fmt, *args, **gating)]


def _route_in_norm(op: Op, b) -> list:
    """A step's projection, its residual add and norm (and the norm's int8 form, from the int8 GEMV) and the
    routing of the normed row, in the add + norm GEMV's launch (`norm_route`)."""
    from fuselane.lanes.cuda.run.product_launch import norm_product
    from fuselane.lanes.cuda.triton.gemv import fast_norm
    from fuselane.lanes.cuda.triton.moe import norm_route

    normed, routing = op.sym.parts  # type: ignore[union-attr]
    inner = normed.sym.parts[0] if class_of(normed) is C.NORM_QUANT else normed
    p, out_q8, rt = norm_product(inner, b), b.q8.get(normed.out), _routing(routing)
    int8 = p.acts is not None and out_q8 is not None
    f32 = out_q8 is None and p.acts is None and fast_norm.supports_fast_add_norm(p.fmt, p.n)
    if not (int8 or f32) or rt.spec.rows != 1 or rt.mm.ins[0] != normed.out:
        raise _mismatch(f"{op.out}: a step's routing runs in its norm's launch from an add + norm GEMV's norm only")
    router, router_fmt = b.raw[rt.mm.ins[1]]
    spec = rt.spec
    # written before read in every launch: one a shape
    key = f"moe-route-in-norm:{p.fmt.name}:{p.n}x{p.k}x{spec.experts}:{int8}"
    scratch = b.scratch.setdefault(key, norm_route.route_scratch(p.x.device, p.fmt, p.n, p.k, spec.experts, int8))
    routed = norm_route.Routing(router, router_fmt, spec.experts, spec.k, spec.renorm, _ids(b, rt.top.out),
                                b.bufs[rt.rw.out], scratch, **_gating(b, rt))  # fmt: skip
    if int8:
        return [lambda: norm_route.gemv_q8_add_norm_route(p.acts, p.wt, p.fmt, p.n, p.k, p.r, p.s, p.w, p.eps,
                                                          p.out, out_q8, p.counter, routed)]  # fmt: skip
    return [lambda: norm_route.gemv_fast_add_norm_route(p.x, p.wt, p.fmt, p.n, p.k, p.r, p.s, p.w, p.eps, p.out,
                                                        p.counter, routed)]  # fmt: skip


def _check_f32_experts(fmt, rows: int) -> None:
    """The kept experts' f32 products (a decode step's under activations=dequant) decode their rows as the GEMV
    by rows does: its formats only (`kernels.rows_gemv`)."""
    if not kernels.rows_gemv(fmt, rows):
        raise FuselaneError(
            f"a mixture's experts in {Format(fmt).name} take a decode step from int8 activations only: "
            "use activations=int8 (the default), not dequant"
        )


def _int8(b, name: str, fmt, n: int, k: int, rows: int) -> Any:
    """The int8 form of activation `name` where the plan wrote one and the expert products take it: the int8
    experts' formats, or a step's grid experts (`kernels.grid_int8`: their dot meets the codes in dp4a)."""
    from fuselane.lanes.cuda.triton.moe.gate_up import int8_takes

    return b.q8.get(name) if kernels.grid_int8(fmt, rows) or (rows == 1 and int8_takes(fmt, n, k)) else None


def gate_up_act(op: Op, b, out_q8: Any = None) -> list:
    """MoeGateUpAct: one `gate_up` launch (with `out_q8`, GluActMulQuant: it writes its int8 form too)."""
    from fuselane.lanes.cuda.triton.moe import gate_up

    gate, up = _of(leaves(op), ExpertMatmul)
    spec: ExpertMatmul = gate.sym  # type: ignore[assignment]
    (wg, fmt), (wu, _) = b.raw[gate.ins[1]], b.raw[up.ins[1]]
    ids, out = _ids(b, gate.ins[2]).view(spec.rows, spec.k), b.bufs[op.out]
    order = _order(b, gate, spec.rows)
    grid_table(fmt, wg)
    if order is not None and out_q8 is None and _grouped().takes(fmt, spec.n, spec.kd):
        return _gate_up_grouped(b, gate, wg, wu, fmt, spec, order, out, op.out)
    if fmt in kernels.GRID_GEMV_FORMATS:  # a step's or a batch's pairs on the grid GEMV's dot: a step's row in
        # int8 where the plan quantized it, else f32
        x = _int8(b, gate.ins[0], fmt, spec.n, spec.kd, spec.rows)
        x = x if x is not None else b.bufs[gate.ins[0]].view(spec.rows, spec.kd)
        counters = None
        if out_q8 is not None:  # each pair's row in int8 too, for the down product (GluActMulQuant)
            from fuselane.lanes.cuda.triton.gemv.q8_epilogue import q8_counters

            counters = b.scratch.setdefault(f"moe-q8:{op.out}", q8_counters(ids.numel() * spec.n, out.device))
        return [lambda: _grid_experts().grid_gate_up(x, wg, wu, fmt, ids, spec.n, spec.kd, out, out_q8, counters)]
    q8 = _int8(b, gate.ins[0], fmt, spec.n, spec.kd, spec.rows)
    if q8 is None:
        _check_f32_experts(fmt, spec.rows)
    if out_q8 is not None and q8 is None:
        raise _mismatch(f"{op.out}: the kept experts write their int8 form only from the int8 products")
    x = q8 if q8 is not None else b.bufs[gate.ins[0]].view(spec.rows, spec.kd)
    # a folded shared expert rides this launch: the down op's binder, bound after this one, names it by the
    # ids both read; the launch looks it up when it runs (every op is bound before the first launch)
    riders = b.scratch.setdefault(_RIDERS, {})
    b.scratch.setdefault(_KEPT_INT8, {})[gate.ins[2]] = fmt if q8 is not None else None
    return [lambda: gate_up.gate_up(x, wg, wu, fmt, ids, spec.n, spec.kd, out, out_q8, riders.get(gate.ins[2]))]


def _grouped() -> Any:
    from fuselane.lanes.cuda.triton.moe import grouped

    return grouped


def _grid_experts() -> Any:
    from fuselane.lanes.cuda.triton.grid import experts

    return experts


def _experts(w, spec_n: int, spec_kd: int, fmt) -> int:
    """The experts of a 3-D expert tensor's bytes `w`: its bytes over one expert's."""
    return w.numel() // (spec_n * stored_row_bytes(fmt, spec_kd))


def _gate_up_grouped(b, gate: Op, wg, wu, fmt, spec: ExpertMatmul, order: tuple[Any, str], out, gate_out: str) -> list:
    """MoeGateUpAct in a chunk: one launch of the grouped GEMM."""
    sorted_pairs, name = order
    experts = _experts(wg, spec.n, spec.kd, fmt)
    x = b.bufs[gate.ins[0]].view(spec.rows, spec.kd)
    counts = _counts(b, name, experts, x.device)
    args = (fmt, experts, spec.k, sorted_pairs, counts, spec.n, spec.kd, out.view(spec.rows * spec.k, spec.n))
    # where the routing launch read this very activation, it wrote its rows' largest values: one f16 scale a
    # row, and this launch leaves its own output's for the down launch (by the output's name)
    amax = b.scratch.get(_amax_key(gate.ins[0], spec.rows, spec.k))
    if amax is not None:
        b.scratch[f"moe-hamax:{gate_out}"] = amax.h
    return [lambda: _grouped().gate_up_grouped(x, wg, wu, *args, amax=amax)]


@dataclass(frozen=True, slots=True)
class _Parts:
    """A down launch's leaves, found by what they compute."""

    down: Op
    mix: Op
    norm: Op | None
    norm_w: Op | None
    shared: dict[str, Op]
    adds: list[str]


def _shared_products(found: list[Op]) -> dict[str, Op]:
    """The folded shared expert's products, by what they read and what reads them: down (it reads the SwiGLU,
    made inside the fold), gate (a SiLU reads it), score (a sigmoid: a gated expert's only), up (the other)."""
    mms = _of(found, Matmul)
    made = {x.out for x in found}
    readers = {x.ins[0]: x for x in found if isinstance(x.sym, Unary)}

    def role(mm: Op) -> str:
        if mm.ins[0] in made:
            return "down"
        r = readers.get(mm.out)
        if r is None:
            return "up"
        return "gate" if r.sym.op is UnaryOp.SILU else "score"  # type: ignore[union-attr]

    return {role(mm): mm for mm in mms}


def _parts(op: Op) -> _Parts:
    found = leaves(op)
    made = {x.out for x in found}
    norms = _of(found, RmsNorm)
    norm = norms[0] if norms else None
    norm_w = next((x for x in found if norm is not None and x.ins[0] == norm.out), None)
    adds = [x for x in found if isinstance(x.sym, Elementwise) and x.sym.op is ElementwiseOp.ADD and not x.sym.row]
    external = [name for a in adds for name in a.ins if name not in made]
    downs = [x for x in _of(found, ExpertMatmul) if x.sym.slotted]  # type: ignore[union-attr]
    (mix,) = _of(found, Moe)
    return _Parts(downs[0], mix, norm, norm_w, _shared_products(found), external)


def _shared(b, s: dict[str, Op], op: Op, ids: str, f32: bool) -> Any:
    """The folded shared expert's launch arguments; `ids`: the expert ids its mixture reads, `f32`: the kept
    experts read f32 (activations=dequant)."""
    import torch

    from fuselane.lanes.cuda.triton.moe.shared import Shared, int8_down, swiglu_tiles

    (wg, fmt), (wu, _), (wd, dfmt) = (b.raw[s[r].ins[1]] for r in ("gate", "up", "down"))
    wsc, sfmt = b.raw[s["score"].ins[1]] if "score" in s else (None, None)  # an ungated expert has no score
    sdff = s["down"].sym.k  # type: ignore[union-attr]
    x = b.bufs[s["gate"].ins[0]].view(1, -1)
    scratch = b.scratch.setdefault(f"moe-shared:{op.out}", torch.zeros(sdff + 1, device=x.device))
    kept = b.scratch.get(_KEPT_INT8, {}).get(ids)  # written by the kept experts' gate/up binder, bound first
    tiles = not f32 and swiglu_tiles(kept, fmt, sdff, x.shape[-1], wg, wu)
    q8 = None
    if int8_down(dfmt, sdff, f32, tiles):  # an int8 down product reads the SwiGLU's int8 form
        from fuselane.lanes.cuda.triton.quant import empty_q8

        q8 = b.scratch.setdefault(f"moe-shared-q8:{op.out}", empty_q8(1, sdff, x.device))
    return Shared(x, wg, wu, wd, wsc, fmt, dfmt, sfmt, sdff, scratch, q8, f32, tiles)


def down_combine(op: Op, b, out_q8: Any = None) -> list:
    """MoeDownCombine, SharedExpertFusion, MoeDeferredFinalize: one `down_combine` launch (with `out_q8`,
    NormQuant: the norm's int8 form too)."""
    from fuselane.lanes.cuda.triton.moe import down

    p = _parts(op)
    spec: ExpertMatmul = p.down.sym  # type: ignore[assignment]
    mix: Moe = p.mix.sym  # type: ignore[assignment]
    w, fmt = b.raw[p.down.ins[1]]
    ids = _ids(b, p.down.ins[2]).view(mix.rows, mix.k)
    weights = b.bufs[p.mix.ins[1]]
    q8 = _int8(b, p.down.ins[0], fmt, spec.n, spec.kd, mix.rows)  # a grid down: the pairs' int8 rows where written
    h = q8 if q8 is not None else b.bufs[p.down.ins[0]].view(mix.rows * mix.k, spec.kd)
    adds = tuple(b.bufs[name] for name in p.adds)
    shared = _shared(b, p.shared, op, p.down.ins[2], q8 is None) if p.shared else None
    if shared is not None:  # its SwiGLU and sigmoid ride the kept experts' gate/up launch (`moe/shared.py`)
        b.scratch.setdefault(_RIDERS, {})[p.down.ins[2]] = shared
    norm = None
    sum_name = op.out
    if p.norm is not None and p.norm_w is not None:
        sum_name = p.norm.ins[0]
        norm = down.Norm(b.vec[p.norm_w.ins[1]], p.norm.sym.eps, b.bufs[p.norm_w.out], out_q8)  # type: ignore[union-attr]
    elif out_q8 is not None:
        raise _mismatch(f"{op.out}: a mixture writes an int8 form only of the norm it ends with")
    sum_out = b.bufs[sum_name]
    order = _order(b, p.down, mix.rows)
    grid_table(fmt, w)
    if order is not None and shared is None and out_q8 is None and _grouped().takes(fmt, mix.d, spec.kd):
        return _down_grouped(b, op, p, w, fmt, order, weights, adds, norm, sum_out)
    counter = b.scratch.setdefault(f"moe-down:{op.out}", down.counters(mix.rows, sum_out.device))
    d, dff = mix.d, spec.kd
    if fmt in kernels.GRID_GEMV_FORMATS:  # a step's or a batch's rows on the grid GEMV's dot (no shared expert)
        if shared is not None:
            raise _mismatch(f"{op.out}: a folded shared expert rides no grid format's expert launches")
        return [lambda: _grid_experts().grid_down_combine(h, w, fmt, ids, weights, d, dff, sum_out, adds=adds,
                                                          norm=norm, counter=counter)]  # fmt: skip
    if q8 is None:
        _check_f32_experts(fmt, mix.rows)
    return [
        lambda: down.down_combine(
            h, w, fmt, ids, weights, d, dff, sum_out, adds=adds, shared=shared, norm=norm, counter=counter
        )
    ]


def _down_grouped(b, op: Op, p: _Parts, w, fmt, order: tuple[Any, str], weights, adds, norm, sum_out) -> list:
    """MoeDownCombine, MoeDeferredFinalize in a chunk: one launch of the grouped GEMM and its combine."""
    import torch

    from fuselane.lanes.cuda.triton.moe import grouped_combine as gc

    spec: ExpertMatmul = p.down.sym  # type: ignore[assignment]
    mix: Moe = p.mix.sym  # type: ignore[assignment]
    sorted_pairs, name = order
    d, dff, pairs = mix.d, spec.kd, mix.rows * mix.k
    counts = _counts(b, name, mix.experts, sum_out.device)
    # one scratch a shape: the layers' down launches run one after another
    pair_out = b.scratch.setdefault(f"moe-pair-out:{pairs}x{d}", torch.empty(pairs * d, device=sum_out.device))
    width_tiles = _grouped().down_width_tiles(fmt, d, pairs_an_expert=pairs / mix.experts)
    counter = b.scratch.setdefault(f"moe-combine:{op.out}", gc.counters(mix.rows, width_tiles, sum_out.device))
    gnorm = gc.GroupedNorm(norm.w, norm.eps, norm.out) if norm is not None else None
    c = gc.Combine(sum_out.view(mix.rows, d), counter, tuple(a.view(mix.rows, d) for a in adds), gnorm)
    h = b.bufs[p.down.ins[0]].view(pairs, dff)
    rw = weights.view(mix.rows, mix.k)
    args = (fmt, mix.experts, sorted_pairs, counts, rw, d, dff, pair_out, c)
    h_amax = b.scratch.get(f"moe-hamax:{p.down.ins[0]}")  # where the grouped gate/up wrote h's
    return [lambda: _grouped().down_grouped(h, w, *args, h_amax=h_amax)]


def row_scale(op: Op, b) -> list:
    """RowScale (a chunk's shared expert, apart): each row times its own scalar, one launch."""
    import torch

    spec: RowScale = op.sym  # type: ignore[assignment]
    x, s, out = b.bufs[op.ins[0]], b.bufs[op.ins[1]], b.bufs[op.out]
    return [lambda: torch.mul(x.view(spec.rows, spec.cols), s.view(spec.rows, 1), out=out.view(spec.rows, spec.cols))]
