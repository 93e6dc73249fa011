"""The binders of the products (`launch.BINDERS`): a product alone (with its bias, its residual or its landing
row), a gated pair, products of one activation in parts (the int8 one turning the query's and key's heads in
its epilogue), and a step's projection that norms its row in its last program. Each picks, among kernels that
launch alike, the one the plan's choices name: the int8 GEMV where the plan quantized the activation
(`q8_in`), the int8 GEMM for a chunk's (`_q8_gemm`), else the f32 GEMVs within the GEMV's rows (a grid
format's own, `grid/gemv.py`), and past them the in-kernel f16 GEMMs or cuBLAS on f16 copies or a scratch (the
`prefill` knob)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fuselane.fuse.views import class_of, leaves, parts
from fuselane.gguf.formats import Format
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Form, Op
from fuselane.graph.ops import Elementwise, Matmul, RmsNorm
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.run import rope_launch
from fuselane.lanes.cuda.run.mismatch import PlanMismatch


def _rows_gemv():
    """The GEMV by checkpoint rows, imported on first bind: the lane loads torch and Triton only when used."""
    from fuselane.lanes.cuda.triton.gemv import rows

    return rows


def grid_table(fmt: Format, w: Any) -> None:
    """A grid format's table on the device (`grid.values.device_table`, kept once made), made at bind time: a
    launch replayed from a CUDA graph's capture may not copy it up then."""
    if fmt in kernels.GRID_GEMV_FORMATS:
        from fuselane.lanes.cuda.triton.grid.values import device_table

        device_table(fmt, w.device)


def grid_x(name: str, fmt: Format, m: int, b: Any, x: Any):
    """A grid product's activation as its GEMV reads it: the int8 form the plan wrote of a step's one row in a
    format the grid GEMV meets in dp4a (`kernels.grid_int8`), else the f32 rows `x`."""
    return b.q8[name] if kernels.grid_int8(fmt, m) and name in b.q8 else x


def rows_view(b: Any, op: Op):
    """The destination a product or row write lands in: (buffer, (pos, pitch) or None)."""
    if op.dst.row is not None:
        return b.bufs[op.dst.buf], (b.bufs["pos"], op.dst.row.pitch)
    return b.bufs[op.dst.buf], None


