"""Batch equals single: every sequence the engine runs with others (joining and leaving mid-run, prefilled in
chunks between decode steps, preempted and recomputed when the pool runs dry) produces exactly the tokens it
produces alone through `Model.generate_ids`, greedy and seeded sampling alike, and every block comes back."""

from __future__ import annotations

import numpy as np
import pytest

from fuselane.engine.batch import engine_for
from fuselane.engine.blocks import DEFAULT_BLOCK_SIZE, blocks_for
from fuselane.engine.sequence import Event, Finish, Request
from fuselane.errors import FuselaneError
from fuselane.gguf.synth import write_synthetic
from fuselane.runtime.model import load
from fuselane.runtime.sampling import GREEDY, SamplingParams

CTX = 96
# prompts of different lengths (one past several prefill chunks) and replies of different lengths, so that
# sequences join and leave while others run
PROMPTS = [list(range(3, 10)), list(range(40, 101)), [7], list(range(200, 230)), [5, 6, 7, 8, 9, 10, 11, 12]]
MAX_TOKENS = [12, 5, 20, 9, 3]
SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("engine") / "q2.gguf", "tiny-qwen2", "q8_0", seed=5)
    return load(path, lane="cpu", ctx=CTX, dtype=np.float64)


def alone(model, prompt, max_tokens, sampling) -> list[int]:
    return list(model.generate_ids(model.session(), prompt, max_tokens=max_tokens, sampling=sampling))


class Recorder:
    """The paged lane as the engine sees it, with each step's work written down (the steps run unchanged)."""

    def __init__(self, lane) -> None:
        self.lane, self.name, self.steps = lane, lane.name, []

    def step(self, works):
        self.steps.append([(w.seq, len(w.ids), w.samples) for w in works])
        return self.lane.step(works)

    def forget(self, seq):
        self.lane.forget(seq)

    def device_bytes(self):
        return self.lane.device_bytes()

    def warm(self, max_seqs, chunk):
        return self.lane.warm(max_seqs, chunk)


def run(model, prompts, max_tokens, sampling, *, max_seqs, blocks, chunk):
    engine = engine_for(model, blocks=blocks, max_seqs=max_seqs, max_queue=len(prompts), chunk=chunk)
    engine.lane = recorder = Recorder(engine.lane)
    events: dict[int, list[Event]] = {}
    ids = [
        engine.submit(Request(tuple(p), n, sampling), lambda e: events.setdefault(e.seq, []).append(e))
        for p, n in zip(prompts, max_tokens, strict=True)
    ]
    engine.run_until_idle()
    return engine, recorder, [events[i] for i in ids]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_batch_equals_single(model, sampling):
    blocks = 3 * blocks_for(CTX, DEFAULT_BLOCK_SIZE)
    engine, recorder, events = run(model, PROMPTS, MAX_TOKENS, sampling, max_seqs=3, blocks=blocks, chunk=16)
    for prompt, n, evs in zip(PROMPTS, MAX_TOKENS, events, strict=True):
        got = [t for e in evs for t in e.tokens]
        assert got == alone(model, prompt, n, sampling)
        assert evs[-1].finish is (Finish.LENGTH if len(got) == n else Finish.STOP)  # a stop token ends one early
        assert evs[-1].completion_tokens == len(got)
    # the run overlapped: a step decoded some sequences while it prefilled another; a sequence joined while
    # others ran, and after one had left
    assert any(any(s for *_, s in step) and any(not s for *_, s in step) for step in recorder.steps)
    spans = {}
    for i, step in enumerate(recorder.steps):
        for seq, *_ in step:
            spans[seq] = (spans.get(seq, (i, i))[0], i)
    assert any(a[0] < b[0] <= a[1] for a in spans.values() for b in spans.values())
    assert any(a[1] < b[0] for a in spans.values() for b in spans.values())
    assert max(n for step in recorder.steps for _, n, s in step if not s) <= 16  # chunks within the budget
    assert engine.pool.used == 0 and engine.stats.kv_blocks_used == 0


def test_a_dry_pool_preempts_and_recomputes(model):
    # one context's worth of blocks for three sequences that each grow past a third of it
    blocks = blocks_for(CTX, DEFAULT_BLOCK_SIZE)
    prompts, max_tokens = [list(range(10, 40)), list(range(50, 75)), list(range(80, 100))], [30, 30, 30]
    engine, _, events = run(model, prompts, max_tokens, GREEDY, max_seqs=3, blocks=blocks, chunk=64)
    assert engine.stats.preemptions > 0
    for prompt, n, evs in zip(prompts, max_tokens, events, strict=True):
        assert [t for e in evs for t in e.tokens] == alone(model, prompt, n, GREEDY)
    assert engine.pool.used == 0


def test_the_context_end_finishes_a_sequence(model):
    prompt = list(range(1, CTX - 2))
    _, _, (evs,) = run(model, [prompt], [None], GREEDY, max_seqs=1, blocks=blocks_for(CTX, 16), chunk=256)
    got = [t for e in evs for t in e.tokens]
    assert got == alone(model, prompt, CTX, GREEDY)  # generate_ids stops at the context's end too
    assert len(prompt) + len(got) == CTX + 1 and evs[-1].finish is Finish.LENGTH


def test_generate_batch_equals_generate(model):
    prompts = ["hello there", "a longer prompt", "x"]
    settings = [GREEDY, SAMPLED, SamplingParams(temperature=1.0, seed=3)]
    expect = [model.generate(p, max_tokens=10, sampling=s) for p, s in zip(prompts, settings, strict=True)]
    assert model.generate_batch(prompts, max_tokens=10, sampling=settings, max_seqs=2) == expect
    raw = [model.generate(p, max_tokens=6, raw=True) for p in prompts]
    assert model.generate_batch(prompts, max_tokens=6, raw=True) == raw
    assert model.generate_batch([], max_tokens=6) == []
    for bad in [{"max_seqs": 0}, {"max_tokens": -1}, {"sampling": [GREEDY]}]:
        with pytest.raises(FuselaneError):
            model.generate_batch(prompts, **({"max_tokens": 4} | bad))


def test_generate_batch_leaves_a_chat_cache_alone(model):
    chat = model.chat()
    first = "".join(chat.say("hi", max_tokens=4))
    model.generate_batch(["something else entirely"], max_tokens=4)
    second = "".join(chat.say("and again", max_tokens=6))  # reuses its cache: it must still hold the first turn
    fresh = model.chat()
    assert "".join(fresh.say("hi", max_tokens=4)) == first
    assert "".join(fresh.say("and again", max_tokens=6)) == second


def test_a_request_without_blocks_waits(model):
    # the pool holds one context (6 blocks): the long prompt takes 5, so the second waits until it ends
    prompts, max_tokens = [list(range(1, 81)), list(range(1, 31))], [4, 4]
    blocks = blocks_for(CTX, DEFAULT_BLOCK_SIZE)
    engine, recorder, events = run(model, prompts, max_tokens, GREEDY, max_seqs=2, blocks=blocks, chunk=256)
    ran = [{seq for seq, *_ in step} for step in recorder.steps]
    assert {1, 2} not in ran and max(i for i, s in enumerate(ran) if 1 in s) < min(
        i for i, s in enumerate(ran) if 2 in s
    )
    for prompt, n, evs in zip(prompts, max_tokens, events, strict=True):
        assert [t for e in evs for t in e.tokens] == alone(model, prompt, n, GREEDY)
    assert engine.stats.preemptions == 0 and engine.pool.used == 0
