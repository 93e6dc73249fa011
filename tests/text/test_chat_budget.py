"""The render budget: every way a template can spend time or memory ends in one line, quickly; real work does not.

Each bomb below is a kind of work Jinja lets a template do (loops, recursion, string and list growth, integer
arithmetic, format widths, width-taking filters and methods, generators, comparisons, shared structure). Through
the Python API each must raise a one-line `FuselaneError` within `FAST` seconds; `tests/test_hostile_text.py`
runs them through the command under a memory limit. The legitimate cases next to them are the same operations
at sizes real templates use, which must still render.
"""

from __future__ import annotations

import time

import pytest

from fuselane.errors import FuselaneError
from fuselane.text.budget import RenderBudget
from fuselane.text.chat import ChatTemplate

FAST = 3.0  # seconds: the budget's 1.5 s deadline and some slack for a loaded machine
MESSAGES = [{"role": "user", "content": "hi"}]


def growing(init: str, step: str, times: int, then: str = "") -> str:
    """A template setting `ns.s` (first `init`) to `step` (which reads `ns.s`) `times` times, then `then`."""
    loop = f"{{% for i in range({times}) %}}{{% set ns.s = {step} %}}{{% endfor %}}"
    return f"{{% set ns = namespace(s={init}) %}}{loop}{then}"


def nested(body: str, outer: str = "range(100000)", setup: str = "") -> str:
    """`body` inside two loops, 10**5 by `outer` items, after `setup`."""
    return f"{setup}{{% for a in {outer} %}}{{% for b in range(100000) %}}{body}{{% endfor %}}{{% endfor %}}"


