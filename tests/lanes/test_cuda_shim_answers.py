"""The cuda lane's shim against its specification: the `supports` table (each class's answer, the refusals' reasons
as specified, the ones that follow a knob), `numerics` at each knob setting, and the lane's rules in their order
(`fits`, `activation` and the `gemv_parts` rule on hand-built ops: test_cuda_shim.py).
"""

from __future__ import annotations

import pytest

from fuselane.fuse.rules import SHARED_RULES
from fuselane.fuse.shim import NATIVE, After, Before, SupportKind
from fuselane.graph.classes import ClassId as C
from fuselane.lanes.cuda.plan.classes import (
    DECOMPOSED_CLASSES,
    NATIVE_CLASSES,
    NO_KERNEL_CLASSES,
    QUANT_EPILOGUES,
    REFUSED_CLASSES,
)
from fuselane.lanes.cuda.plan.gdn import GDN_NATIVE
from fuselane.lanes.cuda.plan.knobs import Activations, CachePrecision, CudaKnobs, StatePrecision
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.numerics.contract import Block, Keep, Kept, Quantized, Scale, Scheme

DEFAULT = CudaKnobs()
INT8 = CudaKnobs(activations=Activations.INT8)

# --- supports ---------------------------------------------------------------------------------------------

SPECIFIED_REFUSALS = {
    C.RELU_SQR: "the lane links no ReLU",
    C.SOFTCAP: "the lane's attention takes no soft cap",
    C.MIXED_BATCH_ATTENTION: "the lane attends a batch's sequences each at its own position, none mid-prefill",
    C.SPARSE_ATTENTION: "the lane's attention reads every cached row of its span",
    C.GROUPED_TOPK: "the lane routes by one top-k over every expert",
    C.SAMPLING: "the lane picks the next token by arg-max",
    C.KV_CACHE_QUANT: "the lane stores its caches in f32 or f16",
    C.HADAMARD_ROTATION: "the lane rotates no cache",
    C.COMPENSATED_RESIDUAL: "the lane sums its residual in f32, uncompensated",
    C.HOST_RESIDENT_KV: "the lane keeps its caches on the device; only matrices move to host memory",
    C.ATTN_GQA_ROW_PACKING: "the lane's decode attention runs a head's dots on the CUDA cores",
    C.MOE_DIRECT_PAIRS: "the lane sorts a chunk's rows by expert",
    C.PERSISTENT_LAYER_MEGAKERNEL: "the lane replays a graph of a launch an op",
    C.ALLREDUCE_NORM: "the lane runs on one device",
}


def test_the_gated_delta_rules_native_classes_each_have_a_kernel() -> None:
    shim = CudaShim(DEFAULT)
    for cls in GDN_NATIVE:  # `plan.gdn`: several convolutions a launch, the gates with their projection too
        assert shim.supports(cls) == NATIVE and cls not in NO_KERNEL_CLASSES


# the numerics under which the decode attention runs a head's dots on the CUDA cores, as the specification's does
CORES = CudaKnobs(activations=Activations.DEQUANT)


def test_supports_answers_every_class_once() -> None:
    groups = [NATIVE_CLASSES, QUANT_EPILOGUES, DECOMPOSED_CLASSES, frozenset(REFUSED_CLASSES)]
    assert sum(len(x) for x in groups) == len(C)
    assert frozenset().union(*groups) == frozenset(C)
    shim = CudaShim(CORES)
    for cls in C:
        answer = shim.supports(cls)
        assert (answer.kind is SupportKind.REFUSE) == (cls in REFUSED_CLASSES), cls


def test_supports_refusals_are_the_specified_reasons() -> None:
    shim = CudaShim(CORES)
    refused = {cls: shim.supports(cls).reason for cls in C if shim.supports(cls).kind is SupportKind.REFUSE}
    assert refused == SPECIFIED_REFUSALS


@pytest.mark.parametrize("activations", list(Activations))
def test_gqa_row_packing_follows_the_attention_numerics(activations: Activations) -> None:
    """Where a step's attention takes f16 operands (the int8 numerics) the decode attention packs a group's
    heads into tensor-core rows; elsewhere the class is refused with the specification's reason, and every other
    refusal stands under every numerics."""
    shim = CudaShim(CudaKnobs(activations=activations))
    packs = activations is Activations.INT8
    assert shim.packs_gqa_rows == packs
    answer = shim.supports(C.ATTN_GQA_ROW_PACKING)
    assert answer == NATIVE if packs else answer.reason == SPECIFIED_REFUSALS[C.ATTN_GQA_ROW_PACKING]
    refused = {cls for cls in C if shim.supports(cls).kind is SupportKind.REFUSE}
    assert refused == set(SPECIFIED_REFUSALS) - ({C.ATTN_GQA_ROW_PACKING} if packs else set())


