"""The cuda shim's checks of a recurrent layer's and a mixture's fused classes (`fits` registers them): a
convolution's epilogue and parts, a delta rule's gates and step, a shared expert folded into its mixture, a
step's routing in the launch that norms the row it reads.

Kept apart from `fits` so each module holds one family of checks; the checks read the shim through `fits`'
protocol and their thresholds from the kernel facts (`kernels`, `moe_kernels`, `gdn`).
"""

from __future__ import annotations

from collections.abc import Sequence

from fuselane.fuse.views import GemvForm, class_of, conv, gemv, leaves, moe, norm, parts
from fuselane.gguf.formats import Format
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Op, Rows, TensorGraph, Values
from fuselane.graph.ops import (
    CausalConv,
    Elementwise,
    ElementwiseOp,
    ExpertMatmul,
    L2Norm,
    Matmul,
    MoeAct,
    RouteWeights,
    Unary,
    UnaryOp,
)
from fuselane.lanes.cuda.plan import gdn, kernels, moe_kernels
from fuselane.lanes.cuda.plan.shim_view import GEMV_PARTS, CudaShim

SHARED_APART = (
    "a shared expert runs in launches of its own (knob shared_fold=off): five launches more a layer where it is gated, "
    "two where not"
)


def conv_silu_l2norm(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    """A convolution with its SiLU and its heads' L2 norm in one launch (ConvSiluL2Norm)."""
    found = leaves(op)
    chan = next((x.sym.chan for x in found if isinstance(x.sym, CausalConv)), None)
    cols = next((x.sym.cols for x in found if isinstance(x.sym, L2Norm)), None)
    if (
        chan is not None
        and cols is not None
        and cols <= kernels.CONV_L2_MAX_HEAD
        and cols % kernels.WARP == 0
        and chan % cols == 0
    ):
        return None
    return "a convolution's epilogue norms heads of at most 1024 values, whole warps, that divide its channels"


def conv_parts(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    """A step's convolutions of one activation in one launch (ConvParts)."""
    convs = [conv(m) for m in members]
    if any(c is None for c in convs):
        return "a launch of convolutions takes convolutions"
    found = [c for c in convs if c is not None]
    normed = {c.l2 for c in found if c.l2 is not None}
    one = (
        len(found) <= kernels.CONV_PARTS
        and all(c.rows == 1 and c.silu and c.taps == found[0].taps for c in found)
        and len(normed) <= 1
    )
    if one:
        return None
    return (
        "one launch convolves a step's one row through the SiLU in at most four parts of one length of taps, the "
        "normed ones over heads of one width"
    )


def gdn_gate_projections(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    """A delta rule's gates with their projection in one launch (GdnGateProjections), from a matrix of floats (the
    lane's f32 copy of it), where no GEMV in parts takes the product with another of its activation's (a chunk's
    rows, `gemv_parts` held, or formats apart): there it joins them, one launch fewer."""
    products = [(m, p) for m in members if (p := gemv(m, g)) is not None]
    if not all(
        isinstance(p.weights, Values) or (isinstance(p.weights, Rows) and p.weights.format in gdn.GATE_MATRIX_FORMATS)
        for _, p in products
    ):
        return "the lane takes a delta rule's gates from its activation only by matrices of floats"
    if GEMV_PARTS not in shim.held and len(products) == 1:
        mine, p = products[0]
        siblings = (x for x in g.ops if x is not mine and isinstance(x.sym, Matmul) and x.ins[0] == p.x)
        if any(shim.gemv_in_parts([x, mine], g) for x in siblings):
            return (
                "a step's gates' product rides the GEMV in parts of its activation's other products, and the delta "
                "step makes the gates (gates_in_step): one launch fewer"
            )
    return None


def gdn_step(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    """A delta rule's step with its gates and its gated norm (GdnStep: `gdn`'s checks)."""
    return gdn.gates_in_step(op) or gdn.norm_in_step(op)


def shared_expert_fusion(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    """A shared expert folded into its mixture's launches (SharedExpertFusion)."""
    if not shim.knobs.shared_fold:
        return SHARED_APART
    found = leaves(op)
    # A SwiGLU is, in the graphs, the SiLU of the gate times the up product.
    silu = any(isinstance(x.sym, Unary) and x.sym.op is UnaryOp.SILU for x in found)
    times = any(isinstance(x.sym, Elementwise) and x.sym.op is ElementwiseOp.MUL and not x.sym.row for x in found)
    biased = any(isinstance(x.sym, Elementwise) and x.sym.op is ElementwiseOp.ADD and x.sym.row for x in found)
    products = [p for x in found if (p := gemv(x, g)) is not None]
    by_rows = all(isinstance(p.weights, Rows) and p.m == 1 for p in products)
    m = moe(op)
    # Kept experts take a warp each and the shared expert one more, in one block of at most 32 warps.
    if not (
        m is not None
        and m.k < kernels.MAX_BLOCK_WARPS
        and m.rows == 1
        and m.act is MoeAct.SWIGLU
        and silu
        and times
        and not biased
        and by_rows
    ):
        return (
            "a mixture folds its unbiased SwiGLU shared expert, a step's one row of checkpoint rows, into at most "
            "32 warps of kept experts"
        )
    made = {x.out for x in found}
    int8 = kept_int8_format(shim, [p.x for p in products if p.x not in made], g)
    gate_up = [p for p in products if p.x not in made and p.n > 1]
    tiles = moe_kernels.MOE_SHARED_INT8 and int8 is not None and all(in_tiles(p, int8) for p in gate_up)
    if all(shared_product_read(p, made, tiles, int8 is None) for p in products):
        return None
    return (
        "a folded shared expert's score reads f32 activations, in the formats the GEMV by rows decodes; its "
        "gate, up and down those, or the kept experts' int8 tiles and an int8 down product"
    )


def in_tiles(p: GemvForm, int8: Format) -> bool:
    """Whether a shared gate or up product runs as the kept experts' int8 tiles: their format, whole blocks."""
    return isinstance(p.weights, Rows) and p.weights.format is int8 and p.n % kernels.QBLOCK == 0


def shared_product_read(p: GemvForm, made: set[str], tiles: bool, f32: bool) -> bool:
    """Whether a folded shared expert's product has a kernel: the f32 GEMV by rows (`moe/shared.py`'s
    `row_dot`) in its formats, and in those it decodes a value at a time where the kept experts read f32 (`f32`:
    activations=dequant, `shared.int8_down`); or, where its gate and up run as the kept experts' int8 tiles
    (`tiles`), those and its down (reading their SwiGLU's int8 form) as an int8 product in the int8 GEMV's
    formats."""
    fmt = p.weights.format if isinstance(p.weights, Rows) else None
    if fmt in kernels.ROWS_GEMV_FORMATS or (f32 and fmt is not None and kernels.rows_gemv(fmt, p.m)):
        return True
    score = p.n == 1 and p.x not in made
    return tiles and not score and fmt is not None and kernels.int8_gemv(fmt, p.m, p.k)


def kept_int8_format(shim: CudaShim, inputs: list[str], g: TensorGraph) -> Format | None:
    """The format of the kept experts' gate/up products that read one of `inputs` (the mixture's input) in
    int8, or None where they read it in f32 (or none is found)."""
    for top in g.ops:
        found = [x for x in leaves(top) if isinstance(x.sym, ExpertMatmul) and not x.sym.slotted]
        if found and found[0].ins[0] in inputs and shim.activation(top, 0, g) is not None:
            storage = g.tensors[found[0].ins[1]].storage
            return storage.format if isinstance(storage, Rows) else None
    return None


# Why a step's routing by its router's format or width keeps a launch of its own.
ROUTER_IN_NORM = (
    f"a step routes in its norm's launch by a float router (F32, F16 or BF16) of at most "
    f"{moe_kernels.MOE_ROUTE_IN_NORM_EXPERTS} experts"
)


def router_topk(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    """Routing (RouterTopk): its own launch, or a step's in the launch of the projection whose normed row it reads
    (`route_in_norm`: the int8 add + norm GEMV, `triton/moe/norm_route.py`)."""
    if class_of(members[-1]) is not C.ROUTER_TOPK:
        return None  # the router's product, top-k and weights: the routing launch takes every shape
    if not shim.knobs.route_in_norm:
        return (
            "a step's routing keeps its own launch (knob route_in_norm=off): in the norm's launch its serial tail "
            "measured slower than the launch it saves"
        )
    normed, found = members[0], leaves(members[-1])
    quantized = class_of(normed) is C.NORM_QUANT
    inner = parts(normed)[0] if quantized else normed
    if not _norm_routes(shim, inner, quantized, g):
        return (
            "a step's routing runs in its norm's launch only from a projection's add + norm GEMV: the int8 one (a "
            "NormQuant of a GemvNormEpilogue) or the fast f32 one, its row whole 32-value blocks"
        )
    spec = next(x.sym for x in found if isinstance(x.sym, RouteWeights))
    if spec.rows != 1:
        return "a chunk's or a batch's rows route in a launch of their own; a step's one row routes in its norm's"
    router = next(gemv(x, g) for x in found if isinstance(x.sym, Matmul))
    fmt = router.weights.format if router is not None and isinstance(router.weights, Rows) else None
    if fmt is None or not moe_kernels.moe_route_in_norm(spec.experts, fmt):
        return ROUTER_IN_NORM
    return None


def _norm_routes(shim: CudaShim, inner: Op, quantized: bool, g: TensorGraph) -> bool:
    """Whether the projection `inner` (a GemvNormEpilogue) launches as an add + norm GEMV that routes: the int8
    GEMV, which writes the norm's int8 form (`quantized`), or the fast f32 GEMV (`kernels.FAST_GEMV_FORMATS`),
    of a step's one row of whole 32-value blocks."""
    if class_of(inner) is not C.GEMV_NORM_EPILOGUE:
        return False
    p, closing = gemv(parts(inner)[0], g), norm(parts(inner)[1])
    if p is None or closing is None or p.m != 1 or closing.cols % kernels.QBLOCK:
        return False
    if quantized:
        return shim.quantizes_in_epilogue(inner, g)
    fmt = p.weights.format if isinstance(p.weights, Rows) else None
    return shim.activation(inner, 0, g) is None and fmt in kernels.FAST_GEMV_FORMATS
