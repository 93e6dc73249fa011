"""The rule `gdn_gate_projections` where a lane takes it (the cuda shim, a file holding its matrices in F16): it
fires in a chunk, and in the decode step where the step's GEMV in parts is held (`gemv_parts`); the fused plan
computes on the cpu lane in f64 the numbers of the plan with the rule held, over a chunk and two steps (the states
carried); it does not fire when the product, or b or a sliced out of it, is read elsewhere (`explain` names the
reader), nor in a step whose GEMV in parts takes the product with the layer's q/k/v and gate rows (one launch
fewer; the step makes the gates).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from fuselane.fuse.optimizer import Plan, optimize
from fuselane.fuse.views import class_of
from fuselane.gguf.synth import SHAPES, write_synthetic
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import WHOLE, Dst, Form, Op, Role, Tensor, TensorGraph, Values
from fuselane.graph.ops import Elementwise, ElementwiseOp
from fuselane.lanes.cpu.lane import CpuLane
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.knobs import CudaKnobs
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.models import recognizer
from fuselane.runtime.model import load

F64 = np.dtype(np.float64)
CTX = 16
RULE = "gdn_gate_projections"
GATES_IN_PARTS = (
    "a step's gates' product rides the GEMV in parts of its activation's other products, and the delta step makes "
    "the gates (gates_in_step): one launch fewer"
)
KNOBS = CudaKnobs.parse(["activations=dequant"])
PARTS = "gemv_parts"
SHIM = CudaShim(KNOBS, held=(PARTS,))  # the product by itself, as a GEMV in parts would not take it
LINEAR = 2  # tiny-qwen3next: linear, full, linear, full


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Iterator:
    path = write_synthetic(tmp_path_factory.mktemp("gates") / "m.gguf", SHAPES["tiny-qwen3next"], "f16", seed=7)
    m = load(path, lane="cpu", ctx=CTX, dtype=F64)
    yield m
    m.close()


def graph(model, rows: int) -> TensorGraph:
    form = Form.DECODE if rows == 1 else Form.PREFILL
    return recognizer(model.cfg).recognize(model.cfg, model.file.tensors, form, rows=rows, ctx=CTX)


def run(model, plans: dict[int, Plan]) -> np.ndarray:
    """Logits of a 5-row chunk then two steps on a fresh cpu lane, each form by its plan."""
    lane = CpuLane(model.cfg, model.file.tensors, ctx=CTX, dtype=F64)
    ids, out, pos = np.random.default_rng(3).integers(0, model.cfg.vocab, 7), [], 0
    for rows in (5, 1, 1):
        out.append(np.ravel(lane.run(plans[rows].graph, ids[pos : pos + rows], pos)))
        pos += rows
    return np.concatenate(out)


def test_the_gates_take_their_projection_and_the_numbers_stay(model):
    fused = {rows: optimize(graph(model, rows), SHIM, held=(PARTS,)) for rows in (1, 5)}
    # `gates_in_step` held too: it would take the gating apart into the step's launch
    held = {rows: optimize(graph(model, rows), SHIM, held=(RULE, "gates_in_step", PARTS)) for rows in (1, 5)}
    for plan in fused.values():
        assert sum(e.rule == RULE and e.cls is C.GDN_GATE_PROJECTIONS for e in plan.fired) == LINEAR
        assert sum(class_of(op) is C.GDN_GATE_PROJECTIONS for op in plan.graph.ops) == LINEAR
    for plan in held.values():
        assert not [e for e in plan.fired if e.rule == RULE]
        assert sum(class_of(op) is C.GDN_GATING for op in plan.graph.ops) == LINEAR
    assert np.array_equal(run(model, fused), run(model, held))


def _read_elsewhere(g: TensorGraph, name: str) -> TensorGraph:
    """`g` with one more op, at the end, that reads `name`."""
    h = TensorGraph(g.form, g.rows, dict(g.tensors), list(g.ops), g.inputs, g.params, g.outputs)
    rows, cols = h.tensors[name].shape
    h.add(Tensor(f"probe.{name}", (rows, cols), Values("f32"), Role.ACTIVATION))
    probe = Op(Elementwise(ElementwiseOp.ADD, rows, cols), (name, name), (WHOLE, WHOLE), f"probe.{name}",
               Dst(f"probe.{name}"), (len(h.ops),))  # fmt: skip
    h.ops = [*h.ops, probe]
    return h


@pytest.mark.parametrize("name", ["l0.ba", "l0.b", "l0.a"])
def test_a_product_or_slice_read_elsewhere_keeps_the_gates_apart(model, name):
    plan = optimize(_read_elsewhere(graph(model, 1), name), SHIM, held=(PARTS,), explain=True)
    taken = [e for e in plan.fired if e.rule == RULE]
    assert len(taken) == LINEAR - 1  # layer 2's still fuses; layer 0's keeps its product's value
    assert any(name in u.reason for u in plan.unmatched if u.rule == RULE), plan.unmatched


def test_a_step_takes_the_gates_product_in_its_gemv_in_parts(model):
    shim = CudaShim(KNOBS)
    # a step's row and a short chunk's 5 (within the GEMV's rows) take the GEMV in parts
    fused = {rows: optimize(graph(model, rows), shim) for rows in (1, 5)}
    for plan in fused.values():
        assert not [e for e in plan.fired if e.rule == RULE]
        assert {m.reason for m in plan.missed if m.rule == RULE} == {GATES_IN_PARTS}
        merged = [op for op in plan.graph.ops if class_of(op) is C.MERGED_QKV and any("ssm_ba" in n for n in op.ins)]
        assert len(merged) == LINEAR
    # a step makes its gates in the delta step's launch; a chunk's gating is a launch of its own, as before
    assert sum(e.rule == "gates_in_step" for e in fused[1].fired) == LINEAR
    held = {rows: optimize(graph(model, rows), SHIM, held=(RULE, "gates_in_step", PARTS)) for rows in (1, 5)}
    assert np.array_equal(run(model, fused), run(model, held))
    # past the GEMV's rows a chunk multiplies on cuBLAS: the gates take their product
    long = optimize(graph(model, kernels.GEMV_ROWS + 1), shim)
    assert sum(e.rule == RULE for e in long.fired) == LINEAR
