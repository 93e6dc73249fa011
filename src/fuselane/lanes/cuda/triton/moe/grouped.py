"""A chunk's kept experts as a grouped GEMM on the tensor cores, from the checkpoint's bytes.

The routing launch (`route`) leaves the chunk's (row, slot) pairs sorted by expert, stably (`order`), and the
pairs each expert takes (`counts`). Each expert's run of the sorted pairs is cut into tiles of BLOCK_M pairs,
the last one partial; tile t of the chunk is found on the device from the counts (`_tile_of`), so nothing
returns to the host and the grid is a bound, not a count: `moe_kernels.moe_tiles_bound` tiles of pairs (a tile
past the chunk's ends at once) by the tiles of weight rows. The launches are thus captured as they are.

A program takes one tile of one expert's pairs by BLOCK_N rows of that expert's matrix (the 3-D tensor's
base + expert * an expert's bytes): it gathers the pairs' activation rows, decodes the weight rows to f16
(each value `fuselane.gguf.dequant`'s f32, rounded once: from 32-bit words for the formats `words` takes, a
step of half a super-block or four blocks; else unit by unit as the dense prefill GEMM does,
`gemv.epilogue.unit_values`), and multiplies on the tensor cores (`tl.dot`, f32 sums). An activation row
past f16's range is divided by a power of two first: with the routing launch's row scales (`route.RowScales`,
the lane's path) one a row for the whole product, so the k loop has no branch and Triton's pipeliner stages
its loads; without them a step's own, as `gemm` does.

- `gate_up_grouped` (MoeGateUpAct): both products of a tile, SiLU(gate) * up in the epilogue, stored at each
  pair's row of the output (the layout the down products read).
- `down_grouped` (MoeDownCombine, MoeDeferredFinalize): the product times the pair's route weight, stored at
  the pair's row of a (pairs, d) scratch; then the weighted combine (`grouped_combine`), in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import QK_K, Format
from fuselane.lanes.cuda.plan import kernels, moe_kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes, stored_span_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemm import F16_SAFE, step_units, supports
from fuselane.lanes.cuda.triton.gemv.epilogue import decode_unit, unit_values
from fuselane.lanes.cuda.triton.gemv.layout import block_d
from fuselane.lanes.cuda.triton.gemv.parts import check_rows
from fuselane.lanes.cuda.triton.grid.values import device_table, grid_tile
from fuselane.lanes.cuda.triton.moe import words
from fuselane.lanes.cuda.triton.moe.grouped_combine import Combine, combine_args, combine_rows, counters_for
from fuselane.lanes.cuda.triton.moe.route import RowScales, f16_row_scale
from fuselane.lanes.cuda.triton.moe.words import word_tile

# The word decode reads the weights as 32-bit words: their bytes must start 4-aligned.
WORD_ALIGN = 4
GATE_UP, DOWN = moe_kernels.MoeLaunch.GATE_UP, moe_kernels.MoeLaunch.DOWN


@triton.jit
def _tile_of(counts, t, E: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile `t` of the chunk: its expert, its first place in the sorted pairs, and its pairs (0: past the end)."""
    ex = tl.arange(0, E_BLOCK)
    c = tl.load(counts + ex, mask=ex < E, other=0)
    tiles = (c + BLOCK_M - 1) // BLOCK_M
    end = tl.cumsum(tiles, 0)
    mine = (t >= end - tiles) & (t < end)
    e = tl.sum(tl.where(mine, ex, 0), 0)
    j = t - tl.sum(tl.where(mine, end - tiles, 0), 0)  # the tile's place among its expert's
    start = tl.sum(tl.where(mine, tl.cumsum(c, 0) - c, 0), 0) + j * BLOCK_M
    left = tl.sum(tl.where(mine, c, 0), 0) - j * BLOCK_M
    return e, start, tl.where(tl.sum(mine.to(tl.int32), 0) > 0, tl.minimum(left, BLOCK_M), 0)


