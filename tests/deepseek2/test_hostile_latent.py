"""Hostile or inconsistent deepseek2 files: claims the tensors or the other keys do not back.

Each file is the tiny V3-style model (q LoRA, sigmoid routing with the correction bias, groups, YaRN) with one
claim wrong. Every case ends, through `run` (and `info`'s API), in one `fuselane: error:` line naming what is
wrong, exit code 1, quickly; the untouched file runs.
"""

from __future__ import annotations

import numpy as np
import pytest

from fuselane.gguf.synth import SHAPES
from tests.bounded import run_bounded
from tests.moe.test_hostile_moe import Case, describe_raises_a_model_error, run_refuses_in_one_line, write_with

V3 = SHAPES["tiny-deepseek3"]
P = "deepseek2."

CASES = {
    "a key half of the wrong shape": Case(
        V3, {}, {"blk.0.attn_k_b.weight": np.zeros((4, 32, 8), np.float32)}, ("blk.0.attn_k_b.weight", "(4, 32, 8)")
    ),
    "no value half": Case(V3, {}, {"blk.1.attn_v_b.weight": None}, ("blk.1.attn_v_b.weight", "missing")),
    "key lengths the latent does not imply": Case(V3, {P + "attention.key_length": 40}, {}, ("key_length", "48")),
    "an unknown gating function": Case(V3, {P + "expert_gating_func": 7}, {}, ("expert_gating_func", "7")),
    "groups that do not split the experts": Case(V3, {P + "expert_group_count": 3}, {}, ("expert_group_count",)),
    "a million experts": Case(V3, {P + "expert_count": 10**6}, {}, ("ffn_gate_inp.weight", "1000000")),
    "a YaRN that shrinks": Case(V3, {P + "rope.scaling.factor": 0.5}, {}, ("rope.scaling", "0.5")),
    "no latent width": Case(V3, {P + "attention.kv_lora_rank": None}, {}, ("kv_lora_rank", "missing")),
    "more dense layers than layers": Case(V3, {P + "leading_dense_block_count": 5}, {}, ("leading_dense",)),
}
CLI_CASES = ("a key half of the wrong shape", "an unknown gating function", "a million experts")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile_latent")
    out = {
        name: write_with(d / f"case{i}.gguf", c.shape, c.meta, c.tensors) for i, (name, c) in enumerate(CASES.items())
    }
    out["good"] = write_with(d / "good.gguf", V3, {}, {})
    return out


@pytest.mark.parametrize("name", CLI_CASES)
def test_cli_refuses_in_one_line(files, name):
    run_refuses_in_one_line(files[name], CASES[name].says)


@pytest.mark.parametrize("name", list(CASES))
def test_api_raises_a_model_error(files, name):
    describe_raises_a_model_error(files[name], CASES[name].says)


def test_the_untouched_file_runs(files):
    done, _ = run_bounded(["run", "--raw", "-n", "2", "--lane", "cpu", str(files["good"]), "hi"])
    assert done.returncode == 0, done.stderr.decode()
