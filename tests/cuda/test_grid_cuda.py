"""The grid and ternary formats on the compiled kernels at real widths, on a GPU (`pytest -m cuda`; skipped where
there is none): the grid GEMV and its epilogues, the whole-matrix decode, and two-layer models at Qwen2.5-7B's and
Qwen3-8B's widths whose projections are in them, against the cpu lane in f64 within the lane's contract: a
prompt's chunk (the scratch), a chunk of three rows and decode steps (the grid GEMV, its gated pair and its add +
norm). CI checks the same paths interpreted at small widths (`tests/cuda_kernels/test_grid_lane.py`,
`test_grid_decode.py`)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import GRID_FORMATS, LAYOUTS, Format  # noqa: E402
from fuselane.gguf.quantize import random_blocks  # noqa: E402
from fuselane.gguf.synth import SHAPES, write_synthetic  # noqa: E402
from tests.lane_steps import rel, runs_as_the_cpu_lane  # noqa: E402

PROMPT = [11, 200, 7, 7, 90, 3, 141, 52, 9, 1000, 17, 4000, 5, 8]  # past the GEMV's rows: a chunk
SHORT = [12, 13, 14]  # a chunk within the GEMV's rows
DECODE = [5, 6, 7]
# a layer's projections in the grid formats, the gate and the up product in one (their pair in one launch)
LAYERS = {
    "qwen2.5-7b": {"attn_q": Format.IQ2_XXS, "attn_k": Format.IQ2_XS, "attn_v": Format.IQ3_XXS,
                   "attn_output": Format.IQ2_S, "ffn_gate": Format.IQ3_S, "ffn_up": Format.IQ3_S,
                   "ffn_down": Format.IQ1_M},
    "qwen3-8b": {"attn_q": Format.IQ1_S, "attn_k": Format.TQ1_0, "attn_v": Format.TQ2_0,
                 "attn_output": Format.IQ3_XXS, "ffn_gate": Format.IQ2_XXS, "ffn_up": Format.IQ2_XXS,
                 "ffn_down": Format.IQ2_S},
}  # fmt: skip
# llama.cpp's IQ3_M layer (q, k, gate and up IQ3_S; v, o and the first eighth's down Q4_K): the query's and key's
# heads turned in the grid GEMV in parts' epilogue, the gated pair at the many-row tile; and Qwen3's q/k norm
# turned there too (`rope_epilogue=on`, its v a third part)
TURNED = {
    "qwen2.5-7b": ({"attn_q": Format.IQ3_S, "attn_k": Format.IQ3_S, "ffn_gate": Format.IQ3_S, "ffn_up": Format.IQ3_S},
                   []),
    "qwen3-8b": ({"attn_q": Format.IQ2_XXS, "attn_k": Format.IQ2_XXS, "attn_v": Format.IQ2_XXS}, ["rope_epilogue=on"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_grid_model_runs_as_the_cpu_lane(tmp_path, name: str) -> None:
    _runs(tmp_path, name, LAYERS[name], [])


@pytest.mark.parametrize("name", list(TURNED))
def test_a_grid_query_and_key_turned_in_the_gemvs_epilogue_run_as_the_cpu_lane(tmp_path, name: str) -> None:
    _runs(tmp_path, name, *TURNED[name])


def _runs(tmp_path, name: str, layer: dict, knobs: list[str]) -> None:
    shape = replace(SHAPES[name], n_layers=2, vocab=4096)
    formats = {f"blk.{i}.{m}.weight": f for i in range(2) for m, f in layer.items()}
    path = write_synthetic(tmp_path / "m.gguf", shape, "q4_k_m", seed=13, formats=formats)
    runs_as_the_cpu_lane(path, PROMPT, SHORT, DECODE, ctx=64, knobs=knobs)


def test_a_grid_model_gives_the_same_bits_launched_plainly_and_as_dependents(tmp_path) -> None:
    # `pdl=auto` launches a grid model's steps in plain stream order (measured faster); forced on, each grid
    # launch is a dependent of the one before and waits for it: the same logits bit for bit (a narrow shape in
    # llama.cpp's IQ3_M layer: the grid GEMV in parts with its turns, the gated pair writing its int8 form)
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("dependent launches need compute capability 9.0")
    from fuselane.gguf.synth import Shape
    from fuselane.runtime.model import load

    shape = Shape("qwen2", 256, 2, 4, 1, 64, 512, 4096, context=64)  # the vocabulary PROMPT's ids need
    formats = {f"blk.{i}.{m}.weight": f for i in range(2) for m, f in TURNED["qwen2.5-7b"][0].items()}
    path = write_synthetic(tmp_path / "m.gguf", shape, "q4_k_m", seed=13, formats=formats)
    plain, dependent = (load(path, lane="cuda", ctx=64, knobs=k) for k in ([], ["pdl=on"]))
    assert not plain.lane.dependent_launch and dependent.lane.dependent_launch
    steps = []
    for model in (plain, dependent):
        s = model.session()
        steps.append([s.feed(PROMPT), s.extend(SHORT), *(s.extend([t]) for t in DECODE)])
    for a, b in zip(*steps, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("fmt", sorted(GRID_FORMATS), ids=lambda f: f.name)
def test_the_grid_gemv_and_decode_at_a_7b_width(fmt: Format) -> None:
    # a down projection's widths: 3,584 rows of 18,944 values, one row and eight; the decode bit for bit
    from fuselane.lanes.cuda.triton.grid.decode import dequantize_grid
    from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid

    n, k = 3584, 18944
    blocks = random_blocks(fmt, n * k // LAYOUTS[fmt].values, np.random.default_rng(int(fmt)))
    w = torch.from_numpy(blocks.reshape(-1)).cuda()
    want_w = dequantize(blocks.reshape(-1), fmt, (n, k))
    out = torch.empty((n, k), dtype=torch.float32, device="cuda")
    np.testing.assert_array_equal(dequantize_grid(w, fmt, n, k, out).cpu().numpy().view(np.uint32),
                                  want_w.view(np.uint32))  # fmt: skip
    for m in (1, 8):
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        y = torch.empty((m, n), dtype=torch.float32, device="cuda")
        gemv_grid(torch.from_numpy(x).cuda(), w, fmt, n, k, y)
        assert rel(y.cpu().numpy(), x.astype(np.float64) @ want_w.T.astype(np.float64)) < 1e-4
