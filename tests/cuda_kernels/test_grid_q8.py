"""The grid GEMV on int8 activations (`triton/grid/q8.py`): a step's one row quantized as the int8 GEMV reads it,
a group's grid bytes and signs against its codes in dp4a. Each launch (alone, in parts, the gated pair writing its
int8 form, the add + norm) against f64 over the same codes, and the parts and the pair against the lone launch
bit for bit. Interpreted where there is no GPU, compiled on one."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import LAYOUTS, QK, Format  # noqa: E402
from fuselane.gguf.quantize import random_blocks  # noqa: E402
from fuselane.lanes.cuda.triton.grid.q8 import signed_words  # noqa: E402
from tests.lane_steps import rel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
Q8_GRID = [Format.IQ2_XXS, Format.IQ2_XS, Format.IQ2_S, Format.IQ3_XXS, Format.IQ3_S, Format.IQ1_S, Format.IQ1_M]
# f32 sums of k products, each group's integer sum exact: within k ulps of the largest partial sum
TOL = 1e-5


def _rows(fmt: Format, n: int, k: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    lay = LAYOUTS[fmt]
    blocks = random_blocks(fmt, n * k // lay.values, np.random.default_rng(seed))
    want = dequantize(blocks.reshape(-1), fmt, (n, k)).astype(np.float64)
    return torch.from_numpy(blocks.reshape(-1)).to(DEVICE), want


def _acts(k: int, seed: int, scale: float = 1.0):
    """A step's row quantized by the lane (`quant.quantize`), and the values its codes stand for, in f64."""
    from fuselane.lanes.cuda.triton.quant import empty_q8, quantize

    rng = np.random.default_rng(seed)
    x = torch.from_numpy((rng.standard_normal((1, k)) * scale).astype(np.float32)).to(DEVICE)
    acts = quantize(x, empty_q8(1, k, DEVICE))
    codes = acts.q.cpu().numpy().astype(np.float64).reshape(-1, QK)
    return acts, (codes * acts.d.cpu().numpy().astype(np.float64).reshape(-1, 1)).reshape(1, k)


@triton.jit
def _signed_kernel(low, high, signs, out_lo, out_hi, N: tl.constexpr):
    i = tl.arange(0, N)
    lo, hi = signed_words(tl.load(low + i), tl.load(high + i), tl.load(signs + i))
    tl.store(out_lo + i, lo)
    tl.store(out_hi + i, hi)


def test_the_sign_masks_negate_each_marked_byte():
    # every sign byte against words of grid bytes 1..127: the masked words' bytes are the signed values
    rng = np.random.default_rng(1)
    grid = rng.integers(1, 128, size=(256, 8), dtype=np.int8)
    words = grid.view(np.int32)  # (256, 2): values 0-3, 4-7
    signs = np.arange(256, dtype=np.int32)
    t = [torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE) for a in (words[:, 0], words[:, 1], signs)]
    lo, hi = torch.empty_like(t[0]), torch.empty_like(t[0])
    _signed_kernel[(1,)](*t, lo, hi, N=256)
    got = np.stack([lo.cpu().numpy(), hi.cpu().numpy()], axis=1).view(np.int8)
    negative = (signs[:, None] >> np.arange(8)) & 1
    assert np.array_equal(got, np.where(negative == 1, -grid.astype(np.int32), grid).astype(np.int8))


@pytest.mark.parametrize("fmt", Q8_GRID, ids=lambda f: f.name)
@pytest.mark.parametrize("tile", ["many_rows", "few_rows", "one_row_few_rows"])
def test_the_grid_gemv_on_int8_matches_f64(fmt, tile, monkeypatch):
    from fuselane.lanes.cuda.triton.grid import gemv as grid_gemv

    chosen = getattr(grid_gemv, f"{tile.upper()}_TILE")
    monkeypatch.setattr(grid_gemv, "grid_tile", lambda n, m=1: chosen)
    n, k = 20, 512  # a partial tile of rows; two super-blocks a row
    w, want_w = _rows(fmt, n, k, seed=int(fmt))
    acts, x = _acts(k, seed=int(fmt) + 1)
    out = torch.empty((1, n), dtype=torch.float32, device=DEVICE)
    grid_gemv.gemv_grid(acts, w, fmt, n, k, out)
    assert rel(out.cpu().numpy(), x @ want_w.T) < TOL


@pytest.mark.parametrize("fmt", [Format.IQ3_S, Format.IQ2_S, Format.IQ1_S], ids=lambda f: f.name)
@pytest.mark.parametrize("k", [768, 1024])
@pytest.mark.parametrize(
    "tile",
    [(2, 4, 512), (1, 4, 1024), (2, 1, 512, 4), (4, 2, 1024, 2)],
    ids=["two-blocks", "four-blocks", "two-blocks-runs-of-4", "four-blocks-runs-of-2"],
)
def test_a_step_of_several_super_blocks_on_int8_matches_f64(fmt, k, tile, monkeypatch):
    # rows of 3 super-blocks end inside a step of 2 or 4 (the groups past the row count nothing), 4 on a step; a
    # thread's groups one at a time or in runs of one sub-block
    from fuselane.lanes.cuda.triton.grid import gemv as grid_gemv

    chosen = grid_gemv.GridTile(*tile)
    monkeypatch.setattr(grid_gemv, "grid_tile", lambda n, m=1: chosen)
    n = 6
    w, want_w = _rows(fmt, n, k, seed=int(fmt) + k)
    acts, x = _acts(k, seed=k)
    out = torch.empty((1, n), dtype=torch.float32, device=DEVICE)
    grid_gemv.gemv_grid(acts, w, fmt, n, k, out)
    assert rel(out.cpu().numpy(), x @ want_w.T) < TOL


