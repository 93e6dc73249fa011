"""Binding a plan's ops to launches: each op of the fused schedule becomes a list of closures over the lane's
buffers, each closure one kernel launch.

A native class the lane has one kernel for binds to that kernel; any other fused op binds to its parts'
launches in order (so a plan held rule by rule still runs); a primitive binds to its own kernel. Everything a
launch reads or writes is a buffer allocated once per session, and the position is a device value, so the
launches of a decode step can be captured in a CUDA graph and replayed at every position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fuselane.fuse.views import class_of, leaves
from fuselane.gguf.formats import Format
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Fused, Op, TensorGraph
from fuselane.graph.ops import (
    ArgMax,
    Attention,
    Elementwise,
    ElementwiseOp,
    Matmul,
    RmsNorm,
    Rope,
    RowsGather,
    SetRow,
    TakeRows,
    Unary,
)
from fuselane.lanes.cuda import kernels
from fuselane.lanes.cuda.knobs import RopeEpilogue
from fuselane.lanes.cuda.shim import QUANT_EPILOGUES

Launch = Callable[[], None]


@dataclass(slots=True)
class Bound:
    """What launches are bound against: the plan's graph, buffers by name, weights, and the scalar facts."""

    g: TensorGraph
    bufs: dict[str, Any]  # name -> torch tensor (activations, caches, ids, pos)
    raw: dict[str, tuple[Any, Format]]  # matrix name -> (uint8 bytes on the device, format)
    vec: dict[str, Any]  # vector weights (norms, biases) as f32 device tensors
    dense: Callable[[str], Any]  # matrix name -> dequantized f16 device matrix (for GEMMs past the GEMV's rows)
    scratch: dict[str, Any] = field(default_factory=dict)
    in_place: bool = False  # prefill products decode the checkpoint's bytes in the kernel (knob prefill=in-place)
    q8: dict[str, Any] = field(default_factory=dict)  # name -> gemv_q8.Q8Acts: a decode step's int8 activations
    # whether a decode step's op reads its activation quantized (the shim's `activation`); None: never
    reads_int8: Callable[[Op], bool] | None = None
    rope_in_gemv: RopeEpilogue = RopeEpilogue.OFF  # where the int8 QKV GEMV turns its query and key
    attention_f16: bool = False  # a chunk's attention multiplies on the f16 tensor cores (`CudaShim.attention`)


def _t():
    """The Triton kernel modules, imported on first bind: the lane loads torch and Triton only when used."""
    from fuselane.lanes.cuda.triton import misc, norm, rope
    from fuselane.lanes.cuda.triton.attention import decode as attention
    from fuselane.lanes.cuda.triton.gemv import rows as gemv

    return gemv, norm, rope, attention, misc


def bind(op: Op, b: Bound) -> list[Launch]:
    """The launches of one op of the schedule. A class without a one-launch kernel here (a projection that
    turns its heads in its epilogue, outside a GEMV in parts) runs as its parts' launches."""
    cls = class_of(op)
    if cls is not None:
        builder = NATIVE.get(cls)
        if builder is not None:
            found = builder(op, b)
            if found is not None:
                return found
        assert isinstance(op.sym, Fused)
        return [launch for part in op.sym.parts for launch in bind(part, b)]
    return _prim(op, b)


# ---- primitives -------------------------------------------------------------------------------------------


def _rows_view(b: Bound, op: Op):
    """The destination a product or row write lands in: (buffer, (pos, pitch) or None)."""
    if op.dst.row is not None:
        return b.bufs[op.dst.buf], (b.bufs["pos"], op.dst.row.pitch)
    return b.bufs[op.dst.buf], None