def product(op: Op, b: Any, *, bias: str | None = None, residual: str | None = None, dst: Op | None = None):
    """A product alone: the int8 GEMM or GEMV where the plan quantized its activation, the f32 GEMVs within the
    GEMV's rows, else a chunk's f16 GEMMs (in-kernel decode, a scratch, or f16 copies)."""
    spec: Matmul = op.sym  # type: ignore[assignment]
    x = b.bufs[op.ins[0]]
    out, row = rows_view(b, dst or op)
    bias_t = b.vec[bias] if bias else None
    res_t = b.bufs[residual] if residual else None
    w, fmt = b.raw[op.ins[1]]
    grid_table(fmt, w)
    chunk = _q8_gemm(op.ins[0], fmt, spec.m, spec.k, b, out)
    if chunk is not None:  # the plan quantized a chunk's activation: the int8 tensor cores, no copy
        gemm_q8, acts = chunk
        res2 = res_t.view(spec.m, spec.n) if res_t is not None else None
        out2 = out if row is not None else out.view(spec.m, spec.n)
        n, k = spec.n, spec.k
        return [lambda: gemm_q8.gemm_q8(acts, w, fmt, n, k, out2, bias=bias_t, residual=res2, out_row=row)]
    q8 = q8_in(op.ins[0], fmt, spec.m, spec.k, b, out)
    if q8 is not None:
        gemv_q8, acts = q8
        n, k = spec.n, spec.k
        return [lambda: gemv_q8.gemv_q8(acts, w, fmt, n, k, out, bias=bias_t, residual=res_t, out_row=row)]
    if spec.m <= kernels.GEMV_ROWS and fmt in kernels.GRID_GEMV_FORMATS:  # a grid format's own GEMV
        from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid

        xg = grid_x(op.ins[0], fmt, spec.m, b, x)
        return [lambda: gemv_grid(xg, w, fmt, spec.n, spec.k, out, bias=bias_t, residual=res_t, out_row=row)]
    if spec.m <= kernels.GEMV_ROWS and kernels.rows_gemv(fmt, spec.m):  # a step's or a batch's rows: GEMVs
        # (Q2_K, Q3_K, IQ4_NL or IQ4_XS in a chunk of a few rows multiplies as a longer chunk's: below)
        kernel = _gemv_kernels(fmt, spec.m, out)
        return [lambda: kernel(x, w, fmt, spec.n, spec.k, out, bias=bias_t, residual=res_t, out_row=row)]
    from fuselane.lanes.cuda.triton import f16_scale, gemm, gemm_sb

    x2 = x.view(spec.m, spec.k)
    res2 = res_t.view(spec.m, spec.n) if res_t is not None else None
    out2 = out if row is not None else out.view(spec.m, spec.n)
    if b.in_place and gemm_sb.supports(fmt, spec.k) and out.dtype in _store_types():
        # Q4_K / Q6_K: a super-block a step, the sub-scales folded into the f16 weights (`gemm_sb`); no copy
        n, k = spec.n, spec.k
        epilogue = dict(bias=bias_t, residual=res2, out_row=row, sms=b.sms)
        return [lambda: gemm_sb.product(x2, w, fmt, n, k, out2, **epilogue)]
    if b.in_place and gemm.supports(fmt, spec.k) and out.dtype in _store_types():
        # the weights decoded to f16 in the kernel: no f16 copy of the matrix
        return [lambda: gemm.gemm(x2, w, fmt, spec.n, spec.k, out2, bias=bias_t, residual=res2, out_row=row)]
    matrix = op.ins[1]
    # an activation no later op reads is rounded into its own bytes, where the workspace asks (`Bound.dying`)
    rounds = (id(op), op.ins[0]) in b.dying and residual != op.ins[0]
    if b.f16_scratch is not None:  # the matrix decoded to f16 just before cuBLAS takes it: no copy kept
        n, k, scratch = spec.n, spec.k, b.f16_scratch
        epilogue = dict(bias=bias_t, residual=res2, out_row=row, in_place=rounds)
        return [lambda: f16_scale.product_from_bytes(x2, w, fmt, n, k, scratch, out2, **epilogue)]

    def f16_copy() -> None:
        # the f16 copy, made by the first run (a kernel): binding launches nothing. A row past f16's range is
        # rounded under a power-of-two scale that the epilogue multiplies back (`f16_scale`), so it stays finite
        f16_scale.product(x2, b.dense(matrix), out2, bias=bias_t, residual=res2, out_row=row, in_place=rounds)

    return [f16_copy]


def _fast(fmt: Format, m: int, *outs: Any):
    """The tile-streaming GEMV kernels where they take this product (one row, their formats, f32 outputs or
    f16 cache rows), else None."""
    from fuselane.lanes.cuda.triton.gemv import fast as gemv_fast

    f32 = all(out.dtype in _store_types() for out in outs)
    return gemv_fast if f32 and gemv_fast.supports_fast(fmt, m) else None


def _q8_gemm(name: str, fmt: Format, m: int, k: int, b: Any, out: Any):
    """(the int8 GEMM module, the activation's Q8Acts) where the plan wrote a chunk's activation `name` in int8
    for a product the int8 GEMM takes (`CudaShim.int8_gemm`); None otherwise."""
    from fuselane.lanes.cuda.triton import gemm_q8

    batch = b.g.form is Form.BATCH  # a batch's rows are each a decode row: the int8 GEMV over them
    if batch or name not in b.q8 or not gemm_q8.supports(fmt, m, k) or out.dtype not in _store_types():
        return None
    return gemm_q8, b.q8[name]


