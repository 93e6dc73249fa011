"""A session runs a prompt in the lane's chunks: the cuda lane takes a mixture's prompt (any attention, one GPU)
512 rows at a time (`kernels.MOE_CHUNK_ROWS`, where its grouped expert GEMM was measured faster than two
chunks of 256), a dense model's under `prefill=f16-scratch` in the rows its workspace is sized at, every other
model's in the session's 256, and any in the knob `chunk_rows`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fuselane.explain import model_source
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.knobs import CudaKnobs
from fuselane.lanes.cuda.run.lane import CudaLane
from fuselane.runtime.session import DEFAULT_CHUNK, Session


def _lane(model: str, *knobs: str) -> SimpleNamespace:
    _, cfg, _ = model_source(model)
    lane = SimpleNamespace(cfg=cfg, ctx=4096, shim=SimpleNamespace(knobs=CudaKnobs.parse(knobs)))
    lane.prefill_chunk = CudaLane.prefill_chunk.fget(lane)
    return lane


@pytest.mark.parametrize(
    ("model", "rows"),
    [
        ("synth:qwen3-30b-a3b", kernels.MOE_CHUNK_ROWS),
        ("synth:qwen1.5-moe-a2.7b", kernels.MOE_CHUNK_ROWS),
        ("synth:qwen2.5-7b", DEFAULT_CHUNK),
        ("synth:deepseek-v2-lite", kernels.MOE_CHUNK_ROWS),
        ("synth:tiny-qwen3next", kernels.MOE_CHUNK_ROWS),  # the hybrid's mixture
        ("synth:tiny-qwen3", DEFAULT_CHUNK),
    ],
)
def test_a_session_takes_the_lanes_chunk(model, rows):
    assert Session(_lane(model)).chunk == rows


def test_the_chunk_rows_knob_sets_the_lanes_chunk():
    # llama.cpp's ubatch: a mixture's and a dense model's alike (under `f16-scratch` the workspace is sized at
    # them: tests/cuda_kernels/test_chunk_rows.py)
    assert Session(_lane("synth:qwen3-30b-a3b", "chunk_rows=128")).chunk == 128
    assert Session(_lane("synth:qwen2.5-7b", "prefill=f16-copy", "chunk_rows=1024")).chunk == 1024


def test_a_chunk_given_to_the_session_wins():
    assert Session(_lane("synth:qwen3-30b-a3b"), chunk=7).chunk == 7


def test_a_lane_without_a_chunk_of_its_own_takes_the_sessions():
    assert Session(SimpleNamespace(ctx=64)).chunk == DEFAULT_CHUNK
