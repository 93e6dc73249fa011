"""A rule of the table: a name (which `--hold` takes), the classes it builds, and a pattern tried at every
live slot of the schedule in order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fuselane.fuse.rewriter import Rewriter
from fuselane.graph.classes import ClassId

Pattern = Callable[[Rewriter, int], None]


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    builds: tuple[ClassId, ...]
    pattern: Pattern

    def apply(self, r: Rewriter) -> None:
        for i in range(len(r.s)):
            if r.s.slot(i) is not None:
                self.pattern(r, i)
