"""What a chat template may spend while it renders: time, steps, the size of what it builds, and total work.

A chat template is code that came with a downloaded file. Jinja2's sandbox stops it from reaching Python's
internals, but not from working: nested loops that write nothing, a string doubled forty times, a width of
10**9 in a format spec. `Meter` is the account one render draws on; the sandbox (`fuselane.text.sandbox`)
charges it at every loop iteration, call, output and operator, and checks the size of every value before it
is built where Python would build it in one C call. Whichever limit is reached first ends the render with
`BudgetExceeded`, long before the machine is out of time or memory.

Sizes are measured in units: a character of a string, a byte of bytes or of an integer, and `ITEM_UNITS` for
each slot of a list, tuple or dict plus the sizes of what it holds (so a list of one string repeated a million
times is as large as the million strings its repr or its JSON would spell). Sizes of immutable containers are
cached for the render, so measuring a value built from measured parts costs its own length only.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from dataclasses import dataclass
from typing import Any

import jinja2.utils
from jinja2.exceptions import SecurityError

ITEM_UNITS = 16  # a list slot and the object it usually points to, in units of one character
# str(container) spells at most this many characters a unit: quotes, separators, escapes like \U0001f600
REPR_UNITS = 10
_CACHE_MIN = 64  # smaller containers are measured again each time: cheaper than a cache entry
_SCALARS = (bool, float, type(None))


@dataclass(frozen=True, slots=True)
class RenderBudget:
    """Limits of one render. Real chat templates stay far below each; the defaults bound a hostile one to
    about a second and a few hundred MB.

    `value_units`, `work_units` and `output_chars` grow with the conversation rendered (`scaled`), so a long
    prompt is limited by the context, not by the template's budget.
    """

    seconds: float = 1.5  # wall-clock time of one render
    steps: int = 1 << 19  # loop iterations, calls, filter and output statements
    value_units: int = 8 << 20  # size of any one value the template builds
    work_units: int = 64 << 20  # sizes of all values built, copied, compared and written, together
    output_chars: int = 8 << 20  # characters of the rendered prompt
    int_bits: int = 1 << 16  # bits of any integer the template computes
    depth: int = 256  # nesting of lists, dicts and namespaces a value may have
    # how many times the size of the conversation the template may build, work on and write
    input_factor: int = 4
    work_factor: int = 32
    step_divisor: int = 4  # a conversation of n units may take n / step_divisor steps

    def scaled(self, input_units: int) -> RenderBudget:
        """This budget, raised where needed so a conversation of `input_units` fits several times over."""
        return RenderBudget(
            seconds=self.seconds,
            steps=max(self.steps, input_units // self.step_divisor),
            value_units=max(self.value_units, self.input_factor * input_units),
            work_units=max(self.work_units, self.work_factor * input_units),
            output_chars=max(self.output_chars, self.input_factor * input_units),
            int_bits=self.int_bits,
            depth=self.depth,
            input_factor=self.input_factor,
            work_factor=self.work_factor,
            step_divisor=self.step_divisor,
        )


class BudgetExceeded(SecurityError):
    """A render ran past one of its `RenderBudget` limits."""


class Meter:
    """The account of one render: steps, work and the deadline, and the sizes of values seen so far."""

    __slots__ = ("budget", "steps", "work", "_deadline", "_sizes")

    def __init__(self, budget: RenderBudget) -> None:
        self.budget = budget
        self.steps = 0
        self.work = 0
        self._deadline = time.monotonic() + budget.seconds
        # id -> (the object, kept alive so its id is not reused; its size)
        self._sizes: dict[int, tuple[Any, int]] = {}

    def tick(self, steps: int = 1) -> None:
        """Count `steps` (loop iterations, calls, outputs) and check the step limit and the deadline."""
        self.steps += steps
        if self.steps > self.budget.steps:
            raise BudgetExceeded(
                f"it ran past {self.budget.steps} steps (loop iterations, calls, outputs, filters' work)"
            )
        if time.monotonic() > self._deadline:
            raise BudgetExceeded(f"it ran past {self.budget.seconds:g} seconds")

    def charge(self, units: int) -> None:
        """Count `units` of work (building, copying, comparing or writing that much)."""
        self.work += units
        if self.work > self.budget.work_units:
            raise BudgetExceeded(f"it did more than {self.budget.work_units} units of work (building and copying)")
        if time.monotonic() > self._deadline:
            raise BudgetExceeded(f"it ran past {self.budget.seconds:g} seconds")

    def allow(self, units: int, what: str = "a value") -> None:
        """Refuse to build `what` of `units` when that passes the limit of one value."""
        if units > self.budget.value_units:
            raise BudgetExceeded(f"{what} would be {units} units, more than the {self.budget.value_units} allowed")

    def allow_int(self, bits: int) -> None:
        if bits > self.budget.int_bits:
            raise BudgetExceeded(f"an integer would have {bits} bits, more than the {self.budget.int_bits} allowed")

    def built(self, value: Any) -> Any:
        """`value`, just made by the template: checked against the value limit, charged, and returned; an
        iterator comes back metered, so that consuming it counts as steps."""
        if isinstance(value, Iterator) and not isinstance(value, MeteredIterator):
            return MeteredIterator(self, value, fresh=True)
        units = self.size(value)
        self.allow(units)
        self.charge(units)
        return value

    def printable(self, value: Any) -> int:
        """Units that `str(value)` may spell: a string's length, or a bound for anything else."""
        if isinstance(value, str):
            return len(value)
        units = REPR_UNITS * self.size(value)
        self.allow(units, "the text of a value")
        return units

    def size(self, value: Any) -> int:
        """The size of `value` in units (see the module docstring)."""
        if isinstance(value, str | bytes):
            return len(value)
        if isinstance(value, int):
            return value.bit_length() // 8 + 1
        if isinstance(value, _SCALARS):
            return 1
        if isinstance(value, list | tuple | dict | jinja2.utils.Namespace):
            return self._walk(value, 0, set())[0]
        if isinstance(value, KeysView | ValuesView | ItemsView):
            return ITEM_UNITS * len(value)
        return 1

    def _walk(self, value: Any, depth: int, active: set[int]) -> tuple[int, bool]:
        """(size, whether a namespace was met): namespaces can change, so what holds one is never cached."""
        key = id(value)
        hit = self._sizes.get(key)
        if hit is not None:
            return hit[1], False
        if depth > self.budget.depth:
            raise BudgetExceeded(f"a value is nested more than {self.budget.depth} levels deep")
        if key in active:  # a namespace that holds itself: its repr prints it once
            return 1, True
        mutable = isinstance(value, jinja2.utils.Namespace)
        if mutable:
            items: Any = value._Namespace__attrs  # type: ignore[attr-defined]
        else:
            items = value
        if isinstance(items, dict):
            parts = [*items.keys(), *items.values()]
            total = 2 * ITEM_UNITS * len(items)
        else:
            parts = items
            total = ITEM_UNITS * len(items)
        self.charge(len(parts))
        active.add(key)
        for part in parts:
            if isinstance(part, str | bytes):
                total += len(part)
            elif isinstance(part, list | tuple | dict | jinja2.utils.Namespace):
                units, seen = self._walk(part, depth + 1, active)
                total += units
                mutable = mutable or seen
            else:
                total += self.size(part)
            if total > self.budget.work_units:
                break  # far past any limit already: the caller refuses it
        active.discard(key)
        if not mutable and total >= _CACHE_MIN:
            self._sizes[key] = (value, total)
        return total, mutable


