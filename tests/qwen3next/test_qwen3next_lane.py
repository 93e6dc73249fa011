"""The cpu lane on a Qwen3-Next file (the synthetic tiny shape, Q8_0): fusion changes no number (f64, every
rule held against none, and each gated delta-rule rule held alone), a prefill chunk equals the same tokens
fed one decode step at a time, and the recurrent state belongs to the sequence: a new session starts from
zero, a session that rewinds starts its state again, and the lane refuses to continue a state elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

from fuselane.fuse.gdn_rules import GATED_ATTENTION_RULES, GDN_RULES
from fuselane.gguf.synth import write_synthetic
from fuselane.lanes.cpu.gdn_kernels import CHUNK
from tests.fuse.test_fusion_exact import RTOL, RULES, check_local, feed, opened, relative

OUR_RULES = [r.name for r in GDN_RULES + GATED_ATTENTION_RULES]
SCHEDULE = (CHUNK + 3, 1, 5, 1)  # a chunk past the rule's chunk, steps, a short chunk
CTX = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_synthetic(tmp_path_factory.mktemp("q3n_lane") / "tiny.gguf", "tiny-qwen3next", "q8_0", seed=5))


def test_every_rule_held_changes_nothing(tiny):
    with opened(tiny, ctx=CTX) as fused, opened(tiny, held=RULES, ctx=CTX) as plain:
        fired = {f.rule for f in fused.lane.plan(1).fired} | {f.rule for f in fused.lane.plan(7).fired}
        # the cpu lane runs every class of ours but the gate projections (a product merge) fused; a step of
        # Qwen3-Next has one convolution a layer, each fed by the one before: nothing for conv_parts to take
        assert fired >= set(OUR_RULES) - {"gdn_gate_projections", "conv_parts"}
        assert plain.lane.plan(7).fired == []
        for all_logits in (False, True):
            got = feed(fused, SCHEDULE, all_logits=all_logits)
            assert relative(got, feed(plain, SCHEDULE, all_logits=all_logits)) <= RTOL


@pytest.mark.parametrize("rule", OUR_RULES)
def test_each_rule_held_alone(tiny, rule):
    chunks = (5, 1, 3)
    with opened(tiny, ctx=CTX) as fused, opened(tiny, held=[rule], ctx=CTX) as partial:
        for rows in sorted(set(chunks)):
            check_local(rule, fused.lane.plan(rows), partial.lane.plan(rows))
        assert relative(feed(partial, chunks, seed=1), feed(fused, chunks, seed=1)) <= RTOL


def test_a_chunk_equals_its_tokens_one_step_at_a_time(tiny):
    with opened(tiny, ctx=CTX) as model:
        ids = np.random.default_rng(2).integers(0, model.cfg.vocab, CHUNK + 9)
        whole = model.lane.forward(ids, 0, all_logits=True)
        steps = [model.lane.forward(ids[i : i + 1], i) for i in range(len(ids))]
        assert relative([np.concatenate(steps)], [whole]) <= 1e-10  # chunked rule against the recurrence, f64


def test_the_state_is_the_sessions(tiny):
    with opened(tiny, ctx=CTX) as model:
        rng = np.random.default_rng(3)
        a, b = (list(rng.integers(0, model.cfg.vocab, 20)) for _ in range(2))
        fresh_b = model.lane.sibling().forward(np.array(b), 0)[-1]
        first = model.session()
        first.feed(a)
        second = model.session()  # a new sequence on the same lane: its state starts from zero
        assert relative([second.feed(b)], [fresh_b]) <= RTOL
        # a session that diverges from what it fed starts again rather than rewinding a state it cannot
        diverged = b[:10] + a[:10]
        want = model.lane.sibling().forward(np.array(diverged), 0)[-1]
        assert relative([second.feed(diverged)], [want]) <= RTOL
        with pytest.raises(ValueError, match="recurrent state"):
            model.lane.forward(np.array(a[:3]), 5)
