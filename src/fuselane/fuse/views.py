"""Pattern views: read a primitive or fused op as a product, a norm, a rotation, a mixture, a convolution or
a slice, whatever it was fused into.

Rules and shims ask questions of shapes ("is this a GEMV of one row by Q4_K rows?") without caring whether
the product is bare, carries a bias, or already writes into a cache row; each view answers for every op
that contains one, with the destination of the whole op.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuselane.graph.classes import ClassId
from fuselane.graph.ir import Dst, Fused, Op, Rows, Strided, TensorGraph, Values
from fuselane.graph.ops import (
    CausalConv,
    ExpertMatmul,
    L2Norm,
    Matmul,
    Moe,
    MoeAct,
    RmsNorm,
    Rope,
    Slice,
    Unary,
    UnaryOp,
    Yarn,
)

Weights = Rows | Values


@dataclass(frozen=True, slots=True)
class GemvForm:
    """y (m, n) = x (m, k) @ w^T, landing at `dst`."""

    x: str
    w: str
    weights: Weights
    m: int
    n: int
    k: int
    dst: Dst


@dataclass(frozen=True, slots=True)
class NormForm:
    """An RMS norm of `rows` units of `cols` values; `part` when it reads a part of each unit in place; `own`
    when the op it is read from writes a buffer of its own, whole."""

    x: str
    rows: int
    cols: int
    eps: float
    part: Strided | None
    own: bool


@dataclass(frozen=True, slots=True)
class RopeForm:
    """A rotation of `heads` heads of `hd` values in each of `rows` rows that hold `per_row` heads, at the
    position `pos`, by frequencies of `base` (stretched by `yarn` where given); `norm` when the heads are normed
    first."""

    x: str
    pos: str
    rows: int
    heads: int
    per_row: int
    hd: int
    half: bool
    base: float
    norm: NormForm | None
    part: Strided | None
    yarn: Yarn | None = None


@dataclass(frozen=True, slots=True)
class MoeForm:
    x: str
    rows: int
    d: int
    k: int
    act: MoeAct
    dst: Dst


@dataclass(frozen=True, slots=True)
class ConvForm:
    rows: int
    taps: int
    silu: bool
    l2: tuple[int, float] | None  # (cols, eps) of a per-head L2 norm in the epilogue


@dataclass(frozen=True, slots=True)
class SliceForm:
    x: str
    groups: int
    every: int
    start: int
    width: int


def class_of(op: Op) -> ClassId | None:
    """The fused class of an op, or None for a primitive."""
    return op.sym.cls if isinstance(op.sym, Fused) else None


def parts(op: Op) -> tuple[Op, ...]:
    return op.sym.parts if isinstance(op.sym, Fused) else ()


def leaves(op: Op) -> list[Op]:
    """The primitive ops an op stands for, in order."""
    if isinstance(op.sym, Fused):
        return [leaf for part in op.sym.parts for leaf in leaves(part)]
    return [op]


def absorbs(op: Op) -> bool:
    """Whether an op holds a per-head product (a latent attention's query join: its product by the key half)."""
    from fuselane.graph.ops import HeadMatmul

    return _find(op, HeadMatmul) is not None


def _find(op: Op, kind: type) -> Op | None:
    return next((leaf for leaf in leaves(op) if isinstance(leaf.sym, kind)), None)


# Classes whose whole result is their product's, perhaps biased or landing elsewhere.
_PRODUCT_CLASSES = {ClassId.GEMM_BIAS, ClassId.ROW_WRITE, ClassId.GEMM_DEQUANT_INKERNEL}


def gemv(op: Op, g: TensorGraph) -> GemvForm | None:
    """The product an op computes: a bare product, or one whose class only biases it or moves where it lands."""
    if isinstance(op.sym, Fused):
        if op.sym.cls not in _PRODUCT_CLASSES:
            return None
        inner = gemv(op.sym.parts[0], g)
        return None if inner is None else GemvForm(inner.x, inner.w, inner.weights, inner.m, inner.n, inner.k, op.dst)
    spec = op.sym
    if not isinstance(spec, Matmul):
        return None
    storage = g.tensors[op.ins[1]].storage
    weights = storage if isinstance(storage, Rows | Values) else Values("f32")
    return GemvForm(op.ins[0], op.ins[1], weights, spec.m, spec.n, spec.k, op.dst)


def _norm_leaf(op: Op, own: bool) -> NormForm | None:
    leaf = _find(op, RmsNorm)
    if leaf is None:
        return None
    spec: RmsNorm = leaf.sym  # type: ignore[assignment]
    access = leaf.access[0]
    return NormForm(leaf.ins[0], spec.rows, spec.cols, spec.eps, access if isinstance(access, Strided) else None, own)


_NORM_CLASSES = {
    ClassId.NORM_WEIGHT,
    ClassId.ADD_NORM,
    ClassId.NORM_THEN_ADD,
    ClassId.NORM_QUANT,
    ClassId.ADD_NORM_QUANT,
}


def norm(op: Op) -> NormForm | None:
    """The RMS norm an op computes: a bare norm, or a norm with its weight, its residual add, or its quantizing
    epilogue."""
    if isinstance(op.sym, Fused) and op.sym.cls not in _NORM_CLASSES:
        return None
    if isinstance(op.sym, Fused) and op.sym.cls in (ClassId.NORM_QUANT, ClassId.ADD_NORM_QUANT):
        inner = op.sym.parts[0]
        return norm(inner) if class_of(inner) != ClassId.EMBED_NORM else None
    return _norm_leaf(op, op.dst.own() is not None)


def embedded_norm(op: Op) -> NormForm | None:
    """The norm a fold of the embedding's gather and its first norm closes with."""
    if class_of(op) != ClassId.EMBED_NORM:
        return None
    return _norm_leaf(op.sym.parts[-1], op.dst.own() is not None)  # type: ignore[union-attr]


_ROPE_CLASSES = {
    ClassId.QK_NORM_ROPE,
    ClassId.QK_NORM_ROPE_KV_APPEND,
    ClassId.ROPE_KV_APPEND,
}


def rope(op: Op) -> RopeForm | None:
    """The rotation an op computes: bare, after its per-head norm, or appending its result to a cache."""
    if isinstance(op.sym, Fused) and op.sym.cls not in _ROPE_CLASSES:
        return None
    leaf = _find(op, Rope)
    if leaf is None:
        return None
    spec: Rope = leaf.sym  # type: ignore[assignment]
    access = leaf.access[0]
    part = access if isinstance(access, Strided) else None
    width = part.pitch if part else None
    per_row = (width or spec.heads * spec.hd) // spec.hd
    normed = _norm_leaf(op, False) if isinstance(op.sym, Fused) else None
    return RopeForm(
        leaf.ins[0], leaf.ins[1], spec.rows, spec.heads, per_row, spec.hd, spec.half, spec.base, normed, part, spec.yarn
    )


def unit_output(op: Op) -> tuple[str, int] | None:
    """The width of the units an op writes one at a time (a norm's, a rotation's heads, a per-head product's),
    where it writes units at all."""
    spec = op.sym
    if isinstance(spec, RmsNorm | L2Norm):
        return op.out, spec.cols
    if isinstance(spec, Rope):
        return op.out, spec.hd
    from fuselane.graph.ops import HeadMatmul

    if isinstance(spec, HeadMatmul):
        return op.out, spec.b
    return None


def moe(op: Op) -> MoeForm | None:
    """The mixture an op computes, bare or folded with its shared expert, its sort or its last step; or the
    part of it that reads the mixture's input, the kept experts' gate and up products (`x` is then that
    input, `d` its width)."""
    leaf = _find(op, Moe)
    if leaf is not None:
        spec: Moe = leaf.sym  # type: ignore[assignment]
        return MoeForm(leaf.ins[0], spec.rows, spec.d, spec.k, spec.act, op.dst)
    products = [x for x in leaves(op) if isinstance(x.sym, ExpertMatmul) and not x.sym.slotted]
    if not products:
        return None
    first: ExpertMatmul = products[0].sym  # type: ignore[assignment]
    return MoeForm(products[0].ins[0], first.rows, first.kd, first.k, MoeAct.SWIGLU, op.dst)


def conv(op: Op) -> ConvForm | None:
    """The causal convolution an op computes, with the SiLU and per-head L2 norm its epilogue may take."""
    leaf = _find(op, CausalConv)
    if leaf is None:
        return None
    spec: CausalConv = leaf.sym  # type: ignore[assignment]
    silu = any(isinstance(x.sym, Unary) and x.sym.op is UnaryOp.SILU for x in leaves(op))
    l2 = _find(op, L2Norm)
    l2_form = (l2.sym.cols, l2.sym.eps) if l2 is not None else None  # type: ignore[union-attr]
    return ConvForm(spec.rows, spec.taps, silu, l2_form)


def slice_view(op: Op) -> SliceForm | None:
    """A slice: `width` values at `start` of every `every`-wide unit of its input."""
    spec = op.sym
    if not isinstance(spec, Slice):
        return None
    return SliceForm(op.ins[0], spec.groups, spec.every, spec.start, spec.width)
