"""The mixture-of-experts rules: routing, the experts' products, the shared expert and the mixture's last step.

A mixture's primitives (`models.moe`) fuse into the classes a lane runs in few launches: the router product
with its top-k and routing weights (`RouterTopk`), a chunk's sort of its pairs by expert with them
(`MoeTokenSort`), the kept experts' gate and up products with their SwiGLU (`MoeGateUpAct`), their down
products with the weighted combine (`MoeDownCombine`), the shared expert (and its sigmoid gate, where it has one)
folded into the mixture (`SharedExpertFusion`), and the residual add and next norm in the mixture's last step
(`MoeDeferredFinalize`). Each swallows an intermediate only where nothing outside the fusion reads it.

Last, after the quantizing rules (`ROUTE_IN_NORM_RULES`): a routing op takes in the projection whose epilogue norms
the row its router reads (`route_in_norm`), where a lane routes in the launch that finishes that norm.
"""

from __future__ import annotations

from collections.abc import Sequence

from fuselane.fuse.patterns import is_add, next_reader, op_at
from fuselane.fuse.rewriter import Rewriter
from fuselane.fuse.rule import Rule
from fuselane.fuse.views import class_of, leaves, moe, parts
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Op
from fuselane.graph.ops import (
    Elementwise,
    ExpertChoice,
    ExpertMatmul,
    ExpertSort,
    Matmul,
    Moe,
    RouteWeights,
    RowScale,
    TopK,
    Unary,
)
from fuselane.graph.ops import UnaryOp as U

MIXTURES = (Moe, C.MOE_DOWN_COMBINE)  # an op whose result is the routed experts' combine
GLUS = (C.GLU_ACT_MUL, C.GEMV_GATE_UP_GLU)


def read_only_by(r: Rewriter, name: str, group: Sequence[int]) -> bool:
    """Whether every reader of `name` is in `group` (and it is not the graph's output)."""
    return name not in r.outputs and set(r.s.readers(name)) <= set(group)


def internal(r: Rewriter, rule: str, members: Sequence[int], swallowed: Sequence[int]) -> bool:
    """Whether the results of the members at `swallowed` are read only inside the group (the fusion keeps
    them to itself); records the first that is not, for `explain`."""
    for m in swallowed:
        name = r.s.get(m).out
        if not read_only_by(r, name, members):
            r.no_match(rule, m, lambda name=name: read_outside(r, name, members))
            return False
    return True


def read_outside(r: Rewriter, name: str, members: Sequence[int]) -> str:
    """Who outside the group reads `name` (a failed match's reason)."""
    found = [f"op {k} ({r.s.get(k).out})" for k in r.s.readers(name) if k not in members]
    if name in r.outputs:
        found.append("the graph's output")
    return f"{name} is also read by {', '.join(found)}"


def router_topk(r: Rewriter, i: int) -> None:
    if op_at(r, i, Matmul) is None:
        return
    scores = r.s.get(i).out
    readers = [j for j in r.s.readers(scores) if j > i]
    # the top-k reads the scores, or the choice scores made of them (DeepSeek's gating and correction bias)
    choice = next((j for j in readers if op_at(r, j, ExpertChoice)), None)
    ranked = [j for j in r.s.readers(r.s.get(choice).out) if j > choice] if choice is not None else readers
    topk = next((j for j in ranked if op_at(r, j, TopK)), None)
    weights = next((j for j in readers if op_at(r, j, RouteWeights)), None)
    if topk is None or weights is None or r.s.get(weights).ins[1] != r.s.get(topk).out:
        return
    made = [i] if choice is None else [i, choice]
    members = sorted([*made, topk, weights])
    if internal(r, "router_topk", members, made):  # the kept experts and weights are the fusion's results
        r.try_fuse("router_topk", C.ROUTER_TOPK, members, weights)


