"""Binding a plan's ops to launches: each op of the plan becomes one closure over the lane's buffers, one kernel
launch (a view, none), through one table, `BINDERS`: a native class or a primitive's spec -> its binder.

Every choice that changes what launches was made by the optimizer (the lane's rules and its shim's answers),
so a binder only picks among kernels that launch the same way (the int8 GEMV where the plan quantized the
activation, the register-tiled GEMV where it takes the format) and never adds or drops a launch: `bind`
checks it. Everything a launch reads or writes is a buffer allocated once per session, and the position is a
device value, so the launches of a decode step can be captured in a CUDA graph and replayed at every
position.

A batch's step over a paged KV pool (`Bound.paged`, `fuselane.engine.cuda`) binds the same plan ops with three
differences: its rotations turn each row at its own position; the rows its plan writes "into the cache" land in
the step's staging rows (the cache buffers it is given, at row 0 + i), which its attention stores into each
row's block before attending over the row's blocks (`attention/paged.py`); and up to the GEMV's rows its
products run as GEMVs over all the batch's rows (the int8 GEMV over the rows, `q8_rows`, where the plan
quantized them), past them as a chunk's GEMMs (never the int8 GEMM: `CudaShim.int8_gemm`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fuselane.fuse.optimizer import launches_of
from fuselane.fuse.views import class_of, leaves
from fuselane.gguf.formats import Format
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Op, TensorGraph
from fuselane.graph.ops import (
    ArgMax,
    Attention,
    CausalConv,
    ConvShift,
    DeltaState,
    Elementwise,
    ElementwiseOp,
    GatedDelta,
    HeadMatmul,
    Join,
    L2Norm,
    Matmul,
    Quantize,
    RmsNorm,
    Rope,
    RowScale,
    RowsGather,
    SetRow,
    Slice,
    TakeRows,
    Unary,
    UnaryOp,
)
from fuselane.lanes.cuda.plan.classes import QUANT_EPILOGUES
from fuselane.lanes.cuda.plan.knobs import H200
from fuselane.lanes.cuda.run import gdn_launch, mla_launch, moe_launch, product_launch, rope_launch
from fuselane.lanes.cuda.run.mismatch import PlanMismatch

Launch = Callable[[], None]


@dataclass(frozen=True, slots=True)
class PagedRows:
    """A batch's rows over a paged KV pool, as device values a captured graph replays with: each row's position,
    the pool row its new key and value go to, its block table (padded to one width) and its length (position
    + 1); the pool's tensors by the plan's cache names."""

    positions: Any  # int32 (rows,)
    slots: Any  # int32 (rows,)
    tables: Any  # int32 (rows, width)
    lens: Any  # int32 (rows,)
    pools: dict[str, Any]  # cache name -> (rows of every block, width) in the cache's precision
    block_size: int


@dataclass(slots=True)
class Bound:
    """What launches are bound against: the plan's graph, buffers by name, weights, and the scalar facts."""

    g: TensorGraph
    bufs: dict[str, Any]  # name -> torch tensor (activations, caches, ids, pos)
    raw: dict[str, tuple[Any, Format]]  # matrix name -> (uint8 bytes on the device, format)
    vec: dict[str, Any]  # vector weights (norms, biases) as f32 device tensors
    dense: Callable[[str], Any]  # matrix name -> dequantized f16 device matrix (prefill=f16-copy's GEMMs)
    scratch: dict[str, Any] = field(default_factory=dict)
    in_place: bool = False  # a chunk's products the int8 GEMM does not take decode the weights to f16 in the kernel
    q8: dict[str, Any] = field(default_factory=dict)  # name -> quant.Q8Acts: the int8 forms the plan writes
    attention_f16: bool = False  # a chunk's attention multiplies on the f16 tensor cores (`CudaShim.attention`)
    latent_packed: bool = False  # a decode step's latent attention takes `triton/mla/packed.py` (`latent_decode`)
    paged: PagedRows | None = None  # a batch's step over a paged KV pool (see the module)
    # the chip's multiprocessors (`Chip.sms`), which kernels size their grids by: the super-block GEMM's tile,
    # the paged attention's splits of each row's span (`paged.paged_plan`)
    sms: int = H200.sms
    f16_scratch: Any = None  # under `prefill=f16-scratch`: the f16 buffer a chunk product decodes its matrix into
    delta_products: str = "tf32x3"  # the chunked gated delta rule's `tl.dot` precision (`CudaKnobs.delta_products`)
    # (id of an op or of a part, activation) where the activation dies unwritten and a chunk's product may round
    # it to f16 in its own bytes (`buffers.dying_reads`); empty unless the lane's workspace asks for that
    dying: frozenset[tuple[int, str]] = frozenset()