def test_large_activations_stay_finite_and_exact():
    # activations near llama.cpp's q8_1 range: the codes' scale carries the size, the integer sums stay exact
    from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid

    fmt, n, k = Format.IQ3_S, 16, 256
    w, want_w = _rows(fmt, n, k, seed=2)
    acts, x = _acts(k, seed=3, scale=1e6)
    out = torch.empty((1, n), dtype=torch.float32, device=DEVICE)
    gemv_grid(acts, w, fmt, n, k, out)
    got = out.cpu().numpy()
    assert np.isfinite(got).all() and rel(got, x @ want_w.T) < TOL


def test_the_parts_on_int8_match_each_alone():
    # a query with its bias, a key landing at a row of its cache, a third part: as the lone launch, bit for bit
    from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid, gemv_grid_parts

    fmt, k, sizes = Format.IQ2_XXS, 512, (40, 24, 8)
    acts, x = _acts(k, seed=4)
    ws = [_rows(fmt, n, k, seed=10 + i) for i, n in enumerate(sizes)]
    bias = torch.linspace(-1, 1, sizes[0], device=DEVICE)
    q, v = torch.empty((1, sizes[0]), device=DEVICE), torch.empty((1, sizes[2]), device=DEVICE)
    cache = torch.zeros((5, sizes[1]), device=DEVICE)
    pos = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    parts = [(ws[0][0], sizes[0], q, bias, None), (ws[1][0], sizes[1], cache, None, (pos, sizes[1])),
             (ws[2][0], sizes[2], v, None, None)]  # fmt: skip
    gemv_grid_parts(acts, parts, fmt, k)
    alone = [torch.empty((1, n), device=DEVICE) for n in sizes]
    gemv_grid(acts, ws[0][0], fmt, sizes[0], k, alone[0], bias=bias)
    for i in (1, 2):
        gemv_grid(acts, ws[i][0], fmt, sizes[i], k, alone[i])
    assert torch.equal(q, alone[0]) and torch.equal(v, alone[2]) and torch.equal(cache[2:3], alone[1])
    assert rel(q.cpu().numpy(), x @ ws[0][1].T + bias.cpu().numpy()) < TOL


@pytest.mark.parametrize("fmt", [Format.IQ3_S, Format.IQ1_M], ids=lambda f: f.name)
@pytest.mark.parametrize("run", [1, 4])
def test_the_gated_pair_on_int8_writes_its_int8_form(fmt, run, monkeypatch):
    # SiLU(gate) * up against f64 over the same codes; its int8 form the lane's own quantize of that row, bit for
    # bit, each block by the last of its programs, the counters left at zero
    from fuselane.lanes.cuda.triton.gemv.q8_epilogue import q8_counters
    from fuselane.lanes.cuda.triton.grid import gemv as grid_gemv
    from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid_gate_up_glu
    from fuselane.lanes.cuda.triton.quant import empty_q8, quantize

    tile = grid_gemv.ONE_ROW_FEW_ROWS_TILE  # a wide step (the row of one super-block ends inside it)
    monkeypatch.setattr(grid_gemv, "grid_tile", lambda n, m=1: grid_gemv.GridTile(tile.block_n, tile.warps,
                                                                                    tile.slice, run))  # fmt: skip
    n, k = 96, 256
    (wg, want_g), (wu, want_u) = _rows(fmt, n, k, seed=5), _rows(fmt, n, k, seed=6)
    acts, x = _acts(k, seed=7)
    out, q8, counters = torch.empty((1, n), device=DEVICE), empty_q8(1, n, DEVICE), q8_counters(n, DEVICE)
    gemv_grid_gate_up_glu(acts, wg, wu, fmt, n, k, out, out_q8=q8, counters=counters)
    g, u = x @ want_g.T, x @ want_u.T
    assert rel(out.cpu().numpy(), g / (1 + np.exp(-g)) * u) < TOL
    want = quantize(out, empty_q8(1, n, DEVICE))
    for got, ref in zip(q8, want, strict=True):
        assert torch.equal(got.cpu(), ref.cpu())
    assert not counters.any()


def test_the_add_norm_on_int8_matches_f64():
    from fuselane.lanes.cuda.triton.gemv.epilogue import gemv_add_norm_counter
    from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid_add_norm

    fmt, n, k, eps = Format.IQ2_S, 40, 256, 1e-6
    w, want_w = _rows(fmt, n, k, seed=8)
    acts, x = _acts(k, seed=9)
    rng = np.random.default_rng(10)
    res, norm_w = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    s = x @ want_w.T + res
    want = s / np.sqrt(np.mean(s * s) + eps) * norm_w
    res_t, norm_t = torch.from_numpy(res).to(DEVICE), torch.from_numpy(norm_w).to(DEVICE)
    out = torch.empty(n, dtype=torch.float32, device=DEVICE)
    gemv_grid_add_norm(acts, w, fmt, n, k, res_t, res_t, norm_t, eps, out, gemv_add_norm_counter(DEVICE))
    assert rel(res_t.cpu().numpy(), s[0]) < TOL and rel(out.cpu().numpy(), want[0]) < TOL


def test_a_ternary_format_refuses_int8_activations():
    from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid

    w, _ = _rows(Format.TQ2_0, 4, 256, seed=1)
    acts, _ = _acts(256, seed=2)
    out = torch.empty((1, 4), dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="reads TQ2_0's activation as f32"):
        gemv_grid(acts, w, Format.TQ2_0, 4, 256, out)
