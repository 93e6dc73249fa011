"""The cuda lane's shim against its specification: every `fits` refusal, `activation` at each knob setting, and the
`gemv_parts` lane rule on hand-built schedules (the `supports` table, `numerics` and the rules' order:
test_cuda_shim_answers.py; on the real models' shapes: test_cuda_launches.py; knobs and kernel facts:
test_cuda_knobs.py).

Ops here are built by hand: a fits check reads only the op, its parts and the storage of the weights it
multiplies, so a graph of a few weights is enough for every class, the mixture and recurrent ones included.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from fuselane.fuse.rewriter import Rewriter, Schedule
from fuselane.gguf.formats import Format
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import (
    WHOLE,
    Dst,
    Form,
    Fused,
    Op,
    QuantFormat,
    Role,
    RowAt,
    Rows,
    Strided,
    Tensor,
    TensorGraph,
    UnitPart,
    Values,
)
from fuselane.graph.ops import (
    Attention,
    AttentionExt,
    CausalConv,
    Elementwise,
    ElementwiseOp,
    ExpertMatmul,
    GateAct,
    GatedDelta,
    HeadMatmul,
    L2Norm,
    Matmul,
    Moe,
    RmsNorm,
    Rope,
    RouteWeights,
    RowsGather,
    SetRow,
    Softcap,
    TopK,
    Unary,
    UnaryOp,
)
from fuselane.lanes.cuda.plan import fits as fits_module
from fuselane.lanes.cuda.plan import fits_recurrent, kernels
from fuselane.lanes.cuda.plan.knobs import Activations, CudaKnobs
from fuselane.lanes.cuda.plan.shim import (
    CudaShim,
)

DEFAULT = CudaKnobs()
INT8 = CudaKnobs(activations=Activations.INT8)
ROUTED = CudaKnobs(route_in_norm=True)

# --- building ops by hand ----------------------------------------------------------------------------------

WEIGHTS = {
    "q4k": Rows(Format.Q4_K),
    "q6k": Rows(Format.Q6_K),
    "q8": Rows(Format.Q8_0),
    "q5k": Rows(Format.Q5_K),
    "q2k": Rows(Format.Q2_K),
    "mxfp4": Rows(Format.MXFP4),  # (`undecoded`: a format no GEMV decodes)
    "f32": Values("f32"),
    "f16": Rows(Format.F16),
    "norm": Values("f32"),
}


def graph(rows: int = 1) -> TensorGraph:
    """The weights, and a gated pair's SwiGLU writing "glu" (what a down projection reads)."""
    g = TensorGraph(Form.DECODE if rows == 1 else Form.PREFILL, rows)
    for name, storage in WEIGHTS.items():
        g.add(Tensor(name, (1, 1), storage, Role.WEIGHT))
    g.emit(Unary(UnaryOp.SILU, rows, 12288), ("gate",), "silu")
    g.emit(Elementwise(ElementwiseOp.MUL, rows, 12288), ("silu", "up"), "glu")
    g.emit(Matmul(rows, 4096, 2048), ("xf", "f16"), "qkv")  # a product of "xf" a GEMV in parts takes others with
    return g


def prim(spec, ins: tuple[str, ...], out: str, dst: Dst | None = None, access=None) -> Op:
    return Op(spec, ins, access or tuple(WHOLE for _ in ins), out, dst or Dst(out))


def fused(cls: C, *members: Op, dst: Dst | None = None) -> Op:
    """A fold of `members`: reading what they read from outside, writing where the last writes."""
    made = {m.out for m in members}
    ins = tuple(dict.fromkeys(n for m in members for n in m.ins if n not in made))
    last = members[-1]
    return Op(Fused(cls, members), ins, tuple(WHOLE for _ in ins), last.out, dst or last.dst)


def matmul(m: int, n: int, k: int, w: str = "q4k", x: str = "x", out: str = "y", dst: Dst | None = None) -> Op:
    return prim(Matmul(m, n, k), (x, w), out, dst)


def unary(cols: int = 64, x: str = "u", out: str = "silu") -> Op:
    return prim(Unary(UnaryOp.SILU, 1, cols), (x,), out)


