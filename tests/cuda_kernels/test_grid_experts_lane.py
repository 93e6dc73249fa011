"""A mixture's experts in a grid or ternary format on the cuda lane: a step's pairs on the grid experts' launches
(`triton/grid/experts.py`), a chunk's and a short batch's on the grouped GEMM's grid tiles
(`grid.values.grid_tile`), against the cpu lane in f64 within the lane's contract. Interpreted where there is
no GPU, compiled on one.

A folded shared expert rides no grid launch: SharedExpertFusion is taken apart, and `explain` says why."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.explain import build_plan  # noqa: E402
from fuselane.fuse.views import class_of, leaves  # noqa: E402
from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.gguf.synth import Shape, write_synthetic  # noqa: E402
from fuselane.graph.classes import ClassId as C  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from tests.lane_steps import runs_as_the_cpu_lane  # noqa: E402

# rows of whole 256-value super-blocks, as the grid formats need; one layer keeps the interpreter's time short
QWEN3MOE = Shape("qwen3moe", 256, 1, 4, 1, 64, 512, 512, context=64, experts=4, experts_used=2, expert_ff=256)
QWEN2MOE = Shape(
    "qwen2moe", 256, 1, 4, 1, 64, 512, 512, context=64, experts=4, experts_used=2, expert_ff=256, shared_ff=256
)
PROMPT = [5, 60, 7, 300, 8, 1, 2, 3, 4, 5, 6]  # past the GEMV's rows: the grouped GEMM
SHORT = [12, 13, 14]  # a short chunk: the grouped GEMM too (no f32 GEMV by rows decodes a grid format)
DECODE = [9, 77]  # a step's one row: the grid experts' launches


def _write(path, shape: Shape, formats: dict[str, Format]) -> str:
    names = {f"blk.0.{m}.weight": f for m, f in formats.items()}
    return str(write_synthetic(path, shape, "q8_0", seed=7, formats=names))


def _holding(path: str, matrix: str) -> list[C]:
    ops = build_plan(path, lane="cuda")[2].ops
    return [class_of(op) for op in ops if matrix in {x for leaf in leaves(op) for x in leaf.ins}]


@pytest.mark.parametrize(
    ("formats", "activations", "gate_up"),
    [
        # a step's row in int8 for the gate/up experts, which write their SwiGLU rows' int8 form for the down
        ({"ffn_gate_exps": Format.IQ2_XXS, "ffn_up_exps": Format.IQ2_XXS, "ffn_down_exps": Format.IQ3_S}, "int8",
         C.GLU_ACT_MUL_QUANT),
        # a ternary down product reads f32: the gate/up launch writes no int8 form
        ({"ffn_gate_exps": Format.IQ1_M, "ffn_up_exps": Format.IQ1_M, "ffn_down_exps": Format.TQ1_0}, "dequant",
         C.MOE_GATE_UP_ACT),
    ],
    ids=["iq2_xxs-iq3_s-int8", "iq1_m-tq1_0-dequant"],
)  # fmt: skip
def test_grid_experts_run_as_the_cpu_lane(tmp_path, formats, activations, gate_up):
    path = _write(tmp_path / "m.gguf", QWEN3MOE, formats)
    assert _holding(path, "blk.0.ffn_gate_exps.weight") == [gate_up]
    runs_as_the_cpu_lane(path, PROMPT, SHORT, DECODE, ctx=32, knobs=[f"activations={activations}"])
    # grid experts run kernels of their own, not the grid GEMV: `pdl=auto` keeps dependent launches
    lane = load(path, lane="cuda", ctx=32).lane
    assert not set(formats.values()) & lane.dense_formats() and lane.shim.dependent_launches(lane.dense_formats())


def test_the_mixtures_last_step_norms_and_quantizes_from_grid_experts(tmp_path):
    # the down experts in a grid format still end the layer with the next norm, and its int8 form for the
    # output head's Q8_0 product (NormQuant of MoeDeferredFinalize): the launch budget is kept
    path = _write(tmp_path / "m.gguf", QWEN3MOE, {"ffn_down_exps": Format.IQ2_S})
    assert _holding(path, "blk.0.ffn_down_exps.weight") == [C.NORM_QUANT]
    runs_as_the_cpu_lane(path, PROMPT, SHORT, DECODE, ctx=32)


def test_a_shared_expert_beside_grid_experts_runs_apart(tmp_path):
    formats = {"ffn_gate_exps": Format.IQ3_XXS, "ffn_up_exps": Format.IQ3_XXS, "ffn_down_exps": Format.IQ2_XS}
    path = _write(tmp_path / "m.gguf", QWEN2MOE, formats)
    _, _, plan = build_plan(path, lane="cuda")
    assert plan.cannot_run is None
    assert C.SHARED_EXPERT_FUSION not in {class_of(op) for op in plan.ops}
    missed = map(str, plan.missed)
    assert any("blk.0.ffn_down_exps.weight" in why and "no shared expert folded" in why for why in missed)
    runs_as_the_cpu_lane(path, PROMPT, SHORT, DECODE[:1], ctx=32)
