"""The cuda lane's plan side on mixtures: the specification's answers for the mixture's classes (native; the
masked activation and the gather in the operand decomposed) and what its `fits` decide (docs/moe.md).

A decode step's mixture is three launches (RouterTopk, MoeGateUpAct, MoeDeferredFinalize, the shared expert
folded in), and a chunk sorts its pairs by expert but keeps its shared expert apart: the fold takes a step's
one row."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fuselane.explain import build_plan, launches_per_layer, model_source
from fuselane.fuse.optimizer import optimize
from fuselane.fuse.shim import DECOMPOSE, NATIVE
from fuselane.fuse.views import class_of, leaves
from fuselane.gguf.synth import SHAPES, model_metadata, tensor_formats, tensor_shapes
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Form, QuantFormat
from fuselane.graph.ops import Matmul
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.classes import MOE_CLASSES, QUANT_EPILOGUES
from fuselane.lanes.cuda.plan.knobs import Activations, CudaKnobs
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.models import config_of, recognizer
from tests.lanes.test_cuda_launches import Stub
from tests.lanes.test_cuda_launches import launches_per_layer as stub_launches
from tests.lanes.test_launch_budget import BUDGET_MIXES

DECOMPOSED_BY_SPEC = (C.MASKED_EXPERT_ACTIVATION, C.MOE_GATHER_IN_OPERAND)
SHARED_REASON = (
    "a mixture folds its unbiased SwiGLU shared expert, a step's one row of checkpoint rows, into at most 32 warps "
    "of kept experts"
)


def graph(model: str, rows: int):
    _, cfg, tensors = model_source(model)
    form = Form.DECODE if rows == 1 else Form.PREFILL
    return recognizer(cfg).recognize(cfg, tensors, form, rows=rows, ctx=64)


def _inner(op):
    """An op's class, or its producer's where it is a quantizing fold (the int8 epilogue of a mixture's step)."""
    c = class_of(op)
    return class_of(op.sym.parts[0]) if c in QUANT_EPILOGUES else c


def mixture_ops(plan) -> list[str]:
    return [c.value for op in plan.ops if (c := _inner(op)) is not None and c in MOE_CLASSES]


def test_the_lane_answers_the_mixture_as_specified():
    shim = CudaShim()
    for cls in MOE_CLASSES:
        assert shim.supports(cls) == (DECOMPOSE if cls in DECOMPOSED_BY_SPEC else NATIVE), cls


@pytest.mark.parametrize(
    ("model", "activations"),
    [
        ("synth:tiny-qwen2moe", Activations.INT8),
        ("synth:tiny-qwen2moe", Activations.DEQUANT),
        ("synth:qwen3-30b-a3b", Activations.INT8),  # the real widths: its down block holds its 2048-wide norm
    ],
)
def test_a_decode_step_mixture_is_three_launches_under_the_specified_answers(model, activations):
    plan = optimize(graph(model, 1), CudaShim(CudaKnobs(activations=activations)))
    layers = len({op.out.split(".")[0] for op in plan.ops if class_of(op) is C.ROUTER_TOPK})
    assert mixture_ops(plan) == ["RouterTopk", "MoeGateUpAct", "MoeDeferredFinalize"] * layers
    # the routing keeps its own launch: `route_in_norm` asks, and the lane answers with its knob's reason
    assert not [m for m in plan.missed if m.cls in MOE_CLASSES and m.rule != "route_in_norm"]
    assert {m.reason.split(" (")[0] for m in plan.missed if m.rule == "route_in_norm"} == {
        "a step's routing keeps its own launch"
    }
    # under the knob it runs in the output projection's launch: the int8 add + norm GEMV's, or the f32 one's
    knobs = CudaKnobs(activations=activations, route_in_norm=True)
    routed = optimize(graph(model, 1), CudaShim(knobs))
    assert mixture_ops(routed) == mixture_ops(plan)
    routers = [op for op in routed.ops if class_of(op) is C.ROUTER_TOPK]
    quantized = activations is Activations.INT8
    assert all(class_of(op.sym.parts[0]) is (C.NORM_QUANT if quantized else C.GEMV_NORM_EPILOGUE) for op in routers)
    assert not [m for m in routed.missed if m.cls in MOE_CLASSES]
    assert routed.launches() == plan.launches() - layers


def test_a_chunk_sorts_by_expert_and_keeps_its_shared_expert_apart():
    """The shared expert runs apart; its gated rows are summed in the mixture's last step with the residual,
    before the next norm (MoeDeferredFinalize of the mixture, the add, the AddNorm)."""
    plan = optimize(graph("synth:tiny-qwen2moe", 5), CudaShim())
    assert mixture_ops(plan)[:3] == ["MoeTokenSort", "MoeGateUpAct", "MoeDeferredFinalize"]
    final = next(op for op in plan.ops if class_of(op) is C.MOE_DEFERRED_FINALIZE)
    assert [type(p.sym).__name__ for p in final.sym.parts[1:2]] == ["Elementwise"]
    reasons = {m.reason for m in plan.missed if m.cls is C.SHARED_EXPERT_FUSION}
    assert reasons == {SHARED_REASON}


def test_the_decode_fold_reads_its_shared_expert_width_from_its_down_product():
    plan = optimize(graph("synth:qwen1.5-moe-a2.7b", 1), CudaShim())
    final = next(op.sym.parts[0] for op in plan.ops if _inner(op) is C.MOE_DEFERRED_FINALIZE)
    fold = final.sym.parts[0]
    assert class_of(fold) is C.SHARED_EXPERT_FUSION
    # four kept experts a program, eight rows of each (the int8 tile of 32 weight rows), in eight warps
    assert CudaShim.moe_down_launch(fold, plan.graph) == (2048 // 8, 8 * 32)


@pytest.mark.parametrize(
    ("activations", "fmt"), [(Activations.INT8, QuantFormat.ONE_WORD), (Activations.DEQUANT, None)]
)
def test_the_kept_experts_read_their_activation_in_the_lanes_form(activations, fmt):
    g = graph("synth:tiny-qwen3moe", 1)
    shim = CudaShim(CudaKnobs(activations=activations))
    plan = optimize(g, shim)
    gate_up = next(op for op in plan.ops if _inner(op) is C.MOE_GATE_UP_ACT)
    gate_up = gate_up.sym.parts[0] if class_of(gate_up) is not C.MOE_GATE_UP_ACT else gate_up
    assert shim.activation(gate_up, 0, plan.graph) is fmt
    assert shim.activation(gate_up, 1, plan.graph) is None  # the expert matrices are not an activation


@pytest.mark.parametrize("model", ["synth:qwen3-30b-a3b", "synth:qwen1.5-moe-a2.7b"])
@pytest.mark.parametrize("knobs", [(), ("activations=dequant",)])
def test_a_decode_step_is_at_most_seven_launches_a_layer(model, knobs):
    # attention's four (QKV, rotations, attention, output projection with its add and norm) and the mixture's
    # router, gate/up and down with its add and norm; under int8 the norm the router reads in f32 writes the
    # experts' int8 form in its own launch
    _, _, plan = build_plan(model, lane="cuda", knobs=knobs)
    assert max(launches_per_layer(plan).values()) <= 7


@pytest.mark.parametrize("model", ["synth:qwen3-30b-a3b", "synth:qwen1.5-moe-a2.7b", "synth:deepseek-v2-lite"])
def test_the_norm_the_router_reads_in_f32_writes_the_experts_int8_form(model):
    # before: AttnOutput -> GemvNormEpilogue (f32) -> RouterTopk, Quantize -> MoeGateUpAct
    # after:  AttnOutput -> NormQuant (f32 and int8) -> RouterTopk (f32), MoeGateUpAct (int8)
    _, _, plan = build_plan(model, lane="cuda")
    routers = [op for op in plan.ops if class_of(op) is C.ROUTER_TOPK]
    assert routers
    for router in routers:
        x = router.ins[0]
        producer = next(op for op in plan.ops if op.out == x)
        assert class_of(producer) is C.NORM_QUANT, (x, class_of(producer))
    quantized_apart = {op.out for op in plan.ops if type(op.sym).__name__ == "Quantize"}
    assert not quantized_apart & {router.ins[0] for router in routers}


@pytest.mark.parametrize("model", ["synth:qwen3-30b-a3b", "synth:qwen1.5-moe-a2.7b", "synth:deepseek-v2-lite"])
def test_under_the_knob_the_routing_takes_in_the_norm_it_reads_and_its_int8_form(model):
    # before: AttnOutput -> NormQuant (f32 and int8) -> RouterTopk (f32), MoeGateUpAct (int8)
    # after:  AttnOutput -> RouterTopk holding the NormQuant: one launch norms the row, writes its int8 form for
    #         the experts and routes it (`route_in_norm`, knob route_in_norm=on)
    _, _, plan = build_plan(model, lane="cuda", knobs=("route_in_norm=on",))
    routers = [op for op in plan.ops if class_of(op) is C.ROUTER_TOPK]
    assert routers
    for router in routers:
        normed, routing = router.sym.parts
        assert class_of(normed) is C.NORM_QUANT and class_of(normed.sym.parts[0]) is C.GEMV_NORM_EPILOGUE
        assert next(x for x in leaves(routing) if isinstance(x.sym, Matmul)).ins[0] == normed.out
    quantized_apart = {op.out for op in plan.ops if type(op.sym).__name__ == "Quantize"}
    assert not quantized_apart & {router.sym.parts[0].out for router in routers}
    _, _, default = build_plan(model, lane="cuda")
    assert default.launches() - plan.launches() == len(routers)  # a launch a mixture layer


@pytest.mark.parametrize("knobs", [(), ("activations=dequant",)])
@pytest.mark.parametrize("mix", BUDGET_MIXES)
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen1.5-moe-a2.7b"])
def test_every_mix_of_the_real_mixtures_is_within_the_budget(name, mix, knobs):
    # eight layers hold every combination of formats the recipes give a layer (tests/lanes/test_launch_budget.py);
    # under dequant a layer whose value product is in another format than its query's (a Q4_K_M recipe's Q6_K
    # attn_v) turns its query and key in the f32 QKV GEMV's epilogue (8 launches before)
    _assert_within_the_budget(replace(SHAPES[name], n_layers=8), name, mix, knobs)


MOST_UNITS = 256  # 64-value units of a mixture's hidden width: 16,384, twice Qwen2.5-72B's


@st.composite
def _mixture_like(draw):
    """A qwen2moe or qwen3moe of other widths: attention's (queries within half and twice the hidden width, a
    hidden width up to 16,384, past every published mixture's: the decode down launch's last block walks a
    norm wider than it holds in chunks), the experts' number, kept experts and width, and a qwen2moe's shared
    expert's."""
    base = SHAPES[draw(st.sampled_from(["qwen3-30b-a3b", "qwen1.5-moe-a2.7b"]))]
    hd, kv = draw(st.sampled_from([48, 64, 80, 96, 128, 256])), draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv * draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16]))  # 16: Qwen3-235B-A22B's 64 query heads over 4
    assume(heads * hd % kernels.QBLOCK == 0)  # a quantized file's rows are whole blocks
    units = draw(st.integers(max(8, heads * hd // 128), min(MOST_UNITS, max(8, heads * hd // 32))))  # 64 values
    experts = draw(st.sampled_from([8, 16, 60, 64, 128]))
    shared = 64 * draw(st.integers(4, 90)) if base.shared_ff else 0
    return replace(base, n_embd=64 * units, n_layers=8, n_heads=heads, n_kv_heads=kv, head_dim=hd,
                   experts=experts, experts_used=min(experts, draw(st.sampled_from([1, 2, 4, 8]))),
                   expert_ff=64 * draw(st.integers(4, 40)), shared_ff=shared, vocab=1024)  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(shape=_mixture_like(), mix=st.sampled_from(BUDGET_MIXES))
def test_a_mixture_of_any_widths_is_within_the_budget(shape, mix):
    _assert_within_the_budget(shape, "mixture-like", mix)


def _assert_within_the_budget(shape, name, mix, knobs=()):
    formats = tensor_formats(shape, mix)
    tensors = {n: Stub(dims, formats[n]) for n, dims in tensor_shapes(shape).items()}
    cfg = config_of(model_metadata(shape, name, 0) | {"general.architecture": shape.arch}, tensors)
    g = recognizer(cfg).recognize(cfg, tensors, Form.DECODE, ctx=4096)
    per_layer = stub_launches(g, optimize(g, CudaShim(CudaKnobs.parse(list(knobs)))))
    assert max(per_layer.values()) <= 7, per_layer


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("mix", BUDGET_MIXES)
def test_the_fold_takes_a_shared_expert_whose_products_have_kernels(mix, int8):
    # the folded expert's gate and up read the mixture's input by rows or as the kept experts' int8 tiles, its
    # down its SwiGLU by rows or, after those tiles, as an int8 product: llama.cpp's Q2_K recipe gives
    # Qwen1.5-MoE's shared down Q3_K and IQ4_XS's IQ4_XS, which the int8 GEMV reads at speed; under dequant
    # activations the GEMV by rows reads them a value at a time, so every layer folds (the grid mixes' experts
    # ride no fold: `test_grid_experts_lane.py`)
    from fuselane.lanes.cuda.plan import kernels

    shape = replace(SHAPES["qwen1.5-moe-a2.7b"], n_layers=8)
    formats = tensor_formats(shape, mix)
    tensors = {n: Stub(dims, formats[n]) for n, dims in tensor_shapes(shape).items()}
    cfg = config_of(model_metadata(shape, "qwen1.5-moe-a2.7b", 0) | {"general.architecture": shape.arch}, tensors)
    g = recognizer(cfg).recognize(cfg, tensors, Form.DECODE, ctx=4096)
    rows = kernels.ROWS_GEMV_FORMATS if int8 else kernels.ROWS_GEMV_FORMATS | kernels.VALUE_GEMV_FORMATS

    def readable(i: int) -> bool:
        at = f"blk.{i}.ffn_%s.weight"
        gate, down, kept = formats[at % "gate_shexp"], formats[at % "down_shexp"], formats[at % "gate_exps"]
        tiles = int8 and gate == kept and gate in kernels.INT8_GEMV_FORMATS
        return (gate in rows or tiles) and (down in rows or (tiles and down in kernels.INT8_GEMV_FORMATS))

    plan = optimize(g, CudaShim(CudaKnobs.parse([] if int8 else ["activations=dequant"])))
    refused = [m for m in plan.missed if m.cls is C.SHARED_EXPERT_FUSION]
    assert len(refused) == sum(not readable(i) for i in range(shape.n_layers))
    assert {m.reason for m in refused} <= {
        "a folded shared expert's score reads f32 activations, in the formats the GEMV by rows decodes; its gate, "
        "up and down those, or the kept experts' int8 tiles and an int8 down product"
    }


def test_shared_fold_off_runs_the_shared_expert_apart_and_says_why():
    # the knob keeps the gated shared expert out of the down launch: every layer's fold refused with the
    # knob's reason, its gate/up a gated pair of its own; on (the default) every layer folds it
    from fuselane.lanes.cuda.plan.fits_recurrent import SHARED_APART

    on = optimize(graph("synth:qwen1.5-moe-a2.7b", 1), CudaShim())
    off = optimize(graph("synth:qwen1.5-moe-a2.7b", 1), CudaShim(CudaKnobs.parse(["shared_fold=off"])))
    layers = 24  # Qwen1.5-MoE-A2.7B's
    assert not any(m.cls is C.SHARED_EXPERT_FUSION for m in on.missed)
    refused = [m for m in off.missed if m.cls is C.SHARED_EXPERT_FUSION]
    assert len(refused) == layers and {m.reason for m in refused} == {SHARED_APART}
    shared_pairs = [op for op in off.ops if "sh_glu" in op.out]
    assert len(shared_pairs) == layers
