"""Each rule of the shared table, tested as Inductor tests its pattern rewrites.

For every rule that fires on dense Qwen graphs (or on a small hand-built graph, for the shapes Qwen lacks):
(a) it fires, with its name and its class; (b) the fused plan computes the plain graph's numbers (run on the
cpu lane in f64: a fused op runs its parts' kernels; where the class reads in place or writes in place, the
in-place form is checked too); (c) it does not fire when an intermediate it would swallow has another reader
(a graph output, or one more op reading it), and `explain` names that reader; (d) it does not fire when an op
placed between its members makes moving them illegal (the rewriter's crossing check), and the numbers still
match. Also: the table is data (unique names, a `# before -> after` comment each, classes that exist), the
quantizing epilogues under a lane whose products read int8 activations, and the explain mode's cost.

Rules the cpu lane runs natively are tested with its shim; the rest with a test shim that takes everything.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest

from fuselane.fuse import gdn_rules, moe_rules, parallel_rules, quant_rules, routing_rules, rules
from fuselane.fuse.optimizer import Plan, optimize, rule_names
from fuselane.fuse.rewriter import Fired, Missed, Rewriter, Schedule
from fuselane.fuse.rules import SHARED_RULES
from fuselane.fuse.shim import DECOMPOSE, NATIVE, LaneRule, Position, Support
from fuselane.fuse.views import class_of, gemv, parts
from fuselane.gguf.formats import Format
from fuselane.gguf.synth import write_synthetic
from fuselane.graph.classes import ClassId
from fuselane.graph.ir import (
    WHOLE,
    Dst,
    Form,
    Op,
    QuantFormat,
    QuantizedActs,
    Role,
    RowAt,
    Strided,
    Tensor,
    TensorGraph,
    Values,
)
from fuselane.graph.ops import (
    ArgMax,
    Elementwise,
    ElementwiseOp,
    Join,
    Matmul,
    PrimSpec,
    RmsNorm,
    RowsGather,
    SetRow,
    Slice,
    Unary,
    UnaryOp,
)
from fuselane.lanes.cpu import kernels
from fuselane.lanes.cpu.lane import CpuLane
from fuselane.lanes.cpu.shim import CPU_NATIVE, CpuShim
from fuselane.models.qwen import IDS, LOGITS, POS, recognize
from fuselane.runtime.model import load

F64 = np.dtype(np.float64)
CPU = CpuShim(F64)
ALL = tuple(rule_names(CPU))
CTX = 24
BUILDS = {r.name: r.builds for r in SHARED_RULES}


class TakeAll:
    """A test lane that runs every class natively and fits every op: every rule that matches fires."""

    held: tuple[str, ...] = ()
    name = "take-all"

    def supports(self, cls: ClassId) -> Support:
        return NATIVE

    def fits(self, op: Op, g: TensorGraph) -> str | None:
        return None

    def activation(self, consumer: Op, operand: int, g: TensorGraph) -> QuantFormat | None:
        return None

    def rules(self) -> list[tuple[Position, LaneRule]]:
        return []

    def numerics(self) -> None:
        return None


@dataclass(frozen=True)
class Int8Lane(TakeAll):
    """A test lane whose products read their activation as int8 words; `fuse_quant` is whether producers may
    quantize in their epilogue (off: the quantizing classes run apart)."""

    fuse_quant: bool = True
    name = "int8"

    def supports(self, cls: ClassId) -> Support:
        quantizing = {c for r in quant_rules.QUANT_RULES for c in r.builds}
        if cls in quantizing:
            return NATIVE if self.fuse_quant else DECOMPOSE
        return NATIVE if cls in CPU_NATIVE else DECOMPOSE

    def activation(self, consumer: Op, operand: int, g: TensorGraph) -> QuantFormat | None:
        return QuantFormat.ONE_WORD if operand == 0 and gemv(consumer, g) is not None else None


# --- graphs and how to run them -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("rules")
    out = {}
    for name in ("tiny-qwen2", "tiny-qwen3"):
        out[name] = load(write_synthetic(d / f"{name}.gguf", name, "q8_0", seed=5), lane="cpu", ctx=CTX, dtype=F64)
    yield out
    for model in out.values():
        model.close()


def qwen_graph(model, rows: int) -> TensorGraph:
    form = Form.DECODE if rows == 1 else Form.PREFILL
    return recognize(model.cfg, model.file.tensors, form, rows=rows, ctx=CTX)


def copy(g: TensorGraph) -> TensorGraph:
    return TensorGraph(g.form, g.rows, dict(g.tensors), list(g.ops), g.inputs, g.params, g.outputs)


def index_of(g: TensorGraph, out: str) -> int:
    return next(i for i, op in enumerate(g.ops) if op.out == out)


def with_op(g: TensorGraph, after: str | None, sym: PrimSpec, ins: tuple[str, ...], out: str) -> TensorGraph:
    """`g` with one more op, right after the op writing `after` (at the end when None), ops renumbered."""
    h = copy(g)
    t = g.tensors[ins[0]]
    h.add(Tensor(out, t.shape, Values("f32"), Role.ACTIVATION))
    k = len(g.ops) if after is None else index_of(g, after) + 1
    op = Op(sym, ins, tuple(WHOLE for _ in ins), out, Dst(out))
    ops = [*g.ops[:k], op, *g.ops[k:]]
    h.ops = [replace(o, covers=(n,)) for n, o in enumerate(ops)]
    return h


def probe(g: TensorGraph, name: str, *, after: str | None = None, write: bool = False) -> TensorGraph:
    """`g` with an op that reads `name` (write: and overwrites it, doubling it in place), after the op writing
    `after`, or at the end."""
    rows, cols = g.tensors[name].shape
    return with_op(
        g, after, Elementwise(ElementwiseOp.ADD, rows, cols), (name, name), name if write else f"probe.{name}"
    )


def exposed(g: TensorGraph, name: str) -> TensorGraph:
    """`g` with `name` also a graph output."""
    h = copy(g)
    h.outputs = (*g.outputs, name)
    return h


def run(g: TensorGraph, lane: CpuLane, steps: int) -> list[np.ndarray]:
    """Logits of `steps` runs of `g` from position 0 on a fresh lane (no cache or graph state is shared)."""
    rng = np.random.default_rng(11)
    out = []
    for step in range(steps):
        ids = rng.integers(0, 8, size=g.rows)
        out.append(np.array(lane.run(g, ids, step * g.rows), dtype=np.float64))
    return out


def same_numbers(plain: TensorGraph, plan: Plan, lane_of) -> float:
    got, want = run(plan.graph, lane_of(), 3), run(plain, lane_of(), 3)
    a, b = np.concatenate([x.ravel() for x in got]), np.concatenate([x.ravel() for x in want])
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def fired(plan: Plan, rule: str) -> list[Fired]:
    return [e for e in plan.fired if e.rule == rule]


# --- the cases ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A rule on a Qwen graph. `member`: an original op the fusion takes (by its output); `swallows`: an
    intermediate it would keep out of memory (None: it writes what it takes); `between`: (after which op's
    output, the tensor an op placed there reads or overwrites, overwrites?) to make a member's move illegal."""

    rule: str
    shape: str
    member: str
    swallows: str | None
    between: tuple[str, str, bool] | None
    take_all: bool = False
    held: tuple[str, ...] = ()
    rows: int = 1