def _product(op: Op, b: Bound, *, bias: str | None = None, residual: str | None = None, dst: Op | None = None):
    gemv, *_ = _t()
    spec: Matmul = op.sym  # type: ignore[assignment]
    x = b.bufs[op.ins[0]]
    out, row = _rows_view(b, dst or op)
    bias_t = b.vec[bias] if bias else None
    res_t = b.bufs[residual] if residual else None
    w, fmt = b.raw[op.ins[1]]
    q8 = _q8_in(op, op.ins[0], fmt, spec.m, spec.k, b, out)
    if q8 is not None:
        gemv_q8, acts, first = q8
        n, k = spec.n, spec.k
        return [*first, lambda: gemv_q8.gemv_q8(acts, w, fmt, n, k, out, bias=bias_t, residual=res_t, out_row=row)]
    if spec.m <= kernels.GEMV_ROWS:
        kernel = _gemv_kernels(fmt, spec.m, out)
        return [lambda: kernel(x, w, fmt, spec.n, spec.k, out, bias=bias_t, residual=res_t, out_row=row)]
    from fuselane.lanes.cuda.triton import gemm

    if b.in_place and gemm.supports(fmt, spec.k) and out.dtype in _store_types():
        # the weights decoded in the kernel: no f16 copy of the matrix
        x2 = x.view(spec.m, spec.k)
        res2 = res_t.view(spec.m, spec.n) if res_t is not None else None
        out2 = out if row is not None else out.view(spec.m, spec.n)
        return [lambda: gemm.gemm(x2, w, fmt, spec.n, spec.k, out2, bias=bias_t, residual=res2, out_row=row)]
    dense = b.dense(op.ins[1])

    def gemm() -> None:
        y = (x.to(dense.dtype) @ dense.T).float()
        if bias_t is not None:
            y += bias_t
        if res_t is not None:
            y += res_t
        if row is None:
            out.copy_(y.view(out.shape))
        else:
            out.index_copy_(0, row[0].long() + _arange(y.shape[0], out.device), y.to(out.dtype))

    return [gemm]


def _fast(fmt: Format, m: int, *outs: Any):
    """The tile-streaming GEMV kernels where they take this product (one row, their formats, f32 outputs or
    f16 cache rows), else None."""
    from fuselane.lanes.cuda.triton.gemv import fast as gemv_fast

    f32 = all(out.dtype in _store_types() for out in outs)
    return gemv_fast if f32 and gemv_fast.supports_fast(fmt, m) else None


def _q8_in(consumer: Op, name: str, fmt: Format, m: int, k: int, b: Bound, *outs: Any):
    """(the int8 GEMV module, the activation's Q8Acts, launches to run first) where `consumer` reads `name`
    quantized and the int8 kernels take it: the form its producer wrote, or, where the producer wrote only
    f32 (`fuse_quant=off`, or a producer that cannot quantize), the consumer's own quantizing launch first.
    None where it reads the f32 row (a format without a dp4a kernel reads the values the producer also
    writes in f32)."""
    from fuselane.lanes.cuda.triton.gemv import q8 as gemv_q8

    if not (gemv_q8.supports(fmt, m, k) and all(out.dtype in _store_types() for out in outs)):
        return None
    if name in b.q8:
        return gemv_q8, b.q8[name], []
    if b.reads_int8 is None or not b.reads_int8(consumer) or k % kernels.QBLOCK:
        return None
    from fuselane.lanes.cuda.triton import quant

    x = b.bufs[name]
    acts = b.scratch.setdefault(f"q8-read:{name}", quant.empty_q8(1, k, x.device))
    return gemv_q8, acts, [lambda: quant.quantize(x.view(1, k), acts)]


def _store_types():
    import torch

    return (torch.float32, torch.float16)


def _gemv_kernels(fmt: Format, m: int, out: Any):
    fast = _fast(fmt, m, out)
    if fast is not None:
        return fast.gemv_fast
    gemv, *_ = _t()
    return gemv.gemv


def _arange(n: int, device: Any):
    import torch

    return torch.arange(n, device=device)