# A bomb per kind of work: name -> template.
BOMBS = {
    "nested empty loops": nested(""),
    "lipsum": "{{ lipsum(n=10**7) }}",
    "lipsum under the argument limit": "{{ lipsum(n=100000, html=false) }}",
    "string doubled with ~": growing("'x'", "ns.s ~ ns.s", 40),
    "string doubled with +": growing("'x'", "ns.s + ns.s", 40),
    "list doubled": growing("[1]", "ns.s + ns.s", 40),
    "shared list nesting printed": growing("[1]", "[ns.s, ns.s]", 60, "{{ ns.s }}"),
    "shared tuple as a dict key": growing("(1,)", "(ns.s, ns.s)", 60, "{{ {ns.s: 1} }}"),
    "repeated integer products": growing("3", "ns.s * ns.s", 100),
    "integer power": "{{ 7 ** 1000000 }}",
    "string repetition": "{{ 'x' * 10**9 }}",
    "list repetition": "{{ [0] * 10**9 }}",
    "format width": "{{ '{:>1000000000}'.format(1) }}",
    "format nested width": "{{ '{:>{w}}'.format(1, w=999999999) }}",
    "format precision": "{{ '{:.999999999f}'.format(1.5) }}",
    "format repeated field": "{% set s = 'x' * 4000000 %}{{ ('{0}' * 1000000).format(s) }}",
    "percent width": "{{ '%999999999d' % 1 }}",
    "percent star width": "{{ '%*d' % (999999999, 1) }}",
    "percent repeated key": "{% set s = 'x' * 4000000 %}{{ ('%(a)s' * 1000000) % {'a': s} }}",
    "format filter width": "{{ '%999999999s'|format(1) }}",
    "center filter": "{{ 'x'|center(999999999) }}",
    "center method": "{{ 'x'.center(999999999) }}",
    "ljust method": "{{ ''.ljust(10**9) }}",
    "zfill method": "{{ '1'.zfill(10**9) }}",
    "expandtabs": "{{ ('\t' * 1000000).expandtabs(1000) }}",
    "indent filter": "{{ ('\n' * 1000000)|indent(1000) }}",
    "indent by a string": "{{ ('\n' * 100000)|indent('x' * 10000) }}",
    "wordwrap filter": "{{ ('a ' * 4000000)|wordwrap(1, wrapstring='x' * 100) }}",
    "replace method": "{% set s = 'x' * 100000 %}{{ s.replace('x', s) }}",
    "replace filter on empty": "{% set s = 'x' * 10000 %}{{ s|replace('', s) }}",
    "join filter": "{% set s = 'x' * 100000 %}{{ (s|list)|join(s) }}",
    "join method": "{% set s = 'x' * 100000 %}{{ s.join(s) }}",
    "translate method": "{% set s = 'x' * 100000 %}{{ s.translate({120: s}) }}",
    "to_bytes": "{{ (1).to_bytes(10**9, 'big') }}",
    "batch fill": "{{ [1]|batch(10**9, 'x')|list }}",
    "slice filter": "{{ [1]|slice(10**6)|list }}",
    "sum of lists": "{{ ([[0] * 1000] * 3000)|sum(start=[]) }}",
    "set accumulating in a loop": growing("''", "ns.s ~ 'x' * 100", 100000),
    "macro recursion": "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "macro without end": "{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}",
    "caller recursion": "{% macro m() %}{{ caller() }}{{ caller() }}{% endmacro %}"
    "{% macro r(n) %}{% if n %}{% call m() %}{{ r(n-1) }}{% endcall %}{% endif %}{% endmacro %}{{ r(40) }}",
    "recursive loop": "{% set ns = namespace(t=[]) %}{% for i in range(30) %}{% set ns.t = [ns.t, ns.t] %}{% endfor %}"
    "{% for x in ns.t recursive %}{{ loop(x) }}{% endfor %}",
    "output in nested loops": nested("x" * 64),
    "range to a list": "{{ range(10**9)|list }}",
    "dict of a big value": "{% set d = dict.fromkeys(range(100000), 'x' * 1000000) %}{{ d }}",
    "block set in a loop": "{% set s = 'x' * 10**6 %}{% set b %}{% for i in range(10**5) %}{{ s }}{% endfor %}"
    "{% endset %}",
    "string filter of shared lists": growing("[1]", "[ns.s, ns.s]", 40, "{{ ns.s|string }}"),
    "tojson indent": "{{ [[[[[[1]]]]]]|tojson(indent=10**8) }}",
    "split into pieces": "{{ (' ' * 8000000).split(' ')|length }}",
    "list of characters": "{{ ('日' * 8000000)|list|length }}",
    "slices copied in a loop": growing("'x' * 8000000", "ns.s[1:] ~ 'x'", 100000),
    "comparisons in a loop": nested(
        "{% if s == t %}{% endif %}", setup="{% set s = 'x' * 8000000 %}{% set t = 'x' * 8000000 %}"
    ),
    "long date pattern": "{{ strftime_now('%c' * 1000000) }}",
    "generator consumed in a loop": nested("", outer="range(100000)|map('string')"),
    "method calls in nested loops": nested("{{ c.next() }}", setup="{% set c = cycler(1, 2) %}"),
    "unique characters": "{{ ('x' * 8000000)|unique|list|length }}",
    "items of a big dict in loops": "{% set d = dict.fromkeys(range(10**5)) %}{% for i in range(1000) %}"
    "{% for k in d|items %}{% endfor %}{% endfor %}",
    "sorting again and again": growing("range(100000)|list", "ns.s|sort", 10000),
    "namespace growth": growing("[]", "ns.s + [i]", 100000),
    "urlize, Python per character": "{{ ('x ' * 4000000)|urlize }}",
    "title, Python per word": "{{ ('x ' * 4000000)|title }}",
    "striptags, quadratic": "{{ ('<a> x ' * 200000)|striptags }}",
    "xmlattr, Python per item": "{{ dict.fromkeys(range(100000)|map('string'), 'x')|xmlattr }}",
    "deep nesting hashed": growing("()", "(ns.s,)", 100000, "{{ {ns.s: 1} }}"),
    "deep nesting compared": growing("[]", "[ns.s]", 100000, "{{ ns.s == [ns.s] }}"),
}

