"""The halves of the latent's expansion over the cached rows, on the tensor cores: each cached latent row (the
first `a` values of a cache row, already normed, in the cache's precision) times each head's half of the
expansion, for the expanded form of a wide chunk's latent attention (`Mla`).

The value half (`attn_v_b`, (h, vdim, kv_lora)) stores a head as `b` checkpoint rows of `a` values (the outputs'
rows: `rows_out`); the key half (`attn_k_b`, (h, kv_lora, nope)) as `a` checkpoint rows of `b` values (the
inputs' rows). A program takes BLOCK_M cached rows and BLOCK_N of one head's outputs and walks the latent in
steps, decoding the step's units of the checkpoint's bytes to f32 in registers (`gemv.epilogue.unit_values`: the
f32 of `fuselane.gguf.dequant`, bit for bit; F16/F32 rows read as floats), rounding them and the latents to f16,
and multiplying them on the tensor cores (`tl.dot`, f32 sums): the numbers of multiplying a dequantized f16 copy
of the half. Only the rows up to the chunk's last (pos[0] + rows - 1, read on the device, so a captured graph
replays at any position) are expanded; the programs past them return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes, stored_span_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.epilogue import decode_unit, unit_values
from fuselane.lanes.cuda.triton.gemv.formats import SLOTS
from fuselane.lanes.cuda.triton.gemv.layout import block_d
from fuselane.lanes.cuda.triton.gemv.rows import largest_pow2_dividing

# Cached rows a program expands: a warpgroup MMA's M.
BLOCK_M = 64
# The value half's checkpoint rows a program takes (its outputs), as the prefill GEMM's tile.
ROWS_BLOCK_N = 32
# The key half's checkpoint rows a step takes (its K), and the outputs a program takes at most (whole units).
KEY_BLOCK_K = 32
KEY_BLOCK_N = 64
# Values a step of the value half walks at most: four 32-value blocks (a K-quant's super-block is one step).
STEP_VALUES = 128
WARPS = 8
DOT_MIN = 16  # tl.dot's smallest side


@triton.jit
def _latents(x, x_pitch, m, end, k0, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K] f16: the latents k0.. of the cached rows m (zeros past the chunk's last row)."""
    k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(x + m.to(tl.int64)[:, None] * x_pitch + k[None, :], mask=(m < end)[:, None], other=0.0)
    return a.to(tl.float16)


