"""The cuda lane's own rules: every choice of its kernels that changes what launches is a rewrite of the plan,
so the schedule `explain` prints is, op for op, what the lane binds (one launch an op, none for a view, `Mla`
the three its rule sizes, a chunk's GdnStep two).

In the order they link into the shared table (`CudaShim.rules`):

- `gemv_parts` (before `merged_projections`): a decode step's products of one activation as one GEMV in parts.
- `rope_epilogue` (settling, after the shared table): a projection keeps its query's or key's rotation in its
  epilogue only in a QKV GEMV in parts that turns heads (`triton/gemv/q8_rope.py`, the int8 one; `f32_rope.py`,
  a step's one row in f32) and where the knob of that name asks for it; elsewhere the rotations run after the
  product, a query's and a key's in one launch.
- `products_apart` (settling, after the shared table): a gated pair past the GEMV's rows runs as its two
  products and its GLU (whose int8 form, where the down product reads one, a `Quantize` launch writes): the
  lane has no paired GEMM on the checkpoint's bytes yet. A prefill chunk's pair that multiplies on cuBLAS
  (`prefill=f16-copy` or `f16-scratch`) stays whole: one rounding of its activation, the GLU in the
  products' epilogue.
- `quantize_apart` (settling, last): a quantizing fold whose producer has no int8 epilogue here runs as the
  producer then a `Quantize` launch; every activation a product reads in int8 that its producer wrote in f32
  only is quantized by one `Quantize` launch before its first such reader.
- `chunked_delta` (settling, after `quantize_apart`; in `gdn.py`): a chunk's GdnStep counts the chunked form's
  two launches.

The settling passes cannot be held (`LaneRule.holdable`): without them the plan is not what the lane runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from fuselane.fuse.rewriter import Rewriter
from fuselane.fuse.rules import turn_partner
from fuselane.fuse.views import RopeForm, class_of, gemv, parts, rope
from fuselane.graph import facts
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import WHOLE, Access, Dst, Fused, Op, QuantFormat, QuantizedActs, Rows, TensorGraph
from fuselane.graph.ops import Quantize
from fuselane.lanes.cuda.plan import attn_kernels, gdn, kernels
from fuselane.lanes.cuda.plan.fits import GEMV_PARTS
from fuselane.lanes.cuda.plan.knobs import RopeEpilogue
from fuselane.lanes.cuda.plan.shim_view import CudaShim

ROPE_EPILOGUE = "rope_epilogue"
PRODUCTS_APART = "products_apart"
QUANTIZE_APART = "quantize_apart"

# Classes of one rotation the QKV GEMV's epilogue takes (bare rotations too), and the launch of two.
ROTATIONS = (C.QK_NORM_ROPE, C.QK_NORM_ROPE_KV_APPEND, C.ROPE_KV_APPEND)
PAIR = C.ROPE_QK_ONE_LAUNCH
# Quantizing folds: a producer writing its result's int8 form too.
QUANTIZING = frozenset(
    {
        *(C.NORM_QUANT, C.ADD_NORM_QUANT, C.GLU_ACT_MUL_QUANT, C.ELEMENTWISE_QUANT, C.GDN_OUTPUT_QUANT),
        *(C.GEMV_QUANT, C.ATTN_OUTPUT_QUANT),
    }
)

LONE_TURN = "a projection turns its heads in its epilogue only as a part of a GEMV in parts"
KNOB_OFF = "the knob rope_epilogue keeps the query's and key's rotations in a launch after the GEMV"
AUTO_SKIPS = "rope_epilogue=auto turns them in the GEMV only where the query and key are its only parts"
NOT_TURNED_HERE = (
    "the query and key turn in the GEMV's epilogue in the int8 GEMV's formats, or a step's one row in the f32 GEMVs'"
)
NOT_A_QUERY_AND_KEY = "the GEMV's epilogue turns a query (into a buffer of its own) and a key, in the int8 formats"
NOT_ALIKE = "the GEMV's epilogue turns a query and a key alike (one head width and frequencies), a head whole programs"
NO_PAIRED_GEMM = "the lane has no paired GEMM yet: a gated pair past the GEMV's rows runs as its products and its GLU"
NO_INT8_EPILOGUE = "the producer's kernel writes no int8 form here: a launch of its own quantizes its result"


# --- gemv_parts ------------------------------------------------------------------------------------------


def gemv_parts(shim: CudaShim, r: Rewriter) -> None:
    """A step's products of one activation's rows within one GEMV's (one format, any widths,
    each into a buffer of its own or a table's rows its width wide, none quantizing its result) as one GEMV
    over their outputs side by side, at the first one's place: the short ones ride with the wide. Nothing
    between them may write the activation or what a later member reads, or touch what it writes."""
    if GEMV_PARTS in shim.held:
        return
    s = r.s
    for i in range(len(s)):
        op = s.slot(i)
        first = shim.part_product(op, r.g) if op is not None else None
        if first is None or not shim.gemv_mergeable(first):
            continue
        group = [i]
        for j in range(i + 1, len(s)):
            op = s.slot(j)
            if op is None:
                continue
            if len(group) == kernels.GEMM_PARTS or first.x in facts.writes(op):
                break
            members = [s.get(k) for k in group] + [op]
            if shim.part_product(op, r.g) is None or not shim.gemv_in_parts(members, r.g):
                continue
            if not crossed(r, op, group, i, j):
                group.append(j)
        if len(group) < 2:
            continue
        members = [s.get(k) for k in group]
        head = members[0]
        r.fuse(GEMV_PARTS, C.MERGED_QKV, i, group[1:], _parts_ins(members), head.out, head.dst)


def _parts_ins(members: Sequence[Op]) -> list[tuple[str, Access]]:
    """A launch in parts' inputs: the activation as the first member reads it, then each member's other
    operands (weights, and what its epilogue reads), whole, each once."""
    ins: dict[str, Access] = {members[0].ins[0]: members[0].access[0]}
    made = {name for m in members for name in facts.writes(m)}
    for m in members:
        for name in m.ins[1:]:
            if name not in made:
                ins.setdefault(name, WHOLE)
    return list(ins.items())


def crossed(r: Rewriter, op: Op, group: Sequence[int], i: int, j: int) -> bool:
    """Whether moving `op` from slot j up to slot i would change what an op between them sees."""
    written, read = set(facts.writes(op)), set(facts.reads(op))
    for b in range(i + 1, j):
        between = r.s.slot(b)
        if b in group or between is None:
            continue
        br, bw = set(facts.reads(between)), set(facts.writes(between))
        if written & (br | bw) or read & bw:
            return True
    return False


# --- settling: rope_epilogue ----------------------------------------------------------------------------


def rope_epilogue(shim: CudaShim, r: Rewriter) -> None:
    """Projections that turn their heads in their epilogue (`QkvHeadEpilogue`) where the lane's kernel does:
    the int8 QKV GEMV in parts or a step's f32 one, where the `rope_epilogue` knob asks for it (`on` wherever
    the kernel takes them, `auto` under `norm_launch` only where the query and key are its only parts, `off`
    nowhere). Every other one runs as its product then its rotation: a GEMV in parts as its products in one
    launch, then its query's and key's rotations in one more (`RopeQkOneLaunch`, where it takes them)."""
    i = 0
    while i < len(r.s):
        op = r.s.slot(i)
        cls = class_of(op) if op is not None else None
        if op is not None and cls is C.QKV_HEAD_EPILOGUE:
            r.split(ROPE_EPILOGUE, i, parts(op), LONE_TURN)
        elif op is not None and cls is C.MERGED_QKV and any(_turns(m) for m in parts(op)):
            why = _why_not_turned(shim, op, r.g)
            if why is not None:
                i = _turns_apart(r, i, why)
        i += 1


def _turns(member: Op) -> bool:
    return class_of(member) is C.QKV_HEAD_EPILOGUE


def _why_not_turned(shim: CudaShim, op: Op, g: TensorGraph) -> str | None:
    """Why the GEMV in parts `op` does not turn its members' heads in its epilogue, or None where it does."""
    knob = shim.knobs.rope_epilogue
    members = parts(op)
    turned = [m for m in members if _turns(m)]
    if knob is RopeEpilogue.OFF or (knob is RopeEpilogue.AUTO and not shim.knobs.norm_launch):
        return KNOB_OFF
    if knob is RopeEpilogue.AUTO and len(turned) != len(members):
        return AUTO_SKIPS
    product = gemv(parts(turned[0])[0], g)
    if product is None or not isinstance(product.weights, Rows):
        return NOT_A_QUERY_AND_KEY
    rows = _tile_rows(shim.activation(op, 0, g), product.weights.format, product.m)
    if rows is None:
        return NOT_TURNED_HERE
    sides = sorted(turned, key=lambda m: m.dst.row is not None)  # the query (in a buffer of its own) first
    forms = [rope(parts(m)[1]) for m in sides]
    if len(sides) != attn_kernels.ROPE_SIDES or sides[0].dst.row is not None or None in forms:
        return NOT_A_QUERY_AND_KEY
    q, k = forms
    assert q is not None and k is not None
    if not _alike(q, k) or q.hd % rows:
        return NOT_ALIKE
    return None


