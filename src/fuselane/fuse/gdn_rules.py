"""The gated delta-rule and gated-attention rules: Qwen3-Next's linear-attention layers and gated attention.

A linear layer's primitives (`models.qwen3next`) fuse into the classes a lane runs in few launches: the causal
convolution with its state's shift and its SiLU (`ConvBiasSilu`), that with the per-head L2 norms of the queries
and keys it feeds (`ConvSiluL2norm`), a step's convolutions that do not feed one another in one launch
(`ConvParts`), the gates beta = sigmoid(b) and g = A * softplus(a + dt) (`GdnGating`), with the product that reads
them off the layer's input (`GdnGateProjections`), the rule's output with its state's update (`GdnStep`), that with
the gates it alone reads (`gates_in_step`, a GdnStep that makes its gates from b and a itself), the gated norm of
its output, norm(o) * w * silu(z) (`GatedNorm`), and that norm, with its int8 form, in the step (`norm_in_step`). A
full-attention layer's output times sigmoid(gate) rides the attention (`AttnOutputGate`). Each swallows an
intermediate only where nothing outside the fusion reads it.
"""

from __future__ import annotations

from fuselane.fuse.moe_rules import internal, producer_of, read_only_by, read_outside
from fuselane.fuse.patterns import is_add, is_mul, next_reader, op_at
from fuselane.fuse.rewriter import Rewriter
from fuselane.fuse.rule import Rule
from fuselane.fuse.views import class_of, leaves
from fuselane.graph import facts
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ops import (
    Attention,
    CausalConv,
    ConvShift,
    DeltaState,
    Elementwise,
    GatedDelta,
    L2Norm,
    Matmul,
    RmsNorm,
    Slice,
    Unary,
    UnaryOp,
)

ATTENTIONS = (Attention, C.FLASH_DECODE, C.FLASH_PREFILL)
CONVS = (C.CONV_BIAS_SILU, C.CONV_SILU_L2NORM)
DELTAS = (GatedDelta, C.GDN_STEP)


def _unary(r: Rewriter, i: int | None, kind: UnaryOp) -> bool:
    op = op_at(r, i, Unary) if i is not None else None
    return op is not None and op.sym.op is kind  # type: ignore[union-attr]


def conv_silu(r: Rewriter, i: int) -> None:
    conv = op_at(r, i, CausalConv)
    if conv is None:
        return
    j = next_reader(r, i, Unary, rule="conv_silu")
    if j is None or not _unary(r, j, UnaryOp.SILU):
        return
    # the state's shift after the convolution (it reads the same inputs and state), into the same launch
    shift = [k for k in range(i + 1, j) if op_at(r, k, ConvShift) and r.s.get(k).ins == conv.ins[:2]]
    r.try_fuse("conv_silu", C.CONV_BIAS_SILU, [i, *shift, j], i)


def _normed_slices(r: Rewriter, name: str, after: int) -> list[int]:
    """The slices of `name` each read by an L2 norm alone, with those norms, in schedule order."""
    found: list[int] = []
    for k in r.s.readers(name):
        if k > after and op_at(r, k, Slice) is not None:
            n = r.sole_reader(r.s.get(k).out)
            if n is not None and n > k and op_at(r, n, L2Norm) is not None:
                found += [k, n]
    return sorted(found)


def conv_silu_l2norm(r: Rewriter, i: int) -> None:
    if op_at(r, i, C.CONV_BIAS_SILU) is None:
        return
    normed = _normed_slices(r, r.s.get(i).out, i)
    if normed:
        members = [i, *normed]
        swallowed = [k for k in normed if op_at(r, k, Slice)]  # each norm's result is read by the delta rule
        if internal(r, "conv_silu_l2norm", members, swallowed):
            r.try_fuse("conv_silu_l2norm", C.CONV_SILU_L2NORM, members, i)


