"""Size checks made before a template's call runs: what a method, filter or format would build, from its
arguments, so that a width of 10**9 or a replace that squares a string is refused before Python allocates it.

Each check takes the render's `Meter` and the call's arguments, and raises `BudgetExceeded` when the result
would pass the limit of one value. Operations whose result is at most a small multiple of their input need
no check here: the sandbox measures every result after the call (`Meter.built`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.filters
import jinja2.utils

from fuselane.text.budget import ITEM_UNITS, BudgetExceeded, Meter, current

# Digits in a format spec: `{:>1000000000}` and `{:.999999999f}` ask for that many characters.
_SPEC_NUMBER = re.compile(r"\d+")
# One %-conversion: %(key)-08.3f, %*d, %%.
_PERCENT = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+)?)?[hlL]?(.)", re.DOTALL)
_MAX_SPEC_DIGITS = 9  # a width of more digits is past any limit; int() of it is not even tried
# Line boundaries str.splitlines knows.
_LINE_BREAKS = ("\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")
_STRFTIME_CHARS = 256  # a date pattern longer than this is not a date pattern
_LIPSUM_WORD_UNITS = 12  # characters a lorem-ipsum word takes, with its separator, at most


def int_arguments(meter: Meter, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Refuse any integer argument larger than a value may be: every width, count and length parameter of
    Python's and Jinja's functions would otherwise build something that large."""
    limit = meter.budget.value_units
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise BudgetExceeded(f"an argument of {value} is larger than the {limit} a value may be")


def format_spec(meter: Meter, spec: str) -> None:
    """A `format()` spec's width and precision, refused when past the value limit."""
    for digits in _SPEC_NUMBER.findall(spec):
        if len(digits) > _MAX_SPEC_DIGITS:
            meter.allow(meter.budget.value_units + 1, "a formatted field")
        meter.allow(int(digits), "a formatted field")


