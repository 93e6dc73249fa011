"""The GEMV of the grid and ternary formats: y (m, n) = x (m, k) @ W^T for a step's or a batch's few rows, W the
checkpoint's blocks in one of `kernels.GRID_GEMV_FORMATS`, each value decoded in registers (`values.grid_values`,
its grid row gathered from the format's table), f32 activations (or a step's row in int8) and f32 sums.

These formats (IQ1_*, IQ2_*, IQ3_*, TQ*) spend 1.6-3.4 bits a value; their codes index llama.cpp's grids, so a
value costs a table gather beside its field loads. Two
kernels, four launchers: `gemv_grid` (a product with a bias, a residual or a landing row read on the device:
`rows.store_rows`), `gemv_grid_gate_up_glu` (a gated pair in one grid format, SiLU(gate) * up),
`gemv_grid_add_norm` (a step's projection plus residual whose last program norms the row: `fast_norm.norm_last`)
and `gemv_grid_parts` (a step's products of one activation in one grid format, a layer's query and key, in one
launch: `gemv.parts`' programs part after part and epilogues). Every other fused op holding a grid matrix is
taken apart (`fits._grid_launch`).

Launch shape (`grid_tile`): a program takes BLOCK_N weight rows for all m <= `kernels.GEMV_ROWS` rows of x and
walks k a slice of a super-block at a time: a thread finds a group's fields once (`values.grid_group`:
the words of its 8 grid values, its signs, its scale) and decodes its 8 values from them in an unrolled loop
(`values.grid_magnitude`: a byte permute and an add a value, no int-to-float conversion), so the bit work
that finds a grid row is spent once for 8 values; a group's 8 products are summed unscaled and its scale
applied once; the [BLOCK_M, BLOCK_N, groups] partial sums are reduced once at the end.

What bounds it (H100, benchmarks/RESULTS.md 2026-12-07 seventh): on f32 activations, a value's dependent loads
(its group's fields, its grid row, its activation) waiting on L1 and L2, not issue: cutting the k loop from 13.6
to 12.4 instructions a value (IQ3_S) gained 2-4 % at the rule's tiles, where more warps in flight gained 20-90 %.
It read 400-585 GB/s. Under int8 activations a step's one row is read in int8 (`Q8IN`: `q8.grid_dot_q8`, a
group's 8 values in two dp4a and one 64-bit load of codes), every launch here taking it as a `Q8Acts`; the
gated pair then writes its own row's int8 form (`q8_epilogue.quantize_block_last`) for the down product.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import LAYOUTS, QK, QK_K, Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.epilogue import COUNTER_DTYPE, check_add_norm
from fuselane.lanes.cuda.triton.gemv.fast_norm import norm_last
from fuselane.lanes.cuda.triton.gemv.parts import (
    Part,
    check_bias,
    check_rows,
    part_base,
    part_out,
    parts_args,
    store_parts,
)
from fuselane.lanes.cuda.triton.gemv.q8_epilogue import check_q8_out, quantize_block_last
from fuselane.lanes.cuda.triton.gemv.rows import check_x, row_tiles, store_glu, store_rows
from fuselane.lanes.cuda.triton.grid.q8 import grid_dot_q8, int8_args
from fuselane.lanes.cuda.triton.grid.steps import live, pair_sums, step_groups
from fuselane.lanes.cuda.triton.grid.values import (
    GRID_GROUP,
    TERNARY_FORMATS,
    device_table,
    flip_bytes,
    grid_group,
    grid_magnitude,
    grid_values,
)
from fuselane.lanes.cuda.triton.quant import Q8Acts


@dataclass(frozen=True, slots=True)
class GridTile:
    """A grid GEMV launch's tile: weight rows a program, its warps, and the values of a super-block one step of
    its k loop decodes a row (the [BLOCK_M, block_n, slice / 8] partial sums, spread over the program's
    threads)."""

    block_n: int
    warps: int
    slice: int
    # groups of one 32-value sub-block a thread takes in an unrolled loop on int8 rows (`q8.grid_dot_q8`); the f32
    # dot takes a group at a time
    run: int = 1

    def values_a_thread(self) -> int:
        """Weight values a thread decodes a step of the k loop (each times every row of x's value)."""
        return self.block_n * self.slice // (self.warps * kernels.WARP)


# A value costs a few dependent loads (its fields, its grid row), so what keeps the GEMV fed is many warps in
# flight a SM. Swept on an H100 (benchmarks/grid_sweep.py; RESULTS.md, 2026-12-07 seventh), IQ3_S at a 7B's
# widths: a product of many rows (the gate, 18,944 x 3,584) ran fastest in small programs, 8 rows and 2 warps
# (572 GB/s; 482 at 16 rows and 4 warps); one of few rows and a long k (the down product, 3,584 x 18,944: 224
# programs of 16 rows) at 16 rows, 8 warps and a whole super-block a step (386 GB/s against 201), the warps
# on the chip doubled and the loop's fixed cost a value halved.
# Swept again over seven tiles after the field-load changes (RESULTS.md, 2026-12-07 ninth; H100, IQ3_S, a step's
# one row): the down product's few rows ran fastest in programs of 4 rows, 2 warps and a whole super-block a
# step, on the f32 row (430 GB/s against 337 at 16 rows and 8 warps) and on its int8 form (505 against 372), the
# attention output's (3,584 x 3,584) too (432 / 465 against 374 / 410); a batch's rows keep the 16-row tile,
# which reads each activation row once for four times the weight rows (not swept past one row).
# A step's one row over few weight rows, seen beside llama.cpp's vec-dot on an H100 (RESULTS.md, 2026-12-07
# tenth): the down product at 4/2/256 ran 896 programs of 64 threads, 16 threads a weight row, 0.2 waves a SM,
# and took 57 us where llama.cpp's 128 threads a row took 30. Two super-blocks a step (`steps.step_groups`) give
# a row 64 threads, one group of 8 values each a step, and the launch twice the loads in flight; both of a 7B's
# widths (14 and 74 super-blocks) are whole steps.
MANY_ROWS_TILE = GridTile(8, 2, 128)
FEW_ROWS_TILE = GridTile(16, 8, QK_K)
ONE_ROW_FEW_ROWS_TILE = GridTile(2, 4, 2 * QK_K)
_TILES = (MANY_ROWS_TILE, FEW_ROWS_TILE, ONE_ROW_FEW_ROWS_TILE)
if any(kernels.GRID_GEMV_MOST_TILE_ROWS % t.block_n for t in _TILES):
    raise RuntimeError("a grid tile's rows must divide kernels.GRID_GEMV_MOST_TILE_ROWS (the plan's head check)")
# the rows from which MANY_ROWS_TILE's programs put about 16 warps on each of an H100's 132 SMs at once
MANY_ROWS = 8192


def grid_tile(n: int, m: int = 1) -> GridTile:
    """The tile of a launch of n weight rows in all (a launch in parts: its parts' rows together) over m rows
    of x."""
    if n >= MANY_ROWS:
        return MANY_ROWS_TILE
    return ONE_ROW_FEW_ROWS_TILE if m == 1 else FEW_ROWS_TILE


@triton.jit
def grid_dot(
    w,
    w2,
    table,
    n,
    x_rows,
    rows,
    x_cols,
    FMT: tl.constexpr,
    NBYTES: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLICE_C: tl.constexpr,
    SUPER_C: tl.constexpr,
    GROUP_C: tl.constexpr,
    TERNARY: tl.constexpr,
    PAIR: tl.constexpr = False,
):
    """[BLOCK_M, BLOCK_N] f32: the rows `x_rows` of x (pointers, each a row within m: the caller points a tile's
    rows past m at a row within it, whose sums the store drops, so no load is masked) times the weight rows `rows` of
    `w` (a pointer, or one a weight row: a mixture's tile of several experts' rows); `x_cols` ([BLOCK_N] ints)
    moves x's pointers for each weight row (zeros for a dense product; a tile of several experts' rows reads
    each its own pair's activation). Where PAIR, the same rows of `w2` too, in the same loop (a gated pair: each
    activation value loaded once for both, twice the loads in flight): a tuple of both, else (the product,
    itself)."""
    # rows past n decode row n - 1 (no masked weight loads); the store drops them
    at_row = tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES  # [N]
    w_rows, w2_rows = w + at_row, w2 + at_row
    groups: tl.constexpr = SLICE_C // GROUP_C
    blocks: tl.constexpr = ROW_BYTES // NBYTES
    gi = tl.arange(0, groups)
    acc = tl.zeros([BLOCK_M, BLOCK_N, groups], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N, groups], tl.float32)
    for step in tl.range(0, STEPS):
        off, g, first = step_groups(step, gi, NBYTES, SLICE_C, SUPER_C, GROUP_C, blocks)
        blk = w_rows[:, None] + off  # [N, 1] or [N, G]
        blk2 = w2_rows[:, None] + off
        # [M, N, G]: each group's first value of x, a pointer a thread (each thread reads its own, from L1, where
        # an [M, G] load would be spread to the product's layout through shared memory for every value)
        cols = x_rows[:, None, None] + (first[None, None, :] + x_cols[None, :, None])
        if TERNARY:
            for j in tl.static_range(GROUP_C):
                xs = tl.load(cols + j).to(tl.float32)
                if STEPS * SLICE_C > blocks * SUPER_C:  # a last step partly past the row: those groups count nothing
                    xs = tl.where(live(step, gi, SLICE_C, SUPER_C, GROUP_C, blocks)[None, None, :], xs, 0.0)
                acc += xs * grid_values(blk, table, (g * GROUP_C + j)[None, :], FMT)[None, :, :]
                if PAIR:
                    acc2 += xs * grid_values(blk2, table, (g * GROUP_C + j)[None, :], FMT)[None, :, :]
        else:
            # a group's fields once ([N, G]), then each of its 8 values from them alone, unscaled; the group's
            # sum takes its scale once
            low, high, signs, scale, delta = grid_group(blk, table, g[None, :], FMT)
            low, high = flip_bytes(low), flip_bytes(high)
            part = tl.zeros([BLOCK_M, BLOCK_N, groups], tl.float32)
            if PAIR:
                low2, high2, signs2, scale2, delta2 = grid_group(blk2, table, g[None, :], FMT)
                low2, high2 = flip_bytes(low2), flip_bytes(high2)
                part2 = tl.zeros([BLOCK_M, BLOCK_N, groups], tl.float32)
            for j in tl.static_range(GROUP_C):
                xs = tl.load(cols + j).to(tl.float32)
                part += xs * grid_magnitude(low, high, signs, delta, j, FMT)[None, :, :]
                if PAIR:
                    part2 += xs * grid_magnitude(low2, high2, signs2, delta2, j, FMT)[None, :, :]
            if STEPS * SLICE_C > blocks * SUPER_C:  # a last step partly past the row: those groups count nothing
                keep = live(step, gi, SLICE_C, SUPER_C, GROUP_C, blocks)[None, :]
                scale = tl.where(keep, scale, 0.0)
                if PAIR:
                    scale2 = tl.where(keep, scale2, 0.0)
            acc += part * scale[None, :, :]
            if PAIR:
                acc2 += part2 * scale2[None, :, :]
    return pair_sums(acc, acc2, 2, PAIR)


