"""The optimizer: applies the rule table (shared rules with the lane's linked in) to a graph for one lane.

The result is a `Plan`: the fused schedule, every fusion that fired, every one a rule matched that the lane
did not take (decomposed, refused, or not fitting its kernels, with the lane's reason), the rules held back,
and the lane's numerics contract; with `explain`, also the matches a rule let go of before asking the lane
(an intermediate with another reader, an op in the way), each with its reason. A class the lane refuses
that the model cannot do without stops compilation with the lane's reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fuselane.errors import FuselaneError
from fuselane.fuse.rewriter import Fired, Missed, Rewriter, Schedule, Unmatched
from fuselane.fuse.rule import Rule
from fuselane.fuse.rules import SHARED_RULES
from fuselane.fuse.shim import After, LaneRule, Shim, SupportKind
from fuselane.fuse.views import leaves
from fuselane.graph.classes import ClassId
from fuselane.graph.ir import Fused, Op, TensorGraph
from fuselane.graph.ops import (
    Attention,
    CausalConv,
    ConvShift,
    DeltaState,
    ExpertMatmul,
    ExpertSort,
    GateAct,
    GatedDelta,
    GroupedTopK,
    HeadMatmul,
    Moe,
    Slice,
    Softcap,
    TakeRows,
    TopK,
)
from fuselane.numerics.contract import Contract
from fuselane.parallel.ops import COLLECTIVES

# Primitives that are views of their input on every lane: no launch runs them.
VIEWS = (TakeRows, Slice)


@dataclass(slots=True)
class Plan:
    """A graph's fused schedule on one lane, and the story of how it got there."""

    lane: str
    graph: TensorGraph
    ops: list[Op]
    fired: list[Fired] = field(default_factory=list)
    missed: list[Missed] = field(default_factory=list)
    held: tuple[str, ...] = ()
    table: tuple[str, ...] = ()
    contract: Contract | None = None
    unmatched: list[Unmatched] = field(default_factory=list)  # only filled when optimized with `explain`
    cannot_run: str | None = None  # why the lane cannot run the graph (only where optimized unchecked)

    def launches(self) -> int:
        """Kernel launches the schedule makes (`launches_of` each op)."""
        return sum(launches_of(op) for op in self.ops)


def launches_of(op: Op) -> int:
    """Kernel launches an op of a schedule makes: none for a view, a fused op's own count (one, unless the lane
    rule that built it sized several), one for any other primitive."""
    if isinstance(op.sym, VIEWS):
        return 0
    return op.sym.launches if isinstance(op.sym, Fused) else 1


def table_for(shim: Shim) -> list[Rule | LaneRule]:
    """The shared rules with the lane's own linked in at their positions."""
    table: list[Rule | LaneRule] = list(SHARED_RULES)
    names = [r.name for r in table]
    for position, rule in shim.rules():
        if position.rule not in names:
            raise ValueError(f"lane rule {rule.name} is placed at unknown rule {position.rule}")
        at = names.index(position.rule) + (1 if isinstance(position, After) else 0)
        table.insert(at, rule)
        names.insert(at, rule.name)
    return table


def holdable(rule: Rule | LaneRule) -> bool:
    """Whether `--hold` takes the rule: every shared rule, and a lane's own but its settling passes."""
    return not isinstance(rule, LaneRule) or rule.holdable


def rule_names(shim: Shim) -> list[str]:
    """The names `--hold` takes, in table order."""
    return [r.name for r in table_for(shim) if holdable(r)]


# A mixture's primitives run only where the lane runs their classes: no lane routes rows to experts otherwise.
_MIXTURE_NEEDS: dict[type, tuple[ClassId, str]] = {
    TopK: (ClassId.ROUTER_TOPK, "routes each row to its top-k experts"),
    ExpertSort: (ClassId.MOE_TOKEN_SORT, "orders a chunk's rows by expert"),
    ExpertMatmul: (ClassId.MOE_GATE_UP_ACT, "multiplies each row by its kept experts' matrices"),
    Moe: (ClassId.MOE_DOWN_COMBINE, "sums the kept experts' outputs by their routing weights"),
}


# A gated delta-rule layer's primitives run only where the lane runs the classes that hold them.
_RECURRENT_NEEDS: dict[type, tuple[ClassId, str]] = {
    GatedDelta: (ClassId.GDN_STEP, "runs the gated delta rule"),
    DeltaState: (ClassId.GDN_STEP, "updates the gated delta rule's state"),
    CausalConv: (ClassId.CONV_BIAS_SILU, "runs a causal convolution"),
    ConvShift: (ClassId.CONV_BIAS_SILU, "moves a causal convolution's state"),
}