def percent(meter: Meter, fmt: str | bytes, args: Any) -> None:
    """`fmt % args`: the literal text, each conversion's width and precision and the text of its argument."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    positional = list(args) if isinstance(args, tuple) else [args]
    mapping = args if isinstance(args, Mapping) else None
    need, index = len(text), 0
    for match in _PERCENT.finditer(text):
        key, width, precision, conversion = match.groups()
        if conversion == "%":
            continue
        for number in (width, precision):
            if number == "*":
                if index < len(positional) and isinstance(positional[index], int):
                    need += abs(positional[index])
                index += 1
            elif number:
                if len(number) > _MAX_SPEC_DIGITS:
                    meter.allow(meter.budget.value_units + 1, "a formatted string")
                need += int(number)
        if key is not None and mapping is not None:
            need += meter.printable(mapping.get(key, ""))
        elif index < len(positional):
            need += meter.printable(positional[index])
            index += 1
        if need > meter.budget.value_units:
            break
    meter.allow(need, "a formatted string")


# --- methods of str and bytes -----------------------------------------------------------------------------


def _width(meter: Meter, receiver: Any, width: Any = 0, *_: Any) -> None:
    if isinstance(width, int):
        meter.allow(max(width, len(receiver)), "a padded string")


def _expandtabs(meter: Meter, receiver: Any, tabsize: Any = 8) -> None:
    tab = "\t" if isinstance(receiver, str) else b"\t"
    if isinstance(tabsize, int):
        meter.allow(len(receiver) + receiver.count(tab) * max(tabsize, 0), "an expanded string")


def _replace(meter: Meter, receiver: Any, old: Any = "", new: Any = "", count: Any = -1) -> None:
    if not isinstance(old, str | bytes) or not isinstance(new, str | bytes):
        return
    found = receiver.count(old) if old else len(receiver) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    meter.allow(len(receiver) + found * max(len(new) - len(old), 0), "a replaced string")


def _split(meter: Meter, receiver: Any, sep: Any = None, maxsplit: Any = -1) -> None:
    pieces = receiver.count(sep) + 1 if isinstance(sep, str | bytes) and sep else len(receiver) // 2 + 1
    if isinstance(maxsplit, int) and maxsplit >= 0:
        pieces = min(pieces, maxsplit + 1)
    meter.allow(len(receiver) + ITEM_UNITS * pieces, "a split string")


def _splitlines(meter: Meter, receiver: Any, *_: Any) -> None:
    breaks = _LINE_BREAKS if isinstance(receiver, str) else (b"\n", b"\r")
    pieces = sum(map(receiver.count, breaks)) + 1
    meter.allow(len(receiver) + ITEM_UNITS * pieces, "a split string")


def _translate(meter: Meter, receiver: Any, table: Any = None, *_: Any) -> None:
    if isinstance(table, Mapping):
        longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
        meter.allow(len(receiver) * max(longest, 1), "a translated string")


def _to_bytes(meter: Meter, receiver: Any, length: Any = 1, *_: Any, **__: Any) -> None:
    if isinstance(length, int):
        meter.allow(length, "bytes")


METHOD_CHECKS: Mapping[str, Callable[..., None]] = {
    "center": _width,
    "ljust": _width,
    "rjust": _width,
    "zfill": _width,
    "expandtabs": _expandtabs,
    "replace": _replace,
    "split": _split,
    "rsplit": _split,
    "splitlines": _splitlines,
    "translate": _translate,
    "to_bytes": _to_bytes,
}


def joined(meter: Meter, separator: Any, items: Sequence[Any]) -> None:
    """`separator.join(items)`, `items` a list or a string (joined character by character)."""
    text = sum(map(meter.printable, items)) if not isinstance(items, str | bytes) else len(items)
    need = text + len(separator) * max(len(items) - 1, 0)
    meter.allow(need, "a joined string")


# --- filters ----------------------------------------------------------------------------------------------


def _center(meter: Meter, value: Any, width: Any = 80, *_: Any, **__: Any) -> None:
    if isinstance(width, int):
        meter.allow(max(width, meter.printable(value)), "a centred string")


def _indent(meter: Meter, value: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    text = meter.printable(value)
    lines = str(value).count("\n") + 1 if isinstance(value, str) else text
    meter.allow(text + lines * max(pad, 0), "an indented string")


_WRAPSTRING_AT = 2  # wordwrap(s, width, break_long_words, wrapstring, ...)


def _wordwrap(meter: Meter, value: Any, *args: Any, **kwargs: Any) -> None:
    wrap = kwargs.get("wrapstring", args[_WRAPSTRING_AT] if len(args) > _WRAPSTRING_AT else None)
    text = meter.printable(value)
    meter.allow(text * (1 + (len(wrap) if isinstance(wrap, str) else 1)), "a wrapped string")


def _replace_filter(meter: Meter, value: Any, old: Any = "", new: Any = "", count: Any = None, **_: Any) -> None:
    if isinstance(value, str):
        _replace(meter, value, str(old), str(new), -1 if count is None else count)


def _format_filter(meter: Meter, value: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str):
        percent(meter, value, kwargs or args)


def _listing(meter: Meter, value: Any, *_: Any, **__: Any) -> None:
    if isinstance(value, str | bytes):
        meter.allow(ITEM_UNITS * len(value), "a list of characters")


def _text(meter: Meter, value: Any, *_: Any, **__: Any) -> None:
    meter.printable(value)


FILTER_CHECKS: Mapping[str, Callable[..., None]] = {
    "center": _center,
    "indent": _indent,
    "wordwrap": _wordwrap,
    "replace": _replace_filter,
    "format": _format_filter,
    "list": _listing,
    "sort": _listing,
    "unique": _listing,
    "string": _text,
    "pprint": _text,
}


def _per_unit(steps: float) -> Callable[[Meter, Any, int], int]:
    return lambda meter, value, units: int(units * steps)


def _striptags(meter: Meter, value: Any, units: int) -> int:
    # markupsafe removes one tag at a time, copying the rest of the text each time
    if not isinstance(value, str):
        meter.printable(value)  # it strips the value's text: refused first if that would be too large
    text = value if isinstance(value, str) else str(value)
    return (text.count("<") + 1) * units // _COPY_CHARS_PER_STEP


_COPY_CHARS_PER_STEP = 64
# Steps a filter costs for an input of `units`, beyond its own one step: what it does in Python per character
# or per item, measured as about a microsecond a step. Filters not named here run at C speed over their input.
FILTER_STEPS: Mapping[str, Callable[[Meter, Any, int], int]] = {
    "urlize": _per_unit(2),
    "title": _per_unit(1 / 4),
    "wordwrap": _per_unit(1 / 2),
    "wordcount": _per_unit(1 / 16),
    "striptags": _striptags,
    "xmlattr": _per_unit(1 / 2),
    "pprint": _per_unit(1 / 4),
    "dictsort": _per_unit(1 / 8),
    "groupby": _per_unit(1 / 8),
    "sort": _per_unit(1 / 8),
    "unique": _per_unit(1 / 8),
    "tojson": _per_unit(1 / 8),
    "urlencode": _per_unit(1 / 8),
}
DEFAULT_FILTER_STEPS = _per_unit(1 / _COPY_CHARS_PER_STEP)

# Filters whose cost does not grow with their input; every other filter is charged the size of its input.
CHEAP_FILTERS = frozenset(
    {
        *("length", "count", "first", "last", "default", "d", "attr", "abs", "int", "float", "bool", "round"),
        *("random", "safe", "filesizeformat", "items", "batch", "slice", "map", "select", "reject", "selectattr"),
        "rejectattr",
    }
)


def sized_join(join: Callable[..., str]) -> Callable[..., str]:
    """Jinja's `join` filter, over a list it can measure first (a generator is consumed, metered, into one)."""

    @jinja2.pass_eval_context
    def do_join(eval_ctx: Any, value: Any, d: Any = "", attribute: Any = None) -> str:
        meter = current()
        items = value if isinstance(value, str) else list(value)  # a generator is consumed, metered
        if attribute is None:
            joined(meter, str(d), items)
        else:
            meter.allow(meter.size(items) * 2 + len(str(d)) * len(items), "a joined string")
        return join(eval_ctx, items, d, attribute)

    return do_join