def _prim(op: Op, b: Bound) -> list[Launch]:
    import torch

    _, norm, rope, attention, misc = _t()
    spec = op.sym
    ins = [b.bufs.get(n) for n in op.ins]
    if isinstance(spec, Matmul):
        return _product(op, b)
    if isinstance(spec, RmsNorm):
        x, out = ins[0], b.bufs[op.out]
        return [lambda: norm.rms_norm_plain(x.view(spec.rows, spec.cols), out.view(spec.rows, spec.cols), spec.eps)]
    if isinstance(spec, Elementwise):
        a = ins[0]
        other = b.vec[op.ins[1]] if op.ins[1] in b.vec else ins[1]
        out = b.bufs[op.out]
        fn = torch.add if spec.op is ElementwiseOp.ADD else torch.mul
        if spec.row:
            return [lambda: fn(a.view(-1, spec.cols), other.view(1, spec.cols), out=out.view(-1, spec.cols))]
        return [lambda: fn(a, other, out=out)]
    if isinstance(spec, Unary):
        x, out = ins[0], b.bufs[op.out]
        return [lambda: torch.mul(torch.sigmoid(x), x, out=out)]
    if isinstance(spec, Rope):
        x, out = ins[0], b.bufs[op.out]
        pos = b.bufs["pos"]
        return [lambda: rope.qk_norm_rope(x, out, pos, heads=spec.heads, hd=spec.hd, base=spec.base)]
    if isinstance(spec, SetRow):
        x, cache = ins[0], b.bufs[op.dst.buf]
        pos = b.bufs["pos"]
        return [lambda: rope.set_rows(x.view(spec.rows, spec.cols), cache, pos)]
    if isinstance(spec, Attention):
        return [_attention(op, b)]
    if isinstance(spec, TakeRows):
        x, out = ins[0], b.bufs[op.out]
        return [lambda: out.copy_(x.view(spec.rows, spec.cols)[spec.rows - spec.take :])]
    if isinstance(spec, RowsGather):
        table = b.dense(op.ins[0])
        ids, out = b.bufs[op.ins[1]], b.bufs[op.out]
        return [
            lambda: (
                torch.index_select(table, 0, ids.long(), out=out)
                if table.dtype == out.dtype
                else out.copy_(table.index_select(0, ids.long()))
            )
        ]
    if isinstance(spec, ArgMax):
        x, out = ins[0], b.bufs[op.out]
        scratch = misc.argmax_scratch(spec.rows, spec.cols, x.device)  # so a long row is read by many blocks
        return [lambda: misc.argmax(x, out, scratch=scratch)]
    raise NotImplementedError(f"the cuda lane has no launch for {type(spec).__name__}")


def _attention(op: Op, b: Bound, out_q8: Any = None) -> Launch:
    _, _, _, attention, _ = _t()
    spec: Attention = op.sym  # type: ignore[assignment]
    q, kc, vc = (b.bufs[n] for n in op.ins[:3])
    out, pos = b.bufs[op.out], b.bufs["pos"]
    shape = dict(heads=spec.heads, kv_heads=spec.kv_heads, hd=spec.hd, scale=spec.scale)
    if spec.rows == 1:
        scratch = b.scratch.setdefault("attn", attention.decode_scratch(spec.heads, spec.hd, spec.len, q.device))
        return lambda: attention.flash_decode(q, kc, vc, pos, out, scratch=scratch, out_q8=out_q8, **shape)
    from fuselane.lanes.cuda.triton.attention import prefill as attention_prefill

    f16 = b.attention_f16
    return lambda: attention_prefill.flash_prefill(q, kc, vc, pos, out, rows=spec.rows, f16_ops=f16, **shape)


# ---- native classes ---------------------------------------------------------------------------------------


def _norm_weight(op: Op, b: Bound):
    _, norm, *_ = _t()
    n_op, w_op = [p for p in leaves(op) if isinstance(p.sym, RmsNorm | Elementwise)][-2:]
    spec: RmsNorm = n_op.sym  # type: ignore[assignment]
    x, w, out = b.bufs[n_op.ins[0]], b.vec[w_op.ins[1]], b.bufs[w_op.out]
    return [lambda: norm.rms_norm(x.view(spec.rows, spec.cols), w, out.view(spec.rows, spec.cols), spec.eps)]