def conv_parts(r: Rewriter, i: int) -> None:
    """At a convolution through its SiLU: the later ones, up to the first other op that reads what a taken one
    writes, that read nothing a taken one writes and move up to it past nothing they touch (the next layer's,
    fed through this one, never do), as the parts of one launch."""
    if op_at(r, i, *CONVS) is None:
        return
    group = [i]
    written = set(facts.writes(r.s.get(i)))
    for j in range(i + 1, len(r.s)):
        op = r.s.slot(j)
        if op is None:
            continue
        fed = bool(written & set(facts.reads(op)))
        if class_of(op) not in CONVS:
            if fed:  # the step reads a taken convolution's result: the launch ends before it
                break
            continue
        if not fed and r.crossing([j], i) is None:
            group.append(j)
            written |= set(facts.writes(op))
    if len(group) > 1:
        r.try_fuse("conv_parts", C.CONV_PARTS, group, i)


def gdn_gating(r: Rewriter, m: int) -> None:
    """At the decay's product by A: softplus(a + dt) before it, and the beta that the same rule reads."""
    mul = op_at(r, m, Elementwise)
    if mul is None or not is_mul(mul, row=True):
        return
    soft = producer_of(r, mul.ins[0], m, Unary)
    if soft is None or not _unary(r, soft, UnaryOp.SOFTPLUS):
        return
    add = producer_of(r, r.s.get(soft).ins[0], soft, Elementwise)
    if add is None or not is_add(r.s.get(add), row=True):
        return
    rule = next((k for k in r.s.readers(mul.out) if k > m and op_at(r, k, *DELTAS)), None)
    beta = producer_of(r, r.s.get(rule).ins[4], rule, Unary) if rule is not None else None
    if beta is None or not _unary(r, beta, UnaryOp.SIGMOID):
        return
    members = sorted([beta, add, soft, m])
    if internal(r, "gdn_gating", members, [add, soft]):
        r.try_fuse("gdn_gating", C.GDN_GATING, members, m)


def gdn_gate_projections(r: Rewriter, j: int) -> None:
    """The product whose result the gating's slices read, with the slices and the gating."""
    gating = op_at(r, j, C.GDN_GATING)
    if gating is None:
        return
    slices = [k for n in gating.ins if (k := producer_of(r, n, j, Slice)) is not None]
    sources = {r.s.get(k).ins[0] for k in slices}
    if len(slices) < 2 or len(sources) != 1:
        return
    product = producer_of(r, sources.pop(), min(slices), Matmul)
    if product is None:
        return
    members = sorted([product, *slices, j])
    if internal(r, "gdn_gate_projections", members, [product, *slices]):
        r.try_fuse("gdn_gate_projections", C.GDN_GATE_PROJECTIONS, members, j)


def gdn_step(r: Rewriter, i: int) -> None:
    delta = op_at(r, i, GatedDelta)
    if delta is None:
        return
    state = delta.ins[-1]
    j = next((k for k in range(i + 1, len(r.s)) if op_at(r, k, DeltaState) and r.s.get(k).dst.buf == state), None)
    if j is not None and r.s.get(j).ins == delta.ins[1:]:
        r.try_fuse("gdn_step", C.GDN_STEP, [i, j], j, out=delta.out, dst=delta.dst)


def gates_in_step(r: Rewriter, j: int) -> None:
    """At a GdnStep: the GdnGating that makes both its gates, where nothing else reads them, into its launch."""
    if op_at(r, j, C.GDN_STEP) is None:
        return
    rule = next((x for x in leaves(r.s.get(j)) if isinstance(x.sym, GatedDelta | DeltaState)), None)
    if rule is None:
        return
    g, beta = rule.ins[-3:-1]  # the rule's (.., g, beta, state) and the state update's
    i = producer_of(r, g, j, C.GDN_GATING)
    if i is None or producer_of(r, beta, j, C.GDN_GATING) != i:
        return
    outside = [n for n in facts.writes(r.s.get(i)) if not read_only_by(r, n, [i, j])]
    if outside:
        r.no_match("gates_in_step", [i, j], lambda: read_outside(r, outside[0], [i, j]))
        return
    step = r.s.get(j)
    r.try_fuse("gates_in_step", C.GDN_STEP, [i, j], j, out=step.out, dst=step.dst)


