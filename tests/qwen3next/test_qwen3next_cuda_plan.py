"""The cuda lane's plan side on Qwen3-Next: the specification's answers for the gated delta rule's and the
gated attention's classes (`plan.gdn.SPECIFIED`), which the lane gives, and the specification's `fits` on the
fused ops the shared rules build from a real graph.

The lane runs every class the specification runs natively (`GDN_NATIVE`: the convolution, several of them a
launch, the gates with and without their projection, the delta step, the gated norm, the gated attention) and
quantizes the gated norm's output in its store under `fuse_quant`. Under the specified answers (a shim that
answers them as the specification does, `Specified`), the rules' fusions at Qwen3-Next-80B-A3B's widths take
the specification's fits: everything fuses but the gates' projection, whose matrix the file holds as
quantized rows (a file holding it alone as floats fuses it too), and the tiny shape's 16-value heads are too narrow
for the convolution's norming epilogue.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from fuselane.explain import launches_per_layer
from fuselane.fuse.optimizer import check_runs, launches_of, needs, optimize
from fuselane.fuse.shim import DECOMPOSE, NATIVE, SupportKind
from fuselane.fuse.views import class_of
from fuselane.gguf.formats import Format
from fuselane.gguf.synth import SHAPES, model_metadata, tensor_formats, tensor_shapes
from fuselane.graph import facts
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import WHOLE, Dst, Form, Op, Role, Tensor, Values
from fuselane.graph.ops import Elementwise, ElementwiseOp, GateAct, GatedDelta, Quantize
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.gdn import (
    EPILOGUE,
    GDN_NATIVE,
    NORM_IN_STEP_FORM,
    NORM_IN_STEP_WIDTH,
    SPECIFIED,
    step_writes_int8,
)
from fuselane.lanes.cuda.plan.knobs import CudaKnobs
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.models import config_of, qwen, recognizer
from fuselane.numerics.contract import Keep
from tests.lanes.test_cuda_launches import Stub
from tests.lanes.test_launch_budget import BUDGET_MIXES, LAUNCH_BUDGET

LAYERS = 4  # three gated delta-rule layers and one full-attention layer at the real shape
HYBRID_RULES = ("conv_silu", "conv_silu_l2norm", "gdn_gating", "gdn_gate_projections", "gdn_step", "gated_norm")
GATES_BY_FLOATS = "the lane takes a delta rule's gates from its activation only by matrices of floats"
NARROW_HEADS = "a convolution's epilogue norms heads of at most 1024 values, whole warps, that divide its channels"


class Specified(CudaShim):
    """The cuda shim answering the gated delta rule's classes as the specification does."""

    def supports(self, cls):
        spec = SPECIFIED.get(cls)
        if spec is None:
            return CudaShim.supports(self, cls)
        if spec == EPILOGUE:
            return NATIVE if self.knobs.fuse_quant else DECOMPOSE
        return spec


def graph(
    name: str, rows: int, *, float_ba: bool = False, v_fmt: Format | None = None, mix: str = "q4_k_m", **widths: int
):
    shape = replace(SHAPES[name], n_layers=LAYERS, **widths)
    formats = tensor_formats(shape, mix)
    if float_ba:  # the gates' projection kept in F32, as the converter writes it before quantizing
        formats |= {n: Format.F32 for n in formats if n.endswith("ssm_ba.weight")}
    if v_fmt is not None:  # the value rows of a `use_more_bits` layer (four layers have none of those)
        formats |= {n: v_fmt for n in formats if n.endswith("attn_v.weight")}
    tensors = {n: Stub(dims, formats[n]) for n, dims in tensor_shapes(shape).items()}
    cfg = config_of(model_metadata(shape, name, 0) | {"general.architecture": shape.arch}, tensors)
    form = Form.DECODE if rows == 1 else Form.PREFILL
    return recognizer(cfg).recognize(cfg, tensors, form, rows=rows, ctx=4096)


def probe(g, name: str) -> None:
    """An op more at the graph's end that reads `name` in f32 (a reader outside any fusion)."""
    rows, cols = g.tensors[name].shape
    g.add(Tensor("probe", (rows, cols), Values("f32"), Role.ACTIVATION))
    g.ops.append(Op(Elementwise(ElementwiseOp.ADD, rows, cols), (name, name), (WHOLE, WHOLE), "probe", Dst("probe"),
                    (len(g.ops),)))  # fmt: skip