def _add_norm(op: Op, b: Bound, out_q8: Any = None):
    """AddNorm in one launch; with `out_q8` (AddNormQuant under int8 activations: a down projection's add and
    norm, `kernels.norm_in_own_launch`) the launch also writes the norm quantized."""
    _, norm, *_ = _t()
    add, n_op, w_op = leaves(op)[-3:]
    spec: RmsNorm = n_op.sym  # type: ignore[assignment]
    a, r, s = b.bufs[add.ins[0]], b.bufs[add.ins[1]], b.bufs[add.out]
    w, out = b.vec[w_op.ins[1]], b.bufs[w_op.out]
    rows = (spec.rows, spec.cols)
    if out_q8 is not None and spec.cols % kernels.QBLOCK:
        return None
    return [
        lambda: norm.rms_norm(
            a.view(rows), w, out.view(rows), spec.eps, residual=r.view(rows), sum_out=s.view(rows), out_q8=out_q8
        )
    ]


def _embed_norm(op: Op, b: Bound):
    _, norm, *_ = _t()
    gather, n_op, w_op = leaves(op)
    spec: RmsNorm = n_op.sym  # type: ignore[assignment]
    table, fmt = b.raw[gather.ins[0]]
    ids, rows_out = b.bufs[gather.ins[1]], b.bufs[gather.out]
    w, out = b.vec[w_op.ins[1]], b.bufs[w_op.out]
    return [lambda: norm.embed_norm(table, fmt, ids, w, rows_out, out, spec.eps)]


@dataclass(frozen=True, slots=True)
class _Side:
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


def _side(op: Op, b: Bound) -> _Side:
    found = leaves(op)
    r_op = next(p for p in found if isinstance(p.sym, Rope))
    spec: Rope = r_op.sym  # type: ignore[assignment]
    n_op = next((p for p in found if isinstance(p.sym, RmsNorm)), None)
    w_op = next((p for p in found if isinstance(p.sym, Elementwise)), None)
    appended = op.dst.row is not None
    return _Side(
        x=b.bufs[(n_op or r_op).ins[0]],
        out=b.bufs[op.dst.buf] if appended else b.bufs[r_op.out],
        heads=spec.heads,
        hd=spec.hd,
        base=spec.base,
        norm_w=b.vec[w_op.ins[1]] if w_op is not None else None,
        eps=n_op.sym.eps if n_op is not None else 0.0,  # type: ignore[union-attr]
        pitch=op.dst.row.pitch if appended else None,  # type: ignore[union-attr]
    )


def _rope_class(op: Op, b: Bound):
    _, _, rope, *_ = _t()
    s, pos = _side(op, b), b.bufs["pos"]
    args = dict(heads=s.heads, hd=s.hd, base=s.base, norm_w=s.norm_w, eps=s.eps, cache_row_pitch=s.pitch)
    return [lambda: rope.qk_norm_rope(s.x, s.out, pos, **args)]


def _rope_pair(q_op: Op, k_op: Op, b: Bound) -> Launch:
    """A layer's query and key rotations in one launch (the key appended to its cache where it is)."""
    _, _, rope, *_ = _t()
    q, k, pos = _side(q_op, b), _side(k_op, b), b.bufs["pos"]
    args = dict(
        heads=q.heads,
        kv_heads=k.heads,
        hd=q.hd,
        base=q.base,
        q_norm_w=q.norm_w,
        k_norm_w=k.norm_w,
        eps=q.eps,
        k_cache_row_pitch=k.pitch,
    )
    return lambda: rope.rope_q_k(q.x, k.x, q.out, k.out, pos, **args)


def _rope_qk(op: Op, b: Bound):
    q_op, k_op = op.sym.parts  # type: ignore[union-attr]
    if _side(q_op, b).pitch is not None:
        q_op, k_op = k_op, q_op
    return [_rope_pair(q_op, k_op, b)]


def _gemm_bias(op: Op, b: Bound):
    mm, add = leaves(op)
    return _product(mm, b, bias=add.ins[1], dst=add)


def _row_write(op: Op, b: Bound):
    found = leaves(op)
    mm = found[0]
    bias = found[1].ins[1] if len(found) == 3 else None
    return _product(mm, b, bias=bias, dst=found[-1])