def mul(cols: int = 64, a: str = "silu", b: str = "up", out: str = "glu") -> Op:
    return prim(Elementwise(ElementwiseOp.MUL, 1, cols), (a, b), out)


def norm_weight(rows: int, cols: int, x: str = "s", out: str = "h") -> Op:
    return fused(
        C.NORM_WEIGHT,
        prim(RmsNorm(rows, cols, 1e-6), (x,), out + ".normed"),
        prim(Elementwise(ElementwiseOp.MUL, rows, cols, row=True), (out + ".normed", "norm"), out),
    )


def add_norm(rows: int, cols: int, a: str = "y") -> Op:
    add = prim(Elementwise(ElementwiseOp.ADD, rows, cols), (a, "resid"), "s")
    return fused(C.ADD_NORM, add, norm_weight(rows, cols))


def rotation(heads: int = 32, hd: int = 128, x: str = "y", out: str = "rot", normed: bool = False) -> Op:
    turn = prim(Rope(1, heads, hd, 1e6), (x, "pos"), out)
    if not normed:
        return turn
    return fused(C.QK_NORM_ROPE, norm_weight(heads, hd, x=x, out=out + ".n"), prim(turn.sym, (out + ".n", "pos"), out))


def attention(rows: int = 1, hd: int = 128, ext: AttentionExt | None = None, access=None) -> Op:
    spec = Attention(rows, 32, 8, hd, 4096, hd**-0.5, ext=ext)
    return prim(spec, ("q", "kc", "vc", "pos"), "att", access=access)


def mixture(k: int = 8, d: int = 2048, dst: Dst | None = None) -> Op:
    return prim(Moe(1, d, 768, 128, k), ("x", "router"), "moe", dst)


def shared_expert(k: int = 8, bias: bool = False, down: bool = True, down_w: str = "q4k", gate_w: str = "q4k") -> Op:
    gate, up = matmul(1, 512, 2048, gate_w, out="sg"), matmul(1, 512, 2048, gate_w, out="up")
    glu = fused(C.GEMV_GATE_UP_GLU, gate, up, fused(C.GLU_ACT_MUL, unary(512, "sg"), mul(512)))
    tail = [matmul(1, 2048, 512, down_w, x="glu", out="shared")] if down else []
    if bias:
        tail.append(prim(Elementwise(ElementwiseOp.ADD, 1, 2048, row=True), ("shared", "norm"), "biased"))
    return fused(C.SHARED_EXPERT_FUSION, mixture(k), glu, *tail)


def conv(taps: int = 4, chan: int = 2048) -> Op:
    return fused(
        C.CONV_BIAS_SILU, prim(CausalConv(1, chan, taps), ("x", "cw"), "c"), unary(chan, "c", "cs" + str(taps))
    )


def gated_attention(hd: int) -> Op:
    return fused(C.ATTN_OUTPUT_GATE, attention(hd=hd), mul(32 * hd, "att", "gate", "gated"))


def routing(router: str = "f16", experts: int = 128, rows: int = 1, x: str = "h") -> Op:
    """A router's product, top-k and weights over `experts` experts (a RouterTopk's parts) of `rows` rows of x."""
    scores = matmul(rows, experts, 2048, router, x=x, out="scores")
    top = prim(TopK(rows, experts, 8), ("scores",), "ids")
    return fused(C.ROUTER_TOPK, scores, top, prim(RouteWeights(rows, experts, 8, True), ("scores", "ids"), "rw"))


def routed_norm(quant: bool = True, **kw) -> Op:
    """A routing that took in the output projection whose norm it reads (`route_in_norm`)."""
    normed = gne(2048, first=matmul(1, 2048, 4096))
    return fused(C.ROUTER_TOPK, fused(C.NORM_QUANT, normed) if quant else normed, routing(**kw))


def gate_up_glu(n: int = 12288, m: int = 1, up: str = "q4k", gate: str = "q4k") -> Op:
    return fused(
        C.GEMV_GATE_UP_GLU,
        matmul(m, n, 4096, gate, out="g"),
        matmul(m, n, 4096, up, out="up"),
        fused(C.GLU_ACT_MUL, unary(n, "g"), mul(n)),
    )


