"""The cuda lane's batch form under int8 activations (the default numerics), under Triton's interpreter: a step
of several sequences' decode rows multiplies its products by the int8 GEMV over the batch's rows (`q8_rows`),
and each row's logits are within the lane's contract of the same sequence's step alone on the cpu lane in f64;
a sampling row draws, inside the step, the token the one-row device sampler draws from its logits under its
settings and seed, and a greedy row takes the arg-max.

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

from fuselane.engine.blocks import BlockPool, BlockTable  # noqa: E402
from fuselane.engine.cuda import CudaPaged  # noqa: E402
from fuselane.engine.lane import Work  # noqa: E402
from fuselane.gguf.synth import Shape, write_synthetic  # noqa: E402
from fuselane.graph.ops import Quantize  # noqa: E402
from fuselane.lanes.cuda.run import product_launch  # noqa: E402
from fuselane.lanes.cuda.triton import sample  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from fuselane.runtime.sampling import GREEDY, Sampler, SamplingParams  # noqa: E402

CTX = 8
BLOCK_SIZE = 4
SHAPE = Shape("qwen2", 64, 1, 2, 1, 32, 64, 260, context=4096, tied=True)
TOKENS = [17, 200]  # two sequences' first tokens, each at position 0 over its own block
SAMPLED = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _drawn_alone(logits: np.ndarray, p: SamplingParams) -> int:
    """The one-row device sampler's first draw from `logits` under `p`, armed as a decode loop arms it."""
    k = p.top_k if 0 < p.top_k < logits.size else logits.size
    vals = torch.empty(k, dtype=torch.float32)
    idx = torch.empty(k, dtype=torch.int64)
    sample.candidates(torch.from_numpy(logits), vals, idx)
    seed = np.random.SeedSequence(p.seed).generate_state(1, np.uint64).view(np.int64)[0]
    params = torch.tensor([p.temperature, p.top_p], dtype=torch.float32)
    picked = sample.new_picked("cpu")
    sample.sample_token(vals, idx, params, torch.tensor([int(seed), 0], dtype=torch.int64), picked)
    return int(picked[sample.TOKEN])


def test_a_batchs_rows_read_int8_and_equal_each_sequence_alone(tmp_path, monkeypatch):
    """Row 0 samples (its own seed, top-k and top-p, drawn inside the step), row 1 is greedy."""
    path = write_synthetic(tmp_path / "m.gguf", SHAPE, "q5_0", seed=7)
    gpu = load(path, lane="cuda", ctx=CTX)
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    picked: list[tuple[str, int]] = []
    real = product_launch.q8_in

    def spy(name, fmt, m, k, b, *outs):
        found = real(name, fmt, m, k, b, *outs)
        if found is not None:
            picked.append((found[0].__name__.rsplit(".", 1)[-1], m))
        return found

    monkeypatch.setattr(product_launch, "q8_in", spy)
    paged, pool = CudaPaged(gpu.lane, blocks=2, block_size=BLOCK_SIZE), BlockPool(2, BLOCK_SIZE)
    tables = [BlockTable() for _ in TOKENS]
    assert all(pool.grow(t, 1) for t in tables)
    settings = [SAMPLED, GREEDY]
    works = [Work(s, (t,), 0, tables[s], Sampler(p)) for s, (t, p) in enumerate(zip(TOKENS, settings, strict=True))]
    tokens = paged.step(works)
    step = paged.steps[len(TOKENS)]
    assert any(isinstance(op.sym, Quantize) for op in step.plan.ops)  # rows quantized for the products
    assert {"q8_rows"} == {module for module, m in picked if m == len(TOKENS)}  # the int8 GEMV over the rows
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    logits = step.logits[: len(TOKENS)].cpu().numpy()
    for row, token in enumerate(TOKENS):
        got, want = logits[row].astype(np.float64), ref.session().feed([token])
        assert np.isfinite(got).all() and rel(got, want) <= tol, f"row {row}: {rel(got, want):.2e} > {tol:.2e}"
    assert tokens == [_drawn_alone(logits[0], SAMPLED), int(np.argmax(logits[1]))]
    assert paged.draws.rng[paged.draws.held[0], sample.COUNTER].item() == 1 and 1 not in paged.draws.held
