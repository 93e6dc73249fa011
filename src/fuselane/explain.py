"""`fuselane explain`: the fused plan of a model on a lane, and why each fusion that did not happen did not.

The plan is built exactly as a lane would build it: the recognizer's graph for a form, the shared rules with
the lane's linked in, the lane's `supports`/`fits` answers. The text form is for reading; the JSON form
(`to_json`, schema version `JSON_VERSION`, documented in the README) is stable for tools.

`fuselane explain --classes` prints instead the table of every fused class (`fuselane.class_table`): the
rules that build it or what it waits for, and each lane's `supports` answer, from shims `make_shim` builds.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fuselane.errors import FuselaneError
from fuselane.fuse.optimizer import VIEWS, Plan, launches_of, optimize
from fuselane.fuse.views import class_of, leaves
from fuselane.gguf.formats import Format
from fuselane.graph.ir import Dst, Form, Op, Strided
from fuselane.graph.ops import RowsGather
from fuselane.models import ModelConfig, config_of, recognizer
from fuselane.numerics.contract import Contract, Kept

JSON_VERSION = 1
SYNTH_PREFIX = "synth:"
DEFAULT_PREFILL_ROWS = 512
DEFAULT_CTX = 4096
DEFAULT_BATCH = 8  # sequences a batch step decodes at once, where --rows does not say
FORMS = ("decode", "prefill", "batch")
_LAYER = re.compile(r"^(?:l|blk\.)(\d+)\.")


@dataclass(frozen=True, slots=True)
class TensorShape:
    """A tensor as the recognizer sees it, where no file backs it (a synthetic shape)."""

    shape: tuple[int, ...]
    format: Format


def model_source(model: str) -> tuple[str, ModelConfig, dict[str, Any]]:
    """A model's name, config and tensor table: from a GGUF (path or known name), or `synth:SHAPE[:MIX]`,
    a synthetic checkpoint's shapes and formats without writing it."""
    if model.startswith(SYNTH_PREFIX):
        from fuselane.gguf.synth import Mix, model_metadata, resolve_shape, tensor_formats, tensor_shapes

        name, _, mix = model[len(SYNTH_PREFIX) :].partition(":")
        label, shape = resolve_shape(name)
        formats = tensor_formats(shape, Mix.parse(mix or "q8_0"))
        tensors = {n: TensorShape(s, formats[n]) for n, s in tensor_shapes(shape).items()}
        meta = {"general.architecture": shape.arch, **model_metadata(shape, label, 0)}
        return label, config_of(meta, tensors), tensors
    from fuselane.gguf.reader import open_gguf
    from fuselane.hub import resolve

    path = resolve(model)
    with open_gguf(path) as f:
        tensors = {n: TensorShape(t.shape, t.format) for n, t in f.tensors.items()}
        return path.name, config_of(f.metadata, tensors), tensors


def make_shim(lane: str, knobs: Sequence[str], held: Sequence[str], form: str):
    """The shim of `lane` under `knobs` (`k=v` strings), holding `held`."""
    if lane == "cpu":
        import numpy as np

        from fuselane.lanes.cpu.shim import CpuShim

        dtype = "f32"
        for knob in knobs:
            key, _, value = knob.partition("=")
            if key != "dtype" or value not in ("f32", "f64"):
                raise FuselaneError(f"the cpu lane takes one knob, dtype=f32|f64, not '{knob}'")
            dtype = value
        return CpuShim(np.dtype(np.float32 if dtype == "f32" else np.float64), tuple(held))
    if lane == "cuda":
        from fuselane.lanes.cuda.plan.knobs import CudaKnobs
        from fuselane.lanes.cuda.plan.shim import CudaShim

        parsed = CudaKnobs.parse([*knobs, *(["batch=true"] if form == "batch" else [])])
        return CudaShim(parsed, held=tuple(held))
    raise FuselaneError(f"unknown lane '{lane}' (choose cpu or cuda)")


def build_plan(
    model: str,
    *,
    lane: str = "cpu",
    form: str = "decode",
    rows: int | None = None,
    knobs: Sequence[str] = (),
    held: Sequence[str] = (),
    ctx: int | None = None,
) -> tuple[str, ModelConfig, Plan]:
    """The plan `fuselane explain` shows, at a context of `ctx` rows (`context_of`)."""
    if form not in FORMS:
        raise FuselaneError(f"unknown form '{form}' (choose from {', '.join(FORMS)})")
    name, cfg, tensors = model_source(model)
    shim = make_shim(lane, knobs, held, form)
    n = rows_of(form, rows, ctx)
    graph = recognizer(cfg).recognize(cfg, tensors, Form(form), rows=n, ctx=context_of(cfg, ctx, n, form))
    return name, cfg, optimize(graph, shim, held=held, check=False)


