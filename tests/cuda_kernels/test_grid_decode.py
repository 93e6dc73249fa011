"""The device decode of the grid and ternary formats (`triton/grid`): for every format it decodes, random blocks
(one with a negative scale, so zeros carry a sign) give bit for bit the f32 values of the cpu lane's
`fuselane.gguf.dequant.dequantize` (compared as uint32 bits: -0.0 is not 0.0 here), their f16 rounding into an f16
out, and an out narrower than its rows' pitch keeps its other columns. A bad call is refused, the table follows
its layout, and a block decoded as another format gives other values. Under Triton's interpreter (or compiled, on
a GPU)."""

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
from gguf import quants as gguf_quants  # noqa: E402

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import LAYOUTS, QK_K, Format  # noqa: E402
from fuselane.gguf.quantize import random_blocks  # noqa: E402
from fuselane.lanes.cuda.plan import kernels  # noqa: E402
from fuselane.lanes.cuda.triton.grid import values  # noqa: E402
from fuselane.lanes.cuda.triton.grid.decode import PROGRAM_BLOCKS, dequantize_grid  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = sorted(kernels.GRID_GEMV_FORMATS, key=int)
ROWS, BLOCKS = 3, 2  # 6 blocks: one program, its last 2 units past the end (masked)
assert ROWS * BLOCKS < PROGRAM_BLOCKS
F16_SIGN = 0x80  # the sign bit of an f16's high byte
IQ1_M_D_HIGH = 7  # IQ1_M: byte 7 of `scales` holds its f16 d's top nibble, the sign bit on top
PADDING = 64  # extra columns of the wider out
SENTINEL = 7.0
TILE_BLOCKS, TILE_A = 4, 4  # the broadcast tile: blocks [1, 4, 1] against value indices [4, 1, 64]


def _blocks(fmt: Format, seed: int) -> np.ndarray:
    """ROWS * BLOCKS random blocks of `fmt`, the second's scale negated (its zeros -0.0)."""
    blocks = random_blocks(fmt, ROWS * BLOCKS, np.random.default_rng(seed))
    lay = LAYOUTS[fmt]
    high = lay.field("scales").offset + IQ1_M_D_HIGH if fmt is Format.IQ1_M else lay.field("d").offset + 1
    blocks[1, high] ^= F16_SIGN
    return blocks


def _decode(fmt: Format, blocks: np.ndarray, out: torch.Tensor) -> np.ndarray:
    w = torch.from_numpy(blocks.reshape(-1).copy()).to(DEVICE)
    return dequantize_grid(w, fmt, ROWS, BLOCKS * QK_K, out).cpu().numpy()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_f32_decode_is_dequant_bit_for_bit(fmt):
    blocks = _blocks(fmt, int(fmt))
    k = BLOCKS * QK_K
    want = dequantize(blocks.reshape(-1), fmt, (ROWS, k))
    got = _decode(fmt, blocks, torch.empty((ROWS, k), dtype=torch.float32, device=DEVICE))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    if fmt in values.TERNARY_FORMATS:  # the negated block's zeros are -0.0: the sign of zero was checked
        assert np.signbit(want[0, QK_K:][want[0, QK_K:] == 0]).all() and (want[0, QK_K:] == 0).any()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_f16_decode_is_dequant_rounded(fmt):
    blocks = _blocks(fmt, int(fmt) + 1)
    k = BLOCKS * QK_K
    want = dequantize(blocks.reshape(-1), fmt, (ROWS, k)).astype(np.float16)
    got = _decode(fmt, blocks, torch.empty((ROWS, k), dtype=torch.float16, device=DEVICE))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("fmt", [Format.IQ2_XS, Format.IQ1_M, Format.TQ1_0], ids=lambda f: f.name)
def test_a_pitched_out_keeps_its_other_columns(fmt):
    blocks = _blocks(fmt, 2)
    k = BLOCKS * QK_K
    wide = torch.full((ROWS, k + PADDING), SENTINEL, dtype=torch.float32, device=DEVICE)
    _decode(fmt, blocks, wide[:, :k])
    got = wide.cpu().numpy()
    want = dequantize(blocks.reshape(-1), fmt, (ROWS, k))
    np.testing.assert_array_equal(got[:, :k].view(np.uint32), want.view(np.uint32))
    assert (got[:, k:] == SENTINEL).all()


