"""The shared rule table: dataflow patterns and the fused classes they build, in order.

Each rule is a (pattern, class) pair with a one-line `# before -> after` comment. A pattern looks at one slot
of the schedule; where its shape is there (and every intermediate it swallows has no other reader), it asks
the rewriter to fuse, which asks the lane. Rules are lane-independent: a lane's quirks live in its shim.
Lanes link their own rules in at named positions; any rule may be held by name.
"""

from __future__ import annotations

from fuselane.fuse.gdn_rules import GATED_ATTENTION_RULES, GDN_RULES, STEP_NORM_RULES
from fuselane.fuse.moe_rules import MOE_RULES, ROUTE_IN_NORM_RULES
from fuselane.fuse.parallel_rules import PARALLEL_RULES
from fuselane.fuse.patterns import is_add, is_mul, next_reader, op_at
from fuselane.fuse.quant_rules import QUANT_RULES
from fuselane.fuse.rewriter import Rewriter
from fuselane.fuse.routing_rules import ROUTING_RULES
from fuselane.fuse.rule import Pattern, Rule
from fuselane.fuse.views import absorbs, gemv, leaves, rope, slice_view
from fuselane.graph import facts
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Dst, Role, Strided, UnitPart
from fuselane.graph.ops import (
    ArgMax,
    Attention,
    Elementwise,
    Join,
    Matmul,
    RmsNorm,
    Rope,
    RowsGather,
    SetRow,
    Slice,
    Unary,
    UnaryOp,
)


def _weight(r: Rewriter, name: str) -> bool:
    return r.g.tensors[name].role is Role.WEIGHT


PRODUCTS = (Matmul, C.GEMM_BIAS)
ROPES = (Rope, C.QK_NORM_ROPE, C.ROPE_KV_APPEND, C.QK_NORM_ROPE_KV_APPEND)


def norm_weight(r: Rewriter, i: int) -> None:
    if op_at(r, i, RmsNorm) is None:
        return
    j = next_reader(r, i, Elementwise, rule="norm_weight")
    if j is not None and is_mul(r.s.get(j), row=True) and _weight(r, r.s.get(j).ins[1]):
        r.try_fuse("norm_weight", C.NORM_WEIGHT, [i, j], j)


def embed_norm(r: Rewriter, i: int) -> None:
    if op_at(r, i, RowsGather) is None:
        return
    gathered = r.s.get(i).out
    for j in r.s.readers(gathered):
        if j > i and op_at(r, j, C.NORM_WEIGHT) is not None and r.s.get(j).ins[0] == gathered:
            r.try_fuse("embed_norm", C.EMBED_NORM, [i, j], j)
            return


def add_norm(r: Rewriter, i: int) -> None:
    op = op_at(r, i, Elementwise)
    if op is None or not is_add(op, row=False):
        return
    for j in r.s.readers(op.out):  # after the add: a reader before it reads an older value of the name
        if j > i and op_at(r, j, C.NORM_WEIGHT) is not None and r.s.get(j).ins[0] == op.out:
            r.try_fuse("add_norm", C.ADD_NORM, [i, j], j)
            return


def norm_then_add(r: Rewriter, i: int) -> None:
    if op_at(r, i, C.NORM_WEIGHT) is None:
        return
    j = next_reader(r, i, Elementwise, operand=None, rule="norm_then_add")
    if j is not None and is_add(r.s.get(j), row=False):
        r.try_fuse("norm_then_add", C.NORM_THEN_ADD, [i, j], j)


def qk_norm_rope(r: Rewriter, i: int) -> None:
    op = op_at(r, i, C.NORM_WEIGHT)
    if op is None:
        return
    j = next_reader(r, i, Rope, rule="qk_norm_rope")
    if j is not None:
        r.try_fuse("qk_norm_rope", C.QK_NORM_ROPE, [i, j], j)


def _rope_append(name: str, first: type | C, builds: C) -> Pattern:
    def pattern(r: Rewriter, i: int) -> None:
        if op_at(r, i, first) is None:
            return
        j = next_reader(r, i, SetRow, rule=name)
        if j is not None:
            r.try_fuse(name, builds, [i, j], j)

    return pattern


def gemm_bias(r: Rewriter, i: int) -> None:
    if op_at(r, i, Matmul) is None:
        return
    j = next_reader(r, i, Elementwise, rule="gemm_bias")
    if j is not None and is_add(r.s.get(j), row=True) and _weight(r, r.s.get(j).ins[1]):
        r.try_fuse("gemm_bias", C.GEMM_BIAS, [i, j], j)


def row_write(r: Rewriter, i: int) -> None:
    if op_at(r, i, *PRODUCTS) is None:
        return
    j = next_reader(r, i, SetRow, rule="row_write")
    if j is not None:
        r.try_fuse("row_write", C.ROW_WRITE, [i, j], j)


