"""deepseek2's forms agree in f64: the absorbed latent attention the cpu lane runs equals the expanded form
(`tests/reference/latent_expanded.py`: each head's keys and values expanded from the latent, as Hugging Face
runs it) on the same weights; fusion
changes nothing (every rule held against none, decode steps and chunks); and grouped top-k picks what a brute
force over every choice of groups picks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fuselane.gguf.synth import write_synthetic, write_weights
from fuselane.graph.ops import GroupedTopK
from fuselane.lanes.cpu.latent_kernels import grouped_top_k
from tests.fuse.test_fusion_exact import RTOL, RULES, SCHEDULES, feed, opened, relative

TINY = ("tiny-deepseek2", "tiny-deepseek3")
PROMPT = [5, 17, 101, 42, 42, 300, 7, 250, 3, 11, 64]
F64_TOL = 1e-12  # both in f64: what is left is summation order over the absorbed and the expanded products


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("latent_exact")
    return {name: str(write_synthetic(d / f"{name}.gguf", name, "q8_0", seed=7)) for name in TINY}


@pytest.mark.parametrize("version", [2, 3])
def test_absorbed_equals_expanded_in_f64(tmp_path, version):
    pytest.importorskip("transformers")
    from tests.reference.hf_deepseek import latent_shape, latent_weights, tiny_deepseek
    from tests.reference.latent_expanded import expanded_logits

    hf = tiny_deepseek(version, q_lora=version == 3)
    weights = latent_weights(hf)
    path = write_weights(tmp_path / "m.gguf", latent_shape(hf, version), weights)
    with opened(str(path)) as model:
        absorbed = model.logits(PROMPT)
        expanded = expanded_logits(model.cfg, weights, PROMPT)
    assert np.max(np.abs(absorbed - expanded)) / np.max(np.abs(expanded)) <= F64_TOL


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("shape", TINY)
def test_every_rule_held_changes_nothing(tiny, shape, schedule):
    chunks = SCHEDULES[schedule]
    with opened(tiny[shape]) as fused, opened(tiny[shape], held=RULES) as plain:
        for rows in sorted(set(chunks)):
            assert plain.lane.plan(rows).fired == []
            assert {f.rule for f in fused.lane.plan(rows).fired} >= {"norm_weight", "moe_down_combine"}
        for all_logits in (False, True):
            got, want = feed(fused, chunks, all_logits=all_logits), feed(plain, chunks, all_logits=all_logits)
            assert relative(got, want) <= RTOL


def brute_grouped(choice: np.ndarray, groups: int, used: int, k: int) -> list[int]:
    """The k best experts of the `used` best groups (a group scoring the sum of its best two), by trying
    every set of groups and keeping the best-scoring one: an independent reading of the rule."""
    runs = choice.reshape(groups, -1)
    score = np.sort(runs, axis=-1)[:, -2:].sum(axis=-1)
    best = max(itertools.combinations(range(groups), used), key=lambda gs: (sum(score[list(gs)]), [-g for g in gs]))
    allowed = [e for g in best for e in range(g * runs.shape[1], (g + 1) * runs.shape[1])]
    return sorted(allowed, key=lambda e: (-choice[e], e))[:k]


def test_grouped_top_k_keeps_the_best_groups_experts():
    rng = np.random.default_rng(3)
    spec = GroupedTopK(rows=64, experts=16, k=3, groups=4, used=2)
    choice = rng.standard_normal((spec.rows, spec.experts))
    got = grouped_top_k(spec, [choice], 0)
    for row, ids in zip(choice, got, strict=True):
        assert list(ids) == brute_grouped(row, spec.groups, spec.used, spec.k)
    plain = np.argsort(-choice, axis=-1, kind="stable")[:, : spec.k]
    assert (got != plain).any()  # the groups do change some rows' experts: the check is not vacuous


def test_a_batch_step_equals_each_sequence_alone(tiny):
    from fuselane.lanes.cpu.lane import CpuLane

    seqs = [[1, 2, 3], [7, 8, 9], [4, 5, 6]]
    with opened(tiny["tiny-deepseek3"]) as model:
        lane = model.lane
        alone = [CpuLane(lane.cfg, lane.tensors, ctx=lane.ctx, dtype=lane.dtype).forward(np.array(s), 0)[-1]
                 for s in seqs]  # fmt: skip
        batch = CpuLane(lane.cfg, lane.tensors, ctx=lane.ctx, dtype=lane.dtype)
        for p in range(3):  # every sequence's latent rows land in its own block of the cache
            out = batch.forward_batch(np.array([s[p] for s in seqs]), np.array([p] * len(seqs)))
    assert relative(list(out), alone) <= RTOL