def _tile_rows(act: QuantFormat | None, fmt, m: int) -> int | None:
    """The most rows a tile of the GEMV that turns the heads takes (a head must be whole tiles), or None where no
    GEMV turns them: the grid GEMV's in the grid formats (a step's one row: `triton/grid/parts_rope.py`), the int8
    GEMV's in its formats, or an f32 GEMV's (a step's one row read in f32, in a format the tile-streaming GEMV or
    the GEMV by rows decodes: `triton/gemv/f32_rope.py`)."""
    if fmt in kernels.GRID_GEMV_FORMATS:
        return kernels.GRID_GEMV_MOST_TILE_ROWS if m == 1 else None
    if act is QuantFormat.ONE_WORD:
        return kernels.INT8_GEMV_TILE_ROWS.get(fmt)
    f32 = act is None and kernels.f32_turning_gemv(fmt, m) is not None
    return kernels.F32_GEMV_MOST_TILE_ROWS if f32 else None


def _alike(a: RopeForm, b: RopeForm) -> bool:
    """Whether two rotations turn alike in one epilogue: one head width, one set of frequencies, both normed or
    neither."""
    eps_a, eps_b = (a.norm.eps if a.norm else 0.0), (b.norm.eps if b.norm else 0.0)
    turn_a, turn_b = (a.hd, a.base, a.yarn, a.pos, a.half), (b.hd, b.base, b.yarn, b.pos, b.half)
    return (*turn_a, eps_a, a.norm is None) == (*turn_b, eps_b, b.norm is None)