CASES = [
    Case(
        "norm_weight", "tiny-qwen2", "l0.ffn_in.normed", "l0.ffn_in.normed", ("l0.ffn_in.normed", "l0.resid_attn", True)
    ),
    Case("embed_norm", "tiny-qwen2", "embd", None, ("embd", "embd", False)),
    Case("add_norm", "tiny-qwen2", "l0.resid_attn", None, ("l0.resid_attn", "l0.resid_attn", False), rows=5),
    Case("qk_norm_rope", "tiny-qwen3", "l0.q_normed", "l0.q_normed", ("l0.q_normed", "l0.q", True)),
    Case("qk_norm_rope_kv_append", "tiny-qwen3", "l0.k_rot", "l0.k_rot", ("l0.k_rot", "l0.k", True), rows=4),
    Case("rope_kv_append", "tiny-qwen2", "l0.k_rot", "l0.k_rot", ("l0.k_rot", "l0.k", True)),
    Case("glu_act_mul", "tiny-qwen3", "l0.gate_act", "l0.gate_act", ("l0.gate_act", "l0.gate", True), rows=3),
    Case("gemm_bias", "tiny-qwen2", "l0.q.raw", "l0.q.raw", ("l0.q.raw", "l0.attn_in", True)),
    Case("row_write", "tiny-qwen3", "l0.v", "l0.v", ("l0.v", "l0.attn_in", True)),
    Case("flash_decode", "tiny-qwen3", "l0.attn", None, None),
    Case("flash_prefill", "tiny-qwen2", "l0.attn", None, None, rows=6),
    Case("qkv_head_epilogue", "tiny-qwen2", "l0.q", "l0.q", ("l0.q", "l0.attn_in", True), take_all=True),
    Case(
        "rope_q_k_one_launch", "tiny-qwen3", "l0.q_rot", None, ("l0.q_rot", "l0.q", True), True, ("qkv_head_epilogue",)
    ),
    Case("gate_up_glu", "tiny-qwen2", "l0.gate", "l0.gate", ("l0.up", "l0.ffn_in", True), take_all=True, rows=2),
    Case("merged_projections", "tiny-qwen2", "l0.k", None, ("l0.q", "l0.attn_in", True), True, ("qkv_head_epilogue",)),
    Case("merged_gate_up", "tiny-qwen3", "l0.up", "l0.up", ("l0.gate", "l0.ffn_in", True), True, ("gate_up_glu",)),
    Case("gemv_norm_epilogue", "tiny-qwen2", "l0.attn_out", "l0.attn_out", ("l0.attn_out", "l0.attn", True), True),
]
IDS_OF = [c.rule for c in CASES]


