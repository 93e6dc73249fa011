"""Prefill products on the tensor cores with the weights dequantized in the kernel: y (m, n) = x (m, k) @ W^T,
W the n x k checkpoint rows as stored (GGUF bytes), for the products of a prefill chunk (m past the GEMV's rows).

A program takes BLOCK_M activation rows and BLOCK_N weight rows and walks k in steps of whole units (a K-quant
super-block of 256 values, or four 32-value blocks): each step decodes its units of the
BLOCK_N rows to f32 in registers (`gemv.epilogue.unit_values`: every value the f32 of `fuselane.gguf.dequant`,
bit for bit), rounds them and the activations to f16, and multiplies them on the tensor cores (`tl.dot`, f32
sums). The numbers are those of multiplying a dequantized f16 copy of the matrix (the operands are rounded
the same way, once), but no copy is made: the weights stay in the checkpoint's bytes on the device, so a
model's prefill needs no second, 3.6x larger, f16 copy of its matrices (16 GB for an 8B Q4_K_M). A step's
activation row past 2^14 is first divided by the power of two that brings it under (exact), and the f16 tensor
cores' product scaled back in f32, so activations past f16's range (65504) stay finite.

Rows past m or n read the last row (no masked loads in the loop); the store drops them. The epilogue adds a
bias and a residual and lands the rows at row pos[0] of a table where asked (a cache row write).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes, stored_span_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.epilogue import DEQUANT_OUT, decode_unit, unit_values
from fuselane.lanes.cuda.triton.gemv.layout import block_d
from fuselane.lanes.cuda.triton.gemv.parts import check_rows

# The tile, as compiled for sm_90 (ptxas -v): 64 activation rows by 32 weight rows, eight warps, the loads of
# a step not staged ahead (one stage): 254 registers a thread and no spills for a K-quant's 256-value step,
# where 64 weight rows spilled 32-250 bytes a thread and two stages 250.
BLOCK_M = 64
BLOCK_N = 32
WARPS = 8
STAGES = 1
# A step of a 32-value format: four blocks (128 values, a tensor-core K of eight 16-value slices); eight
# spilled 280-490 bytes a thread.
BLOCK_STEP_VALUES = 128
# The largest |activation| a step rounds to f16 as it is: a row of a step past it is divided by the power of two
# that brings it under (exact), multiplied in f16 and scaled back in f32, so no activation overflows f16 (65504).
F16_SAFE = tl.constexpr(2.0**14)


@triton.jit
def store_tile(acc, xm, rows, m, n, bias, res, res_pitch, out, out_pitch, pos,
               HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, AT_ROW: tl.constexpr):  # fmt: skip
    """A prefill GEMM's epilogue, shared by the f16 and the int8 GEMMs: the tile `acc` (activation rows `xm` x
    weight rows `rows`) plus a bias and a residual where given, stored at row pos[0] + xm of `out` where AT_ROW
    (a cache row write), else at row xm; rows past m or n dropped."""
    keep = (xm < m)[:, None] & (rows < n)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + rows, mask=rows < n, other=0.0)[None, :]
    if HAS_RES:
        acc += tl.load(res + xm[:, None].to(tl.int64) * res_pitch + rows[None, :], mask=keep, other=0.0)
    first = 0
    if AT_ROW:
        first = tl.load(pos)
    dst = out + (first + xm)[:, None].to(tl.int64) * out_pitch + rows[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=keep)


@triton.jit
def _gemm_kernel(
    x, w, out, bias, res, pos, m, n, x_pitch, out_pitch, res_pitch,
    FMT: tl.constexpr, VALUES: tl.constexpr, NBYTES: tl.constexpr, ROW_BYTES: tl.constexpr,
    STEPS: tl.constexpr, STEP_UNITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, AT_ROW: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    xm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    w_rows = w + tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    x_rows = x + tl.minimum(xm, m - 1).to(tl.int64) * x_pitch
    units = tl.arange(0, STEP_UNITS)
    cols = tl.arange(0, STEP_UNITS * VALUES)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in range(0, STEPS):
        u0 = s * STEP_UNITS
        a = tl.load(x_rows[:, None] + u0 * VALUES + cols[None, :]).to(tl.float32)
        # [BLOCK_N * STEP_UNITS, 1] unit pointers, row-major, so the decoded [.., VALUES] reshapes to the rows'
        blk = tl.reshape(w_rows[:, None] + (u0 + units)[None, :] * NBYTES, [BLOCK_N * STEP_UNITS, 1])
        qd = tl.reshape(block_d(w_rows[:, None], (u0 + units)[None, :], FMT, ROW_BYTES), [BLOCK_N * STEP_UNITS, 1])
        b = tl.reshape(unit_values(blk, qd, FMT, VALUES), [BLOCK_N, STEP_UNITS * VALUES]).to(tl.float16)
        amax = tl.max(tl.abs(a), 1)
        if tl.max(amax) > F16_SAFE:  # a row past f16's range: scaled down by a power of two, exactly
            scale = tl.where(amax > F16_SAFE, tl.exp2(tl.ceil(tl.log2(amax / F16_SAFE))), 1.0)
            part = tl.dot((a / scale[:, None]).to(tl.float16), tl.trans(b))
            acc += part * scale[:, None]
        else:
            acc = tl.dot(a.to(tl.float16), tl.trans(b), acc)
    store_tile(acc, xm, rows, m, n, bias, res, res_pitch, out, out_pitch, pos, HAS_BIAS, HAS_RES, AT_ROW)


def supports(fmt: Format, k: int) -> bool:
    """Whether `gemm` takes n x k rows in `fmt`: a format the device decodes, rows of whole steps."""
    fmt = Format(fmt)
    return fmt in kernels.DEQUANT_FORMATS and k % decode_unit(fmt, k) == 0 and step_units(fmt, k) > 0


def step_units(fmt: Format, k: int) -> int:
    """Units a step: one K-quant super-block, or the most of a 32-value format's blocks, up to
    BLOCK_STEP_VALUES and a power of two, whose values divide the row (a row of 46 blocks, 1,472 values, takes
    steps of two: a tensor-core K of four 16-value slices); 0 where the row is not whole units."""
    values = decode_unit(fmt, k)
    if k % values:
        return 0
    units = max(1, BLOCK_STEP_VALUES // values)
    while k % (units * values):
        units //= 2
    return units


def gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    fmt: Format,
    n: int,
    k: int,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_row: tuple[torch.Tensor, int] | None = None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """out (m, n) = x (m, k) @ W^T (+ bias) (+ residual), W the n x k checkpoint rows `w` in `fmt`, on the
    tensor cores with f16 operands and f32 sums; returns `out`.

    `x` is f32 or f16 (m, k), rows at any pitch; `residual` (m, n) may be `out`. With `out_row` = (pos, pitch)
    the rows land from row pos[0] of the table `out` (`pitch` values apart), the position read on the device.
    `block_m` and `block_n` are the kernel's tile, parameters only so tests reach several tiles.
    """
    fmt = Format(fmt)
    if not supports(fmt, k):
        raise ValueError(f"no prefill GEMM for {fmt.name} rows of {k} values")
    check_rows(w, fmt, n, k)
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.dtype not in DEQUANT_OUT:
        raise ValueError(f"x must be an f32 or f16 (m, {k}) tensor with unit column stride")
    check_out(out, m, n, out_row, residual, bias)
    pos, pitch = out_row if out_row is not None else (x, out.stride(0))
    values = decode_unit(fmt, k)
    units = step_units(fmt, k)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _gemm_kernel[grid](
        x,
        w,
        out,
        x if bias is None else bias,
        x if residual is None else residual,
        pos,
        m,
        n,
        x.stride(0),
        pitch,
        out.stride(0) if residual is None else residual.stride(0),
        FMT=int(fmt),
        VALUES=values,
        NBYTES=stored_span_bytes(fmt, values),
        ROW_BYTES=stored_row_bytes(fmt, k),
        STEPS=k // (values * units),
        STEP_UNITS=units,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        AT_ROW=out_row is not None,
        num_warps=WARPS,
        num_stages=STAGES,
        **pdl.options(),
    )
    return out


def check_out(out: torch.Tensor, m: int, n: int, out_row, residual, bias) -> None:
    """Raise unless `out`, `residual` and `bias` fit a prefill product's (m, n) result and `store_tile`'s
    epilogue (with `out_row` the rows land in a table, whatever its shape)."""
    if out.dim() != 2 or out.stride(1) != 1 or out.dtype not in DEQUANT_OUT:
        raise ValueError("out must be a 2-D f32 or f16 tensor with unit column stride")
    if out_row is None and tuple(out.shape) != (m, n):
        raise ValueError(f"out must be ({m}, {n}), got {tuple(out.shape)}")
    if residual is not None and (tuple(residual.shape) != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be ({m}, {n}) with unit column stride")
    if bias is not None and (bias.dim() != 1 or bias.numel() != n or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous ({n},) tensor")
