"""Where each class stands (`graph.classes.STANDING`), held to the rule table and to the plans it builds.

The record says, for every class, the rules that build it or what it waits for. It must agree with the rule
table both ways (a rule's class names that rule; a rule the record names exists and builds that class), and
with what the optimizer does on the tiny synthetic models in every form, on the cpu lane and on the cuda lane
under its activation and epilogue knobs: every fusion that fires is one the record names, every builder the
record names matches there (but those whose shape the dense graphs lack), and a class the record says no
rule builds never appears in a plan.
"""

from __future__ import annotations

import itertools

import pytest

from fuselane.explain import FORMS, build_plan, make_shim
from fuselane.fuse.optimizer import Plan, table_for
from fuselane.fuse.views import class_of
from fuselane.graph.classes import STANDING, Awaits, ClassId, Standing, built_by

MODELS = ("synth:tiny-qwen2", "synth:tiny-qwen3", "synth:tiny-qwen3:q4_k_m")
# Each lane at its defaults, and the cuda lane under the knobs that change which rules fire.
LANES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cpu", ()),
    ("cpu", ("dtype=f64",)),
    ("cuda", ()),
    ("cuda", ("activations=dequant",)),
    ("cuda", ("activations=int8x2",)),
    ("cuda", ("fuse_quant=false",)),
)

# Rules whose shape the dense tiny graphs lack, so the sweep cannot show them matching (tests/fuse/test_rules.py
# builds the first four's shapes by hand).
NOT_IN_DENSE_GRAPHS = {
    "norm_then_add": "a dense layer adds a product's output to the residual, never a norm's",
    "strided_read": "the dense graphs slice nothing",
    "join_in_place": "the dense graphs join nothing",
    "join_row_write": "the dense graphs join nothing (tests/deepseek2/test_latent_plan.py)",
    "mla_prologue": "the dense graphs hold no latent attention (tests/deepseek2/test_latent_plan.py)",
    "fused_sampling": "the plans end in the logits; the next token is picked after the graph",
    "elementwise_quant": "no product reads an elementwise result that add_norm has not taken",
    "gemv_quant": "no product reads another product's output",
    "row_write_quant": "attention reads the cache rows as the cache keeps them, not quantized",
    # a decode step's down projection keeps its add and norm in its epilogue unless its rows are more than twice
    # the width (not the tiny models'), and a chunk's products read f32 rows, so nothing asks for the int8 form
    "add_norm_quant": "the tiny models' add + norm whose result a product reads int8 is a projection's epilogue",
    "latent_expanded": "the dense graphs hold no latent attention (tests/deepseek2/test_latent_plan.py)",
    "grouped_topk": "the dense graphs route to no experts (tests/deepseek2/test_latent_plan.py)",
    "allreduce_norm": "one rank's graph of a split model holds the all-reduces (tests/parallel/test_ranks.py)",
}
# The mixture rules' shape is only in the mixtures' graphs, which the cuda lane refuses (it has no mixture
# kernels yet); tests/moe/test_moe_classes.py holds them to the record on the cpu lane.
MIXTURE_RULES = (
    *("router_topk", "moe_token_sort", "moe_gate_up_act", "moe_down_combine", "shared_expert_fusion"),
    "moe_deferred_finalize",
)
NOT_IN_DENSE_GRAPHS |= dict.fromkeys(MIXTURE_RULES, "the dense graphs route to no experts")
NOT_IN_DENSE_GRAPHS["route_in_norm"] = "the dense graphs route to no experts (tests/moe/test_moe_cuda_plan.py)"
# Likewise the gated delta rule's and the gated attention's (tests/qwen3next/test_qwen3next_rules.py).
HYBRID_RULES = (
    *("conv_silu", "conv_silu_l2norm", "conv_parts", "gdn_gating", "gdn_gate_projections", "gdn_step"),
    *("gates_in_step", "gated_norm"),
    *("attn_output_gate", "gdn_output_quant", "norm_in_step"),
)
NOT_IN_DENSE_GRAPHS |= dict.fromkeys(HYBRID_RULES, "the dense graphs have no gated delta-rule or gated attention")


def tables():
    """Every lane's rule table: the shared rules with that lane's own linked in."""
    return {lane: table_for(make_shim(lane, (), (), "decode")) for lane in ("cpu", "cuda")}


@pytest.fixture(scope="module")
def plans() -> dict[tuple[str, str, str, tuple[str, ...]], Plan]:
    return {
        (model, form, lane, knobs): build_plan(model, lane=lane, form=form, knobs=knobs)[2]
        for model, form, (lane, knobs) in itertools.product(MODELS, FORMS, LANES)
    }


def test_every_class_has_one_standing_in_the_class_order() -> None:
    assert list(STANDING) == list(ClassId)
    for cls, standing in STANDING.items():
        assert bool(standing.built_by) != (standing.awaits is not None), cls


def test_a_standing_is_built_or_awaiting_never_both() -> None:
    with pytest.raises(ValueError):
        Standing()
    with pytest.raises(ValueError):
        Standing(built_by=("norm_weight",), awaits=Awaits.SEVERAL_GPUS)


def test_every_rule_of_every_lane_is_named_by_the_classes_it_builds() -> None:
    for lane, table in tables().items():
        for rule in table:
            for cls in rule.builds:
                assert rule.name in built_by(cls), f"{lane} rule {rule.name} builds {cls.value}; STANDING omits it"


def test_every_rule_the_record_names_exists_and_builds_that_class() -> None:
    builds: dict[str, set[ClassId]] = {}
    for table in tables().values():
        for rule in table:
            builds.setdefault(rule.name, set()).update(rule.builds)
    for cls, standing in STANDING.items():
        for name in standing.built_by:
            assert name in builds, f"{cls.value} names {name}, which no lane's table has"
            made = sorted(c.value for c in builds[name])
            assert cls in builds[name], f"{cls.value} names {name}, which builds {made}"


def test_what_fires_on_the_tiny_models_is_what_the_record_says(plans) -> None:
    fired = set()
    for key, plan in plans.items():
        for f in plan.fired:
            assert f.rule in built_by(f.cls), f"{key}: {f.rule} built {f.cls.value}, which STANDING does not say"
            fired.add(f.cls)
    # the sweep is not empty: the dense models' norms, rotations, attention and GLUs fuse on both lanes
    assert {ClassId.NORM_WEIGHT, ClassId.FLASH_DECODE, ClassId.FLASH_PREFILL, ClassId.MERGED_QKV} <= fired


def test_every_builder_the_record_names_matches_on_the_tiny_models(plans) -> None:
    # fired, or matched and declined by the lane: either way the rule built (or tried to build) that class
    matched = {(e.rule, e.cls) for plan in plans.values() for e in [*plan.fired, *plan.missed]}
    for cls, standing in STANDING.items():
        for rule in standing.built_by:
            assert (rule, cls) in matched or rule in NOT_IN_DENSE_GRAPHS, f"{rule} never builds {cls.value}"


def test_no_class_without_a_rule_is_in_any_plan(plans) -> None:
    for key, plan in plans.items():
        for op in plan.ops:
            cls = class_of(op)
            assert cls is None or built_by(cls), f"{key}: {cls} is in the plan, but STANDING says no rule builds it"