def q8_in(name: str, fmt: Format, m: int, k: int, b: Any, *outs: Any):
    """(the int8 GEMV module, the activation's Q8Acts) where the plan wrote `name`'s int8 form (its producer's
    epilogue, or a `Quantize` launch) and the int8 kernels take the product; None where it reads the f32 row.
    A batch's rows past one take the module over many rows (`q8_rows`), whose launchers the one-row
    module's names call alike."""
    from fuselane.lanes.cuda.triton.gemv import q8, q8_rows

    gemv_q8 = q8 if m == 1 else q8_rows if b.g.form is Form.BATCH else None  # a chunk's: the GEMMs, or f32
    if gemv_q8 is None or name not in b.q8 or not gemv_q8.supports(fmt, m, k):
        return None
    if any(out.dtype not in _store_types() for out in outs):
        return None
    return gemv_q8, b.q8[name]


def _store_types():
    import torch

    return (torch.float32, torch.float16)


def _gemv_kernels(fmt: Format, m: int, out: Any):
    fast = _fast(fmt, m, out)
    if fast is not None:
        return fast.gemv_fast
    gemv = _rows_gemv()
    return gemv.gemv


def gemm_bias(op: Op, b: Any):
    mm, add = leaves(op)
    return product(mm, b, bias=add.ins[1], dst=add)


def row_write(op: Op, b: Any):
    found = leaves(op)
    mm = found[0]
    bias = found[1].ins[1] if len(found) == 3 else None
    return product(mm, b, bias=bias, dst=found[-1])


def gate_up(op: Op, b: Any, out_q8: Any = None):
    """The gated pair in one GEMV launch (the lane rule `products_apart` keeps it within the GEMV's rows); with
    `out_q8` (GluActMulQuant) the int8 GEMV writes the GLU's int8 form too."""
    gemv = _rows_gemv()
    gate, up = (p for p in leaves(op) if isinstance(p.sym, Matmul))
    spec: Matmul = gate.sym  # type: ignore[assignment]
    x, out = b.bufs[gate.ins[0]], b.bufs[op.out]
    grid_table(b.raw[gate.ins[1]][1], b.raw[gate.ins[1]][0])
    if spec.m > kernels.GEMV_ROWS:
        if b.in_place or out_q8 is not None:  # the GEMV would read every matrix once a tile of rows
            raise PlanMismatch(
                f"{op.out}: a gated pair of {spec.m} rows, past the GEMV's {kernels.GEMV_ROWS}, not split"
            )
        rounds = (id(op), gate.ins[0]) in b.dying
        return [_f16_pair(gate, up, spec, b, x.view(spec.m, spec.k), out.view(spec.m, spec.n), rounds)]
    (wg, fmt), (wu, _) = b.raw[gate.ins[1]], b.raw[up.ins[1]]
    n, k = spec.n, spec.k
    if fmt in kernels.GRID_GEMV_FORMATS:  # the grid GEMV's pair (`fits` keeps the two in one grid format)
        from fuselane.lanes.cuda.triton.gemv.q8_epilogue import q8_counters
        from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid_gate_up_glu

        xg = grid_x(gate.ins[0], fmt, spec.m, b, x)
        if out_q8 is None:
            return [lambda: gemv_grid_gate_up_glu(xg, wg, wu, fmt, n, k, out)]
        counters = b.scratch.setdefault(f"glu-q8:{op.out}", q8_counters(n, out.device))
        return [lambda: gemv_grid_gate_up_glu(xg, wg, wu, fmt, n, k, out, out_q8=out_q8, counters=counters)]
    q8 = q8_in(gate.ins[0], fmt, spec.m, k, b, out)
    if q8 is not None:
        gemv_q8, acts = q8
        if out_q8 is None:
            return [lambda: gemv_q8.gemv_q8_gate_up_glu(acts, wg, wu, fmt, n, k, out)]
        if spec.m > 1:
            raise PlanMismatch(f"{op.out}: the gated pair writes its int8 form from the one-row int8 GEMV only")
        from fuselane.lanes.cuda.triton.gemv import q8_epilogue as qe

        counters = b.scratch.setdefault(f"glu-q8:{op.out}", qe.q8_counters(n, out.device))
        return [lambda: qe.gemv_q8_gate_up_glu_q8(acts, wg, wu, fmt, n, k, out, out_q8, counters)]
    if out_q8 is not None:
        raise PlanMismatch(f"{op.out}: the gated pair writes its int8 form only from the int8 GEMV")
    fast = _fast(fmt, spec.m, out)
    if fast is not None:
        return [lambda: fast.gemv_fast_gate_up_glu(x, wg, wu, fmt, n, k, out)]
    return [lambda: gemv.gemv_gate_up_glu(x, wg, wu, fmt, n, k, out)]


