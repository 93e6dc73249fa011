"""A batch step's next inputs made on the device from its current ones and its picks: the overlapped decode.

With overlap (`engine/cuda.py`), step N+1 of a batch is launched before the host has read step N's tokens. Its
inputs are step N's, one row on: each of the first `n` rows feeds the token it picked (`picked`' TOKEN column),
at its position + 1, attending over one row more, its new key and value going to the pool slot of that position
in its block table (which the host has grown, and written, to hold it). The padding rows past `n` are left as
they are: token 0 at position 0 over the spare block, every step.

One program over every row of the bucket (at most a few hundred int32 values read and written): a launch of its
own before the step's graph replay, not captured in the graph. Captured, a bucket would need a graph that
advances beside each that reads the host's inputs (twice the graphs, their capture time and memory) for the
gap of one launch between two replays, which the GPU runs while the host, a step ahead, waits for the picks.
It runs as an ordinary launch (not a dependent): it reads the picks the replay before wrote.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.sample import PICKED_DTYPE, PICKED_VALUES, TOKEN

_ID: tl.constexpr = tl.constexpr(kernels.BATCH_ID)
_POSITION: tl.constexpr = tl.constexpr(kernels.BATCH_POSITION)
_SLOT: tl.constexpr = tl.constexpr(kernels.BATCH_SLOT)
_LENGTH: tl.constexpr = tl.constexpr(kernels.BATCH_LENGTH)
_COLUMNS: tl.constexpr = tl.constexpr(kernels.BATCH_COLUMNS)
_PICKED_VALUES: tl.constexpr = tl.constexpr(PICKED_VALUES)
_TOKEN: tl.constexpr = tl.constexpr(TOKEN)


@triton.jit(do_not_specialize=["n"])  # one compile a bucket, whatever rows it advances
def _advance_kernel(inputs_ptr, picked_ptr, n, width, block_size, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):  # fmt: skip
    # Rows 0 .. n-1 of a bucket of ROWS: the pick becomes the id, the position and length step on by one, and
    # the slot is the new position's in the row's table.
    pdl.begin(PDL)
    row = tl.arange(0, BLOCK)
    live = row < n
    token = tl.load(picked_ptr + row * _PICKED_VALUES + _TOKEN, mask=live, other=0)
    pos = tl.load(inputs_ptr + _POSITION * ROWS + row, mask=live, other=0) + 1
    block = tl.load(inputs_ptr + _COLUMNS * ROWS + row * width + pos // block_size, mask=live, other=0)
    tl.store(inputs_ptr + _ID * ROWS + row, token, mask=live)
    tl.store(inputs_ptr + _POSITION * ROWS + row, pos, mask=live)
    tl.store(inputs_ptr + _LENGTH * ROWS + row, pos + 1, mask=live)
    tl.store(inputs_ptr + _SLOT * ROWS + row, block * block_size + pos % block_size, mask=live)


def advance(inputs: torch.Tensor, picked: torch.Tensor, n: int, rows: int, width: int, block_size: int) -> None:
    """Advance the first `n` rows of a bucket of `rows` in place (see the module): `inputs` the step's int32
    inputs (`kernels.BATCH_COLUMNS` columns of `rows`, then `rows` tables of `width` blocks), `picked` its
    (rows, PICKED_VALUES) picks."""
    if inputs.dtype != torch.int32 or inputs.numel() != rows * (kernels.BATCH_COLUMNS + width):
        raise ValueError(f"advance: the int32 inputs of {rows} rows with tables {width} wide")
    if picked.dtype != PICKED_DTYPE or picked.shape != (rows, PICKED_VALUES) or not 0 <= n <= rows:
        raise ValueError(f"advance: ({rows}, {PICKED_VALUES}) picks, and at most {rows} rows to advance")
    block = triton.next_power_of_2(rows)
    _advance_kernel[(1,)](inputs, picked, n, width, block_size, ROWS=rows, BLOCK=block, **pdl.options())