def _t():
    """The Triton kernel modules, imported on first bind: the lane loads torch and Triton only when used."""
    from fuselane.lanes.cuda.triton import misc, norm, rope
    from fuselane.lanes.cuda.triton.attention import decode as attention

    return norm, rope, attention, misc


def binder_of(op: Op) -> Binder:
    """The binder of an op: its class's, or its primitive spec's."""
    cls = class_of(op)
    binder = BINDERS.get(cls if cls is not None else type(op.sym))
    if binder is None:
        name = cls.value if cls is not None else type(op.sym).__name__
        raise PlanMismatch(f"the cuda lane has no launch for {name}")
    return binder


def bind(op: Op, b: Bound) -> list[Launch]:
    """The launches of one op of the plan: as many as the plan counts (`launches_of`: one, none for a view,
    a fused op's own count)."""
    launches = binder_of(op)(op, b)
    expected = launches_of(op)
    if len(launches) != expected:
        raise PlanMismatch(f"{op.out} bound to {len(launches)} launches, the plan says {expected}")
    return launches


def _one(op: Op, b: Bound) -> Launch:
    """The one launch of an op a binder runs inside its own (a fold's producer)."""
    (launch,) = bind(op, b)
    return launch


# ---- primitives -------------------------------------------------------------------------------------------


def _rms_norm(op: Op, b: Bound):
    norm, *_ = _t()
    spec: RmsNorm = op.sym  # type: ignore[assignment]
    x, out = b.bufs[op.ins[0]], b.bufs[op.out]
    return [lambda: norm.rms_norm_plain(x.view(spec.rows, spec.cols), out.view(spec.rows, spec.cols), spec.eps)]


def _elementwise(op: Op, b: Bound):
    import torch

    spec: Elementwise = op.sym  # type: ignore[assignment]
    a = b.bufs[op.ins[0]]
    other = b.vec[op.ins[1]] if op.ins[1] in b.vec else b.bufs[op.ins[1]]
    out = b.bufs[op.out]
    fn = torch.add if spec.op is ElementwiseOp.ADD else torch.mul
    if spec.op is ElementwiseOp.ADD and not spec.row and _whole_f32(a, other, out):
        *_, misc = _t()
        return [lambda: misc.add(a, other, out)]  # a dependent launch, where torch's add ends the chain
    if spec.row:
        # an input may be a slice's strided view (a gate's values): read through a copy where it is not contiguous
        return [lambda: fn(a.reshape(-1, spec.cols), other.view(1, spec.cols), out=out.view(-1, spec.cols))]
    return [lambda: fn(a, other, out=out)]


def _whole_f32(*tensors: Any) -> bool:
    """Whether each is a contiguous f32 tensor of as many values as the first (`misc.add` takes them)."""
    import torch

    first = tensors[0].numel()
    return all(t.is_contiguous() and t.dtype == torch.float32 and t.numel() == first for t in tensors)


def _unary(op: Op, b: Bound):
    import torch

    x = b.bufs[op.ins[0]]
    out = b.bufs[op.out].view(x.shape)  # the input may be a slice's (groups, width) view
    kind = op.sym.op  # type: ignore[union-attr]
    if kind is UnaryOp.SIGMOID:
        return [lambda: torch.sigmoid(x, out=out)]
    if kind is UnaryOp.SOFTPLUS:
        return [lambda: out.copy_(torch.nn.functional.softplus(x))]
    return [lambda: torch.mul(torch.sigmoid(x), x, out=out)]


def _set_row(op: Op, b: Bound):
    _, rope, *_ = _t()
    spec: SetRow = op.sym  # type: ignore[assignment]
    x, cache, pos = b.bufs[op.ins[0]], b.bufs[op.dst.buf], b.bufs["pos"]
    return [lambda: rope.set_rows(x.view(spec.rows, spec.cols), cache, pos)]


def _take_rows(op: Op, b: Bound):
    """A chunk's last rows: a view of its input, which the ops after it read in place (no launch)."""
    spec: TakeRows = op.sym  # type: ignore[assignment]
    b.bufs[op.out] = b.bufs[op.ins[0]].view(spec.rows, spec.cols)[spec.rows - spec.take :]
    return []