@triton.jit
def _f16_rows(a):
    """a (BLOCK_M, values) f32 as the f16 operand: each row past F16_SAFE divided by the power of two that brings
    it under (exact; the others by 1), with those divisors and whether any row took one. Rounded once, here,
    so the f32 tile is not kept for the products."""
    amax = tl.max(tl.abs(a), 1)
    scale = tl.where(amax > F16_SAFE, tl.exp2(tl.ceil(tl.log2(amax / F16_SAFE))), 1.0)
    return (a * (1.0 / scale)[:, None]).to(tl.float16), scale, tl.max(amax) > F16_SAFE


@triton.jit
def _mma(a16, scale, big, b, acc):
    """acc + a16 @ b^T on the tensor cores (f32 sums), the rows' divisors multiplied back where any row took one."""
    if big:
        acc += tl.dot(a16, tl.trans(b)) * scale[:, None]
    else:
        acc = tl.dot(a16, tl.trans(b), acc)
    return acc


@triton.jit
def _weights(w_rows, u0, FMT: tl.constexpr, VALUES: tl.constexpr, NBYTES: tl.constexpr, ROW_BYTES: tl.constexpr,
             STEP_UNITS: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """[BLOCK_N, STEP_UNITS * VALUES] f16: a step's units of the tile's weight rows, decoded."""
    units = tl.arange(0, STEP_UNITS)
    blk = tl.reshape(w_rows[:, None] + (u0 + units)[None, :] * NBYTES, [BLOCK_N * STEP_UNITS, 1])
    qd = tl.reshape(block_d(w_rows[:, None], (u0 + units)[None, :], FMT, ROW_BYTES), [BLOCK_N * STEP_UNITS, 1])
    return tl.reshape(unit_values(blk, qd, FMT, VALUES), [BLOCK_N, STEP_UNITS * VALUES]).to(tl.float16)


@triton.jit
def _tile(w, off, s, table, FMT: tl.constexpr, VALUES: tl.constexpr, NBYTES: tl.constexpr, ROW_BYTES: tl.constexpr,
          STEP_UNITS: tl.constexpr, STEP_VALUES: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
          GRID: tl.constexpr):  # fmt: skip
    """[BLOCK_N, STEP_VALUES] f16: step s's weights of the rows at byte offsets `off` of `w`: a grid format's from
    its table (`grid.values.grid_tile`, half a super-block or a whole one a step), from words where the format
    has that decode (`words`: a super-block or its half a step), else unit by unit."""
    if GRID:
        first = s * STEP_VALUES
        b = grid_tile(w + off + first // VALUES * NBYTES, table, first % VALUES, FMT, BLOCK_N, STEP_VALUES)
        b = b.to(tl.float16)
    elif WORDS:
        first = s * STEP_VALUES
        unit = first // VALUES
        b = word_tile(w, off + unit * NBYTES, block_d(off, unit, FMT, ROW_BYTES), first % VALUES // STEP_VALUES, FMT,
                      BLOCK_N, STEP_VALUES)  # fmt: skip
    else:
        b = _weights(w + off, s * STEP_UNITS, FMT, VALUES, NBYTES, ROW_BYTES, STEP_UNITS, BLOCK_N)
    return b


@triton.jit
def _tile_pairs(order, counts, E: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's tile: its expert, its pairs (a pair past the tile's repeats its first), which are live."""
    e, start, live = _tile_of(counts, tl.program_id(1), E, E_BLOCK, BLOCK_M)
    i = tl.arange(0, BLOCK_M)
    pair = tl.load(order + start + tl.minimum(i, tl.maximum(live - 1, 0)), mask=live > 0, other=0)
    return e.to(tl.int64), pair, (i < live), live


@triton.jit
def gate_up_kernel(
    x, w_gate, w_up, table, order, counts, out, x_amax, x16, h_amax,
    N: tl.constexpr, KD: tl.constexpr, SLOTS: tl.constexpr, E: tl.constexpr, E_BLOCK: tl.constexpr,
    EXPERT_BYTES: tl.constexpr, FMT: tl.constexpr, VALUES: tl.constexpr, NBYTES: tl.constexpr,
    ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, STEP_UNITS: tl.constexpr, STEP_VALUES: tl.constexpr,
    WORDS: tl.constexpr, GRID: tl.constexpr, ROW_SCALES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)  # the order and counts (and the rows' largest values) are the routing launch's
    e, pair, live, n_live = _tile_pairs(order, counts, E, E_BLOCK, BLOCK_M)
    if n_live > 0:
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        off = e * EXPERT_BYTES + tl.minimum(rows, N - 1).to(tl.int64) * ROW_BYTES
        x_rows = x + (pair // SLOTS).to(tl.int64) * KD
        cols = tl.arange(0, STEP_VALUES)
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if ROW_SCALES:  # the rows the routing launch scaled and rounded: no branch in the loop, which is pipelined
            row_scale = f16_row_scale(tl.load(x_amax + pair // SLOTS))
            x16_rows = x16 + (pair // SLOTS).to(tl.int64) * KD
            for s in range(0, STEPS):
                a16 = tl.load(x16_rows[:, None] + s * STEP_VALUES + cols[None, :])
                wg = _tile(
                    w_gate, off, s, table, FMT, VALUES, NBYTES, ROW_BYTES, STEP_UNITS, STEP_VALUES, BLOCK_N, WORDS, GRID
                )
                gate = tl.dot(a16, tl.trans(wg), gate)
                wu = _tile(
                    w_up, off, s, table, FMT, VALUES, NBYTES, ROW_BYTES, STEP_UNITS, STEP_VALUES, BLOCK_N, WORDS, GRID
                )
                up = tl.dot(a16, tl.trans(wu), up)
            gate *= row_scale[:, None]
            up *= row_scale[:, None]
        else:
            for s in range(0, STEPS):
                a16, scale, big = _f16_rows(tl.load(x_rows[:, None] + s * STEP_VALUES + cols[None, :]))
                wg = _tile(
                    w_gate, off, s, table, FMT, VALUES, NBYTES, ROW_BYTES, STEP_UNITS, STEP_VALUES, BLOCK_N, WORDS, GRID
                )
                gate = _mma(a16, scale, big, wg, gate)
                wu = _tile(
                    w_up, off, s, table, FMT, VALUES, NBYTES, ROW_BYTES, STEP_UNITS, STEP_VALUES, BLOCK_N, WORDS, GRID
                )
                up = _mma(a16, scale, big, wu, up)
        h = gate / (1.0 + tl.exp(-gate)) * up
        keep = live[:, None] & (rows < N)[None, :]
        dst = out + pair.to(tl.int64)[:, None] * N + rows[None, :]
        tl.store(dst, h, mask=keep)
        if ROW_SCALES:  # each pair's largest |h| for the down launch's scale: non-negative floats order as bits
            top = tl.max(tl.where(keep, tl.abs(h), 0.0), 1).to(tl.int32, bitcast=True)
            tl.atomic_max(h_amax + pair, top, mask=live, sem="relaxed", scope="gpu")


@triton.jit
def down_kernel(
    h, w, table, order, counts, weights, h_amax, pair_out, a0, a1, sum_out, norm_w, normed, counters, eps,
    D: tl.constexpr, DFF: tl.constexpr, SLOTS: tl.constexpr, E: tl.constexpr, E_BLOCK: tl.constexpr,
    EXPERT_BYTES: tl.constexpr, FMT: tl.constexpr, VALUES: tl.constexpr, NBYTES: tl.constexpr,
    ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, STEP_UNITS: tl.constexpr, STEP_VALUES: tl.constexpr,
    WORDS: tl.constexpr, GRID: tl.constexpr, ADDS: tl.constexpr,
    NORM: tl.constexpr, NORM_CHUNK: tl.constexpr, ROWS: tl.constexpr, ROW_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    e, pair, live, n_live = _tile_pairs(order, counts, E, E_BLOCK, BLOCK_M)
    if n_live > 0:
        cols_d = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        off = e * EXPERT_BYTES + tl.minimum(cols_d, D - 1).to(tl.int64) * ROW_BYTES
        h_rows = h + pair.to(tl.int64) * DFF
        vals = tl.arange(0, STEP_VALUES)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if ROW_SCALES:  # the gate/up launch's largest |h| a pair: one scale a row, no branch in the loop
            row_scale = f16_row_scale(tl.load(h_amax + pair).to(tl.float32, bitcast=True))
            inv = (1.0 / row_scale)[:, None]
            for s in range(0, STEPS):
                a16 = (tl.load(h_rows[:, None] + s * STEP_VALUES + vals[None, :]) * inv).to(tl.float16)
                wt = _tile(
                    w, off, s, table, FMT, VALUES, NBYTES, ROW_BYTES, STEP_UNITS, STEP_VALUES, BLOCK_N, WORDS, GRID
                )
                acc = tl.dot(a16, tl.trans(wt), acc)
            acc *= row_scale[:, None]
        else:
            for s in range(0, STEPS):
                a16, scale, big = _f16_rows(tl.load(h_rows[:, None] + s * STEP_VALUES + vals[None, :]))
                wt = _tile(
                    w, off, s, table, FMT, VALUES, NBYTES, ROW_BYTES, STEP_UNITS, STEP_VALUES, BLOCK_N, WORDS, GRID
                )
                acc = _mma(a16, scale, big, wt, acc)
        acc = acc * tl.load(weights + pair)[:, None]
        keep = live[:, None] & (cols_d < D)[None, :]
        tl.store(pair_out + pair.to(tl.int64)[:, None] * D + cols_d[None, :], acc, mask=keep)
        combine_rows(pair_out, a0, a1, sum_out, norm_w, normed, counters, eps, pair // SLOTS, live, cols_d,
                     D, SLOTS, ADDS, NORM, NORM_CHUNK, ROWS, BLOCK_M, BLOCK_N)  # fmt: skip


def down_width_tiles(fmt: Format, d: int, block_n: int | None = None, pairs_an_expert: float | None = None) -> int:
    """Tiles of the model's width a down launch of experts in `fmt` takes (its combine's counters a row): the
    table's BLOCK_N (`moe_kernels.moe_gemm_tile`, for `pairs_an_expert`) unless given."""
    return triton.cdiv(d, block_n or moe_kernels.moe_gemm_tile(fmt, DOWN, pairs_an_expert).block_n)


def takes(fmt: Format, n: int, k: int) -> bool:
    """Whether the grouped GEMM takes experts of (n, k) checkpoint rows in `fmt`: those the dense prefill GEMM
    takes (`gemm.supports`), and the grid formats' rows of whole super-blocks (decoded from their tables)."""
    fmt = Format(fmt)
    return n > 0 and (supports(fmt, k) or (fmt in kernels.GRID_GEMV_FORMATS and k > 0 and k % QK_K == 0))


def format_consts(fmt: Format, n: int, k: int, w: Tensor | None = None, word_step: int | None = None, *,
                  launch: moe_kernels.MoeLaunch) -> dict:  # fmt: skip
    """The kernels' constants for experts of (n, k) rows in `fmt` (the bytes `w`, where given) in `launch`: the
    decode's unit and step, an expert's bytes, and whether the weights are decoded from words (`words.takes`;
    their bytes 4-aligned, as a GGUF tensor's and a device allocation's are), `word_step` values a step (the
    table's, `moe_kernels.moe_gemm_tile`, where not given)."""
    values = decode_unit(fmt, k)
    if fmt in kernels.GRID_GEMV_FORMATS:  # a step is a slice of one super-block (`grid.values.grid_tile`)
        step = word_step or moe_kernels.moe_gemm_tile(fmt, launch).step
        return dict(FMT=int(fmt), VALUES=values, NBYTES=stored_span_bytes(fmt, values),
                    ROW_BYTES=stored_row_bytes(fmt, k), STEPS=k // step, STEP_UNITS=1, STEP_VALUES=step, WORDS=False,
                    GRID=True, EXPERT_BYTES=n * stored_row_bytes(fmt, k))  # fmt: skip
    units = step_units(fmt, k)
    # the word decode's steps are 128 or 256 values: a row of neither (a 32-value format's of 1,472 values)
    # takes the unit decode's steps
    word = words.takes(fmt) and (w is None or w.data_ptr() % WORD_ALIGN == 0) and k % min(words.STEPS) == 0
    step = (word_step or moe_kernels.moe_gemm_tile(fmt, launch).step) if word else values * units
    if k % step:  # a 32-value format's row of whole 128-value steps, not of 256 (DeepSeek-V2-Lite's 1,408)
        step = min(words.STEPS)
    return dict(FMT=int(fmt), VALUES=values, NBYTES=stored_span_bytes(fmt, values), ROW_BYTES=stored_row_bytes(fmt, k),
                STEPS=k // step, STEP_UNITS=units, STEP_VALUES=step, WORDS=word, GRID=False,
                EXPERT_BYTES=n * stored_row_bytes(fmt, k))  # fmt: skip


def _check(w: Tensor, fmt: Format, experts: int, n: int, k: int, order: Tensor, counts: Tensor) -> None:
    if not takes(fmt, n, k):
        raise ValueError(f"no grouped GEMM for {Format(fmt).name} experts of {k}-value rows")
    check_rows(w, fmt, experts * n, k)
    if order.dtype != torch.int32 or counts.dtype != torch.int32 or counts.numel() != experts:
        raise ValueError(f"order must be int32 pairs and counts int32 ({experts},)")


def _table(fmt: Format, w: Tensor) -> Tensor:
    """A grid format's table on the weights' device (`grid.values.device_table`, made once); the weights
    themselves, never read, for any other format."""
    return device_table(fmt, w.device) if fmt in kernels.GRID_GEMV_FORMATS else w


def _grid(n: int, block_n: int, pairs: int, experts: int, block_m: int) -> tuple[int, int]:
    return triton.cdiv(n, block_n), moe_kernels.moe_tiles_bound(pairs, experts, block_m)


def tile_options(fmt: Format, launch: moe_kernels.MoeLaunch, block_m: int | None = None, block_n: int | None = None,
                 warps: int | None = None, stages: int | None = None, step: int | None = None,
                 pairs_an_expert: float | None = None) -> moe_kernels.MoeTile:  # fmt: skip
    """The tile of `launch` for experts in `fmt`: the table's (`moe_kernels.moe_gemm_tile`, for `pairs_an_expert`)
    where not given."""
    table = moe_kernels.moe_gemm_tile(fmt, launch, pairs_an_expert)
    given = (block_m, block_n, warps, stages, step)
    return moe_kernels.MoeTile(*(t if v is None else v for v, t in zip(given, table, strict=True)))


def gate_up_grouped(x: Tensor, w_gate: Tensor, w_up: Tensor, fmt: Format, experts: int, slots: int, order: Tensor,
                    counts: Tensor, n: int, k: int, out: Tensor, *, block_m: int | None = None,
                    block_n: int | None = None, warps: int | None = None, stages: int | None = None,
                    step: int | None = None, amax: RowScales | None = None) -> Tensor:  # fmt: skip
    """out[p] (n) f32 = SiLU(x[p // slots] @ Wg[e]^T) * (x[p // slots] @ Wu[e]^T) for each pair p the sorted
    `order` (int32 (pairs,)) lists, e its expert, `counts` (int32 (experts,)) the pairs of each in turn; Wg and
    Wu (experts, n, k) checkpoint rows in `fmt`, x f32 (rows, k) contiguous. One launch; the tile, its warps and
    stages, and the word decode's values a step are the table's (`moe_kernels.moe_gemm_tile`) unless
    given (tests, the benchmark's sweep). With `amax` (`route.RowScales`, the routing launch's) each row takes one
    f16 scale for the whole product, and each pair's largest |out| is raised in amax.h for the down launch."""
    fmt = Format(fmt)
    per = order.numel() / experts
    block_m, block_n, warps, stages, step = tile_options(fmt, GATE_UP, block_m, block_n, warps, stages, step, per)
    rows = order.numel() // slots
    if amax is not None and (amax.x.numel() != rows or amax.h.numel() != rows * slots or amax.x16.numel() != rows * k):
        raise ValueError(f"the row scales must be ({rows},), ({rows}, {k}) and ({rows * slots},)")
    _check(w_gate, fmt, experts, n, k, order, counts)
    check_rows(w_up, fmt, experts * n, k)
    pairs = order.numel()
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() * slots != pairs * k:
        raise ValueError(f"x must be contiguous f32 ({pairs // slots}, {k})")
    if out.numel() != pairs * n or not out.is_contiguous():
        raise ValueError(f"out must be contiguous ({pairs}, {n})")
    scales = (amax.x, amax.x16, amax.h) if amax is not None else (x, x, order)  # stand-ins where there are none
    gate_up_kernel[_grid(n, block_n, pairs, experts, block_m)](
        x, w_gate, w_up, _table(fmt, w_gate), order, counts, out, *scales, N=n, KD=k, SLOTS=slots, E=experts,
        E_BLOCK=triton.next_power_of_2(experts), **format_consts(fmt, n, k, w_gate, step, launch=GATE_UP),
        BLOCK_M=block_m, BLOCK_N=block_n, ROW_SCALES=amax is not None, num_warps=warps, num_stages=stages,
        **pdl.options(),
    )  # fmt: skip
    return out


def down_grouped(h: Tensor, w: Tensor, fmt: Format, experts: int, order: Tensor, counts: Tensor, weights: Tensor,
                 d: int, dff: int, pair_out: Tensor, c: Combine, *, block_m: int | None = None,
                 block_n: int | None = None, warps: int | None = None, stages: int | None = None,
                 step: int | None = None, h_amax: Tensor | None = None) -> Tensor:  # fmt: skip
    """c.sum_out (rows, d) = sum over each row's slots j, in order, of weights[row, j] * (h[pair] @ Wd[e]^T)
    (+ each of c.adds), e the pair's expert; with c.norm its RMS norm too. Wd (experts, d, dff) checkpoint rows
    in `fmt`, h f32 (pairs, dff), weights f32 (rows, slots), `pair_out` a (pairs, d) f32 scratch. One launch:
    the products, then each (row, tile of d) summed by the program that stores its last slot; c.counters
    holds `counters_for(rows, width tiles)` (`down_width_tiles`). With `h_amax` (int32 (pairs,), the bits of each
    pair's largest |h|: `route.RowScales.h` as the gate/up launch left it) each row takes one f16 scale."""
    fmt = Format(fmt)
    per = order.numel() / experts
    block_m, block_n, warps, stages, step = tile_options(fmt, DOWN, block_m, block_n, warps, stages, step, per)
    _check(w, fmt, experts, d, dff, order, counts)
    pairs = order.numel()
    rows, slots = weights.shape
    if h.dtype != torch.float32 or h.numel() != pairs * dff or not h.is_contiguous() or rows * slots != pairs:
        raise ValueError(f"h must be contiguous f32 ({pairs}, {dff}) and weights ({pairs // max(slots, 1)}, k)")
    if h_amax is not None and (h_amax.numel() != pairs or h_amax.dtype != torch.int32):
        raise ValueError(f"h_amax must be int32 ({pairs},)")
    if pair_out.numel() < pairs * d:
        raise ValueError(f"pair_out must hold ({pairs}, {d})")
    grid = _grid(d, block_n, pairs, experts, block_m)
    if c.counters.numel() < counters_for(rows, grid[0]):
        raise ValueError(f"counters must hold {counters_for(rows, grid[0])}")
    down_kernel[grid](
        h, w, _table(fmt, w), order, counts, weights, order if h_amax is None else h_amax, pair_out,
        *combine_args(c, rows, d),
        D=d, DFF=dff, SLOTS=slots, E=experts, E_BLOCK=triton.next_power_of_2(experts),
        **format_consts(fmt, d, dff, w, step, launch=DOWN), ADDS=len(c.adds), NORM=c.norm is not None,
        NORM_CHUNK=moe_kernels.MOE_NORM_CHUNK, ROWS=rows, ROW_SCALES=h_amax is not None,
        BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages, **pdl.options(),
    )  # fmt: skip
    return c.sum_out