def plan_of(case: Case, g: TensorGraph, *, explain: bool = False) -> Plan:
    return optimize(g, TakeAll() if case.take_all else CPU, held=case.held, explain=explain)


def covering(plan: Plan, rule: str, index: int) -> list[Fired]:
    return [e for e in fired(plan, rule) if index in e.covers]


@pytest.mark.parametrize("case", CASES, ids=IDS_OF)
def test_the_rule_fires_and_changes_no_number(models, case):
    model = models[case.shape]
    g = qwen_graph(model, case.rows)
    plan = plan_of(case, g)
    events = covering(plan, case.rule, index_of(g, case.member))
    assert len(events) == 1, f"{case.rule} did not fire on {case.member}"
    assert events[0].cls in BUILDS[case.rule]
    assert any(class_of(op) is events[0].cls for op in _all_ops(plan))
    assert same_numbers(g, plan, lambda: CpuLane(model.cfg, model.file.tensors, ctx=CTX, dtype=F64)) <= 1e-12


def _all_ops(plan: Plan) -> list[Op]:
    stack, found = list(plan.ops), []
    while stack:
        op = stack.pop()
        found.append(op)
        stack.extend(parts(op))
    return found


@pytest.mark.parametrize("how", ["output", "reader"])
@pytest.mark.parametrize("case", [c for c in CASES if c.swallows], ids=lambda c: c.rule)
def test_no_fusion_swallows_a_value_read_elsewhere(models, case, how):
    g = qwen_graph(models[case.shape], case.rows)
    other = exposed(g, case.swallows) if how == "output" else probe(g, case.swallows)
    plan = plan_of(case, other, explain=True)
    assert not covering(plan, case.rule, index_of(g, case.member)), f"{case.rule} swallowed {case.swallows}"
    assert fired(plan, case.rule), "the other layer's fusion should still happen"
    # explain names who else reads it
    reasons = [u.reason for u in plan.unmatched if u.rule == case.rule]
    reader = "the graph's output" if how == "output" else f"probe.{case.swallows}"
    assert any(case.swallows in r and reader in r for r in reasons), reasons


@pytest.mark.parametrize("case", [c for c in CASES if c.rule in ("embed_norm", "add_norm")], ids=lambda c: c.rule)
def test_a_fusion_that_writes_its_intermediate_allows_other_readers(models, case):
    """EmbedNorm and AddNorm write the residual they take (later layers read it): more readers change nothing."""
    g = qwen_graph(models[case.shape], case.rows)
    for other in (exposed(g, case.member), probe(g, case.member)):
        assert covering(plan_of(case, other), case.rule, index_of(g, case.member))