def moe_token_sort(r: Rewriter, j: int) -> None:
    sort = op_at(r, j, ExpertSort)
    if sort is None:
        return
    i = r.s.producer(sort.ins[0], before=j)
    if i is not None and op_at(r, i, C.ROUTER_TOPK, TopK) is not None:
        r.try_fuse("moe_token_sort", C.MOE_TOKEN_SORT, [i, j], j)


def _expert_product(r: Rewriter, name: str, before: int) -> int | None:
    i = r.s.producer(name, before=before)
    op = op_at(r, i, ExpertMatmul) if i is not None else None
    return i if op is not None and not op.sym.slotted else None  # type: ignore[union-attr]


def moe_gate_up_act(r: Rewriter, j: int) -> None:
    glu = op_at(r, j, C.GLU_ACT_MUL)
    if glu is None or len(glu.ins) != 2:
        return
    pair = [_expert_product(r, name, j) for name in glu.ins]
    if None in pair:
        return
    gate, up = (r.s.get(k) for k in pair)  # type: ignore[arg-type]
    same_rows = gate.ins[0] == up.ins[0] and gate.ins[2:] == up.ins[2:]
    members = [*pair, j]
    if same_rows and internal(r, "moe_gate_up_act", members, pair):  # type: ignore[arg-type]
        r.try_fuse("moe_gate_up_act", C.MOE_GATE_UP_ACT, members, j)  # type: ignore[arg-type]


def moe_down_combine(r: Rewriter, i: int) -> None:
    down = op_at(r, i, ExpertMatmul)
    if down is None or not down.sym.slotted:  # type: ignore[union-attr]
        return
    j = next_reader(r, i, Moe, rule="moe_down_combine")
    if j is not None:
        r.try_fuse("moe_down_combine", C.MOE_DOWN_COMBINE, [i, j], j)


def producer_of(r: Rewriter, name: str, before: int, *kinds) -> int | None:
    i = r.s.producer(name, before=before)
    return i if i is not None and op_at(r, i, *kinds) is not None else None


def _shared_members(r: Rewriter, shared: str, before: int) -> list[int] | None:
    """The shared expert whose output `shared` is (read by the op at slot `before`): its SwiGLU (and the gate and
    up products it reads, where they are apart) and its down product; where it is gated (a RowScale of the down
    product by a sigmoid, Qwen2-MoE's), that RowScale and its gate's product and sigmoid too. An ungated one
    (DeepSeek's) is its down product itself."""
    gating: list[int] = []
    scaled = producer_of(r, shared, before, RowScale)
    if scaled is not None:
        rs = r.s.get(scaled)
        sig = producer_of(r, rs.ins[1], scaled, Unary)
        if sig is None or r.s.get(sig).sym.op is not U.SIGMOID:  # type: ignore[union-attr]
            return None
        score = producer_of(r, r.s.get(sig).ins[0], sig, Matmul)
        if score is None:
            return None
        gating = [score, sig, scaled]
        shared, before = rs.ins[0], scaled
    down = producer_of(r, shared, before, Matmul)
    glu = producer_of(r, r.s.get(down).ins[0], down, *GLUS) if down is not None else None
    if glu is None:
        return None
    products = []
    if class_of(r.s.get(glu)) is C.GLU_ACT_MUL:
        products = [producer_of(r, name, glu, Matmul) for name in r.s.get(glu).ins]
        if None in products:
            return None
    return sorted([*products, glu, down, *gating])  # type: ignore[list-item]


def shared_expert_fusion(r: Rewriter, j: int) -> None:
    add = op_at(r, j, Elementwise)
    if add is None or not is_add(add, row=False) or add.ins[0] == add.ins[1]:
        return
    mixtures = [producer_of(r, n, j, *MIXTURES) for n in add.ins]
    if mixtures.count(None) != 1:
        return
    mixture = next(m for m in mixtures if m is not None)
    shared = _shared_members(r, add.ins[mixtures.index(None)], j)
    if shared is None:
        return
    members = sorted([mixture, *shared, j])
    if internal(r, "shared_expert_fusion", members, [m for m in members if m != j]):
        r.try_fuse("shared_expert_fusion", C.SHARED_EXPERT_FUSION, members, j)


