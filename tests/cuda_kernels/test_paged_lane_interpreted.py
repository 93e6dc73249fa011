"""The cuda lane's paged form (a step's decode rows as one batch over the device pool, prefill chunks through the
single-sequence path) under Triton's interpreter, against the cpu lane alone in f64: batch equals single.

Interpreted kernels are slow, so this runs few tokens of a tiny model: three sequences of different lengths,
two at a time, so one joins when another leaves, decode buckets of 2 and 1, a prompt prefilled in two chunks.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.engine.batch import engine_for  # noqa: E402
from fuselane.engine.sequence import Event, Request  # noqa: E402
from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from fuselane.runtime.sampling import GREEDY  # noqa: E402

CTX = 32
PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [40]]
MAX_TOKENS = [3, 2, 2]


class Recorder:
    """The paged lane with the decode rows of each step written down."""

    def __init__(self, lane) -> None:
        self.lane, self.name, self.rows = lane, lane.name, []

    def step(self, works):
        self.rows.append(sum(w.samples for w in works))
        return self.lane.step(works)

    def forget(self, seq):
        self.lane.forget(seq)


def test_paged_cuda_lane_equals_cpu_alone(tmp_path):
    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "f16", seed=5)
    gpu = load(path, lane="cuda", ctx=CTX)
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    engine = engine_for(gpu, blocks=6, max_seqs=2, max_queue=3, block_size=4, chunk=6)
    engine.lane = recorder = Recorder(engine.lane)
    events: dict[int, list[Event]] = {}
    ids = [
        engine.submit(Request(tuple(p), n, GREEDY), lambda e: events.setdefault(e.seq, []).append(e))
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    engine.run_until_idle()
    for seq, prompt, n in zip(ids, PROMPTS, MAX_TOKENS, strict=True):
        got = [t for e in events[seq] for t in e.tokens]
        assert not any(e.error for e in events[seq])
        assert got == list(ref.generate_ids(ref.session(), prompt, max_tokens=n, sampling=GREEDY))
    assert {1, 2} <= set(recorder.rows)  # batches of two rows and of one
    assert engine.pool.used == 0 and sorted(engine.lane.lane.steps) == [1, 2]
    # the prompts' chunks (3, 3, 6 and 1 rows: a prompt's last token is a decode row) ran padded to powers of two
    assert sorted(engine.lane.lane.single._steps) == [(1, False), (4, False), (8, False)]


def test_a_chunk_pads_to_a_power_of_two_unless_the_context_or_a_recurrent_state_forbids():
    from fuselane.engine.cuda import _chunk_rows

    assert [_chunk_rows(n, 0, 64, False) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert _chunk_rows(5, 58, 64, False) == 5  # 8 rows from 58 would pass the context of 64
    assert _chunk_rows(5, 56, 64, False) == 8
    assert _chunk_rows(5, 0, 64, True) == 5  # a recurrent state would sum the padding


def test_a_steps_inputs_pad_the_bucket_with_the_spare_block():
    """Two sequences in a bucket of four: their ids, positions, slots, lengths and tables, then two padding rows
    of token 0 at position 0 writing into and reading only the spare block (7, after the pool's 7)."""
    from fuselane.engine.cuda import _bucket
    from fuselane.lanes.cuda.run.paged import COLUMNS, layout

    assert [_bucket(n) for n in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
    values = layout(4, 3, [11, 12], [5, 0], [2 * 4 + 1, 6 * 4], [[3, 2], [6]], spare=7, block_size=4)
    columns, tables = values[: 4 * COLUMNS].reshape(COLUMNS, 4), values[4 * COLUMNS :].reshape(4, 3)
    assert columns.tolist() == [[11, 12, 0, 0], [5, 0, 0, 0], [9, 24, 28, 28], [6, 1, 1, 1]]
    assert tables.tolist() == [[3, 2, 7], [6, 7, 7], [7, 7, 7], [7, 7, 7]]