def _turns_apart(r: Rewriter, i: int, why: str) -> int:
    """Split the GEMV in parts at slot i into its products in parts and its rotations after them, pairing a
    query's and a key's in one launch where the lane takes them so; the last slot it now takes."""
    op = r.s.get(i)
    members = parts(op)
    products = [parts(m)[0] if _turns(m) else m for m in members]
    rotations = [parts(m)[1] for m in members if _turns(m)]
    head = products[0]
    ins = _parts_ins(products)
    merged = Op(Fused(C.MERGED_QKV, tuple(products)), tuple(n for n, _ in ins), tuple(a for _, a in ins), head.out,
                head.dst, tuple(sorted(c for p in products for c in p.covers)))  # fmt: skip
    r.split(ROPE_EPILOGUE, i, [merged, *rotations], why, undone=[m for m in members if _turns(m)])
    if len(rotations) == attn_kernels.ROPE_SIDES:
        r.try_fuse(ROPE_EPILOGUE, PAIR, [i + 1, i + 2], i + 2)
    elif len(rotations) == 1:
        _pair_with_a_later_turn(r, i + 1)
    return i + len(rotations)


def _pair_with_a_later_turn(r: Rewriter, at: int) -> None:
    """The lone rotation at slot `at` (a key's, whose query turns after a slice of its product: a gated query's,
    Qwen3-Next's) with the layer's next rotation at its position (`turn_partner`), in one launch where the lane
    takes them so."""
    j = turn_partner(r, at, ROTATIONS)
    if j is not None:
        r.try_fuse(ROPE_EPILOGUE, PAIR, [at, j], j)