def rows_of(form: str, rows: int | None, ctx: int | None) -> int:
    """A form's step rows as `explain` shows it: one for decode; `rows` where given; else `DEFAULT_PREFILL_ROWS`
    for a prefill chunk (at most the context asked: a lane of a shorter context runs its prompts in chunks of
    at most that) and `DEFAULT_BATCH` sequences for a batch."""
    default = min(DEFAULT_PREFILL_ROWS, ctx or DEFAULT_PREFILL_ROWS) if form == "prefill" else DEFAULT_BATCH
    n = 1 if form == "decode" else (rows if rows is not None else default)
    if n < 1:
        raise FuselaneError(f"a {form} step has at least one row, not {n}")
    return n


def context_of(cfg: ModelConfig, ctx: int | None, rows: int, form: str) -> int:
    """The cache rows a plan is shown at: `ctx` where given (the model's context at most, and a prefill chunk's
    rows at least), else what a lane loads with (`DEFAULT_CTX`, or the model's context where shorter) and at
    least a chunk's rows (a batch's rows are sequences, each with a context of its own)."""
    if ctx is None:
        loaded = min(cfg.context, DEFAULT_CTX)
        return max(loaded, rows) if form == "prefill" else loaded
    if not 1 <= ctx <= cfg.context:
        raise FuselaneError(f"the context (--ctx) must be 1 to {cfg.context:,} tokens, the model's, not {ctx:,}")
    if form == "prefill" and ctx < rows:
        raise FuselaneError(f"a prefill chunk of {rows:,} rows does not fit a context of {ctx:,} (--rows, --ctx)")
    return ctx


def op_name(op: Op) -> str:
    cls = class_of(op)
    return cls.value if cls is not None else type(op.sym).__name__


def _access(a: Any) -> str:
    return f"strided(pitch={a.pitch}, offset={a.offset}, width={a.width})" if isinstance(a, Strided) else "whole"


def _dst(d: Dst) -> dict[str, Any]:
    out: dict[str, Any] = {"buffer": d.buf}
    if d.row is not None:
        out["row"] = {"at": d.row.sel, "pitch": d.row.pitch}
    if d.unit is not None:
        out["unit"] = {"pitch": d.unit.pitch, "offset": d.unit.offset, "width": d.unit.width}
    return out


def layer_of(op: Op) -> int | None:
    m = _LAYER.match(op.out)
    return int(m.group(1)) if m else None


def launch_layers(ops: Sequence[Op]) -> list[int | None]:
    """The layer each op of a schedule launches for (None: none, or a view): the layer its output is named for;
    the embedding's gather, and what folds into it, launch before the first layer; an op a lane adds (one that
    covers none of the model's, a `Quantize`) launches for the layer of the op that wrote what it reads."""
    layers: list[int | None] = []
    writer: dict[str, int | None] = {}
    for op in ops:
        if not op.covers and op.ins:
            layer = writer.get(op.ins[0], layer_of(op))
        elif any(isinstance(leaf.sym, RowsGather) for leaf in leaves(op)):
            layer = None
        else:
            layer = layer_of(op)
        writer[op.out] = layer
        layers.append(None if isinstance(op.sym, VIEWS) else layer)
    return layers


def launches_per_layer(plan: Plan) -> dict[int, int]:
    """Launches by layer (`launch_layers`): each op's own (`launches_of`: none for a view)."""
    counts: Counter[int] = Counter()
    for op, layer in zip(plan.ops, launch_layers(plan.ops), strict=True):
        if layer is not None:
            counts[layer] += launches_of(op)
    return dict(sorted(counts.items()))


def _taken(t: Any) -> str:
    return t.keep.value if isinstance(t, Kept) else t.scheme.describe()