# The same operations at the sizes real templates use.
FINE = {
    "loops": ("{% for a in range(100) %}{% for b in range(100) %}{% endfor %}{% endfor %}ok", "ok"),
    "string building": (
        growing("''", "ns.s ~ 'ab'", 1000, "{{ ns.s|length }}"),
        "2000",
    ),
    "format": (
        "{{ '{:>6}|{:.2f}'.format('a', 1.5) }}|{{ '%5d' % 42 }}|{{ '%s-%s'|format(1, 2) }}",
        "     a|1.50|   42|1-2",
    ),
    "filters": (
        "{{ 'x'|center(5) }}|{{ 'a\nb'|indent(2) }}|{{ [1, 2]|join(', ') }}|{{ [[1], [2]]|sum(start=[]) }}",
        "  x  |a\n  b|1, 2|[1, 2]",
    ),
    "tojson": ("{{ {'a': [1, 'é']}|tojson(indent=2) }}", '{\n  "a": [\n    1,\n    "é"\n  ]\n}'),
    "power and product": ("{{ 2 ** 64 }}|{{ 10 ** 20 * 10 ** 20 }}", f"{2**64}|{10**40}"),
    "lipsum": ("{{ lipsum(2, html=false)|length > 0 }}", "True"),
    "slices and methods": (
        "{{ 'hello world'[::-1] }}|{{ 'a,b'.split(',') }}|{{ 'ab'.replace('a', 'xy') }}",
        "dlrow olleh|['a', 'b']|xyb",
    ),
    "recursive macro": ("{% macro f(n) %}{% if n %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(5) }}", "54321"),
}


@pytest.mark.parametrize("source", BOMBS.values(), ids=BOMBS.keys())
def test_bomb_stops_quickly_with_one_line(source):
    started = time.perf_counter()
    with pytest.raises(FuselaneError) as caught:
        ChatTemplate(source).render(MESSAGES)
    seconds = time.perf_counter() - started
    message = str(caught.value)
    assert "\n" not in message and message.startswith("chat template") and len(message) < 400, message
    assert seconds < FAST, f"{seconds:.1f} s: {message}"


@pytest.mark.parametrize("source, expected", FINE.values(), ids=FINE.keys())
def test_real_sized_work_renders(source, expected):
    assert ChatTemplate(source).render(MESSAGES) == expected


def test_the_budget_is_the_callers():
    loops = "{% for a in range(100) %}{% for b in range(100) %}{% endfor %}{% endfor %}ok"
    assert ChatTemplate(loops).render(MESSAGES) == "ok"
    with pytest.raises(FuselaneError, match="stopped: it ran past 1000 steps"):
        ChatTemplate(loops, budget=RenderBudget(steps=1000)).render(MESSAGES)
    with pytest.raises(FuselaneError, match="stopped: a repetition would be 100000 units"):
        ChatTemplate("{{ 'x' * 100000 }}", budget=RenderBudget(value_units=100)).render(MESSAGES)


def test_the_budget_grows_with_the_conversation():
    # a long message may be copied a few times over, though it is larger than the default value limit
    long = "word " * (RenderBudget().value_units // 4)
    rendered = ChatTemplate("{{ messages[0].content + messages[0].content }}").render(
        [{"role": "user", "content": long}]
    )
    assert len(rendered) == 2 * len(long)


def test_an_error_message_quoting_a_huge_value_is_cut():
    source = "{{ raise_exception('x' * 1000000) }}"
    with pytest.raises(FuselaneError, match=r"refused the conversation: x+\.\.\.$") as caught:
        ChatTemplate(source).render(MESSAGES)
    assert len(str(caught.value)) < 400


def test_a_huge_template_is_refused_before_parsing():
    with pytest.raises(FuselaneError, match="chat template is .* characters"):
        ChatTemplate("x" * (1 << 20))
