"""Fusion changes nothing: the cpu lane's numbers with every rule held equal its numbers with none held.

The cpu lane's contract says a fused op computes its parts' numbers (`fused` is exact): it runs its parts'
kernels in their order. So on the cpu lane in f64 a model's logits with every rule of the table held must equal
its logits with none held (to 1e-12 relative: in practice bit for bit), for qwen2 and qwen3, decode steps and
prefill chunks of several sizes, at tiny shapes and at one real shape. Holding one rule alone must change the
plan only in that rule's fusions (and the fusions that build on or compete with them) and not the logits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import pytest

from fuselane.fuse.optimizer import Plan, rule_names
from fuselane.gguf.synth import write_synthetic
from fuselane.lanes.cpu.shim import CpuShim
from fuselane.runtime.model import Model, load

RTOL = 1e-12  # the cpu contract's fused bound is exact; this leaves room only for f64 summation order
F64 = np.dtype(np.float64)
RULES = rule_names(CpuShim(F64))
TINY = ("tiny-qwen2", "tiny-qwen3")
CTX = 32
# How a sequence is fed: decode steps, or prefill chunks of several sizes with decode steps between.
SCHEDULES = {
    "decode": (1, 1, 1, 1, 1, 1),
    "prefill": (7, 1, 3, 5, 1),
    "chunks": (2, 4, 8, 1, 6),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("exact")
    return {name: str(write_synthetic(d / f"{name}.gguf", name, "q8_0", seed=7)) for name in TINY}


@contextmanager
def opened(path: str, held: Sequence[str] = (), ctx: int = CTX) -> Iterator[Model]:
    model = load(path, lane="cpu", ctx=ctx, dtype=np.float64, held=held)
    try:
        yield model
    finally:
        model.close()


def feed(model: Model, chunks: Sequence[int], *, all_logits: bool = False, seed: int = 0) -> list[np.ndarray]:
    """Logits after each chunk of a random sequence fed chunk by chunk from position 0."""
    ids = np.random.default_rng(seed).integers(0, model.cfg.vocab, size=sum(chunks))
    out, pos = [], 0
    for n in chunks:
        out.append(model.lane.forward(ids[pos : pos + n], pos, all_logits=all_logits))
        pos += n
    return out


def relative(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> float:
    """max |got - want| / max |want| over every step's logits."""
    a = np.concatenate([x.ravel() for x in got])
    b = np.concatenate([x.ravel() for x in want])
    assert a.shape == b.shape and np.all(np.isfinite(b))
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# --- every rule held against none ---------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("shape", TINY)
def test_every_rule_held_changes_nothing(tiny, shape, schedule):
    chunks = SCHEDULES[schedule]
    with opened(tiny[shape]) as fused, opened(tiny[shape], held=RULES) as plain:
        for rows in sorted(set(chunks)):
            assert plain.lane.plan(rows).fired == [], "holding every rule must leave the graph unfused"
            assert fused.lane.plan(rows).fired, "the cpu lane fuses something in every form"
        for all_logits in (False, True):
            got, want = feed(fused, chunks, all_logits=all_logits), feed(plain, chunks, all_logits=all_logits)
            assert relative(got, want) <= RTOL


def test_a_real_shape_decodes_the_same_fused(tmp_path_factory):
    """qwen2.5-0.5b's shape (14 heads over 2 kv heads, 24 layers, 151,936 tokens): two decode steps.

    The weights are dequantized once (f64 doubles their bytes, ~4 GB): the unfused graph, from a model
    loaded with every rule held, runs on the fused model's lane. Each step writes its cache row before it
    reads the cache, so the second run sees only rows it wrote itself."""
    path = write_synthetic(tmp_path_factory.mktemp("real") / "qwen2.5-0.5b.gguf", "qwen2.5-0.5b", "q8_0", seed=1)
    try:
        with opened(str(path), ctx=4) as fused, opened(str(path), held=RULES, ctx=4) as plain:
            plan, bare = fused.lane.plan(1), plain.lane.plan(1)
            assert bare.fired == [] and len(plan.ops) < len(bare.ops)
            ids = [17, 151_000]
            got = [fused.lane.run(fused.lane.graph(1), np.array([t]), pos) for pos, t in enumerate(ids)]
            want = [fused.lane.run(plain.lane.graph(1), np.array([t]), pos) for pos, t in enumerate(ids)]
            assert relative(got, want) <= RTOL
    finally:
        path.unlink()  # 0.7 GB: do not leave it for the session's end


# --- one rule held at a time --------------------------------------------------------------------------------


def touched_by(rule: str, full: Plan, without: Plan) -> set[int]:
    """The original ops `rule`'s fusions cover in `full`, grown by every fusion (of either plan) that shares an
    op with them: what holding the rule may change (a fusion built on its class, or one that takes its ops)."""
    touched = {c for e in full.fired if e.rule == rule for c in e.covers}
    events = [set(e.covers) for e in (*full.fired, *without.fired)]
    grown = True
    while grown:
        grown = False
        for covers in events:
            if covers & touched and not covers <= touched:
                touched |= covers
                grown = True
    return touched


def check_local(rule: str, full: Plan, without: Plan) -> None:
    assert not any(e.rule == rule for e in without.fired), f"{rule} fired while held"
    touched = touched_by(rule, full, without)
    if not touched:  # the rule did not fire: holding it changes nothing at all
        assert without.ops == full.ops and without.fired == full.fired
        return
    away = [e for e in full.fired if not touched & set(e.covers)]
    assert away == [e for e in without.fired if not touched & set(e.covers)]
    kept = [op for op in full.ops if not touched & set(op.covers)]
    assert kept == [op for op in without.ops if not touched & set(op.covers)]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape", TINY)
def test_each_rule_held_alone(tiny, shape, rule):
    chunks = (5, 1, 3, 1)
    with opened(tiny[shape]) as fused, opened(tiny[shape], held=[rule]) as partial:
        for rows in sorted(set(chunks)):
            check_local(rule, fused.lane.plan(rows), partial.lane.plan(rows))
        assert relative(feed(partial, chunks, seed=1), feed(fused, chunks, seed=1)) <= RTOL


def test_the_locality_check_is_not_vacuous(tiny):
    """Holding norm_weight takes the fusions built on NormWeight with it, but not the GLU's or attention's."""
    with opened(tiny["tiny-qwen3"]) as fused, opened(tiny["tiny-qwen3"], held=["norm_weight"]) as partial:
        full, without = fused.lane.plan(1), partial.lane.plan(1)
        touched = touched_by("norm_weight", full, without)
        away = {e.rule for e in full.fired if not touched & set(e.covers)}
        assert {"glu_act_mul", "flash_decode", "row_write"} <= away
        assert "add_norm" in {e.rule for e in full.fired} - {e.rule for e in without.fired}