@triton.jit
def _dot(w, w2, table, n, x, x_pitch, m, xq, xd, rows, mi, FMT: tl.constexpr, NBYTES: tl.constexpr,
         ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         SLICE_C: tl.constexpr, SUPER_C: tl.constexpr, GROUP_C: tl.constexpr, TERNARY: tl.constexpr,
         Q8IN: tl.constexpr, PAIR: tl.constexpr, RUN_C: tl.constexpr):  # fmt: skip
    """([BLOCK_M, BLOCK_N], the same of `w2` where PAIR): x's rows `mi` times the weight rows `rows`: the dp4a dot
    on a step's one row in int8 (Q8IN: `xq`, `xd`), else the f32 one on x (rows past m read row m - 1, dropped at
    the store)."""
    if Q8IN:
        y, y2 = grid_dot_q8(w, w2, table, n, xq, xd, rows, rows * 0, FMT, NBYTES, ROW_BYTES, STEPS, BLOCK_N,
                            SLICE_C, SUPER_C, GROUP_C, PAIR, RUN_C)  # fmt: skip
        y, y2 = tl.reshape(y, [1, BLOCK_N]), tl.reshape(y2, [1, BLOCK_N])
    else:
        x_rows = x + tl.minimum(mi, m - 1).to(tl.int64) * x_pitch  # [M]
        y, y2 = grid_dot(w, w2, table, n, x_rows, rows, rows * 0, FMT, NBYTES, ROW_BYTES, STEPS, BLOCK_M, BLOCK_N,
                         SLICE_C, SUPER_C, GROUP_C, TERNARY, PAIR)  # fmt: skip
    return y, y2