@pytest.mark.parametrize("case", [c for c in CASES if c.between], ids=lambda c: c.rule)
def test_no_fusion_moves_an_op_across_a_conflict(models, case):
    model = models[case.shape]
    g = qwen_graph(model, case.rows)
    after, name, write = case.between  # type: ignore[misc]
    h = probe(g, name, after=after, write=write)
    plan = plan_of(case, h, explain=True)
    assert not covering(plan, case.rule, index_of(h, case.member)), f"{case.rule} moved an op across the probe"
    slot = index_of(h, after) + 1
    reasons = [u.reason for u in plan.unmatched if u.rule == case.rule]
    assert any(f"op {slot} " in r and name in r for r in reasons), reasons
    assert same_numbers(h, plan, lambda: CpuLane(model.cfg, model.file.tensors, ctx=CTX, dtype=F64)) <= 1e-12


# --- hand-built graphs: the shapes Qwen does not have --------------------------------------------------------


@dataclass(frozen=True)
class Weight:
    """A checkpoint tensor in f32, as the cpu lane reads one: shape, format and bytes."""

    shape: tuple[int, ...]
    format: Format
    data: np.ndarray


class Hand:
    """A small graph built op by op over random f32 weights, and a cpu lane to run it."""

    def __init__(self, rows: int = 3, seed: int = 0) -> None:
        self.g = TensorGraph(Form.PREFILL, rows, inputs=(IDS,), params=(POS,), outputs=(LOGITS,))
        self.g.add(Tensor(IDS, (rows,), Values("i32"), Role.INPUT))
        self.g.add(Tensor(POS, (), Values("i32"), Role.PARAM))
        self.weights: dict[str, Weight] = {}
        self.rng = np.random.default_rng(seed)

    def weight(self, name: str, *shape: int) -> str:
        values = (self.rng.standard_normal(shape) * (0.5 if len(shape) > 1 else 1)).astype(np.float32)
        self.weights[name] = Weight(shape, Format.F32, values.view(np.uint8).reshape(-1))
        return self.g.add(Tensor(name, shape, Values("f32"), Role.WEIGHT))

    def op(self, sym: PrimSpec, ins: tuple[str, ...], out: str, cols: int, rows: int | None = None) -> str:
        role = Role.OUTPUT if out == LOGITS else Role.ACTIVATION
        self.g.add(Tensor(out, (rows or self.g.rows, cols), Values("f32"), role))
        self.g.emit(sym, ins, out)
        return out

    def embed(self, cols: int) -> str:
        self.weight("table", 8, cols)
        return self.op(RowsGather(self.g.rows, cols), ("table", IDS), "x", cols)

    def lane(self) -> CpuLane:
        return CpuLane(None, self.weights, ctx=CTX, dtype=F64)  # type: ignore[arg-type]


def hand_norm_then_add() -> Hand:
    """A product's result normed and added back to it (not the embedding's: EmbedNorm would take the norm)."""
    h = Hand()
    x = h.op(Matmul(3, 16, 16), (h.embed(16), h.weight("wx", 16, 16)), "y", 16)
    h.op(RmsNorm(3, 16, 1e-6), (x,), "n", 16)
    h.op(Elementwise(ElementwiseOp.MUL, 3, 16, row=True), ("n", h.weight("w", 16)), "nw", 16)
    h.op(Elementwise(ElementwiseOp.ADD, 3, 16), ("nw", x), LOGITS, 16)
    return h


def hand_sampling() -> Hand:
    h = Hand()
    x = h.embed(16)
    h.op(Matmul(3, 10, 16), (x, h.weight("head", 10, 16)), "scores", 10)
    h.op(ArgMax(3, 10), ("scores",), LOGITS, 1)
    return h


def hand_strided() -> Hand:
    """The second quarter of every row, normed: the slice a lane reads in place."""
    h = Hand()
    x = h.embed(32)
    h.op(Slice(3, 32, 8, 8), (x,), "s", 8)
    h.op(RmsNorm(3, 8, 1e-6), ("s",), LOGITS, 8)
    return h


