"""Every number on the command line is checked against its range while the arguments are parsed.

Each numeric option of each subcommand is given values outside its range (NaN, the infinities, one past each
end, a 5,000-digit number, text, a value holding a newline): each must end in one `fuselane: error:` line that
names the option and its allowed range, exit code 1, quickly and in bounded memory. Bench sizes are checked
against the model's context before anything runs. Values at the ends of the ranges run.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from fuselane import ranges
from tests.bounded import assert_one_line_error, run_bounded
from tests.test_bad_input import tiny_meta, tiny_weights, write_gguf

TINY_CONTEXT = 4096  # the tiny synthetic shapes' context
HUGE = "9" * 5000  # past Python's 4,300-digit limit for int(): refused as a number, quoted short
OUTSIDE = {
    ranges.Kind.INT: ("-1", "1.5", "1e3", "abc", "", "1\n2", HUGE),
    ranges.Kind.REAL: ("nan", "inf", "-inf", "1e400", "abc", "", "1\n2"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from fuselane.gguf.synth import write_synthetic

    return str(write_synthetic(tmp_path_factory.mktemp("numbers") / "tiny.gguf", "tiny-qwen2", "q8_0", seed=5))


def _outside(bound: ranges.Bound) -> list[str]:
    """Values the bound refuses: the kind's hostile texts, and the numbers just past each end."""
    step = 1 if bound.kind is ranges.Kind.INT else 1e-9
    below = bound.low if bound.open_low else bound.low - step
    values = [v for v in OUTSIDE[bound.kind] if not (v == "-1" and bound.low < 0)]
    values.append(str(int(below)) if bound.kind is ranges.Kind.INT else repr(below))
    if bound.high is not None:
        values.append(str(bound.high + 1) if bound.kind is ranges.Kind.INT else repr(bound.high + 1e-6))
    return values


# (argv before the option, the option's bound, argv after it); {tiny} is the model's path
OPTIONS = [
    (("run", "--raw"), ranges.TOKENS, ("{tiny}", "hi")),
    (("run",), ranges.CTX, ("{tiny}", "hi")),
    (("run",), ranges.TEMPERATURE, ("{tiny}", "hi")),
    (("run",), ranges.TOP_K, ("{tiny}", "hi")),
    (("run",), ranges.TOP_P, ("{tiny}", "hi")),
    (("run",), ranges.SEED, ("{tiny}", "hi")),
    (("chat", "{tiny}"), ranges.TOKENS, ()),
    (("chat", "{tiny}"), ranges.TEMPERATURE, ()),
    (("bench", "{tiny}", "--lane", "cpu"), ranges.BENCH_PROMPT, ()),
    (("bench", "{tiny}", "--lane", "cpu"), ranges.BENCH_GENERATED, ()),
    (("bench", "{tiny}", "--lane", "cpu"), ranges.BENCH_DEPTH, ()),
    (("bench", "{tiny}", "--lane", "cpu"), ranges.BENCH_REPETITIONS, ()),
    (("explain", "synth:tiny-qwen2", "--form", "prefill"), ranges.ROWS, ()),
    (("serve", "{tiny}"), ranges.PORT, ()),  # serve's other bounds are of the same two kinds, checked alike
    (("serve", "{tiny}"), ranges.GPU_MEMORY, ()),
]
CASES = [
    pytest.param(before, bound, value, after, id=f"{before[0]} {bound.flag} {value[:12]!r}")
    for before, bound, after in OPTIONS
    for value in _outside(bound)
]


@pytest.mark.parametrize(("before", "bound", "value", "after"), CASES)
def test_a_number_out_of_range_is_one_line_naming_the_range(tiny, before, bound, value, after):
    argv = [a.format(tiny=tiny) for a in (*before, f"{bound.flag}={value}", *after)]
    done, seconds = run_bounded(argv)
    message = assert_one_line_error(done, seconds)
    assert f"argument {bound.flag}" in message and bound.describe() in message, message
    assert len(message) < 300 and done.stdout == b""


def test_every_numeric_option_has_a_bound():
    # the parser's actions that take a number all use a Bound as their type
    from fuselane.cli import parser

    def actions(p: argparse.ArgumentParser):
        for action in p._actions:
            yield action
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from actions(sub)

    numeric = [a for a in actions(parser()) if a.type in (int, float)]
    assert numeric == [], [a.option_strings for a in numeric]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("-p", "4000"), "prompt 4000 + generated 128 + 1 = 4,129 cache rows, more than the model's context of 4,096"),
        (("--depth", "0", "4090", "-p", "8", "-n", "4"), "depth 4090 + prompt 8 + generated 4"),
        (("-n", "4096", "-p", "1"), "more than the model's context of 4,096"),
        (("--depth", str(ranges.MAX_CTX)), "depth 1048576 + prompt 512"),
    ],
)
def test_bench_sizes_past_the_context_are_refused_up_front(tiny, argv, says):
    done, seconds = run_bounded(["bench", tiny, "--lane", "cpu", *argv])
    assert says in assert_one_line_error(done, seconds)
    assert done.stdout == b""


def test_a_context_past_the_models_is_refused(tiny):
    done, seconds = run_bounded(["run", "--ctx", str(TINY_CONTEXT + 1), tiny, "hi"])
    assert "1 to 4,096 tokens" in assert_one_line_error(done, seconds)


@pytest.mark.parametrize(
    "argv",
    [
        ("--temp", "1e300", "--seed", str(ranges.MAX_SEED), "--top-k", str(ranges.MAX_TOP_K), "--top-p", "1"),
        ("--temp", "0", "--ctx", str(TINY_CONTEXT), "--top-k", "0", "--seed", "0"),
        ("-n", str(ranges.MAX_CTX), "--ctx", "8"),  # asks past the context: stops at its end
    ],
)
def test_values_at_the_ends_of_the_ranges_run(tiny, argv):
    done, seconds = run_bounded(["run", "--raw", "-n", "3", *argv, tiny, "hello"])
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr.decode()


def test_bench_at_the_smallest_sizes_runs(tiny):
    done, _ = run_bounded(["bench", tiny, "--lane", "cpu", "-p", "1", "-n", "1", "--json"])
    assert done.returncode == 0, done.stderr.decode()
    (row,) = json.loads(done.stdout)
    assert row["prompt"] == 1 and row["generated"] == 1 and row["decode_tok_s"] > 0


def test_bench_percent_of_limit_stays_under_100(tiny):
    # the limit is the lane's own weights read once each, the way a decode step reads them and nothing more
    done, _ = run_bounded(["bench", tiny, "--lane", "cpu", "-p", "4", "-n", "16", "--json"])
    assert done.returncode == 0, done.stderr.decode()
    (row,) = json.loads(done.stdout)
    assert 0 < row["percent_of_limit"] < 100 and row["limit_tok_s"] > row["decode_tok_s"]


def test_numpy_warnings_stay_off_stderr(tmp_path):
    # weights near float32's end overflow in the norm and the attention: NumPy warns, then the logits are NaN
    weights = {k: v if k.endswith("norm.weight") else v * np.float32(1e37) for k, v in tiny_weights().items()}
    path = write_gguf(tmp_path / "overflow.gguf", "qwen2", tiny_meta(), weights)
    done, seconds = run_bounded(["run", "--raw", "-n", "4", str(path), "hello"])
    assert "NaN logits" in assert_one_line_error(done, seconds)
