"""The overlapped decode of the cuda lane's paged form (`engine/engine.py`: a step launched before the tokens of
the one before are read, its inputs advanced on the device) under Triton's interpreter: every sequence's tokens
with overlap are those without, exactly, and those of the cpu lane alone in f64.

One run each way over a tiny model covers the cases at once (interpreted kernels are slow): greedy and seeded
sequences in the same batch, of different prompt and reply lengths so they join and leave mid-run, one ended by
a stop token, one cancelled mid-run, and a pool of one context for three sequences, so some are preempted.
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

CTX = 32
BLOCK = 4
PROMPTS = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [40, 41], [20, 21, 22]]
MAX_TOKENS = [9, 6, 8, 7]
SEEDED = SamplingParams(temperature=0.9, top_k=8, seed=11)
SAMPLING = [GREEDY, SEEDED, GREEDY, SEEDED]
CANCELLED = 3  # the fourth sequence is cancelled once it has this many tokens
STOPPED = 0  # ...and the first ends at a stop token: its third token's (see `stop_token`)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("overlap") / "m.gguf", "tiny-qwen3", "f16", seed=5)
    return load(path, lane="cuda", ctx=CTX), load(path, lane="cpu", ctx=CTX, dtype=np.float64)


def stop_token(ref) -> int:
    """A token the first sequence greedily picks third and none of the other greedy sequences picks before its
    own end, so it stops exactly that one."""
    first = list(ref.generate_ids(ref.session(), PROMPTS[STOPPED], max_tokens=3, sampling=GREEDY))
    return first[2]


def run(gpu, *, overlap: bool, stop: int):
    """Every sequence's events, the engine, and the rows of each step launched ahead."""
    engine = engine_for(gpu, blocks=CTX // BLOCK, max_seqs=3, max_queue=4, block_size=BLOCK, chunk=8, overlap=overlap)
    engine.scheduler.stop_ids = frozenset({stop})
    ahead: list[int] = []
    if overlap:
        launch_next = engine.lane.launch_next
        engine.lane.launch_next = lambda works: (ahead.append(len(works)), launch_next(works))[1]
    events: dict[int, list[Event]] = {}
    ids: list[int] = []

    def sink(e: Event) -> None:
        assert not any(x.finish for x in events.get(e.seq, [])), "an event after the sequence's end"
        events.setdefault(e.seq, []).append(e)
        if e.seq == ids[-1] and e.completion_tokens == CANCELLED and e.finish is None:
            engine.cancel(e.seq)

    for p, n, s in zip(PROMPTS, MAX_TOKENS, SAMPLING, strict=True):
        ids.append(engine.submit(Request(tuple(p), n, s), sink))
    engine.run_until_idle()
    return [events[i] for i in ids], engine, ahead


def tokens(evs: list[Event]) -> list[int]:
    return [t for e in evs for t in e.tokens]


def test_overlap_gives_the_tokens_of_no_overlap(models):
    gpu, ref = models
    stop = stop_token(ref)
    plain, plain_engine, _ = run(gpu, overlap=False, stop=stop)
    over, engine, ahead = run(gpu, overlap=True, stop=stop)
    assert [tokens(e) for e in over] == [tokens(e) for e in plain]
    assert [e[-1].finish for e in over] == [e[-1].finish for e in plain]
    assert ahead and max(ahead) > 1  # steps were launched ahead, of several rows
    assert engine.stats.preemptions > 0 and plain_engine.stats.preemptions > 0
    assert engine.pool.used == 0 and not engine.lane._flights
    # the greedy sequences are the cpu lane's alone; the stopped one ends at its stop token, the cancelled one
    # after the tokens it had
    for i in (0, 2):
        want = list(ref.generate_ids(ref.session(), PROMPTS[i], max_tokens=MAX_TOKENS[i], sampling=GREEDY))
        if i == STOPPED:
            want = want[:2]
        assert tokens(over[i]) == want
    assert over[STOPPED][-1].finish is Finish.STOP
    assert over[-1][-1].finish is Finish.CANCELLED and len(tokens(over[-1])) == CANCELLED
    # a seeded sequence's draws repeat: run alone, with overlap, it draws what it drew in the batch
    alone, _, _ = (lambda r: r)(run_one(gpu, 1, stop))
    assert tokens(alone) == tokens(over[1])


def run_one(gpu, i: int, stop: int):
    engine = engine_for(gpu, blocks=CTX // BLOCK, max_seqs=1, max_queue=1, block_size=BLOCK, chunk=8)
    engine.scheduler.stop_ids = frozenset({stop})
    events: list[Event] = []
    engine.submit(Request(tuple(PROMPTS[i]), MAX_TOKENS[i], SAMPLING[i]), events.append)
    engine.run_until_idle()
    return events, engine, None