def qkv_head_epilogue(r: Rewriter, i: int) -> None:
    if op_at(r, i, *PRODUCTS) is None:
        return
    j = next_reader(r, i, *ROPES, rule="qkv_head_epilogue")
    if j is not None:
        r.try_fuse("qkv_head_epilogue", C.QKV_HEAD_EPILOGUE, [i, j], j)


def turn_partner(r: Rewriter, i: int, kinds: tuple[type | C, ...]) -> int | None:
    """The slot of the rotation (one of `kinds`) that turns beside the one at slot i: the layer's next, before
    its attention (a later one is the next layer's), at the same position (the same step's query and key)."""
    mine = rope(r.s.get(i))
    for j in range(i + 1, len(r.s)):
        op = r.s.slot(j)
        if op is None:
            continue
        if any(isinstance(x.sym, Attention) for x in leaves(op)):
            return None
        if op_at(r, j, *kinds) is not None:
            other = rope(op)
            return j if mine is not None and other is not None and mine.pos == other.pos else None
    return None


def rope_q_k_one_launch(r: Rewriter, i: int) -> None:
    if op_at(r, i, *ROPES) is None:
        return
    j = turn_partner(r, i, ROPES)
    if j is not None:
        r.try_fuse("rope_q_k_one_launch", C.ROPE_QK_ONE_LAUNCH, [i, j], j)


def _attention(name: str, builds: C, decode: bool) -> Pattern:
    def pattern(r: Rewriter, i: int) -> None:
        op = op_at(r, i, Attention)
        # a batch's rows are each one sequence's step: the decode kernel's shape, many times over
        if op is not None and (op.sym.rows == 1 or op.sym.batched) is decode:  # type: ignore[union-attr]
            r.try_fuse(name, builds, [i], i)

    return pattern


def glu_act_mul(r: Rewriter, i: int) -> None:
    op = op_at(r, i, Unary)
    if op is None or op.sym.op is not UnaryOp.SILU:  # type: ignore[union-attr]
        return
    j = next_reader(r, i, Elementwise, rule="glu_act_mul")
    if j is not None and is_mul(r.s.get(j), row=False):
        r.try_fuse("glu_act_mul", C.GLU_ACT_MUL, [i, j], j)


def _gate_up(r: Rewriter, j: int, rule: str) -> tuple[int, int] | None:
    """The gate and up products a GLU at slot j multiplies, where they read one activation and only it reads
    them."""
    glu = op_at(r, j, C.GLU_ACT_MUL)
    if glu is None or len(glu.ins) != 2:  # silu(x) * x reads one value: there is no pair of products
        return None
    found = []
    for name in glu.ins:
        i = r.s.producer(name, before=j)
        if i is None or op_at(r, i, Matmul) is None:
            return None
        if r.sole_reader(name) != j:
            r.no_match(rule, i, lambda name=name: r.other_readers(name, j))
            return None
        found.append(i)
    gate, up = (r.s.get(k) for k in found)
    return (found[0], found[1]) if gate.ins[0] == up.ins[0] else None


def gate_up_glu(r: Rewriter, j: int) -> None:
    pair = _gate_up(r, j, "gate_up_glu")
    if pair is not None:
        r.try_fuse("gate_up_glu", C.GEMV_GATE_UP_GLU, [*pair, j], j)


def merged_gate_up(r: Rewriter, j: int) -> None:
    pair = _gate_up(r, j, "merged_gate_up")
    if pair is not None:
        gate = r.s.get(pair[0])
        r.try_fuse("merged_gate_up", C.MERGED_GATE_UP, list(pair), pair[0], out=gate.out, dst=gate.dst)


def _product_of(r: Rewriter, i: int, x: str | None = None):
    """A product merged_projections may group (of activation `x`, where given): not a gate or up product, which
    the GLU rules pair. The activation is compared before the product's readers are looked for."""
    if op_at(r, i, *PRODUCTS, C.ROW_WRITE) is None:
        return None
    product = gemv(r.s.get(i), r.g)
    if product is None or (x is not None and product.x != x):
        return None
    reader = r.sole_reader(r.s.get(i).out)
    if reader is not None and op_at(r, reader, C.GLU_ACT_MUL, C.GEMV_GATE_UP_GLU) is not None:
        return None
    return product


