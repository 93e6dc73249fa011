"""A schedule op the lane has no launch for is a reason the lane cannot run the model, said before anything
runs: a float matrix whose rows are not whole 32-value blocks (the converter stores such a matrix as F16)
leaves a primitive product no cuda kernel takes. `explain` shows the plan and says why; loading refuses in
one line; the cpu lane runs the same file."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from fuselane.errors import FuselaneError
from fuselane.explain import build_plan, make_shim, model_source
from fuselane.fuse.optimizer import optimize
from fuselane.gguf.synth import SHAPES, write_synthetic
from fuselane.graph.ir import Form
from fuselane.models import recognizer
from fuselane.runtime.model import load

RAGGED = 48  # the query's LoRA rank: 1.5 blocks of 32
WHY = f"l0.q: the lane's products take rows of whole 32-value blocks, not {RAGGED} values"


@pytest.fixture(scope="module")
def ragged(tmp_path_factory) -> str:
    shape = replace(SHAPES["tiny-deepseek3"], groups=1, groups_used=1, q_lora=RAGGED, vocab=260)
    return str(write_synthetic(tmp_path_factory.mktemp("ragged") / "m.gguf", shape, "q8_0", seed=3))


def _graph(path: str, form: str):
    _, cfg, tensors = model_source(path)
    return recognizer(cfg).recognize(cfg, tensors, Form(form), rows=1, ctx=64)


def test_explain_names_the_op_and_why(ragged):
    _, _, plan = build_plan(ragged, lane="cuda")
    assert plan.cannot_run == WHY


@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_the_lane_refuses_before_it_runs(ragged, form):
    with pytest.raises(FuselaneError, match="lane cannot run this model: " + re.escape(WHY)):
        optimize(_graph(ragged, form), make_shim("cuda", [], [], form))


def test_whole_blocks_leave_nothing_unfit(tmp_path):
    shape = replace(SHAPES["tiny-deepseek3"], groups=1, groups_used=1, q_lora=64, vocab=260)
    path = str(write_synthetic(tmp_path / "m.gguf", shape, "q8_0", seed=3))
    assert build_plan(path, lane="cuda")[2].cannot_run is None


def test_the_cpu_lane_runs_the_same_file(ragged):
    logits = np.asarray(load(ragged, lane="cpu", ctx=64).session().feed([5, 60, 7]))
    assert np.isfinite(logits).all()