def hand_join(same: bool = False) -> Hand:
    """Two products joined head by head (2 heads: 3 + 5 values each)."""
    h = Hand()
    x = h.embed(16)
    h.op(Matmul(3, 6, 16), (x, h.weight("wa", 6, 16)), "a", 6)
    h.op(Matmul(3, 10, 16), (x, h.weight("wb", 10, 16)), "b", 10)
    if same:
        h.op(Join(3, 2, 6, 6), ("a", "a"), LOGITS, 12)
    else:
        h.op(Join(3, 2, 6, 10), ("a", "b"), LOGITS, 16)
    return h


def hand_join_row() -> Hand:
    """hand_join's two products joined, the join written as a cache's rows at the position; the cache read."""
    h = Hand()
    x = h.embed(16)
    h.op(Matmul(3, 6, 16), (x, h.weight("wa", 6, 16)), "a", 6)
    h.op(Matmul(3, 10, 16), (x, h.weight("wb", 10, 16)), "b", 10)
    h.op(Join(3, 2, 6, 10), ("a", "b"), "j", 16)
    h.g.add(Tensor("kc", (CTX, 16), Values("f32"), Role.CACHE))
    h.g.emit(SetRow(3, 16), ("j", POS), "kc", Dst("kc", row=RowAt(POS, 16)))
    h.op(RmsNorm(CTX, 16, 1e-6), ("kc",), LOGITS, 16, rows=CTX)
    return h


@dataclass(frozen=True)
class HandCase:
    rule: str
    build: Any
    member: str
    swallows: str
    between: tuple[str, str]  # (after which op's output, the tensor the op placed there overwrites)
    take_all: bool = False
    held: tuple[str, ...] = ()


HAND = [
    HandCase("norm_then_add", hand_norm_then_add, "nw", "nw", ("nw", "y")),
    HandCase("fused_sampling", hand_sampling, "scores", "scores", ("scores", "x"), take_all=True),
    HandCase("strided_read", hand_strided, "s", "s", ("s", "x")),
    HandCase("join_in_place", hand_join, "a", "a", ("b", "x"), take_all=True, held=("merged_projections",)),
    HandCase("join_row_write", hand_join_row, "j", "j", ("j", "x"), take_all=True, held=("merged_projections",)),
]


def hand_plan(case: HandCase, g: TensorGraph, *, explain: bool = False) -> Plan:
    return optimize(g, TakeAll() if case.take_all else CPU, held=case.held, explain=explain)


@pytest.mark.parametrize("case", HAND, ids=lambda c: c.rule)
def test_a_hand_built_pattern_fuses_exactly(case):
    h = case.build()
    plan = hand_plan(case, h.g)
    events = covering(plan, case.rule, index_of(h.g, case.member))
    assert len(events) == 1 and events[0].cls in BUILDS[case.rule]
    assert same_numbers(h.g, plan, h.lane) == 0.0


@pytest.mark.parametrize("case", HAND, ids=lambda c: c.rule)
def test_a_hand_built_pattern_keeps_a_shared_value(case):
    h = case.build()
    for other in (exposed(h.g, case.swallows), probe(h.g, case.swallows)):
        plan = hand_plan(case, other, explain=True)
        assert not fired(plan, case.rule)
        assert any(case.swallows in u.reason for u in plan.unmatched if u.rule == case.rule), plan.unmatched


@pytest.mark.parametrize("case", HAND, ids=lambda c: c.rule)
def test_a_hand_built_pattern_does_not_cross_a_conflict(case):
    h = case.build()
    after, name = case.between
    other = probe(h.g, name, after=after, write=True)
    plan = hand_plan(case, other, explain=True)
    assert not fired(plan, case.rule)
    assert any("between them" in u.reason for u in plan.unmatched if u.rule == case.rule), plan.unmatched
    assert same_numbers(other, plan, h.lane) == 0.0


def test_a_strided_read_reads_the_slice_in_place():
    """The fused op's own inputs (the slice's source, read strided) give the consumer the slice's values."""
    h = hand_strided()
    (op,) = [op for op in hand_plan(HAND[2], h.g).ops if class_of(op) is ClassId.STRIDED_READ]
    x = np.random.default_rng(1).standard_normal((3, 32))
    (access,) = op.access
    assert isinstance(access, Strided)
    in_place = x.reshape(-1, access.pitch)[:, access.offset : access.offset + access.width]
    consumer = parts(op)[-1]
    sliced = kernels.slice_units(parts(op)[0].sym, [x], 0)  # type: ignore[arg-type]
    assert np.array_equal(kernels.rms_norm(consumer.sym, [in_place], 0), kernels.rms_norm(consumer.sym, [sliced], 0))