def _gather(op: Op, b: Bound):
    import torch

    name, ids, out = op.ins[0], b.bufs[op.ins[1]], b.bufs[op.out]

    def gather() -> None:
        table = b.dense(name)  # made by the first run, as a product's f16 copy
        if table.dtype == out.dtype:
            torch.index_select(table, 0, ids.long(), out=out)
        else:
            out.copy_(table.index_select(0, ids.long()))

    return [gather]


def _argmax(op: Op, b: Bound):
    *_, misc = _t()
    spec: ArgMax = op.sym  # type: ignore[assignment]
    x, out = b.bufs[op.ins[0]], b.bufs[op.out]
    scratch = misc.argmax_scratch(spec.rows, spec.cols, x.device)  # so a long row is read by many blocks
    return [lambda: misc.argmax(x, out, scratch=scratch)]


def _quantize(op: Op, b: Bound):
    """An activation's int8 form, where its producer wrote it in f32 only (the lane rule `quantize_apart`)."""
    from fuselane.lanes.cuda.triton import quant

    spec: Quantize = op.sym  # type: ignore[assignment]
    x, acts = b.bufs[op.ins[0]], b.q8[op.out]
    return [lambda: quant.quantize(x.view(spec.rows, spec.cols), acts)]


def _attention(op: Op, b: Bound, out_q8: Any = None, gate: Any = None, out: Any = None):
    """An attention's launch; with `gate` (AttnOutputGate) its output times sigmoid(gate) lands in `out`."""
    _, _, attention, _ = _t()
    spec: Attention = op.sym  # type: ignore[assignment]
    if spec.value_width != spec.hd:  # the latent cache: values its rows' first part
        return mla_launch.latent_attention(op, b, out_q8)
    q, kc, vc = (b.bufs[n] for n in op.ins[:3])
    out, pos = (out if out is not None else b.bufs[op.out]), b.bufs["pos"]
    shape = dict(heads=spec.heads, kv_heads=spec.kv_heads, hd=spec.hd, scale=spec.scale)
    if b.paged is not None:
        return [_paged_attention(op, b, spec, out_q8)]
    if spec.rows == 1:
        scratch = b.scratch.setdefault("attn", attention.decode_scratch(spec.heads, spec.hd, spec.len, q.device))
        g1 = gate.view(spec.heads, -1) if gate is not None else None  # one row: a head's gate a row
        f16 = b.attention_f16
        return [
            lambda: attention.flash_decode(
                q, kc, vc, pos, out, scratch=scratch, out_q8=out_q8, gate=g1, f16_ops=f16, **shape
            )
        ]
    from fuselane.lanes.cuda.triton.attention import prefill as attention_prefill

    f16 = b.attention_f16
    g3 = gate.view(spec.rows, spec.heads, -1) if gate is not None else None
    return [
        lambda: attention_prefill.flash_prefill(
            q, kc, vc, pos, out, rows=spec.rows, f16_ops=f16, out_q8=out_q8, gate=g3, **shape
        )
    ]


def _paged_attention(op: Op, b: Bound, spec: Attention, out_q8: Any) -> Launch:
    """A batch's attention over the pool: its rows' new keys and values (staged where the plan's cache writes
    landed) stored into their blocks, then each row over its own blocks. One launch of the plan's, two
    kernels."""
    from fuselane.lanes.cuda.triton.attention import paged as attention_paged

    p: PagedRows = b.paged  # type: ignore[assignment]
    k_name, v_name = op.ins[1], op.ins[2]
    rows, width = spec.rows, spec.heads * spec.hd
    q, out = b.bufs[op.ins[0]].view(rows, width), b.bufs[op.out].view(rows, width)
    k_new, v_new = b.bufs[k_name], b.bufs[v_name]
    k_pool, v_pool = p.pools[k_name], p.pools[v_name]
    shape = dict(heads=spec.heads, kv_heads=spec.kv_heads, hd=spec.hd, scale=spec.scale, block_size=p.block_size)
    span = p.tables.shape[1] * p.block_size
    plan = attention_paged.paged_plan(rows, spec.heads, spec.kv_heads, span, sms=b.sms, hd=spec.hd)
    need = attention_paged.paged_scratch_size(plan, rows, spec.heads, spec.hd, quantized=out_q8 is not None)
    # one scratch for every layer's attention of a size: the launches run in turn, each leaving its counters at 0
    scratch = b.scratch.setdefault(f"paged {need}", q.new_zeros(need)) if need else None

    def attend() -> None:
        attention_paged.store_kv(k_new, v_new, k_pool, v_pool, p.slots)
        attention_paged.paged_decode(
            q, k_pool, v_pool, p.tables, p.lens, out, out_q8=out_q8, scratch=scratch, sms=b.sms, **shape
        )

    return attend


