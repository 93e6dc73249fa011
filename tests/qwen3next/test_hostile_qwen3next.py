"""Hostile or inconsistent Qwen3-Next files: a hybrid's counts and tensors that do not back each other.

Each file is the tiny Qwen3-Next (float weights, the synthetic tokenizer) with one claim wrong: a convolution of
no taps, a full-attention interval of 0, a missing recurrent tensor, value heads that do not group over the key
heads, an inner size the heads do not make, layer flags short of the layers, a partial rotary past the head,
YaRN on a partly rotated head.
Each must end in one error line naming what is wrong: through `run` (exit code 1, quickly) and `info`'s API.
"""

from __future__ import annotations

import numpy as np
import pytest

from fuselane.gguf.synth import SHAPES
from tests.bounded import run_bounded
from tests.moe.test_hostile_moe import Case, describe_raises_a_model_error, run_refuses_in_one_line, write_with

Q3N = SHAPES["tiny-qwen3next"]
P = "qwen3next."
CASES = {
    "a convolution of no taps": Case(Q3N, {P + "ssm.conv_kernel": 0}, {}, ("ssm.conv_kernel", "positive", "not 0")),
    "full attention every 0th layer": Case(
        Q3N, {P + "full_attention_interval": 0}, {}, ("full_attention_interval", "positive")
    ),
    "no ssm_a": Case(Q3N, {}, {"blk.0.ssm_a": None}, ("blk.0.ssm_a", "missing")),
    "no convolution": Case(Q3N, {}, {"blk.2.ssm_conv1d.weight": None}, ("blk.2.ssm_conv1d.weight", "missing")),
    "taps past the tensor": Case(Q3N, {P + "ssm.conv_kernel": 5}, {}, ("ssm_conv1d.weight", "(128, 4)", "(128, 5)")),
    "value heads over key heads": Case(
        Q3N, {P + "ssm.time_step_rank": 3}, {}, ("time_step_rank", "3 value heads", "2 key heads")
    ),
    "an inner size the heads do not make": Case(Q3N, {P + "ssm.inner_size": 100}, {}, ("ssm.inner_size", "100")),
    "layer flags short of the layers": Case(
        Q3N, {P + "attention.recurrent_layers": [True, False]}, {}, ("recurrent_layers", "2 layers", "4 layers")
    ),
    "a rotary past the head": Case(Q3N, {P + "rope.dimension_count": 18}, {}, ("rope.dimension_count", "18")),
    # YaRN scales the rotation's cos and sin; a partly rotated head's other values would not carry the scale
    "YaRN on a partly rotated head": Case(
        Q3N,
        {P + "rope.scaling.type": "yarn", P + "rope.scaling.factor": 4.0},
        {},
        ("YaRN", "whole heads"),
    ),
    "a quantized norm of the rule": Case(
        Q3N, {}, {"blk.0.ssm_norm.weight": np.zeros((3, 16), np.float32)}, ("blk.0.ssm_norm.weight", "(3, 16)")
    ),
}
CLI_CASES = ("a convolution of no taps", "full attention every 0th layer", "no ssm_a")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile_q3n")
    out = {
        name: write_with(d / f"case{i}.gguf", c.shape, c.meta, c.tensors) for i, (name, c) in enumerate(CASES.items())
    }
    out["good"] = write_with(d / "good.gguf", Q3N, {}, {})
    return out


@pytest.mark.parametrize("name", CLI_CASES)
def test_cli_refuses_in_one_line(files, name):
    run_refuses_in_one_line(files[name], CASES[name].says, "--lane", "cpu")


@pytest.mark.parametrize("name", list(CASES))
def test_api_raises_a_model_error(files, name):
    describe_raises_a_model_error(files[name], CASES[name].says)


def test_the_untouched_file_runs(files):
    done, _ = run_bounded(["run", "--raw", "-n", "2", "--lane", "cpu", str(files["good"]), "hi"])
    assert done.returncode == 0, done.stderr.decode()


def test_the_cuda_lane_plans_it(files):
    """`explain` shows the cuda lane's plan with the gated delta rule's classes and no refusal (a plan-side
    answer: no GPU is needed to give it)."""
    done, _ = run_bounded(["explain", "--lane", "cuda", str(files["good"])])
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    # the file holds its matrices in F32: `ssm_ba` as values, so the gates take their projection in their launch;
    # the step norms its output in its own
    assert all(cls in out for cls in ("ConvBiasSilu", "GdnGateProjections", "GdnStep"))
    assert "GatedNorm" not in out.split("not fused on this lane")[0]
    assert "cannot run the model" not in out