def numerics_json(c: Contract | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {
        "point": c.point,
        "activations": c.activations.describe() if c.activations else "dequantized",
        "cache": c.cache.value,
        "state": c.state.value,
        "attention": None
        if c.attention is None
        else {k: _taken(getattr(c.attention, k)) for k in ("queries", "keys_values", "weights")},
        "fused_bound": "exact" if c.fused.exact else c.fused.relative,
        "accumulator_bits": c.accumulator_bits,
    }


def to_json(
    name: str, cfg: ModelConfig, plan: Plan, form: str, workspace: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The plan as plain data: the stable JSON form (see the README for the schema); `workspace`, the cuda lane's
    chunk workspace where it keeps one (`prefill_workspace`)."""
    per_layer = launches_per_layer(plan)
    data = {
        "version": JSON_VERSION,
        "model": {"name": name, "architecture": cfg.arch, "layers": cfg.n_layers},
        "lane": plan.lane,
        "form": form,
        "rows": plan.graph.rows,
        "held": list(plan.held),
        "rules": list(plan.table),
        "schedule": [
            {
                "op": op_name(op),
                "fused": class_of(op) is not None,
                "covers": list(op.covers),
                "inputs": [{"name": n, "access": _access(a)} for n, a in zip(op.ins, op.access, strict=True)],
                "output": op.out,
                "destination": _dst(op.dst),
                "launches": launches_of(op),
            }
            for op in plan.ops
        ],
        "not_fused": [
            {"rule": m.rule, "class": m.cls.value, "kind": m.kind, "reason": m.reason, "covers": list(m.covers)}
            for m in plan.missed
        ],
        "launches": {
            "per_step": plan.launches(),
            "per_layer_max": max(per_layer.values(), default=0),
            "per_layer": per_layer,
        },
        "numerics": numerics_json(plan.contract),
    }
    if plan.cannot_run is not None:  # only where the lane refuses a class the model needs
        data["cannot_run"] = plan.cannot_run
    if workspace is not None:
        data["workspace"] = workspace
    return data


def prefill_workspace(
    model: str, *, knobs: Sequence[str] = (), held: Sequence[str] = (), ctx: int | None = None
) -> dict[str, Any] | None:
    """The cuda lane's chunk workspace for `model` under `knobs` at a context of `ctx` rows (`context_of`): what a
    lane loaded with that context sizes (`lanes/cuda/explain_workspace`), or None where its chunks keep none."""
    from fuselane.lanes.cuda.explain_workspace import prefill_workspace as sized

    _, cfg, tensors = model_source(model)
    rows = context_of(cfg, ctx, 1, "decode")
    return sized(cfg, tensors, make_shim("cuda", knobs, held, "prefill"), held, rows)


def render(data: dict[str, Any]) -> str:
    """The plan for a terminal: the schedule, what was not fused and why, launches, numerics."""
    m = data["model"]
    lines = [
        f"{m['name']} ({m['architecture']}, {m['layers']} layers) on {data['lane']}: "
        f"{data['form']} form, {data['rows']} row{'s' if data['rows'] != 1 else ''}",
        "",
        f"schedule ({len(data['schedule'])} ops):",
    ]
    for i, op in enumerate(data["schedule"]):
        ins = ", ".join(n["name"] + ("" if n["access"] == "whole" else f" [{n['access']}]") for n in op["inputs"])
        d = op["destination"]
        where = d["buffer"]
        if "row" in d:
            where += f"[row {d['row']['at']}, pitch {d['row']['pitch']}]"
        if "unit" in d:
            where += f"[unit {d['unit']['offset']}+{d['unit']['width']} of {d['unit']['pitch']}]"
        several = f"  ({op['launches']} launches)" if op["launches"] > 1 else ""
        lines.append(f"  {i:4d}  {op['op']:<22} {ins} -> {where}{several}")
    misses: dict[tuple[str, str, str, str], int] = {}
    for miss in data["not_fused"]:
        key = (miss["rule"], miss["class"], miss["kind"], miss["reason"])
        misses[key] = misses.get(key, 0) + 1
    lines += ["", f"not fused on this lane ({len(data['not_fused'])}):"]
    for (rule, cls, kind, reason), count in misses.items():
        lines.append(f"  {rule} -> {cls} x{count} [{kind}]: {reason}")
    if not misses:
        lines.append("  (none)")
    if data["held"]:
        lines += ["", "held: " + ", ".join(data["held"])]
    if data.get("cannot_run"):
        lines += ["", f"this lane cannot run the model: {data['cannot_run']}"]
    la = data["launches"]
    lines += ["", f"launches per {data['form']} step: {la['per_step']} (at most {la['per_layer_max']} per layer)"]
    n = data["numerics"]
    if n is not None:
        lines += ["", "numerics:"] + [f"  {k}: {v}" for k, v in n.items()]
    if data.get("workspace"):
        from fuselane.lanes.cuda.explain_workspace import render_workspace

        lines += ["", *render_workspace(data["workspace"])]
    return "\n".join(lines)
