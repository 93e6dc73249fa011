"""A step's activation buffers, shared by activations whose lives do not overlap, so a chunk's workspace is the
most it holds at once (a few of a layer's activations) rather than every layer's.

An activation lives from the first op of the plan that touches it (reads or writes it, in any part of a fused
op) to the last, a view's readers counting as its input's. Walking the ops in order, an activation takes a free
buffer of exactly its size (f32 values; its int8 form, where the plan writes one, a free form of its shape)
when its life begins, and gives it back once the op where its life ends has taken what it needs: an op never
gets an input's buffer for its own output. Every op writes its outputs whole before anything reads them
within a step, so a buffer's stale values from another activation are never read. The step's output (the
logits), the caches, the ids and the position keep buffers of their own; a view's output (a chunk's last
rows) is bound to its input's buffer by its binder.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import Any

from fuselane.fuse.optimizer import VIEWS, Plan
from fuselane.fuse.views import class_of, leaves
from fuselane.graph.classes import ClassId
from fuselane.graph.ir import Op, QuantizedActs, Role


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
    plan: Plan, make: Callable[[tuple[int, ...]], Any], make_q8: Callable[[tuple[int, ...]], Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(buffers, int8 forms) by name for the plan's activations, shared where their lives do not overlap.
    `make(shape)` allocates an f32 buffer, `make_q8(shape)` an int8 form."""
    g = plan.graph
    inside = unstored(plan)
    pooled = {name for name, t in g.tensors.items() if t.role is Role.ACTIVATION} - inside
    span = lives(plan, pooled)
    starts: dict[int, list[str]] = defaultdict(list)
    ends: dict[int, list[str]] = defaultdict(list)
    for name, (a, z) in span.items():
        starts[a].append(name)
        ends[z].append(name)
    free: dict[Hashable, list[Any]] = defaultdict(list)
    taken: dict[str, list[tuple[Hashable, Any]]] = defaultdict(list)

    def take(key: Hashable, build: Callable[[], Any]) -> Any:
        return free[key].pop() if free[key] else build()

    bufs: dict[str, Any] = {}
    q8: dict[str, Any] = {}
    for i in range(len(plan.ops)):
        for name in starts[i]:
            shape = g.tensors[name].shape
            numel = _numel(shape)
            flat = take(("f32", numel), lambda n=numel: make((n,)))  # noqa: B023 (bound by default)
            taken[name].append((("f32", numel), flat))
            bufs[name] = flat.view(shape)
            if isinstance(g.tensors[name].storage, QuantizedActs):
                form = take(("q8", shape), lambda s=shape: make_q8(s))  # noqa: B023
                taken[name].append((("q8", shape), form))
                q8[name] = form
        for name in ends[i]:
            for key, buf in taken.pop(name):
                free[key].append(buf)
    views = {op.out for op in plan.ops if isinstance(op.sym, VIEWS)}  # bound to their input's buffer
    for name in pooled - set(span) - views - inside:  # never touched by an op: a buffer of its own all the same
        bufs[name] = make(g.tensors[name].shape)
    return bufs, q8


def unstored(plan: Plan) -> set[str]:
    """Activations that live and die inside one gated pair (GemvGateUpGlu): its gate and up products and the
    gate's SiLU, which its launches never store (the GEMV keeps them in registers; a chunk's pair on cuBLAS
    joins the products' f16 tiles in its epilogue), so they take no buffer. Other fused ops' parts may store
    theirs (a GEMV in parts writes each member's output), so only the pair's are left out."""
    outer: set[str] = set()
    touched: dict[str, set[int]] = defaultdict(set)
    pairs: set[int] = set()
    for i, op in enumerate(plan.ops):
        outer |= set(op.ins) | {op.out, op.dst.buf}
        if class_of(op) is ClassId.GEMV_GATE_UP_GLU:
            pairs.add(i)
        for name in _names(op):
            touched[name].add(i)
    return {name for name, ops in touched.items() if len(ops) == 1 and ops <= pairs and name not in outer}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