def _gate_up(op: Op, b: Bound, out_q8: Any = None):
    gemv, *_ = _t()
    gate, up = (p for p in leaves(op) if isinstance(p.sym, Matmul))
    spec: Matmul = gate.sym  # type: ignore[assignment]
    if spec.m > kernels.GEMV_ROWS:
        return None
    x, out = b.bufs[gate.ins[0]], b.bufs[op.out]
    (wg, fmt), (wu, _) = b.raw[gate.ins[1]], b.raw[up.ins[1]]
    q8 = _q8_in(op, gate.ins[0], fmt, spec.m, spec.k, b, out)
    if q8 is not None:
        gemv_q8, acts, first = q8
        if out_q8 is None:
            return [*first, lambda: gemv_q8.gemv_q8_gate_up_glu(acts, wg, wu, fmt, spec.n, spec.k, out)]
        from fuselane.lanes.cuda.triton.gemv import q8_epilogue as qe

        if spec.n % kernels.QBLOCK == 0:
            counters = b.scratch.setdefault(f"glu-q8:{op.out}", qe.q8_counters(spec.n, out.device))
            n, k = spec.n, spec.k
            return [*first, lambda: qe.gemv_q8_gate_up_glu_q8(acts, wg, wu, fmt, n, k, out, out_q8, counters)]
        return None
    if out_q8 is not None:
        return None
    fast = _fast(fmt, spec.m, out)
    if fast is not None:
        return [lambda: fast.gemv_fast_gate_up_glu(x, wg, wu, fmt, spec.n, spec.k, out)]
    return [lambda: gemv.gemv_gate_up_glu(x, wg, wu, fmt, spec.n, spec.k, out)]


def _merged(op: Op, b: Bound):
    """Products of one activation in parts: one GEMV launch, then each part's epilogue launch (rotations), or
    under `rope_epilogue` one int8 GEMV launch that turns the query and the key itself."""
    gemv, *_ = _t()
    members = op.sym.parts  # type: ignore[union-attr]
    products, after, turned = [], [], []
    for m in members:
        found = leaves(m)
        mm = found[0]
        spec: Matmul = mm.sym  # type: ignore[assignment]
        if spec.m > kernels.GEMV_ROWS:
            return None
        cls = class_of(m)
        bias = next((p.ins[1] for p in found if isinstance(p.sym, Elementwise) and p.ins[0] == mm.out), None)
        landing = found[-1] if cls in (C.ROW_WRITE,) else (found[1] if bias else mm)
        out, row = _rows_view(b, landing)
        products.append((b.raw[mm.ins[1]][0], spec.n, out, b.vec[bias] if bias else None, row))
        if cls is C.QKV_HEAD_EPILOGUE:
            after.append(m.sym.parts[1])  # type: ignore[union-attr]
            turned.append(len(products) - 1)
    x, fmt = b.bufs[members[0].ins[0]], b.raw[leaves(members[0])[0].ins[1]][1]
    k = leaves(members[0])[0].sym.k  # type: ignore[union-attr]
    q8 = _q8_in(op, members[0].ins[0], fmt, x.shape[0], k, b, *(p[2] for p in products))
    if q8 is not None:
        gemv_q8, acts, first = q8
        fused = _turned_in_gemv(list(zip(turned, after, strict=True)), products, acts, fmt, k, b)
        if fused is not None:
            return [*first, fused]
        return [*first, lambda: gemv_q8.gemv_q8_parts(acts, products, fmt), *_turns(after, b)]
    turns = _turns(after, b)
    fast = _fast(fmt, x.shape[0], *(p[2] for p in products))
    if fast is not None:
        return [lambda: fast.gemv_fast_parts(x, products, fmt), *turns]
    return [lambda: gemv.gemv_parts(x, products, fmt), *turns]


