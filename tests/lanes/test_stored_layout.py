"""The weights' layout on the cuda lane's device (`run/stored.py`, `kernels.STORED_BLOCK_BYTES`, `ROW_TAIL_D`):
Q3_K's blocks padded to 112 bytes, Q6_K's rows split into their blocks' first 208 bytes, then the blocks' d's,
then zeros to a 16-byte end; the bytes each adds, and the device decode reading them back as `gguf.dequant`
does. Host-only but for the last case, which runs the decode kernel (interpreted without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from fuselane.gguf.dequant import dequantize
from fuselane.gguf.formats import LAYOUTS, Format
from fuselane.gguf.quantize import random_blocks
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.run import stored

Q6 = LAYOUTS[Format.Q6_K]


def _q6_k_rows(rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    return random_blocks(Format.Q6_K, rows * blocks, np.random.default_rng(seed)).reshape(-1)


@pytest.mark.parametrize("blocks", [1, 7, 8, 14, 74])
def test_a_q6_k_row_keeps_its_runs_then_its_ds_then_zeros_to_16_bytes(blocks):
    rows, row_bytes = 3, blocks * Q6.nbytes
    raw = _q6_k_rows(rows, blocks)
    out = stored.stored_bytes(Format.Q6_K, raw, row_bytes).reshape(rows, -1)
    width = kernels.stored_row_bytes(Format.Q6_K, blocks * Q6.values)
    assert out.shape[1] == width and width % kernels.ROW_ALIGN_BYTES == 0 and width - row_bytes < 16
    file = raw.reshape(rows, blocks, Q6.nbytes)
    d_at, stride = Q6.field("d").offset, kernels.stored_block_bytes(Format.Q6_K)
    for r in range(rows):
        for b in range(blocks):
            assert (out[r, b * stride : (b + 1) * stride] == file[r, b, :d_at]).all()
            assert (out[r, blocks * stride + 2 * b : blocks * stride + 2 * b + 2] == file[r, b, d_at:]).all()
        assert not out[r, row_bytes:].any()  # the row's padding
    assert stored.surplus(Format.Q6_K, raw.size, row_bytes) == rows * (width - row_bytes)


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


def test_the_device_decode_reads_the_split_rows_as_dequant_does():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from fuselane.lanes.cuda.triton.gemv.epilogue import dequantize as device_dequantize

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, blocks = 5, 3  # 630-byte rows: 640 on the device, so each row's start moves by its padding
    raw = _q6_k_rows(rows, blocks, seed=4)
    w = torch.from_numpy(stored.stored_bytes(Format.Q6_K, raw, blocks * Q6.nbytes)).to(device)
    out = torch.empty(rows, blocks * Q6.values, dtype=torch.float32, device=device)
    device_dequantize(w, Format.Q6_K, rows, blocks * Q6.values, out)
    want = dequantize(raw, Format.Q6_K, (rows, blocks * Q6.values))
    np.testing.assert_array_equal(out.cpu().numpy(), want)