def _attn_output_gate(op: Op, b: Bound, out_q8: Any = None):
    """AttnOutputGate: the attention with its gate's sigmoid in the store, one launch (the gate a slice's view
    of the query product, each head's gate after its query)."""
    found = leaves(op)
    att = next(p for p in found if isinstance(p.sym, Attention))
    sig = next(p for p in found if isinstance(p.sym, Unary))
    mul = next(p for p in found if isinstance(p.sym, Elementwise))
    return _attention(att, b, out_q8, gate=b.bufs[sig.ins[0]], out=b.bufs[mul.out])


# ---- native classes ---------------------------------------------------------------------------------------


def _norm_weight(op: Op, b: Bound):
    norm, *_ = _t()
    n_op, w_op = [p for p in leaves(op) if isinstance(p.sym, RmsNorm | Elementwise)][-2:]
    spec: RmsNorm = n_op.sym  # type: ignore[assignment]
    x, w, out = b.bufs[n_op.ins[0]], b.vec[w_op.ins[1]], b.bufs[w_op.out]
    return [lambda: norm.rms_norm(x.view(spec.rows, spec.cols), w, out.view(spec.rows, spec.cols), spec.eps)]


def _add_norm(op: Op, b: Bound, out_q8: Any = None):
    """AddNorm in one launch; with `out_q8` (AddNormQuant under int8 activations: a down projection's add and
    norm, `kernels.norm_in_own_launch`) the launch also writes the norm quantized."""
    norm, *_ = _t()
    add, n_op, w_op = leaves(op)[-3:]
    spec: RmsNorm = n_op.sym  # type: ignore[assignment]
    a, r, s = b.bufs[add.ins[0]], b.bufs[add.ins[1]], b.bufs[add.out]
    w, out = b.vec[w_op.ins[1]], b.bufs[w_op.out]
    rows = (spec.rows, spec.cols)
    return [
        lambda: norm.rms_norm(
            a.view(rows), w, out.view(rows), spec.eps, residual=r.view(rows), sum_out=s.view(rows), out_q8=out_q8
        )
    ]


def _embed_norm(op: Op, b: Bound):
    norm, *_ = _t()
    gather, n_op, w_op = leaves(op)
    spec: RmsNorm = n_op.sym  # type: ignore[assignment]
    table, fmt = b.raw[gather.ins[0]]
    product_launch.grid_table(fmt, table)  # a grid format's table, made before any capture
    ids, rows_out = b.bufs[gather.ins[1]], b.bufs[gather.out]
    w, out = b.vec[w_op.ins[1]], b.bufs[w_op.out]
    return [lambda: norm.embed_norm(table, fmt, ids, w, rows_out, out, spec.eps)]


def _glu(op: Op, b: Bound, out_q8: Any = None):
    """SwiGLU's product in one launch; with `out_q8` (GluActMulQuant: a chunk's, for the down product on the
    int8 tensor cores) the launch also writes its int8 form."""
    *_, misc = _t()
    act, mul = leaves(op)
    g, u, out = b.bufs[act.ins[0]], b.bufs[mul.ins[1]], b.bufs[mul.out]
    return [lambda: misc.glu_act_mul(g, u, out, out_q8)]


def _flash(op: Op, b: Bound, out_q8: Any = None):
    return _attention(leaves(op)[0], b, out_q8)


def _quantizing(op: Op, b: Bound):
    """A producer that writes its result's int8 form too (NormQuant, GluActMulQuant, AttnOutputQuant, ...): its
    kernel with the int8 epilogue. The lane rule `quantize_apart` left only producers that have one; where the
    step keeps no int8 form (a chunk's rows, whose products read f32), the producer's own launch."""
    inner = op.sym.parts[0]  # type: ignore[union-attr]
    out_q8 = b.q8.get(op.out)
    if out_q8 is None:
        return bind(inner, b)
    cls = class_of(inner)
    epilogue = _QUANT_EPILOGUE.get(cls if cls is not None else type(inner.sym))
    if epilogue is None:
        raise PlanMismatch(f"{op.out}: no int8 epilogue for {cls.value if cls else type(inner.sym).__name__}")
    return epilogue(inner, b, out_q8)


Binder = Callable[[Op, Bound], list[Launch]]