def test_a_join_in_place_lands_each_product_in_its_unit_part():
    """The fused op's destination (the first product's part of every unit; the second's follows it) holds
    what the join would have written."""
    h = hand_join()
    (op,) = [op for op in hand_plan(HAND[3], h.g).ops if class_of(op) is ClassId.JOIN_IN_PLACE]
    unit = op.dst.unit
    assert unit is not None and op.dst.buf == LOGITS
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((3, 6)), rng.standard_normal((3, 10))
    out = np.zeros((3, 16))
    out.reshape(-1, unit.pitch)[:, unit.offset : unit.offset + unit.width] = a.reshape(-1, unit.width)
    rest = unit.pitch - unit.width
    out.reshape(-1, unit.pitch)[:, unit.offset + unit.width :] = b.reshape(-1, rest)
    assert np.array_equal(out, kernels.join(parts(op)[-1].sym, [a, b], 0))  # type: ignore[arg-type]


def test_a_join_of_one_value_with_itself_is_not_taken_in_place():
    """join(a, a): one product cannot write both unit parts, and its op must not be covered twice."""
    h = hand_join(same=True)
    plan = hand_plan(HAND[3], h.g)
    assert not fired(plan, "join_in_place")
    assert sorted(c for op in plan.ops for c in op.covers) == list(range(len(h.g.ops)))


def test_a_join_takes_the_writer_it_reads_not_a_later_one():
    """A value written again after the join is not the join's input: its later writer is no producer of it."""
    h = hand_join()
    h.op(Matmul(3, 6, 16), ("x", "wa"), "a", 6)  # writes `a` again after the join, read by nobody
    plan = hand_plan(HAND[3], h.g)
    (event,) = fired(plan, "join_in_place")
    assert event.covers == (1, 2, 3)


def test_a_reader_before_the_producer_reads_an_older_value():
    """`y` is written twice; the bias add reads the first value, so the second product is not its product."""
    h = Hand()
    x = h.embed(16)
    h.op(Elementwise(ElementwiseOp.ADD, 3, 16), (x, x), "y", 16)
    h.op(Elementwise(ElementwiseOp.ADD, 3, 16, row=True), ("y", h.weight("b", 16)), LOGITS, 16)
    h.op(Matmul(3, 16, 16), (x, h.weight("w", 16, 16)), "y", 16)  # rewrites y after its last reader
    plan = optimize(h.g, CPU)
    assert not fired(plan, "gemm_bias")
    assert same_numbers(h.g, plan, h.lane) == 0.0


def test_a_glu_of_one_value_has_no_gate_and_up_pair():
    """silu(y) * y is a GLU of one value: the gate/up rules must let it be (they took it apart as a pair)."""
    h = Hand()
    y = h.op(Matmul(3, 16, 16), (h.embed(16), h.weight("wy", 16, 16)), "y", 16)
    h.op(Unary(UnaryOp.SILU, 3, 16), (y,), "s", 16)
    h.op(Elementwise(ElementwiseOp.MUL, 3, 16), ("s", y), LOGITS, 16)
    for held in ((), ("gate_up_glu",)):
        plan = optimize(h.g, TakeAll(), held=held)
        assert fired(plan, "glu_act_mul") and not fired(plan, "gate_up_glu") and not fired(plan, "merged_gate_up")
        assert same_numbers(h.g, plan, h.lane) == 0.0


# --- the table is data -------------------------------------------------------------------------------------


def test_rule_names_are_unique():
    names = [r.name for r in SHARED_RULES]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", n) for n in names)


def test_every_rule_builds_classes_that_exist():
    for rule in SHARED_RULES:
        assert rule.builds and all(isinstance(c, ClassId) and ClassId(c.value) is c for c in rule.builds), rule.name