@triton.jit
def _grid_gemv_kernel(
    x,
    x_pitch,
    m,
    w,
    w_up,
    table,
    n,
    out,
    pitch,
    bias,
    pos,
    res,
    res_pitch,
    norm_w,
    norm_out,
    counter,
    eps,
    oq,
    od,
    os_,
    xq,
    xd,
    FMT: tl.constexpr,
    NBYTES: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLICE_C: tl.constexpr,
    SUPER_C: tl.constexpr,
    GROUP_C: tl.constexpr,
    TERNARY: tl.constexpr,
    GLU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    AT_ROW: tl.constexpr,
    HAS_RES: tl.constexpr,
    NORM: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    NORM_STEPS: tl.constexpr,
    Q8OUT: tl.constexpr,
    Q8IN: tl.constexpr,
    RUN_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mi = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    # GLU: `w` the gate's rows, `w_up` the up product's, in one format: SiLU(gate) * up. A row of x walks both in
    # one k loop; a batch's rows one after the other (both [M, N, G] sums in flight took a batch of 8 from 135 to
    # 167 registers a thread, sm_90)
    if GLU & (BLOCK_M > 1):
        y = _dot(w, w, table, n, x, x_pitch, m, xq, xd, rows, mi, FMT, NBYTES, ROW_BYTES, STEPS, BLOCK_M, BLOCK_N,
                 SLICE_C, SUPER_C, GROUP_C, TERNARY, Q8IN, False, RUN_C)[0]  # fmt: skip
        up = _dot(w_up, w_up, table, n, x, x_pitch, m, xq, xd, rows, mi, FMT, NBYTES, ROW_BYTES, STEPS, BLOCK_M,
                  BLOCK_N, SLICE_C, SUPER_C, GROUP_C, TERNARY, Q8IN, False, RUN_C)[0]  # fmt: skip
    else:
        y, up = _dot(w, w_up, table, n, x, x_pitch, m, xq, xd, rows, mi, FMT, NBYTES, ROW_BYTES, STEPS, BLOCK_M,
                     BLOCK_N, SLICE_C, SUPER_C, GROUP_C, TERNARY, Q8IN, GLU, RUN_C)  # fmt: skip
    if GLU:
        store_glu(y, up, rows, n, mi, m, out, pitch)
        if Q8OUT:  # a step's one row: its 32-value blocks' int8 form, each by the last of its programs
            quantize_block_last(out, tl.program_id(0), n, oq, od, os_, counter, BLOCK_N)
    else:
        store_rows(y, rows, n, mi, m, out, pitch, bias, pos, res, res_pitch, HAS_BIAS, AT_ROW, HAS_RES)
    if NORM:  # a step's one row: `out` holds x @ W^T + residual, which the launch's last program norms (and
        # where Q8OUT writes as int8 activations too, for the int8 products that read it)
        norm_last(out, norm_w, norm_out, n, eps, counter, oq, od, os_, NORM_BLOCK, NORM_STEPS, Q8OUT)


@triton.jit
def _grid_parts_kernel(
    x,
    xq,
    xd,
    parts,
    res,
    table,
    FMT: tl.constexpr,
    NBYTES: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLICE_C: tl.constexpr,
    SUPER_C: tl.constexpr,
    GROUP_C: tl.constexpr,
    TERNARY: tl.constexpr,
    PARTS: tl.constexpr,
    BIAS: tl.constexpr,
    AT_ROW: tl.constexpr,
    HAS_RES: tl.constexpr,
    Q8IN: tl.constexpr,
    RUN_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    grid_parts_product(x, xq, xd, parts, res, table, FMT, NBYTES, ROW_BYTES, STEPS, BLOCK_N, SLICE_C, SUPER_C,
                       GROUP_C, TERNARY, PARTS, BIAS, AT_ROW, HAS_RES, Q8IN, RUN_C)  # fmt: skip


@triton.jit
def grid_parts_product(x, xq, xd, parts, res, table, FMT: tl.constexpr, NBYTES: tl.constexpr,
                       ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, BLOCK_N: tl.constexpr, SLICE_C: tl.constexpr,
                       SUPER_C: tl.constexpr, GROUP_C: tl.constexpr, TERNARY: tl.constexpr, PARTS: tl.constexpr,
                       BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr,
                       Q8IN: tl.constexpr, RUN_C: tl.constexpr):  # fmt: skip
    """A step's one row (f32 `x`, or its int8 form `xq`, `xd` where Q8IN) times this program's part
    (`gemv.parts.part_base`, tiles part after part), its rows stored with the part's epilogue; returns the part
    (`parts_rope` turns its heads after)."""
    part, rows, n, w = part_base(parts, BLOCK_N)
    one = tl.arange(0, 1)
    y = _dot(w, w, table, n, x, 0, 1, xq, xd, rows, one, FMT, NBYTES, ROW_BYTES, STEPS, 1, BLOCK_N, SLICE_C, SUPER_C,
             GROUP_C, TERNARY, Q8IN, False, RUN_C)[0]  # fmt: skip
    store_parts(tl.reshape(y, [BLOCK_N]), rows, part, n, parts, res, PARTS, BIAS, AT_ROW, HAS_RES)
    return part


def dot_consts(fmt: Format, k: int, tile: GridTile) -> dict:
    """`grid_dot`'s constants for rows of k values in `fmt` under `tile` (its values a step and a thread's run of
    groups; its rows, BLOCK_M and BLOCK_N, are the launch's; a last step may lie partly past the row)."""
    lay = LAYOUTS[fmt]
    return dict(FMT=int(fmt), NBYTES=lay.nbytes, ROW_BYTES=(k // lay.values) * lay.nbytes,
                STEPS=triton.cdiv(k, tile.slice), SLICE_C=tile.slice, SUPER_C=QK_K, GROUP_C=GRID_GROUP,
                TERNARY=fmt in TERNARY_FORMATS, RUN_C=tile.run)  # fmt: skip


def _check_rows(w: torch.Tensor, fmt: Format, n: int, k: int) -> None:
    """`parts.check_rows`, the rows whole super-blocks (the k loop's steps are slices of one)."""
    if k % QK_K:
        raise ValueError(f"{fmt.name} rows take whole {QK_K}-value blocks, not {k} values")
    check_rows(w, fmt, n, k)


def grid_format(fmt: Format) -> Format:
    """`fmt` as a Format, checked to be one the grid GEMV decodes."""
    fmt = Format(fmt)
    if fmt not in kernels.GRID_GEMV_FORMATS:
        raise ValueError(f"no grid GEMV for {fmt.name}")
    return fmt


def _activation(x: torch.Tensor | Q8Acts, fmt: Format, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """x as the kernels take it: (its f32 rows, its int8 codes, its blocks' scales, its rows), a Q8Acts checked as
    a step's one row (`q8.grid_dot_q8`, not in a ternary format); an f32 x's codes and scales are x, never read."""
    if isinstance(x, Q8Acts):
        return *int8_args(x, fmt, k), 1
    return x, x, x, check_x(x, k)


def _launch(x, w, fmt: Format, n: int, k: int, out, pitch: int, *, w_up=None, bias=None, pos=None, residual=None,
            norm: tuple | None = None, norm_chunk: int | None = None, out_q8: Q8Acts | None = None,
            counters=None) -> None:  # fmt: skip
    """One launch of the grid GEMV kernel over x's rows (in tiles of the GEMV's; a Q8Acts: a step's one row in
    int8), its arguments checked by the caller; `norm` = (norm_w, norm_out, counter, eps) norms the one row `out`
    holds in the last program, which writes the normed row's int8 form to `out_q8` too where given; a gated pair
    with `out_q8` writes its row's int8 form, a block by the last of its programs (`counters`)."""
    xf, xq, xd, m = _activation(x, fmt, k)
    block_m, m_tiles = row_tiles(m)
    tile = grid_tile(n, m)
    # an absent norm's operands, or the pair's counters without its int8 form, are never read
    norm_w, norm_out, counter, eps = norm if norm is not None else (xf, xf, xf if counters is None else counters, 0.0)
    # the most values of the norm's row the last program holds in registers; a wider row is walked in chunks of
    # it, read back from L2
    chunk = min(triton.next_power_of_2(n), norm_chunk or kernels.NORM_HELD_A_THREAD * tile.warps * kernels.WARP)
    _grid_gemv_kernel[(triton.cdiv(n, tile.block_n), m_tiles)](
        xf,
        xf.stride(0),
        m,
        w,
        w if w_up is None else w_up,  # an absent up product, bias, position or residual is never read
        device_table(fmt, w.device),
        n,
        out,
        pitch,
        xf if bias is None else bias,
        xf if pos is None else pos,
        xf if residual is None else residual,
        0 if residual is None else residual.stride(0),
        norm_w,
        norm_out,
        counter,
        float(eps),
        *((xf, xf, xf) if out_q8 is None else out_q8),  # the int8 output (codes, scales, sums), read where Q8OUT
        xq,
        xd,
        **dot_consts(fmt, k, tile),
        BLOCK_M=block_m,
        BLOCK_N=tile.block_n,
        GLU=w_up is not None,
        HAS_BIAS=bias is not None,
        AT_ROW=pos is not None,
        HAS_RES=residual is not None,
        NORM=norm is not None,
        NORM_BLOCK=chunk,
        NORM_STEPS=triton.cdiv(n, chunk),
        Q8OUT=out_q8 is not None,
        Q8IN=isinstance(x, Q8Acts),
        num_warps=tile.warps,
        **pdl.options(),
    )


def gemv_grid(
    x: torch.Tensor | Q8Acts,
    w: torch.Tensor,
    fmt: Format,
    n: int,
    k: int,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_row: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """out = x (m, k) @ W^T (+ bias) (+ residual), W the n x k checkpoint rows `w` (1-D uint8, the file's blocks)
    in a grid or ternary `fmt`; returns `out`. As `rows.gemv`: with `out_row` = (pos, pitch), row r lands at row
    pos[0] + r of the table `out`, the position read on the device; `residual` (m, n) may be `out` itself. Rows
    of x past the GEMV's run in tiles of them, each re-reading the weights. A Q8Acts x is a step's one row in
    int8 (a grid format's, not a ternary one's), met in dp4a (`q8.grid_dot_q8`)."""
    fmt = grid_format(fmt)
    m = _activation(x, fmt, k)[3]
    _check_rows(w, fmt, n, k)
    check_bias(bias, n)
    if residual is not None and (tuple(residual.shape) != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be ({m}, {n}) with unit column stride")
    out, pitch, pos = part_out(Part(w, n, out, bias, out_row), m)
    _launch(x, w, fmt, n, k, out, pitch, bias=bias, pos=pos, residual=residual)
    return out


def gemv_grid_parts(
    x: torch.Tensor | Q8Acts, parts: Sequence[Part | tuple], fmt: Format, k: int, *,
    residual: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """One launch of up to `parts.PARTS_MOST` products of a step's one row `x` (1, k; or its int8 form) in one grid
    or ternary format (a layer's query and key), each a `Part` (or a tuple in its order: w, n, out, bias|None,
    out_row|None): its `out` gets x @ W^T (+ bias), or lands at a row of a table read on the device; `residual`
    (1, n0) is added to part 0. Programs take the parts' tiles part after part, as the other GEMVs in parts do."""
    tile, args, consts, tiles = parts_launch(x, parts, fmt, k, residual)
    _grid_parts_kernel[(tiles,)](*args, **consts, num_warps=tile.warps, **pdl.options())


def parts_launch(x: torch.Tensor | Q8Acts, parts: Sequence[Part | tuple], fmt: Format, k: int,
                 residual: torch.Tensor | None) -> tuple[GridTile, list, dict, int]:  # fmt: skip
    """A grid launch in parts over a step's one row `x` (1, k; or its int8 form), checked: its tile (by the parts'
    rows together), its arguments (x's three pointers, the parts', the residual, the table), its constants and
    its programs."""
    fmt = grid_format(fmt)
    xf, xq, xd, m = _activation(x, fmt, k)
    if m != 1:
        raise ValueError(f"a grid GEMV in parts takes a step's one row of x, not {m}")
    if k % QK_K:
        raise ValueError(f"{fmt.name} rows take whole {QK_K}-value blocks, not {k} values")
    tile = grid_tile(sum(Part(*p).n for p in parts))
    args, flags, tiles = parts_args(parts, fmt, k, tile.block_n, xf, residual)
    consts = dot_consts(fmt, k, tile) | flags | dict(BLOCK_N=tile.block_n, Q8IN=isinstance(x, Q8Acts))
    return tile, [xf, xq, xd, *args, device_table(fmt, xf.device)], consts, tiles


def gemv_grid_gate_up_glu(
    x: torch.Tensor | Q8Acts, w_gate: torch.Tensor, w_up: torch.Tensor, fmt: Format, n: int, k: int,
    out: torch.Tensor, *, out_q8: Q8Acts | None = None, counters: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """out (m, n) = SiLU(x @ Wg^T) * (x @ Wu^T) in one launch, both matrices n x k checkpoint rows in the grid
    format `fmt`; returns `out`. A program takes the same rows of both, so the gate's and the up product's sums
    meet in registers. With `out_q8` (a step's one row, n whole 32-value blocks) the row's int8 form is written
    too, each block by the last of its programs (`counters`: `q8_epilogue.q8_counters(n)`'s)."""
    fmt = grid_format(fmt)
    m = _activation(x, fmt, k)[3]
    _check_rows(w_gate, fmt, n, k)
    _check_rows(w_up, fmt, n, k)
    part_out(Part(w_gate, n, out), m)
    if out_q8 is not None:
        if m != 1:
            raise ValueError(f"a gated pair writes its int8 form for a step's one row, not {m}")
        check_q8_out(out_q8, n)
        if counters is None or counters.numel() != n // QK or counters.dtype != COUNTER_DTYPE:
            raise ValueError(f"a gated pair's int8 form takes q8_counters({n})")
        if QK % grid_tile(n, m).block_n:  # a block is quantized by the last of its whole programs
            raise ValueError(f"a gated pair's int8 form needs a tile of rows dividing {QK}")
    _launch(x, w_gate, fmt, n, k, out, out.stride(0), w_up=w_up, out_q8=out_q8, counters=counters)
    return out


def gemv_grid_add_norm(
    x: torch.Tensor | Q8Acts,
    w: torch.Tensor,
    fmt: Format,
    n: int,
    k: int,
    residual: torch.Tensor,
    sum_out: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    counter: torch.Tensor,
    *,
    out_q8: Q8Acts | None = None,
    norm_chunk: int | None = None,
) -> torch.Tensor:
    """One launch for a decode step's row: sum_out = x @ W^T + residual, W the n x k checkpoint rows `w` in the
    grid format `fmt` (x f32, or its int8 form), then out = sum_out / sqrt(mean(sum_out^2) + eps) * norm_w, the
    norm done by the launch's last program over the sum_out it reads back (`fast_norm.norm_last`); returns `out`.
    The contract of `epilogue.gemv_add_norm`: `sum_out` may be `residual`, `counter` is `gemv_add_norm_counter`'s,
    left at 0. With `out_q8` the last program writes the normed row's int8 form too (`quant.store_quantized`,
    whole 32-value blocks), so an int8 product after it needs no launch to quantize it. A row wider than the
    launch's threads hold (`kernels.NORM_HELD_A_THREAD` a thread) is normed in chunks of it (`norm_chunk`, a power
    of two, sets the chunk: tests)."""
    fmt = grid_format(fmt)
    if not isinstance(x, Q8Acts):
        x = x.view(1, -1) if x.dim() == 1 else x
    if _activation(x, fmt, k)[3] != 1:
        raise ValueError("a grid GEMV's add + norm takes a decode step's one row of x")
    _check_rows(w, fmt, n, k)
    check_add_norm(residual, sum_out, norm_w, out, counter, n, w.device)
    if out_q8 is not None:
        check_q8_out(out_q8, n)
    row = sum_out.view(1, n)
    norm = (norm_w, out, counter, eps)
    _launch(x, w, fmt, n, k, row, n, residual=residual.view(1, n), norm=norm, norm_chunk=norm_chunk, out_q8=out_q8)
    return out
