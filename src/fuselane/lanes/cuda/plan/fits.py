"""Whether the cuda lane's kernels have a launch for a fused op, and if not, why (the shim's `fits`).

The checks run in a fixed order: the products' accumulator first; then every primitive the op stands for (a
soft cap, a sigmoid-gated delta rule, a part of every unit written, a part read in place); then a mixture's
destination; then a grid format's matrix in a fused op (none of their kernels decodes one); then the conditions
of the op's own class; last, a matrix in a format no kernel decodes.
Each refusal's text is shown to the user by
`fuselane explain`; each threshold is a kernel fact from `kernels`.

How the IR names what the checks read: an attention sits in a FlashDecode / FlashPrefill fold (built before
the quantizing rules), so "the op's attention" is read through that fold; a SwiGLU is the SiLU of the gate
times the up product; a row a parameter names is a `RowAt` whose `sel` is the parameter's name.
"""

from __future__ import annotations

from collections.abc import Sequence

from fuselane.fuse.views import (
    absorbs,
    class_of,
    embedded_norm,
    gemv,
    leaves,
    moe,
    norm,
    parts,
    rope,
    unit_output,
)
from fuselane.gguf.formats import Format
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Fused, Op, Rows, Strided, TensorGraph
from fuselane.graph.ops import (
    Attention,
    Elementwise,
    ElementwiseOp,
    ExpertMatmul,
    GateAct,
    GatedDelta,
    HeadMatmul,
    Join,
    Matmul,
    Rope,
    RowsGather,
    SetRow,
    Softcap,
    Unary,
    UnaryOp,
)
from fuselane.lanes.cuda.plan import attn_kernels, kernels
from fuselane.lanes.cuda.plan import fits_recurrent as recurrent
from fuselane.lanes.cuda.plan.knobs import Activations
from fuselane.lanes.cuda.plan.shim_view import GEMV_PARTS, Check, CudaShim
from fuselane.numerics.contract import holds_accumulator

ROWS_A_WARP = "rows_a_warp"  # the held name that runs every product a row a warp
# A latent attention's query and key rotations, side by side once `Mla` holds what lay between them.
TABLE_ROTATIONS_APART = "the fused rotations turn NEOX pairs: DeepSeek's pairs turn in the table kernel's launch"
# Fused classes whose launch turns heads by the NEOX kernels' own frequencies (`triton/rope.py`, the QKV GEMV's
# epilogue), never by a table.
NEOX_ROTATIONS = frozenset(
    {C.QK_NORM_ROPE, C.QK_NORM_ROPE_KV_APPEND, C.ROPE_KV_APPEND, C.QKV_HEAD_EPILOGUE, C.ROPE_QK_ONE_LAUNCH}
)


def fits(shim: CudaShim, op: Op, g: TensorGraph) -> str | None:
    """Why the lane has no launch for `op`, or None when it has one."""
    why = holds_accumulator(op, g, shim.accumulator_bits, shim.scheme)
    if why is not None:
        return why
    for leaf in leaves(op):
        why = _leaf(leaf)
        if why is not None:
            return why
    if moe(op) is not None and op.dst.row is not None and isinstance(op.dst.row.sel, str):
        return "a mixture writes its result at a fixed row, never at one a parameter names"
    if not isinstance(op.sym, Fused):
        return _undecoded(op, g) or (_gate_up_apart(g, op) if isinstance(op.sym, ExpertMatmul) else None)
    if op.sym.cls in NEOX_ROTATIONS and any(_table_rotation(x.sym) for x in leaves(op) if isinstance(x.sym, Rope)):
        return TABLE_ROTATIONS_APART
    check = _CHECKS.get(op.sym.cls)
    # a grid matrix first, which no fused kernel decodes; then a class's own reasons, which say what its kernels
    # take; then any matrix no kernel decodes
    return _grid_matrix(op, g) or (None if check is None else check(shim, op, op.sym.parts, g)) or _undecoded(op, g)


