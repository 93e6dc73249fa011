"""A matrix's bytes as the cuda lane keeps them on the device (`kernels.STORED_BLOCK_BYTES`, `ROW_TAIL_D`):

- Q3_K's 110-byte blocks each at the start of 112 bytes, the rest zero, so every block starts on 16 bytes;
- Q6_K's, Q8_0's, Q4_0's, IQ4_NL's and IQ4_XS's rows split: each block's bytes but its f16 d (Q6_K's ql, qh and
  scales, 208 bytes; Q8_0's 32 codes; Q4_0's and IQ4_NL's 16; IQ4_XS's 128, its scales kept with its d) one after
  another, then the row's blocks' d's, then zeros to a 16-byte end (Q8_0, Q4_0, IQ4_NL: 8), so every run of codes
  starts on 16 bytes (on 8 where a row of those three does not end on 16);
- MXFP4's rows as IQ4_NL's, each block's 1-byte e8m0 exponent where IQ4_NL keeps its d;
- every other format as the file has it.

The upload (`lane.CudaLane`) writes them so; tests hand the kernels the same."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from fuselane.gguf.formats import LAYOUTS, Format
from fuselane.lanes.cuda.plan import kernels


def relaid(fmt: Format) -> bool:
    """Whether the device keeps `fmt`'s bytes otherwise than the file."""
    fmt = Format(fmt)
    return kernels.stored_block_bytes(fmt) != LAYOUTS[fmt].nbytes or fmt in kernels.ROW_TAIL_D


def file_row_bytes(fmt: Format, shape: tuple[int, ...]) -> int:
    """Bytes of a row of a matrix of numpy-order `shape` (its last axis a row's values) as the file has them."""
    lay = LAYOUTS[Format(fmt)]
    return shape[-1] // lay.values * lay.nbytes


def _row(fmt: Format, row_bytes: int | None) -> int:
    """A row's file bytes: `row_bytes`, or a block where the layout does not go by rows (a format whose blocks
    move apart within a row cannot be laid out without knowing its rows)."""
    if row_bytes is not None:
        return row_bytes
    if fmt in kernels.ROW_TAIL_D:
        raise ValueError(f"{fmt.name} bytes are laid out by rows: give a row's length")
    return LAYOUTS[fmt].nbytes


def _rows(fmt: Format, size: int, row_bytes: int | None) -> tuple[int, int, int]:
    """(rows, blocks a row, file block) of `size` file bytes in rows of `row_bytes` (whole blocks)."""
    file_block = LAYOUTS[fmt].nbytes
    if size % file_block:
        raise ValueError(f"{fmt.name} bytes are whole blocks of {file_block}, not {size}")
    row_bytes = _row(fmt, row_bytes)
    if row_bytes % file_block or size % row_bytes:
        raise ValueError(f"{fmt.name} rows of {row_bytes} bytes do not divide {size} bytes of whole blocks")
    return size // row_bytes, row_bytes // file_block, file_block


def stored_tensor(fmt: Format, raw: Any, row_bytes: int | None = None) -> Any:
    """`raw` (a host torch uint8 tensor: a tensor's bytes as the file has them, its rows `row_bytes` long) as the
    device keeps them: a flat uint8 tensor, `raw` itself where the layouts agree. torch's strided copies, where
    NumPy's took ~13x longer (2.0 s against 0.15 s for a 7B's Q6_K head on two cores): the upload's cost."""
    import torch

    fmt = Format(fmt)
    if not relaid(fmt):
        return raw.reshape(-1)
    rows, per_row, file_block = _rows(fmt, raw.numel(), row_bytes)
    blocks = raw.reshape(rows, per_row, file_block)
    stride = kernels.stored_block_bytes(fmt)
    out = torch.zeros((rows, kernels.stored_row_bytes(fmt, per_row * LAYOUTS[fmt].values)), dtype=torch.uint8)
    runs = out[:, : per_row * stride].view(rows, per_row, stride)
    tail = kernels.ROW_TAIL_D.get(fmt)
    if tail is None:
        runs[:, :, :file_block].copy_(blocks)
    else:
        d_at = kernels.tail_offset(fmt)
        runs[:, :, :d_at].copy_(blocks[:, :, :d_at])
        runs[:, :, d_at:].copy_(blocks[:, :, d_at + tail :])
        ds = out[:, per_row * stride : per_row * (stride + tail)].view(rows, per_row, tail)
        ds.copy_(blocks[:, :, d_at : d_at + tail])
    return out.view(-1)


def stored_bytes(fmt: Format, data: np.ndarray, row_bytes: int | None = None) -> np.ndarray:
    """`data` (a tensor's bytes as the file has them, any shape of whole blocks; its rows `row_bytes` long, else
    its last axis's bytes where it has two or more) as the device keeps them (`stored_tensor`): flat uint8. The
    file's bytes themselves where the layouts agree."""
    import torch

    arr = np.asarray(data)
    raw = arr.reshape(-1).view(np.uint8)
    if not relaid(fmt):
        return raw
    if row_bytes is None and arr.ndim > 1:
        row_bytes = arr.shape[-1] * arr.dtype.itemsize
    return stored_tensor(fmt, torch.from_numpy(np.array(raw)), row_bytes).numpy()


def surplus(fmt: Format, nbytes: int, row_bytes: int | None = None) -> int:
    """Bytes the device's layout adds to a tensor of `nbytes` bytes in `fmt` (as the file has them) whose rows are
    `row_bytes` long (a block where not given: the formats laid out by rows need it)."""
    fmt = Format(fmt)
    if not relaid(fmt):
        return 0
    row_bytes = _row(fmt, row_bytes)
    per_row = row_bytes // LAYOUTS[fmt].nbytes
    return nbytes // row_bytes * kernels.stored_row_bytes(fmt, per_row * LAYOUTS[fmt].values) - nbytes


def describe(formats: Iterable[Format] | None = None) -> str:
    """The stored layouts of `formats` (every one the lane relays where None) in a few words, for `explain`."""
    parts = []
    wanted = None if formats is None else {Format(f) for f in formats}
    for fmt, block in kernels.STORED_BLOCK_BYTES.items():
        if wanted is not None and fmt not in wanted:
            continue
        if fmt in kernels.ROW_TAIL_D:
            field, align = kernels.tail_field(fmt), kernels.ROW_ALIGN_BYTES[fmt]
            parts.append(f"{fmt.name}'s {field}'s after a row's {block}-byte blocks, rows to {align} bytes")
        else:
            parts.append(f"{fmt.name}'s {LAYOUTS[fmt].nbytes} bytes in {block}")
    return ", ".join(parts)
