"""The shim protocol: a lane's answers to the shared optimizer, beside the optimizer that asks them.

The rules decide a fusion by dataflow; the lane decides whether the fused op has a launch. Five questions:
`supports` (native, decompose, or refuse with a reason, per class), `fits` (why this particular fused op has
no launch, or None), `activation` (the quantized form in which a product reads an operand, so its producer
can quantize in its epilogue), `rules` (lane-only rules and where they go in the shared table) and
`numerics` (the lane's contract). A lane may hold rules back by name.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fuselane.graph.classes import ClassId
from fuselane.graph.ir import Op, QuantFormat, TensorGraph
from fuselane.numerics.contract import Contract


class SupportKind(enum.Enum):
    NATIVE = "native"  # one launch runs the class
    DECOMPOSE = "decompose"  # the lane runs its parts apart
    REFUSE = "refuse"  # the lane cannot run a model that needs it


@dataclass(frozen=True, slots=True)
class Support:
    kind: SupportKind
    reason: str = ""

    @property
    def native(self) -> bool:
        return self.kind is SupportKind.NATIVE


NATIVE = Support(SupportKind.NATIVE)
DECOMPOSE = Support(SupportKind.DECOMPOSE)


def refuse(reason: str) -> Support:
    return Support(SupportKind.REFUSE, reason)


@dataclass(frozen=True, slots=True)
class Before:
    """A lane rule's place: just before the named shared rule."""

    rule: str


@dataclass(frozen=True, slots=True)
class After:
    """A lane rule's place: just after the named shared rule."""

    rule: str


Position = Before | After


@dataclass(frozen=True, slots=True)
class LaneRule:
    """A rule only one lane has: its name, the classes it builds, and its pass over the rewriter
    (`fuse.rewriter.Rewriter`, which this module sits below: the rewriter asks the shim, so the pass's argument
    is typed loosely here rather than by importing it back).

    `holdable` is False for a lane's settling pass: one that splits a fusion the lane's kernels run only in
    some shapes, or adds the launches its kernels need (a quantizing launch). Without it the plan would not be
    what the lane runs, so `--hold` does not take it; the knob it reads is how to switch its choice."""

    name: str
    builds: tuple[ClassId, ...]
    apply: Callable[[Any], None]
    holdable: bool = True


class Shim(Protocol):
    """What a lane answers the optimizer."""

    held: tuple[str, ...]

    @property
    def name(self) -> str: ...

    def supports(self, cls: ClassId) -> Support: ...

    def fits(self, op: Op, g: TensorGraph) -> str | None: ...

    def activation(self, consumer: Op, operand: int, g: TensorGraph) -> QuantFormat | None: ...

    def rules(self) -> list[tuple[Position, LaneRule]]: ...

    def numerics(self) -> Contract | None: ...
