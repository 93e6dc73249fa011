"""Quantizing activation rows for the int8 GEMV (`gemv.q8`): f32 (m, k) -> int8 codes under one scale a
32-value block, plus each 16 values' scaled code sum.

The scheme is the lane's `activations=int8` contract (`numerics.contract.Scheme`: int8, one word a value,
the scale the block's largest |value| / 127): d = amax / 127, code = floor(x * (127 / amax) + 0.5) (an
all-zero block has d = 0 and codes 0). `quantize_reference` is the same arithmetic in NumPy, f32 step by
step, so the kernel's codes are checked bit for bit.

`quantize` is the launch a plan uses where a producer cannot quantize in its own epilogue; the epilogues
that can (the add + RMS norm's last program, the attention merge) call `quantize_block` on the values they
already hold.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import QK
from fuselane.lanes.cuda.triton import pdl

INT8_MAX = 127.0
INT8_MAX_C = tl.constexpr(INT8_MAX)
QB_C = tl.constexpr(QK)
HALF = 16  # values a sum covers: Q6_K's sub-blocks, and half a Q5_0 / Q8_0 block
BLOCKS_A_PROGRAM = 32  # 1024 values: a 4096-wide row is 4 programs
CODES_ALIGN = 16  # bytes the codes start at a multiple of: the int8 GEMV reads 16 codes in one 128-bit load


class Q8Acts(NamedTuple):
    """An activation row quantized for these kernels: codes, block scales, 16-value sums (see the module)."""

    q: Tensor  # int8 (m, k)
    d: Tensor  # f32 (m, k / 32)
    s: Tensor  # f32 (m, k / 16)


def check_acts(x: Q8Acts, k: int, m: int = 1) -> None:
    """A Q8Acts of m rows of k values, as the kernels read and write it."""
    q, d, s = x
    if q.dtype != torch.int8 or tuple(q.shape) != (m, k) or not q.is_contiguous():
        raise ValueError(f"the activation codes must be a contiguous int8 ({m}, {k}) tensor")
    if q.data_ptr() % CODES_ALIGN:
        raise ValueError(f"the activation codes must start {CODES_ALIGN}-byte aligned (`gemv.int8_words.ld4`)")
    for t, n in ((d, m * k // QK), (s, m * k // (QK // 2))):
        if t.dtype != torch.float32 or t.numel() != n or not t.is_contiguous():
            raise ValueError(f"the activation scales and sums must be contiguous f32 tensors of {n} values")
        if t.data_ptr() % CODES_ALIGN:  # a Q3_K / Q2_K group reads four blocks' scales in one 128-bit load
            raise ValueError(f"the activation scales and sums must start {CODES_ALIGN}-byte aligned")


@triton.jit
def quantize_block(v, QB: tl.constexpr):
    """v [B, 32] f32 -> (codes [B, 32] int8, scales [B] f32, sums [B, 2] f32: d * the codes of values 0-15
    and 16-31)."""
    amax = tl.max(tl.abs(v), 1)
    # IEEE divisions (div_rn), as NumPy's: Triton's `/` is the approximate one
    inv = tl.where(amax > 0.0, tl.math.div_rn(tl.full(amax.shape, INT8_MAX_C, tl.float32), amax), 0.0)
    codes = tl.floor(v * inv[:, None] + 0.5)
    d = tl.math.div_rn(amax, tl.full(amax.shape, INT8_MAX_C, tl.float32))
    halves = tl.sum(tl.reshape(codes, [v.shape[0], 2, QB // 2]), 2)
    return codes.to(tl.int8), d, halves * d[:, None]


@triton.jit
def store_quantized(v, first, n, oq, od, os_):
    """Quantize the values v [B * 32] that start at value `first` (a multiple of 32) of a row of n and store
    them as a Q8Acts' codes, scales and sums; blocks past n dropped."""
    B: tl.constexpr = v.shape[0] // QB_C
    codes, d, sums = quantize_block(tl.reshape(v, [B, QB_C]), QB_C)
    blk = first // QB_C + tl.arange(0, B)
    live = blk < n // QB_C
    tl.store(oq + blk[:, None] * QB_C + tl.arange(0, QB_C)[None, :], codes, mask=live[:, None])
    tl.store(od + blk, d, mask=live)
    tl.store(os_ + blk[:, None] * 2 + tl.arange(0, 2)[None, :], sums, mask=live[:, None])