def undecoded(g: TensorGraph) -> str | None:
    """The first matrix of `g` in a format no kernel of the lane decodes, as `fits` words it, or a mixture whose
    gate and up experts differ in format, or None: checked before the lane is made, so that `--lane auto` runs
    such a model on the cpu lane."""
    return next((why for op in g.ops if (why := _undecoded(op, g)) is not None), None) or _gate_up_apart(g)


def _gate_up_apart(g: TensorGraph, product: Op | None = None) -> str | None:
    """Why a mixture's gate and up experts (those beside `product`, else any) have no launch: they differ in
    format (`_moe_gate_up_act`)."""
    pairs: dict[tuple[str, ...], list[str]] = {}
    for op in g.ops:
        for leaf in leaves(op):
            if isinstance(leaf.sym, ExpertMatmul) and not leaf.sym.slotted:  # gate and up read the rows and ids
                pairs.setdefault((leaf.ins[0], *leaf.ins[2:]), []).append(leaf.ins[1])
    if product is not None:
        pairs = {key: names for key, names in pairs.items() if product.ins[1] in names}
    for names in pairs.values():
        formats = [_matrix_format(name, g) for name in names]
        if len(set(formats)) > 1:
            listed = " and ".join(f"{n} is {f.name}" for n, f in zip(names, formats, strict=True) if f is not None)
            return f"{listed}: {GATE_UP_ONE_FORMAT}" + _CPU
    return None


def _undecoded(op: Op, g: TensorGraph) -> str | None:
    """A matrix the op reads in a format no kernel of the lane decodes there: one outside
    `kernels.DEQUANT_FORMATS` and the grid formats, whose products, gathers and prompt scratch would each stop
    at it; or a grid format's (`kernels.GRID_GEMV_FORMATS`) anywhere but as the matrix of a product alone, which
    its own GEMV multiplies (and its whole-matrix decode, for a chunk), or of a per-head product
    (`_values_decoded`)."""
    for leaf in leaves(op):
        for i, name in enumerate(leaf.ins):
            fmt = _matrix_format(name, g)
            if fmt is None or fmt in kernels.DEQUANT_FORMATS or _values_decoded(leaf, i):
                continue
            if fmt not in kernels.GRID_GEMV_FORMATS:
                return f"{name} is {fmt.name}, which no kernel of the lane decodes" + _CPU
            if isinstance(op.sym, Fused):
                if _grid_launch(op, g):
                    continue
                return _GRID_ALONE.format(name=name, fmt=fmt.name)
            if not (isinstance(op.sym, (Matmul, ExpertMatmul)) and i == 1 or isinstance(op.sym, RowsGather)):
                return (
                    f"{name} is {fmt.name}, a grid format, which the lane decodes in a product and an embedding only"
                    + _CPU
                )
    return None


_CPU = " (the cpu lane runs it)"
_GRID_ALONE = (
    "{name} is {fmt}, a grid format, which the lane multiplies by its own GEMV: alone, with a bias, a landing row "
    "or a step's add + norm, in parts with a step's products in its format (turning a query's and a key's heads), or "
    "paired with an up product in its format; a mixture's experts in its gate/up and "
    "down launches, with no shared expert folded in; an embedding table in its gather and norm"
)


# Fused classes whose launch is a product alone with its bias or its landing row (`product_launch.product`),
# which the grid GEMV's epilogue takes as the GEMV by rows' does.
_GRID_PRODUCT_CLASSES = frozenset({C.GEMM_BIAS, C.ROW_WRITE})
# A mixture's launches whose experts may be in a grid format (`grid/experts.py` for a step's or a batch's rows, the
# grouped GEMM's grid tiles for a chunk's); a folded shared expert (SharedExpertFusion) is taken apart.
_GRID_MIXTURE_CLASSES = frozenset({C.MOE_GATE_UP_ACT, C.MOE_DOWN_COMBINE, C.MOE_DEFERRED_FINALIZE})


