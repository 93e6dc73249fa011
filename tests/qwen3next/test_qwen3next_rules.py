"""The gated delta rule's and the gated attention's rules on Qwen3-Next's graphs (the cpu lane): each builds
the class the record says, in the decode step and in a chunk; what they take is what a layer holds (the
convolution with its state's shift and SiLU, the L2 norms of q and k, both gates, the rule with its state's
update, the gated norm, the attention with its gate), and the state is an input of the ops that read it."""

from __future__ import annotations

import pytest

from fuselane.explain import build_plan
from fuselane.fuse.gdn_rules import GATED_ATTENTION_RULES, GDN_RULES
from fuselane.fuse.views import class_of, leaves
from fuselane.graph.classes import ClassId as C
from fuselane.graph.classes import built_by
from fuselane.graph.ops import CausalConv, ConvShift, DeltaState, GatedDelta, L2Norm, Unary

LAYERS = 4  # tiny-qwen3next: linear, full, linear, full
LINEAR, FULL = 2, 2


@pytest.fixture(scope="module", params=["decode", "prefill"])
def plan(request):
    return build_plan("synth:tiny-qwen3next", lane="cpu", form=request.param)[2]


# Qwen3-Next convolves q, k and v as one, and each layer's convolution reads what the one before it fed: a
# step has no two convolutions one launch takes (`test_conv_parts.py` builds such a step by hand).
ONE_CONVOLUTION_A_STEP = "conv_parts"


def test_every_rule_builds_what_the_record_says(plan):
    matched = {(e.rule, e.cls) for e in [*plan.fired, *plan.missed]}
    assert not {e for e in matched if e[0] == ONE_CONVOLUTION_A_STEP}
    for rule in GDN_RULES + GATED_ATTENTION_RULES:
        if rule.name == ONE_CONVOLUTION_A_STEP:
            continue
        for cls in rule.builds:
            assert rule.name in built_by(cls)
            assert (rule.name, cls) in matched, f"{rule.name} never builds {cls.value}"


def _ops(plan, cls):
    return [op for op in plan.ops if any(class_of(x) is cls for x in [op, *_nested(op)])]


def _nested(op):
    return [] if class_of(op) is None else [p for part in op.sym.parts for p in [part, *_nested(part)]]


def test_a_linear_layer_fuses_as_a_layer_holds(plan):
    convs = _ops(plan, C.CONV_SILU_L2NORM)
    assert len(convs) == LINEAR
    for op in convs:
        kinds = [type(x.sym) for x in leaves(op)]
        assert kinds[:3] == [CausalConv, ConvShift, Unary] and kinds.count(L2Norm) == 2
        assert op.ins[1].endswith("conv_state")  # read before the shift inside writes it
    steps = _ops(plan, C.GDN_STEP)
    assert len(steps) == LINEAR
    for op in steps:
        assert [type(x.sym) for x in leaves(op) if isinstance(x.sym, GatedDelta | DeltaState)] == [
            GatedDelta,
            DeltaState,
        ]
        assert op.ins[-1].endswith("delta_state") and op.out.endswith(".delta")
    assert len(_ops(plan, C.GDN_GATING)) == LINEAR and len(_ops(plan, C.GATED_NORM)) == LINEAR


def test_a_full_layer_gates_its_attention(plan):
    assert len(_ops(plan, C.ATTN_OUTPUT_GATE)) == FULL


def test_the_gate_projections_are_products_the_cpu_lane_runs_apart(plan):
    missed = [e for e in plan.missed if e.rule == "gdn_gate_projections"]
    assert len(missed) == LINEAR and all(e.kind == "decompose" for e in missed)
