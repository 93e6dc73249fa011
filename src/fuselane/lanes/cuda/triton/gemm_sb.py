"""Prefill products on the f16 tensor cores from the checkpoint's K-quant bytes, one super-block a step:
y (m, n) = x (m, k) @ W^T for Q4_K and Q6_K rows (`prefill=in-place`; other formats keep `gemm.gemm`).

Why a step is a whole super-block (256 values). A K-quant weight is d * (sc * q) - dmin * mn: d and dmin are
f16 scales of the super-block, sc and mn small integers of a sub-block (32 values for Q4_K, 16 for Q6_K), q
the code. `gemm.gemm` decodes every weight to its f32 value, then rounds it to f16, and every program
takes its f32 activation tile's largest value and rounds the tile to f16 again each step: its instructions
issue for ~10-17x the time of its MMA (docs/cuda-lane.md counts them). `gemm_q8` keeps the codes integer, but
scales its [BLOCK_N, BLOCK_M] f32 accumulator every 32 values (int32 to f32, the product of two scales, an add:
4-5 instructions an output a 32-value run), ~15x its int8 MMA's time. Here:

- the weights are decoded to f16 with their integer sub-scale folded in: Q4_K's sc * q (0..63 x 0..15 <= 945)
  is an integer f16 holds exactly; Q6_K's sc * (q - 32) (up to 128 x 32) is rounded to f16 once, as an f16 copy
  rounds its weights. A code becomes an f16 without a convert: its bits or'ed under those of 1024.0 (0x6400)
  are the f16 1024 + q, and 1024 taken off leaves q exactly (integer operations, one f16 subtract, one multiply);
- the activation comes in f16 already (one launch a product before the GEMM: the default path's operand, rows
  past 2^14 under a power-of-two scale that the epilogue multiplies back; for Q4_K with its sub-block sums,
  `f16_sums`), so no program converts it and its tile goes to shared memory for the MMA as loaded;
- one MMA a super-block (K = 256, f32 sums), and its f32 result times the row's d: one FMA an output element a
  256 values;
- Q4_K's minimum, dmin * sum_j mn_j * (the sum of the activation over sub-block j), is a second, K = 16 MMA a
  super-block: the eight sub-block sums / 32 as f16 heads and tails (head + tail holds a sum within ~2^-22,
  `f16_sums`) times the integer minima twice over, f32 sums; its result times 32 * dmin is one more FMA an
  output element.

So the product is that of the f16-rounded activation and the checkpoint's weights with d and dmin applied in
f32 (Q4_K: no weight is rounded at all; Q6_K: sc * (q - 32) once to f16, relative 2^-11), up to f32 sums.

A program takes BLOCK_M activation rows by BLOCK_N weight rows (`weight_rows`) and computes the transposed
tile, weight rows down: the decoded weights are the MMA's register operand, the activation tile its
shared-memory one (asynchronous copies, STAGES deep), and a step decodes its super-block in two halves of 128
values so that one half is live at a time. Rows past m or n read the last row (no masked
loads in the loop) and the store drops them. The epilogue (`gemm.store_tile`) adds a bias and a residual and
lands the rows at row pos[0] of a table where asked (a cache row write).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import QK, Format
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes, stored_span_bytes
from fuselane.lanes.cuda.plan.knobs import H200
from fuselane.lanes.cuda.triton import f16_scale, pdl
from fuselane.lanes.cuda.triton.f16_sums import HEAD_TAIL, f16_sums
from fuselane.lanes.cuda.triton.gemm import check_out, store_tile
from fuselane.lanes.cuda.triton.gemv.layout import q6_k_d
from fuselane.lanes.cuda.triton.gemv.parts import check_rows

SUPER = 256  # values a super-block: a step's K
FORMATS = (Format.Q4_K, Format.Q6_K)
Q4_K = tl.constexpr(int(Format.Q4_K))
SB = tl.constexpr(SUPER)
HALF_SB = tl.constexpr(SUPER // 2)
# Q4_K's super-block (144 bytes): d (f16), dmin (f16), 12 bytes of 6-bit sub-scales and minima, 128 of codes.
Q4K_DMIN = tl.constexpr(2)
Q4K_SCALES = tl.constexpr(4)
Q4K_CODES = tl.constexpr(16)
# Q6_K's (208 bytes as the device keeps it, `run/stored.py`): 128 bytes of low nibbles, 64 of high bit pairs, 16
# int8 sub-scales; d (f16) after the row's blocks (`layout.q6_k_d`).
Q6K_HIGH = tl.constexpr(128)
Q6K_SCALES = tl.constexpr(192)
F16_ONE_K_BITS = tl.constexpr(0x6400)  # the f16 1024.0: a code < 1024 or'ed into its mantissa reads 1024 + q
ONE_K = tl.constexpr(1024.0)
Q6K_ZERO = tl.constexpr(1024.0 + 32.0)  # 1024 and Q6_K's code bias, taken off in one exact subtract
SUB = tl.constexpr(QK)  # Q4_K's sub-block: the values a minimum covers
SUB_SHIFT = tl.constexpr(float(QK))  # the activation's sub-block sums are stored / 32 (`f16_sums`)
MIN_K = tl.constexpr(SUPER // QK * HEAD_TAIL)  # the minimum MMA's K: a super-block's 8 sums, head and tail

# The tile (activation rows x weight rows) and its warps; each step's loads issued STAGES - 1 steps ahead. At
# 8 warps, 2 stages, sm_90: 128 x 128 takes 255 (Q4_K) / 241 (Q6_K) registers, 128 x 64 223 / 218, no spills;
# 256 activation rows spill (benchmarks/gemm_sb_registers.py).
BLOCK_M = 128
BLOCK_N = 128
NARROW_N = 64  # the weight rows a program where BLOCK_N's grid leaves SMs idle
WARPS = 8
STAGES = 2


@triton.jit
def _q4k_scale_min(sub, j):
    """Q4_K's 6-bit sub-scale and minimum of sub-block j (0..7) from the 12 bytes at `sub` (llama.cpp's
    get_scale_min_k4): j < 4 the low 6 bits of bytes j and j + 4; else 4 bits of byte j + 4 and the top 2 of
    bytes j - 4 and j."""
    low = j < 4
    b1 = tl.load(sub + tl.where(low, j, j + 4)).to(tl.int32)
    b2 = tl.load(sub + tl.where(low, j + 4, j - 4)).to(tl.int32)
    b3 = tl.load(sub + j).to(tl.int32)
    sc = tl.where(low, b1 & 63, (b1 & 15) | ((b2 >> 6) << 4))
    mn = tl.where(low, b2 & 63, (b1 >> 4) | ((b3 >> 6) << 4))
    return sc, mn


@triton.jit
def _code_f16(q):
    """An int32 code 0 <= q < 1024 as the f16 1024 + q, from its bits (no convert)."""
    return (q | F16_ONE_K_BITS).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _q4k_half(blk, part):
    """Half `part` (0, 1) of the super-block at byte pointers `blk` [BLOCK_N] of each row: sc * q
    [BLOCK_N, 128] f16 (exact). Value 64p + 32h + l is nibble h of code byte 32p + l, in sub-block j = 2p + h."""
    p = 2 * part + tl.arange(0, 2)[None, :, None, None]
    h = tl.arange(0, 2)[None, None, :, None]
    lane = tl.arange(0, SUB)[None, None, None, :]
    at = blk[:, None, None, None]
    byte = tl.load(at + Q4K_CODES + SUB * p + lane).to(tl.int32)  # [BLOCK_N, 2, 1, 32], each byte once
    sc, _ = _q4k_scale_min(at + Q4K_SCALES, 2 * p + h)  # [BLOCK_N, 2, 2, 1]
    w = (_code_f16((byte >> (4 * h)) & 15) - ONE_K) * sc.to(tl.float16)
    return tl.reshape(w, [blk.shape[0], HALF_SB])


@triton.jit
def _q4k_scales(blk):
    """The super-block's d and dmin [BLOCK_N] f32 and its minima twice over [BLOCK_N, 16] f16 (column 2j + t:
    mn_j), the minimum MMA's operand, read straight into its shape (a join and reshape before the MMA is a
    shared layout Triton 3.6 cannot lower)."""
    d = tl.load(blk.to(tl.pointer_type(tl.float16))).to(tl.float32)
    dmin = tl.load((blk + Q4K_DMIN).to(tl.pointer_type(tl.float16))).to(tl.float32)
    _, mn = _q4k_scale_min(blk[:, None] + Q4K_SCALES, tl.arange(0, MIN_K)[None, :] // 2)
    return d, dmin, mn.to(tl.float16)


@triton.jit
def _q6k_half(blk, part):
    """Half `part` of the super-block at `blk` [BLOCK_N]: sc * (q - 32) [BLOCK_N, 128] rounded to f16 once.
    Value 128 part + 32g + 16t + l takes the nibble g >> 1 of low byte 64 part + 32(g & 1) + 16t + l, the bit
    pair g of high byte 32 part + 16t + l and sub-scale 8 part + 2g + t."""
    g = tl.arange(0, 4)[None, :, None, None]
    t = tl.arange(0, 2)[None, None, :, None]
    lane = tl.arange(0, 16)[None, None, None, :]
    at = blk[:, None, None, None]
    lo = tl.load(at + 64 * part + 32 * (g & 1) + 16 * t + lane).to(tl.int32)  # [BLOCK_N, 4, 2, 16]
    hi = tl.load(at + Q6K_HIGH + 32 * part + 16 * t + lane).to(tl.int32)
    q = ((lo >> (4 * (g >> 1))) & 15) | (((hi >> (2 * g)) & 3) << 4)
    sc = tl.load((at + Q6K_SCALES + 8 * part + 2 * g + t).to(tl.pointer_type(tl.int8))).to(tl.float16)
    w = (_code_f16(q) - Q6K_ZERO) * sc
    return tl.reshape(w, [blk.shape[0], HALF_SB])


@triton.jit
def _super_block(acc, x_at, blk, FMT: tl.constexpr):
    """The super-block's product without its d: the two halves' MMAs (K = 128 each, so one half's decoded
    weights are live at a time) into one fresh f32 tile [BLOCK_N, BLOCK_M]."""
    cols = tl.arange(0, HALF_SB)
    part = tl.zeros_like(acc)
    for half in tl.static_range(2):
        a = tl.load(x_at[:, None] + half * HALF_SB + cols[None, :])  # [BLOCK_M, 128] f16
        if FMT == Q4_K:
            wt = _q4k_half(blk, half)
        else:
            wt = _q6k_half(blk, half)
        part = tl.dot(wt, tl.trans(a), part)
    return part


@triton.jit
def _gemm_sb_kernel(
    x, scales, sums, w, out, bias, res, pos, m, n, x_pitch, sums_pitch, out_pitch, res_pitch,
    FMT: tl.constexpr, SB_BYTES: tl.constexpr, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, AT_ROW: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    xm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    w_rows = w + tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    x_rows = x + tl.minimum(xm, m - 1).to(tl.int64) * x_pitch
    sum_rows = sums + tl.minimum(xm, m - 1).to(tl.int64) * sums_pitch
    halves = tl.arange(0, MIN_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # transposed: the decoded weights are the MMA's register A
    for s in tl.range(0, STEPS, num_stages=STAGES):
        blk = w_rows + s * SB_BYTES
        part = _super_block(acc, x_rows + s * SB, blk, FMT)
        if FMT == Q4_K:
            d, dmin, mn = _q4k_scales(blk)
            # sum_j mn_j * (sub-block j's activation sum / 32): the minima twice over by heads and tails
            xa = tl.load(sum_rows[:, None] + s * MIN_K + halves[None, :])  # [BLOCK_M, 16] f16
            acc += part * d[:, None] - tl.dot(mn, tl.trans(xa)) * (dmin * SUB_SHIFT)[:, None]
        else:
            d = tl.load(q6_k_d(w_rows, s, STEPS).to(tl.pointer_type(tl.float16))).to(tl.float32)
            acc += part * d[:, None]
    acc = tl.trans(acc) * tl.load(scales + tl.minimum(xm, m - 1))[:, None]  # each row's power-of-two scale back
    store_tile(acc, xm, rows, m, n, bias, res, res_pitch, out, out_pitch, pos, HAS_BIAS, HAS_RES, AT_ROW)


def supports(fmt: Format, k: int) -> bool:
    """Whether `product` takes rows of k values in `fmt`: Q4_K or Q6_K rows of whole super-blocks."""
    return Format(fmt) in FORMATS and k % SUPER == 0 and k > 0


def gemm_sb(
    x16: torch.Tensor,
    scales: torch.Tensor,
    sums: torch.Tensor | None,
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
    block_n: int | None = None,
    sms: int = H200.sms,
) -> torch.Tensor:
    """out (m, n) = (x16 (m, k) @ W^T) * scales[:, None] (+ bias) (+ residual), x16 an f16 activation and
    `scales` (m,) f32 its rows' powers of two, `sums` (m, k / 16) f16 its sub-block sums (`f16_sums.f16_sums`;
    Q4_K's minimum reads them, None for Q6_K), W the n x k checkpoint rows `w` in `fmt`;
    returns `out`. `out_row` = (pos, pitch) lands the rows from row pos[0] of the table `out`. `block_m` and
    `block_n` are the tile (`block_n` by default `weight_rows` on a chip of `sms` multiprocessors, the lane's
    `Chip`), parameters so tests reach several tiles."""
    fmt = Format(fmt)
    if not supports(fmt, k):
        raise ValueError(f"no super-block GEMM for {fmt.name} rows of {k} values")
    check_rows(w, fmt, n, k)
    m = x16.shape[0]
    if x16.dtype != torch.float16 or tuple(x16.shape) != (m, k) or x16.stride(1) != 1:
        raise ValueError(f"x16 must be an f16 (m, {k}) tensor with unit column stride")
    if scales.dtype != torch.float32 or scales.numel() != m or not scales.is_contiguous():
        raise ValueError(f"scales must be a contiguous f32 ({m},) tensor")
    if fmt is Format.Q4_K and (sums is None or tuple(sums.shape) != (m, k // QK * HEAD_TAIL) or sums.stride(1) != 1):
        raise ValueError(f"Q4_K takes the activation's sub-block sums, an f16 ({m}, {k // QK * HEAD_TAIL}) tensor")
    check_out(out, m, n, out_row, residual, bias)
    pos, pitch = out_row if out_row is not None else (scales, out.stride(0))
    block_n = block_n or weight_rows(m, n, sms)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _gemm_sb_kernel[grid](
        x16, scales, x16 if sums is None else sums, w, out,
        scales if bias is None else bias,
        scales if residual is None else residual,
        pos, m, n, x16.stride(0), 0 if sums is None else sums.stride(0), pitch,
        out.stride(0) if residual is None else residual.stride(0),
        FMT=int(fmt), SB_BYTES=stored_span_bytes(fmt, SUPER), ROW_BYTES=stored_row_bytes(fmt, k), STEPS=k // SUPER,
        BLOCK_M=block_m, BLOCK_N=block_n, STAGES=STAGES,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, AT_ROW=out_row is not None,
        num_warps=WARPS, num_stages=STAGES, **pdl.options(),
    )  # fmt: skip
    return out


def weight_rows(m: int, n: int, sms: int) -> int:
    """A program's weight rows: BLOCK_N where its grid fills the chip's `sms`, else NARROW_N. A program's time is
    its decode, which grows with its weight rows (each decoded once for BLOCK_M activation rows), so where the
    grid is under one program an SM (a 7B's q, k, v, o and down products at a 256-row chunk) twice the programs
    of half the rows finish in about half the time; where it fills the chip the wider tile reads each
    activation tile for twice the weight rows."""
    return BLOCK_N if triton.cdiv(n, BLOCK_N) * triton.cdiv(m, BLOCK_M) >= sms else NARROW_N


def product(x: torch.Tensor, w: torch.Tensor, fmt: Format, n: int, k: int, out: torch.Tensor, **epilogue: Any):
    """out (m, n) = x (m, k, f32 or f16) @ W^T with `gemm_sb`'s epilogue (bias, residual, out_row): x rounded to
    f16 under its rows' power-of-two scales (with Q4_K's sub-block sums: one launch), then the super-block
    GEMM; returns `out`."""
    m = x.shape[0]
    x16 = torch.empty((m, k), dtype=torch.float16, device=x.device)
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    sums = None
    if Format(fmt) is Format.Q4_K:
        sums = torch.empty((m, k // QK * HEAD_TAIL), dtype=torch.float16, device=x.device)
        f16_sums(x, x16, scales, sums)
    else:
        f16_scale.to_f16(x, x16, scales)
    return gemm_sb(x16, scales, sums, w, fmt, n, k, out, **epilogue)