def _grid_launch(op: Op, g: TensorGraph) -> bool:
    """Whether a fused op's grid matrices have a launch of the grid GEMV: a product with its bias or landing
    row, a step's projection whose last program norms its row (`grid.gemv.gemv_grid_add_norm`; with the
    normed row's int8 form, NormQuant), or a gated pair within the GEMV's rows whose gate and up product share
    one grid format (`gemv_grid_gate_up_glu`; a step's writing its int8 form too, GluActMulQuant)."""
    if op.sym.cls in _GRID_PRODUCT_CLASSES:
        return True
    if op.sym.cls in _GRID_MIXTURE_CLASSES:  # every grid matrix an expert tensor the launch multiplies
        return all(isinstance(leaf.sym, ExpertMatmul) for leaf in leaves(op) if _reads_grid(leaf, g))
    if op.sym.cls is C.EMBED_NORM:  # the gather decodes its table's rows (`norm.embed_norm`)
        return all(isinstance(leaf.sym, RowsGather) for leaf in leaves(op) if _reads_grid(leaf, g))
    if op.sym.cls is C.NORM_QUANT:  # a norm writing its int8 form too: the add + norm's or the mixture's launch
        first = op.sym.parts[0]
        closing = (C.GEMV_NORM_EPILOGUE, C.MOE_DEFERRED_FINALIZE)
        return isinstance(first.sym, Fused) and first.sym.cls in closing and _grid_launch(first, g)
    if op.sym.cls is C.GLU_ACT_MUL_QUANT:  # a step's gated pair or kept experts' gate/up writing its int8 form
        first = op.sym.parts[0]
        if not (isinstance(first.sym, Fused) and _grid_launch(first, g)):
            return False
        if first.sym.cls is C.MOE_GATE_UP_ACT:  # `grid.experts.grid_gate_up`
            return all(leaf.sym.rows == 1 for leaf in leaves(first) if isinstance(leaf.sym, ExpertMatmul))
        p = gemv(parts(first)[0], g) if first.sym.cls is C.GEMV_GATE_UP_GLU else None  # `gemv_grid_gate_up_glu`
        return p is not None and p.m == 1
    if op.sym.cls is C.MERGED_QKV:  # a step's products in one grid format (`gemv_grid_parts`; turning a query's
        # and a key's heads, `gemv_grid_parts_rope`)
        products = [_turned_product(m, g) for m in op.sym.parts]
        formats = {p.weights.format if p is not None and isinstance(p.weights, Rows) else None for p in products}
        return len(formats) == 1 and formats <= kernels.GRID_GEMV_FORMATS and products[0].m == 1
    if op.sym.cls is C.QKV_HEAD_EPILOGUE:  # a step's one row: it launches only as a part of the GEMV in parts
        p = _turned_product(op, g)
        return p is not None and p.m == 1
    if op.sym.cls is C.GEMV_NORM_EPILOGUE:  # a step's one row (the class's own check says the rest)
        p = gemv(op.sym.parts[0], g)
        return p is not None and p.m == 1
    if op.sym.cls is not C.GEMV_GATE_UP_GLU:
        return False
    products = [p for m in op.sym.parts if (p := gemv(m, g)) is not None]
    formats = {p.weights.format if isinstance(p.weights, Rows) else None for p in products}
    return (
        len(products) == 2
        and products[0].m <= kernels.GEMV_ROWS
        and len(formats) == 1
        and formats <= kernels.GRID_GEMV_FORMATS
    )


def _turned_product(member: Op, g: TensorGraph):
    """The product a member of a GEMV in parts computes (a projection turning its heads: its product)."""
    return gemv(parts(member)[0] if class_of(member) is C.QKV_HEAD_EPILOGUE else member, g)


def _reads_grid(leaf: Op, g: TensorGraph) -> bool:
    """Whether a primitive reads a matrix in a grid format."""
    return any(_matrix_format(name, g) in kernels.GRID_GEMV_FORMATS for name in leaf.ins)