def test_every_rule_says_what_it_rewrites_in_a_comment():
    """`# before -> after` on the rule's line (or, where its entry spans lines, the line above it)."""
    found: dict[str, str] = {}
    for module in (rules, quant_rules, moe_rules, gdn_rules, routing_rules, parallel_rules):
        lines = inspect.getsource(module).splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("Rule", "_rule") and node.args:
                name = node.args[0]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    own = [line.partition("#")[2] for line in lines[node.lineno - 1 : node.end_lineno]]
                    above = lines[node.lineno - 2].strip()
                    found[name.value] = " ".join(c for c in own if c) or (above[1:] if above.startswith("#") else "")
    for rule in SHARED_RULES:
        assert re.search(r"\S.*->\s*\S", found.get(rule.name, "")), f"{rule.name} has no '# before -> after' comment"


# --- the quantizing epilogues ------------------------------------------------------------------------------


def test_a_norm_feeding_only_products_writes_int8(models):
    """Under int8 activations a NormWeight whose every reader is a product writes its result quantized; one
    that feeds a rotation (qwen3's q/k norms, held apart from their rope here) does not."""
    g = qwen_graph(models["tiny-qwen3"], 1)
    plan = optimize(g, Int8Lane(), held=("add_norm", "embed_norm", "qk_norm_rope"))
    quantized = {e.covers for e in fired(plan, "norm_quant")}
    assert quantized, "norm_quant did not fire"
    for op in plan.ops:
        if class_of(op) is ClassId.NORM_QUANT:
            assert op.covers in quantized and class_of(parts(op)[0]) is ClassId.NORM_WEIGHT
            assert plan.graph.tensors[op.out].storage == QuantizedActs(QuantFormat.ONE_WORD)
            assert g.tensors[op.out].storage == Values("f32"), "the recognizer's graph must not change"
            assert all(gemv(r, plan.graph) is not None for r in plan.ops if op.out in r.ins)
    for name in ("l0.attn_in", "l0.ffn_in", "out_in"):
        assert plan.graph.tensors[name].storage == QuantizedActs(QuantFormat.ONE_WORD), name
    for name in ("l0.q_normed", "l0.k_normed"):
        assert plan.graph.tensors[name].storage == Values("f32"), name


def test_without_fuse_quant_the_norm_quantizes_apart(models):
    g = qwen_graph(models["tiny-qwen3"], 1)
    plan = optimize(g, Int8Lane(fuse_quant=False), held=("add_norm", "embed_norm"))
    assert not fired(plan, "norm_quant")
    missed = [e for e in plan.missed if e.rule == "norm_quant"]
    assert missed and all(isinstance(e, Missed) and e.kind == "decompose" for e in missed)
    assert all(e.cls is ClassId.NORM_QUANT for e in missed)
    assert plan.graph.tensors["l0.attn_in"].storage == Values("f32")


# --- explain -----------------------------------------------------------------------------------------------


def test_explain_names_the_other_reader(models):
    g = qwen_graph(models["tiny-qwen2"], 1)
    h = probe(g, "l0.ffn_in.normed")
    plan = optimize(h, CPU, explain=True)
    (u,) = [u for u in plan.unmatched if u.rule == "norm_weight"]
    rule, covers, reason = u
    assert covers == (index_of(h, "l0.ffn_in.normed"),)
    assert reason == f"l0.ffn_in.normed is also read by op {len(h.ops) - 1} (probe.l0.ffn_in.normed)"


def test_explain_costs_nothing_when_off(models):
    """Off, no reason is built (the callable is never called) and the plan has no unmatched entries."""
    g = probe(qwen_graph(models["tiny-qwen2"], 1), "l0.ffn_in.normed")
    assert optimize(g, CPU).unmatched == []
    r = Rewriter(g, Schedule(g.ops), CPU)
    r.no_match("norm_weight", 0, lambda: pytest.fail("a reason was built with explain off"))
    assert r.unmatched == []


def test_explain_does_not_change_the_plan(models):
    g = probe(qwen_graph(models["tiny-qwen3"], 4), "l0.gate")
    quiet, told = optimize(g, TakeAll()), optimize(g, TakeAll(), explain=True)
    assert quiet.ops == told.ops and quiet.fired == told.fired and quiet.missed == told.missed


def test_every_rule_tested_here_is_in_the_table():
    tested: Sequence[str] = [c.rule for c in CASES] + [c.rule for c in HAND] + ["norm_quant"]
    assert set(tested) <= set(ALL)