def _f16_pair(gate: Op, up: Op, spec: Matmul, b: Any, x: Any, out: Any, rounds: bool):
    """A chunk's gated pair on cuBLAS: the activation rounded once (in its own bytes where it `rounds` there, as
    it dies), the GLU in the products' epilogue (`f16_scale.gate_up_glu`), over the matrices' f16 copies or
    decoded into the scratch a slab at a time."""
    from fuselane.lanes.cuda.triton import f16_scale

    if b.f16_scratch is not None:
        pair, scratch = (b.raw[gate.ins[1]], b.raw[up.ins[1]]), b.f16_scratch
        return lambda: f16_scale.gate_up_glu_from_bytes(x, *pair, spec.n, spec.k, scratch, out, in_place=rounds)
    # the f16 copies, made by the first run as `product`'s are
    return lambda: f16_scale.gate_up_glu(x, b.dense(gate.ins[1]), b.dense(up.ins[1]), out, in_place=rounds)


def _part(member: Op, b: Any) -> tuple:
    """A member of a GEMV in parts as the kernels take it: (weights, outputs, output buffer, bias, row)."""
    found = leaves(member)
    mm = found[0]
    spec: Matmul = mm.sym  # type: ignore[assignment]
    bias = next((p.ins[1] for p in found if isinstance(p.sym, Elementwise) and p.ins[0] == mm.out), None)
    landing = found[-1] if class_of(member) is C.ROW_WRITE else (found[1] if bias else mm)
    out, row = rows_view(b, landing)
    return (b.raw[mm.ins[1]][0], spec.n, out, b.vec[bias] if bias else None, row)