def needs(op: Op) -> list[tuple[ClassId, str]]:
    """Classes a primitive cannot run without, with what in it needs them."""
    spec = op.sym
    found: list[tuple[ClassId, str]] = []
    if type(spec) in _MIXTURE_NEEDS:
        cls, what = _MIXTURE_NEEDS[type(spec)]
        if isinstance(spec, ExpertMatmul) and spec.slotted:  # the down products: the combine's
            cls, what = ClassId.MOE_DOWN_COMBINE, "multiplies each kept expert's hidden row by its down matrix"
        found.append((cls, f"{op.out} {what}"))
    if isinstance(spec, Softcap) or (isinstance(spec, Attention) and spec.ext and spec.ext.softcap is not None):
        found.append((ClassId.SOFTCAP, f"{op.out} soft-caps its values"))
    if isinstance(spec, HeadMatmul):
        found.append((ClassId.MLA, f"{op.out} multiplies each head by its own part of the latent's expansion"))
    if isinstance(spec, COLLECTIVES):  # a tensor-parallel rank's: a lane on one device has no collective
        found.append((ClassId.ALLREDUCE_NORM, f"{op.out} meets the other ranks' partial results"))
    if isinstance(spec, GroupedTopK):
        found.append((ClassId.GROUPED_TOPK, f"{op.out} routes within the best groups of experts"))
    if isinstance(spec, GatedDelta) and spec.gate is GateAct.SIGMOID:
        found.append((ClassId.GDN_STEP, f"{op.out} gates its delta rule by a sigmoid"))
    elif type(spec) in _RECURRENT_NEEDS:  # a lane that runs no gated delta rule fused runs none of its parts
        cls, what = _RECURRENT_NEEDS[type(spec)]
        found.append((cls, f"{op.out} {what}"))
    return found


def refusals(g: TensorGraph, shim: Shim) -> str | None:
    """Why the lane cannot run `g` (each class it refuses that a primitive needs, once, with the first op
    that needs it and the lane's reason), or None where it can."""
    found: dict[ClassId, str] = {}
    for op in g.ops:
        for cls, why in needs(op):
            support = shim.supports(cls)
            if support.kind is SupportKind.REFUSE and cls not in found:
                found[cls] = f"{why}, and {support.reason}"
    return "; ".join(found.values()) or None


def misfits(ops: Sequence[Op], g: TensorGraph, shim: Shim) -> str | None:
    """Why the lane has no launch for an op of the rewritten schedule (a fused op is built only where it fits,
    so only a primitive can be left so: a float matrix of ragged rows, say), first such op once, or None."""
    for op in ops:
        why = shim.fits(op, g)
        if why is not None:
            return f"{op.out}: {why}"
    return None


def check_runs(g: TensorGraph, shim: Shim) -> None:
    """Raise, with the lane's reasons, where `g` holds a primitive whose class the lane refuses."""
    why = refusals(g, shim)
    if why is not None:
        raise FuselaneError(f"the {shim.name} lane cannot run this model: {why}")


def optimize(
    g: TensorGraph, shim: Shim, *, held: Sequence[str] = (), explain: bool = False, check: bool = True
) -> Plan:
    """Fuse `g` for the lane behind `shim`, holding back the rules named in `held`; `explain` also keeps why
    rules let go of the ops of their shape they did not fuse (`Plan.unmatched`). A graph the lane cannot run
    raises, unless not `check` (`fuselane explain` shows its plan): then `Plan.cannot_run` says why."""
    table = table_for(shim)
    # a lane may also hold choices of its own kernels by name (the cuda lane's `rows_a_warp`)
    known = [r.name for r in table if holdable(r)] + list(getattr(shim, "lane_holds", ()))
    unknown = sorted(set(held) - set(known))
    if unknown:
        raise FuselaneError(f"no rule named {unknown[0]} (rules: {', '.join(known)})")
    if check:
        check_runs(g, shim)
    work = TensorGraph(g.form, g.rows, dict(g.tensors), list(g.ops), g.inputs, g.params, g.outputs)
    r = Rewriter(work, Schedule(g.ops), shim, outputs=frozenset(g.outputs), explain=explain)
    for rule in table:
        if rule.name not in held or not holdable(rule):
            rule.apply(r)
    ops = r.s.live()
    work.ops = ops
    misfit = misfits(ops, work, shim)
    if check and misfit is not None:
        raise FuselaneError(f"the {shim.name} lane cannot run this model: {misfit}")
    return Plan(
        lane=shim.name,
        graph=work,
        ops=ops,
        fired=[e for e in r.events if isinstance(e, Fired)],
        missed=[e for e in r.events if isinstance(e, Missed)],
        held=tuple(held),
        table=tuple(r.name for r in table),
        contract=shim.numerics(),
        unmatched=r.unmatched,
        cannot_run=None if check else "; ".join(w for w in (refusals(g, shim), misfit) if w) or None,
    )


def covered(plan: Plan) -> list[int]:
    """The original op indices the plan's ops cover, in schedule order (each exactly once when sound)."""
    return [c for op in plan.ops for c in op.covers]


def leaf_count(plan: Plan) -> int:
    return sum(len(leaves(op)) for op in plan.ops)