# The one table: every class the shim runs natively, and every primitive, to its binder (a test holds the
# classes to `classes.NATIVE_CLASSES` and `QUANT_EPILOGUES`).
BINDERS: dict[C | type, Binder] = {
    Matmul: product_launch.product,
    RmsNorm: _rms_norm,
    Elementwise: _elementwise,
    Unary: _unary,
    Rope: rope_launch.rope,
    SetRow: _set_row,
    Attention: _attention,
    TakeRows: _take_rows,
    RowsGather: _gather,
    ArgMax: _argmax,
    Quantize: _quantize,
    RowScale: moe_launch.row_scale,
    Slice: gdn_launch.slice_view,
    Join: mla_launch.join,
    HeadMatmul: mla_launch.head_matmul,
    CausalConv: gdn_launch.conv,
    ConvShift: gdn_launch.conv,
    L2Norm: gdn_launch.l2_norm,
    GatedDelta: gdn_launch.step,
    DeltaState: gdn_launch.step,
    C.NORM_WEIGHT: _norm_weight,
    C.ADD_NORM: _add_norm,
    C.EMBED_NORM: _embed_norm,
    C.QK_NORM_ROPE: rope_launch.rope_class,
    C.QK_NORM_ROPE_KV_APPEND: rope_launch.rope_class,
    C.ROPE_KV_APPEND: rope_launch.rope_class,
    C.ROPE_QK_ONE_LAUNCH: rope_launch.rope_qk,
    C.GEMM_BIAS: product_launch.gemm_bias,
    C.ROW_WRITE: product_launch.row_write,
    C.GEMV_GATE_UP_GLU: product_launch.gate_up,
    C.MERGED_QKV: product_launch.merged,
    C.GEMV_NORM_EPILOGUE: product_launch.norm_epilogue,
    C.GLU_ACT_MUL: _glu,
    C.FLASH_DECODE: _flash,
    C.FLASH_PREFILL: _flash,
    C.ROUTER_TOPK: moe_launch.route_topk,
    C.MOE_TOKEN_SORT: moe_launch.route_topk,
    C.MOE_GATE_UP_ACT: moe_launch.gate_up_act,
    C.MOE_DOWN_COMBINE: moe_launch.down_combine,
    C.SHARED_EXPERT_FUSION: moe_launch.down_combine,
    C.MOE_DEFERRED_FINALIZE: moe_launch.down_combine,
    C.CONV_BIAS_SILU: gdn_launch.conv,
    C.CONV_SILU_L2NORM: gdn_launch.conv,
    C.GDN_GATING: gdn_launch.gating,
    C.GDN_GATE_PROJECTIONS: gdn_launch.gate_projections,
    C.CONV_PARTS: gdn_launch.conv_parts,
    C.GDN_STEP: gdn_launch.step,
    C.GATED_NORM: gdn_launch.gated_norm,
    C.ATTN_OUTPUT_GATE: _attn_output_gate,
    C.MLA: mla_launch.mla,
    C.JOIN_IN_PLACE: mla_launch.join_in_place,
    C.MLA_PROLOGUE: mla_launch.prologue,
    **{cls: _quantizing for cls in QUANT_EPILOGUES},
}
# Native classes that launch only as a part of another class's launch: a projection turns its heads in its
# epilogue in the int8 QKV GEMV in parts (the lane rule `rope_epilogue` runs every other one as its parts).
# A decode step's attention packs a key/value group's heads in tensor-core rows inside FlashDecode's launch
# (under the int8 numerics, `CudaShim.packs_gqa_rows`).
PARTS_ONLY: dict[C, C] = {C.QKV_HEAD_EPILOGUE: C.MERGED_QKV, C.ATTN_GQA_ROW_PACKING: C.FLASH_DECODE}
# Producers whose kernel writes its result's int8 form in its own epilogue (`CudaShim.quantizes_in_epilogue`).
_QUANT_EPILOGUE: dict[C | type, Callable[[Op, Bound, Any], list[Launch]]] = {
    C.ADD_NORM: _add_norm,
    C.GEMV_NORM_EPILOGUE: product_launch.norm_epilogue,
    C.GEMV_GATE_UP_GLU: product_launch.gate_up,
    C.GLU_ACT_MUL: _glu,
    C.FLASH_DECODE: _flash,
    C.FLASH_PREFILL: _flash,
    Attention: _attention,
    C.ATTN_OUTPUT_GATE: _attn_output_gate,
    C.GATED_NORM: gdn_launch.gated_norm,
    C.MOE_GATE_UP_ACT: moe_launch.gate_up_act,
    C.MOE_DEFERRED_FINALIZE: moe_launch.down_combine,
    HeadMatmul: mla_launch.head_matmul,
}