def merged(op: Op, b: Any):
    """Products of one activation in parts, one GEMV launch; where the plan folded the query's and key's
    rotations into it (the lane rule `rope_epilogue`), the GEMV that turns them in its epilogue."""
    gemv = _rows_gemv()
    members = op.sym.parts  # type: ignore[union-attr]
    turned = [k for k, m in enumerate(members) if class_of(m) is C.QKV_HEAD_EPILOGUE]
    bare = [parts(m)[0] if k in turned else m for k, m in enumerate(members)]  # each member's product
    products = [_part(m, b) for m in bare]
    first = leaves(members[0])[0]
    spec: Matmul = first.sym  # type: ignore[assignment]
    if turned and b.paged is not None and spec.m != 1:
        raise PlanMismatch(f"{op.out}: a batch's rows past one turn in their own launch")
    x, fmt = b.bufs[first.ins[0]], b.raw[first.ins[1]][1]
    fmts = [b.raw[leaves(m)[0].ins[1]][1] for m in bare]
    if fmt in kernels.GRID_GEMV_FORMATS:  # a step's products in one grid format (`fits._grid_launch`): its own GEMV
        from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid_parts

        grid_table(fmt, products[0][0])
        if set(fmts) != {fmt} or spec.m != 1:
            raise PlanMismatch(f"{op.out}: a grid GEMV in parts takes a step's one row in one format")
        x1 = grid_x(first.ins[0], fmt, 1, b, x.view(1, spec.k))
        if turned:
            return [_turned_in_gemv(turned, members, products, x1, False, fmt, b)]
        return [lambda: gemv_grid_parts(x1, products, fmt, spec.k)]
    q8 = q8_in(first.ins[0], fmt, spec.m, spec.k, b, *(p[2] for p in products))
    if len(set(fmts)) > 1:  # two formats: a step's one row, int8 or f32 (`CudaShim._formats_mix`)
        int8 = q8 is not None and all(q8[0].supports(f, 1, spec.k) for f in fmts)
        if spec.m != 1 or not (int8 or q8 is None and all(kernels.rows_gemv(f, 1) for f in fmts)):
            raise PlanMismatch(f"{op.out}: products of two formats in parts run in a step's one-row GEMVs only")
        fmt = fmts
    if turned:
        return [_turned_in_gemv(turned, members, products, q8[1] if q8 is not None else x, q8 is not None, fmt, b)]
    if q8 is not None:
        gemv_q8, acts = q8
        return [lambda: gemv_q8.gemv_q8_parts(acts, products, fmt)]
    if isinstance(fmt, list):  # the f32 GEMV by rows takes two formats
        return [lambda: gemv.gemv_parts(x, products, fmt)]
    fast = _fast(fmt, spec.m, *(p[2] for p in products))
    if fast is not None:
        return [lambda: fast.gemv_fast_parts(x, products, fmt)]
    return [lambda: gemv.gemv_parts(x, products, fmt)]


def _turned_in_gemv(turned: list[int], members, products: list, acts: Any, int8: bool, fmt: Format | list, b: Any):
    """The GEMV in parts that turns a query's and a key's heads in its epilogue: the int8 one (`q8_rope`) where
    `acts` is the activation's int8 form (`int8`), the grid GEMV's (`grid.parts_rope`, a step's one row) in a grid
    format, else the f32 one (`f32_rope`, a step's one row). The query lands in a buffer of its own, the key where
    its rotation writes it (its cache row)."""
    from fuselane.lanes.cuda.triton.gemv import f32_rope, q8_rope, turn
    from fuselane.lanes.cuda.triton.grid.parts_rope import gemv_grid_parts_rope

    qi, ki = turned if members[turned[0]].dst.row is None else turned[::-1]
    q_op, k_op = (parts(members[i])[1] for i in (qi, ki))
    q, kk = rope_launch.side(q_op, b), rope_launch.side(k_op, b)
    counters = b.scratch.setdefault(f"rope-turn:{q_op.out}", turn.rope_counters(q.heads, kk.heads, q.out.device))
    q_turn = turn.Turn(qi, q.out, q.heads, None, q.norm_w)
    # a batch of one: the row turns at its own position and its key lands in the step's staging row (row 0)
    k_turn = turn.Turn(ki, kk.out, kk.heads, kk.pitch if b.paged is None else None, kk.norm_w)
    pos = b.bufs["pos"] if b.paged is None else b.paged.positions
    grid = not isinstance(fmt, list) and fmt in kernels.GRID_GEMV_FORMATS  # a list: a step's two formats
    launch = gemv_grid_parts_rope if grid else q8_rope.gemv_q8_parts_rope if int8 else f32_rope.gemv_f32_parts_rope
    return lambda: launch(acts, products, fmt, q_turn, k_turn, pos, counters, hd=q.hd, base=q.base, eps=q.eps,
                          yarn=q.yarn)  # fmt: skip


@dataclass(frozen=True, slots=True)
class NormProduct:
    """A step's projection with its residual add and norm (GemvNormEpilogue), bound: its activation x (and its
    int8 form where the plan wrote one and the int8 GEMV takes the product), the checkpoint rows, the residual
    r, the sum s, the norm's weight w and eps, the normed row out, and the launch's counter."""

    x: Any
    acts: Any
    wt: Any
    fmt: Format
    n: int
    k: int
    r: Any
    s: Any
    w: Any
    eps: float
    out: Any
    counter: Any