def _turned_in_gemv(turned: list[tuple[int, Op]], products: list, acts: Any, fmt: Format, k: int, b: Bound):
    """Under `rope_epilogue`, the int8 GEMV in parts that turns a query's and a key's heads in its epilogue
    (`gemv_q8_rope`): one launch for the product and its rotations, where they are one query (landing in a
    buffer) and one key turned alike, and the GEMV's tile divides a head; under `auto` only where they are
    the GEMV's only parts (the layer's V takes a launch of its own). None otherwise."""
    if b.rope_in_gemv is RopeEpilogue.OFF or len(turned) != 2:
        return None
    if b.rope_in_gemv is RopeEpilogue.AUTO and len(products) != len(turned):
        return None
    from fuselane.lanes.cuda.triton.gemv import q8 as gemv_q8
    from fuselane.lanes.cuda.triton.gemv import q8_rope as gemv_q8_rope

    (qi, q_op), (ki, k_op) = turned if _side(turned[0][1], b).pitch is None else turned[::-1]
    q, kk = _side(q_op, b), _side(k_op, b)
    alike = (q.hd, q.base, q.eps, q.norm_w is None) == (kk.hd, kk.base, kk.eps, kk.norm_w is None)
    # the epilogue turns what the part wrote: the rotations must read the parts' own outputs
    reads_parts = all(s.x.data_ptr() == products[i][2].data_ptr() for i, s in ((qi, q), (ki, kk)))
    block_n = gemv_q8._tile_plan(fmt, k, None, None, None)["BLOCK_N"]
    if q.pitch is not None or not alike or not reads_parts or q.hd % block_n:
        return None
    counters = b.scratch.setdefault(f"rope-q8:{q_op.out}", gemv_q8_rope.rope_counters(q.heads, kk.heads, acts.q.device))
    q_turn = gemv_q8_rope.Turn(qi, q.out, q.heads, None, q.norm_w)
    k_turn = gemv_q8_rope.Turn(ki, kk.out, kk.heads, kk.pitch, kk.norm_w)
    pos = b.bufs["pos"]
    return lambda: gemv_q8_rope.gemv_q8_parts_rope(
        acts, products, fmt, q_turn, k_turn, pos, counters, hd=q.hd, base=q.base, eps=q.eps
    )


def _turns(sides: list[Op], b: Bound) -> list[Launch]:
    """The rotations a GEMV in parts leaves for its epilogue: a query and a key go in one launch."""
    if len(sides) == 2:
        q_op, k_op = sides if _side(sides[1], b).pitch is not None else sides[::-1]
        if _side(q_op, b).pitch is None and (_side(q_op, b).norm_w is None) == (_side(k_op, b).norm_w is None):
            return [_rope_pair(q_op, k_op, b)]
    return [launch for side in sides for launch in bind(side, b)]


def _norm_epilogue(op: Op, b: Bound, out_q8: Any = None):
    """A projection with its residual add and norm: one launch whose last program norms the sum (a step's one
    row), or the product with the residual then the norm (a chunk's rows). With `out_q8` (int8 activations)
    the last program writes the norm quantized too, where the product reads its own activation quantized."""
    mm = op.sym.parts[0]  # type: ignore[union-attr]
    add_norm = op.sym.parts[1]  # type: ignore[union-attr]
    add, n_op, w_op = leaves(add_norm)
    residual = add.ins[0] if add.ins[1] == mm.out else add.ins[1]
    spec: RmsNorm = n_op.sym  # type: ignore[assignment]
    s, w, out = b.bufs[add.out], b.vec[w_op.ins[1]], b.bufs[w_op.out]
    product: Matmul = mm.sym  # type: ignore[assignment]
    wt, fmt = b.raw[mm.ins[1]]
    if product.m == 1:
        from fuselane.lanes.cuda.triton.gemv import epilogue as gemv_epilogue
        from fuselane.lanes.cuda.triton.gemv import fast_norm as gemv_fast_norm

        x, r = b.bufs[mm.ins[0]], b.bufs[residual]
        counter = gemv_epilogue.gemv_add_norm_counter(x.device)  # its own: launches on one stream in turn
        n, k = product.n, product.k
        q8 = _q8_in(mm, mm.ins[0], fmt, 1, k, b, out)
        if q8 is not None and n % kernels.QBLOCK == 0:
            from fuselane.lanes.cuda.triton.gemv import q8_epilogue as qe
            from fuselane.lanes.cuda.triton.quant import empty_q8

            _, acts, first = q8
            # a norm no product reads quantized still goes through the one kernel: its int8 form is dropped
            oq = out_q8 if out_q8 is not None else b.scratch.setdefault(f"q8-drop:{n}", empty_q8(1, n, x.device))
            return [*first, lambda: qe.gemv_q8_add_norm(acts, wt, fmt, n, k, r, s, w, spec.eps, out, oq, counter)]
        if out_q8 is not None:
            return None
        if gemv_fast_norm.supports_fast_add_norm(fmt, n):
            return [lambda: gemv_fast_norm.gemv_fast_add_norm(x, wt, fmt, n, k, r, s, w, spec.eps, out, counter)]
        return [lambda: gemv_epilogue.gemv_add_norm(x, wt, fmt, n, k, r, s, w, spec.eps, out, counter)]
    _, norm, *_ = _t()
    rows = (spec.rows, spec.cols)
    return [
        *_product(mm, b, residual=residual, dst=add),
        lambda: norm.rms_norm(s.view(rows), w, out.view(rows), spec.eps),
    ]