# --- (a) every fits refusal -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """An op the lane fits and one it refuses, with the refusal's text."""

    name: str
    fits: Callable[[], Op]
    refused: Callable[[], Op]
    reason: str
    knobs: CudaKnobs = DEFAULT
    rows: int = 1  # the graph's: a step's one row, or a chunk's


def gne(n: int, m: int = 1, first: Op | None = None) -> Op:
    return fused(C.GEMV_NORM_EPILOGUE, first or matmul(m, n, n), add_norm(m, n))


def mdf(first: Op, cols: int = 2048) -> Op:
    return fused(C.MOE_DEFERRED_FINALIZE, first, add_norm(1, cols, a=first.out))


def qkv(hd: int = 128) -> Op:
    return fused(C.QKV_HEAD_EPILOGUE, matmul(1, 4096, 4096), rotation(4096 // hd, hd))


def conv_l2(cols: int) -> Op:
    return fused(C.CONV_SILU_L2NORM, conv(), prim(L2Norm(2048 // cols, cols, 1e-6), ("cs4",), "l2"))


def unit_dst(width: int) -> Dst:
    return Dst("wide", unit=UnitPart(256, 0, width))


CASES = [
    Case(
        "accumulator",
        lambda: matmul(1, 64, 4096),
        lambda: matmul(1, 64, 140_000),
        "a product of 140000 int8 terms overflows the lane's 32-bit accumulator",
        INT8,
    ),
    Case(
        "softcap attention",
        lambda: attention(),
        lambda: attention(ext=AttentionExt(softcap=30.0)),
        "the lane's attention takes no soft cap",
    ),
    Case(
        "softcap",
        lambda: unary(),
        lambda: prim(Softcap(1, 64, 30.0), ("u",), "capped"),
        "the lane links no soft-capped tensor",
    ),
    Case(
        "sigmoid gated delta",
        lambda: prim(GatedDelta(1, 4, 128, 128), ("q", "k", "v", "g"), "o"),
        lambda: prim(GatedDelta(1, 4, 128, 128, GateAct.SIGMOID), ("q", "k", "v", "g"), "o"),
        "the lane's gated delta gates by SiLU, not a sigmoid",
    ),
    Case(
        "unit destination",
        lambda: prim(RmsNorm(4, 128, 1e-6), ("u",), "wide", unit_dst(128)),
        lambda: prim(Elementwise(ElementwiseOp.ADD, 4, 128), ("u", "v"), "wide", unit_dst(128)),
        "the lane writes a part of every unit of a wider tensor only from a norm, a rotation or a per-head product",
    ),
    Case(
        "per-head product read in place",
        lambda: prim(HeadMatmul(1, 4, 64, 128), ("x", "w"), "y", access=(Strided(192, 64, 64), WHOLE)),
        lambda: prim(HeadMatmul(1, 4, 64, 128), ("x", "w"), "y", access=(Strided(192, 48, 64), WHOLE)),
        "a per-head product reads a part in place only at whole 32-value blocks",
    ),
    Case(
        "attention read in place",
        lambda: attention(access=(WHOLE, WHOLE, Strided(256, 128, 128), WHOLE)),
        lambda: attention(access=(WHOLE, WHOLE, Strided(257, 129, 128), WHOLE)),
        "an attention reads its values in place a pair at a time, from an even place",
    ),
    Case(
        "mixture at a parameter's row",
        lambda: mixture(dst=Dst("table", row=RowAt(3, 2048))),
        lambda: mixture(dst=Dst("table", row=RowAt("pos", 2048))),
        "a mixture writes its result at a fixed row, never at one a parameter names",
    ),
    Case(
        "norm then add",
        lambda: fused(
            C.NORM_THEN_ADD, norm_weight(1, 64), prim(Elementwise(ElementwiseOp.ADD, 1, 64), ("h", "r"), "o")
        ),
        lambda: fused(C.NORM_THEN_ADD, mul(), prim(Elementwise(ElementwiseOp.ADD, 1, 64), ("glu", "r"), "o")),
        "the lane's norm-then-add kernel norms the sum it writes",
    ),
    Case(
        "projection epilogue parts",
        lambda: gne(4096),
        lambda: gne(4096, first=unary(4096, out="y")),
        "a projection's epilogue norms the add of its result",
    ),
    Case(
        "projection epilogue one row",
        lambda: gne(896, first=matmul(1, 896, 896, "q8")),
        lambda: gne(4096, m=2),
        "a projection norms in its last block the one row it writes whole, a GEMV of a step's one row by "
        "checkpoint rows",
    ),
    Case(
        "projection epilogue down norm launch",
        # an attention output projection keeps its epilogue, its rows however long (a query past twice the
        # hidden width); a gated pair's down projection longer than twice the norm's width leaves it
        lambda: fused(C.GEMV_NORM_EPILOGUE, matmul(1, 4096, 12288), add_norm(1, 4096)),
        lambda: fused(C.GEMV_NORM_EPILOGUE, matmul(1, 4096, 12288, x="glu"), add_norm(1, 4096)),
        "under int8 activations and norm_launch=on a down projection longer than the norm is wide leaves its "
        "add and norm to a launch of their own: the last block's serial tail costs more than a launch",
        CudaKnobs(activations=Activations.INT8, norm_launch=True),
    ),
    Case(
        "mixture finalize parts",
        lambda: mdf(mixture()),
        lambda: mdf(matmul(1, 2048, 2048, out="moe")),
        "a mixture's last step norms the add of its result",
    ),
    Case(
        "mixture finalize rows",
        lambda: mdf(mixture()),
        lambda: mdf(mixture(), cols=1024),
        "a mixture, alone or summed with another array, adds and norms in its last step the whole rows it writes",
    ),
    Case(
        "mixture finalize widths",
        lambda: mdf(shared_expert()),
        lambda: mdf(shared_expert(down=False)),
        "a decode mixture's down projection reads its experts' widths from its parts",
    ),
    Case(
        "embedding norm",
        lambda: fused(C.EMBED_NORM, prim(RowsGather(1, 64), ("table", "ids"), "s"), norm_weight(1, 64)),
        lambda: fused(C.EMBED_NORM, unary(64, out="s"), norm_weight(1, 64)),
        "a gather norms in its own blocks the whole rows it gathers",
    ),
    Case(
        "head epilogue parts",
        lambda: qkv(),
        lambda: fused(C.QKV_HEAD_EPILOGUE, matmul(1, 4096, 4096), unary(4096, "y")),
        "a projection's epilogue turns the heads of its result",
    ),
    Case(
        "head epilogue heads",
        lambda: qkv(hd=256),
        lambda: qkv(hd=512),
        "a projection turns in its epilogue the heads of the one row it writes whole, a GEMV of a step's one row",
    ),
    Case(
        "convolution l2 norm",
        lambda: conv_l2(128),
        lambda: conv_l2(48),
        "a convolution's epilogue norms heads of at most 1024 values, whole warps, that divide its channels",
    ),
    Case(
        "gated pair products",
        lambda: gate_up_glu(),
        lambda: fused(C.GEMV_GATE_UP_GLU, matmul(1, 64, 64, out="g"), fused(C.GLU_ACT_MUL, unary(64, "g"), mul())),
        "a gated pair is two products",
    ),
    Case(
        "gated pair rows",
        lambda: gate_up_glu(),
        lambda: gate_up_glu(gate="f32"),
        "the lane pairs a gate and an up product only over checkpoint rows",
    ),
    Case(
        "gated pair tiles",
        lambda: gate_up_glu(m=64),
        lambda: gate_up_glu(m=64, up="q6k"),
        "a gated pair on the tensor cores pairs tiles of one format, the hidden width whole pair tiles",
        INT8,
    ),
    Case(
        "gated pair of a short chunk",
        lambda: gate_up_glu(m=4),
        # Q2_K's products multiply on the int8 GEMV in a step, on cuBLAS in a chunk: no f32 GEMV decodes it
        lambda: gate_up_glu(m=4, gate="q2k", up="q2k"),
        "a chunk's few rows pair a gate and an up product only in the formats the f32 GEMVs decode",
        rows=4,
    ),
    Case(
        "convolution parts",
        lambda: fused(C.CONV_PARTS, conv(), conv()),
        lambda: fused(C.CONV_PARTS, conv(), unary()),
        "a launch of convolutions takes convolutions",
    ),
    Case(
        "convolution launch",
        lambda: fused(C.CONV_PARTS, conv(4), conv(4)),
        lambda: fused(C.CONV_PARTS, conv(4), conv(3)),
        "one launch convolves a step's one row through the SiLU in at most four parts of one length of taps, the "
        "normed ones over heads of one width",
    ),
    Case(
        "delta rule gates",
        lambda: fused(C.GDN_GATE_PROJECTIONS, matmul(1, 32, 2048, "f32", out="a"), matmul(1, 32, 2048, "f32")),
        lambda: fused(C.GDN_GATE_PROJECTIONS, matmul(1, 32, 2048, "f32", out="a"), matmul(1, 32, 2048, "q4k")),
        "the lane takes a delta rule's gates from its activation only by matrices of floats",
    ),
    Case(
        "delta rule gates in parts",
        lambda: fused(C.GDN_GATE_PROJECTIONS, matmul(1, 64, 2048, "f16", out="a"), unary(64, x="a")),
        lambda: fused(C.GDN_GATE_PROJECTIONS, matmul(1, 64, 2048, "f16", x="xf", out="a"), unary(64, x="a")),
        "a step's gates' product rides the GEMV in parts of its activation's other products, and the delta step "
        "makes the gates (gates_in_step): one launch fewer",
    ),
    Case(
        "routing in its own launch",
        lambda: routing(),
        lambda: routed_norm(),
        "a step's routing keeps its own launch (knob route_in_norm=off): in the norm's launch its serial tail "
        "measured slower than the launch it saves",
    ),
    Case(
        "routing in the norm's launch",
        lambda: routed_norm(),
        lambda: routed_norm(quant=False),
        "a step's routing runs in its norm's launch only from a projection's add + norm GEMV: the int8 one (a "
        "NormQuant of a GemvNormEpilogue) or the fast f32 one, its row whole 32-value blocks",
        knobs=ROUTED,
    ),
    Case(
        "routing a step's row in the norm's launch",
        lambda: routed_norm(),
        lambda: routed_norm(rows=4),
        "a chunk's or a batch's rows route in a launch of their own; a step's one row routes in its norm's",
        knobs=ROUTED,
    ),
    Case(
        "the router routing in the norm's launch",
        lambda: routed_norm(experts=256),
        lambda: routed_norm(router="q8"),
        fits_recurrent.ROUTER_IN_NORM,
        knobs=ROUTED,
    ),
    Case(
        "shared expert",
        lambda: shared_expert(),
        lambda: shared_expert(bias=True),
        "a mixture folds its unbiased SwiGLU shared expert, a step's one row of checkpoint rows, into at most 32 "
        "warps of kept experts",
    ),
    Case(
        "rotations",
        lambda: fused(C.ROPE_QK_ONE_LAUNCH, rotation(normed=True), rotation(8, out="krot", normed=True)),
        lambda: fused(C.ROPE_QK_ONE_LAUNCH, rotation(), unary()),
        "a launch of rotations takes rotations",
    ),
    Case(
        "one launch of rotations",
        lambda: fused(C.ROPE_QK_ONE_LAUNCH, rotation(), rotation(8, out="krot")),
        lambda: fused(C.ROPE_QK_ONE_LAUNCH, rotation(normed=True), rotation(8, out="krot")),
        "one launch rotates at most a query and a key of a step's one row, alike, both normed or neither",
    ),
    Case(
        "attention output gate",
        lambda: fused(C.ATTN_OUTPUT_GATE, attention(rows=8), mul(4096, "att", "gate")),
        lambda: fused(C.ATTN_OUTPUT_GATE, attention(rows=64), mul(4096, "att", "gate")),
        "an attention gates its output only in the decode step's, a short chunk's and a batch's sequences' "
        "kernels, its heads whole pairs",
    ),
    Case(
        "row write quant",
        lambda: fused(C.ROW_WRITE_QUANT, prim(SetRow(1, 1024), ("k", "pos"), "kc", Dst("kc", row=RowAt("pos", 1024)))),
        lambda: fused(C.ROW_WRITE_QUANT, prim(SetRow(1, 48), ("k", "pos"), "kc", Dst("kc", row=RowAt("pos", 48)))),
        "a row set carries its rows' quantized form only where they are whole 32-value blocks",
    ),
    Case(
        "gated attention quant",
        lambda: fused(C.GLU_ACT_MUL_QUANT, gated_attention(128)),
        lambda: fused(C.GLU_ACT_MUL_QUANT, gated_attention(16)),
        "a gated attention quantizes its output in its store only where its heads, and a batch's rows, are "
        "whole 32-value groups",
    ),
    Case(
        "attention output quant",
        lambda: fused(C.ATTN_OUTPUT_QUANT, fused(C.FLASH_DECODE, attention())),
        lambda: fused(C.ATTN_OUTPUT_QUANT, fused(C.FLASH_PREFILL, attention(rows=4, hd=16))),
        "an attention quantizes its output only where its heads are whole 32-value groups, or a decode step's "
        "heads together are",
    ),
    Case(
        "norm quant",
        lambda: fused(C.NORM_QUANT, gne(4096)),
        lambda: fused(C.NORM_QUANT, mul()),
        "the lane's norm quantizes its result only from an RMS norm",
    ),
    Case(
        "product quant",
        lambda: fused(C.GEMV_QUANT, matmul(1, 4096, 4096)),
        lambda: fused(C.GEMV_QUANT, matmul(1, 4096, 512)),
        "a product quantizes its outputs only four rows a warp, whole blocks of them",
    ),
    Case(
        "gated pair quant",
        lambda: fused(C.GLU_ACT_MUL_QUANT, gate_up_glu(12288)),
        lambda: fused(C.GLU_ACT_MUL_QUANT, gate_up_glu(12296)),
        "a gated pair quantizes its hidden values in whole 32-value blocks",
    ),
    Case(
        "products in parts on the tensor cores",
        lambda: fused(C.MERGED_QKV, matmul(8, 4096, 4096), matmul(8, 1024, 4096, out="k")),
        lambda: fused(C.MERGED_QKV, matmul(64, 4096, 4096), matmul(64, 1024, 4096, out="k")),
        "the lane has no GEMM in parts yet: a chunk's products of one activation run apart",
        INT8,
    ),
    Case(
        # two formats share the int8 GEMV's parts (a Q4_K_M layer's Q6_K value rows), a third does not
        "products in parts",
        lambda: fused(C.MERGED_QKV, matmul(1, 4096, 4096), matmul(1, 1024, 4096, "q6k", out="k")),
        lambda: fused(
            C.MERGED_QKV,
            matmul(1, 4096, 4096),
            matmul(1, 1024, 4096, "q6k", out="k"),
            matmul(1, 1024, 4096, "q8", out="v"),
        ),
        "products of one activation are one launch in parts: at most four, one format — on the tensor cores "
        "whole 128-output tiles",
    ),
]


# a refusal no format of the table meets today (the lane decodes every one): `undecoded` makes one
SHARED_FORMATS_WHY = (
    "a folded shared expert's score reads f32 activations, in the formats the GEMV by rows decodes; its gate, up "
    "and down those, or the kept experts' int8 tiles and an int8 down product"
)


@pytest.fixture
def undecoded(monkeypatch):
    """MXFP4 as a format no GEMV has a body for (the lane decodes every format of the table today)."""
    for name in ("INT8_GEMV_FORMATS", "VALUE_GEMV_FORMATS", "DEQUANT_FORMATS"):
        monkeypatch.setattr(kernels, name, getattr(kernels, name) - {Format.MXFP4})


def test_the_int8_gemvs_epilogue_norms_any_width_and_format(undecoded) -> None:
    # its last program walks the row in chunks, in every int8 GEMV format; under dequant the f32 GEMV by rows
    # takes Q2_K a value at a time, and no GEMV a format it has no body for
    g = graph()
    q2k = gne(4096, first=matmul(1, 4096, 4096, "q2k"))
    assert CudaShim(INT8).fits(gne(5120), g) is None and CudaShim(INT8).fits(q2k, g) is None
    dequant = CudaShim(CudaKnobs(activations=Activations.DEQUANT))
    assert dequant.fits(q2k, g) is None
    refused = dequant.fits(gne(4096, first=matmul(1, 4096, 4096, "mxfp4")), g)
    assert refused is not None and refused.startswith("a projection norms in its last block the one row")


def test_mxfp4_takes_every_gemv_a_step_takes() -> None:
    g, dequant = graph(), CudaShim(CudaKnobs(activations=Activations.DEQUANT))
    mx = gne(4096, first=matmul(1, 4096, 4096, "mxfp4"))
    assert CudaShim(INT8).fits(mx, g) is None and dequant.fits(mx, g) is None
    parts = [matmul(1, 512, 4096, "mxfp4", out="q"), matmul(1, 512, 4096, "mxfp4", out="k")]
    assert CudaShim(INT8).gemv_in_parts(parts, g) and dequant.gemv_in_parts(parts, g)
    assert CudaShim(INT8).fits(shared_expert(down_w="mxfp4"), g) is None


def test_a_shared_expert_in_a_format_no_gemv_decodes_is_not_folded(undecoded) -> None:
    # without the kept experts' int8 tiles (none here) its down reads the f32 SwiGLU by rows, which the GEMV
    # by rows decodes in its formats only (Q2_K a value at a time, the kept experts reading f32 here)
    g = graph()
    assert CudaShim(INT8).fits(shared_expert(down_w="q2k"), g) is None
    assert CudaShim(INT8).fits(shared_expert(down_w="mxfp4"), g) == SHARED_FORMATS_WHY


def test_a_short_chunk_takes_products_in_parts_only_in_the_f32_gemvs_formats(undecoded) -> None:
    # a step's Q2_K products read int8 (the int8 GEMV in parts), or under dequant f32 (the GEMV by rows, a value
    # at a time); a chunk's few rows read f32, which the GEMV by rows decodes Q2_K from only for a step's one
    # row, so they multiply apart, on cuBLAS
    def products(m: int, w: str) -> list[Op]:
        return [matmul(m, 512, 4096, w, out="q"), matmul(m, 512, 4096, w, out="k")]

    shim = CudaShim(DEFAULT)
    assert shim.gemv_in_parts(products(4, "q4k"), graph(4))
    assert not shim.gemv_in_parts(products(4, "q2k"), graph(4))
    assert shim.gemv_in_parts(products(1, "q2k"), graph())
    dequant = CudaShim(CudaKnobs(activations=Activations.DEQUANT))
    assert dequant.gemv_in_parts(products(1, "q2k"), graph())
    assert not dequant.gemv_in_parts(products(1, "mxfp4"), graph())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fits_refuses_with_the_specified_reason(case: Case) -> None:
    shim, g = CudaShim(case.knobs), graph(case.rows)
    assert shim.fits(case.fits(), g) is None
    assert shim.fits(case.refused(), g) == case.reason


def _returned_strings(source: str) -> set[str]:
    """Every string a function of `source` returns literally: the refusals."""
    return {
        node.value.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def test_the_table_covers_every_refusal() -> None:
    table = [c.reason for c in CASES]
    assert len(table) == len(set(table)), "one row a reason"
    # the accumulator's reason is the numerics contract's own, formatted with the product's width
    ours = {r for r in table if "accumulator" not in r and r != fits_recurrent.ROUTER_IN_NORM} | {SHARED_FORMATS_WHY}
    sources = inspect.getsource(fits_module) + inspect.getsource(fits_recurrent)
    assert _returned_strings(sources) == ours


def test_held_gemv_parts_refuses_products_in_parts() -> None:
    (case,) = [c for c in CASES if c.name == "products in parts"]
    assert CudaShim(DEFAULT, held=("gemv_parts",)).fits(case.fits(), graph()) == case.reason


# --- (b) activation ---------------------------------------------------------------------------------------

FORMATS = {Activations.DEQUANT: None, Activations.INT8: QuantFormat.ONE_WORD, Activations.INT8X2: QuantFormat.TWO_WORDS}


@pytest.mark.parametrize("activations", list(Activations))
def test_activation(activations: Activations) -> None:
    shim, g, fmt = CudaShim(CudaKnobs(activations=activations)), graph(), FORMATS[activations]
    product = matmul(1, 4096, 4096)
    assert shim.activation(product, 0, g) is fmt
    assert shim.activation(product, 1, g) is None  # the weights are not an activation
    assert shim.activation(matmul(1, 64, 64, "f32"), 0, g) is None  # a product by values reads floats
    assert shim.activation(unary(), 0, g) is None
    # a mixture's kept experts read int8 where the int8 GEMV takes their format; the combine alone reads f32
    experts = prim(ExpertMatmul(1, 8, 768, 2048), ("x", "q4k", "ids"), "gate")
    assert shim.activation(experts, 0, g) is fmt
    assert shim.activation(mixture(), 0, g) is None
    assert shim.activation(gate_up_glu(), 0, g) is fmt
    assert shim.activation(CASES[-1].fits(), 0, g) is fmt  # products in parts
    assert shim.activation(fused(C.GEMV_QUANT, product), 0, g) is fmt  # quantizing: as its producer reads
    epilogue = gne(4096)
    assert shim.activation(epilogue, 0, g) is fmt
    assert shim.activation(epilogue, 2, g) is None  # past the projection's own operands: the residual


def test_gemv_parts_respects_what_lies_between() -> None:
    """A later product moves up to the first only past ops that neither read what it writes nor write what it
    reads; an op writing the activation ends the group."""
    g = graph()

    def run(ops: list[Op]) -> list[Op]:
        r = Rewriter(g, Schedule(ops), CudaShim(DEFAULT))
        CudaShim(DEFAULT).gemv_parts(r)
        return r.s.live()

    q, k, v = matmul(1, 4096, 4096, out="q"), matmul(1, 1024, 4096, out="k"), matmul(1, 1024, 4096, out="v")
    assert [op.sym.cls for op in run([q, k, v])] == [C.MERGED_QKV]
    reads_k = unary(1024, "k", "k2")
    merged = run([q, reads_k, k, v])
    assert [op.out for op in merged] == ["q", "k2", "k"] and merged[0].sym.parts == (q, v)
    writes_x = unary(4096, "z", "x")
    cut = run([q, writes_x, k, v])  # q stays alone; k and v, past the write, are a group of their own
    assert [op.out for op in cut] == ["q", "x", "k"] and cut[2].sym.parts == (k, v)
    # at most four parts
    many = [matmul(1, 1024, 4096, out=f"p{i}") for i in range(6)]
    assert [len(op.sym.parts) for op in run(many)] == [4, 2]


def test_turned_alike() -> None:
    """Products that turn their heads in their epilogue merge only as one launch of rotations would take them."""
    q, k = qkv(), fused(C.QKV_HEAD_EPILOGUE, matmul(1, 1024, 4096, out="k"), rotation(8, x="k", out="krot"))
    assert CudaShim.turned_alike([q, k])
    assert not CudaShim.turned_alike([q, k, qkv()])  # three sides: more than a query and a key
    other = fused(C.QKV_HEAD_EPILOGUE, matmul(1, 1024, 4096, out="k"), rotation(16, 64, x="k", out="krot"))
    assert not CudaShim.turned_alike([q, other])  # another head width
    normed = fused(C.QKV_HEAD_EPILOGUE, matmul(1, 1024, 4096, out="k"), rotation(8, x="k", out="kr", normed=True))
    assert not CudaShim.turned_alike([q, normed])
    assert CudaShim(DEFAULT).gemv_in_parts([q, k], graph())
