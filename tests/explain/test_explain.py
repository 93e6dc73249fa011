"""`fuselane explain`: golden plans for qwen2 and qwen3 on both lanes, the JSON form's schema, held rules.

Regenerate the golden files after an intended change with `FUSELANE_UPDATE_GOLDEN=1 pytest tests/explain`
and read the diff: it is the change to the plans.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuselane.cli import main
from fuselane.explain import JSON_VERSION, build_plan, make_shim, to_json
from fuselane.fuse.optimizer import rule_names
from fuselane.fuse.views import class_of, parts
from fuselane.graph.ir import Op

GOLDEN = Path(__file__).parent / "golden"
CASES = [
    (arch, lane, form) for arch in ("qwen2", "qwen3") for lane in ("cpu", "cuda") for form in ("decode", "prefill")
]


def explain_text(*args: str) -> str:
    # the cuda lane's workspace block reads the process's cuBLAS workspace setting: a golden text has none
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    done = subprocess.run(
        [sys.executable, "-m", "fuselane", "explain", *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return done.stdout


@pytest.mark.parametrize(("arch", "lane", "form"), CASES)
def test_golden_plan(arch, lane, form):
    text = explain_text(f"synth:tiny-{arch}", "--lane", lane, "--form", form, "--rows", "16")
    path = GOLDEN / f"{arch}-{lane}-{form}.txt"
    if os.environ.get("FUSELANE_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


@pytest.mark.parametrize("lane", ["cpu", "cuda"])
def test_json_schema(lane, capsys):
    assert main(["explain", "synth:tiny-qwen3", "--lane", lane, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["version"] == JSON_VERSION
    assert set(data) == {
        "version",
        "model",
        "lane",
        "form",
        "rows",
        "held",
        "rules",
        "schedule",
        "not_fused",
        "launches",
        "numerics",
    }
    assert set(data["model"]) == {"name", "architecture", "layers"}
    for op in data["schedule"]:
        assert set(op) == {"op", "fused", "covers", "inputs", "output", "destination", "launches"}
        assert all(set(i) == {"name", "access"} for i in op["inputs"])
        assert "buffer" in op["destination"]
    for miss in data["not_fused"]:
        assert set(miss) == {"rule", "class", "kind", "reason", "covers"}
        assert miss["kind"] in ("decompose", "refuse", "fits") and miss["reason"]
    assert set(data["launches"]) == {"per_step", "per_layer_max", "per_layer"}
    assert sum(op["launches"] for op in data["schedule"]) == data["launches"]["per_step"]
    assert set(data["numerics"]) == {
        "point",
        "activations",
        "cache",
        "state",
        "attention",
        "fused_bound",
        "accumulator_bits",
    }
    covered = sorted(c for op in data["schedule"] for c in op["covers"])
    assert covered == list(range(len(covered)))


def leaves_and_folds(op: Op) -> list[Op]:
    """An op and every fold inside it."""
    return [op, *(inner for part in parts(op) for inner in leaves_and_folds(part))]


def folds(plan) -> list[tuple[str, tuple[int, ...]]]:
    """Every op of a plan and every fold inside it, by class and the original ops it covers."""
    return [(class_of(op) or type(op.sym).__name__, op.covers) for top in plan.ops for op in leaves_and_folds(top)]


@pytest.mark.parametrize("lane", ["cpu", "cuda"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_every_rule_held_changes_only_the_plan(lane, arch):
    """Holding a rule removes its fusions and nothing else: the other rules fire as before wherever the held
    rule's fusions did not stand in their way, and every original op is still covered once."""
    name, cfg, plain = build_plan(f"synth:tiny-{arch}", lane=lane)
    standing = {op.covers for top in plain.ops for op in leaves_and_folds(top)}
    for rule in rule_names(make_shim(lane, (), (), "decode")):  # every rule `--hold` takes
        _, _, held = build_plan(f"synth:tiny-{arch}", lane=lane, held=[rule])
        assert not any(e.rule == rule for e in held.fired)
        assert sorted(c for op in held.ops for c in op.covers) == sorted(c for op in plain.ops for c in op.covers)
        # where a fusion of the rule stands in the plan (a lane's settling pass may have taken it back), the
        # plan's folds differ: at its top, or inside another fusion (a FlashDecode in an AttnOutputQuant)
        if any(e.rule == rule and e.covers in standing for e in plain.fired):
            assert folds(held) != folds(plain)


def test_gemv_parts_held_on_cuda_costs_launches():
    _, _, plain = build_plan("synth:qwen3-8b:q4_k_m", lane="cuda")
    _, _, held = build_plan("synth:qwen3-8b:q4_k_m", lane="cuda", held=["gemv_parts"])
    assert held.launches() > plain.launches()


def test_cuda_qwen3_8b_decode_reaches_at_most_7_launches_per_layer():
    name, cfg, plan = build_plan("synth:qwen3-8b:q4_k_m", lane="cuda")
    assert to_json(name, cfg, plan, "decode")["launches"]["per_layer_max"] <= 7


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["synth:tiny-qwen3", "--hold", "no_such_rule"], "no rule named no_such_rule"),
        (["synth:tiny-qwen3", "--lane", "cuda", "--knob", "activations=fp4"], "activations"),
        (["synth:tiny-qwen3", "--lane", "cpu", "--knob", "dtype=f16"], "dtype=f32|f64"),
        (["synth:no-such-shape"], "no-such-shape"),
        (["synth:tiny-qwen3", "--form", "prefill", "--rows", "0"], "at least one row"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, fragment, capsys):
    assert main(["explain", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fuselane: error:") and fragment in err[0]
