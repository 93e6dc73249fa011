"""The cuda lane against the cpu lane in f64, on a GPU (`pytest -m cuda`; skipped where there is none).

Tolerances come from the cuda lane's numerics contract (`Contract.logits_tolerance`): f32 arithmetic, the KV
cache in f16 or f32, activations in int8 (the default) or dequantized, each model run at both. The decode
loop (`CudaLane.decode`) is held to the host's path over the same lane (each step's logits copied out and
picked by the host `Sampler`) and profiled: a step must be one graph replay and one copy of the 8-byte pick,
never of the logits.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

from fuselane.fuse.optimizer import rule_names  # noqa: E402
from fuselane.gguf.synth import Shape, write_synthetic  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from fuselane.runtime.sampling import GREEDY, Sampler, SamplingParams  # noqa: E402

PROMPT = [11, 200, 7, 7, 90, 3, 141, 52, 9]
STEPS = 24
GREEDY_STEPS = 64
DECODE_TOKENS = 48
DECODE_WARM = 4  # tokens read before profiling: the loop's first steps compile its kernels and capture its graph
PROFILED = 8
TOP_K = 5
PICK_BYTES = 8  # the sampler's pick the host reads a step: two int32 (`triton.sample.PICKED_VALUES`)
# A small model whose rows are whole 256-value super-blocks, so the Q4_K_M mix really uses Q4_K and Q6_K.
K_SHAPE = Shape("qwen3", 256, 3, 4, 2, 64, 512, 512)
CASES = [("tiny-qwen2", "q8_0"), ("tiny-qwen3", "f32"), ("tiny-qwen3", "f16"), (K_SHAPE, "q4_k_m")]
NUMERICS = {"int8": [], "dequant": ["activations=dequant"]}  # the knobs of each numerics a model runs at


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{getattr(c[0], 'arch', c[0])}-{c[1]}")
def checkpoint(request, tmp_path_factory):
    shape, mix = request.param
    path = write_synthetic(tmp_path_factory.mktemp("m") / "m.gguf", shape, mix, seed=3)
    return path, load(path, lane="cpu", ctx=128, dtype=np.float64)


@pytest.fixture(scope="module", params=NUMERICS)
def pair(request, checkpoint):
    """(checkpoint, the cuda lane at one numerics, the cpu lane in f64)."""
    path, ref = checkpoint
    gpu = load(path, lane="cuda", ctx=128, knobs=NUMERICS[request.param])
    return path, gpu, ref


def _knobs(gpu) -> list[str]:
    """The knobs that load another lane at `gpu`'s numerics."""
    return [f"activations={gpu.lane.shim.knobs.activations.value}"]


def _run(model, ids, steps):
    s = model.session()
    out = [s.feed(ids)]
    for i in range(steps):
        out.append(s.extend([int(ids[i % len(ids)])]))
    return np.array(out)


def test_logits_match_cpu_f64_within_the_contract(pair):
    path, gpu, ref = pair
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    mine, theirs = _run(gpu, PROMPT, STEPS), _run(ref, PROMPT, STEPS)
    assert np.isfinite(mine).all()
    for step, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        assert rel(a, b) <= tol, f"step {step}: {rel(a, b):.2e} > {tol:.2e}"


def test_fused_equals_held_plan(pair):
    path, gpu, _ = pair
    every = [r for r in rule_names(gpu.lane.shim)]
    held = load(path, lane="cuda", ctx=128, held=every, knobs=_knobs(gpu))
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    assert rel(_run(gpu, PROMPT, 4), _run(held, PROMPT, 4)) <= tol


def test_dependent_launches_change_no_bit(pair):
    """Kernels launched as dependents of the one before (`pdl`, on by default on Hopper) wait for their
    inputs: the logits are those of the plain launch order, bit for bit."""
    path, gpu, _ = pair
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("dependent launches need compute capability 9.0")
    assert gpu.lane.dependent_launch
    plain = load(path, lane="cuda", ctx=128, knobs=[*_knobs(gpu), "pdl=off"])
    assert not plain.lane.dependent_launch
    np.testing.assert_array_equal(_run(gpu, PROMPT, STEPS), _run(plain, PROMPT, STEPS))


def test_weight_loads_ahead_change_no_bit(pair):
    """The int8 GEMVs' weights on the coherent path, held ahead by the prefetch's barrier (`weight_loads=ahead`),
    are the same bytes summed in the same order: the logits are the default's, bit for bit."""
    path, gpu, _ = pair
    ahead = load(path, lane="cuda", ctx=128, knobs=[*_knobs(gpu), "weight_loads=ahead"])
    np.testing.assert_array_equal(_run(gpu, PROMPT, STEPS), _run(ahead, PROMPT, STEPS))


def test_every_launch_runs_on_the_lanes_one_stream(pair):
    # cuBLAS keeps a workspace for every stream it ran on: the eager runs take the stream the graphs are
    # captured on, ordered after the caller's stream's work, and hand the caller its stream back
    _, gpu, _ = pair
    lane, caller = gpu.lane, torch.cuda.current_stream()
    with lane.launching():
        inside = torch.cuda.current_stream()
        with lane.launching():  # a capture's run, already on the lane's stream, stays there
            nested = torch.cuda.current_stream()
    assert inside == nested == lane.capture_stream()
    assert inside != caller
    assert torch.cuda.current_stream() == caller


