"""The overlapped decode on the cuda lane's paged form under Triton's interpreter: steps launched before the
tokens of the one before are read, their inputs advanced on the device (`triton/advance.py`), the picks read
from the host's copy. Interpreted steps are slow, so one short run covers it: a greedy sequence, which gives the
cpu lane's tokens alone in f64, and two seeded twins (the same prompt and seed) of different lengths, the
shorter ending while a step planned ahead holds its row: the longer draws the same tokens, then its own.
Overlap on against off, seeded, and compiled: tests/cuda/test_paged_cuda.py; the engine's side of every case
(stops, cancels, preemption): tests/engine/test_overlap.py.
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
from fuselane.engine.sequence import Event, Finish, Request  # noqa: E402
from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from fuselane.runtime.sampling import GREEDY, SamplingParams  # noqa: E402

CTX = 16
SEEDED = SamplingParams(temperature=0.9, top_k=8, seed=11)
REQUESTS = [Request((3, 4), 2, GREEDY), Request((5,), 2, SEEDED), Request((5,), 3, SEEDED)]


def test_overlapped_steps_give_the_tokens_of_the_sequences_alone(tmp_path):
    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "f16", seed=5)
    gpu = load(path, lane="cuda", ctx=CTX)
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    engine = engine_for(gpu, blocks=8, max_seqs=3, max_queue=3, block_size=4, chunk=4)
    assert engine.overlap
    ahead: list[int] = []
    launch_next = engine.lane.launch_next
    engine.lane.launch_next = lambda works: (ahead.append(len(works)), launch_next(works))[1]
    events: dict[int, list[Event]] = {}
    ids = [engine.submit(r, lambda e: events.setdefault(e.seq, []).append(e)) for r in REQUESTS]
    engine.run_until_idle()
    got = [[t for e in events[i] for t in e.tokens] for i in ids]
    assert got[0] == list(ref.generate_ids(ref.session(), [3, 4], max_tokens=2, sampling=GREEDY))
    assert len(got[1]) == 2 and got[2][:2] == got[1] and len(got[2]) == 3
    assert all(events[i][-1].finish is Finish.LENGTH for i in ids)
    assert ahead == [3]  # the three rows (a bucket of four) planned ahead once: then the short twin had ended
    assert engine.pool.used == 0 and not engine.lane._flights