def _grid_matrix(op: Op, g: TensorGraph) -> str | None:
    """Why a fused op holding a grid format's matrix has no launch: no fused class's kernel decodes one but the
    grid GEMV's (`_grid_launch`), so the op is taken apart and its products run alone."""
    if _grid_launch(op, g):
        return None
    for leaf in leaves(op):
        for i, name in enumerate(leaf.ins):
            fmt = _matrix_format(name, g)
            if fmt in kernels.GRID_GEMV_FORMATS and not _values_decoded(leaf, i):
                return _GRID_ALONE.format(name=name, fmt=fmt.name)
    return None


def _values_decoded(leaf: Op, operand: int) -> bool:
    """Whether a primitive's operand is a matrix its launch reads as f32 values, decoded once on the device from
    any format the whole-matrix decode takes, the grid formats too (`mla_launch._head_weights`): a latent
    attention's per-head product's (llama.cpp's IQ mixes write DeepSeek's `attn_v_b`, rows of the latent's 512
    values, in them). The expanded form's tiles decode none of them, so such a half keeps the absorbed form
    (`latent.HeadHalf.in_tiles`)."""
    return isinstance(leaf.sym, HeadMatmul) and operand == 1


def _matrix_format(name: str, g: TensorGraph) -> Format | None:
    """The format of the checkpoint rows `name` is, or None for any other tensor."""
    t = g.tensors.get(name)
    return t.storage.format if t is not None and isinstance(t.storage, Rows) else None


def _leaf(leaf: Op) -> str | None:
    """What in one primitive no kernel of the lane takes."""
    spec = leaf.sym
    if isinstance(spec, Attention) and spec.ext is not None and spec.ext.softcap is not None:
        return "the lane's attention takes no soft cap"
    if isinstance(spec, Softcap):
        return "the lane links no soft-capped tensor"
    if isinstance(spec, GatedDelta) and spec.gate is GateAct.SIGMOID:
        return "the lane's gated delta gates by SiLU, not a sigmoid"
    if isinstance(spec, Matmul) and spec.k % kernels.QBLOCK:
        # quantized rows are whole blocks by their format; only a float matrix can be ragged
        return f"the lane's products take rows of whole {kernels.QBLOCK}-value blocks, not {spec.k} values"
    unit = leaf.dst.unit
    if unit is not None:
        written = unit_output(leaf)
        if written is None or written[1] != unit.width:
            return (
                "the lane writes a part of every unit of a wider tensor only from a norm, a rotation or a "
                "per-head product"
            )
    for access in leaf.access:
        if not isinstance(access, Strided):
            continue
        if isinstance(spec, HeadMatmul) and (access.pitch % kernels.QBLOCK or access.offset % kernels.QBLOCK):
            return "a per-head product reads a part in place only at whole 32-value blocks"
        pair = attn_kernels.ATTN_VALUES_A_LOAD
        if isinstance(spec, Attention) and (access.pitch % pair or access.offset % pair):
            return "an attention reads its values in place a pair at a time, from an even place"
    return None


def _attention(op: Op) -> Attention | None:
    """The attention an op is: bare, or in the FlashDecode / FlashPrefill fold our table wraps it in."""
    if isinstance(op.sym, Attention):
        return op.sym
    if class_of(op) in (C.FLASH_DECODE, C.FLASH_PREFILL):
        return _attention(parts(op)[0])
    return None


def _one_row(shim: CudaShim, m: int) -> bool:
    return m == 1 and not shim.knobs.batch


def _one_row_or_batch_of_one(m: int) -> bool:
    """A step's one row, or a batch of one sequence (its bucket of one row): the one-row GEMV's epilogues run
    there too, so a batch of one runs the single step's launches (the batch form's rotation reads the row's own
    position, its key lands in the step's staging row)."""
    return m == 1


# --- norms -----------------------------------------------------------------------------------------------