def ours(events) -> Counter:
    return Counter(e.cls.value for e in events if e.rule in (*HYBRID_RULES, "attn_output_gate"))


@pytest.mark.parametrize("fuse_quant", [True, False])
def test_the_lane_answers_as_specified(fuse_quant):
    shim = CudaShim(CudaKnobs(fuse_quant=fuse_quant))
    assert {c for c, spec in SPECIFIED.items() if spec == NATIVE} == GDN_NATIVE
    for cls, spec in SPECIFIED.items():
        answer = shim.supports(cls)
        if cls in GDN_NATIVE:
            assert answer == NATIVE, cls
        elif spec == EPILOGUE:
            assert answer.kind is (SupportKind.NATIVE if fuse_quant else SupportKind.DECOMPOSE), cls
        else:  # the three regroupings, as specified
            assert answer.kind is SupportKind.DECOMPOSE, cls


@pytest.mark.parametrize(("name", "linear"), [("tiny-qwen3next", LAYERS // 2), ("qwen3-next-80b-a3b", LAYERS - 1)])
def test_a_qwen3next_file_runs_on_the_lane(name, linear):
    check_runs(graph(name, 1), CudaShim())
    plan = optimize(graph(name, 1), CudaShim())
    fused = Counter((e.rule, e.cls.value) for e in plan.fired if e.cls in GDN_NATIVE)
    # a decode step's gates are made in its step's launch (`gates_in_step`): no GdnGating launch is left
    for rule, cls in (("gdn_step", "GdnStep"), ("gdn_gating", "GdnGating"), ("gated_norm", "GatedNorm")):
        assert fused[rule, cls] == linear
    assert fused["gates_in_step", "GdnStep"] == linear
    assert not [op for op in plan.graph.ops if class_of(op) is C.GDN_GATING]


@pytest.mark.parametrize("rows", [1, 5])
def test_under_the_specified_answers_the_real_shape_fuses_all_but_the_gates_projection(rows):
    plan = optimize(graph("qwen3-next-80b-a3b", rows), Specified())
    linear = LAYERS - 1
    want = {c: linear for c in ("ConvBiasSilu", "ConvSiluL2norm", "GdnGating", "GdnStep", "GatedNorm")}
    assert ours(plan.fired) == Counter(want | {"AttnOutputGate": 1})
    assert {(m.cls, m.reason) for m in plan.missed if m.rule in HYBRID_RULES} == {
        (C.GDN_GATE_PROJECTIONS, GATES_BY_FLOATS)
    }


@pytest.mark.parametrize("rows", [1, 5])
def test_the_lane_takes_the_gates_with_their_projection_from_a_matrix_of_floats(rows):
    plan = optimize(graph("qwen3-next-80b-a3b", rows, float_ba=True), CudaShim())
    fused = Counter(e.cls for e in plan.fired)
    assert fused[C.GDN_GATE_PROJECTIONS] == LAYERS - 1
    assert not [m for m in plan.missed if m.cls is C.GDN_GATE_PROJECTIONS]
    rows_ba = optimize(graph("qwen3-next-80b-a3b", rows), CudaShim())
    assert {m.reason for m in rows_ba.missed if m.cls is C.GDN_GATE_PROJECTIONS} == {GATES_BY_FLOATS}


@pytest.mark.parametrize("held", [(), ("norm_in_step",)])
def test_the_lanes_gated_norm_writes_its_int8_form_in_its_store(held):
    # heads of 128: whole 32-value blocks, so no Quantize launch follows the gated norm, in the step's launch
    # (`norm_in_step`) or in its own
    plan = optimize(graph("qwen3-next-80b-a3b", 1), CudaShim(), held=held)
    quantized = [op for op in plan.ops if class_of(op) is C.GDN_OUTPUT_QUANT or step_writes_int8(op)]
    assert len(quantized) == LAYERS - 1
    assert all(class_of(op) is (C.GDN_OUTPUT_QUANT if held else C.GDN_STEP) for op in quantized)
    assert not [op for op in plan.ops if isinstance(op.sym, Quantize) and op.out.endswith("o_gated")]


def test_a_decode_steps_delta_rule_norms_its_output_in_its_launch():
    # the gated norm (with its int8 form) in the step's launch: a linear layer is 7 launches, as a dense one
    plan = optimize(graph("qwen3-next-80b-a3b", 1), CudaShim())
    steps = [op for op in plan.ops if class_of(op) is C.GDN_STEP]
    assert len(steps) == LAYERS - 1 and all(step_writes_int8(op) for op in steps)
    assert sum(e.rule == "norm_in_step" for e in plan.fired) == LAYERS - 1
    assert not [op for op in plan.ops if class_of(op) in (C.GATED_NORM, C.GDN_OUTPUT_QUANT)]
    start, end = (next(i for i, op in enumerate(plan.ops) if op.out == f"l{n}.qkv") for n in (1, 2))
    assert sum(launches_of(op) for op in plan.ops[start:end]) == 7  # layer 1's, its down launch norming layer 2's


def test_a_chunks_delta_rule_writes_its_output_for_the_norms_launch():
    plan = optimize(graph("qwen3-next-80b-a3b", 5), CudaShim())
    assert {m.reason for m in plan.missed if m.rule == "norm_in_step"} == {NORM_IN_STEP_FORM}
    assert sum(class_of(op) is C.GDN_OUTPUT_QUANT or class_of(op) is C.GATED_NORM for op in plan.ops) == LAYERS - 1


def test_a_step_output_read_elsewhere_keeps_the_norm_apart():
    # the rule's output another op reads stays a tensor of its own: `norm_in_step` lets go of that layer's
    g = graph("qwen3-next-80b-a3b", 1)
    name = "l0.delta"
    probe(g, name)
    plan = optimize(g, CudaShim(), explain=True)
    assert sum(e.rule == "norm_in_step" for e in plan.fired) == LAYERS - 2
    assert any(u.rule == "norm_in_step" and f"{name} is also read by" in u.reason for u in plan.unmatched)
    (apart,) = [op for op in plan.ops if class_of(op) is C.GDN_OUTPUT_QUANT]
    assert name in apart.ins


def test_heads_wider_than_a_program_holds_keep_the_norm_apart():
    plan = optimize(graph("qwen3-next-80b-a3b", 1, ssm_dim=2 * kernels.GDN_NORM_MOST_DV), CudaShim())
    assert {m.reason for m in plan.missed if m.rule == "norm_in_step"} == {NORM_IN_STEP_WIDTH}


def test_under_int8_the_gated_norm_and_the_gated_attention_quantize_their_output():
    plan = optimize(graph("qwen3-next-80b-a3b", 1), Specified())
    fired = Counter(f.rule for f in plan.fired)
    assert fired["gdn_output_quant"] == LAYERS - 1
    gated = [f for f in plan.fired if f.rule == "glu_quant" and f.cls is C.GLU_ACT_MUL_QUANT]
    assert any(set(g.covers) & set(a.covers) for g in gated for a in plan.fired if a.rule == "attn_output_gate")


def test_the_tiny_shapes_heads_are_too_narrow_for_the_convolutions_epilogue():
    plan = optimize(graph("tiny-qwen3next", 1), Specified())
    assert {m.reason for m in plan.missed if m.cls is C.CONV_SILU_L2NORM} == {NARROW_HEADS}


def test_a_sigmoid_gated_delta_rule_is_refused():
    spec = GatedDelta(1, 4, 8, 8, gate=GateAct.SIGMOID)
    op = Op(spec, ("q", "k", "v", "g", "b", "s"), (WHOLE,) * 6, "o", Dst("o"))
    assert CudaShim().fits(op, None) == "the lane's gated delta gates by SiLU, not a sigmoid"
    assert needs(op) == [(C.GDN_STEP, "o gates its delta rule by a sigmoid")]


@pytest.mark.parametrize(("value", "keep"), [("f32", Keep.F32), ("bf16", Keep.BF16)])
def test_the_state_knob_sets_the_recurrent_states_precision(value, keep):
    shim = CudaShim(CudaKnobs.parse([f"state={value}"]))
    assert shim.numerics().state is keep


def test_a_gated_norm_read_elsewhere_in_f32_still_quantizes_in_its_launch():
    # a reader of the f32 result does not stop the int8 epilogue: the launch writes both forms, no Quantize
    g = graph("qwen3-next-80b-a3b", 1)
    name = "l0.o_gated"
    probe(g, name)
    plan = optimize(g, CudaShim())
    quantized = {op.out for op in plan.ops if step_writes_int8(op)}
    assert name in quantized and len(quantized) == LAYERS - 1
    assert not [op for op in plan.ops if isinstance(op.sym, Quantize) and op.out == name]
    assert any(op.out == "probe" and name in op.ins for op in plan.ops), "the f32 reader still reads it"


@pytest.mark.parametrize("knobs", [(), ("activations=dequant",)])
def test_a_full_attention_layers_key_and_gated_query_turn_in_one_launch(knobs):
    # the key's rotation comes out of the QKV GEMV (its query's product is gated, so the GEMV does not turn it)
    # and pairs with the query's, which reads a slice of that product: one launch for both, its key appended
    from fuselane.fuse.views import parts
    from fuselane.lanes.cuda.plan.rules import ROPE_EPILOGUE

    shim = CudaShim(CudaKnobs.parse(list(knobs)))
    plan = optimize(graph("qwen3-next-80b-a3b", 1), shim)
    (pair,) = [op for op in plan.ops if class_of(op) is C.ROPE_QK_ONE_LAUNCH]
    sides = {class_of(p) for p in parts(pair)}
    assert sides == {C.QK_NORM_ROPE, C.QK_NORM_ROPE_KV_APPEND}
    assert not [op for op in plan.ops if class_of(op) in (C.QK_NORM_ROPE, C.QK_NORM_ROPE_KV_APPEND)]
    assert any(e.rule == ROPE_EPILOGUE and e.cls is C.ROPE_QK_ONE_LAUNCH for e in plan.fired)


def test_a_chunks_gates_run_in_a_launch_of_their_own():
    # the chunked form's two launches read the gates made: the fold is declined with the lane's reason
    from fuselane.lanes.cuda.plan.gdn import GATES_IN_STEP_FORM

    plan = optimize(graph("qwen3-next-80b-a3b", 5), CudaShim())
    assert {m.reason for m in plan.missed if m.rule == "gates_in_step"} == {GATES_IN_STEP_FORM}
    assert sum(class_of(op) is C.GDN_GATING for op in plan.ops) == LAYERS - 1


@pytest.mark.parametrize("name", ["l0.decay", "l0.beta"])
def test_a_gate_read_elsewhere_keeps_the_gating_apart(name):
    # a gate another op reads stays a tensor of its own: `gates_in_step` lets go of that layer's, and says who
    g = graph("qwen3-next-80b-a3b", 1)
    probe(g, name)
    plan = optimize(g, CudaShim(), explain=True)
    (apart,) = [op for op in plan.ops if class_of(op) is C.GDN_GATING]
    assert name in facts.writes(apart)
    assert sum(e.rule == "gates_in_step" for e in plan.fired) == LAYERS - 2
    assert any(u.rule == "gates_in_step" and f"{name} is also read by" in u.reason for u in plan.unmatched)


def test_the_q4_k_m_recipes_two_formats_share_each_layers_gemv_in_parts():
    # llama.cpp's Q4_K_M gives every attn_v-like matrix Q6_K on its `use_more_bits` layers: a delta-rule layer's
    # fused q/k/v rows beside its Q4_K gate and gates (layer 2 of 4), a full-attention layer's value rows beside
    # its Q4_K query/gate and key (layer 3). Each layer's products of its input are one int8 GEMV in parts, of two
    # formats where they differ, and every layer keeps the budget of 7
    g = graph("qwen3-next-80b-a3b", 1)
    assert g.tensors["blk.2.attn_qkv.weight"].storage.format is Format.Q6_K
    assert g.tensors["blk.3.attn_v.weight"].storage.format is Format.Q6_K
    plan = optimize(g, CudaShim())
    merged = [op for op in plan.ops if class_of(op) is C.MERGED_QKV]
    assert len(merged) == LAYERS
    mixes = [{g.tensors[w].storage.format for w in op.ins if w.endswith("weight")} for op in merged]
    assert mixes == [{Format.Q4_K}, {Format.Q4_K}, {Format.Q4_K, Format.Q6_K}, {Format.Q4_K, Format.Q6_K}]
    assert not [op for op in plan.ops if class_of(op) is C.ROW_WRITE]  # the value rows land from the GEMV
    # a layer's launches: from its GEMV in parts to the next one's (its down launch norms the next layer's input)
    # (the last, a full-attention layer, to the output head's product)
    starts = [plan.ops.index(op) for op in merged]
    ends = [*starts[1:], next(i for i, op in enumerate(plan.ops) if op.out == qwen.LOGITS)]
    for a, b in zip(starts, ends, strict=True):
        assert sum(launches_of(op) for op in plan.ops[a:b]) == LAUNCH_BUDGET, plan.ops[a].out


@pytest.mark.parametrize("knobs", [(), ("rope_epilogue=on",), ("rope_epilogue=off",)], ids=["auto", "on", "off"])
@pytest.mark.parametrize("mix", [m.value for m in BUDGET_MIXES])
def test_every_recipe_keeps_the_budget(mix, knobs):
    # each quantized recipe writes the fused q/k/v rows (attn_v-like) by its own rules beside the gate's base
    # format: Q3_K_M, IQ4_XS and Q2_K in every layer, Q4_K_M and Q5_K_M on their `use_more_bits` layers; the
    # int8 GEMV in parts takes the second format, so no layer takes a launch more for it. In the float mixes
    # the gates' product joins the float GEMV in parts rather than a launch with the gates (GdnGateProjections)
    g = graph("qwen3-next-80b-a3b", 1, mix=mix)
    per_layer = launches_per_layer(optimize(g, CudaShim(CudaKnobs.parse(list(knobs)))))
    assert sorted(per_layer) == list(range(LAYERS))
    assert max(per_layer.values()) <= LAUNCH_BUDGET, per_layer


def test_two_formats_share_a_step_gemv_that_reads_f32():
    # the f32 GEMV by rows (activations=dequant) takes a step's parts in two formats, as the int8 GEMV does: the
    # value rows land from the full-attention layer's GEMV in parts, the delta-rule layers' Q6_K q/k/v rows share
    # theirs with the Q4_K gate and gates
    g = graph("qwen3-next-80b-a3b", 1, v_fmt=Format.Q6_K)
    plan = optimize(g, CudaShim(CudaKnobs.parse(["activations=dequant"])))
    assert not [op for op in plan.ops if class_of(op) is C.ROW_WRITE and "attn_v" in op.ins[1]]
    merged = [op for op in plan.ops if class_of(op) is C.MERGED_QKV]
    mixes = [{g.tensors[w].storage.format for w in op.ins if w.endswith("weight")} for op in merged]
    assert {Format.Q4_K, Format.Q6_K} in mixes, mixes


def test_two_formats_do_not_share_a_gemv_of_a_batchs_rows_that_reads_f32():
    # past a step's one row the f32 GEMV decodes one format a launch: the value rows keep their own
    g = graph("qwen3-next-80b-a3b", 4, v_fmt=Format.Q6_K)
    plan = optimize(g, CudaShim(CudaKnobs.parse(["activations=dequant"])))
    for op in plan.ops:
        if class_of(op) is C.MERGED_QKV:
            assert len({g.tensors[w].storage.format for w in op.ins if w.endswith("weight")}) == 1, op.out


@pytest.mark.parametrize("mix", [m.value for m in BUDGET_MIXES])
def test_every_recipe_keeps_the_budget_reading_f32(mix):
    # activations=dequant: the recipes' second formats join the f32 GEMV by rows' parts, so no layer takes a
    # launch more for them than under int8 activations
    g = graph("qwen3-next-80b-a3b", 1, mix=mix)
    per_layer = launches_per_layer(optimize(g, CudaShim(CudaKnobs.parse(["activations=dequant"]))))
    assert max(per_layer.values()) <= LAUNCH_BUDGET, per_layer
