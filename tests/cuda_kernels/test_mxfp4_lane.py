"""MXFP4 on the cuda lane: the blocks split as IQ4_NL's (their 16 code bytes in the same nibble order), each block's
1-byte e8m0 exponent where IQ4_NL keeps its d, then every IQ4_NL path with MXFP4's table and the scale 2^(e - 128)
made from e (`layout.e8m0_scale`). Against the cpu lane in f64, within the lane's contract (`logits_tolerance`),
under Triton's interpreter (or compiled, on a GPU): a dense model whose embedding and down projections are MXFP4, a
mixture and a latent model in llama.cpp's `MXFP4_MOE` recipe (their experts, and DeepSeek's per-head `attn_v_b`), a
prompt past the GEMV's rows (its chunk's products on the f16 scratch, the mixture's on the grouped GEMM) and a decode
step, under int8 and dequantized activations (the latent model under int8)."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.gguf.formats import GRID_FORMATS, Format  # noqa: E402
from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.lanes.cuda.plan import kernels  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

PROMPT = [5, 60, 7, 11, 200, 3, 141, 52, 9, 90, 17, 33]  # past the GEMV's rows: a chunk
assert len(PROMPT) > kernels.GEMV_ROWS
# (shape, mix, tensors written MXFP4 beside the mix's): the mixture and the latent model in llama.cpp's MXFP4_MOE
# recipe (every 3-D matrix MXFP4: the experts, DeepSeek's per-head attn_v_b), a dense one by name
MXFP4_FILES = {
    "dense": ("tiny-qwen3", "q8_0", ["token_embd.weight", *(f"blk.{i}.ffn_down.weight" for i in range(2))]),
    "experts": ("tiny-qwen3moe", "mxfp4_moe", []),
    "latent": ("tiny-deepseek2", "mxfp4_moe", []),
}
CASES = [(kind, a) for kind in MXFP4_FILES for a in ("int8", "dequant") if kind != "latent" or a == "int8"]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_every_exponent_decodes_as_dequant_does():
    # a row of 256 blocks, block e's exponent e (0 and 1 an f32 subnormal scale, 255 a scale of 2^127 whose
    # largest codes overflow to inf, as in ggml): the device decode equals `gguf.dequant` bit for bit
    from fuselane.gguf.dequant import dequantize
    from fuselane.gguf.formats import LAYOUTS
    from fuselane.gguf.quantize import random_blocks
    from fuselane.lanes.cuda.run import stored
    from fuselane.lanes.cuda.triton.gemv.epilogue import dequantize as device_dequantize

    lay = LAYOUTS[Format.MXFP4]
    blocks = random_blocks(Format.MXFP4, 256, np.random.default_rng(3))
    blocks[:, lay.field("e").offset] = np.arange(256)
    k = 256 * lay.values
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.from_numpy(stored.stored_bytes(Format.MXFP4, blocks.reshape(-1), 256 * lay.nbytes)).to(device)
    out = torch.empty((1, k), dtype=torch.float32, device=device)
    with np.errstate(over="ignore"):
        want = dequantize(blocks.reshape(-1), Format.MXFP4, (1, k))
    np.testing.assert_array_equal(device_dequantize(w, Format.MXFP4, 1, k, out).cpu().numpy(), want)
    assert np.isinf(want).any() and (want[want != 0] != 0).all()


def test_the_lane_decodes_every_format_of_the_table_but_the_grid_ones():
    # the grid and ternary formats run on the cpu lane only (tests/lanes/test_undecoded_formats.py)
    assert set(Format) - GRID_FORMATS <= kernels.DEQUANT_FORMATS
    assert not GRID_FORMATS & kernels.DEQUANT_FORMATS


@pytest.mark.parametrize(("kind", "activations"), CASES)
def test_an_mxfp4_file_runs_as_the_cpu_lane(tmp_path, kind, activations):
    shape, mix, names = MXFP4_FILES[kind]
    path = write_synthetic(tmp_path / "m.gguf", shape, mix, seed=2, formats=dict.fromkeys(names, Format.MXFP4))
    gpu = load(path, lane="cuda", ctx=32, knobs=[f"activations={activations}"])
    ref = load(path, lane="cpu", ctx=32, dtype=np.float64)
    assert sum(fmt is Format.MXFP4 for _, fmt in gpu.lane.raw.values()) >= 3
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    sg, sr = gpu.session(), ref.session()
    for what, a, b in (("prompt", sg.feed(PROMPT), sr.feed(PROMPT)), ("decode", sg.extend([9]), sr.extend([9]))):
        assert np.isfinite(a).all(), what
        assert rel(a, b) <= tol, f"{what}: {rel(a, b):.2e} > {tol:.2e}"
