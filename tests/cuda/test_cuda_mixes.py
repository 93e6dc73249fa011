"""Every llama.cpp mix on the cuda lane's decode GEMVs (int8 for the quantized formats, the f32 row for BF16) and
its prefill (a chunk on cuBLAS, a chunk of a few rows, then decode steps),
on a GPU (`pytest -m cuda`; skipped where there is none): a small model whose rows are whole super-blocks
(so the K formats and IQ4_XS are really written), decoded a token at a time, against the cpu lane in f64
within the lane's contract. Under Triton's interpreter the same run takes minutes a mix, so CI checks the
kernels one by one (`tests/cuda_kernels/test_gemv_q8.py`) and the plans (`tests/lanes/test_int8_formats.py`)
instead."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

from fuselane.gguf.synth import Shape, write_synthetic  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

# 4 query heads a kv head, so the gqa >= 4 rules of Q2_K and IQ4_XS show; 16 layers for the layer rules
SHAPE = Shape("qwen2", 256, 16, 4, 1, 64, 512, 512, context=256)
MIXES = ("q5_k_m", "q6_k", "q4_0", "q5_0", "iq4_xs", "q3_k_m", "q2_k", "bf16")
TOKENS = [11, 200, 7, 90, 3, 141]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("mix", MIXES)
def test_decode_matches_cpu_f64(tmp_path, mix: str) -> None:
    path = write_synthetic(tmp_path / "m.gguf", SHAPE, mix, seed=5)
    gpu = load(path, lane="cuda", ctx=64)
    ref = load(path, lane="cpu", ctx=64, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    a, b = gpu.session(), ref.session()
    steps = [(a.feed(TOKENS[:1]), b.feed(TOKENS[:1]))]
    steps += [(a.extend([t]), b.extend([t])) for t in TOKENS[1:]]
    for step, (x, y) in enumerate(steps):
        assert np.isfinite(x).all() and rel(x, y) <= tol, f"step {step}: {rel(x, y):.2e} > {tol:.2e}"


PROMPT = [5, 60, 7, 300, 8, 1, 2, 3, 4, 5, 6, 17, 18, 19, 20, 21, 22, 23, 24, 25]  # a chunk on cuBLAS
SHORT = [12, 13, 14]  # a chunk within the GEMV's rows
# every mix over the f16 scratch (prefill=auto); the formats only the int8 GEMV multiplies in a step over the
# f16 copies too
PREFILLS = [(mix, "auto") for mix in MIXES] + [(mix, "f16-copy") for mix in ("iq4_xs", "q3_k_m", "q2_k")]


@pytest.mark.parametrize(("mix", "prefill"), PREFILLS)
def test_prefill_matches_cpu_f64(tmp_path, mix: str, prefill: str) -> None:
    path = write_synthetic(tmp_path / "m.gguf", SHAPE, mix, seed=5)
    gpu = load(path, lane="cuda", ctx=64, knobs=[f"prefill={prefill}"])
    ref = load(path, lane="cpu", ctx=64, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    a, b = gpu.session(), ref.session()
    steps = [(a.feed(PROMPT), b.feed(PROMPT)), (a.extend(SHORT), b.extend(SHORT))]
    steps += [(a.extend([t]), b.extend([t])) for t in TOKENS[:2]]
    for step, (x, y) in enumerate(steps):
        assert np.isfinite(x).all() and rel(x, y) <= tol, f"step {step}: {rel(x, y):.2e} > {tol:.2e}"
