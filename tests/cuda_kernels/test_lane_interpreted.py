"""The whole cuda lane (plan, buffers, every launch) under Triton's interpreter, against the cpu lane in f64.

This is how every commit checks that each native class the cuda shim accepts has a launch that runs and
computes the right numbers, on a machine without a GPU. Tolerances come from the lane's numerics contract.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.fuse.optimizer import rule_names  # noqa: E402
from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

PROMPT = [5, 60, 7, 300, 8, 1, 2, 3, 4, 5, 6]  # past the GEMV's rows: the prefill GEMM and flash-prefill run
DECODE = [9, 10, 11]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _steps(model) -> list[np.ndarray]:
    s = model.session()
    out = [s.feed(PROMPT)]
    out += [s.extend([t]) for t in DECODE]
    return out


@pytest.mark.parametrize(("shape", "mix"), [("tiny-qwen2", "q8_0"), ("tiny-qwen3", "f16")])
@pytest.mark.parametrize("held", [False, True], ids=["fused", "every-rule-held"])
def test_cuda_lane_matches_cpu_f64(tmp_path, shape, mix, held):
    path = write_synthetic(tmp_path / "m.gguf", shape, mix, seed=4)
    gpu = load(path, lane="cuda", ctx=32)
    if held:
        gpu = load(path, lane="cuda", ctx=32, held=rule_names(gpu.lane.shim))
    ref = load(path, lane="cpu", ctx=32, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    for step, (a, b) in enumerate(zip(_steps(gpu), _steps(ref), strict=True)):
        assert np.isfinite(a).all()
        assert rel(a, b) <= tol, f"step {step}: {rel(a, b):.2e} > {tol:.2e}"


def test_prefill_in_place_decodes_the_weights_in_the_kernel(tmp_path, monkeypatch):
    # rows of 128 values under prefill=in-place: every prefill product takes the in-kernel-dequantizing GEMM,
    # none an f16 copy
    from fuselane.gguf.synth import Shape
    from fuselane.lanes.cuda.triton import gemm

    calls: list[int] = []
    real = gemm.gemm
    monkeypatch.setattr(gemm, "gemm", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    shape = Shape("qwen2", 128, 1, 4, 2, 32, 256, 512, context=4096)
    path = write_synthetic(tmp_path / "m.gguf", shape, "q8_0", seed=6)
    gpu = load(path, lane="cuda", ctx=32, knobs=["prefill=in-place"])
    ref = load(path, lane="cpu", ctx=32, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    a, b = gpu.session().feed(PROMPT), ref.session().feed(PROMPT)
    assert np.isfinite(a).all() and rel(a, b) <= tol
    assert calls, "no prefill product took the GEMM"
    assert not any(n != "token_embd.weight" for n in gpu.lane._dense), "a product made an f16 copy"
