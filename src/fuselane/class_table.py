"""The class table `fuselane explain --classes` prints: every fused class, where it stands, and each lane's answer.

For each class (in `ClassId` order): the rules that build it, each with the lanes whose table has it (a lane's
own rule is in that lane's only), or what it waits for where no rule builds it yet (`graph.classes.STANDING`);
then what each lane's shim answers when asked for it (`supports`: native, decompose, or refuse with the
reason). The shims are built as `explain` builds them, so the lane named by `--lane` takes `--knob`; the other
lane answers at its defaults. Given a model, the table also counts each class's ops in that model's plan.
The text form is for reading; the JSON form (`class_table`, schema version `JSON_VERSION`) is for tools.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from fuselane.errors import FuselaneError
from fuselane.explain import build_plan, make_shim
from fuselane.fuse.optimizer import table_for
from fuselane.fuse.shim import Support
from fuselane.fuse.views import class_of
from fuselane.graph.classes import STANDING, Awaits, ClassId

JSON_VERSION = 1
LANES = ("cuda", "cpu")  # the table's answer columns, in order
NONE_YET = "none yet"
COLUMN_GAP = 2


def awaits_key(what: Awaits) -> str:
    """The short name of what a class waits for, as the table's column and the JSON print it."""
    return what.name.lower().replace("_", "-")


def _answer(support: Support) -> dict[str, str]:
    return {"kind": support.kind.value, "reason": support.reason}


def _shims(lane: str, knobs: Sequence[str], held: Sequence[str], form: str) -> dict[str, Any]:
    """Each lane's shim as `explain` builds it: `lane`'s under `knobs` and `held`, the others at defaults."""
    if lane not in LANES:
        raise FuselaneError(f"unknown lane '{lane}' (choose {' or '.join(sorted(LANES))})")
    return {name: make_shim(name, knobs if name == lane else (), held if name == lane else (), form) for name in LANES}


def _check_held(shim: Any, lanes_of: dict[str, list[str]], lane: str, held: Sequence[str]) -> None:
    """What `--hold` names must be a rule of the lane or a kernel choice it holds, as `optimize` checks it."""
    known = [name for name, lanes in lanes_of.items() if lane in lanes] + list(getattr(shim, "lane_holds", ()))
    unknown = sorted(set(held) - set(known))
    if unknown:
        raise FuselaneError(f"no rule named {unknown[0]} (rules: {', '.join(known)})")


def class_table(
    *,
    lane: str = "cpu",
    knobs: Sequence[str] = (),
    held: Sequence[str] = (),
    form: str = "decode",
    model: str | None = None,
    rows: int | None = None,
) -> dict[str, Any]:
    """The table as plain data: every class's builders (or what it awaits) and each lane's `supports` answer,
    with `knobs` and `held` given to the shim of `lane`; with `model`, each class's ops in its plan there."""
    shims = _shims(lane, knobs, held, form)
    lanes_of: dict[str, list[str]] = {}
    for name, shim in shims.items():
        for rule in table_for(shim):
            lanes_of.setdefault(rule.name, []).append(name)
    _check_held(shims[lane], lanes_of, lane, held)
    data: dict[str, Any] = {
        "version": JSON_VERSION,
        "lanes": {name: shim.name for name, shim in shims.items()},
        "knobs": {name: list(knobs) if name == lane else [] for name in LANES},
    }
    counts: Counter[ClassId] | None = None
    if model is not None:
        label, _, plan = build_plan(model, lane=lane, form=form, rows=rows, knobs=knobs, held=held)
        counts = Counter(cls for op in plan.ops if (cls := class_of(op)) is not None)
        data["plan"] = {"model": label, "lane": plan.lane, "form": form, "rows": plan.graph.rows}
    classes = []
    for cls, standing in STANDING.items():
        row: dict[str, Any] = {
            "class": cls.value,
            "built_by": [{"rule": rule, "lanes": lanes_of.get(rule, [])} for rule in standing.built_by],
            "awaits": None if standing.awaits is None else awaits_key(standing.awaits),
            "answers": {name: _answer(shim.supports(cls)) for name, shim in shims.items()},
        }
        if counts is not None:
            row["in_plan"] = counts[cls]
        classes.append(row)
    data["classes"] = classes
    return data


def _builders(row: dict[str, Any], lanes: Sequence[str]) -> str:
    if row["awaits"] is not None:
        return f"{NONE_YET}: {row['awaits']}"
    # a rule every lane's table has is plain; a lane's own rule says whose it is
    return ", ".join(
        b["rule"] if sorted(b["lanes"]) == sorted(lanes) else f"{b['rule']} ({', '.join(b['lanes'])} only)"
        for b in row["built_by"]
    )


def _said(answer: dict[str, str]) -> str:
    return answer["kind"] + (f": {answer['reason']}" if answer["reason"] else "")


def render_table(data: dict[str, Any]) -> str:
    """The table for a terminal: a line a class, then what the classes no rule builds wait for."""
    lanes = list(data["lanes"])
    plan = data.get("plan")
    header = ["class", "built by", *(f"{name} ({data['lanes'][name]})" for name in lanes)]
    body = [
        [row["class"], _builders(row, lanes), *(_said(row["answers"][name]) for name in lanes)]
        for row in data["classes"]
    ]
    if plan is not None:
        header.insert(2, "in plan")
        for cells, row in zip(body, data["classes"], strict=True):
            cells.insert(2, str(row["in_plan"]))
    widths = [max(len(cells[c]) for cells in [header, *body]) + COLUMN_GAP for c in range(len(header) - 1)]
    lines = []
    built = sum(1 for row in data["classes"] if row["built_by"])
    title = f"fused classes: {built} of {len(data['classes'])} built by a rule"
    if plan is not None:
        title += f"; in plan: ops of each class in {plan['model']}'s {plan['form']} plan on {plan['lane']}"
    lines.append(title)
    lines += [f"knobs on {name}: {', '.join(chosen)}" for name, chosen in data["knobs"].items() if chosen]
    lines.append("")
    for cells in [header, *body]:
        lines.append("".join(cell.ljust(w) for cell, w in zip(cells[:-1], widths, strict=True)) + cells[-1])
    waiting = Counter(row["awaits"] for row in data["classes"] if row["awaits"] is not None)
    lines += ["", f"{NONE_YET} ({sum(waiting.values())} classes), waiting for:"]
    for what in Awaits:
        key = awaits_key(what)
        if waiting[key]:
            lines.append(f"  {key} ({waiting[key]}): {what.value}")
    return "\n".join(lines)
