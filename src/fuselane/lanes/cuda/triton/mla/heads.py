"""Per-head products: out[m, h] = W[h] @ x[m, h], each of `heads` heads of each row times its own (b, a)
matrix, one launch for every head (the grid's third axis).

The query's unrotated part through the key half of the latent's expansion (`attn_k_b`, (h, kv_lora, nope))
and the attended latent through the value half (`attn_v_b`, (h, vdim, kv_lora)) are both stored as a head's
`b` checkpoint rows of `a` values, so a head is a GEMV over its own rows. A block format decodes the file's
bytes in registers through the GEMV's own helpers (`gemv.formats.dot_rows`); float rows (the converter's
f16 or f32, whatever their width) are read as floats. `x` is read in place at any pitch: a head's `a` values
start `x_head` apart and a row's heads `x_row` apart (the query's unrotated slice is read where it lies).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import Format, row_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.formats import SLOTS, dot_rows
from fuselane.lanes.cuda.triton.gemv.rows import plan, row_tiles, stages, tile

FLOATS = {Format.F32: tl.float32, Format.F16: tl.float16}
# Output rows a program of the float kernel takes.
FLOAT_BLOCK_N = 32


@triton.jit
def _head_rows_kernel(
    x, x_row, x_head, m, w, out, out_row, n,
    FMT: tl.constexpr, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.begin(PDL)
    h = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past the head's end read its last row (no masked loads in the k loop); the store drops them.
    w_rows = w + (h * n).to(tl.int64) * ROW_BYTES + tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    mi = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    x_rows = x + tl.minimum(mi, m - 1).to(tl.int64) * x_row + h * x_head
    y = dot_rows(w_rows, x_rows, FMT, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES)
    mask = (mi < m)[:, None] & (rows < n)[None, :]
    tl.store(out + mi.to(tl.int64)[:, None] * out_row + h * n + rows[None, :], y, mask=mask)


@triton.jit
def _head_floats_kernel(
    x, x_row, x_head, w, out, out_row, n, a,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.begin(PDL)
    h, mi = tl.program_id(2), tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_A)
    keep = (rows < n)[:, None] & (cols < a)[None, :]
    wv = tl.load(w + (h * n + rows).to(tl.int64)[:, None] * a + cols[None, :], mask=keep, other=0.0)
    xv = tl.load(x + mi.to(tl.int64) * x_row + h * x_head + cols, mask=cols < a, other=0.0)
    y = tl.sum(wv.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    tl.store(out + mi.to(tl.int64) * out_row + h * n + rows, y, mask=rows < n)


def _floats(w: torch.Tensor, fmt: Format) -> torch.Tensor:
    return w.view(torch.float32 if fmt is Format.F32 else torch.float16)


def head_matmul(
    x: torch.Tensor, x_row: int, x_head: int, m: int, w: torch.Tensor, fmt: Format, heads: int, a: int, b: int,
    out: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """out (m, heads * b) = each head's `a` values of each of the `m` rows of `x` (at pitches `x_row`,
    `x_head`) times its own `b` rows of `a` values of `w` (the checkpoint's bytes in `fmt`); returns `out`."""
    fmt = Format(fmt)
    if out.stride(-1) != 1 or out.numel() != m * heads * b:
        raise ValueError(f"out must hold ({m}, {heads * b}) values with unit column stride")
    out_row = heads * b
    if fmt in FLOATS:
        grid = (triton.cdiv(b, FLOAT_BLOCK_N), m, heads)
        block_a = triton.next_power_of_2(a)
        _head_floats_kernel[grid](
            x, x_row, x_head, _floats(w, fmt), out, out_row, b, a, FLOAT_BLOCK_N, block_a, **pdl.options()
        )
        return out
    if fmt not in SLOTS:
        raise ValueError(f"no per-head product for {fmt.name} rows")
    block_n, warps = tile(fmt, b, a, m)
    block_m, m_tiles = row_tiles(m)
    steps, units, split = plan(fmt, a, block_n, warps, block_m)
    _head_rows_kernel[(triton.cdiv(b, block_n), m_tiles, heads)](
        x, x_row, x_head, m, w, out, out_row, b,
        FMT=int(fmt), ROW_BYTES=row_bytes(fmt, a), STEPS=steps, UNITS=units, SPLIT=split, BLOCK_M=block_m,
        BLOCK_N=block_n, STAGES=stages(fmt), num_warps=warps, **pdl.options()
    )  # fmt: skip
    return out
