"""The engine's overlapped decode (`fuselane.engine.engine`): a step of decode rows is launched before the
tokens of the one before are read. Its tokens are those without overlap, exactly: greedy and seeded, sequences
joining and leaving mid-run, stop tokens, `max_tokens`, the context's end, a cancel mid-run, preemption in a
pool of one context, a lane failing with a step in flight; a row of a sequence that ended is never reported,
and every block comes back.

The engine's side runs here on the cpu lane's paged form behind `HostPipelined`: the overlap protocol (`launch`,
`launch_next`, `collect`, `discard`) with the device's parts on the host (a step runs when launched and its
tokens wait to be collected; the step launched next feeds them, as the cuda lane's device advance does). The
cuda lane's own: tests/cuda_kernels/test_paged_overlap_interpreted.py, and tests/cuda compiled.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from fuselane.engine.batch import engine_for
from fuselane.engine.blocks import DEFAULT_BLOCK_SIZE, blocks_for
from fuselane.engine.lane import PICKED, Work
from fuselane.engine.sequence import Event, Finish, Request
from fuselane.errors import FuselaneError
from fuselane.gguf.synth import write_synthetic
from fuselane.runtime.model import load
from fuselane.runtime.sampling import GREEDY, SamplingParams

CTX = 64
PROMPTS = [list(range(3, 10)), list(range(40, 70)), [7], list(range(200, 215)), [5, 6, 7, 8]]
MAX_TOKENS = [12, 5, 20, 9, 3]
SEEDED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("overlap") / "q2.gguf", "tiny-qwen2", "q8_0", seed=5)
    return load(path, lane="cpu", ctx=CTX, dtype=np.float64)


class HostPipelined:
    """The cpu lane's paged form behind the overlap protocol (see the module), checking the engine keeps it: a
    step launched ahead holds the sequences of the step before in the same rows, each one row on."""

    overlap = True

    def __init__(self, paged) -> None:
        self.paged, self.name = paged, paged.name
        self.flights: deque[tuple[list[Work], list[int | None]]] = deque()
        self.ahead: list[int] = []  # the rows of each step launched ahead

    def step(self, works):
        assert not self.flights, "a step run while another is in flight"
        return self.paged.step(works)

    def launch(self, works):
        assert not self.flights and all(w.samples and len(w.ids) == 1 for w in works)
        self.flights.append((list(works), self.paged.step(works)))

    def launch_next(self, works):
        assert len(self.flights) == 1, "at most two steps in flight"
        last, picked = self.flights[-1]
        assert [(w.seq, w.pos, w.ids) for w in works] == [(w.seq, w.pos + 1, (PICKED,)) for w in last]
        fed = [Work(w.seq, (t,), w.pos, w.table, w.sampler) for w, t in zip(works, picked, strict=True)]
        self.ahead.append(len(works))
        self.flights.append((fed, self.paged.step(fed)))

    def collect(self):
        return self.flights.popleft()[1]

    def discard(self):
        self.flights.clear()

    def forget(self, seq):
        self.paged.forget(seq)

    def device_bytes(self):
        return 0

    def warm(self, max_seqs, chunk):
        return 0


def run(model, prompts, max_tokens, sampling, *, overlap, blocks, max_seqs=3, stop=None, cancel=None):
    """Each sequence's events, the engine and its lane. `cancel`: (sequence index, tokens after which it is
    cancelled); `stop`: the engine's stop tokens."""
    engine = engine_for(model, blocks=blocks, max_seqs=max_seqs, max_queue=len(prompts), chunk=16)
    if overlap:
        engine.lane = HostPipelined(engine.lane)
    if stop is not None:
        engine.scheduler.stop_ids = frozenset(stop)
    events: dict[int, list[Event]] = {}
    ids: list[int] = []

    def sink(e: Event) -> None:
        assert not any(x.finish for x in events.get(e.seq, [])), "an event after the sequence's end"
        events.setdefault(e.seq, []).append(e)
        if cancel and e.seq == ids[cancel[0]] and e.completion_tokens == cancel[1] and e.finish is None:
            engine.cancel(e.seq)

    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    for p, n, s in zip(prompts, max_tokens, samplings, strict=True):
        ids.append(engine.submit(Request(tuple(p), n, s), sink))
    engine.run_until_idle()
    assert engine.pool.used == 0 and engine.stats.kv_blocks_used == 0
    return [events[i] for i in ids], engine


