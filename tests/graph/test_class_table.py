"""`fuselane explain --classes`: the table of every fused class, as text (run as a user would) and as JSON.

Each class is one line of the text and one entry of the JSON, in the class list's order; the built-by column
is the record's, each lane's answer is that lane's shim's `supports` (under `--knob` for the lane `--lane`
names); with a model, each class's count is its ops in that model's plan; bad input is one error line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from fuselane.class_table import JSON_VERSION, LANES, NONE_YET, awaits_key, class_table
from fuselane.cli import main
from fuselane.explain import build_plan, make_shim
from fuselane.fuse.shim import Support, SupportKind
from fuselane.fuse.views import class_of
from fuselane.graph.classes import STANDING, ClassId
from tests.bounded import assert_one_line_error, run_bounded

TIMEOUT = 120


def explain(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "fuselane", "explain", *args], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return done.stdout


def said(support: Support) -> dict[str, str]:
    return {"kind": support.kind.value, "reason": support.reason}


def json_table(capsys, *args: str) -> dict:
    assert main(["explain", "--classes", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_cli_prints_a_line_a_class_with_its_builders_and_both_lanes_answers() -> None:
    text = explain("--classes")
    lines = [line for line in text.splitlines() if line.strip()]
    header = next(line for line in lines if line.startswith("class "))
    assert header.split()[:3] == ["class", "built", "by"]
    assert header.index("cuda (") < header.index("cpu (")
    firsts = Counter(line.split()[0] for line in lines)
    cuda, cpu = make_shim("cuda", (), (), "decode"), make_shim("cpu", (), (), "decode")
    for cls, standing in STANDING.items():
        assert firsts[cls.value] == 1, cls
        line = next(line for line in lines if line.split()[0] == cls.value)
        if standing.awaits is not None:
            assert f"{NONE_YET}: {awaits_key(standing.awaits)}" in line
        for rule in standing.built_by:
            assert rule in line
        for shim in (cuda, cpu):
            answer = shim.supports(cls)
            assert answer.kind.value in line
            assert answer.reason in line
    assert f"{sum(1 for s in STANDING.values() if s.built_by)} of {len(ClassId)} built by a rule" in text


def test_json_schema_every_class_once_in_order(capsys) -> None:
    data = json_table(capsys)
    assert set(data) == {"version", "lanes", "knobs", "classes"}
    assert data["version"] == JSON_VERSION
    assert list(data["lanes"]) == list(LANES)
    assert [row["class"] for row in data["classes"]] == [cls.value for cls in ClassId]
    kinds = {kind.value for kind in SupportKind}
    for row, (cls, standing) in zip(data["classes"], STANDING.items(), strict=True):
        assert set(row) == {"class", "built_by", "awaits", "answers"}
        assert [b["rule"] for b in row["built_by"]] == list(standing.built_by)
        assert all(b["lanes"] and set(b["lanes"]) <= set(LANES) for b in row["built_by"]), row
        assert row["awaits"] == (None if standing.awaits is None else awaits_key(standing.awaits))
        for lane in LANES:
            answer = row["answers"][lane]
            assert answer["kind"] in kinds
            assert answer["kind"] != SupportKind.REFUSE.value or answer["reason"], f"{cls.value} refused, no reason"
            assert answer == said(make_shim(lane, (), (), "decode").supports(cls))


def test_a_lane_rule_says_whose_it_is(capsys) -> None:
    row = next(r for r in json_table(capsys)["classes"] if r["class"] == ClassId.MERGED_QKV.value)
    lanes = {b["rule"]: b["lanes"] for b in row["built_by"]}
    assert sorted(lanes["merged_projections"]) == sorted(LANES)
    assert lanes["gemv_parts"] == ["cuda"]


def test_a_knob_changes_its_lanes_answers_only(capsys) -> None:
    quantizing = ClassId.NORM_QUANT.value
    plain = {r["class"]: r["answers"] for r in json_table(capsys, "--lane", "cuda")["classes"]}
    apart = json_table(capsys, "--lane", "cuda", "--knob", "fuse_quant=false")
    assert apart["knobs"] == {"cuda": ["fuse_quant=false"], "cpu": []}
    answers = {r["class"]: r["answers"] for r in apart["classes"]}
    assert plain[quantizing]["cuda"]["kind"] == "native"
    assert answers[quantizing]["cuda"]["kind"] == "decompose"
    assert answers[quantizing]["cpu"] == plain[quantizing]["cpu"]
    # the cpu lane's knob goes to the cpu shim (its dtype), never to the cuda lane's
    cpu = json_table(capsys, "--lane", "cpu", "--knob", "dtype=f64")
    assert cpu["lanes"] == {"cuda": make_shim("cuda", (), (), "decode").name, "cpu": "cpu:float64"}
    assert cpu["knobs"] == {"cuda": [], "cpu": ["dtype=f64"]}


@pytest.mark.parametrize(("lane", "form"), [("cpu", "decode"), ("cuda", "prefill"), ("cuda", "batch")])
def test_with_a_model_each_class_counts_its_ops_in_the_plan(lane: str, form: str) -> None:
    model = "synth:tiny-qwen3"
    data = class_table(lane=lane, form=form, model=model, rows=8)
    _, _, plan = build_plan(model, lane=lane, form=form, rows=8)
    counts = Counter(class_of(op) for op in plan.ops)
    assert data["plan"] == {"model": "tiny-qwen3", "lane": plan.lane, "form": form, "rows": plan.graph.rows}
    for row in data["classes"]:
        assert row["in_plan"] == counts[ClassId(row["class"])]
    assert sum(row["in_plan"] for row in data["classes"]) == sum(n for cls, n in counts.items() if cls is not None)
    assert sum(row["in_plan"] for row in data["classes"]) > 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["explain"], "needs a MODEL"),
        (["explain", "--classes", "--hold", "no_such_rule"], "no rule named no_such_rule"),
        (["explain", "--classes", "--lane", "cpu", "--hold", "gemv_parts"], "no rule named gemv_parts"),
        (["explain", "--classes", "--lane", "cuda", "--knob", "activations=fp4"], "activations"),
        (["explain", "--classes", "--knob", "dtype=f16"], "dtype=f32|f64"),
        (["explain", "--classes", "synth:no-such-shape"], "unknown shape"),
    ],
)
def test_bad_input_is_one_error_line(argv: list[str], says: str) -> None:
    done, seconds = run_bounded(argv)
    assert says in assert_one_line_error(done, seconds)