def _norm_then_add(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    if norm(op) is None:
        return "the lane's norm-then-add kernel norms the sum it writes"
    return None


def _gemv_norm_epilogue(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    p = gemv(members[0], g)
    n = norm(members[1]) if len(members) > 1 else None
    if p is None or n is None:
        return "a projection's epilogue norms the add of its result"
    fmt = p.weights.format if isinstance(p.weights, Rows) else None
    int8 = shim.activation(members[0], 0, g) is not None
    chunked = fmt is not None and kernels.norm_walked_in_chunks(fmt, p.m, p.k, n.cols, int8)
    grid = fmt in kernels.GRID_GEMV_FORMATS  # the grid GEMV's last program walks the norm's row in chunks
    by_rows = fmt is not None and (kernels.rows_gemv(fmt, p.m) or chunked or grid)
    one_gemv = by_rows and _one_row_or_batch_of_one(p.m) and p.dst.own() is not None
    whole_row = n.part is None and n.rows == p.m and n.cols == p.n and members[1].dst.own() is not None
    if not (one_gemv and whole_row):
        return (
            "a projection norms in its last block the one row it writes whole, a GEMV of a step's one row by "
            "checkpoint rows"
        )
    # every GEMV's last program walks a norm wider than its block holds in chunks, so any width is taken
    # the int8 GEMV's tail was measured slower than a launch; a product that reads f32 keeps its epilogue
    # only a gated pair's down projection: a layer's attention output projection keeps its epilogue however
    # long its rows (a query more than twice the hidden width), so the layer keeps its 7 launches
    mode = kernels.mode(shim.knobs.activations) if int8 else kernels.Mode.FLOAT
    if shim.knobs.norm_launch and kernels.norm_in_own_launch(mode, p.k, p.n) and _reads_gated_pair(p.x, g):
        return (
            "under int8 activations and norm_launch=on a down projection longer than the norm is wide leaves its "
            "add and norm to a launch of their own: the last block's serial tail costs more than a launch"
        )
    return None


def _reads_gated_pair(x: str, g: TensorGraph) -> bool:
    """Whether activation `x` is a gated pair's output, SiLU(gate) * up: what a down projection reads."""
    made = {leaf.out: leaf for top in g.ops for leaf in leaves(top)}
    mul = made.get(x)
    if mul is None or not (isinstance(mul.sym, Elementwise) and mul.sym.op is ElementwiseOp.MUL):
        return False
    return any(isinstance(u.sym, Unary) and u.sym.op is UnaryOp.SILU for name in mul.ins if (u := made.get(name)))


def _moe_deferred_finalize(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    m = moe(members[0])
    n = norm(members[-1])
    if m is None or n is None:
        return "a mixture's last step norms the add of its result"
    second = members[1].sym if len(members) > 1 else None
    summed = len(members) == 2 or (isinstance(second, Elementwise) and second.op is ElementwiseOp.ADD)
    whole_rows = n.part is None and n.rows == m.rows and n.cols == m.d and n.own and m.dst.own() is not None
    if not (summed and whole_rows):
        return "a mixture, alone or summed with another array, adds and norms in its last step the whole rows it writes"
    # The decode step's last down block norms the row, walking a row wider than it holds in chunks
    # (`fast_norm.norm_last`); a chunk's or a batch's combine takes a block of the norm's threads a row.
    if _one_row(shim, m.rows) and shim.moe_down_launch(members[0], g) is None:
        return "a decode mixture's down projection reads its experts' widths from its parts"
    return None


GATE_UP_ONE_FORMAT = "a mixture's gate and up experts multiply in one launch that decodes one format"


def _moe_gate_up_act(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    formats = {_matrix_format(leaf.ins[1], g) for leaf in leaves(op) if isinstance(leaf.sym, ExpertMatmul)}
    return GATE_UP_ONE_FORMAT if len(formats) > 1 else None


def _embed_norm(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    first = members[0]
    gathered = isinstance(first.sym, RowsGather) or class_of(first) is C.EMBED_SCALE
    n = embedded_norm(op)
    if n is not None and gathered and n.own:
        return None
    return "a gather norms in its own blocks the whole rows it gathers"


def _norm_quant(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    first = members[0]
    # A projection whose last block norms its row (GemvNormEpilogue, which the shared `norm_quant` rule
    # offers) closes with an RMS norm too: its norm is its second part; a mixture's last step's is its last.
    closing = None
    if class_of(first) is C.GEMV_NORM_EPILOGUE:
        closing = norm(parts(first)[1])
    elif class_of(first) is C.MOE_DEFERRED_FINALIZE:
        closing = norm(parts(first)[-1])
    if norm(first) is None and embedded_norm(first) is None and closing is None:
        return "the lane's norm quantizes its result only from an RMS norm"
    return None


# --- rotations and attention -----------------------------------------------------------------------------


def _qkv_head_epilogue(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    p = shim.rows_product(members[0], g)
    ro = rope(members[1]) if len(members) > 1 else None
    if p is None or ro is None:
        return "a projection's epilogue turns the heads of its result"
    one_row = _one_row_or_batch_of_one(p.m) and shim.gemv_mergeable(p) and p.dst.own() is not None
    its_heads = (
        ro.part is None and ro.heads == ro.per_row and p.n == ro.heads * ro.hd and ro.hd <= attn_kernels.ROPE_HEAD
    )
    if one_row and its_heads:
        return None
    return "a projection turns in its epilogue the heads of the one row it writes whole, a GEMV of a step's one row"


def _rope_qk_one_launch(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    sides = [rope(m) for m in members]
    if any(s is None for s in sides):
        return "a launch of rotations takes rotations"
    normed = {s.norm is not None for s in sides if s is not None}
    turns = {(s.hd, s.base, s.yarn) for s in sides if s is not None}
    one = (
        len(sides) <= attn_kernels.ROPE_SIDES
        and all(s.heads == s.per_row for s in sides if s is not None)
        and len(normed) <= 1
        and len(turns) <= 1
    )
    if one:
        return None
    return "one launch rotates at most a query and a key of a step's one row, alike, both normed or neither"


def _table_rotation(spec: Rope) -> bool:
    """A rotation of DeepSeek's pairs: the table kernel's (`triton.mla.parts`) alone (the NEOX kernels turn
    YaRN's stretched frequencies too)."""
    return not spec.half


JOIN_IN_PLACE_PAIRS = (
    "one launch writes a join's parts in place only as a per-head product then its heads' rotation by a table, or "
    "a weighted norm of whole rows then a rotation by a table"
)


HEADS_IN_BLOCKS = "a per-head product quantizes its outputs only where each head's are whole 32-value blocks"
JOIN_ROW_WRITE_FORM = "one launch writes a join in a cache row only as the cache row's norm and rotation, at pos"


def _join_in_place(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    # the query's join (HeadMatmul by the key half, its rotated part) and the cache row's (the latent's
    # NormWeight, the rotated key): `mla_launch.join_in_place`'s two launches; the cache row's written
    # straight into the cache at the position where its row write follows it (`join_row_write`)
    if len(members) == 2 and isinstance(members[1].sym, SetRow):
        inner, row = members
        if class_of(inner) is not C.JOIN_IN_PLACE or row.sym.batched:  # type: ignore[union-attr]
            return JOIN_ROW_WRITE_FORM
        why = _join_in_place(shim, inner, parts(inner), g)
        cache_row = not any(isinstance(p.sym, HeadMatmul) for p in parts(inner))
        return why if why is not None else (None if cache_row else JOIN_ROW_WRITE_FORM)
    join = next((p for p in members if isinstance(p.sym, Join)), None)
    made = {p.out: p for p in members}
    first, second = (made.get(n) for n in join.ins) if join is not None and len(join.ins) == 2 else (None, None)
    if first is None or second is None or not isinstance(second.sym, Rope):
        return JOIN_IN_PLACE_PAIRS
    turn: Rope = second.sym
    spec: Join = join.sym  # type: ignore[union-attr, assignment]
    if not _table_rotation(turn) or turn.rot or turn.heads != spec.heads or turn.hd * spec.heads != spec.wb:
        return JOIN_IN_PLACE_PAIRS
    if isinstance(first.sym, HeadMatmul):
        return None if first.sym.heads == spec.heads and first.sym.b * spec.heads == spec.wa else JOIN_IN_PLACE_PAIRS
    normed = norm(first) if class_of(first) is C.NORM_WEIGHT else None
    return None if normed is not None and spec.heads == 1 and normed.cols == spec.wa else JOIN_IN_PLACE_PAIRS


PROLOGUE_PAIR = "one launch runs a latent attention's query join and its cache row's join only as each runs alone"


def _mla_prologue(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    # `triton.mla.prologue`: the query's join's grid (`heads.head_matmul` with its `Turn`) and one more plane
    # for the cache row's (`parts.norm_rope`), each as it runs alone
    if len(members) != 2 or any(class_of(m) is not C.JOIN_IN_PLACE for m in members):
        return PROLOGUE_PAIR
    query, row = members
    if [absorbs(m) for m in members] != [True, False]:
        return PROLOGUE_PAIR
    return _join_in_place(shim, query, parts(query), g) or _join_in_place(shim, row, parts(row), g)


def _attn_output_gate(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    # The gate rides the decode step's, a short chunk's and a batch's sequences' attention stores, a pair a
    # thread; a chunk in tiles gates apart.
    attentions = [a for m in members if (a := _attention(m)) is not None]
    pair = attn_kernels.ATTN_VALUES_A_LOAD
    if attentions and all(a.rows <= kernels.GEMV_ROWS and a.value_width % pair == 0 for a in attentions):
        return None
    return (
        "an attention gates its output only in the decode step's, a short chunk's and a batch's sequences' "
        "kernels, its heads whole pairs"
    )


def _attn_output_quant(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    # The decode step's attention stores its output a pair a thread, each 32-value group in one half-warp's
    # sixteen lanes; a chunk's (`attention/prefill.py`) quantizes each tile row's head in its epilogue: both
    # take heads of whole 32-value groups. A step's (or a batch's) heads that are not whole groups (8, 16,
    # 48, 80) run heads whole groups together a block where the group allows it (`attn_kernels.attn_heads_a_block`;
    # the packed kernel's block is a key/value group), and otherwise are read back where stored, each group
    # two blocks share by the later of them (`attention.splits.seam_counters`): the row must be whole groups.
    a = _attention(members[0])
    if a is not None and a.value_width % kernels.QBLOCK == 0:
        return None
    step = a is not None and (a.rows == 1 or a.batched) and a.hd == a.value_width
    if step and a.heads * a.hd % kernels.QBLOCK == 0:  # type: ignore[union-attr]
        return None
    return (
        "an attention quantizes its output only where its heads are whole 32-value groups, or a decode step's "
        "heads together are"
    )


# --- products --------------------------------------------------------------------------------------------


def _gemv_gate_up_glu(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    products = [p for m in members if (p := gemv(m, g)) is not None]
    if len(products) < 2:
        return "a gated pair is two products"
    gate, up = products[0], products[1]
    if not (isinstance(gate.weights, Rows) and isinstance(up.weights, Rows)):
        return "the lane pairs a gate and an up product only over checkpoint rows"
    grid = gate.weights.format in kernels.GRID_GEMV_FORMATS  # the grid GEMV's pair (`_grid_launch`)
    if gate.m <= kernels.GEMV_ROWS and not (grid or shim.gemv_takes(gate, g)):
        return "a chunk's few rows pair a gate and an up product only in the formats the f32 GEMVs decode"
    gemv_rows = gate.m <= kernels.GEMV_ROWS or shim.knobs.activations is Activations.DEQUANT
    paired = not gemv_rows and gate.weights == up.weights and gate.n % kernels.GEMM_PAIR_TILE_N == 0
    if gemv_rows or paired or shim.pairs_on_cublas(g):
        return None
    return "a gated pair on the tensor cores pairs tiles of one format, the hidden width whole pair tiles"


def _gemv_quant(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    if isinstance(members[0].sym, HeadMatmul):  # DeepSeek's value half: a program a block of a head's outputs
        return None if attn_kernels.head_product_quantizes(members[0].sym.b) else HEADS_IN_BLOCKS
    p = gemv(members[0], g)
    if (
        p is not None
        and shim.per_warp(p) == kernels.ROWS_A_WARP_WIDE
        and p.n % kernels.QBLOCK == 0
        and p.dst.own() is not None
    ):
        return None
    return "a product quantizes its outputs only four rows a warp, whole blocks of them"


def _whole_groups(part: Op) -> bool:
    """Whether a part of a gated attention stores whole 32-value groups: its heads, a batch's rows."""
    a = _attention(part)
    if a is not None:
        return a.value_width % kernels.QBLOCK == 0
    if isinstance(part.sym, SetRow):
        return part.sym.cols % kernels.QBLOCK == 0
    return True


def _glu_act_mul_quant(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    inner = members[0]
    if class_of(inner) is C.ATTN_OUTPUT_GATE:
        # A batch's sequences each quantize their gated row in their store, set with its quantized form into
        # the product's. (A gate that is not a fold cannot reach here: the class is one.)
        if all(_whole_groups(p) for p in parts(inner)):
            return None
        return (
            "a gated attention quantizes its output in its store only where its heads, and a batch's rows, are "
            "whole 32-value groups"
        )
    if class_of(inner) is C.GEMV_GATE_UP_GLU:
        hidden = next((p.n for m in parts(inner) if (p := gemv(m, g)) is not None), None)
        if hidden is None or hidden % kernels.QBLOCK:
            return "a gated pair quantizes its hidden values in whole 32-value blocks"
    return None


def _merged_qkv(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    # The GEMV in parts is the lane's own rule, held with it.
    if GEMV_PARTS not in shim.held and shim.gemv_in_parts(members, g):
        return None
    if shim.gemm_parts(members, g):
        return "the lane has no GEMM in parts yet: a chunk's products of one activation run apart"
    return (
        "products of one activation are one launch in parts: at most four, one format — on the tensor cores "
        "whole 128-output tiles"
    )


def _row_write_quant(shim: CudaShim, op: Op, members: Sequence[Op], g: TensorGraph) -> str | None:
    # A row set carries its row's quantized form a block at a time: the rows whole 32-value blocks.
    first = members[0].sym
    if isinstance(first, SetRow) and first.cols % kernels.QBLOCK == 0:
        return None
    return "a row set carries its rows' quantized form only where they are whole 32-value blocks"


_CHECKS: dict[C, Check] = {
    C.NORM_THEN_ADD: _norm_then_add,
    C.GEMV_NORM_EPILOGUE: _gemv_norm_epilogue,
    C.MOE_DEFERRED_FINALIZE: _moe_deferred_finalize,
    C.MOE_GATE_UP_ACT: _moe_gate_up_act,
    C.EMBED_NORM: _embed_norm,
    C.QKV_HEAD_EPILOGUE: _qkv_head_epilogue,
    C.CONV_SILU_L2NORM: recurrent.conv_silu_l2norm,
    C.GEMV_GATE_UP_GLU: _gemv_gate_up_glu,
    C.CONV_PARTS: recurrent.conv_parts,
    C.GDN_GATE_PROJECTIONS: recurrent.gdn_gate_projections,
    C.GDN_STEP: recurrent.gdn_step,
    C.SHARED_EXPERT_FUSION: recurrent.shared_expert_fusion,
    C.ROUTER_TOPK: recurrent.router_topk,
    C.ROPE_QK_ONE_LAUNCH: _rope_qk_one_launch,
    C.ATTN_OUTPUT_GATE: _attn_output_gate,
    C.ROW_WRITE_QUANT: _row_write_quant,
    C.GLU_ACT_MUL_QUANT: _glu_act_mul_quant,
    C.ATTN_OUTPUT_QUANT: _attn_output_quant,
    C.NORM_QUANT: _norm_quant,
    C.GEMV_QUANT: _gemv_quant,
    C.MERGED_QKV: _merged_qkv,
    C.JOIN_IN_PLACE: _join_in_place,
    C.MLA_PROLOGUE: _mla_prologue,
}
