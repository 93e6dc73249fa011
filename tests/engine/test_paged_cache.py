"""The paged KV cache's bookkeeping, the stop strings, the pool's sizing and the engine's queue: blocks are
taken as rows reach them and all come back when a sequence finishes, is cancelled or fails; a full queue refuses."""

from __future__ import annotations

import numpy as np
import pytest

from fuselane.engine.batch import engine_for
from fuselane.engine.blocks import BlockPool, BlockTable, blocks_for
from fuselane.engine.engine import QueueFull
from fuselane.engine.sequence import Finish, Request
from fuselane.engine.sizing import pool_blocks
from fuselane.engine.stops import StopText
from fuselane.errors import FuselaneError
from fuselane.gguf.synth import write_synthetic
from fuselane.runtime.model import load

CTX = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("paged") / "q3.gguf", "tiny-qwen3", "q8_0", seed=3)
    return load(path, lane="cpu", ctx=CTX)


def test_blocks_are_taken_as_rows_reach_them_and_all_return():
    pool = BlockPool(5, 4)
    a, b = BlockTable(), BlockTable()
    assert pool.grow(a, 1) and a.blocks == [0] and pool.grow(a, 4) and a.blocks == [0]
    assert pool.grow(b, 9) and b.blocks == [1, 2, 3] and pool.used == 4
    assert not pool.grow(a, 9) and a.blocks == [0]  # two more would pass the pool: nothing taken
    assert pool.grow(a, 8) and a.blocks == [0, 4] and pool.free == 0
    # sequence a's rows 2 .. 5 live at slots 2, 3 of block 0 and 0, 1 of block 4
    assert a.rows(2, 6, 4).tolist() == [2, 3, 16, 17]
    pool.release(b)
    pool.release(b)  # a second release gives nothing back twice
    assert pool.free == 3 and b.blocks == []
    pool.release(a)
    assert pool.used == 0 and pool.free == 5


def test_stop_strings_are_held_back_and_never_shown():
    class Letters:  # a decoder of one character a token
        def push(self, token: int) -> str:
            return chr(token)

        def flush(self) -> str:
            return ""

    text = StopText(Letters(), ["END", "xyz"])
    shown = "".join(text.push(ord(c)) for c in "abcENxEN")
    assert shown == "abcENx" and not text.stopped  # "EN" may still become "END"
    assert text.push(ord("D")) == "" and text.stopped
    assert text.push(ord("q")) == "" and text.flush() == ""
    partial = StopText(Letters(), ["END"])
    assert "".join(partial.push(ord(c)) for c in "aEN") == "a" and partial.flush() == "EN"


def test_a_stop_string_ends_the_sequence_before_it(model):
    ids = model.prompt_ids("tell me", raw=True)
    whole = model.tokenizer.decode(list(model.generate_ids(model.session(), ids, max_tokens=12)))
    stop = whole[5:7]
    engine = engine_for(model, blocks=blocks_for(CTX, 16), max_seqs=1, max_queue=1)
    seen = []
    engine.submit(Request(tuple(ids), 12, stop=(stop,)), seen.append)
    engine.run_until_idle()
    assert "".join(e.text for e in seen) == whole[: whole.index(stop)]
    assert seen[-1].finish is Finish.STOP and engine.pool.used == 0


def test_ignore_eos_runs_past_the_end_tokens_to_max_tokens(model):
    ids = model.prompt_ids("tell me", raw=True)
    whole = list(model.generate_ids(model.session(), ids, max_tokens=12))
    ends = []
    for ignore in (False, True):
        engine = engine_for(model, blocks=blocks_for(CTX, 16), max_seqs=1, max_queue=1)
        engine.scheduler.stop_ids = frozenset({whole[2]})  # the model's third token is an end token here
        seen = []
        engine.submit(Request(tuple(ids), 12, ignore_eos=ignore), seen.append)
        engine.run_until_idle()
        ends.append((sum((e.tokens for e in seen), ()), seen[-1].finish))
    assert ends[0] == (tuple(whole[:2]), Finish.STOP)
    assert ends[1] == (tuple(whole), Finish.LENGTH)


