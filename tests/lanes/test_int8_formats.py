"""The cuda lane's int8 GEMV takes every quantized format of llama.cpp's mixes: in a decode step of each mix,
every matrix product but the embedding's gather reads its activation in int8 (the plan's quantizing
producers write it), and the launch budget of seven a layer holds. Plans only (no kernels run)."""

from __future__ import annotations

import pytest

from fuselane.explain import build_plan, launches_per_layer
from fuselane.gguf.synth import SHAPES, Shape
from fuselane.lanes.cuda.plan.knobs import CudaKnobs
from fuselane.lanes.cuda.plan.shim import CudaShim

MIXES = ("q5_k_m", "q6_k", "q4_0", "q5_0", "iq4_xs", "q3_k_m", "q2_k")
# The 32B's and the 8B's widths at four layers and a small vocabulary (the plans are the same a layer)
WIDTHS = {
    "qwen2.5-32b-4": Shape("qwen2", 5120, 4, 40, 8, 128, 27648, 1024),
    "qwen3-8b-4": Shape("qwen3", 4096, 4, 32, 8, 128, 12288, 1024),
}
LAUNCHES_A_LAYER = 7


@pytest.fixture(autouse=True)
def _shapes(monkeypatch):
    for name, shape in WIDTHS.items():
        monkeypatch.setitem(SHAPES, name, shape)


def matrices(ops) -> set[str]:
    return {n for op in ops for n in op.ins if n.endswith(".weight") and "norm" not in n}


@pytest.mark.parametrize("shape", WIDTHS)
@pytest.mark.parametrize("mix", MIXES)
def test_every_product_reads_int8(shape: str, mix: str) -> None:
    _, _, plan = build_plan(f"synth:{shape}:{mix}", lane="cuda")
    shim, g = CudaShim(CudaKnobs()), plan.graph
    int8 = matrices(op for op in plan.ops if shim.activation(op, 0, g) is not None)
    assert matrices(plan.ops) - int8 == {"token_embd.weight"}
    assert max(launches_per_layer(plan).values()) <= LAUNCHES_A_LAYER


def test_floats_read_f32() -> None:
    _, _, plan = build_plan("synth:qwen3-8b-4:bf16", lane="cuda")
    shim = CudaShim(CudaKnobs())
    assert not [op for op in plan.ops if shim.activation(op, 0, plan.graph) is not None]
