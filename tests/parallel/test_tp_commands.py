"""`--tp` on the commands and `fuselane.load(tp=)`: a split no lane runs yet is one line naming why, a model
that cannot be split says where, and `explain --tp` shows each rank's plan with its collectives."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fuselane.errors import FuselaneError
from fuselane.gguf.synth import write_synthetic
from fuselane.runtime.model import load
from tests.bounded import assert_one_line_error, run_bounded


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_synthetic(tmp_path_factory.mktemp("tp") / "tiny.gguf", "tiny-qwen3moe", "q8_0"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "{m}", "hi", "--lane", "cpu", "--tp", "2"], "the cpu lane runs a model in one process"),
        (["bench", "{m}", "--lane", "cuda", "--tp", "2"], "embd meets the other ranks' partial results, and the "
         "lane runs on one device"),
        (["serve", "{m}", "--lane", "cuda", "--tp", "2"], "the lane runs on one device"),
        (["chat", "{m}", "--tp", "3"], "--tp 3 cannot split the model's 8 experts evenly"),
        (["run", "{m}", "hi", "--tp", "0"], "argument --tp: GPUs to split the model over must be an integer"),
    ],
)  # fmt: skip
def test_a_split_no_lane_runs_is_one_line(tiny, argv, message) -> None:
    done, seconds = run_bounded([a.format(m=tiny) for a in argv], stdin=b"")
    assert message in assert_one_line_error(done, seconds)


def test_load_with_tp_checks_the_split_then_says_why_not(tiny) -> None:
    with pytest.raises(FuselaneError, match="--tp 8 cannot split the model's 4 attention heads"):
        load(tiny, lane="cpu", tp=8)
    with pytest.raises(FuselaneError, match="the cpu lane .* does not split it; --tp 2 needs GPUs"):
        load(tiny, lane="cpu", tp=2)


def test_explain_tp_shows_each_ranks_plan_and_its_collectives() -> None:
    argv = [sys.executable, "-m", "fuselane", "explain", "synth:tiny-qwen3moe", "--tp", "2", "--json"]
    data = json.loads(subprocess.run(argv, capture_output=True, check=True, timeout=60).stdout)
    assert data["tp"] == 2 and [r["rank"] for r in data["ranks"]] == [0, 1]
    layers = data["ranks"][0]["model"]["layers"]
    for rank in data["ranks"]:
        kinds = [c["op"] for c in rank["collectives"]]
        assert kinds.count("AllReduce") == 2 * layers + 1 and kinds.count("AllGather") == 1
        fused = [c for c in rank["collectives"] if c["in"] == "AllreduceNorm"]
        assert len(fused) == 2 * layers  # a decode step's every partial sum meets its residual add and norm
        assert rank["lane"].startswith("cpu-rank") and rank.get("cannot_run") is None
    argv[argv.index("--json")] = "--lane=cuda"
    text = subprocess.run([*argv, "--json"], capture_output=True, check=True, timeout=60).stdout
    assert all("the lane runs on one device" in r["cannot_run"] for r in json.loads(text)["ranks"])