@pytest.mark.parametrize("fuse_quant", [True, False])
def test_quantizing_epilogues_follow_fuse_quant(fuse_quant: bool) -> None:
    shim = CudaShim(CudaKnobs(fuse_quant=fuse_quant))
    expected = SupportKind.NATIVE if fuse_quant else SupportKind.DECOMPOSE
    quantizing = {C.NORM_QUANT, C.ADD_NORM_QUANT, C.GLU_ACT_MUL_QUANT, C.ELEMENTWISE_QUANT}
    quantizing |= {C.GDN_OUTPUT_QUANT, C.GEMV_QUANT, C.ATTN_OUTPUT_QUANT}
    assert {cls for cls in C if shim.supports(cls).kind is expected} >= quantizing
    # the row write with its quantized form does not follow fuse_quant: the lane has no kernel for it yet, so it
    # runs as its parts either way; the gated attention runs natively either way
    assert shim.supports(C.ROW_WRITE_QUANT).kind is SupportKind.DECOMPOSE and C.ROW_WRITE_QUANT in NO_KERNEL_CLASSES
    assert shim.supports(C.ATTN_OUTPUT_GATE).kind is SupportKind.NATIVE
    assert shim.supports(C.PREFILL_NORM_EPILOGUES).kind is SupportKind.DECOMPOSE


# --- numerics and rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "knobs",
    [
        DEFAULT,
        INT8,
        CudaKnobs(activations=Activations.INT8X2, cache_precision=CachePrecision.F32),
        CudaKnobs(recurrent_state=StatePrecision.BF16),
    ],
    ids=["default", "int8", "int8x2-f32cache", "bf16-state"],
)
def test_numerics(knobs: CudaKnobs) -> None:
    c = CudaShim(knobs).numerics()
    words = {Activations.DEQUANT: None, Activations.INT8: 1, Activations.INT8X2: 2}[knobs.activations]
    assert (c.activations.words if c.activations else None) == words
    if c.activations:
        assert c.activations.block is Block.QBLOCK
    assert c.cache is {CachePrecision.F16: Keep.F16, CachePrecision.F32: Keep.F32}[knobs.cache_precision]
    assert c.state is {StatePrecision.F32: Keep.F32, StatePrecision.BF16: Keep.BF16}[knobs.recurrent_state]
    assert c.fused.exact and c.accumulator_bits == 32
    assert c.point == (
        f"the cuda lane: {knobs.activations.value} activations, {knobs.cache_precision.value} cache, "
        f"{knobs.recurrent_state.value} state; a chunk's products {CudaShim(knobs).prefill_products}"
    )
    assert c.attention == CudaShim.attention(knobs.activations)


def test_wide_attention_numerics() -> None:
    assert CudaShim.attention(Activations.DEQUANT) is None
    one = CudaShim.attention(Activations.INT8)
    assert one.queries == one.keys_values == one.weights == Kept(Keep.F16)
    two = CudaShim.attention(Activations.INT8X2)
    assert two.queries == two.keys_values == Quantized(Scheme(Block.ROW, Scale.MAX_OVER_127, 2))
    assert two.weights == Quantized(Scheme(Block.ROW, Scale.MAX_OVER_127, 3))


def test_name_and_rules() -> None:
    shim = CudaShim(INT8)
    assert shim.name == "cuda:H200:int8"
    found = [(position, rule.name, rule.holdable) for position, rule in shim.rules()]
    assert found == [
        (Before("add_norm"), "latent_expanded", True),
        (Before("merged_projections"), "gemv_parts", True),
        (After(SHARED_RULES[-1].name), "rope_epilogue", False),
        (After("rope_epilogue"), "products_apart", False),
        (After("products_apart"), "quantize_apart", False),
        (After("quantize_apart"), "chunked_delta", False),
    ]
    assert [rule.builds for _, rule in shim.rules()[:2]] == [(C.MLA,), (C.MERGED_QKV,)]
