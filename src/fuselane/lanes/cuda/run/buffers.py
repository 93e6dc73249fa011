"""A step's activation buffers: parts of one f32 arena, laid out by the activations' lives, so a chunk's workspace
is about the most it holds at once (a few of a layer's activations) rather than every layer's.

An activation lives from the first op of the plan that touches it (reads or writes it, in any part of a fused
op) to the last, a view's readers counting as its input's. Two activations whose lives meet (one ending at the
op where the other begins counts: an op never gets an input's span for its own output) never share bytes;
`arena_layout` places each in the tightest gap the spans of those alive with it leave, in the best of a few
orders, which on every dense shape measured makes the arena exactly the most a chunk holds at once. A value a
fused launch keeps in registers takes no span (`unstored`). An int8 form, where the
plan writes one, takes a free form of its shape. Every op writes its outputs whole before anything reads them
within a step, so stale values from another activation are never read. One arena, not a buffer an activation:
the caching allocator rounds each block it hands out, and spans of different sizes pack where exact-size
buffers could not be shared. The step's output (the logits: one buffer for all a lane's steps,
`CudaLane.output`), the caches, the ids and the position keep buffers of their own; a view's output (a chunk's
last rows) is bound to its input's buffer by its binder.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import Any

from fuselane.fuse.optimizer import VIEWS, Plan
from fuselane.fuse.views import class_of, leaves
from fuselane.graph.classes import ClassId
from fuselane.graph.ir import Op, QuantizedActs, Role
from fuselane.graph.ops import GatedDelta, Matmul, RmsNorm
from fuselane.lanes.cuda.plan.kernels import PART_ALIGN_BYTES

F32_BYTES = 4
F16_BYTES = 2

ALIGN_VALUES = PART_ALIGN_BYTES // F32_BYTES  # an activation's span starts where a block of its own did


def _names(op: Op) -> set[str]:
    """Every tensor an op or any part of it reads or writes."""
    names: set[str] = set(op.ins) | {op.out, op.dst.buf}
    for leaf in leaves(op):
        names |= set(leaf.ins) | {leaf.out, leaf.dst.buf}
    return names


def lives(plan: Plan, pooled: set[str]) -> dict[str, tuple[int, int]]:
    """The (first, last) op index each of `pooled` is touched at; a view's output extends its input's life."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    alias: dict[str, str] = {}
    for i, op in enumerate(plan.ops):
        if isinstance(op.sym, VIEWS):
            alias[op.out] = alias.get(op.ins[0], op.ins[0])
        for name in _names(op):
            name = alias.get(name, name)
            if name in pooled:
                first.setdefault(name, i)
                last[name] = i
    return {name: (first[name], last[name]) for name in first}