@triton.jit
def _half_kernel(
    x, x_pitch, w, out, pos, rows,
    FMT: tl.constexpr, VALUES: tl.constexpr, NBYTES: tl.constexpr, ROW_BYTES: tl.constexpr,
    A: tl.constexpr, B: tl.constexpr, ROWS_OUT: tl.constexpr, UNITS: tl.constexpr, STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HEADS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    h = tl.program_id(2)
    m0 = tl.program_id(1) * BLOCK_M
    end = tl.load(pos) + rows  # the rows a chunk attends: up to its last row's position
    if m0 < end:
        m = m0 + tl.arange(0, BLOCK_M)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        units = tl.arange(0, UNITS)
        if ROWS_OUT:  # a head's B rows of A values: the outputs' rows; a step is UNITS units of each
            w_rows = w + (h * B + tl.minimum(n, B - 1)).to(tl.int64) * ROW_BYTES
            for s in range(STEPS):
                at = (s * UNITS + units)[None, :]
                blk = tl.reshape(w_rows[:, None] + at * NBYTES, [BLOCK_N * UNITS, 1])
                qd = tl.reshape(block_d(w_rows[:, None], at, FMT, ROW_BYTES), [BLOCK_N * UNITS, 1])
                b = tl.reshape(unit_values(blk, qd, FMT, VALUES), [BLOCK_N, UNITS * VALUES]).to(tl.float16)
                a = _latents(x, x_pitch, m, end, s * UNITS * VALUES, UNITS * VALUES)
                acc = tl.dot(a, tl.trans(b), acc)
        else:  # a head's A rows of B values: the inputs' rows; a step is BLOCK_K rows, UNITS units of each
            last = B // VALUES - 1
            u = tl.minimum(tl.program_id(0) * UNITS + units, last)  # units past the row read its last (dropped)
            for s in range(STEPS):
                k = s * BLOCK_K + tl.arange(0, BLOCK_K)
                w_rows = w + (h * A + k).to(tl.int64) * ROW_BYTES
                blk = tl.reshape(w_rows[:, None] + u[None, :] * NBYTES, [BLOCK_K * UNITS, 1])
                qd = tl.reshape(block_d(w_rows[:, None], u[None, :], FMT, ROW_BYTES), [BLOCK_K * UNITS, 1])
                b = tl.reshape(unit_values(blk, qd, FMT, VALUES), [BLOCK_K, BLOCK_N]).to(tl.float16)
                acc = tl.dot(_latents(x, x_pitch, m, end, s * BLOCK_K, BLOCK_K), b, acc)
        keep = (m < end)[:, None] & (n < B)[None, :]
        dst = out + m.to(tl.int64)[:, None] * (HEADS * B) + h * B + n[None, :]
        tl.store(dst, acc.to(out.dtype.element_ty), mask=keep)


def _pow2_at_most(n: int, most: int) -> int:
    p = 1
    while p * 2 <= min(n, most):
        p *= 2
    return p


def runs_in_tiles(fmt: Format, a: int, b: int, rows_out: bool) -> bool:
    """Whether `expand` takes a half: a format the device decodes, the latent whole 32-value blocks (a step's
    K at least tl.dot's), the outputs whole 16s, the checkpoint rows whole units of their format."""
    fmt = Format(fmt)
    row = a if rows_out else b
    return fmt in SLOTS and a % 32 == 0 and b % DOT_MIN == 0 and row % decode_unit(fmt, row) == 0 and (
        decode_unit(fmt, row) >= DOT_MIN)  # fmt: skip


def expand(
    x: torch.Tensor, w: torch.Tensor, fmt: Format, pos: torch.Tensor, out: torch.Tensor, *,
    heads: int, a: int, b: int, rows_out: bool, rows: int,
) -> torch.Tensor:  # fmt: skip
    """out (len, heads * b): each cached row's first `a` values (`x`, (len, >= a), rows at any pitch, f16 or
    f32) times each head's half, for the rows 0..pos[0] + rows - 1 (the others untouched). `w` the half's
    bytes in `fmt`: a head's `b` rows of `a` values where `rows_out`, else its `a` rows of `b` values; `out`
    f16 or f32, contiguous. Returns `out`."""
    fmt = Format(fmt)
    if not runs_in_tiles(fmt, a, b, rows_out):
        raise ValueError(f"no tiled expansion for {fmt.name} halves of {a} -> {b} values")
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < a or not out.is_contiguous():
        raise ValueError("expand: x (len, >= a) of unit-stride rows, out contiguous")
    length = x.shape[0]
    if out.numel() != length * heads * b:
        raise ValueError(f"out must hold ({length}, {heads * b}) values")
    row = a if rows_out else b
    values = decode_unit(fmt, row)
    if rows_out:
        units = largest_pow2_dividing(a // values, max(1, STEP_VALUES // values))
        block_n, block_k, steps = ROWS_BLOCK_N, units * values, a // (units * values)
    else:
        units = _pow2_at_most(b // values, max(1, KEY_BLOCK_N // values))
        block_n, block_k, steps = units * values, KEY_BLOCK_K, a // KEY_BLOCK_K
    grid = (triton.cdiv(b, block_n), triton.cdiv(length, BLOCK_M), heads)
    _half_kernel[grid](
        x, x.stride(0), w, out, pos, rows,
        FMT=int(fmt), VALUES=values, NBYTES=stored_span_bytes(fmt, values), ROW_BYTES=stored_row_bytes(fmt, row),
        A=a, B=b,
        ROWS_OUT=rows_out, UNITS=units, STEPS=steps, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        HEADS=heads, num_warps=WARPS, **pdl.options(),
    )  # fmt: skip
    return out
