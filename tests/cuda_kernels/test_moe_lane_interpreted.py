"""The cuda lane on the two mixtures, every launch under Triton's interpreter, against the cpu lane in f64:
a prompt past the GEMV's rows (routing with the pairs sorted by expert, the chunk's expert products on f32
rows, the shared expert apart) and a decode step (the router and top-k on the device, the kept experts'
int8 gate/up writing its int8 form, the down products with the shared expert folded in, the residual add
and the next norm in one launch). Tolerances from the lane's numerics contract. One step each: the
interpreter is slow.

Routing: the lane must keep the experts the reference keeps, in every row (recorded from the cpu lane's top-k
and read from the lane's id buffer). The lane routes on its own scores, which differ from the reference's by
its numerics, so a k-th and (k+1)-th score within that of each other could keep another expert by chance:
the message then gives the reference's smallest lead of the k-th score, to tell such a seed from a bug."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.fuse.views import class_of, parts  # noqa: E402
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
    # three kept: the decode down tile's slots round up to four, or pack ten rows of three (moe_kernels.MOE_DOWN_PACKED)
    "qwen2moe-3": Shape(
        "qwen2moe", 64, 1, 4, 2, 16, 128, 260, context=4096, experts=8, experts_used=3, expert_ff=32, shared_ff=64
    ),
    # llama.cpp's Q2_K recipe at widths of whole super-blocks: the shared expert's gate/up in Q2_K (the kept
    # experts' int8 tiles) and its down in Q3_K, which only the int8 GEMV decodes: the down launch's int8 product
    # of the SwiGLU's int8 form, which those tiles write
    "qwen2moe-q2k": Shape(
        "qwen2moe",
        256,
        1,
        4,
        2,
        64,
        256,
        260,
        context=4096,
        experts=4,
        experts_used=2,
        expert_ff=256,
        shared_ff=256,
    ),
}
MIXES = {"qwen2moe-q2k": "q2_k"}  # the others' products in Q8_0


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _holds(op, cls) -> bool:
    """Whether `op` is of class `cls` or holds a part of it, at any depth."""
    return class_of(op) is cls or any(_holds(p, cls) for p in parts(op))


def _record_routing(monkeypatch) -> list:
    """The cpu lane's router scores and kept ids at each top-k it runs (the one layer's), appended in turn."""
    from fuselane.graph.ops import TopK
    from fuselane.lanes.cpu import kernels

    seen: list = []
    top_k = kernels.KERNELS[TopK]

    def recording(spec, args, pos):
        ids = top_k(spec, args, pos)
        seen.append((args[0].reshape(spec.rows, spec.cols), ids))
        return ids

    monkeypatch.setitem(kernels.KERNELS, TopK, recording)
    return seen


@pytest.mark.parametrize(
    ("shape", "activations", "decode_classes", "fold"),
    [
        ("qwen3moe", "int8", {C.ROUTER_TOPK, C.GLU_ACT_MUL_QUANT, C.NORM_QUANT}, "on"),
        ("qwen2moe", "dequant", {C.ROUTER_TOPK, C.MOE_GATE_UP_ACT, C.MOE_DEFERRED_FINALIZE}, "on"),
        ("qwen2moe", "int8", {C.ROUTER_TOPK, C.GLU_ACT_MUL_QUANT, C.NORM_QUANT}, "on"),  # the fold's int8 experts
        # the folded expert's SwiGLU as the kept experts' int8 tiles (moe_kernels.MOE_SHARED_INT8)
        ("qwen2moe", "int8", {C.ROUTER_TOPK, C.GLU_ACT_MUL_QUANT, C.NORM_QUANT}, "on-int8"),
        # the shared expert in launches of its own, its result added in by the down launch
        ("qwen2moe", "int8", {C.ROUTER_TOPK, C.GLU_ACT_MUL_QUANT, C.NORM_QUANT, None}, "off"),
        # a packed down tile of rows not a power of two, the folded expert's rows added in each program
        ("qwen2moe-3", "int8", {C.ROUTER_TOPK, C.GLU_ACT_MUL_QUANT, C.NORM_QUANT}, "on-int8-packed"),
        ("qwen2moe-q2k", "int8", {C.ROUTER_TOPK, C.GLU_ACT_MUL_QUANT, C.NORM_QUANT}, "on-int8"),
        ("qwen2moe-q2k", "int8", {C.ROUTER_TOPK, C.GLU_ACT_MUL_QUANT, C.NORM_QUANT, None}, "off-int8"),
    ],
)
def test_cuda_lane_runs_a_mixture_as_the_cpu_lane(tmp_path, monkeypatch, shape, activations, decode_classes, fold):
    from fuselane.lanes.cuda.plan import moe_kernels

    fold, *how = fold.split("-")
    monkeypatch.setattr(moe_kernels, "MOE_SHARED_INT8", "int8" in how)
    monkeypatch.setattr(moe_kernels, "MOE_DOWN_PACKED", "packed" in how)
    path = write_synthetic(tmp_path / "m.gguf", SHAPES[shape], MIXES.get(shape, "q8_0"), seed=4)
    gpu = load(path, lane="cuda", ctx=16, knobs=[f"activations={activations}", f"shared_fold={fold}"])
    ref = load(path, lane="cpu", ctx=16, dtype=np.float64)
    step = gpu.lane.step(1)
    assert decode_classes <= {class_of(op) for op, _ in step.bound}
    folded = any(_holds(op, C.SHARED_EXPERT_FUSION) for op, _ in step.bound)
    assert folded is (shape.startswith("qwen2moe") and fold == "on")
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    routed = _record_routing(monkeypatch)
    sg, sr = gpu.session(), ref.session()
    for what, a, b in (("prefill", sg.feed(PROMPT), sr.feed(PROMPT)), ("decode", sg.extend([9]), sr.extend([9]))):
        rows = len(PROMPT) if what == "prefill" else 1
        scores, want = routed.pop(0)
        got = gpu.lane.step(rows).bufs["l0.experts"].view(torch.int32).numpy()
        k = got.shape[-1]
        ranked = np.sort(scores, axis=-1)[:, ::-1]
        lead = float(np.min(ranked[:, k - 1] - ranked[:, k]))
        assert np.array_equal(np.sort(got, -1), np.sort(want, -1)), f"{what}: other experts kept (lead {lead:.2e})"
        assert np.isfinite(a).all()
        assert rel(a, b) <= tol, f"{what}: {rel(a, b):.2e} > {tol:.2e}"


def test_low_bit_experts_under_dequant_activations_run_as_the_cpu_lane(tmp_path):
    # a decode step's f32 expert products (and the folded shared expert's, the dense products') decode Q2_K and
    # Q3_K rows a value at a time (`gemv.formats._dot_values`), where they had refused activations=dequant
    from tests.lane_steps import runs_as_the_cpu_lane

    path = write_synthetic(tmp_path / "m.gguf", SHAPES["qwen2moe-q2k"], MIXES["qwen2moe-q2k"], seed=4)
    knobs = ["activations=dequant"]
    step = load(path, lane="cuda", ctx=16, knobs=knobs).lane.step(1)
    assert any(_holds(op, C.SHARED_EXPERT_FUSION) for op, _ in step.bound)
    runs_as_the_cpu_lane(path, PROMPT, [9, 10], [11], ctx=16, knobs=knobs)


def test_experts_of_rows_not_whole_128_value_steps_run_a_prompt(tmp_path):
    # rows of 160 values are not whole K-quant super-blocks: the Q3_K_M recipe's experts fall back to IQ4_NL,
    # which a chunk multiplies on the grouped GEMM only; its steps are now the most blocks that divide a row
    from fuselane.gguf.formats import Format
    from fuselane.gguf.synth import tensor_formats
    from tests.lane_steps import runs_as_the_cpu_lane

    shape = Shape("qwen3moe", 160, 1, 4, 2, 32, 128, 260, context=4096, experts=8, experts_used=2, expert_ff=96)
    assert tensor_formats(shape, "q3_k_m")["blk.0.ffn_gate_exps.weight"] is Format.IQ4_NL
    path = write_synthetic(tmp_path / "m.gguf", shape, "q3_k_m", seed=4)
    runs_as_the_cpu_lane(path, [5, 60, 7, 200, 8, 1, 2, 3, 4, 5, 6], [9, 10], [11], ctx=32)


@pytest.mark.parametrize(("shape", "activations"), [("qwen2moe", "int8"), ("qwen3moe", "dequant")])
def test_the_routing_in_the_norms_launch_runs_as_the_cpu_lane(tmp_path, shape, activations):
    # knob route_in_norm=on: a decode step's routing runs in the output projection's add + norm GEMV (the int8
    # one, writing the norm's int8 form too, or the f32 one), each program's share of the scores summed by its
    # group's and the launch's last programs (`triton/moe/norm_route.py`)
    from tests.lane_steps import runs_as_the_cpu_lane

    path = write_synthetic(tmp_path / "m.gguf", SHAPES[shape], MIXES.get(shape, "q8_0"), seed=4)
    knobs = [f"activations={activations}", "route_in_norm=on"]
    step = load(path, lane="cuda", ctx=16, knobs=knobs).lane.step(1)
    routers = [op for op, _ in step.bound if class_of(op) is C.ROUTER_TOPK]
    inner = C.NORM_QUANT if activations == "int8" else C.GEMV_NORM_EPILOGUE
    assert routers and all(class_of(op.sym.parts[0]) is inner for op in routers)
    runs_as_the_cpu_lane(path, PROMPT, [9, 10], [11], ctx=16, knobs=knobs)
