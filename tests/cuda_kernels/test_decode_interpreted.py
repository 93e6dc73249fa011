"""The cuda lane's decode loop (`CudaLane.decode`) under Triton's interpreter: each step's launches, the device
sampler after them, the sampler's token and position feeding the next step, and the loop's one step of
lookahead, on a one-layer synthetic model (the interpreter is slow: about a second a step).

Greedy tokens must equal the cpu lane's, through the runtime's own loop (`Model.generate_ids`), with the same
session bookkeeping; that the equality is no luck of rounding is checked too: along those tokens, the f64
logits' best two are further apart than the cuda lane's numerics contract lets a logit move.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.errors import FuselaneError  # noqa: E402
from fuselane.gguf.synth import Shape, write_synthetic  # noqa: E402
from fuselane.models.qwen import IDS, POS  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from fuselane.runtime.sampling import GREEDY, SamplingParams  # noqa: E402

ONE_LAYER = Shape("qwen3", 64, 1, 4, 2, 16, 128, 512, context=4096)
CTX = 12
PROMPT = [1, 2, 3, 4]  # with the seed below: the f64 top-2 gaps are 11x the bound or more
TOKENS = 5
SAMPLED = 2  # tokens of each sampling run, decoded at the cache's end so no step runs past them
SAMPLING = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("m") / "m.gguf", ONE_LAYER, "f32", seed=6)


@pytest.fixture(scope="module")
def gpu(path):
    return load(path, lane="cuda", ctx=CTX)


def test_greedy_decode_equals_the_cpu_lane(path, gpu):
    cpu = load(path, lane="cpu", ctx=CTX)
    mine, theirs = gpu.session(), cpu.session()
    tokens = list(gpu.generate_ids(mine, PROMPT, max_tokens=TOKENS, sampling=GREEDY))
    assert tokens == list(cpu.generate_ids(theirs, PROMPT, max_tokens=TOKENS, sampling=GREEDY))
    assert len(tokens) == TOKENS and not set(tokens) & gpu.tokenizer.stop_ids
    # the session holds what was fed: the prompt and every token but the last
    assert mine.tokens == theirs.tokens == PROMPT + tokens[:-1]
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64).session()
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    logits = ref.feed(PROMPT)
    for step, token in enumerate(tokens):
        second, first = np.sort(logits)[-2:]
        assert first - second > 2 * tol * np.max(np.abs(logits)), f"step {step} is a near tie: pick another case"
        assert token == int(np.argmax(logits))
        logits = ref.extend([token])


def test_the_loop_runs_a_step_ahead_and_stops_at_the_cache_end(gpu):
    lane = gpu.lane
    step = lane.step(1)
    pos = CTX - 3
    steps = lane.decode(PROMPT[-1], pos, GREEDY)
    first = next(steps)
    # the step after it (feeding `first` at pos + 1) has run: its pick is the input of the step after that
    assert int(step.bufs[POS].item()) == pos + 2
    ahead = int(step.bufs[IDS].item())
    second = next(steps)
    assert second == ahead
    third = next(steps)
    with pytest.raises(StopIteration):  # the third came from the cache's last row: no step past it
        next(steps)
    assert int(step.bufs[POS].item()) == CTX
    # the same positions again, one token at a time through `forward`: the same tokens
    again = [PROMPT[-1]]
    for p in range(pos, CTX):
        again.append(int(np.argmax(lane.forward(np.array([again[-1]]), p))))
    assert again[1:] == [first, second, third]


def test_seeded_sampling_repeats_and_top_k_one_is_greedy(gpu):
    lane = gpu.lane
    pos = CTX - SAMPLED  # the rows below are whatever earlier steps left: the same for every run here

    def run(sampling: SamplingParams) -> list[int]:
        return list(lane.decode(PROMPT[-1], pos, sampling))

    a = run(SAMPLING)
    assert len(a) == SAMPLED
    assert a == run(SAMPLING), "the same seed gave other tokens"
    greedy = run(GREEDY)
    assert run(SamplingParams(temperature=0.9, top_k=1, top_p=1.0, seed=1)) == greedy


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_nan_logits_raise(path):
    bad = load(path, lane="cuda", ctx=CTX)
    bad.lane.vec["output_norm.weight"].fill_(float("nan"))
    for sampling in (GREEDY, SAMPLING):
        with pytest.raises(FuselaneError, match="NaN"):
            list(bad.lane.decode(PROMPT[-1], CTX - 1, sampling))
