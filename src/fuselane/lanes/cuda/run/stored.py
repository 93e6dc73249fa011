"""A matrix's bytes as the cuda lane keeps them on the device: the file's blocks, each at the start of a block of
`kernels.stored_block_bytes` (Q3_K's 110 bytes in 112, so every block starts on 16 bytes), the rest zero. The
upload (`lane.CudaLane`) writes them so; tests hand the kernels the same."""

from __future__ import annotations

import numpy as np

from fuselane.gguf.formats import LAYOUTS, Format
from fuselane.lanes.cuda.plan import kernels


def padded(fmt: Format) -> bool:
    """Whether the device's blocks of `fmt` are larger than the file's."""
    return kernels.stored_block_bytes(fmt) != LAYOUTS[Format(fmt)].nbytes


def stored_bytes(fmt: Format, data: np.ndarray) -> np.ndarray:
    """`data` (a tensor's bytes as the file has them, any shape of whole blocks) as the device keeps them: flat
    uint8, each block at the start of its stored block. The file's bytes themselves where the layouts agree."""
    raw = np.asarray(data).reshape(-1).view(np.uint8)
    if not padded(fmt):
        return raw
    file_block, block = LAYOUTS[Format(fmt)].nbytes, kernels.stored_block_bytes(fmt)
    if raw.size % file_block:
        raise ValueError(f"{Format(fmt).name} bytes are whole blocks of {file_block}, not {raw.size}")
    out = np.zeros((raw.size // file_block, block), dtype=np.uint8)
    out[:, :file_block] = raw.reshape(-1, file_block)
    return out.reshape(-1)


def surplus(fmt: Format, nbytes: int) -> int:
    """Bytes the device's layout adds to a tensor of `nbytes` bytes in `fmt` (as the file has them)."""
    if not padded(fmt):
        return 0
    return nbytes // LAYOUTS[Format(fmt)].nbytes * kernels.stored_block_bytes(fmt) - nbytes
