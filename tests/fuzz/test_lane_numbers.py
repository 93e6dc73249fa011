"""`python -m fuzz.lane_numbers` draws tiny models the same way from a seed and runs a draw on both lanes: one draw
here (a one-layer qwen3moe in llama.cpp's Q5_K_M recipe, its producers' int8 forms apart), its log line OK. The
long runs are in docs/fuzzing.md."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("triton")

from fuzz import lane_numbers  # noqa: E402


def test_a_seed_draws_the_same_models() -> None:
    a, b = random.Random(8), random.Random(8)
    assert lane_numbers.said(lane_numbers._draw(a)) == lane_numbers.said(lane_numbers._draw(b))


def test_a_draw_runs_on_both_lanes_within_the_contract(tmp_path) -> None:
    log = tmp_path / "log"
    assert lane_numbers.main(["--seed", "9", "--count", "1", "--log", str(log)]) == 0
    (line,) = log.read_text().splitlines()
    assert line.startswith("OK ") and "qwen3moe d=128 L=1" in line and "mix=iq4_xs knobs=fuse_quant=off" in line