def test_bad_calls_are_refused():
    fmt = Format.IQ2_XXS
    nbytes = LAYOUTS[fmt].nbytes
    w = torch.zeros(2 * nbytes, dtype=torch.uint8, device=DEVICE)
    out = torch.empty((1, 2 * QK_K), dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="whole"):
        dequantize_grid(w, fmt, 1, 2 * QK_K - 32, out)
    with pytest.raises(ValueError, match="bytes"):
        dequantize_grid(w[:-1], fmt, 1, 2 * QK_K, out)
    with pytest.raises(ValueError, match="out must be"):
        dequantize_grid(w, fmt, 1, 2 * QK_K, out.to(torch.float64))
    with pytest.raises(ValueError, match="no device grid decode"):
        dequantize_grid(w, Format.Q4_K, 1, 2 * QK_K, out)


def test_the_tables_follow_the_layout():
    for fmt in FORMATS:
        table = values.table_bytes(fmt)
        assert table.dtype == np.uint8 and table.ndim == 1
        if fmt in values.TERNARY_FORMATS:
            assert table.size == 1
            continue
        cls = getattr(gguf_quants, fmt.name)
        cls.init_grid()
        grid = np.asarray(cls.grid).reshape(cls.grid_shape)
        rows = table[: grid.size].view(np.int8).reshape(grid.shape)
        np.testing.assert_array_equal(rows.astype(np.float32), grid)
        tail = table[grid.size :]
        if fmt in values.KSIGN_FORMATS:
            assert bytes(tail) == gguf_quants.IQ2_XXS.ksigns
        else:
            assert tail.size == 0
    assert values.device_table(Format.IQ1_S, DEVICE) is values.device_table(Format.IQ1_S, DEVICE)


def test_another_formats_decode_differs():
    # the decode reads the format it is told: IQ2_XXS's bytes as TQ2_0 (the same 66-byte block) differ
    assert LAYOUTS[Format.IQ2_XXS].nbytes == LAYOUTS[Format.TQ2_0].nbytes
    blocks = _blocks(Format.IQ2_XXS, 5)
    k = BLOCKS * QK_K
    want = dequantize(blocks.reshape(-1), Format.IQ2_XXS, (ROWS, k))
    got = _decode(Format.TQ2_0, blocks, torch.empty((ROWS, k), dtype=torch.float32, device=DEVICE))
    assert not np.array_equal(got, want)


@triton.jit
def _gathered(w, table, out, NBYTES: tl.constexpr, FMT: tl.constexpr, N: tl.constexpr, A: tl.constexpr):
    # a GEMV's broadcast: blocks [1, N, 1] against value indices [A, 1, B], out[a, n, b] = value A * b + a of block n
    n = tl.arange(0, N)[None, :, None]
    t = tl.arange(0, A)[:, None, None] + tl.arange(0, QK_K // A)[None, None, :] * A
    v = values.grid_values(w + n * NBYTES, table, t, FMT)
    tl.store(out + n * QK_K + t, v)


@pytest.mark.parametrize("fmt", [Format.IQ3_XXS, Format.IQ1_S, Format.TQ1_0], ids=lambda f: f.name)
def test_grid_values_broadcasts_a_gemv_tile(fmt):
    blocks = _blocks(fmt, 9)[:TILE_BLOCKS]
    w = torch.from_numpy(blocks.reshape(-1).copy()).to(DEVICE)
    out = torch.empty((TILE_BLOCKS, QK_K), dtype=torch.float32, device=DEVICE)
    table = values.device_table(fmt, DEVICE)
    _gathered[(1,)](w, table, out, NBYTES=LAYOUTS[fmt].nbytes, FMT=int(fmt), N=TILE_BLOCKS, A=TILE_A)
    want = dequantize(blocks.reshape(-1), fmt, (TILE_BLOCKS, QK_K))
    np.testing.assert_array_equal(out.cpu().numpy().view(np.uint32), want.view(np.uint32))