def moe_deferred_finalize(r: Rewriter, i: int) -> None:
    if op_at(r, i, *MIXTURES, C.SHARED_EXPERT_FUSION) is None or moe(r.s.get(i)) is None:
        return
    summed = _summed(r, i)
    if summed is not None:  # the mixture plus another array (an ungated shared expert's), then the AddNorm
        j, k = summed
        r.try_fuse("moe_deferred_finalize", C.MOE_DEFERRED_FINALIZE, [i, j, k], k)
        return
    j = next_reader(r, i, C.ADD_NORM, operand=None, rule="moe_deferred_finalize")
    if j is not None:
        r.try_fuse("moe_deferred_finalize", C.MOE_DEFERRED_FINALIZE, [i, j], j)


def _summed(r: Rewriter, i: int) -> tuple[int, int] | None:
    """(the add, the AddNorm) where the mixture at slot i is summed with another array by an add that it alone
    reads it into, whose sum only an AddNorm reads; else None."""
    j = next_reader(r, i, Elementwise, operand=None)
    if j is None or not is_add(r.s.get(j), row=False) or r.s.get(j).ins[0] == r.s.get(j).ins[1]:
        return None
    k = next_reader(r, j, C.ADD_NORM, operand=None)
    return (j, k) if k is not None else None


MOE_RULES = [
    # TopK(x @ Wr^T or its choice scores); RouteWeights(scores, ids) -> RouterTopk writes the kept experts, weights
    Rule("router_topk", (C.ROUTER_TOPK,), router_topk),
    # ExpertSort(RouterTopk's ids) -> MoeTokenSort: the top-k also orders the chunk's pairs by expert
    Rule("moe_token_sort", (C.MOE_TOKEN_SORT,), moe_token_sort),
    # GluActMul(experts(x, Wg), experts(x, Wu)) -> MoeGateUpAct over the kept experts' rows only
    Rule("moe_gate_up_act", (C.MOE_GATE_UP_ACT,), moe_gate_up_act),
    # Moe(experts(h, Wd), weights) -> MoeDownCombine: each down product lands weighted in its row's sum
    Rule("moe_down_combine", (C.MOE_DOWN_COMBINE,), moe_down_combine),
    # mixture + [sigmoid(x . wg) *] down(GLU(x)) -> SharedExpertFusion: the shared expert in the mixture's launch
    Rule("shared_expert_fusion", (C.SHARED_EXPERT_FUSION,), shared_expert_fusion),
    # AddNorm(r, mixture [+ x]) -> MoeDeferredFinalize: the mixture adds the residual (and x) and norms in its last step
    Rule("moe_deferred_finalize", (C.MOE_DEFERRED_FINALIZE,), moe_deferred_finalize),
]


def _product_norm(op: Op) -> bool:
    """Whether op is a projection whose epilogue adds its residual and norms the row (GemvNormEpilogue), or that
    op's quantizing fold: a launch whose last program holds the whole normed row already."""
    inner = parts(op)[0] if class_of(op) is C.NORM_QUANT else op
    return class_of(inner) is C.GEMV_NORM_EPILOGUE


def route_in_norm(r: Rewriter, j: int) -> None:
    if op_at(r, j, C.ROUTER_TOPK) is None:
        return
    router = next((x for x in leaves(r.s.get(j)) if isinstance(x.sym, Matmul)), None)
    i = r.s.producer(router.ins[0], before=j) if router is not None else None
    if i is not None and r.s.get(i).out == router.ins[0] and _product_norm(r.s.get(i)):  # type: ignore[union-attr]
        r.try_fuse("route_in_norm", C.ROUTER_TOPK, [i, j], j)


ROUTE_IN_NORM_RULES = [
    # GemvNormEpilogue(...) -> x; RouterTopk(x) -> RouterTopk: the projection's launch norms x and routes it
    Rule("route_in_norm", (C.ROUTER_TOPK,), route_in_norm),
]
