"""The cuda lane's prefill plan under `prefill=int8`: a chunk's products read their activation's int8 form, which
the plan writes (an add + norm in its epilogue, a `Quantize` launch after the producers that have none), and
the other `prefill` values and the dequantized numerics leave every activation in f32 (a batch's rows:
`test_cuda_batch_plan.py`)."""

from __future__ import annotations

import pytest

from fuselane.explain import build_plan
from fuselane.fuse.views import class_of, leaves
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import QuantFormat, QuantizedActs
from fuselane.graph.ops import Matmul, Quantize


def _plan(*knobs: str, form: str = "prefill", rows: int = 16):
    knobs = knobs or ("prefill=int8",)  # not the default yet (measured slower, `knobs.py`)
    _, _, plan = build_plan("synth:tiny-qwen2", lane="cuda", form=form, rows=rows, knobs=knobs)
    return plan


def _int8_products(plan) -> list[str]:
    g = plan.graph
    return [
        op.out
        for op in plan.ops
        if any(isinstance(leaf.sym, Matmul) for leaf in leaves(op))
        and isinstance(g.tensors[op.ins[0]].storage, QuantizedActs)
    ]


def test_a_chunks_products_read_int8():
    plan = _plan()
    g = plan.graph
    # q, k, v, o, gate, up, down of each of the two layers; the head reads the last row's f32 norm (one row)
    assert len(_int8_products(plan)) == 2 * 7
    assert all(g.tensors[n].storage == QuantizedActs(QuantFormat.ONE_WORD) for n in ("l0.glu", "l0.attn", "l1.ffn_in"))
    # the embedding's norm is quantized by a launch of its own, and each attention's output (its heads of 16
    # values are no whole 32-value blocks); the add + norms and SwiGLU write their int8 forms in their launches
    assert sum(isinstance(op.sym, Quantize) for op in plan.ops) == 1 + 2
    assert sum(class_of(op) is C.GLU_ACT_MUL_QUANT for op in plan.ops) == 2


def test_an_attention_of_whole_blocks_quantizes_its_output(tmp_path):
    from fuselane.gguf.synth import Shape, write_synthetic

    shape = Shape("qwen2", 128, 1, 4, 2, 32, 256, 512, context=4096)
    path = write_synthetic(tmp_path / "m.gguf", shape, "q8_0")
    _, _, plan = build_plan(str(path), lane="cuda", form="prefill", rows=16, knobs=["prefill=int8"])
    assert sum(class_of(op) is C.ATTN_OUTPUT_QUANT for op in plan.ops) == 1
    assert sum(isinstance(op.sym, Quantize) for op in plan.ops) == 1  # the embedding's norm only
    assert "int8 tensor cores" in plan.contract.point


@pytest.mark.parametrize(
    "knobs", [("prefill=f16-copy",), ("prefill=in-place",), ("activations=dequant", "prefill=int8")]
)
def test_other_prefills_read_f32(knobs):
    plan = _plan(*knobs)
    assert not _int8_products(plan) and not any(isinstance(op.sym, Quantize) for op in plan.ops)


def test_a_chunk_within_the_gemvs_rows_reads_f32():
    assert not _int8_products(_plan("prefill=int8", rows=8))


def test_the_default_prefill_reads_f32():
    assert not _int8_products(_plan("activations=int8"))
