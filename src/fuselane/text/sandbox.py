"""The Jinja2 environment chat templates run in: Jinja's immutable sandbox, strict, and metered.

Jinja2's `ImmutableSandboxedEnvironment` keeps a template away from Python's internals (no underscore
attributes, no mutating methods). It does not keep it from spending: it will run `range(10**5)` nested three
deep, double a string forty times, or format with a width of 10**9. `Sandbox` meters the template's work
against the render's `Meter` (`fuselane.text.budget`) at every place Jinja lets code spend:

* every `for` loop iterates through a `MeteredIterator` (a step per item; `loop(...)` of a recursive loop too);
* every call (functions, methods, macros, `caller()`) and filter is a step; its arguments are checked before it
  runs (`fuselane.text.sized`: widths, counts, replace and join results) and its result is measured after;
* every operator (`+ - * / // % **`), `~` concatenation, comparison operand and list, tuple or dict literal is
  checked for the size of what it would build and charged for it; integers are capped in bits;
* every output statement is charged for what it writes, and `str.format` fields for their width and text.

Configured otherwise as Hugging Face's `apply_chat_template` configures Jinja (trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), so a template renders
here exactly as it renders there. Where Jinja2's sandbox would quietly render an unsafe attribute as an empty
string, this one refuses.
"""

from __future__ import annotations

import functools
import string
import types
from collections.abc import Callable
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.runtime import LoopContext, markup_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.visitor import NodeTransformer
from markupsafe import EscapeFormatter, Markup

from fuselane.text import sized
from fuselane.text.budget import ITEM_UNITS, MeteredIterator, current

_SEQUENCES = (str, bytes, list, tuple)
_ESCAPED_UNITS = 5  # HTML escaping writes at most five characters for one (&amp;)
# Tests that compare their arguments: each costs as much as its operands are large.
_COMPARING_TESTS = frozenset(
    {"==", "eq", "equalto", "!=", "ne", "<", "lt", "lessthan", "<=", "le", ">", "gt", "greaterthan", ">=", "ge", "in"}
)
_JINJA_KEYWORDS = frozenset({"_loop_vars", "_block_vars"})
_HOOKS = frozenset(
    {"meter_iter", "meter_concat", "meter_markup_concat", "meter_compare", "meter_value", "meter_output"}
)


class TemplateRaised(TemplateError):
    """The template called `raise_exception`: it refuses this conversation."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(str(message))


class _SafeDict:
    """`dict(...)` for templates, without handing them the `dict` type itself (and its class machinery)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """A Jinja `namespace` refusing underscore attributes: `{% set ns.__x = ... %}` cannot reach internals."""

    # No named `self`, as in Jinja's own Namespace, so that `namespace(self=...)` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        current().tick()  # the value was measured when it was built; what holds a namespace is measured anew
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant text for training; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _hook(name: str, lineno: int | None, *args: nodes.Expr) -> nodes.Call:
    """A call of the environment's metering method `name` (compiled as `environment.<name>(...)`)."""
    return nodes.Call(nodes.EnvironmentAttribute(name), list(args), [], None, None, lineno=lineno)


def _constant(node: nodes.Node) -> bool:
    return isinstance(node, nodes.Const | nodes.TemplateData)


