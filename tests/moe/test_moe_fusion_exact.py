"""Fusion changes nothing on a mixture: the cpu lane's logits in f64 with every rule held equal its logits with
none held, for qwen2moe and qwen3moe, decode steps and prefill chunks of several sizes; holding one mixture
rule alone changes the plan only in that rule's fusions (and those built on them) and not the logits."""

from __future__ import annotations

import pytest

from fuselane.fuse.moe_rules import MOE_RULES
from fuselane.gguf.synth import write_synthetic
from tests.fuse.test_fusion_exact import RTOL, RULES, SCHEDULES, check_local, feed, opened, relative

TINY = ("tiny-qwen2moe", "tiny-qwen3moe")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("moe_exact")
    return {name: str(write_synthetic(d / f"{name}.gguf", name, "q4_k_m", seed=7)) for name in TINY}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("shape", TINY)
def test_every_rule_held_changes_nothing(tiny, shape, schedule):
    chunks = SCHEDULES[schedule]
    with opened(tiny[shape]) as fused, opened(tiny[shape], held=RULES) as plain:
        for rows in sorted(set(chunks)):
            assert plain.lane.plan(rows).fired == []
            assert {f.rule for f in fused.lane.plan(rows).fired} >= {"router_topk", "moe_down_combine"}
        for all_logits in (False, True):
            got, want = feed(fused, chunks, all_logits=all_logits), feed(plain, chunks, all_logits=all_logits)
            assert relative(got, want) <= RTOL


@pytest.mark.parametrize("rule", [r.name for r in MOE_RULES])
@pytest.mark.parametrize("shape", TINY)
def test_each_mixture_rule_held_alone(tiny, shape, rule):
    chunks = (5, 1, 3, 1)
    with opened(tiny[shape]) as fused, opened(tiny[shape], held=[rule]) as partial:
        for rows in sorted(set(chunks)):
            check_local(rule, fused.lane.plan(rows), partial.lane.plan(rows))
        assert relative(feed(partial, chunks, seed=1), feed(fused, chunks, seed=1)) <= RTOL