@triton.jit
def store_quantized_rows(v, rows, m, first, k, oq, od, os_):
    """Quantize the tile v [R, B * 32] of rows `rows` [R] (those under m stored) of k-value rows, its values
    starting at value `first` (a multiple of 32) of each, and store them as a Q8Acts' codes, scales and sums."""
    R: tl.constexpr = v.shape[0]
    B: tl.constexpr = v.shape[1] // QB_C
    codes, d, sums = quantize_block(tl.reshape(v, [R * B, QB_C]), QB_C)
    row = tl.reshape(tl.broadcast_to(rows.to(tl.int64)[:, None], [R, B]), [R * B])
    blk = tl.reshape(tl.broadcast_to((first // QB_C + tl.arange(0, B))[None, :], [R, B]), [R * B])
    live = row < m
    at = row * (k // QB_C) + blk
    tl.store(oq + at[:, None] * QB_C + tl.arange(0, QB_C)[None, :], codes, mask=live[:, None])
    tl.store(od + at, d, mask=live)
    tl.store(os_ + at[:, None] * 2 + tl.arange(0, 2)[None, :], sums, mask=live[:, None])


@triton.jit
def _quantize_kernel(x, q, d, s, n_blocks, QB: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    row = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    live = blk < n_blocks
    off = blk[:, None] * QB + tl.arange(0, QB)[None, :]
    k = n_blocks * QB
    v = tl.load(x + row * k + off, mask=live[:, None], other=0.0).to(tl.float32)
    codes, scale, sums = quantize_block(v, QB)
    tl.store(q + row * k + off, codes, mask=live[:, None])
    tl.store(d + row * n_blocks + blk, scale, mask=live)
    two = tl.arange(0, 2)[None, :]
    tl.store(s + row * 2 * n_blocks + blk[:, None] * 2 + two, sums, mask=live[:, None])


def empty_q8(m: int, k: int, device) -> Q8Acts:
    """An uninitialized Q8Acts for m rows of k values (k whole 32-value blocks)."""
    if k % QK:
        raise ValueError(f"int8 activations take whole {QK}-value blocks, not {k} values")
    return Q8Acts(
        torch.empty((m, k), dtype=torch.int8, device=device),
        torch.empty((m, k // QK), dtype=torch.float32, device=device),
        torch.empty((m, k // HALF), dtype=torch.float32, device=device),
    )


def quantize(x: Tensor, out: Q8Acts) -> Q8Acts:
    """Quantize the f32 rows `x` (m, k) into `out` (one launch); returns `out`."""
    m, k = x.shape
    if not x.is_contiguous() or k % QK or tuple(out.q.shape) != (m, k):
        raise ValueError(f"x must be contiguous (m, k) with k whole {QK}-value blocks, matching out")
    n_blocks = k // QK
    grid = (triton.cdiv(n_blocks, BLOCKS_A_PROGRAM), m)
    _quantize_kernel[grid](x, out.q, out.d, out.s, n_blocks, QB=QK, BLOCKS=BLOCKS_A_PROGRAM, **pdl.options())
    return out


def dequantize(x: Q8Acts) -> Tensor:
    """The f32 values a Q8Acts stands for, (m, k): code times its block's scale."""
    m, k = x.q.shape
    return (x.q.view(m, k // QK, QK).float() * x.d.view(m, k // QK, 1)).view(m, k)


def quantize_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy's (codes, scales, sums) for f32 rows x (m, k), the kernel's arithmetic in f32."""
    m, k = x.shape
    v = x.astype(np.float32).reshape(m, k // QK, QK)
    amax = np.abs(v).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(INT8_MAX) / amax, np.float32(0)).astype(np.float32)
    codes = np.floor(v * inv[..., None] + np.float32(0.5)).astype(np.float32)
    d = (amax / np.float32(INT8_MAX)).astype(np.float32)
    sums = codes.reshape(m, k // QK, 2, QK // 2).sum(axis=3) * d[..., None]
    return codes.astype(np.int8).reshape(m, k), d, sums.reshape(m, k // HALF).astype(np.float32)
