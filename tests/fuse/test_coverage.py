"""Every plan is a sound schedule: a property test over random model shapes, forms, held rules and lane knobs.

For any dense Qwen graph the optimizer's plan must cover each original op exactly once, keep every dataflow
order the original had (no op reads a value before it is written, or after it is overwritten), fuse only
into classes the lane runs natively and whose fused ops fit its kernels, record as missed only what the lane
decomposed, refused or could not fit, and never fire a held rule. Graphs are built from metadata and tensor
tables of stand-ins (a shape and a format each), so no file is written; the cuda lane's shim is checked too
where it is importable (it needs neither torch nor a GPU to answer).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections import defaultdict
from functools import partial
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuselane.errors import FuselaneError
from fuselane.fuse.optimizer import Plan, covered, optimize, rule_names
from fuselane.fuse.rewriter import Missed
from fuselane.fuse.shim import SupportKind
from fuselane.fuse.views import class_of, parts
from fuselane.gguf.formats import Format
from fuselane.gguf.synth import Shape, model_metadata, tensor_formats, tensor_shapes
from fuselane.graph import facts
from fuselane.graph.ir import Form, Op, Role, TensorGraph
from fuselane.lanes.cpu.shim import CpuShim
from fuselane.models import config_of
from fuselane.models.qwen import recognize

AVAILABLE = (Role.WEIGHT, Role.INPUT, Role.PARAM)  # there before a step's first op
HAS_CUDA_SHIM = importlib.util.find_spec("fuselane.lanes.cuda") is not None and (
    importlib.util.find_spec("fuselane.lanes.cuda.plan.shim") is not None
)
LANES = ["cpu", *(["cuda"] if HAS_CUDA_SHIM else [])]


@dataclasses.dataclass(frozen=True)
class Stub:
    """What the recognizer needs of a tensor: its numpy-order shape and its storage format."""

    shape: tuple[int, ...]
    format: Format


def graph_of(shape: Shape, mix: str, rows: int, ctx: int) -> TensorGraph:
    """The recognizer's graph of a decode step (rows == 1) or a prefill chunk, from stand-in tensors."""
    formats = tensor_formats(shape, mix)
    tensors = {name: Stub(dims, formats[name]) for name, dims in tensor_shapes(shape).items()}
    meta = model_metadata(shape, "coverage", 0) | {"general.architecture": shape.arch}
    cfg = config_of(meta, tensors)
    return recognize(cfg, tensors, Form.DECODE if rows == 1 else Form.PREFILL, rows=rows, ctx=ctx)


def cuda_shim(activations: str, cache: str, fuse_quant: bool, held: tuple[str, ...]) -> Any:
    from fuselane.lanes.cuda.plan.knobs import CudaKnobs
    from fuselane.lanes.cuda.plan.shim import CudaShim

    knobs = CudaKnobs.parse(
        [f"activations={activations}", f"cache={cache}", f"fuse_quant={'on' if fuse_quant else 'off'}", "batch=off"]
    )
    return CudaShim(knobs, held=held)


# --- the properties -----------------------------------------------------------------------------------------


def check_covers(g: TensorGraph, plan: Plan) -> None:
    """Each original op is covered by exactly one op of the plan, and a fused op's covers are its parts'."""
    assert sorted(covered(plan)) == list(range(len(g.ops)))
    for op in plan.ops:
        if class_of(op) is not None:
            assert op.covers == tuple(sorted(c for part in parts(op) for c in part.covers))


def check_order(g: TensorGraph, plan: Plan) -> None:
    """The plan keeps every order the original's dataflow fixes.

    For each tensor, the original ops that touch it in turn (a write then its reads, reads then the next write,
    two writes) must run in the same order in the plan: in plan order, or inside one fused op, whose parts run
    in their original order. And every op of the plan reads only what an earlier op (or the op itself, inside
    a fusion) wrote, or what exists before the step: weights, inputs, parameters, and caches no op writes.
    """
    at = {c: k for k, op in enumerate(plan.ops) for c in op.covers}
    touches: dict[str, list[tuple[int, bool]]] = defaultdict(list)
    for i, op in enumerate(g.ops):
        for name in facts.reads(op):
            touches[name].append((i, False))
        for name in facts.writes(op):
            touches[name].append((i, True))
    for name, seq in touches.items():
        last_write: int | None = None
        reads_since: list[int] = []
        for i, write in seq:
            # a read comes after the write it reads; a write after every read of the value it overwrites
            before = ([] if last_write is None else [last_write]) + (reads_since if write else [])
            for a in before:
                assert a == i or at[a] <= at[i], f"{name}: op {a} must run before op {i}, but the plan swaps them"
            if write:
                last_write, reads_since = i, []
            else:
                reads_since.append(i)
    written = {name for op in g.ops for name in facts.writes(op)}
    seen: set[str] = set()
    for k, op in enumerate(plan.ops):
        inside = {n for leaf in _leaves(op) for n in facts.writes(leaf)}
        for name in facts.reads(op):
            role = plan.graph.tensors[name].role
            ready = role in AVAILABLE or (role is Role.CACHE and name not in written)
            assert ready or name in seen or name in inside, f"plan op {k} reads {name} before it is written"
        seen |= set(facts.writes(op))


def _leaves(op: Op) -> list[Op]:
    return [leaf for part in parts(op) for leaf in _leaves(part)] if class_of(op) else [op]