def _glu(op: Op, b: Bound):
    *_, misc = _t()
    act, mul = leaves(op)
    g, u, out = b.bufs[act.ins[0]], b.bufs[mul.ins[1]], b.bufs[mul.out]
    return [lambda: misc.glu_act_mul(g, u, out)]


def _flash(op: Op, b: Bound, out_q8: Any = None):
    return [_attention(leaves(op)[0], b, out_q8)]


def _quantizing(op: Op, b: Bound):
    """A producer that writes its result quantized (NormQuant, GluActMulQuant, AttnOutputQuant, ...): in a
    decode step, its kernel writing the int8 form in its epilogue where it has one, else its launches then
    one quantizing launch; in a prefill chunk (no int8 GEMM: its products read the f32 rows on the f16
    tensor cores) just its launches."""
    inner = op.sym.parts[0]  # type: ignore[union-attr]
    out_q8 = b.q8.get(op.out)
    if out_q8 is None:
        return None
    epilogue = _QUANT_EPILOGUE.get(class_of(inner))
    if epilogue is None and isinstance(inner.sym, Attention) and inner.sym.rows == 1:
        return [_attention(inner, b, out_q8)]
    found = epilogue(inner, b, out_q8) if epilogue is not None else None
    if found is not None:
        return found
    from fuselane.lanes.cuda.triton import quant

    x = b.bufs[op.out]
    return [*bind(inner, b), lambda: quant.quantize(x.view(out_q8.q.shape), out_q8)]


NATIVE: dict[C, Callable[[Op, Bound], list[Launch] | None]] = {
    C.NORM_WEIGHT: _norm_weight,
    C.ADD_NORM: _add_norm,
    C.EMBED_NORM: _embed_norm,
    C.QK_NORM_ROPE: _rope_class,
    C.QK_NORM_ROPE_KV_APPEND: _rope_class,
    C.ROPE_KV_APPEND: _rope_class,
    C.ROPE_QK_ONE_LAUNCH: _rope_qk,
    C.GEMM_BIAS: _gemm_bias,
    C.ROW_WRITE: _row_write,
    C.GEMV_GATE_UP_GLU: _gate_up,
    C.MERGED_QKV: _merged,
    C.GEMV_NORM_EPILOGUE: _norm_epilogue,
    C.GLU_ACT_MUL: _glu,
    C.FLASH_DECODE: _flash,
    C.FLASH_PREFILL: _flash,
    **{cls: _quantizing for cls in QUANT_EPILOGUES},
}
# producers whose kernel writes its result's int8 form in its own epilogue (a decode step's)
_QUANT_EPILOGUE: dict[C, Callable[[Op, Bound, Any], list[Launch] | None]] = {
    C.ADD_NORM: _add_norm,
    C.GEMV_NORM_EPILOGUE: _norm_epilogue,
    C.GEMV_GATE_UP_GLU: _gate_up,
    C.FLASH_DECODE: _flash,
}
