"""The cuda lane against the cpu lane in f64, on a GPU (`pytest -m cuda`; skipped where there is none).

Tolerances come from the cuda lane's numerics contract (`Contract.logits_tolerance`): f32 arithmetic, the KV
cache in f16 or f32, dequantized activations.
"""

from __future__ import annotations

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

PROMPT = [11, 200, 7, 7, 90, 3, 141, 52, 9]
STEPS = 24
GREEDY_STEPS = 64
# A small model whose rows are whole 256-value super-blocks, so the Q4_K_M mix really uses Q4_K and Q6_K.
K_SHAPE = Shape("qwen3", 256, 3, 4, 2, 64, 512, 512)
CASES = [("tiny-qwen2", "q8_0"), ("tiny-qwen3", "f32"), ("tiny-qwen3", "f16"), (K_SHAPE, "q4_k_m")]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{getattr(c[0], 'arch', c[0])}-{c[1]}")
def pair(request, tmp_path_factory):
    shape, mix = request.param
    path = write_synthetic(tmp_path_factory.mktemp("m") / "m.gguf", shape, mix, seed=3)
    gpu = load(path, lane="cuda", ctx=128)
    ref = load(path, lane="cpu", ctx=128, dtype=np.float64)
    return path, gpu, ref


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
    held = load(path, lane="cuda", ctx=128, held=every)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    assert rel(_run(gpu, PROMPT, 4), _run(held, PROMPT, 4)) <= tol


def test_greedy_tokens_match_cpu(pair):
    path, gpu, ref = pair
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
    assert step.graph is not None