def norm_product(op: Op, b: Any) -> NormProduct:
    """A GemvNormEpilogue's operands against the lane's buffers."""
    mm = op.sym.parts[0]  # type: ignore[union-attr]
    add, n_op, w_op = leaves(op.sym.parts[1])  # type: ignore[union-attr]
    residual = add.ins[0] if add.ins[1] == mm.out else add.ins[1]
    spec: RmsNorm = n_op.sym  # type: ignore[assignment]
    product: Matmul = mm.sym  # type: ignore[assignment]
    if product.m > 1:
        raise PlanMismatch(f"{op.out}: a projection norms in its last program the one row of a decode step only")
    from fuselane.lanes.cuda.triton.gemv import epilogue as gemv_epilogue

    x, out = b.bufs[mm.ins[0]], b.bufs[w_op.out]
    wt, fmt = b.raw[mm.ins[1]]
    q8 = q8_in(mm.ins[0], fmt, product.m, product.k, b, out)
    acts = q8[1] if q8 is not None and product.n % kernels.QBLOCK == 0 else None
    if fmt in kernels.GRID_GEMV_FORMATS:  # the grid GEMV reads the int8 form at any width
        acts = grid_x(mm.ins[0], fmt, product.m, b, None)
    counter = gemv_epilogue.gemv_add_norm_counter(x.device)  # its own: launches on one stream in turn
    return NormProduct(x, acts, wt, fmt, product.n, product.k, b.bufs[residual], b.bufs[add.out],
                       b.vec[w_op.ins[1]], spec.eps, out, counter)  # fmt: skip


def norm_epilogue(op: Op, b: Any, out_q8: Any = None):
    """A step's projection with its residual add and norm in one launch, whose last program norms the sum. In
    the int8 GEMV (where the plan quantized its activation) the last program writes the norm's int8 form too:
    into `out_q8` (NormQuant), else into a scratch no product reads."""
    from fuselane.lanes.cuda.triton.gemv import epilogue as gemv_epilogue
    from fuselane.lanes.cuda.triton.gemv import fast_norm as gemv_fast_norm

    p = norm_product(op, b)
    if p.fmt in kernels.GRID_GEMV_FORMATS:  # the grid GEMV's add + norm (its activation f32 or int8), the norm's
        # int8 form too
        from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid_add_norm

        grid_table(p.fmt, p.wt)
        xg = p.acts if p.acts is not None else p.x
        return [lambda: gemv_grid_add_norm(xg, p.wt, p.fmt, p.n, p.k, p.r, p.s, p.w, p.eps, p.out, p.counter,
                                           out_q8=out_q8)]  # fmt: skip
    if p.acts is not None:
        from fuselane.lanes.cuda.triton.gemv import q8_epilogue as qe
        from fuselane.lanes.cuda.triton.quant import empty_q8

        oq = out_q8 if out_q8 is not None else b.scratch.setdefault(f"q8-drop:{p.n}", empty_q8(1, p.n, p.x.device))
        return [lambda: qe.gemv_q8_add_norm(p.acts, p.wt, p.fmt, p.n, p.k, p.r, p.s, p.w, p.eps, p.out, oq,
                                            p.counter)]  # fmt: skip
    if out_q8 is not None:
        raise PlanMismatch(f"{op.out}: a projection's norm writes its int8 form only from the int8 GEMV")
    if gemv_fast_norm.supports_fast_add_norm(p.fmt, p.n):
        return [lambda: gemv_fast_norm.gemv_fast_add_norm(p.x, p.wt, p.fmt, p.n, p.k, p.r, p.s, p.w, p.eps, p.out,
                                                          p.counter)]  # fmt: skip
    return [lambda: gemv_epilogue.gemv_add_norm(p.x, p.wt, p.fmt, p.n, p.k, p.r, p.s, p.w, p.eps, p.out, p.counter)]