class _Metering(NodeTransformer):
    """Rewrites a parsed template so that its loops, concatenations, comparisons, literals and outputs go
    through the environment's `meter_*` hooks; everything else already passes through the sandbox."""

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__()
        self._environment = environment
        # inside `{% autoescape true %}`, `~` joins as Jinja's markup_join does (escaping what is not safe)
        self._escaping = [False]

    def visit_ScopedEvalContextModifier(self, node: nodes.ScopedEvalContextModifier) -> nodes.Node:
        setting = next((option.value for option in node.options if option.key == "autoescape"), None)
        if setting is None:
            self._escaping.append(self._escaping[-1])
        else:  # a setting known only at run time may turn escaping on: join as if it did
            self._escaping.append(not isinstance(setting, nodes.Const) or bool(setting.value))
        try:
            return self.generic_visit(node)
        finally:
            self._escaping.pop()

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _hook("meter_iter", node.lineno, node.iter)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        try:  # constants Jinja folds while compiling (metered then): left to it, so they join as Jinja joins them
            node.as_const(nodes.EvalContext(self._environment))
            return node
        except nodes.Impossible:
            pass
        return _hook("meter_markup_concat" if self._escaping[-1] else "meter_concat", node.lineno, *node.nodes)

    def visit_Compare(self, node: nodes.Compare) -> nodes.Node:
        self.generic_visit(node)
        if not _constant(node.expr):
            node.expr = _hook("meter_compare", node.lineno, node.expr)
        for operand in node.ops:
            if not _constant(operand.expr):
                operand.expr = _hook("meter_compare", node.lineno, operand.expr)
        return node

    def _literal(self, node: nodes.Expr, items: list[nodes.Node]) -> nodes.Node:
        self.generic_visit(node)
        return node if all(map(_constant, items)) else _hook("meter_value", node.lineno, node)

    def visit_List(self, node: nodes.List) -> nodes.Node:
        return self._literal(node, node.items)

    def visit_Tuple(self, node: nodes.Tuple) -> nodes.Node:
        if node.ctx != "load":  # an assignment target, not a value
            return self.generic_visit(node)
        return self._literal(node, node.items)

    def visit_Dict(self, node: nodes.Dict) -> nodes.Node:
        return self._literal(node, [part for pair in node.items for part in (pair.key, pair.value)])

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        self.generic_visit(node)
        # Jinja compiles a slice to Python's own subscript, past the sandbox's getitem: measure the copy.
        return _hook("meter_value", node.lineno, node) if isinstance(node.arg, nodes.Slice) else node

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        text = sum(len(child.data) for child in node.nodes if isinstance(child, nodes.TemplateData))
        node.nodes.insert(0, _hook("meter_output", node.lineno, nodes.Const(text)))
        return node


class _SizedFormatter(SandboxedFormatter):
    """`str.format` in the sandbox, with each field's width and text checked and the whole result capped."""

    def __init__(self, env: jinja2.Environment, **kwargs: Any) -> None:
        super().__init__(env, **kwargs)
        self._length = 0

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._length = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        meter = current()
        sized.format_spec(meter, format_spec)
        meter.printable(value)
        text = super().format_field(value, format_spec)
        self._length += len(text)
        meter.allow(self._length, "a formatted string")
        meter.charge(len(text))
        return text


class _SizedEscapeFormatter(_SizedFormatter, EscapeFormatter):
    pass


class Sandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox, made strict (unsafe access raises) and metered (see the module docstring)."""

    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=self._finalize, **options)
        self.filters["tojson"] = sized.tojson
        self.filters["join"] = sized.sized_join(self.filters["join"])
        self.filters["sum"] = sized.sized_sum
        self.filters = {name: _sized_filter(name, f) for name, f in self.filters.items()}
        self.tests = {name: _sized_test(name, t) for name, t in self.tests.items()}
        self.globals["lipsum"] = sized.lipsum

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _Metering(self).visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja returns an Undefined that prints as '' and raises only when used further; a template probing
        # for `__class__` should fail loudly instead of rendering a prompt with a hole in it.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is not allowed")

    # --- the sandbox's own hooks --------------------------------------------------------------------------

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's form)
        if getattr(__obj, "__self__", None) is __self and getattr(__obj, "__name__", "") in _HOOKS:
            return __obj(*args)  # keywords are only Jinja's own (_loop_vars, _block_vars)
        meter = current()
        meter.tick()
        if not __self.is_safe_callable(__obj):
            raise SecurityError(f"{__obj!r} is not safely callable")
        if isinstance(__obj, LoopContext) and args:  # the body of a recursive loop, on new items
            args = (MeteredIterator(meter, args[0]), *args[1:])
        # Jinja adds its own _loop_vars / _block_vars for callables that take the context; they are not arguments
        given = {key: value for key, value in kwargs.items() if key not in _JINJA_KEYWORDS}
        sized.int_arguments(meter, args, given)
        receiver = getattr(__obj, "__self__", None)
        # str's own methods, and Markup's Python wrappers of them
        method = isinstance(__obj, types.BuiltinMethodType | types.MethodType)
        if method and isinstance(receiver, (*_SEQUENCES, dict, int)):
            name = __obj.__name__
            if name == "join" and isinstance(receiver, str | bytes) and args:
                if not isinstance(args[0], str | bytes):  # measured as a list (a generator is consumed, metered)
                    args = (list(args[0]), *args[1:])
                sized.joined(meter, receiver, args[0])
            check = sized.METHOD_CHECKS.get(name)
            if check is not None and isinstance(receiver, str | bytes | int):
                check(meter, receiver, *args, **given)
            meter.charge(meter.size(receiver))
        return meter.built(__context.call(__obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        meter = current()
        if operator == "+" and isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
            meter.allow(meter.size(left) + meter.size(right))
        elif operator == "*":
            self._check_product(left, right)
        elif operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            # a lower bound of the result's bits, within a factor of two of the truth
            meter.allow_int(max(abs(left).bit_length() - 1, 1) * right)
        elif operator == "%" and isinstance(left, str | bytes):
            sized.percent(meter, left, right)
        return meter.built(self.binop_table[operator](left, right))

    @staticmethod
    def _check_product(left: Any, right: Any) -> None:
        meter = current()
        if _is_int(left) and _is_int(right):
            meter.allow_int(left.bit_length() + right.bit_length())
            return
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, _SEQUENCES) and _is_int(count):
                meter.allow(meter.size(sequence) * max(count, 0), "a repetition")

    def getitem(self, obj: Any, argument: Any) -> Any:
        if isinstance(argument, slice) and isinstance(obj, _SEQUENCES):
            taken = len(range(*argument.indices(len(obj))))
            current().charge(taken if isinstance(obj, str | bytes) else ITEM_UNITS * taken)
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """`str.format` and `str.format_map`, as Jinja's sandbox wraps them, with a sized formatter."""
        if not isinstance(value, types.MethodType | types.BuiltinMethodType) or value.__name__ not in (
            "format",
            "format_map",
        ):
            return None
        f_self: Any = value.__self__
        if not isinstance(f_self, str):
            return None
        str_type: type[str] = type(f_self)
        is_format_map = value.__name__ == "format_map"
        if isinstance(f_self, Markup):
            formatter: string.Formatter = _SizedEscapeFormatter(self, escape=f_self.escape)
        else:
            formatter = _SizedFormatter(self)

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                kwargs, args = args[0], ()
            return str_type(formatter.vformat(f_self, args, kwargs))

        return functools.update_wrapper(wrapper, value)

    # --- hooks the rewritten template calls (see _Metering) ----------------------------------------------

    def meter_iter(self, iterable: Any) -> Any:
        return iterable if isinstance(iterable, MeteredIterator) else MeteredIterator(current(), iterable)

    def meter_concat(self, *items: Any) -> str:
        meter = current()
        meter.allow(sum(map(meter.printable, items)), "a concatenation")
        return meter.built("".join(map(str, items)))

    def meter_markup_concat(self, *items: Any) -> str:
        meter = current()
        meter.allow(sum(map(meter.printable, items)) * _ESCAPED_UNITS, "a concatenation")
        return meter.built(markup_join(items))

    def meter_compare(self, value: Any) -> Any:
        if not isinstance(value, int | float | bool | type(None)):
            meter = current()
            meter.charge(meter.size(value))
        return value

    def meter_value(self, value: Any) -> Any:
        return current().built(value)

    def meter_output(self, text_chars: int) -> str:
        meter = current()
        meter.tick()
        meter.charge(text_chars)
        return ""

    def _finalize(self, value: Any) -> Any:
        meter = current()
        meter.charge(meter.printable(value))
        return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int)


def _sized_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, a filter, as a metered step: its arguments checked, its input charged, its result measured."""
    offset = 0 if jinja2.utils._PassArg.from_obj(function) is None else 1
    check = sized.FILTER_CHECKS.get(name)
    cheap = name in sized.CHEAP_FILTERS
    steps = sized.FILTER_STEPS.get(name, sized.DEFAULT_FILTER_STEPS)

    @functools.wraps(function)  # keeps Jinja's pass_context/pass_environment mark
    def filtered(*args: Any, **kwargs: Any) -> Any:
        meter = current()
        meter.tick()
        given = args[offset:]
        if given:
            sized.int_arguments(meter, given[1:], kwargs)
            if check is not None:
                check(meter, *given, **kwargs)
            if not cheap:
                units = meter.size(given[0])
                meter.tick(steps(meter, given[0], units))  # before it runs: a filter cannot be stopped midway
                meter.charge(units)
        return meter.built(function(*args, **kwargs))

    return filtered


def _sized_test(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, a test, as a metered step; comparing tests are charged for their operands."""
    offset = 0 if jinja2.utils._PassArg.from_obj(function) is None else 1
    comparing = name in _COMPARING_TESTS

    @functools.wraps(function)
    def tested(*args: Any, **kwargs: Any) -> Any:
        meter = current()
        meter.tick()
        if comparing:
            meter.charge(sum(map(meter.size, args[offset:])))
        return function(*args, **kwargs)

    return tested


def environment() -> Sandbox:
    """A fresh sandbox configured as transformers configures Jinja for chat templates."""
    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = sized.strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _SafeNamespace
    return env
