"""The rewriter: a schedule of ops that rules fuse in place, and the record of what fired and what did not.

A fusion replaces its members with one op at a chosen place, keeping which original ops it covers. Before it
does, the rewriter asks the lane: `supports` (native, or the fusion is recorded as decomposed or refused with
the lane's reason) and then `fits` for the candidate op. Moving a member to the fused op's place is legal only
when nothing between them writes what it reads or reads or writes what it writes (`facts`).

With `explain` on, the rewriter also keeps why a pattern let go of an op of its shape (an intermediate it
would swallow has another reader, or a member cannot move past an op): Inductor's failed-match reasons. The
patterns hand over the reason as a callable, so it is only built when asked.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from fuselane.fuse.shim import Shim, SupportKind
from fuselane.graph import facts
from fuselane.graph.classes import ClassId
from fuselane.graph.ir import WHOLE, Access, Dst, Fused, Op, TensorGraph


@dataclass(frozen=True, slots=True)
class Fired:
    """A fusion that happened."""

    rule: str
    cls: ClassId
    covers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Missed:
    """A fusion a rule matched that the lane did not take, and the lane's reason."""

    rule: str
    cls: ClassId
    covers: tuple[int, ...]
    kind: str  # "decompose", "refuse" or "fits" (also where a lane's settling pass ran a fusion as its parts)
    reason: str


class Unmatched(NamedTuple):
    """A pattern that found its shape at the ops `covers` but did not fuse them, and why (explain mode only)."""

    rule: str
    covers: tuple[int, ...]
    reason: str


