"""Prefill products on the int8 tensor cores from the checkpoint's bytes: y (m, n) = x (m, k) @ W^T.

x is the activation in the decode step's int8 form (`quant.Q8Acts`: int8 codes under one f32 scale a 32-value
block, and each 16 values' scaled code sums), W the n x k checkpoint rows as stored. A program takes BLOCK_M
activation rows and BLOCK_N weight rows and computes the transposed tile, weight rows down (the MMA's rows),
activation rows across. Its K loop is flat: one trip a 32-value run of the row (k / 32 trips), the run's
block (r // runs a block) and its index in the block (r % runs: 0-7 in a K format's super-block) values of the
loop, so the body is one run's work whatever the format, and only one run's codes are live. A trip

- loads the activation's int8 tile [BLOCK_M, 32] of the run, its block scales and (formats with a minimum)
  its two 16-value code sums, and the weight rows' bytes of the run (codes, and the scales and minimums of
  its block: `gemm_q8_runs.run`, one small body a format taking the run's index as a value),
- unpacks the rows' codes to int8 in registers with the run's f32 scale and offset,
- multiplies codes by codes on the int8 tensor cores (`tl.dot` [BLOCK_N, 32] x [32, BLOCK_M], int32 sums:
  exact; the codes are the register operand of Hopper's wgmma, the activation the shared-memory one),
- turns the int32 sums to f32 exactly without a convert (|sum| < 2^22: added to the bits of 1.5 * 2^23 and
  the float 1.5 * 2^23 taken off), and scales in f32: acc += dot * (w_scale * x_scale) + w_offset * x_sum,
  where x_sum (`Q8Acts.s`) carries a format's minimum. Q2_K's, Q3_K's and Q6_K's 16-value sub-blocks take
  two MMAs a run, each with the other half of the codes zeroed.

The loop is a `tl.range` with `num_stages`: Triton's pipeliner issues the next stages' loads as asynchronous
copies into shared memory while the current run multiplies. A load is staged only if a thread's part of it is
4 bytes or more, so every weight byte is read in 32-bit words (`gemm_q8_runs`): the blocks that are whole
words directly (and IQ4_XS's header, two words after its row), the 2-aligned ones (Q5_0, Q3_K, and the split
formats' d: Q6_K's, Q8_0's, Q4_0's, IQ4_NL's) from the word boundary at or below (a run's bytes rebuilt from two
words where it starts mid-word). What stays in the trip is the IQ4 formats' 16-value table lookup (32 byte loads
a thread a run, L1-resident). Weight rows are the MMA's rows because a run's per-row scales are then a few values
a thread (four at 128 rows and 4 warps); as its columns each thread would hold a quarter of them and compute
every scale 32 times over.

So the numbers are the exact product of the dequantized activation and the dequantized weights, up to the f32
roundings of the scaling and the sums; nothing is rounded to f16, so no activation overflows (an int8 code
and an f32 scale hold any finite f32), and no copy of the weights is made: a model's memory is its file, its
KV cache and the activations' int8 forms.

Rows past m or n read the last row (no masked loads in the loop); the store drops them. The epilogue adds a
bias and a residual and lands the rows at row pos[0] of a table where asked (a cache row write). Tiles come
from `plan.gemm_tiles` (one table, to tune on the GPU with `benchmarks/gemm_q8_sweep.py`;
`benchmarks/gemm_q8_registers.py` compiles a tile for sm_90 and tells its registers and spills without one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import IQ4_NL_VALUES, QK, Format
from fuselane.lanes.cuda.plan import gemm_tiles
from fuselane.lanes.cuda.plan.gemm_tiles import GemmTile
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes, stored_span_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemm import check_out, store_tile
from fuselane.lanes.cuda.triton.gemm_q8_runs import run
from fuselane.lanes.cuda.triton.gemv.layout import block_d
from fuselane.lanes.cuda.triton.gemv.parts import check_rows
from fuselane.lanes.cuda.triton.quant import HALF, Q8Acts, check_acts

QB = tl.constexpr(QK)
HALF_C = tl.constexpr(HALF)
# int32 -> f32 without a convert: adding an integer |v| < 2^22 to the bits of 1.5 * 2^23 gives the bits of the
# float 1.5 * 2^23 + v (one step a unit in [2^23, 2^24)), and subtracting 1.5 * 2^23 leaves v exactly.
F32_MAGIC_BITS = tl.constexpr(0x4B400000)
F32_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _exact_f32(v):
    """An int32 tile of |v| < 2^22 (a run's dot: 32 products of two int8, at most 2^19) as f32, exactly, in
    an integer add and a float subtract: an int-to-float convert issues at a quarter of their rate or less."""
    return (v + F32_MAGIC_BITS).to(tl.float32, bitcast=True) - F32_MAGIC


@triton.jit
def _run_product(acc, codes, xt, ad, s0, s1, SPLIT: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + the run's product: the weights' int8 codes (the MMA's A, [BLOCK_N, 32]) times
    the activation's (B, [32, BLOCK_M]), an exact int32 dot, times the weights' and the activation's scales. A
    split run (two scales of 16 values) takes two dots, each with the other half's codes zeroed."""
    if SPLIT:
        low = (tl.arange(0, QB) < HALF_C)[None, :]
        lo = _exact_f32(tl.dot(tl.where(low, codes, 0).to(tl.int8), xt, out_dtype=tl.int32))
        hi = _exact_f32(tl.dot(tl.where(low, 0, codes).to(tl.int8), xt, out_dtype=tl.int32))
        acc += (lo * s0[:, None] + hi * s1[:, None]) * ad[None, :]
    else:
        acc += _exact_f32(tl.dot(codes, xt, out_dtype=tl.int32)) * (s0[:, None] * ad[None, :])
    return acc


@triton.jit
def _gemm_q8_kernel(
    xq, xd, xs, w, lut, out, bias, res, pos, m, n, out_pitch, res_pitch,
    FMT: tl.constexpr, K: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    RUNS: tl.constexpr, SPLIT: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, AT_ROW: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    xm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    w_rows = tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES  # each row's byte offset in the matrix
    xr = tl.minimum(xm, m - 1).to(tl.int64)
    xq_rows = xq + xr * K
    xd_rows = xd + xr * (K // QB)
    xs_rows = xs + xr * (K // HALF_C)
    cols = tl.arange(0, QB)
    # the transposed product, weight rows down: their scales (computed a run) are then the MMA's rows, a few
    # to a thread, where as its columns each thread would hold and compute a quarter of them
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # one 32-value run a trip, the run's index in its block a value of the loop (so one body, no unrolled
    # super-block): the pipeliner issues the next STAGES - 1 runs' loads while this one multiplies
    for r in tl.range(0, K // QB, num_stages=STAGES):
        xt = tl.trans(tl.load(xq_rows[:, None] + r * QB + cols[None, :]))  # [32, BLOCK_M] int8
        ad = tl.load(xd_rows + r)  # [BLOCK_M] f32
        # the run in its block as an int32 scalar in the interpreter too (where r is a Python int, which the
        # formats' constexpr operands do not all take on the right of an operator)
        j = tl.zeros([], tl.int32) + r % RUNS
        unit = r // RUNS
        codes, s0, s1, m0, m1 = run(w, w_rows + unit * BLOCK_BYTES, block_d(w_rows, unit, FMT, ROW_BYTES), j, FMT, lut)
        acc = _run_product(acc, codes, xt, ad, s0, s1, SPLIT)
        if HAS_MIN:
            # a format's minimum: the run's scaled code sums (one a 16 values) times the offset
            sum0 = tl.load(xs_rows + 2 * r)
            sum1 = tl.load(xs_rows + 2 * r + 1)
            if SPLIT:
                acc += m0[:, None] * sum0[None, :] + m1[:, None] * sum1[None, :]
            else:
                acc += m0[:, None] * (sum0 + sum1)[None, :]
    store_tile(tl.trans(acc), xm, rows, m, n, bias, res, res_pitch, out, out_pitch, pos, HAS_BIAS, HAS_RES, AT_ROW)


_LUTS: dict[torch.device, torch.Tensor] = {}


def _lut(device: torch.device) -> torch.Tensor:
    """The IQ4 formats' 16 code values on `device` (made once a device)."""
    if device not in _LUTS:
        _LUTS[device] = torch.tensor(IQ4_NL_VALUES, dtype=torch.int8, device=device)
    return _LUTS[device]


def supports(fmt: Format, m: int, k: int) -> bool:
    """Whether `gemm_q8` takes a product of m rows of k values in `fmt` (`plan.gemm_tiles.int8_gemm`)."""
    return gemm_tiles.int8_gemm(Format(fmt), m, k)


def gemm_q8(
    x: Q8Acts,
    w: torch.Tensor,
    fmt: Format,
    n: int,
    k: int,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_row: tuple[torch.Tensor, int] | None = None,
    tile: GemmTile | None = None,
) -> torch.Tensor:
    """out (m, n) = x (m, k) @ W^T (+ bias) (+ residual), x an activation's int8 form (m rows of k), W the n x k
    checkpoint rows `w` in `fmt`, on the int8 tensor cores with f32 scaling; returns `out`.

    `residual` (m, n) may be `out`. With `out_row` = (pos, pitch) the rows land from row pos[0] of the table
    `out` (`pitch` values apart), the position read on the device. `tile` overrides the format's tile of
    `plan.gemm_tiles` (tests reach several tiles with small ones; the GPU is tuned through the table).
    """
    fmt = Format(fmt)
    m = x.q.shape[0]
    if not supports(fmt, m, k):
        raise ValueError(f"no int8 GEMM for {m} rows of {fmt.name} rows of {k} values")
    check_rows(w, fmt, n, k)
    check_acts(x, k, m)
    check_out(out, m, n, out_row, residual, bias)
    pos, pitch = out_row if out_row is not None else (x.d, out.stride(0))
    t = tile or gemm_tiles.tile(fmt)
    values = gemm_tiles.block_values(fmt)
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))
    _gemm_q8_kernel[grid](
        x.q, x.d, x.s, w, _lut(w.device), out,
        x.d if bias is None else bias,
        x.d if residual is None else residual,
        pos, m, n, pitch,
        out.stride(0) if residual is None else residual.stride(0),
        FMT=int(fmt), K=k, ROW_BYTES=stored_row_bytes(fmt, k), BLOCK_BYTES=stored_span_bytes(fmt, values),
        RUNS=values // QK, SPLIT=fmt in gemm_tiles.SPLIT_FORMATS, HAS_MIN=fmt in gemm_tiles.MIN_FORMATS,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, STAGES=t.stages,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, AT_ROW=out_row is not None,
        num_warps=t.warps, num_stages=t.stages, **pdl.options(),
    )  # fmt: skip
    return out
