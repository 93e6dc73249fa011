"""The cuda lane's batch plan (`batch=on`) under int8 activations: past one row, a batch's products by checkpoint
rows in the int8 GEMV's formats read their activation's int8 form (the int8 GEMV over the batch's rows,
`triton/gemv/q8_rows.py`), which the plan writes: an add + norm and the paged attention in their launches, a
`Quantize` launch after the embedding's norm and after each gated pair (the one-row GEMV's quantizing epilogue
takes one row). Products in other formats, a mixture's kept experts and the dequantized numerics read f32."""

from __future__ import annotations

import pytest

from fuselane.explain import build_plan
from fuselane.fuse.views import class_of, leaves
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ops import ExpertMatmul, Matmul, Quantize
from fuselane.lanes.cuda.plan.knobs import CudaKnobs
from fuselane.lanes.cuda.plan.shim import CudaShim

ROWS = 4


def _plan(model: str = "synth:tiny-qwen2", *knobs: str, rows: int = ROWS):
    _, _, plan = build_plan(model, lane="cuda", form="batch", rows=rows, knobs=("batch=on", *knobs))
    return plan, CudaShim(CudaKnobs.parse(["batch=on", *knobs]))


def _reads_int8(found, kind: type = Matmul) -> list[str]:
    """The products of `kind` that read their activation in int8 (the shim's answer, which the binders follow)."""
    plan, shim = found
    return [
        op.out
        for op in plan.ops
        if any(isinstance(leaf.sym, kind) for leaf in leaves(op)) and shim.activation(op, 0, plan.graph) is not None
    ]


def _count(found, what) -> int:
    plan, _ = found
    return sum(isinstance(op.sym, Quantize) if what is Quantize else class_of(op) is what for op in plan.ops)


def test_a_batchs_products_read_int8():
    plan = _plan()
    # each layer's q/k/v in parts, o, the gated pair, down; and the head: 4 a layer and one
    assert len(_reads_int8(plan)) == 2 * 4 + 1
    # the embedding's norm and each layer's gated pair; the attention writes its output's int8 form itself (heads
    # of 16 values, two a block: whole 32-value blocks together)
    assert _count(plan, Quantize) == 1 + 2
    assert _count(plan, C.ADD_NORM_QUANT) == 2 * 2 and _count(plan, C.GLU_ACT_MUL_QUANT) == 0
    assert "a batch's products up to 8 rows read int8 rows in the int8 GEMV's formats" in plan[0].contract.point


def test_a_batch_of_one_row_keeps_the_one_row_epilogues():
    plan = _plan(rows=1)
    assert _count(plan, C.GLU_ACT_MUL_QUANT) == 2 and len(_reads_int8(plan)) == 2 * 4 + 1


@pytest.mark.parametrize(
    ("model", "knobs"), [("synth:tiny-qwen3:f16", ()), ("synth:tiny-qwen2", ("activations=dequant",))]
)
def test_other_formats_and_the_dequantized_numerics_read_f32(model, knobs):
    """f16 rows: no int8 GEMV multiplies them."""
    plan = _plan(model, *knobs)
    assert not _reads_int8(plan) and not _count(plan, Quantize)
    if knobs:
        assert "a batch's products up to 8 rows read f32 rows; past them" in plan[0].contract.point


def test_a_mixtures_kept_experts_read_f32_its_shared_expert_int8():
    """The mixture's launches read the f32 rows (the chunk kernels for experts take a batch's rows), though the
    norm they read is quantized too, for the shared expert's products."""
    found = _plan("synth:tiny-qwen2moe")
    assert not _reads_int8(found, ExpertMatmul)
    shared = [name for name in _reads_int8(found) if "sh_" in name]
    assert len(shared) == 2 * 2  # each layer's shared gated pair and down product


@pytest.mark.parametrize("knobs", [(), ("activations=dequant",), ("prefill=in-place",), ("prefill=int8",)])
def test_a_batch_past_the_gemvs_rows_multiplies_as_a_chunk(knobs):
    """Past the GEMV's 8 rows a batch's products run as a chunk's: the f16 tensor cores (never the int8 GEMM,
    whatever the `prefill` knob), reading f32 rows, so nothing quantizes; the gated pair splits as a chunk's."""
    found = _plan("synth:tiny-qwen2", *knobs, rows=16)
    plan, shim = found
    assert not _reads_int8(found) and not _count(found, Quantize)
    assert _count(found, C.GEMV_GATE_UP_GLU) == 0 and _count(found, C.GLU_ACT_MUL) == 2
    assert not any(shim.int8_gemm(p) for op in plan.ops if (p := shim.rows_product(op, plan.graph)) is not None)
    assert "past them" in plan.contract.point
    narrow = _plan("synth:tiny-qwen2", *knobs, rows=8)
    assert _count(narrow, C.GEMV_GATE_UP_GLU) == 2  # within the GEMV's rows: the gated pair is one launch