def test_cancelled_and_failed_sequences_return_their_blocks(model):
    engine = engine_for(model, blocks=2 * blocks_for(CTX, 16), max_seqs=2, max_queue=0)
    seen = []
    first = engine.submit(Request(tuple(range(1, 30)), 20), seen.append)
    engine.submit(Request(tuple(range(1, 20)), 20), seen.append)
    with pytest.raises(QueueFull):  # two run, none may wait
        engine.submit(Request((1, 2, 3), 5), seen.append)
    for _ in range(3):
        engine.step()
    assert engine.pool.used == blocks_for(30, 16) + blocks_for(20, 16)
    engine.cancel(first)
    engine.step()
    assert engine.pool.used == blocks_for(20 + 2, 16) and engine.stats.running == 1
    assert [e.finish for e in seen if e.seq == first][-1] is Finish.CANCELLED

    def broken(works):
        raise FuselaneError("the model computed NaN logits")

    engine.lane.step = broken  # the lane fails mid-run: its sequences end with the error, blocks come back
    engine.step()
    assert engine.pool.used == 0 and engine.scheduler.idle
    assert seen[-1].finish is Finish.ERROR and "NaN" in seen[-1].error
    engine.submit(Request((1, 2, 3), 5), seen.append)  # the queue has room again


def test_requests_that_cannot_run_are_refused(model):
    engine = engine_for(model, blocks=blocks_for(CTX, 16), max_seqs=1, max_queue=1)
    for prompt, words in [((), "empty"), (tuple(range(CTX)), "no room"), ((1, 10**6), "vocabulary")]:
        with pytest.raises(FuselaneError, match=words):
            engine.submit(Request(prompt, 4), print)
    seen = []
    engine.submit(Request((1, 2), 0), seen.append)  # nothing to generate: it ends at once, running nothing
    assert seen[0].finish is Finish.LENGTH and seen[0].text == "" and engine.scheduler.idle


def test_the_pool_is_sized_from_blocks_or_memory():
    kw = {"ctx": 100, "max_seqs": 4, "block_size": 16, "block_bytes": 1000, "lane": "cpu"}
    assert pool_blocks(kv_blocks=None, gpu_memory=None, device=None, **kw) == 4 * 7
    assert pool_blocks(kv_blocks=9, gpu_memory=None, device=None, **kw) == 9
    assert pool_blocks(kv_blocks=999, gpu_memory=None, device=None, **kw) == 28  # no more than can be used
    from fuselane.engine.lane import DeviceMemory

    gpu = DeviceMemory(total=100_000, used=40_000)
    assert pool_blocks(kv_blocks=None, gpu_memory=0.5, device=gpu, **kw) == 10
    assert pool_blocks(kv_blocks=None, gpu_memory=None, device=gpu, **kw) == 28  # 0.9: 50 blocks, capped
    for kv_blocks, gpu_memory, device, words in [
        (6, None, None, "less than one context"),
        (None, 0.45, gpu, "less than one context"),
        (None, 0.5, None, "--kv-blocks"),
        (3, 0.5, gpu, "not both"),
    ]:
        with pytest.raises(FuselaneError, match=words):
            pool_blocks(kv_blocks=kv_blocks, gpu_memory=gpu_memory, device=device, **kw)


def test_the_pool_holds_what_the_scratch_held(model):
    """The cpu lane's pool rows are the rows a sequence's cache holds alone: the same keys at the same places."""
    engine = engine_for(model, blocks=2 * blocks_for(CTX, 16), max_seqs=2, max_queue=0)
    prompt = tuple(range(5, 45))
    engine.submit(Request(prompt, 1), print)
    engine.step()  # the prefill chunk of all but the last token
    seq = engine.scheduler.running[0]
    session = model.session()
    session.feed(list(prompt[:-1]))
    lane = engine.lane
    rows = seq.table.rows(0, len(prompt) - 1, 16)
    for name, pool in lane.pool.items():
        assert np.array_equal(pool[rows], model.lane.cache(name, ())[: len(prompt) - 1])
