"""The schedule's index of which slots read and write each tensor answers as a scan of every slot would, through
any mix of slots set in place, spliced and inserted (the rules ask it thousands of times a plan)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fuselane.explain import model_source
from fuselane.fuse.rewriter import Schedule
from fuselane.graph import facts
from fuselane.graph.ir import Form
from fuselane.models import recognizer

_, CFG, TENSORS = model_source("synth:tiny-qwen3:q8_0")
OPS = recognizer(CFG).recognize(CFG, TENSORS, Form.DECODE, rows=1, ctx=16).ops
NAMES = sorted({n for op in OPS for n in (*facts.reads(op), *facts.writes(op))})

EDIT = st.one_of(
    st.tuples(st.just("empty"), st.integers(0, 10**6)),
    st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, len(OPS) - 1)),
    st.tuples(st.just("splice"), st.integers(0, 10**6), st.lists(st.integers(0, len(OPS) - 1), max_size=3)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(0, len(OPS) - 1)),
)


def _scanned(s: Schedule, name: str) -> tuple[list[int], list[int]]:
    reads = [i for i, op in enumerate(s.ops) if op is not None and name in facts.reads(op)]
    writes = [i for i, op in enumerate(s.ops) if op is not None and name in facts.writes(op)]
    return reads, writes


def _check(s: Schedule) -> None:
    for name in NAMES:
        reads, writes = _scanned(s, name)
        assert s.readers(name) == reads, name
        assert s.producer(name) == (writes[-1] if writes else None), name
        for before in (0, len(s) // 2, len(s)):
            earlier = [i for i in writes if i < before]
            assert s.producer(name, before) == (earlier[-1] if earlier else None), (name, before)


@settings(max_examples=40, deadline=None)
@given(st.lists(EDIT, max_size=12))
def test_the_index_answers_as_a_scan_through_any_edits(edits):
    s = Schedule(OPS)
    _check(s)  # built on the first question
    for edit in edits:
        kind, at = edit[0], edit[1] % len(s)
        if kind == "empty":
            s.set(at, None)
        elif kind == "set":
            s.set(at, OPS[edit[2]])
        elif kind == "splice" and edit[2]:
            s.splice(at, [OPS[k] for k in edit[2]])
        elif kind == "insert":
            s.insert(at, OPS[edit[2]])
        _check(s)