def pooled_buffers(
    plan: Plan,
    make: Callable[[tuple[int, ...]], Any],
    make_q8: Callable[[tuple[int, ...]], Any],
    arena: Callable[[int], Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(buffers, int8 forms) by name for the plan's activations: each buffer a part of one arena, shared where
    their lives do not overlap. `make(shape)` allocates an f32 buffer, `make_q8(shape)` an int8 form; `arena(n)`
    gives the arena's n f32 values where steps share one (`CudaLane.activation_arena`), else `make` takes it."""
    g = plan.graph
    pooled, span, (offsets, total) = _layout(plan)
    arena_values = make((total,)) if arena is None else arena(total)
    shapes = {name: g.tensors[name].shape for name in offsets}
    bufs = {n: arena_values[at : at + _numel(shapes[n])].view(shapes[n]) for n, at in offsets.items()}
    q8 = _int8_forms(plan, span, make_q8)
    views = {op.out for op in plan.ops if isinstance(op.sym, VIEWS)}  # bound to their input's buffer
    for name in pooled - set(span) - views:  # never touched by an op: a buffer of its own all the same
        bufs[name] = make(g.tensors[name].shape)
    return bufs, q8


def parts(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """(offset by name, total bytes) of parts of `sizes` bytes laid one after another in one buffer, each starting
    `kernels.PART_ALIGN_BYTES` aligned, where a block of its own did (the weights' upload, the caches)."""
    offsets, at = {}, 0
    for name, n in sizes.items():
        offsets[name] = at
        at += -(-n // PART_ALIGN_BYTES) * PART_ALIGN_BYTES
    return offsets, at


def arena_values(plan: Plan) -> int:
    """The values of the arena `pooled_buffers` lays the plan's activations out in, none allocated."""
    return _layout(plan)[2][1]


def _layout(plan: Plan) -> tuple[set[str], dict[str, tuple[int, int]], tuple[dict[str, int], int]]:
    """(the pooled activations, their lives, their arena layout) of a plan."""
    g = plan.graph
    pooled = _pooled(plan)
    span = lives(plan, pooled)
    return pooled, span, arena_layout({name: (span[name], _numel(g.tensors[name].shape)) for name in span})


def _pooled(plan: Plan) -> set[str]:
    """The activations the arena holds: every one but those a fused launch keeps in registers."""
    return {name for name, t in plan.graph.tensors.items() if t.role is Role.ACTIVATION} - unstored(plan)


Item = tuple[str, tuple[tuple[int, int], int]]  # name, ((first op, last op), values)

# The orders the greedy layout places items in; the layout keeps the smallest arena any of them gives (the first
# on a tie). Largest first packs a layer's wide products and narrow rows together, where the order lives begin
# leaves gaps no later item fits; the largest life x size first reached the most alive at once on every dense
# shape where largest first missed the Qwen3-4B's by 41 % (43.0 MB for 30.4) and the 32B's by 17 %; earliest
# first did best on DeepSeek-V2-Lite's latent chunk (86.0 MB for largest first's 94.4).
LAYOUT_ORDERS: tuple[Callable[[Item], Any], ...] = (
    lambda kv: (-kv[1][1], kv[1][0], kv[0]),
    lambda kv: (-(kv[1][0][1] - kv[1][0][0] + 1) * kv[1][1], kv[0]),
    lambda kv: (kv[1][0][0], -kv[1][1], kv[0]),
    lambda kv: (kv[1][0][0] - kv[1][0][1], -kv[1][1], kv[0]),
)


def arena_layout(items: dict[str, tuple[tuple[int, int], int]]) -> tuple[dict[str, int], int]:
    """(offset by name, arena length) in values for `items` (name: ((first op, last op), values)): the smallest
    of the greedy layouts in `LAYOUT_ORDERS`."""
    layouts = [_greedy(items, order) for order in LAYOUT_ORDERS]
    return min(layouts, key=lambda layout: layout[1])


def _greedy(items: dict[str, tuple[tuple[int, int], int]], order: Callable[[Item], Any]) -> tuple[dict[str, int], int]:
    """Place `items` in `order`, each in the tightest gap, `ALIGN_VALUES` aligned, between the spans of the items
    already placed whose lives meet its own (an item whose life ends at an op still holds its span there), or
    above them all."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, end offset, first op, last op)
    offsets: dict[str, int] = {}
    total = 0
    for name, ((first, last), numel) in sorted(items.items(), key=order):
        size = -(-numel // ALIGN_VALUES) * ALIGN_VALUES
        best, best_gap, at = None, None, 0
        for lo, hi, _, _ in sorted(p for p in placed if p[2] <= last and first <= p[3]):
            if lo - at >= size and (best_gap is None or lo - at < best_gap):
                best, best_gap = at, lo - at
            at = max(at, hi)
        offset = at if best is None else best
        placed.append((offset, offset + size, first, last))
        offsets[name] = offset
        total = max(total, offset + size)
    return offsets, total


def _int8_forms(
    plan: Plan, span: dict[str, tuple[int, int]], make_q8: Callable[[tuple[int, ...]], Any]
) -> dict[str, Any]:
    """An int8 form for each activation the plan writes one of, shared by exact shape where lives do not
    overlap."""
    g = plan.graph
    starts: dict[int, list[str]] = defaultdict(list)
    ends: dict[int, list[str]] = defaultdict(list)
    for name, (a, z) in span.items():
        if isinstance(g.tensors[name].storage, QuantizedActs):
            starts[a].append(name)
            ends[z].append(name)
    free: dict[Hashable, list[Any]] = defaultdict(list)
    q8: dict[str, Any] = {}
    for i in range(len(plan.ops)):
        for name in starts[i]:
            shape = g.tensors[name].shape
            q8[name] = free[shape].pop() if free[shape] else make_q8(shape)
        for name in ends[i]:
            free[g.tensors[name].shape].append(q8[name])
    return q8


# Fused classes whose launch keeps values inside it in registers, and which of its parts' results those are (None:
# every part's). `launch` binds no buffer to them: a gated pair's products and SiLU (the GEMV, or on cuBLAS the
# products' f16 tiles joined in their epilogue); the query/key norms and rotations' normed, weighted and rotated
# values (`rope_launch.rope_class`, `rope_qk`: they read the op's inputs and write the rotated query or the key's
# cache row; a 512-row chunk of Qwen3-0.6B held 14.7 of its 29.4 MB arena in them); a norm's value before its weight
# (`_norm_weight`, `_add_norm`, `_embed_norm` write the weighted norm, and the sum or the gathered rows). Other
# fused ops' parts may store theirs: a GEMV in parts writes each member's output.
IN_REGISTERS: dict[ClassId, tuple[type, ...] | None] = {
    ClassId.GEMV_GATE_UP_GLU: None,
    ClassId.QK_NORM_ROPE: None,
    ClassId.QK_NORM_ROPE_KV_APPEND: None,
    ClassId.ROPE_KV_APPEND: None,
    ClassId.ROPE_QK_ONE_LAUNCH: None,
    ClassId.NORM_WEIGHT: (RmsNorm,),
    ClassId.ADD_NORM: (RmsNorm,),
    ClassId.EMBED_NORM: (RmsNorm,),
}


def unstored(plan: Plan) -> set[str]:
    """Activations that live and die inside one op of an `IN_REGISTERS` class, as results of the parts it keeps
    in registers (a gated pair's gate and up products and the gate's SiLU; a query's or key's normed and rotated
    values on their way to its result or its cache row; a norm before its weight), which its launch never
    stores, so they take no buffer."""
    outer: set[str] = set()
    touched: dict[str, set[int]] = defaultdict(set)
    kept: dict[str, int] = {}
    for i, op in enumerate(plan.ops):
        outer |= set(op.ins) | {op.out, op.dst.buf}
        cls = class_of(op)
        if cls in IN_REGISTERS:
            kinds = IN_REGISTERS[cls]
            kept |= {leaf.out: i for leaf in leaves(op) if kinds is None or isinstance(leaf.sym, kinds)}
        for name in _names(op):
            touched[name].add(i)
    return {name for name, i in kept.items() if touched[name] == {i} and name not in outer}


def dying_reads(plan: Plan) -> frozenset[tuple[int, str]]:
    """(id of an op, or of a part of it, name) for each arena activation whose life ends at that op without the
    op writing it: a part is named where it alone of the op's parts reads the value, the op where its parts
    all do (a gated pair's launch rounds its activation once for both products). Those bytes are free for the
    launch to overwrite as it reads them (a product rounding its activation to f16 in place)."""
    span = lives(plan, _pooled(plan))
    views = {op.out for op in plan.ops if isinstance(op.sym, VIEWS)}
    found: set[tuple[int, str]] = set()
    for i, op in enumerate(plan.ops):
        written = {op.out, op.dst.buf} | {part.out for part in leaves(op)} | {part.dst.buf for part in leaves(op)}
        for name in set(op.ins) - written - views:
            if span.get(name, (i, -1))[1] != i:
                continue
            found.add((id(op), name))
            readers = [part for part in leaves(op) if name in part.ins]
            if len(readers) == 1:
                found.add((id(readers[0]), name))
    return frozenset(found)


# The classes whose chunk launches round their products' activations to f16 (`product_launch.product`, `_f16_pair`), so
# may round a dying one in its own bytes; a lone product too
ROUNDING_CLASSES = frozenset({ClassId.GEMM_BIAS, ClassId.ROW_WRITE, ClassId.GEMV_GATE_UP_GLU})


def dying_widths(plan: Plan, reads: frozenset[tuple[int, str]]) -> frozenset[int]:
    """The widths k whose every matrix product in the plan rounds an activation that dies there (`reads`, from
    `dying_reads`), so takes no f16 copy of it where the lane rounds in place; a width any other product
    multiplies keeps its copy counted."""
    dies: dict[int, bool] = {}
    for op in plan.ops:
        cls = class_of(op)
        for part in leaves(op):
            if not isinstance(part.sym, Matmul):
                continue
            owner = op if cls is ClassId.GEMV_GATE_UP_GLU else part  # a pair rounds once for both products
            rounds = (cls is None or cls in ROUNDING_CLASSES) and (id(owner), part.ins[0]) in reads
            dies[part.sym.k] = dies.get(part.sym.k, True) and rounds
    return frozenset(k for k, all_die in dies.items() if all_die)


def delta_rule_states(plan: Plan) -> set[str]:
    """The states a gated delta rule of the plan sums into (kept in the `state` knob's precision; a
    convolution's states stay f32)."""
    return {leaf.ins[-1] for op in plan.ops for leaf in leaves(op) if isinstance(leaf.sym, GatedDelta)}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