class Schedule:
    """Ops in order, each slot live or emptied by a fusion, with an index of which slots read and write each
    tensor: the rules ask for a value's readers and producer thousands of times a plan (an 8B's), and a scan of
    every slot each time was most of what planning took. The index follows a slot set in place and is built
    again, on the next question, after slots are spliced in (which moves the slots after them)."""

    def __init__(self, ops: Sequence[Op]) -> None:
        self.ops: list[Op | None] = list(ops)
        self._reads: dict[str, list[int]] | None = None  # by tensor, the slots that read it, ascending
        self._writes: dict[str, list[int]] | None = None  # by tensor, the slots that write it, ascending

    def __len__(self) -> int:
        return len(self.ops)

    def slot(self, i: int) -> Op | None:
        return self.ops[i]

    def get(self, i: int) -> Op:
        op = self.ops[i]
        if op is None:
            raise IndexError(f"slot {i} was fused away")
        return op

    def live(self) -> list[Op]:
        return [op for op in self.ops if op is not None]

    def set(self, i: int, op: Op | None) -> None:
        """Put `op` at slot `i` (None empties it), keeping the index."""
        if self._reads is not None and self._writes is not None:
            old = self.ops[i]
            if old is not None:
                _unindex(self._reads, facts.reads(old), i)
                _unindex(self._writes, facts.writes(old), i)
            if op is not None:
                _index(self._reads, facts.reads(op), i)
                _index(self._writes, facts.writes(op), i)
        self.ops[i] = op

    def splice(self, at: int, ops: Sequence[Op]) -> None:
        """Put `ops` in place of slot `at`, moving the slots after along."""
        self.ops[at : at + 1] = list(ops)
        self._reads = self._writes = None

    def insert(self, at: int, op: Op) -> None:
        """Put `op` in a new slot before slot `at`."""
        self.ops.insert(at, op)
        self._reads = self._writes = None

    def producer(self, name: str, before: int | None = None) -> int | None:
        """The last live op that writes `name` (before slot `before`: the value an op there reads)."""
        found = self._index()[1].get(name, [])
        end = len(found) if before is None else bisect.bisect_left(found, before)
        return found[end - 1] if end else None

    def readers(self, name: str) -> list[int]:
        """The live ops that read `name`."""
        return list(self._index()[0].get(name, ()))

    def _index(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        if self._reads is None or self._writes is None:
            self._reads, self._writes = {}, {}
            for i, op in enumerate(self.ops):
                if op is not None:
                    _index(self._reads, facts.reads(op), i)
                    _index(self._writes, facts.writes(op), i)
        return self._reads, self._writes


def _index(index: dict[str, list[int]], names: Sequence[str], i: int) -> None:
    for name in dict.fromkeys(names):
        bisect.insort(index.setdefault(name, []), i)


def _unindex(index: dict[str, list[int]], names: Sequence[str], i: int) -> None:
    for name in dict.fromkeys(names):
        index[name].remove(i)


@dataclass(slots=True)
class Rewriter:
    g: TensorGraph
    s: Schedule
    shim: Shim
    events: list[Fired | Missed] = field(default_factory=list)
    outputs: frozenset[str] = frozenset()
    explain: bool = False
    unmatched: list[Unmatched] = field(default_factory=list)

    def no_match(self, rule: str, slots: int | Sequence[int], reason: Callable[[], str | None]) -> None:
        """Record why `rule` let go of the ops at `slots`, when explaining; `reason` is only called then (and
        may answer None: nothing worth saying)."""
        if not self.explain:
            return
        text = reason()
        if text:
            members = [slots] if isinstance(slots, int) else slots
            covers = tuple(sorted(c for m in members if (op := self.s.slot(m)) is not None for c in op.covers))
            self.unmatched.append(Unmatched(rule, covers, text))

    def other_readers(self, name: str, taker: int) -> str:
        """Who besides the op at slot `taker` reads `name` (a failed match's reason)."""
        found = [f"op {k} ({self.s.get(k).out})" for k in self.s.readers(name) if k != taker]
        if name in self.outputs:
            found.append("the graph's output")
        return f"{name} is also read by {', '.join(found)}"

    def sole_reader(self, name: str) -> int | None:
        """The one op that reads `name`, where nothing else (no other op, no graph output) does."""
        found = self.s.readers(name)
        return found[0] if len(found) == 1 and name not in self.outputs else None

    def crossing(self, members: Sequence[int], at: int) -> str | None:
        """Why moving `members` to slot `at` would change what some op between sees, or None when legal."""
        group = set(members)
        for m in members:
            op = self.s.get(m)
            reads, writes = set(facts.reads(op)), set(facts.writes(op))
            lo, hi = sorted((m, at))
            for b in range(lo + 1, hi):
                between = self.s.slot(b)
                if b in group or between is None:
                    continue
                br, bw = set(facts.reads(between)), set(facts.writes(between))
                clash = (writes & (br | bw)) | (reads & bw)
                if clash:
                    return f"op {b} ({between.out}) between them touches {sorted(clash)[0]}"
        return None

    def candidate(
        self,
        cls: ClassId,
        members: Sequence[int],
        *,
        ins: Sequence[tuple[str, Access]] | None = None,
        out: str | None = None,
        dst: Dst | None = None,
        launches: int = 1,
    ) -> Op:
        """The fused op `members` would become: by default reading what its members read from outside, writing
        where the last member writes; run as `launches` kernel launches."""
        ops = [self.s.get(m) for m in sorted(members)]
        if ins is None:
            # a member reading a value before any member writes it (a state a later member updates) reads it
            # from outside
            made: set[str] = set()
            seen: dict[str, Access] = {}
            for op in ops:
                for name, access in zip(op.ins, op.access, strict=True):
                    if name not in made and name not in seen:
                        seen[name] = access
                made.update(facts.writes(op))
            ins = list(seen.items())
        last = ops[-1]
        covers = tuple(sorted(c for op in ops for c in op.covers))
        return Op(
            Fused(cls, tuple(ops), launches),
            tuple(n for n, _ in ins),
            tuple(a for _, a in ins),
            out if out is not None else last.out,
            dst if dst is not None else last.dst,
            covers,
        )

    def try_fuse(self, rule: str, cls: ClassId, members: Sequence[int], at: int, **build) -> bool:
        """Fuse `members` into one op of `cls` at slot `at`, if legal and the lane runs it; record either way."""
        crossing = self.crossing(members, at)
        if crossing is not None:
            self.no_match(rule, members, lambda: f"cannot move the ops together: {crossing}")
            return False
        op = self.candidate(cls, members, **build)
        support = self.shim.supports(cls)
        if support.kind is not SupportKind.NATIVE:
            reason = support.reason or "the lane runs it as its parts"
            self.events.append(Missed(rule, cls, op.covers, support.kind.value, reason))
            return False
        why = self.shim.fits(op, self.g)
        if why is not None:
            self.events.append(Missed(rule, cls, op.covers, "fits", why))
            return False
        self.place(rule, op, members, at)
        return True

    def place(self, rule: str, op: Op, members: Sequence[int], at: int) -> None:
        """Put `op` at slot `at` and empty the other members' slots."""
        for m in members:
            self.s.set(m, None)
        self.s.set(at, op)
        assert isinstance(op.sym, Fused)
        self.events.append(Fired(rule, op.sym.cls, op.covers))

    def split(self, rule: str, at: int, ops: Sequence[Op], reason: str, undone: Sequence[Op] = ()) -> None:
        """Run the fused op at slot `at` as `ops` (its parts, or its parts regrouped), in order, in its place: a
        lane's settling pass taking back a fusion its kernels run only in other shapes. Each fusion taken back
        (`undone`; by default the op itself) is recorded as a miss for `fits`: the lane has no launch for it
        here."""
        op = self.s.get(at)
        self.s.splice(at, ops)
        for gone in undone or (op,):
            assert isinstance(gone.sym, Fused)
            self.events.append(Missed(rule, gone.sym.cls, gone.covers, "fits", reason))

    def insert(self, at: int, op: Op) -> None:
        """Put a lane's own op (one no model emits, covering none of the graph's) at slot `at`, before what is
        there."""
        self.s.insert(at, op)

    def fuse(
        self, rule: str, cls: ClassId, at: int, others: Sequence[int], ins, out: str, dst: Dst, launches: int = 1
    ) -> None:
        """Fuse unconditionally: a lane rule that has already asked itself (and sized its `launches`)."""
        members = [at, *others]
        self.place(rule, self.candidate(cls, members, ins=ins, out=out, dst=dst, launches=launches), members, at)


def whole(names: Sequence[str]) -> list[tuple[str, Access]]:
    return [(n, WHOLE) for n in names]


Pattern = Callable[[Rewriter, int], None]
