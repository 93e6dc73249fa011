"""A step's activation buffers (`run/buffers.py`): activations whose lives overlap never share one, and a
deep plan's activations take far fewer buffers than it has activations."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from fuselane.explain import build_plan  # noqa: E402
from fuselane.fuse.optimizer import VIEWS  # noqa: E402
from fuselane.fuse.views import class_of, leaves  # noqa: E402
from fuselane.graph.classes import ClassId as C  # noqa: E402
from fuselane.graph.ir import QuantizedActs, Role  # noqa: E402
from fuselane.graph.ops import RmsNorm  # noqa: E402
from fuselane.lanes.cuda.run.buffers import (  # noqa: E402
    ALIGN_VALUES,
    arena_layout,
    dying_reads,
    dying_widths,
    lives,
    pooled_buffers,
    unstored,
)


def _span(t):
    """The bytes [start, end) a buffer holds."""
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


@pytest.mark.parametrize("form", ["prefill", "decode"])
def test_overlapping_lives_never_share_a_buffer(form):
    _, _, plan = build_plan("synth:tiny-qwen3", lane="cuda", form=form, rows=16)
    g = plan.graph
    views = {op.out for op in plan.ops if isinstance(op.sym, VIEWS)}  # bound to their input's buffer
    acts = {n for n, t in g.tensors.items() if t.role is Role.ACTIVATION} - views - unstored(plan)
    bufs, q8 = pooled_buffers(plan, lambda s: torch.zeros(s), lambda s: torch.zeros(s, dtype=torch.int8))
    assert set(bufs) == acts and all(tuple(bufs[n].shape) == g.tensors[n].shape for n in acts)
    assert {n for n in acts if isinstance(g.tensors[n].storage, QuantizedActs)} == set(q8)
    span = lives(plan, acts)
    shared = 0
    for a in acts:
        for b in acts - {a}:
            (a0, a1), (b0, b1) = span[a], span[b]
            (x0, x1), (y0, y1) = _span(bufs[a]), _span(bufs[b])
            if a0 <= b1 and b0 <= a1:
                assert x1 <= y0 or y1 <= x0, (a, b)
                assert a not in q8 or b not in q8 or q8[a] is not q8[b], (a, b)
            shared += x0 < y1 and y0 < x1
    assert shared, "no two activations share bytes"
    assert len({bufs[n].untyped_storage().data_ptr() for n in acts}) == 1  # one arena


@pytest.mark.parametrize("shape", ["qwen2.5-0.5b", "qwen3-8b", "qwen3-4b", "qwen3-32b"])
def test_the_arena_holds_about_the_most_alive_at_once(shape):
    # the arena's length against the most values alive at one op: a chunk's workspace is what it holds at once
    # (the Qwen3-4B's and 32B's only since the layout tries more orders than largest first: 41 % and 17 % over)
    _, _, plan = build_plan(f"synth:{shape}", lane="cuda", form="prefill", rows=512)
    g = plan.graph
    acts = {n for n, t in g.tensors.items() if t.role is Role.ACTIVATION} - unstored(plan)
    span = lives(plan, acts)
    items = {n: (span[n], math.prod(g.tensors[n].shape)) for n in span}
    offsets, total = arena_layout(items)
    most = max(sum(v for (a, z), v in items.values() if a <= i <= z) for i in range(len(plan.ops)))
    every = sum(v for _, v in items.values())
    assert most <= total <= 1.1 * most + ALIGN_VALUES * len(items) < every / 10


def test_the_arena_layout_packs_spans_by_their_lives():
    # largest first: b (ops 1-2) at 0; a (0-1) meets b at op 1, above it; c (2-3) meets b only, above it too
    offsets, total = arena_layout({"a": ((0, 1), 100), "b": ((1, 2), 300), "c": ((2, 3), 120)})
    assert offsets == {"b": 0, "a": 384, "c": 384} and total == 384 + 128
    # c dies at op 1, so d (ops 2-3) takes its span; b and e, alive with both, go above them
    offsets, total = arena_layout({"b": ((0, 5), 128), "c": ((0, 1), 256), "e": ((0, 5), 128), "d": ((2, 3), 256)})
    assert offsets == {"c": 0, "d": 0, "b": 256, "e": 384} and total == 512
    # a gap below a live span is taken when it fits: z (ops 2-9) under y, where x was
    offsets, total = arena_layout({"x": ((0, 1), 256), "y": ((0, 9), 256), "z": ((2, 9), 200)})
    assert offsets == {"x": 0, "y": 256, "z": 0} and total == 512


def _inner(plan, cls: C) -> tuple[list, set[str]]:
    """The ops of `cls` and the values only their parts write."""
    ops = [op for op in plan.ops if class_of(op) is cls]
    return ops, {leaf.out for op in ops for leaf in leaves(op)} - {op.out for op in ops}


def test_a_chunks_fused_ops_store_only_what_their_launches_write():
    # on cuBLAS a chunk's pair joins its products' f16 tiles in its epilogue: its gate, up and SiLU take no
    # buffer; the query/key norms and rotations keep their normed and rotated parts in registers, storing the
    # rotated query (the attention reads it) and the key's cache row. Every other fused op's parts keep theirs
    # (a GEMV in parts writes each member's output)
    _, cfg, plan = build_plan("synth:tiny-qwen3", lane="cuda", form="prefill", rows=16)
    pairs, in_pairs = _inner(plan, C.GEMV_GATE_UP_GLU)
    turns, in_turns = _inner(plan, C.ROPE_QK_ONE_LAUNCH)
    assert len(pairs) == cfg.n_layers and len(in_pairs) == 3 * cfg.n_layers  # gate, up, the gate's SiLU
    read_later = {n for op in plan.ops for n in op.ins}
    rotated_q = in_turns & read_later
    assert len(turns) == cfg.n_layers and len(rotated_q) == cfg.n_layers
    # a norm keeps its value before the weight in registers, and stores the weighted norm and (AddNorm) the sum
    norms = [op for op in plan.ops if class_of(op) in (C.ADD_NORM, C.NORM_WEIGHT, C.EMBED_NORM)]
    normed = {leaf.out for op in norms for leaf in leaves(op) if isinstance(leaf.sym, RmsNorm)}
    sums = {leaves(op)[-3].out for op in norms if class_of(op) is C.ADD_NORM}  # add, norm, weight: `_add_norm`
    assert len(normed) == len(norms) >= 2 * cfg.n_layers
    assert unstored(plan) == in_pairs | (in_turns - rotated_q) | normed
    bufs, _ = pooled_buffers(plan, lambda s: torch.zeros(s), lambda s: torch.zeros(s, dtype=torch.int8))
    assert not unstored(plan) & set(bufs)
    assert {op.out for op in pairs + norms} | rotated_q | sums <= set(bufs)


def test_an_activation_dies_at_its_last_reader_only():
    # the down's SwiGLU output and the pair's normed input die at their products, which may round them in place;
    # the attention's input, which the key's and value's products read after the query's, dies at none of those
    _, _, plan = build_plan("synth:qwen2.5-0.5b", lane="cuda", form="prefill", rows=512)
    reads = dying_reads(plan)
    ops = {op.out: op for op in plan.ops}
    down, pair, query = ops["l0.ffn_out"], ops["l0.glu"], ops["l0.q"]
    assert (id(down), "l0.glu") in reads
    assert class_of(pair) is C.GEMV_GATE_UP_GLU and (id(pair), "l0.ffn_in") in reads
    gate = next(p for p in leaves(pair) if p.ins[0] == "l0.ffn_in")
    assert (id(gate), "l0.ffn_in") not in reads  # both products read it: the pair's launch rounds it once
    assert not any(name == "l0.attn_in" for op_id, name in reads if op_id in {id(query), *map(id, leaves(query))})
    assert dying_widths(plan, reads) == {4864}  # the down's; the model's width is read by the query's too
    assert dying_widths(plan, frozenset()) == frozenset()