def tokens(evs: list[Event]) -> list[list[int]]:
    return [[t for e in seq for t in e.tokens] for seq in evs]


def same(model, prompts, max_tokens, sampling, **kw):
    """Run without and with overlap: the same tokens and finishes; the overlapped engine."""
    plain, _ = run(model, prompts, max_tokens, sampling, overlap=False, **kw)
    over, engine = run(model, prompts, max_tokens, sampling, overlap=True, **kw)
    assert tokens(over) == tokens(plain)
    assert [e[-1].finish for e in over] == [e[-1].finish for e in plain]
    assert [e[-1].completion_tokens for e in over] == [e[-1].completion_tokens for e in plain]
    assert not engine.lane.flights and engine.lane.ahead  # steps were launched ahead
    return over, engine


@pytest.mark.parametrize(
    "sampling", [GREEDY, SEEDED, [GREEDY, SEEDED] * 2 + [GREEDY]], ids=["greedy", "seeded", "mixed"]
)
def test_overlap_gives_the_tokens_of_no_overlap(model, sampling):
    _, engine = same(model, PROMPTS, MAX_TOKENS, sampling, blocks=3 * blocks_for(CTX, DEFAULT_BLOCK_SIZE))
    assert max(engine.lane.ahead) == 3  # three sequences decoding together, planned ahead


def test_stop_tokens_a_cancel_and_the_context_end(model):
    plain, _ = run(model, PROMPTS, MAX_TOKENS, GREEDY, overlap=False, blocks=3 * blocks_for(CTX, 16))
    # a token the first sequence picks fourth: a stop token that ends it (and maybe others) mid-run
    stop = {tokens(plain)[0][3]}
    prompts = [*PROMPTS, list(range(1, CTX - 3))]  # the last reaches the context's end
    max_tokens = [*MAX_TOKENS, None]
    over, _ = same(model, prompts, max_tokens, GREEDY, blocks=3 * blocks_for(CTX, 16), stop=stop, cancel=(2, 4))
    assert over[0][-1].finish is Finish.STOP and len(tokens(over)[0]) == 3
    assert over[2][-1].finish is Finish.CANCELLED and len(tokens(over)[2]) == 4
    assert over[-1][-1].finish is Finish.LENGTH and len(prompts[-1]) + len(tokens(over)[-1]) == CTX + 1


def test_a_dry_pool_preempts_under_overlap(model):
    prompts, max_tokens = [list(range(10, 40)), list(range(50, 75)), list(range(80, 100))], [30, 30, 30]
    over, engine = same(model, prompts, max_tokens, SEEDED, blocks=blocks_for(CTX, DEFAULT_BLOCK_SIZE))
    assert engine.stats.preemptions > 0


def test_a_lane_failing_with_a_step_in_flight_ends_its_sequences(model):
    engine = engine_for(model, blocks=2 * blocks_for(CTX, 16), max_seqs=2, max_queue=0)
    engine.lane = lane = HostPipelined(engine.lane)
    seen: list[Event] = []
    for p in ([1, 2, 3], [4, 5]):
        engine.submit(Request(tuple(p), 20), seen.append)
    while not lane.ahead:
        engine.step()
    assert engine.pool.used > 0 and lane.flights

    def broken():
        raise FuselaneError("the model computed NaN logits")

    lane.collect = broken
    engine.step()
    assert engine.pool.used == 0 and engine.scheduler.idle and not lane.flights
    assert [e.finish for e in seen[-2:]] == [Finish.ERROR] * 2 and "NaN" in seen[-1].error


def test_overlap_is_off_on_the_cpu_lane(model):
    engine = engine_for(model, blocks=blocks_for(CTX, 16), max_seqs=1, max_queue=0)
    assert not engine.overlap and not engine.lane.overlap
