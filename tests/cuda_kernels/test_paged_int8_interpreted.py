"""The cuda lane's batch form under int8 activations (the default numerics), under Triton's interpreter: a step
of several sequences' decode rows multiplies its products by the int8 GEMV over the batch's rows (`q8_rows`),
and each row's logits are within the lane's contract of the same sequence's step alone on the cpu lane in f64.

Interpreted kernels are slow (a program's loop runs in Python), so this is one step of two rows of a tiny
model of one layer: Q5_0 rows (a GEMV program takes four of them), the output tied to a Q8_0 embedding, heads
of one 32-value block (the attention quantizes its output). Rows at other positions, joining and leaving, run
under the f16 weights' test (`test_paged_lane_interpreted.py`); the kernel's rows equal the one-row kernel's
bit for bit (`test_gemv_q8_rows.py`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.engine.cuda import CudaPaged  # noqa: E402
from fuselane.gguf.synth import Shape, write_synthetic  # noqa: E402
from fuselane.graph.ops import Quantize  # noqa: E402
from fuselane.lanes.cuda.run import launch  # noqa: E402
from fuselane.lanes.cuda.run.paged import layout  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

CTX = 8
BLOCK_SIZE = 4
SHAPE = Shape("qwen2", 64, 1, 2, 1, 32, 64, 260, context=4096, tied=True)
TOKENS = [17, 200]  # two sequences' first tokens, each at position 0 over its own block


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_a_batchs_rows_read_int8_and_equal_each_sequence_alone(tmp_path, monkeypatch):
    path = write_synthetic(tmp_path / "m.gguf", SHAPE, "q5_0", seed=7)
    gpu = load(path, lane="cuda", ctx=CTX)
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    picked: list[tuple[str, int]] = []
    real = launch._q8_in

    def spy(name, fmt, m, k, b, *outs):
        found = real(name, fmt, m, k, b, *outs)
        if found is not None:
            picked.append((found[0].__name__.rsplit(".", 1)[-1], m))
        return found

    monkeypatch.setattr(launch, "_q8_in", spy)
    paged = CudaPaged(gpu.lane, blocks=2, block_size=BLOCK_SIZE)
    step = paged._batch(len(TOKENS))
    assert any(isinstance(op.sym, Quantize) for op in step.plan.ops)  # rows quantized for the products
    assert {"q8_rows"} == {module for module, m in picked if m == len(TOKENS)}  # the int8 GEMV over the rows
    slots = [block * BLOCK_SIZE for block in range(len(TOKENS))]
    tables = [[block] for block in range(len(TOKENS))]
    step.write(layout(len(TOKENS), paged.width, TOKENS, [0, 0], slots, tables, paged.spare, BLOCK_SIZE))
    step.launch()
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    for row, token in enumerate(TOKENS):
        got = step.logits[row].cpu().double().numpy()
        want = ref.session().feed([token])
        assert np.isfinite(got).all() and rel(got, want) <= tol, f"row {row}: {rel(got, want):.2e} > {tol:.2e}"