@jinja2.pass_environment
def sized_sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's `sum` filter, adding with the sandbox's metered `+` so summing lists cannot go quadratic."""
    if attribute is not None:
        getter = jinja2.filters.make_attrgetter(environment, attribute)
        iterable = map(getter, iterable)
    total = start
    for item in iterable:
        total = environment.call_binop(None, "+", total, item)
    return total


def tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """JSON as `json.dumps` writes it (not Jinja's HTML-safe `tojson`, so chat templates render as in HF),
    streamed and stopped at the value limit: nesting and indent multiply a value's size."""
    meter = current()
    if isinstance(indent, str):
        meter.allow(len(indent), "a JSON indent")
    elif isinstance(indent, int):
        meter.allow(indent, "a JSON indent")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    pieces, length = [], 0
    for piece in encoder.iterencode(value):
        length += len(piece)
        meter.allow(length, "a JSON text")
        pieces.append(piece)
    return "".join(pieces)


def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (Jinja's names)
    """Jinja's `lipsum`, refused when it would write more words than the render has steps or room for."""
    meter = current()
    words = n * max if isinstance(n, int) and isinstance(max, int) and n > 0 and max > 0 else 0
    meter.allow(words * _LIPSUM_WORD_UNITS, "lorem ipsum")
    meter.tick(words)  # it writes word by word in Python: a step each
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


def strftime_now(pattern: str) -> str:
    """The local time in `pattern`, as HF's templates get it; a pattern is short, so a long one is refused."""
    if len(pattern) > _STRFTIME_CHARS:
        raise BudgetExceeded(f"a date pattern of {len(pattern)} characters is longer than {_STRFTIME_CHARS}")
    return datetime.now().strftime(pattern)