class MeteredIterator:
    """An iterator that counts a step for each item; `fresh` items (made by a filter or generator, not read
    from an existing list) are charged and checked too. `len` passes through where the source has one."""

    __slots__ = ("_meter", "_source", "_iterator", "_fresh")

    def __init__(self, meter: Meter, source: Any, *, fresh: bool = False) -> None:
        self._meter = meter
        self._source = source
        self._iterator = iter(source)
        self._fresh = fresh

    def __iter__(self) -> MeteredIterator:
        return self

    def __next__(self) -> Any:
        self._meter.tick()
        item = next(self._iterator)
        if self._fresh and not isinstance(item, (*_SCALARS, int)):
            units = self._meter.size(item)
            self._meter.allow(units)
            self._meter.charge(units)
        return item

    def __len__(self) -> int:
        return len(self._source)  # TypeError for a generator: Jinja's loop then counts by consuming us


_CURRENT: contextvars.ContextVar[Meter | None] = contextvars.ContextVar("fuselane_render_meter", default=None)


def current() -> Meter:
    """The meter of the render in progress; outside a render (Jinja folding constants while it compiles), a
    fresh default one, so that every size check still applies."""
    meter = _CURRENT.get()
    return meter if meter is not None else Meter(RenderBudget())


def activate(meter: Meter) -> contextvars.Token:
    """Make `meter` the current one; pass the token to `deactivate` when the render ends."""
    return _CURRENT.set(meter)


def deactivate(token: contextvars.Token) -> None:
    _CURRENT.reset(token)
