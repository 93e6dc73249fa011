"""A batch step (one row of each of several sequences, each at its own position) on the cpu lane equals
decoding each sequence alone."""

from __future__ import annotations

import numpy as np
import pytest

from fuselane.gguf.synth import write_synthetic
from fuselane.runtime.model import load

CTX = 16
SEQS = [[3, 9, 27, 81, 12], [200, 5, 5, 5, 77], [1, 2, 3, 4, 5]]


@pytest.mark.parametrize("shape", ["tiny-qwen2", "tiny-qwen3"])
def test_batch_steps_equal_separate_decodes(tmp_path, shape):
    path = write_synthetic(tmp_path / f"{shape}.gguf", shape, "q8_0", seed=5)
    batch = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    alone = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    ids = np.array(SEQS)
    for t in range(ids.shape[1]):
        logits = batch.lane.forward_batch(ids[:, t], np.full(len(SEQS), t))
    for i, seq in enumerate(SEQS):
        expect = alone.session().feed(seq)
        assert np.max(np.abs(logits[i] - expect)) <= 1e-12 * np.max(np.abs(expect))


def test_batch_rows_at_different_positions(tmp_path):
    path = write_synthetic(tmp_path / "q3.gguf", "tiny-qwen3", "f32", seed=2)
    batch = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    alone = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    # sequence 0 is two tokens ahead of sequence 1: it runs alone first (sequence 1 rewrites its own rows)
    long, short = [7, 8, 9, 10], [11, 12]
    for t in range(2):
        batch.lane.forward_batch(np.array([long[t], short[0]]), np.array([t, 0]))
    last = batch.lane.forward_batch(np.array([long[2], short[1]]), np.array([2, 1]))
    assert np.allclose(last[0], alone.session().feed(long[:3]), rtol=0, atol=1e-12 * np.abs(last[0]).max())
    assert np.allclose(last[1], alone.session().feed(short), rtol=0, atol=1e-12 * np.abs(last[1]).max())