def merged_projections(r: Rewriter, i: int) -> None:
    first = _product_of(r, i)
    if first is None:
        return
    # only a reader of the activation can be a product of it; a group starts at the first, so the lane is asked
    # once per group
    others = [k for k in r.s.readers(first.x) if k != i]
    if any(_product_of(r, k, first.x) is not None for k in others if k < i):
        return
    group = [i]
    for j in (k for k in others if k > i):
        if _product_of(r, j, first.x) is None:
            continue
        crossing = r.crossing([j], i)
        if crossing is None:
            group.append(j)
        else:
            r.no_match("merged_projections", j, lambda crossing=crossing: f"cannot join op {i}'s group: {crossing}")
    if len(group) > 1:
        head = r.s.get(i)
        r.try_fuse("merged_projections", C.MERGED_QKV, group, i, out=head.out, dst=head.dst)


def gemv_norm_epilogue(r: Rewriter, i: int) -> None:
    if op_at(r, i, *PRODUCTS) is None:
        return
    j = next_reader(r, i, C.ADD_NORM, operand=None, rule="gemv_norm_epilogue")
    if j is not None:
        r.try_fuse("gemv_norm_epilogue", C.GEMV_NORM_EPILOGUE, [i, j], j)


def strided_read(r: Rewriter, i: int) -> None:
    sl = slice_view(r.s.get(i)) if op_at(r, i, Slice) else None
    if sl is None:
        return
    j = r.sole_reader(r.s.get(i).out)
    if j is None:
        r.no_match("strided_read", i, lambda: _other_readers(r, r.s.get(i).out))
        return
    if j < i:  # it reads an older value of the name
        return
    consumer = r.s.get(j)
    access = Strided(sl.every, sl.start, sl.width)
    sliced = r.s.get(i).out
    ins = [(sl.x, access) if n == sliced else (n, a) for n, a in zip(consumer.ins, consumer.access, strict=True)]
    r.try_fuse("strided_read", C.STRIDED_READ, [i, j], j, ins=ins)


