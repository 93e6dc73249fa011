"""The cuda lane on the two mixtures, every launch under Triton's interpreter, against the cpu lane in f64:
a prompt past the GEMV's rows (routing with the pairs sorted by expert, the chunk's expert products on f32
rows, the shared expert apart) and a decode step (the router and top-k on the device, the kept experts'
int8 gate/up writing its int8 form, the down products with the shared expert folded in, the residual add
and the next norm in one launch). Tolerances from the lane's numerics contract. One step each: the
interpreter is slow."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.fuse.views import class_of  # noqa: E402
from fuselane.gguf.synth import Shape, write_synthetic  # noqa: E402
from fuselane.graph.classes import ClassId as C  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

PROMPT = [5, 60, 7, 100, 8, 1, 2, 3, 4, 5, 6]  # past the GEMV's rows
# the tiny mixtures with one layer and a small vocabulary: the interpreter's time goes to the lm head and the
# attention, which other tests cover
SHAPES = {
    "qwen3moe": Shape("qwen3moe", 64, 1, 4, 2, 16, 128, 260, context=4096, experts=8, experts_used=2, expert_ff=32),
    "qwen2moe": Shape(
        "qwen2moe", 64, 1, 4, 2, 16, 128, 260, context=4096, experts=8, experts_used=2, expert_ff=32, shared_ff=64
    ),
}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize(
    ("shape", "activations", "decode_classes"),
    [
        ("qwen3moe", "int8", {C.ROUTER_TOPK, C.GLU_ACT_MUL_QUANT, C.NORM_QUANT}),
        ("qwen2moe", "dequant", {C.ROUTER_TOPK, C.MOE_GATE_UP_ACT, C.MOE_DEFERRED_FINALIZE}),
    ],
)
def test_cuda_lane_runs_a_mixture_as_the_cpu_lane(tmp_path, shape, activations, decode_classes):
    path = write_synthetic(tmp_path / "m.gguf", SHAPES[shape], "q8_0", seed=4)
    gpu = load(path, lane="cuda", ctx=16, knobs=[f"activations={activations}"])
    ref = load(path, lane="cpu", ctx=16, dtype=np.float64)
    step = gpu.lane.step(1)
    assert decode_classes <= {class_of(op) for op, _ in step.bound}
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    sg, sr = gpu.session(), ref.session()
    for what, a, b in (("prefill", sg.feed(PROMPT), sr.feed(PROMPT)), ("decode", sg.extend([9]), sr.extend([9]))):
        assert np.isfinite(a).all()
        assert rel(a, b) <= tol, f"{what}: {rel(a, b):.2e} > {tol:.2e}"
