"""The weights' layout on the cuda lane's device (`run/stored.py`, `kernels.STORED_BLOCK_BYTES`, `ROW_TAIL_D`): Q3_K's
blocks padded to 112 bytes; Q6_K's, Q8_0's, Q4_0's, IQ4_NL's, IQ4_XS's and MXFP4's rows split into their blocks'
bytes but d (MXFP4's exponent e) (Q6_K's first 208, Q8_0's 32 codes, Q4_0's and IQ4_NL's 16, IQ4_XS's 128, its
scales kept with its d), then the blocks' d's, then zeros to a 16-byte end (Q8_0, Q4_0, IQ4_NL: 8); the bytes each
adds, and the device decode reading them back as `gguf.dequant` does. Host-only but for the last cases, which run
the decode kernel (interpreted without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from fuselane.gguf.dequant import dequantize
from fuselane.gguf.formats import LAYOUTS, Format
from fuselane.gguf.quantize import random_blocks
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.run import stored

Q6 = LAYOUTS[Format.Q6_K]
SPLIT = sorted(kernels.ROW_TAIL_D, key=int)  # the formats whose rows keep their d's after their blocks


def _rows(fmt: Format, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    return random_blocks(fmt, rows * blocks, np.random.default_rng(seed)).reshape(-1)


def _q6_k_rows(rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    return _rows(Format.Q6_K, rows, blocks, seed)


def test_the_formats_whose_blocks_are_not_whole_16_byte_units_are_split():
    assert {Format.Q6_K, Format.Q8_0, Format.Q4_0, Format.IQ4_NL, Format.IQ4_XS} <= set(SPLIT)
    assert Format.Q2_K not in SPLIT  # its 84-byte blocks gained no speed split, and their rows padded to 16


@pytest.mark.parametrize("fmt", SPLIT, ids=lambda f: f.name)
@pytest.mark.parametrize("blocks", [1, 7, 8, 14, 74, 112])
def test_a_split_row_keeps_its_blocks_then_its_ds_then_zeros_to_16_bytes(fmt, blocks):
    lay = LAYOUTS[fmt]
    rows, row_bytes = 3, blocks * lay.nbytes
    raw = _rows(fmt, rows, blocks)
    out = stored.stored_bytes(fmt, raw, row_bytes).reshape(rows, -1)
    width = kernels.stored_row_bytes(fmt, blocks * lay.values)
    assert out.shape[1] == width and width % kernels.ROW_ALIGN_BYTES[fmt] == 0 and width - row_bytes < 16
    file = raw.reshape(rows, blocks, lay.nbytes)
    d_at = lay.field(kernels.TAIL_FIELD.get(fmt, "d")).offset  # MXFP4's header is its exponent, e
    stride, tail = kernels.stored_block_bytes(fmt), kernels.ROW_TAIL_D[fmt]
    assert stride == lay.nbytes - tail and stride % 16 == 0  # every block's runs start on 16 bytes
    for r in range(rows):
        for b in range(blocks):
            block = np.concatenate([file[r, b, :d_at], file[r, b, d_at + tail :]])
            assert (out[r, b * stride : (b + 1) * stride] == block).all()
            ds = out[r, blocks * stride + tail * b : blocks * stride + tail * (b + 1)]
            assert (ds == file[r, b, d_at : d_at + tail]).all()
        assert not out[r, row_bytes:].any()  # the row's padding
    assert stored.surplus(fmt, raw.size, row_bytes) == rows * (width - row_bytes)


def test_a_stored_offset_moves_past_a_d_kept_after_the_row():
    assert kernels.stored_offset(Format.Q8_0, "qs") == 0
    assert kernels.stored_offset(Format.Q6_K, "scales") == Q6.field("scales").offset
    assert kernels.stored_offset(Format.Q4_K, "qs") == LAYOUTS[Format.Q4_K].field("qs").offset
    assert kernels.stored_offset(Format.IQ4_XS, "qs") == kernels.stored_offset(Format.Q4_0, "qs") == 0
    with pytest.raises(ValueError, match="after its row"):
        kernels.stored_offset(Format.Q8_0, "d")
    with pytest.raises(ValueError, match="scales_l is kept after its row"):
        kernels.stored_offset(Format.IQ4_XS, "scales_l")
    assert kernels.kept_after_row(Format.IQ4_XS, "scales_l") and not kernels.kept_after_row(Format.IQ4_XS, "qs")
    assert not kernels.kept_after_row(Format.Q4_K, "dmin")


def test_a_matrix_with_rows_takes_its_row_from_its_last_axis():
    raw = _q6_k_rows(2, 3)
    flat = stored.stored_bytes(Format.Q6_K, raw, 3 * Q6.nbytes)
    assert (stored.stored_bytes(Format.Q6_K, raw.reshape(2, -1)) == flat).all()


def test_q6_k_bytes_without_rows_are_refused_not_guessed():
    raw = _q6_k_rows(2, 3)
    with pytest.raises(ValueError, match="laid out by rows"):
        stored.stored_bytes(Format.Q6_K, raw)
    with pytest.raises(ValueError, match="laid out by rows"):
        stored.surplus(Format.Q6_K, raw.size)
    with pytest.raises(ValueError, match="do not divide"):
        stored.stored_bytes(Format.Q6_K, raw, 4 * Q6.nbytes)  # six blocks are not rows of four


def test_q3_k_pads_each_block_and_the_other_formats_keep_the_files_bytes():
    q3 = LAYOUTS[Format.Q3_K]
    raw = random_blocks(Format.Q3_K, 5, np.random.default_rng(1)).reshape(-1)
    out = stored.stored_bytes(Format.Q3_K, raw).reshape(5, -1)
    assert out.shape[1] == 112 and (out[:, : q3.nbytes] == raw.reshape(5, -1)).all() and not out[:, q3.nbytes :].any()
    assert stored.surplus(Format.Q3_K, raw.size) == 5 * 2
    q4 = random_blocks(Format.Q4_K, 4, np.random.default_rng(2)).reshape(-1)
    assert (stored.stored_bytes(Format.Q4_K, q4) == q4).all()
    assert not stored.relaid(Format.Q4_K) and stored.relaid(Format.Q6_K) and stored.relaid(Format.Q3_K)


# rows whose stored bytes differ from the file's: each row's start moves (Q4_0 / IQ4_NL: 5 blocks, 90 bytes -> 96)
DECODED = {Format.Q6_K: 3, Format.Q8_0: 5, Format.Q4_0: 5, Format.IQ4_NL: 5, Format.IQ4_XS: 3, Format.MXFP4: 17}


def test_every_split_format_is_decoded_here():
    assert set(DECODED) == set(SPLIT)


@pytest.mark.parametrize(("fmt", "blocks"), list(DECODED.items()), ids=[f.name for f in DECODED])
def test_the_device_decode_reads_the_split_rows_as_dequant_does(fmt, blocks):
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from fuselane.lanes.cuda.triton.gemv.epilogue import dequantize as device_dequantize

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lay, rows = LAYOUTS[fmt], 5
    raw = _rows(fmt, rows, blocks, seed=4)
    assert kernels.stored_row_bytes(fmt, blocks * lay.values) != blocks * lay.nbytes
    w = torch.from_numpy(stored.stored_bytes(fmt, raw, blocks * lay.nbytes)).to(device)
    out = torch.empty(rows, blocks * lay.values, dtype=torch.float32, device=device)
    device_dequantize(w, fmt, rows, blocks * lay.values, out)
    want = dequantize(raw, fmt, (rows, blocks * lay.values))
    np.testing.assert_array_equal(out.cpu().numpy(), want)
