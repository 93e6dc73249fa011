"""The whole-matrix decode of a grid or ternary format on the device: one launch turns a GGUF tensor's bytes into
f16 or f32 values, each the f32 `fuselane.gguf.dequant.dequantize` gives (an f16 out holds it rounded to nearest
even), so a product the lane has no fused kernel for can read the weights as floats.

A program decodes UNITS whole 256-value blocks: a grid format's 32 groups of 8 a block, each group's fields found
once (`values.grid_group`) and its 8 values from them (`grid_entry`), stored side by side; a ternary format's
values each alone (`grid_values`). Blocks past the end decode the last one, as `gemv.epilogue`'s decode does, and
their stores are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import LAYOUTS, QK_K, Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.grid.values import (
    BLOCK_VALUES,
    GRID_GROUP,
    TERNARY_FORMATS,
    device_table,
    grid_entry,
    grid_group,
    grid_values,
)

DECODE_OUT = (torch.float16, torch.float32)
PROGRAM_BLOCKS = 8  # blocks a program: 2,048 values, 16 a thread at DECODE_WARPS
DECODE_WARPS = 4


@triton.jit
def _grid_dequant_kernel(
    w,
    table,
    out,
    units,
    units_a_row,
    pitch,
    FMT: tl.constexpr,
    NBYTES: tl.constexpr,
    UNITS: tl.constexpr,
    GROUP_C: tl.constexpr,
    TERNARY: tl.constexpr,
    PDL: tl.constexpr,
):
    # a program decodes UNITS whole blocks of the flat tensor; row r's blocks at w + r * units_a_row * NBYTES
    pdl.begin(PDL)
    u = tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS)
    keep = u < units
    # units past the end decode the last one (no masked loads); the store drops them
    last = tl.minimum(u, units - 1)
    row, unit = last // units_a_row, last % units_a_row
    blk = (w + (row * units_a_row + unit) * NBYTES)[:, None]
    first = out + (u // units_a_row) * pitch + (u % units_a_row) * BLOCK_VALUES  # [U]: each unit's first value
    # an f16 result is the f32 value rounded once, to nearest even (as NumPy's astype rounds)
    if TERNARY:
        t = tl.arange(0, BLOCK_VALUES)[None, :]
        v = grid_values(blk, table, t, FMT)
        tl.store(first[:, None] + t, v.to(out.dtype.element_ty), mask=keep[:, None])
    else:
        # a group's fields once ([U, G]), then its 8 values from them alone (as the grid GEMV), side by side in
        # the thread, so a unit's values leave in one wide store a group, not 8 narrow ones 16 bytes apart
        g = tl.arange(0, BLOCK_VALUES // GROUP_C)[None, :]
        low, high, signs, scale, delta = grid_group(blk, table, g, FMT)
        v = _group_values(low, high, signs, scale, delta, FMT, GROUP_C)  # [U, G * 8]
        t = tl.arange(0, BLOCK_VALUES)[None, :]
        tl.store(first[:, None] + t, v.to(out.dtype.element_ty), mask=keep[:, None])


@triton.jit
def _entry(low, high, signs, scale, delta, J: tl.constexpr, FMT: tl.constexpr):
    return grid_entry(low, high, signs, scale, delta, tl.full([1, 1], J, tl.int32), FMT)


@triton.jit
def _group_values(low, high, signs, scale, delta, FMT: tl.constexpr, GROUP_C: tl.constexpr):
    """[U, G * 8]: each group's 8 values (`grid_entry`) in order, a group's in one thread. `tl.join` adds a last
    axis of two; joining the values 4 apart first, then 2 apart, then 1 apart makes that axis (j >> 2, j >> 1 & 1,
    j & 1), which flattens to j."""
    a0 = tl.join(_entry(low, high, signs, scale, delta, 0, FMT), _entry(low, high, signs, scale, delta, 4, FMT))
    a1 = tl.join(_entry(low, high, signs, scale, delta, 1, FMT), _entry(low, high, signs, scale, delta, 5, FMT))
    a2 = tl.join(_entry(low, high, signs, scale, delta, 2, FMT), _entry(low, high, signs, scale, delta, 6, FMT))
    a3 = tl.join(_entry(low, high, signs, scale, delta, 3, FMT), _entry(low, high, signs, scale, delta, 7, FMT))
    v = tl.join(tl.join(a0, a2), tl.join(a1, a3))  # [U, G, 2, 2, 2]
    return tl.reshape(v, [v.shape[0], v.shape[1] * GROUP_C])


def dequantize_grid(
    w: torch.Tensor, fmt: Format, n: int, k: int, out: torch.Tensor, table: torch.Tensor | None = None
) -> torch.Tensor:
    """out (n, k) = the values of the n x k rows `w` (1-D uint8, the GGUF tensor's bytes) in the grid or ternary
    format `fmt`, decoded on the device; returns `out`.

    `out` is an f16 or f32 2-D tensor of unit column stride, rows at any pitch (columns past k untouched).
    Every value is the f32 `fuselane.gguf.dequant.dequantize` gives, bit for bit; an f16 `out` holds it rounded
    to nearest even. `table` is `values.device_table(fmt, w.device)` unless given (a caller holding it already).
    """
    fmt = Format(fmt)
    if fmt not in kernels.GRID_GEMV_FORMATS:
        raise ValueError(f"no device grid decode for {fmt.name}")
    if n < 0 or k < 0 or k % QK_K:
        raise ValueError(f"{fmt.name} rows must be whole {QK_K}-value blocks; got n={n}, k={k}")
    want = n * (k // QK_K) * LAYOUTS[fmt].nbytes
    if w.dtype != torch.uint8 or w.dim() != 1 or not w.is_contiguous() or w.numel() != want:
        raise ValueError(f"{fmt.name} weights of {n} rows of {k} must be a contiguous 1-D uint8 tensor of {want} bytes")
    if out.dtype not in DECODE_OUT or out.dim() != 2 or tuple(out.shape) != (n, k) or out.stride(1) != 1:
        raise ValueError(f"out must be an f16 or f32 ({n}, {k}) tensor with unit column stride")
    if table is None:
        table = device_table(fmt, w.device)
    units_a_row = k // QK_K
    units = n * units_a_row
    if units == 0:
        return out
    _grid_dequant_kernel[(triton.cdiv(units, PROGRAM_BLOCKS),)](
        w,
        table,
        out,
        units,
        units_a_row,
        out.stride(0),
        FMT=int(fmt),
        NBYTES=LAYOUTS[fmt].nbytes,
        UNITS=PROGRAM_BLOCKS,
        GROUP_C=GRID_GROUP,
        TERNARY=fmt in TERNARY_FORMATS,
        num_warps=DECODE_WARPS,
        **pdl.options(),
    )
    return out