def check_lane(plan: Plan, shim: Any, held: tuple[str, ...]) -> None:
    """What fired the lane runs natively and fits; what was missed it did not; nothing held fired."""
    for op in plan.ops:
        stack = [op]
        while stack:
            node = stack.pop()
            if class_of(node) is not None:
                support = shim.supports(class_of(node))
                assert support.kind is SupportKind.NATIVE, f"{class_of(node)} fired but the lane says {support}"
                stack.extend(parts(node))
        if class_of(op) is not None:
            assert shim.fits(op, plan.graph) is None, f"{class_of(op)} fired but does not fit the lane"
    for event in plan.missed:
        assert isinstance(event, Missed) and event.reason
        kind = shim.supports(event.cls).kind
        if event.kind == "fits":
            assert kind is SupportKind.NATIVE, f"{event.cls} missed for fits but the lane says {kind}"
        else:
            assert kind is not SupportKind.NATIVE and event.kind == kind.value, event
    assert not {e.rule for e in plan.fired} & set(held), "a held rule fired"
    assert not {e.rule for e in plan.missed} & set(held), "a held rule asked the lane"


def check_plan(g: TensorGraph, plan: Plan, shim: Any, held: tuple[str, ...]) -> None:
    check_covers(g, plan)
    check_order(g, plan)
    check_lane(plan, shim, held)
    present = {op.covers for op in plan.ops} | _inner_covers(plan)
    # a fusion no longer in the plan was taken back (it, or a part of it) by a lane's settling pass
    split = [set(m.covers) for m in plan.missed if m.kind == "fits"]
    for covers in {e.covers for e in plan.fired} - present:
        assert any(s <= set(covers) for s in split), f"the fusion of {covers} fired but is not in the plan"


def _inner_covers(plan: Plan) -> set[tuple[int, ...]]:
    """The covers of fused ops nested in the plan's ops (a fusion later taken into a larger one)."""
    found: set[tuple[int, ...]] = set()
    stack = [p for op in plan.ops for p in parts(op)]
    while stack:
        op = stack.pop()
        found.add(op.covers)
        stack.extend(parts(op))
    return found


# --- the strategies -----------------------------------------------------------------------------------------


@st.composite
def shapes(draw) -> Shape:
    kv = draw(st.integers(1, 3))
    return Shape(
        arch=draw(st.sampled_from(("qwen2", "qwen3"))),
        n_embd=draw(st.sampled_from((16, 24, 32, 64, 96))),
        n_layers=draw(st.integers(1, 3)),
        n_heads=kv * draw(st.integers(1, 3)),
        n_kv_heads=kv,
        head_dim=2 * draw(st.integers(1, 40)),
        n_ff=draw(st.sampled_from((8, 32, 48, 64, 256))),
        vocab=draw(st.integers(8, 80)),
        context=256,
    )


MIXES = ("f32", "f16", "q8_0", "q4_k_m")
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw, lane: str):
    shape = draw(shapes())
    rows = draw(st.sampled_from((1, 1, 2, 7, 33, 64)))
    if lane == "cpu":
        dtype = np.dtype(draw(st.sampled_from((np.float32, np.float64))))
        make = partial(CpuShim, dtype)
    else:
        activations = draw(st.sampled_from(("dequant", "int8", "int8x2")))
        cache, fuse_quant = draw(st.sampled_from(("f16", "f32"))), draw(st.booleans())
        make = partial(cuda_shim, activations, cache, fuse_quant)
    # held names come from the table of the very shim under test: a lane's own rules may depend on its knobs
    held = tuple(draw(st.lists(st.sampled_from(rule_names(make(()))), unique=True, max_size=6)))
    return graph_of(shape, draw(st.sampled_from(MIXES)), rows, ctx=128), make(held), held


@pytest.mark.parametrize("lane", LANES)
@SETTINGS
@given(data=st.data())
def test_every_plan_is_a_sound_schedule(lane, data):
    g, shim, held = data.draw(cases(lane))
    # the drawn widths include ones no cuda kernel takes (rows not whole 32-value blocks): the plan is still a
    # sound schedule, and the lane says why it cannot run it, in one FuselaneError where the plan is checked
    plan = optimize(g, shim, held=held, check=False)
    check_plan(g, plan, shim, held)
    if plan.cannot_run is not None:
        with pytest.raises(FuselaneError, match="cannot run this model"):
            optimize(g, shim, held=held)
    told = optimize(g, shim, held=held, explain=True, check=False)  # explaining only adds reasons
    assert (told.ops, told.fired, told.missed) == (plan.ops, plan.fired, plan.missed)
    assert all(u.rule not in held and u.covers and u.reason for u in told.unmatched)


@pytest.mark.parametrize("lane", LANES)
def test_the_full_table_fires_on_a_tiny_model(lane):
    """A fixed case, so a broken strategy cannot make the property pass on plans that fuse nothing."""
    shape = Shape("qwen3", 64, 2, 4, 2, 16, 128, 64, context=256)
    shim = CpuShim() if lane == "cpu" else cuda_shim("int8", "f16", True, ())
    for rows in (1, 16):
        g = graph_of(shape, "q8_0", rows, ctx=64)
        plan = optimize(g, shim)
        check_plan(g, plan, shim, ())
        assert plan.fired and len(plan.ops) < len(g.ops)


def test_the_order_check_catches_a_swap():
    """The order property is not vacuous: a plan with two dependent ops swapped fails it."""
    g = graph_of(Shape("qwen2", 16, 1, 2, 1, 8, 8, 8, context=32), "f32", 1, ctx=8)
    plan = optimize(g, CpuShim(), held=rule_names(CpuShim()))
    plan.ops[0], plan.ops[1] = plan.ops[1], plan.ops[0]  # the norm before the gather it reads
    with pytest.raises(AssertionError, match="before"):
        check_order(g, plan)
