"""The activation a super-block GEMM (`gemm_sb`) reads: the f16 rows `f16_scale.to_f16` makes (a row past 2^14
under the power of two that brings it under, that power beside it), and with them each 32-value sub-block's sum
of those f16 values, divided by 32, as an f16 head and an f16 tail.

Why here and not in the GEMM: Q4_K's minimum multiplies a sub-block's activation sum, and every program of the
GEMM over the same activation rows would sum the same values again (and hold its activation tile in registers to
do it, rather than leave it in shared memory for the MMA). One launch a product rounds the row, as `to_f16`
would, and sums it once.

The sums: at most 32 x 2^14 before the division by 32 (exact: a power of two), so they fit f16; the head is the
f16 rounding of the f32 sum, the tail the f16 rounding of what is left (exact in f32), so head + tail is the sum
within 2^-22 of it (a tail under f16's normals, 2^-14, within 2^-25). Stored [m, k / 16]: sub-block j's head at
column 2j, its tail at 2j + 1: the K = 16 operand of the GEMM's minimum MMA a super-block, as it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import QK
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.f16_scale import power_of_two, row_exponent

SUB = tl.constexpr(QK)
SUM_SHIFT = tl.constexpr(float(QK))  # the sums / 32 fit f16
HEAD_TAIL = 2  # f16 words a sub-block's sum takes
ROW_BLOCK = 1024  # values a step of a program (one row a program)
ROW_WARPS = 4


@triton.jit
def _round_and_sum(src, dst, sums, c0, scale, BLOCK: tl.constexpr):
    """Values c0 .. c0 + BLOCK of a row times `scale`, rounded to f16 into `dst`; their sub-blocks' sums / 32 as
    head and tail into `sums`."""
    cols = c0 + tl.arange(0, BLOCK)
    v = (tl.load(src + cols).to(tl.float32) * scale).to(tl.float16)
    tl.store(dst + cols, v)
    total = tl.sum(tl.reshape(v.to(tl.float32), [BLOCK // SUB, SUB]), axis=1) / SUM_SHIFT
    head = total.to(tl.float16)
    tail = (total - head.to(tl.float32)).to(tl.float16)
    at = c0 // SUB * 2 + tl.arange(0, 2 * (BLOCK // SUB))
    tl.store(sums + at, tl.reshape(tl.join(head, tail), [2 * (BLOCK // SUB)]))


@triton.jit
def _f16_sums_kernel(x, x_pitch, out, out_pitch, scales, sums, sums_pitch, K: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):  # fmt: skip
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    src, dst, srow = x + row * x_pitch, out + row * out_pitch, sums + row * sums_pitch
    amax = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, K, BLOCK):  # one pass rounds the row as it is (nearly every row) and finds its largest
        amax = tl.maximum(amax, tl.abs(tl.load(src + c0 + tl.arange(0, BLOCK)).to(tl.float32)))
        _round_and_sum(src, dst, srow, c0, 1.0, BLOCK)
    e = row_exponent(tl.max(amax, 0))
    if e > 0:  # a row past 2^14: written again, times 2^-e (exact), over what the first pass wrote
        tl.debug_barrier()
        for c0 in range(0, K, BLOCK):
            _round_and_sum(src, dst, srow, c0, power_of_two(-e), BLOCK)
    tl.store(scales + row, power_of_two(e))


def f16_sums(x: torch.Tensor, out: torch.Tensor, scales: torch.Tensor, sums: torch.Tensor) -> None:
    """out (m, k) f16 and scales (m,) f32 as `f16_scale.to_f16` makes them (bit for bit), and sums (m, k / 16)
    f16: each 32-value sub-block's sum of `out`'s values / 32, head then tail. x f32 or f16, unit column stride,
    k a multiple of 256."""
    m, k = x.shape
    block = min(ROW_BLOCK, k & -k)  # a power of two dividing k: no masks
    if x.dtype not in (torch.float32, torch.float16) or x.stride(1) != 1 or block < QK:
        raise ValueError(f"x must be an f32 or f16 (m, {k}) tensor with unit column stride, k a multiple of {QK}")
    if out.dtype != torch.float16 or tuple(out.shape) != (m, k) or out.stride(1) != 1:
        raise ValueError(f"out must be an f16 ({m}, {k}) tensor with unit column stride")
    if scales.dtype != torch.float32 or scales.numel() != m or not scales.is_contiguous():
        raise ValueError(f"scales must be a contiguous f32 ({m},) tensor")
    if sums.dtype != torch.float16 or tuple(sums.shape) != (m, k // QK * HEAD_TAIL) or sums.stride(1) != 1:
        raise ValueError(f"sums must be an f16 ({m}, {k // QK * HEAD_TAIL}) tensor with unit column stride")
    _f16_sums_kernel[(m,)](
        x, x.stride(0), out, out.stride(0), scales, sums, sums.stride(0), K=k, BLOCK=block,
        num_warps=ROW_WARPS, **pdl.options(),
    )  # fmt: skip
