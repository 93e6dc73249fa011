"""The mixture rules, tested as tests/fuse/test_rules.py tests the dense ones: each fires on a tiny mixture's
graph and changes no number (the cpu lane in f64), does not fire when an intermediate it would swallow has
another reader (a graph output, or one more op) and explain names it, and does not move a member across an op
that conflicts with it. Also: the table is in order (a mixture's rules after the GLU and add + norm rules
they build on, before the products'), and each MoE class's ops are what its rule says."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest

from fuselane.fuse.optimizer import optimize
from fuselane.fuse.rules import SHARED_RULES
from fuselane.fuse.views import class_of, leaves, moe
from fuselane.gguf.synth import SHAPES, write_synthetic
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Form
from fuselane.graph.ops import ExpertMatmul, Matmul, Moe, RouteWeights, RowScale, TopK
from fuselane.lanes.cpu.lane import CpuLane
from fuselane.lanes.cpu.shim import CpuShim
from fuselane.models import recognizer
from fuselane.runtime.model import load
from tests.fuse.test_rules import covering, exposed, fired, index_of, probe, same_numbers

F64 = np.dtype(np.float64)
CPU = CpuShim(F64)
CTX = 24  # tests/fuse/test_rules.py's cache, which its graph helpers build with


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_rules")
    out = {}
    # tiny-deepseek2's first layer is dense: a third layer gives it two mixtures, as the Qwen ones have
    shapes = {"tiny-qwen2moe": "tiny-qwen2moe", "tiny-qwen3moe": "tiny-qwen3moe",
              "tiny-deepseek2": replace(SHAPES["tiny-deepseek2"], n_layers=3)}  # fmt: skip
    for name, shape in shapes.items():
        out[name] = load(write_synthetic(d / f"{name}.gguf", shape, "q8_0", seed=5), lane="cpu", ctx=CTX, dtype=F64)
    yield out
    for model in out.values():
        model.close()


@dataclass(frozen=True)
class Case:
    """A mixture rule: an original op it takes (by output), the intermediate it swallows (None: it writes what
    it takes), and (after which op, the tensor an op there overwrites) to make a member's move illegal."""

    rule: str
    shape: str
    member: str
    swallows: str | None
    between: tuple[str, str] | None
    rows: int = 1
    name: str = ""  # where one rule has two cases, the second's test id is its rule's name and this

    @property
    def id(self) -> str:
        return f"{self.rule}-{self.name}" if self.name else self.rule


CASES = [
    Case("router_topk", "tiny-qwen3moe", "l0.router", "l0.router", ("l0.router", "l0.ffn_in")),
    Case("moe_token_sort", "tiny-qwen3moe", "l0.expert_order", None, None, rows=5),
    Case("moe_gate_up_act", "tiny-qwen2moe", "l0.exp_gate", "l0.exp_gate", ("l0.exp_up", "l0.ffn_in"), rows=3),
    Case("moe_down_combine", "tiny-qwen3moe", "l0.exp_down", "l0.exp_down", ("l0.exp_down", "l0.exp_glu")),
    Case("shared_expert_fusion", "tiny-qwen2moe", "l0.sh_scaled", "l0.sh_scaled", ("l0.sh_scaled", "l0.ffn_in")),
    # an ungated shared expert (DeepSeek's): its down product is what the mixture adds
    Case(
        "shared_expert_fusion",
        "tiny-deepseek2",
        "l1.sh_down",
        "l1.sh_down",
        ("l1.sh_down", "l1.ffn_in"),
        name="ungated",
    ),
    Case("moe_deferred_finalize", "tiny-qwen3moe", "l0.ffn_out", "l0.ffn_out", ("l0.ffn_out", "l0.route")),
]


def graph_of(model, rows: int):
    """The model's graph by its architecture's recognizer (`qwen_graph` knows the Qwen families only)."""
    form = Form.DECODE if rows == 1 else Form.PREFILL
    return recognizer(model.cfg).recognize(model.cfg, model.file.tensors, form, rows=rows, ctx=CTX)


def lane_of(model):
    return lambda: CpuLane(model.cfg, model.file.tensors, ctx=CTX, dtype=F64)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_rule_fires_and_changes_no_number(models, case):
    model = models[case.shape]
    g = graph_of(model, case.rows)
    plan = optimize(g, CPU)
    events = covering(plan, case.rule, index_of(g, case.member))
    assert len(events) == 1, f"{case.rule} did not fire on {case.member}"
    assert same_numbers(g, plan, lane_of(model)) <= 1e-12


