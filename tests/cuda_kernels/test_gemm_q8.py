"""The int8 tensor-core GEMM (`gemm_q8`) against the f64 product of the same quantized activation and the
dequantized matrix.

The reference multiplies exactly the numbers the kernel does: the activation's int8 codes times their block
scales (`quant.quantize_reference`, the kernel's quantizer bit for bit) and every weight the f32 value of
`fuselane.gguf.dequant` (`gguf.quants`-checked), in f64. The kernel's integer dots are exact; what rounds is
the f32 scaling and summing: each run's term is one or two products of an exact int32 sum by scales (at most
four roundings with the activation's block sum), and k / 32 runs, two terms each, are summed, so an output is
within gamma_(3R + 8) (R = k / 32 runs) of the sum of its terms' magnitudes (Higham 3.1), which is at most
|x| @ (|W - M| + |M|), M the runs' offsets (a format's minimum: the weights with their codes zeroed). A wrong
code, scale, offset, row or column moves an output by about one product, |x_j w_j| ~ 1/k of that magnitude,
hundreds of times the bound.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import CUDA, DEVICE, U16, U32, check, dev, gamma, raw_weights  # noqa: E402

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import LAYOUTS, QK, Format  # noqa: E402
from fuselane.lanes.cuda.plan import gemm_tiles  # noqa: E402
from fuselane.lanes.cuda.plan.gemm_tiles import GemmTile  # noqa: E402
from fuselane.lanes.cuda.triton import gemm_q8 as G  # noqa: E402
from fuselane.lanes.cuda.triton.quant import Q8Acts, quantize_reference  # noqa: E402

FORMATS = sorted(gemm_tiles.INT8_GEMM_FORMATS, key=int)
# Small tiles, so a few rows reach several tiles and a partial one of each kind.
TILE = GemmTile(block_m=16, block_n=16, warps=4, stages=1)
# Tiles of unequal sides (an activation row taken for a weight row would show) and a pipelined loop.
WIDE_TILES = (GemmTile(block_m=16, block_n=32, warps=4, stages=2), GemmTile(block_m=32, block_n=16, warps=4, stages=3))
CODE_FIELDS = ("qs", "qh", "ql")  # the packed code fields: zeroed, a block decodes to its offsets
ROUNDINGS_A_RUN, ROUNDINGS_MORE = 3, 8


def _offsets(raw: np.ndarray, fmt: Format, n: int, k: int) -> np.ndarray:
    """M: each weight's run offset (the format's minimum), the weights decoded with every code zero."""
    if fmt not in gemm_tiles.MIN_FORMATS:
        return np.zeros((n, k))
    lay = LAYOUTS[fmt]
    blocks = raw.reshape(-1, lay.nbytes).copy()
    for f in lay.fields:
        if f.name in CODE_FIELDS:
            blocks[:, f.offset : f.offset + f.nbytes] = 0
    return dequantize(blocks.reshape(-1), fmt, (n, k), dtype=np.float32).astype(np.float64)


def _acts(x: np.ndarray) -> tuple[Q8Acts, np.ndarray]:
    """x's int8 form on the device, and the f64 values it stands for."""
    q, d, s = quantize_reference(x)
    m, k = x.shape
    values = q.reshape(m, k // QK, QK).astype(np.float64) * d.reshape(m, k // QK, 1).astype(np.float64)
    return Q8Acts(dev(q), dev(d), dev(s)), values.reshape(m, k)


def _case(fmt: Format, m: int, n: int, k: int, seed: int, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    raw = raw_weights(fmt, n, k, rng)
    acts, xv = _acts((rng.standard_normal((m, k)) * scale).astype(np.float32))
    w = dequantize(raw, fmt, (n, k), dtype=np.float32).astype(np.float64)
    off = _offsets(raw, fmt, n, k)
    mag = np.abs(xv) @ (np.abs(w - off) + np.abs(off)).T
    return raw, acts, xv @ w.T, gamma(ROUNDINGS_A_RUN * (k // QK) + ROUNDINGS_MORE) * mag


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_gemm_q8_matches_the_f64_product(fmt):
    m, n, k = 20, 40, 256
    raw, acts, want, bound = _case(fmt, m, n, k, int(fmt))
    out = torch.empty((m, n), device=DEVICE)
    G.gemm_q8(acts, dev(raw), fmt, n, k, out, tile=TILE)
    check(out, want, bound + 1e-30)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_gemm_q8_rows_of_several_blocks(fmt):
    # two super-blocks (16 runs) a row: a run's index in its block and the block's in the row both vary in
    # the K loop; ragged m and n past a tile of unequal sides (each format one of the two)
    m, n, k = 19, 37, 2 * 256
    raw, acts, want, bound = _case(fmt, m, n, k, 100 + int(fmt))
    out = torch.full((m, n), float("nan"), device=DEVICE)
    G.gemm_q8(acts, dev(raw), fmt, n, k, out, tile=WIDE_TILES[FORMATS.index(fmt) % len(WIDE_TILES)])
    check(out, want, bound + 1e-30)


def test_activations_past_f16_stay_finite():
    # activations of ~1e6 (f16 holds 65504): int8 codes under f32 scales hold them
    fmt, m, n, k = Format.Q4_K, 16, 32, 256
    raw, acts, want, bound = _case(fmt, m, n, k, 3, scale=1e6)
    out = torch.empty((m, n), device=DEVICE)
    G.gemm_q8(acts, dev(raw), fmt, n, k, out, tile=TILE)
    assert np.abs(want).max() > np.finfo(np.float16).max
    check(out, want, bound)


def test_gemm_q8_bias_residual_and_rows_of_a_table():
    fmt, m, n, k = Format.Q8_0, 9 + gemm_tiles.GEMV_ROWS, 24, 256
    raw, acts, want, bound = _case(fmt, m, n, k, 7)
    rng = np.random.default_rng(8)
    bias, res = rng.standard_normal(n).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    out = dev(res.copy())
    G.gemm_q8(acts, dev(raw), fmt, n, k, out, bias=dev(bias), residual=out, tile=TILE)
    total = want + bias + res
    check(out, total, bound + 2 * U32 * (np.abs(total) + np.abs(bias) + np.abs(res)))
    # rows 5 .. 5 + m of an f16 table of pitch n + 8, the position read from the device
    table = torch.zeros((m + 12, n + 8), dtype=torch.float16, device=DEVICE)
    pos = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    G.gemm_q8(acts, dev(raw), fmt, n, k, table, out_row=(pos, n + 8), tile=TILE)
    got = table.double().cpu().numpy()
    assert not got[:5].any() and not got[5 + m :].any() and not got[:, n:].any(), "rows outside were written"
    assert np.all(np.abs(got[5 : 5 + m, :n] - want) <= bound + U16 * np.abs(want) + 2.0**-24)


def test_supports_and_refusals():
    assert G.supports(Format.Q4_K, 512, 3584) and G.supports(Format.Q5_0, 16, 896)
    assert not G.supports(Format.Q4_K, gemm_tiles.GEMV_ROWS, 3584)  # the GEMV's rows
    assert not G.supports(Format.Q4_K, 64, 96) and not G.supports(Format.F16, 64, 4096)
    raw = dev(raw_weights(Format.Q8_0, 8, 256, np.random.default_rng(0)))
    acts, _ = _acts(np.zeros((16, 256), np.float32))
    with pytest.raises(ValueError, match="out must be"):
        G.gemm_q8(acts, raw, Format.Q8_0, 8, 256, torch.empty((16, 9), device=DEVICE))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_gemm_q8_at_real_widths(fmt):
    # a 7B's projection widths, compiled, at the table's tiles
    m, n, k = 512, 3584, 3584
    raw, acts, want, bound = _case(fmt, m, n, k, 11)
    out = torch.empty((m, n), device=DEVICE)
    G.gemm_q8(acts, dev(raw), fmt, n, k, out)
    check(out, want, bound + 1e-30)
