"""The shared rule `mla_prologue` on a hand-built latent attention (2 heads): it takes the query's join and the
cache row's as one op, the numbers unchanged on the cpu lane in f64; it does not fire where the row's join
reads what the query's writes (one launch runs both at once), nor across an op between them that touches what
they read."""

from __future__ import annotations

from fuselane.fuse.optimizer import optimize
from fuselane.fuse.views import class_of, parts
from fuselane.graph.classes import ClassId
from fuselane.graph.ir import Dst, Role, RowAt, Tensor, Values
from fuselane.graph.ops import (
    Attention,
    Elementwise,
    ElementwiseOp,
    HeadMatmul,
    Join,
    Matmul,
    RmsNorm,
    Rope,
    SetRow,
    Slice,
)
from fuselane.models.qwen import LOGITS, POS
from tests.fuse.test_rules import CTX, Hand, TakeAll, fired, index_of, probe, same_numbers

HEADS, NOPE, ROPE, LORA = 2, 4, 4, 8
HELD = ("rope_q_k_one_launch", "merged_projections")  # each rotation stays beside its own join


def hand_prologue(chained: bool = False) -> Hand:
    """The query (each head's NOPE values through its own (LORA, NOPE) matrix, then its ROPE values turned)
    joined head by head; the latent (LORA values normed and weighted, then the shared key's ROPE turned) joined
    into the cache at the position; the attention over the cache, its values the latents. `chained`: the latent
    is the absorbed query's first LORA values, so the row's join reads what the query's writes."""
    h = Hand()
    rows, x = h.g.rows, h.embed(16)
    h.op(Matmul(rows, HEADS * (NOPE + ROPE), 16), (x, h.weight("wq", HEADS * (NOPE + ROPE), 16)), "q", 16)
    h.op(Slice(rows * HEADS, NOPE + ROPE, 0, NOPE), ("q",), "q_nope", HEADS * NOPE)
    h.op(HeadMatmul(rows, HEADS, NOPE, LORA), ("q_nope", h.weight("kb", HEADS * LORA, NOPE)), "q_lat", HEADS * LORA)
    h.op(Slice(rows * HEADS, NOPE + ROPE, NOPE, ROPE), ("q",), "q_pe", HEADS * ROPE)
    h.op(Rope(rows, HEADS, ROPE, 10_000.0, half=False), ("q_pe", POS), "q_rot", HEADS * ROPE)
    kw = LORA + ROPE
    h.op(Join(rows, HEADS, HEADS * LORA, HEADS * ROPE), ("q_lat", "q_rot"), "q_abs", HEADS * kw)
    h.op(Matmul(rows, kw, 16), (x, h.weight("wkv", kw, 16)), "kv", kw)
    if chained:
        h.op(Slice(rows, HEADS * kw, 0, LORA), ("q_abs",), "latent", LORA)
    else:
        h.op(Slice(rows, kw, 0, LORA), ("kv",), "latent", LORA)
    h.op(Slice(rows, kw, LORA, ROPE), ("kv",), "k_pe", ROPE)
    h.op(RmsNorm(rows, LORA, 1e-6), ("latent",), "n", LORA)
    h.op(Elementwise(ElementwiseOp.MUL, rows, LORA, row=True), ("n", h.weight("kv_norm", LORA)), "nw", LORA)
    h.op(Rope(rows, 1, ROPE, 10_000.0, half=False), ("k_pe", POS), "k_rot", ROPE)
    h.op(Join(rows, 1, LORA, ROPE), ("nw", "k_rot"), "row", kw)
    h.g.add(Tensor("kc", (CTX, kw), Values("f32"), Role.CACHE))
    h.g.emit(SetRow(rows, kw), ("row", POS), "kc", Dst("kc", row=RowAt(POS, kw)))
    h.op(Slice(CTX, kw, 0, LORA), ("kc",), "values", LORA, rows=CTX)
    h.op(Attention(rows, HEADS, 1, kw, CTX, 0.3, vd=LORA), ("q_abs", "kc", "values", POS), LOGITS, HEADS * LORA)
    return h


def plan_of(g, *, explain: bool = False):
    return optimize(g, TakeAll(), held=HELD, explain=explain)


def test_the_two_joins_become_one_op_and_no_number_changes():
    h = hand_prologue()
    plan = plan_of(h.g)
    (event,) = fired(plan, "mla_prologue")
    assert event.cls is ClassId.MLA_PROLOGUE
    assert {index_of(h.g, "q_abs"), index_of(h.g, "row")} <= set(event.covers)
    (op,) = [op for op in plan.graph.ops if class_of(op) is ClassId.MLA_PROLOGUE]
    assert [class_of(p) for p in parts(op)] == [ClassId.JOIN_IN_PLACE] * 2
    assert same_numbers(h.g, plan, h.lane) == 0.0


def test_a_row_join_that_reads_the_absorbed_query_stays_apart():
    h = hand_prologue(chained=True)
    plan = plan_of(h.g, explain=True)
    assert len([e for e in plan.fired if e.rule == "join_in_place"]) == 2  # both joins are there to take
    assert not fired(plan, "mla_prologue")
    assert any("q_abs" in u.reason for u in plan.unmatched if u.rule == "mla_prologue"), plan.unmatched
    assert same_numbers(h.g, plan, h.lane) == 0.0


def test_the_joins_do_not_move_across_a_conflict():
    h = hand_prologue()
    other = probe(h.g, "q_pe", after="kv", write=True)  # between the joins: overwrites what the query's reads
    plan = plan_of(other, explain=True)
    assert not fired(plan, "mla_prologue")
    assert any("between them" in u.reason for u in plan.unmatched if u.rule == "mla_prologue"), plan.unmatched
    assert same_numbers(other, plan, h.lane) == 0.0
