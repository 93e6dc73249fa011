"""The cuda lane on DeepSeek-V2-Lite's widths, compiled on an NVIDIA GPU, against the cpu lane in f64 within
the lane's numerics contract: two layers (the first dense, the second a mixture of 8 experts keeping 6, with
the 2 shared) in Q4_K_M, a small vocabulary; a prompt chunk past the GEMV's rows (its latent attention
expanded, `Mla`: the key half Q5_0, the value half Q4_K), then decode steps replayed from the captured CUDA
graph (the latent cache written a row a token in f16, read in place by the attention), then a second chunk at
a later position, twice (the second replayed from its graph); and a prompt of a 512-row chunk and a partial one.
The widths are V2-Lite's: 2048 wide, 16 heads, kv_lora_rank 512, nope 128, rope 64, value 128, YaRN x40.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # skipped, but Triton is imported once a session: as the other modules want it
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fuselane.fuse.views import class_of, leaves  # noqa: E402
from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.gguf.synth_latent import LATENT_SHAPES  # noqa: E402
from fuselane.graph.classes import ClassId as C  # noqa: E402
from fuselane.graph.ops import HeadMatmul  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

CUDA = torch.cuda.is_available()
SHAPE = replace(LATENT_SHAPES["deepseek-v2-lite"], n_layers=2, vocab=1024, experts=8, context=4096)
PROMPT = list(range(3, 23))  # 20 rows: past the GEMV's, a chunk of the int8 tensor cores
CTX = 64


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_v2_lite_widths_run_as_the_cpu_lane(tmp_path):
    path = write_synthetic(tmp_path / "v2lite.gguf", SHAPE, "q4_k_m", seed=3)
    gpu = load(path, lane="cuda", ctx=CTX)  # the lane's defaults: int8 activations, f16 cache, graphs
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    step = gpu.lane.step(1)
    # the value half (its int8 form written in its programs, GemvQuant); the query's is in its join
    assert HeadMatmul in {type(x.sym) for op, _ in step.bound for x in leaves(op)} and gpu.lane.use_graphs
    assert C.GEMV_QUANT in {class_of(op) for op, _ in step.bound}
    assert C.ROUTER_TOPK in {class_of(op) for op, _ in step.bound}
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    sg, sr = gpu.session(), ref.session()
    steps = [("prefill", sg.feed(PROMPT), sr.feed(PROMPT))]
    for token in (9, 11, 13):  # the second and third replay the captured graph at a new position
        steps.append((f"decode {token}", sg.extend([token]), sr.extend([token])))
    chunk = list(range(30, 42))
    expanded = [op for op, _ in gpu.lane.step(len(chunk)).bound if class_of(op) is C.MLA]
    assert len(expanded) == SHAPE.n_layers  # each layer's latent attention, expanded
    steps.append(("chunk at 23", sg.extend(chunk), sr.extend(chunk)))
    steps.append(("chunk at 35", sg.extend(chunk), sr.extend(chunk)))  # the chunk's graph replayed
    for what, a, b in steps:
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all(), what
        assert rel(a, b) <= tol, f"{what}: {rel(a, b):.2e} > {tol:.2e}"


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_a_long_prompt_runs_in_the_lanes_chunks_as_the_cpu_lane(tmp_path):
    # a session takes the latent mixture's prompt 512 rows at a time (`CudaLane.prefill_chunk`): a full chunk, then
    # 88 rows, each latent attention expanded (`Mla`) over the whole cache so far; each of the 8 experts meets ~450
    # pairs (many tiles of the grouped GEMM)
    from fuselane.lanes.cuda.plan import kernels
    from tests.long_prompt import feed_both

    long = kernels.MOE_CHUNK_ROWS + 88
    path = write_synthetic(tmp_path / "long.gguf", SHAPE, "q4_k_m", seed=5)
    tokens = np.random.default_rng(5).integers(0, SHAPE.vocab, long).tolist()
    got, want, tol, chunk = feed_both(path, tokens)
    assert chunk == kernels.MOE_CHUNK_ROWS
    assert np.isfinite(got).all() and rel(got, want) <= tol, f"{rel(got, want):.2e} > {tol:.2e}"