# --- settling: products_apart ----------------------------------------------------------------------------


def products_apart(shim: CudaShim, r: Rewriter) -> None:
    """A gated pair of more rows than the GEMV takes, as its gate and up products and its GLU; one that writes
    its GLU's int8 form (a chunk's, for a down product on the int8 tensor cores) as the bare pair first, then
    its GLU as the fold that writes the int8 form in its launch (GluActMulQuant)."""
    i = 0
    while i < len(r.s):  # the schedule grows as pairs split: read its length each time round
        op = r.s.slot(i)
        if op is not None and class_of(op) in QUANTIZING and _wide_pair(parts(op)[0], r.g):
            r.split(PRODUCTS_APART, i, parts(op)[:1], NO_PAIRED_GEMM)
            continue  # the bare pair, now at slot i, splits next round
        if op is not None and _wide_pair(op, r.g) and not shim.pairs_on_cublas(r.g):
            members = parts(op)
            r.split(PRODUCTS_APART, i, members, NO_PAIRED_GEMM)
            i += len(members) - 1
            _requantize(shim, r, i)
        i += 1


def _requantize(shim: CudaShim, r: Rewriter, i: int) -> None:
    """The GLU at slot i of a split pair writes its int8 form in its own launch where the pair wrote one."""
    glu = r.s.slot(i)
    if glu is None or not isinstance(r.g.tensors[glu.out].storage, QuantizedActs):
        return
    if shim.quantizes_in_epilogue(glu, r.g):
        r.try_fuse(PRODUCTS_APART, C.GLU_ACT_MUL_QUANT, [i], i)


def _wide_pair(op: Op, g: TensorGraph) -> bool:
    """Whether `op` is a gated pair of more rows than the GEMV takes."""
    product = gemv(parts(op)[0], g) if class_of(op) is C.GEMV_GATE_UP_GLU else None
    return product is not None and product.m > kernels.GEMV_ROWS


# --- settling: quantize_apart ----------------------------------------------------------------------------


def quantize_apart(shim: CudaShim, r: Rewriter) -> None:
    """Quantizing folds the producer's kernel cannot write, as the producer; then one `Quantize` launch for
    every activation a product reads in int8 that its producer wrote in f32 only, before its first reader."""
    for i in range(len(r.s)):
        op = r.s.slot(i)
        if op is not None and class_of(op) in QUANTIZING and not shim.quantizes_in_epilogue(parts(op)[0], r.g):
            r.split(QUANTIZE_APART, i, parts(op)[:1], NO_INT8_EPILOGUE)
    i = 0
    while i < len(r.s):
        op = r.s.slot(i)
        fmt = shim.activation(op, 0, r.g) if op is not None and op.ins else None
        if op is not None and fmt is not None and not _writes_int8(r, r.s.producer(op.ins[0], before=i), op.ins[0]):
            r.insert(i, quantize(r.g, op.ins[0], fmt))
            i += 1
        i += 1


def _writes_int8(r: Rewriter, at: int | None, name: str) -> bool:
    """Whether the op at slot `at` writes `name`'s int8 form: a quantizing fold (a step's norm among them), or a
    `Quantize`, or a fused op holding a quantizing fold that writes it (a routing op that took in its norm)."""
    op = r.s.slot(at) if at is not None else None
    if op is None:
        return False
    if class_of(op) in QUANTIZING or isinstance(op.sym, Quantize) or gdn.step_writes_int8(op):
        return True
    return any(class_of(p) in QUANTIZING and p.out == name for p in parts(op)) if isinstance(op.sym, Fused) else False


def quantize(g: TensorGraph, x: str, fmt: QuantFormat) -> Op:
    """The launch that writes `x`'s int8 form (its tensor holds one from now on, which the lane allocates)."""
    t = g.tensors[x]
    g.tensors[x] = replace(t, storage=QuantizedActs(fmt))
    return Op(Quantize(math.prod(t.shape[:-1]), t.shape[-1]), (x,), (WHOLE,), x, Dst(x))
