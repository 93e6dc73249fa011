"""Two CPU processes, each a rank of a gloo group running its graph over its slices, give the logits of the
unsplit cpu lane in f64 within the contract: a dense model with q/k norms, one with q/k/v biases, and two
mixtures (experts split across the ranks, one with a shared expert split by its width)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

from fuselane.gguf.reader import open_gguf  # noqa: E402
from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.lanes.cpu.lane import CpuLane  # noqa: E402
from fuselane.models import config_of  # noqa: E402
from fuselane.parallel.executor import RankShim  # noqa: E402
from fuselane.parallel.processes import rank_logits  # noqa: E402

TP, CTX = 2, 16
STEPS = [[1, 5, 9, 300, 511], [7], [499]]  # a prefill chunk, then two decode steps


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-qwen2", "tiny-qwen3moe", "tiny-qwen2moe"])
def path(request, tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("gloo") / f"{request.param}.gguf", request.param, "q8_0")


def _reference(path) -> tuple[list[np.ndarray], int]:
    with open_gguf(path) as f:
        cfg = config_of(f.metadata, f.tensors)
        lane, pos, out = CpuLane(cfg, f.tensors, ctx=CTX, dtype=np.float64), 0, []
        for ids in STEPS:
            out.append(lane.forward(np.array(ids), pos, all_logits=True))
            pos += len(ids)
    return out, cfg.n_layers


def test_two_ranks_over_gloo_give_the_unsplit_logits(path) -> None:
    ranks = rank_logits(path, TP, STEPS, CTX)
    reference, depth = _reference(path)
    tol = RankShim(np.dtype(np.float64)).numerics().logits_tolerance(depth)
    for step, want in enumerate(reference):
        scale = np.abs(want).max()
        for rank in range(TP):
            got = ranks[rank][step]
            assert got.shape == want.shape
            assert np.abs(got - want).max() <= tol * scale, (rank, step)
        np.testing.assert_array_equal(ranks[0][step], ranks[1][step])  # every rank holds the same logits