def test_prompts_of_many_lengths_share_one_arena_and_keep_the_cpu_lanes_numbers(pair):
    # every new step lays its activations out in the lane's arena: steps of many row counts, each captured as a
    # graph on its third run, replay over it in turn; a longer prompt replaces it for the steps made after, the
    # captured ones keep theirs, and the numbers stay the cpu lane's
    _, gpu, ref = pair
    lane = gpu.lane
    tol = lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    ids = PROMPT * 4
    lane.step(len(PROMPT))  # the arena holds the longest of the first lengths
    arena = lane._arena.untyped_storage().data_ptr()
    for length in [*[3, len(PROMPT), 5, 2] * 3, 4 * len(PROMPT), 3, 4, 4, 4]:
        a, b = gpu.session().feed(ids[:length]), ref.session().feed(ids[:length])
        assert np.isfinite(a).all() and rel(a, b) <= tol, f"{length} rows: {rel(a, b):.2e} > {tol:.2e}"
        if length > len(PROMPT):
            arena = None  # replaced, where no earlier test made a longer step
        elif arena is not None:
            assert lane._arena.untyped_storage().data_ptr() == arena, f"{length} rows replaced the arena"
    assert lane.step(3).graphs and lane.step(4).graphs, "a step was not captured"


def test_greedy_tokens_match_cpu(pair):
    """At the dequantized numerics: int8's bound (5.0e-2 relative) makes most steps of these random-weight
    models near-ties of the reference, so the comparison would test little (`test_anchor_shapes` says more)."""
    path, gpu, ref = pair
    if gpu.lane.shim.activation_format is not None:
        pytest.skip("greedy tokens are compared at the dequantized numerics")
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    sg, sr = gpu.session(), ref.session()
    lg, lr = sg.feed(PROMPT), sr.feed(PROMPT)
    for step in range(GREEDY_STEPS):
        top2 = np.sort(lr)[-2:]
        near_tie = top2[1] - top2[0] <= 2 * tol * np.max(np.abs(lr))
        a, b = int(np.argmax(lg)), int(np.argmax(lr))
        if not near_tie:
            assert a == b, f"step {step}"
        lg, lr = sg.extend([b]), sr.extend([b])  # both follow the reference, so one near-tie does not cascade


def test_decode_step_is_one_graph_replay(pair):
    path, gpu, _ = pair
    s = gpu.session()
    s.feed(PROMPT)
    for t in PROMPT[:3]:
        s.extend([t])
    step = gpu.lane.step(1)
    assert step.graphs.get(None) is not None


def _host_path(model, ids, n, fed=None):
    """`n` steps the host's way over the same lane: each step's logits copied out and arg-maxed by `Sampler`,
    the next step fed that token (or `fed[i]`, where given). The tokens picked, and each step's logits."""
    pos = model.session().prepare(ids)
    sampler, token, picked, logits = Sampler(GREEDY), ids[-1], [], []
    for i in range(n):
        logits.append(model.lane.forward(np.array([token]), pos + i)[-1])
        picked.append(sampler(logits[-1]))
        token = picked[-1] if fed is None else fed[i]
    return picked, logits


def test_decode_loop_greedy_equals_the_host_path(pair):
    path, gpu, _ = pair
    pos = gpu.session().prepare(PROMPT)
    mine = list(itertools.islice(gpu.lane.decode(PROMPT[-1], pos, GREEDY), DECODE_TOKENS))
    # the same launches on the same inputs: the same logits, so the same tokens, not only near ties aside
    theirs, _ = _host_path(gpu, PROMPT, DECODE_TOKENS)
    assert mine == theirs


def test_decode_loop_sampling_is_seeded_and_keeps_to_top_k(pair):
    path, gpu, _ = pair
    params = SamplingParams(temperature=1.5, top_k=TOP_K, top_p=1.0, seed=11)

    def run(sampling):
        pos = gpu.session().prepare(PROMPT)
        return list(itertools.islice(gpu.lane.decode(PROMPT[-1], pos, sampling), DECODE_TOKENS))

    drawn = run(params)
    assert drawn == run(params), "the same seed gave other tokens"
    assert drawn != run(SamplingParams(temperature=1.5, top_k=TOP_K, top_p=1.0, seed=12))
    _, logits = _host_path(gpu, PROMPT, DECODE_TOKENS, fed=drawn)
    for step, (token, row) in enumerate(zip(drawn, logits, strict=True)):
        assert token in np.argsort(-row)[:TOP_K], f"step {step}: a token outside the top {TOP_K}"


def test_a_decode_step_is_one_graph_replay_and_copies_no_logits(pair, tmp_path):
    from fuselane.lanes.cuda.triton import sample  # here: importing kernels at collection fixes Triton's mode

    assert PICK_BYTES == sample.PICKED_VALUES * sample.PICKED_DTYPE.itemsize
    path, gpu, _ = pair
    pos = gpu.session().prepare(PROMPT)
    steps = gpu.lane.decode(PROMPT[-1], pos, GREEDY)
    for _ in range(DECODE_WARM):
        next(steps)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(PROFILED):
            next(steps)
        torch.cuda.synchronize()
    steps.close()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = [e.get("name", "") for e in events]
    assert names.count("cudaGraphLaunch") == PROFILED, "a decode step is one graph replay"
    launches = [n for n in names if "LaunchKernel" in n]
    assert not launches, f"kernels launched outside the graph: {sorted(set(launches))}"
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    assert len(copies) == PROFILED, "one copy a step: the pick"
    assert all(e["args"]["bytes"] <= PICK_BYTES for e in copies), "logits were copied to the host"