def norm_in_step(r: Rewriter, j: int) -> None:
    """At a gated norm (or its int8 form's GdnOutputQuant): the GdnStep whose output it alone reads, the norm
    into the step's launch."""
    norm = op_at(r, j, C.GATED_NORM, C.GDN_OUTPUT_QUANT)
    if norm is None:
        return
    x = next((n.ins[0] for n in leaves(norm) if isinstance(n.sym, RmsNorm)), None)
    i = producer_of(r, x, j, C.GDN_STEP) if x is not None else None
    if i is None:
        return
    if not read_only_by(r, x, [i, j]):
        r.no_match("norm_in_step", [i, j], lambda: read_outside(r, x, [i, j]))
        return
    r.try_fuse("norm_in_step", C.GDN_STEP, [i, j], j, out=norm.out, dst=norm.dst)


def gated_norm(r: Rewriter, i: int) -> None:
    if op_at(r, i, C.NORM_WEIGHT) is None:
        return
    j = next_reader(r, i, Elementwise, rule="gated_norm")
    if j is None or not is_mul(r.s.get(j), row=False):
        return
    gate = producer_of(r, r.s.get(j).ins[1], j, Unary)
    if gate is not None and _unary(r, gate, UnaryOp.SILU) and internal(r, "gated_norm", [i, gate, j], [gate]):
        r.try_fuse("gated_norm", C.GATED_NORM, sorted([i, gate, j]), j)


def attn_output_gate(r: Rewriter, j: int) -> None:
    mul = op_at(r, j, Elementwise)
    if mul is None or not is_mul(mul, row=False) or len(mul.ins) != 2:
        return
    att = producer_of(r, mul.ins[0], j, *ATTENTIONS)
    sig = producer_of(r, mul.ins[1], j, Unary)
    if att is None or sig is None or not _unary(r, sig, UnaryOp.SIGMOID):
        return
    members = sorted([att, sig, j])
    if internal(r, "attn_output_gate", members, [att, sig]):
        r.try_fuse("attn_output_gate", C.ATTN_OUTPUT_GATE, members, j)


GDN_RULES = [
    # silu(conv(x, state)); shift(state, x) -> ConvBiasSilu: the convolution moves its state and activates
    Rule("conv_silu", (C.CONV_BIAS_SILU,), conv_silu),
    # l2norm(slice(ConvBiasSilu)) for q and k -> ConvSiluL2norm: the heads normed in the convolution's epilogue
    Rule("conv_silu_l2norm", (C.CONV_SILU_L2NORM,), conv_silu_l2norm),
    # ConvBiasSilu(x1); ...; ConvSiluL2norm(x4) -> ConvParts: convolutions feeding none of the others, one launch
    Rule("conv_parts", (C.CONV_PARTS,), conv_parts),
    # A * softplus(a + dt); sigmoid(b) -> GdnGating: both gates of the delta rule
    Rule("gdn_gating", (C.GDN_GATING,), gdn_gating),
    # GdnGating(slices of x @ Wba^T) -> GdnGateProjections: the gates straight off the layer's input
    Rule("gdn_gate_projections", (C.GDN_GATE_PROJECTIONS,), gdn_gate_projections),
    # delta(q, k, v, g, beta, S); S = state(k, v, g, beta, S) -> GdnStep: output and state in one pass
    Rule("gdn_step", (C.GDN_STEP,), gdn_step),
    # GdnGating(b, a) -> g, beta; GdnStep(.., g, beta, S) -> GdnStep(.., b, a, S): the gates in the step's launch
    Rule("gates_in_step", (C.GDN_STEP,), gates_in_step),
    # NormWeight(o) * silu(z) -> GatedNorm
    Rule("gated_norm", (C.GATED_NORM,), gated_norm),
]
# after the quant rules: the step takes the norm with its int8 form
STEP_NORM_RULES = [
    # GdnStep(..) -> o; GdnOutputQuant(o, w, z) -> GdnStep(..) -> norm(o) * w * silu(z): the norm in the step
    Rule("norm_in_step", (C.GDN_STEP,), norm_in_step),
]
GATED_ATTENTION_RULES = [
    # attention(q, K, V) * sigmoid(gate) -> AttnOutputGate: the gate rides the attention's store
    Rule("attn_output_gate", (C.ATTN_OUTPUT_GATE,), attn_output_gate),
]