def join_in_place(r: Rewriter, j: int) -> None:
    join = op_at(r, j, Join)
    if join is None:
        return
    spec: Join = join.sym  # type: ignore[assignment]
    producers = [r.s.producer(n, before=j) for n in join.ins]
    # two inputs from two producers: join(a, a) would make one op write both unit parts (and cover it twice)
    if len(join.ins) != 2 or None in producers or producers[0] == producers[1]:
        return
    for name in join.ins:
        if r.sole_reader(name) != j:
            r.no_match("join_in_place", j, lambda name=name: r.other_readers(name, j))
            return
    pitch = (spec.wa + spec.wb) // spec.heads
    dst = Dst(join.out, unit=UnitPart(pitch, 0, spec.wa // spec.heads))
    r.try_fuse("join_in_place", C.JOIN_IN_PLACE, [*producers, j], j, dst=dst)  # type: ignore[list-item]


def join_row_write(r: Rewriter, i: int) -> None:
    if op_at(r, i, C.JOIN_IN_PLACE) is None:
        return
    j = next_reader(r, i, SetRow, rule="join_row_write")
    if j is not None:
        r.try_fuse("join_row_write", C.JOIN_IN_PLACE, [i, j], j)


def mla_prologue(r: Rewriter, i: int) -> None:
    op = op_at(r, i, C.JOIN_IN_PLACE)
    if op is None or not absorbs(op):
        return
    # the layer's cache row join: the next join in place before its attention (a later one is the next layer's)
    for j in range(i + 1, len(r.s)):
        other = r.s.slot(j)
        if other is None:
            continue
        if any(isinstance(x.sym, Attention) for x in leaves(other)):
            return
        if op_at(r, j, C.JOIN_IN_PLACE) is not None and not absorbs(other):
            break
    else:
        return
    # one launch runs both at once: the row's join may not read what the query's writes
    shared = set(facts.writes(op)) & set(facts.reads(other))
    if shared:
        name = sorted(shared)[0]
        r.no_match("mla_prologue", [i, j], lambda: f"op {j} ({other.out}) reads {name}, which op {i} writes")
        return
    r.try_fuse("mla_prologue", C.MLA_PROLOGUE, [i, j], j)


def _other_readers(r: Rewriter, name: str) -> str:
    readers = r.s.readers(name)
    return r.other_readers(name, readers[0]) if readers else f"{name} is the graph's output"


def fused_sampling(r: Rewriter, i: int) -> None:
    if op_at(r, i, Matmul) is None:
        return
    j = next_reader(r, i, ArgMax, rule="fused_sampling")
    if j is not None:
        r.try_fuse("fused_sampling", C.FUSED_SAMPLING, [i, j], j)


NORM_RULES = [
    Rule("norm_weight", (C.NORM_WEIGHT,), norm_weight),  # rms_norm(x) * w -> NormWeight(x, w)
    Rule("embed_norm", (C.EMBED_NORM,), embed_norm),  # gather(table, ids); NormWeight(rows) -> EmbedNorm
    Rule("add_norm", (C.ADD_NORM,), add_norm),  # s = a + b; NormWeight(s) -> AddNorm writes s and its norm
    Rule("norm_then_add", (C.NORM_THEN_ADD,), norm_then_add),  # NormWeight(x) + y -> NormThenAdd
]
ROTATION_RULES = [
    Rule("qk_norm_rope", (C.QK_NORM_ROPE,), qk_norm_rope),  # rope(NormWeight(heads)) -> QkNormRope
    # set_row(cache, pos, QkNormRope(k)) -> QkNormRopeKvAppend writing the cache row
    Rule(
        "qk_norm_rope_kv_append",
        (C.QK_NORM_ROPE_KV_APPEND,),
        _rope_append("qk_norm_rope_kv_append", C.QK_NORM_ROPE, C.QK_NORM_ROPE_KV_APPEND),
    ),
    # set_row(cache, pos, rope(k)) -> RopeKvAppend writing the cache row
    Rule("rope_kv_append", (C.ROPE_KV_APPEND,), _rope_append("rope_kv_append", Rope, C.ROPE_KV_APPEND)),
]
ELEMENTWISE_RULES = [
    Rule("glu_act_mul", (C.GLU_ACT_MUL,), glu_act_mul),  # silu(g) * u -> GluActMul(g, u)
    Rule("gemm_bias", (C.GEMM_BIAS,), gemm_bias),  # x @ W^T + b -> GemmBias
]
EPILOGUE_RULES = [
    Rule("row_write", (C.ROW_WRITE,), row_write),  # set_row(cache, pos, x @ W^T) -> the product writes the row
    Rule("qkv_head_epilogue", (C.QKV_HEAD_EPILOGUE,), qkv_head_epilogue),  # rope(x @ W^T) -> QkvHeadEpilogue
    Rule("rope_q_k_one_launch", (C.ROPE_QK_ONE_LAUNCH,), rope_q_k_one_launch),  # rope(q); rope(k) -> one launch
]
ATTENTION_RULES = [
    # attention(q, k cache, v cache) of one row -> FlashDecode
    Rule("flash_decode", (C.FLASH_DECODE,), _attention("flash_decode", C.FLASH_DECODE, True)),
    # attention(q, k cache, v cache) of a chunk's rows -> FlashPrefill
    Rule("flash_prefill", (C.FLASH_PREFILL,), _attention("flash_prefill", C.FLASH_PREFILL, False)),
]
PRODUCT_RULES = [
    Rule("gate_up_glu", (C.GEMV_GATE_UP_GLU,), gate_up_glu),  # GluActMul(x @ Wg^T, x @ Wu^T) -> GemvGateUpGlu
    Rule("merged_projections", (C.MERGED_QKV,), merged_projections),  # x @ Wq^T; x @ Wk^T; ... -> MergedQkv
    Rule("merged_gate_up", (C.MERGED_GATE_UP,), merged_gate_up),  # x @ Wg^T; x @ Wu^T -> MergedGateUp
    Rule("gemv_norm_epilogue", (C.GEMV_NORM_EPILOGUE,), gemv_norm_epilogue),  # AddNorm(r, x @ W^T) -> one op
]
LAYOUT_RULES = [
    Rule("strided_read", (C.STRIDED_READ,), strided_read),  # f(slice(x)) -> f reads x strided, in place
    Rule("join_in_place", (C.JOIN_IN_PLACE,), join_in_place),  # join(f(a), g(b)) -> f, g write unit parts
    Rule("join_row_write", (C.JOIN_IN_PLACE,), join_row_write),  # set_row(cache, pos, JoinInPlace) -> in the row
    Rule("mla_prologue", (C.MLA_PROLOGUE,), mla_prologue),  # JoinInPlace(query); JoinInPlace(cache row) -> one op
    Rule("fused_sampling", (C.FUSED_SAMPLING,), fused_sampling),  # argmax(x @ W^T) -> FusedSampling
]

SHARED_RULES: list[Rule] = (
    NORM_RULES
    + PARALLEL_RULES  # after add_norm: it takes the AddNorm that reads an all-reduce's sum
    + ROTATION_RULES
    + GDN_RULES  # before the elementwise rules: a gated norm's silu(z) is its gate, not a GLU's
    + ELEMENTWISE_RULES
    + EPILOGUE_RULES
    + ATTENTION_RULES
    + GATED_ATTENTION_RULES
    + MOE_RULES  # before the product rules: the router is the mixture's, not a product to merge
    + ROUTING_RULES
    + PRODUCT_RULES
    + LAYOUT_RULES
    + QUANT_RULES
    + ROUTE_IN_NORM_RULES  # after the quant rules: the norm goes in with its int8 form
    + STEP_NORM_RULES  # after the quant rules: a step's norm goes in with its int8 form
)
