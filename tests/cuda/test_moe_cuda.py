"""The cuda lane on the mixtures at the real widths, on a GPU (`pytest -m cuda`; skipped where there is none).

Qwen3-30B-A3B's widths (n_embd 2048, 32 heads of 128, 4 kv heads, 128 experts, top-8, expert ffn 768) and a
Qwen1.5-MoE-A2.7B's (60 experts, top-4, expert ffn 1408, a shared expert of 5632) in Q4_K_M, with 2 layers
and a small vocabulary (the lm head is no mixture kernel; it keeps the f64 reference short): the prompt's
chunk, decode steps against the cpu lane in f64 within the contract at both numerics, the decode loop's
graph replays against the host path's steps (the same launches: the same tokens), and a decode step within
the budget of 8 launches a layer.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

from fuselane.explain import launches_per_layer  # noqa: E402
from fuselane.gguf.synth import SHAPES, write_synthetic  # noqa: E402
from fuselane.lanes.cuda.plan import kernels  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from fuselane.runtime.sampling import GREEDY, Sampler  # noqa: E402
from tests.long_prompt import feed_both  # noqa: E402

LAYERS, VOCAB, SEED = 2, 4096, 7
PROMPT = [11, 200, 7, 7, 90, 3, 141, 52, 9, 1000, 17, 4000]  # past the GEMV's rows: a chunk
DECODE = [5, 6, 7]
LONG = kernels.MOE_CHUNK_ROWS + 88  # a prompt of a whole mixture chunk and a partial one
LAUNCH_BUDGET = 8  # a decode step's launches a layer
SHAPE_NAMES = ["qwen3-30b-a3b", "qwen1.5-moe-a2.7b"]
NUMERICS = {"int8": [], "dequant": ["activations=dequant"]}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# a shape's tests run on one worker under pytest-xdist, which builds its reference once
@pytest.fixture(
    scope="module",
    params=[pytest.param(name, marks=pytest.mark.xdist_group(f"moe-{name}")) for name in SHAPE_NAMES],
)
def mixture(request, tmp_path_factory):
    name = request.param
    shape = replace(SHAPES[name], n_layers=LAYERS, vocab=VOCAB)
    path = write_synthetic(tmp_path_factory.mktemp(name) / f"{name}.gguf", shape, "q4_k_m", seed=SEED)
    ref = load(path, lane="cpu", ctx=64, dtype=np.float64)
    s = ref.session()
    want = [s.feed(PROMPT)] + [s.extend([t]) for t in DECODE]
    yield path, want
    ref.close()


@pytest.mark.parametrize("numerics", list(NUMERICS))
def test_mixture_logits_match_the_cpu_lane(mixture, numerics):
    path, want = mixture
    gpu = load(path, lane="cuda", ctx=64, knobs=NUMERICS[numerics])
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    s = gpu.session()
    got = [s.feed(PROMPT)] + [s.extend([t]) for t in DECODE]
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.isfinite(a).all() and rel(a, b) <= tol, f"step {step}: {rel(a, b):.2e} > {tol:.2e}"
    gpu.close()


def test_decode_loop_replays_the_host_steps_within_the_launch_budget(mixture):
    path, _ = mixture
    gpu = load(path, lane="cuda", ctx=64)
    per_layer = launches_per_layer(gpu.lane.step(1).plan)
    assert max(per_layer.values()) <= LAUNCH_BUDGET, per_layer
    pos = gpu.session().prepare(PROMPT)
    replayed = list(itertools.islice(gpu.lane.decode(PROMPT[-1], pos, GREEDY), len(DECODE)))
    pos = gpu.session().prepare(PROMPT)  # the same prompt again: the host path from the same cache
    sampler, token, host = Sampler(GREEDY), PROMPT[-1], []
    for i in range(len(DECODE)):
        host.append(sampler(gpu.lane.forward(np.array([token]), pos + i)[-1]))
        token = host[-1]
    assert replayed == host  # the counters re-arm: every replay routes and norms as the first
    gpu.close()


def test_the_prompts_chunk_runs_the_grouped_expert_gemm(mixture, monkeypatch):
    # the chunk past the GEMV's rows multiplies the kept experts on the tensor cores (`triton.moe.grouped`):
    # gate/up in every layer; the down products where the grouped GEMM takes the experts' rows (Qwen1.5's
    # 1408-wide Q4_K_M down rows are Q8_0 / Q5_0 there, of whole 128-value steps), and the logits as the cpu lane's
    from fuselane.lanes.cuda.triton.moe import grouped

    calls = {"gate_up_grouped": 0, "down_grouped": 0}
    for name in calls:
        real = getattr(grouped, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(grouped, name, counted)
    path, want = mixture
    gpu = load(path, lane="cuda", ctx=64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    got = gpu.session().feed(PROMPT)
    assert calls == {"gate_up_grouped": LAYERS, "down_grouped": LAYERS}, calls
    assert np.isfinite(got).all() and rel(got, want[0]) <= tol, f"{rel(got, want[0]):.2e} > {tol:.2e}"
    gpu.close()


def test_a_long_prompt_runs_in_the_lanes_chunks_as_the_cpu_lane(tmp_path):
    # a session takes a mixture's prompt 512 rows at a time (`CudaLane.prefill_chunk`): a full chunk, then 88 rows;
    # 16 of the 30B-A3B's experts, so each meets ~300 pairs (many tiles of the grouped GEMM) and the f64
    # reference, which dequantizes every expert a chunk meets, stays short
    shape = replace(SHAPES["qwen3-30b-a3b"], n_layers=LAYERS, vocab=VOCAB, experts=16)
    path = write_synthetic(tmp_path / "long.gguf", shape, "q4_k_m", seed=SEED)
    tokens = np.random.default_rng(SEED).integers(0, VOCAB, LONG).tolist()
    got, want, tol, chunk = feed_both(path, tokens)
    assert chunk == kernels.MOE_CHUNK_ROWS
    assert np.isfinite(got).all() and rel(got, want) <= tol, f"{rel(got, want):.2e} > {tol:.2e}"
