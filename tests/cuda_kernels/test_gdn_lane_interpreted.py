"""The cuda lane on Qwen3-Next, every launch under Triton's interpreter, against the cpu lane in f64: a tiny
hybrid of one gated delta-rule layer and one gated full-attention layer (partial rotary), a prompt of a few
rows (the chunk's convolution and rule over its rows) and two decode steps, under both `state` precisions
(dequantized activations: the int8 products' launches take minutes interpreted, and the mixture's tests cover
them); the
heads either too narrow for the convolution's norming epilogue (the norms apart) or wide enough (normed in
it). Tolerances from the lane's numerics contract (`logits_tolerance`, which counts the state's rounding).

The states are the sequence's: a fresh session starts them again at zero, so the same prompt gives the same
logits, and continuing them anywhere but where they stopped is refused."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.fuse.views import class_of  # noqa: E402
from fuselane.gguf.synth import SHAPES, write_synthetic  # noqa: E402
from fuselane.graph.classes import ClassId as C  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

PROMPT = [5, 60, 7]
# one linear and one full-attention layer, a small vocabulary: the interpreter's time goes to the lm head
TINY = replace(SHAPES["tiny-qwen3next"], n_layers=2, vocab=260)
WIDE = replace(TINY, ssm_dim=32)  # heads of whole warps: normed in the convolution's epilogue
STEP = {C.CONV_BIAS_SILU, C.GDN_STEP, C.ATTN_OUTPUT_GATE}  # the gates made, and the output normed, in the GdnStep


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize(
    ("shape", "state", "activations", "conv_class", "held"),
    [
        (TINY, "bf16", "dequant", C.CONV_BIAS_SILU, ()),
        (WIDE, "f32", "dequant", C.CONV_SILU_L2NORM, ()),
        # the step's rule held: the chunk's bare GatedDelta and DeltaState each in the chunked form's one launch
        (WIDE, "f32", "dequant", C.CONV_SILU_L2NORM, ("gdn_step",)),
        # the gates in a launch of their own before the step's
        (TINY, "f32", "dequant", C.CONV_BIAS_SILU, ("gates_in_step",)),
        # the gated norm in a launch of its own after the step's
        (TINY, "f32", "dequant", C.CONV_BIAS_SILU, ("norm_in_step",)),
    ],
)
def test_cuda_lane_runs_qwen3next_as_the_cpu_lane(tmp_path, shape, state, activations, conv_class, held):
    path = write_synthetic(tmp_path / "m.gguf", shape, "q8_0", seed=3)
    gpu = load(path, lane="cuda", ctx=16, knobs=[f"state={state}", f"activations={activations}"], held=held)
    ref = load(path, lane="cpu", ctx=16, dtype=np.float64)
    classes = {class_of(op) for op, _ in gpu.lane.step(1).bound}
    assert (STEP - {C.CONV_BIAS_SILU} - ({C.GDN_STEP} if "gdn_step" in held else set())) | {conv_class} <= classes
    gates_apart = bool({"gdn_step", "gates_in_step"} & set(held))
    assert (C.GDN_GATING in classes) is gates_apart  # apart only where the step or the gates' fold is held
    assert (C.GATED_NORM in classes) is bool({"gdn_step", "norm_in_step"} & set(held))
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    sg, sr = gpu.session(), ref.session()
    steps = [("prefill", sg.feed(PROMPT), sr.feed(PROMPT))]
    steps += [(f"decode {t}", sg.extend([t]), sr.extend([t])) for t in (9, 40)]
    for what, a, b in steps:
        assert np.isfinite(a).all(), what
        assert rel(a, b) <= tol, f"{what}: {rel(a, b):.2e} > {tol:.2e}"
    again, want = gpu.session().feed([9]), ref.session().feed([9])  # the states start again at zero
    assert rel(again, want) <= tol
    with pytest.raises(ValueError, match="cannot continue"):
        gpu.lane.forward(np.array([3]), 2)


@pytest.mark.parametrize(("knobs", "precision"), [((), "tf32x3"), (("delta_products=ieee",), "ieee")])
def test_a_chunks_delta_rule_multiplies_at_the_knobs_precision(tmp_path, monkeypatch, knobs, precision):
    # binding only (no kernel runs): the chunk's GdnStep launches hand the chunked rule the knob's precision
    from fuselane.lanes.cuda.triton.gdn import chunked

    path = write_synthetic(tmp_path / "m.gguf", TINY, "q8_0", seed=3)
    gpu = load(path, lane="cuda", ctx=16, knobs=["activations=dequant", *knobs])
    rows = len(PROMPT)
    (launches,) = [ls for op, ls in gpu.lane.step(rows).bound if class_of(op) is C.GDN_STEP]
    seen: list[tuple[str, str]] = []
    for name in ("prepare", "recur"):
        monkeypatch.setattr(chunked, name, lambda *a, name=name, **k: seen.append((name, k["precision"])))
    for launch in launches:
        launch()
    assert seen == [("prepare", precision), ("recur", precision)]