@pytest.mark.parametrize("how", ["output", "reader"])
@pytest.mark.parametrize("case", [c for c in CASES if c.swallows], ids=lambda c: c.id)
def test_no_fusion_swallows_a_value_read_elsewhere(models, case, how):
    g = graph_of(models[case.shape], case.rows)
    other = exposed(g, case.swallows) if how == "output" else probe(g, case.swallows)
    plan = optimize(other, CPU, explain=True)
    assert not covering(plan, case.rule, index_of(g, case.member)), f"{case.rule} swallowed {case.swallows}"
    assert fired(plan, case.rule), "the other layer's fusion should still happen"
    reasons = [u.reason for u in plan.unmatched if u.rule == case.rule]
    reader = "the graph's output" if how == "output" else f"probe.{case.swallows}"
    assert any(case.swallows in r and reader in r for r in reasons), reasons


def test_the_sort_keeps_the_experts_it_orders_for_their_other_readers(models):
    """MoeTokenSort writes the kept experts (the expert products read them): it fires with them read."""
    g = graph_of(models["tiny-qwen3moe"], 5)
    ids = index_of(g, "l0.experts")
    assert covering(optimize(g, CPU), "moe_token_sort", ids)
    assert covering(optimize(exposed(g, "l0.experts"), CPU), "moe_token_sort", ids)


@pytest.mark.parametrize("case", [c for c in CASES if c.between], ids=lambda c: c.id)
def test_no_fusion_moves_an_op_across_a_conflict(models, case):
    model = models[case.shape]
    g = graph_of(model, case.rows)
    after, name = case.between  # type: ignore[misc]
    h = probe(g, name, after=after, write=True)
    plan = optimize(h, CPU, explain=True)
    assert not covering(plan, case.rule, index_of(h, case.member)), f"{case.rule} moved an op across the probe"
    slot = index_of(h, after) + 1
    reasons = [u.reason for u in plan.unmatched if u.rule == case.rule]
    assert any(f"op {slot} " in r and name in r for r in reasons), reasons
    assert same_numbers(h, plan, lane_of(model)) <= 1e-12


def test_the_mixture_rules_sit_between_what_they_build_on_and_the_products():
    names = [r.name for r in SHARED_RULES]
    for rule in ("router_topk", "moe_gate_up_act", "moe_deferred_finalize"):
        assert names.index("glu_act_mul") < names.index(rule) < names.index("merged_projections")
        assert names.index("add_norm") < names.index(rule)
    assert names.index("shared_expert_fusion") < names.index("moe_deferred_finalize")


def _one(plan, cls):
    found = [op for op in plan.ops if class_of(op) is cls or any(class_of(p) is cls for p in _inner(op))]
    assert found, f"no {cls.value} in the plan"
    return next(p for op in found for p in (op, *_inner(op)) if class_of(p) is cls)


def _inner(op):
    from fuselane.fuse.views import parts

    stack, out = list(parts(op)), []
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(parts(p))
    return out


def test_each_class_holds_the_primitives_its_rule_says(models):
    g = graph_of(models["tiny-qwen2moe"], 1)
    plan = optimize(g, CPU)
    kinds = lambda op: [type(x.sym) for x in leaves(op)]  # noqa: E731
    assert kinds(_one(plan, C.ROUTER_TOPK)) == [Matmul, TopK, RouteWeights]
    assert kinds(_one(plan, C.MOE_DOWN_COMBINE)) == [ExpertMatmul, Moe]
    gate_up = kinds(_one(plan, C.MOE_GATE_UP_ACT))
    assert gate_up[:2] == [ExpertMatmul, ExpertMatmul] and len(gate_up) == 4
    shared = _one(plan, C.SHARED_EXPERT_FUSION)
    assert class_of(shared.sym.parts[0]) is C.MOE_DOWN_COMBINE and RowScale in kinds(shared)
    final = _one(plan, C.MOE_DEFERRED_FINALIZE)
    assert class_of(final.sym.parts[0]) is C.SHARED_EXPERT_FUSION and class_of(final.sym.parts[1]) is C.ADD_NORM
    m = moe(final)
    assert m is not None and (m.rows, m.d, m.k) == (1, 64, 2)


def test_an_ungated_shared_expert_folds_without_a_gate(models):
    """DeepSeek's shared experts add to the mixture unscaled: the fold holds their SwiGLU and down product, and
    no sigmoid or RowScale (the graph has none)."""
    from fuselane.graph.ops import Unary, UnaryOp

    g = graph_of(models["tiny-deepseek2"], 1)
    shared = _one(optimize(g, CPU), C.SHARED_EXPERT_FUSION)
    found = leaves(shared)
    assert RowScale not in {type(x.sym) for x in found}
    assert not any(isinstance(x.sym, Unary) and x.sym.op is UnaryOp.SIGMOID for x in found)
    assert {x.out for x in found} >= {"l1.sh_glu", "l1.sh_down", "l1.ffn_out"}
