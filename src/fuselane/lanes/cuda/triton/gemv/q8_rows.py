"""The int8 GEMV over a batch's rows (`batch=on`, activations=int8): y (m, n) = x (m, k) @ W^T, each row of x
held as int8 codes under one f32 scale a 32-value block (`quant.Q8Acts` of m rows), W as checkpoint bytes.

Why: a batch step's rows are each one sequence's decode row, so each product is the decode GEMV many times
over. Run as m one-row launches, every row would stream the whole matrix again; here a program loads a chunk
of its weight rows once (`q8.raw_chunk`, the one-row kernel's loads) and sums it against each of its
BLOCK_M activation rows in turn (`q8.chunk_acts`, `q8.chunk_sums`: the one-row kernel's dp4a bodies), so a
weight block is read once for all the tile's rows. Past `kernels.GEMV_ROWS` rows the rows run in tiles of
that many on the grid's second axis, each tile reading the weights again (as the f32 GEMV's, `rows.py`).

The numbers are the one-row kernel's: the same tile (rows, warps, chunk) for the format, the same per-group
sums added chunk by chunk into each row's own [BLOCK_N, G] accumulator (held as row `i` of a
[BLOCK_M, BLOCK_N, G] tensor), the same sum over groups and the same epilogue, so each row equals what
`gemv_q8` computes for it alone. No prefetch of the next chunk: the rows' sums keep the loads covered.

Three launchers, each one launch, as the one-row module's: `gemv_q8_rows` (one product: bias, residual, rows
landing at a table's row at a device position), `gemv_q8_rows_parts` (up to four products of one activation)
and `gemv_q8_rows_gate_up_glu` (a gated pair with SwiGLU in the store).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import QK, Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.parts import (
    PARTS_MOST,
    Part,
    PartArgs,
    check_bias,
    check_rows,
    pack_parts,
    part_out,
    part_rows,
)
from fuselane.lanes.cuda.triton.gemv.q8 import (
    FORMATS,
    GROUPS,
    UNIT_VALUES,
    check_aligned,
    chunk_acts,
    chunk_sums,
    raw_chunk,
    tile_plan,
)
from fuselane.lanes.cuda.triton.gemv.rows import store_glu, store_part
from fuselane.lanes.cuda.triton.quant import HALF, Q8Acts, check_acts

QK_C = tl.constexpr(QK)
HALF_C = tl.constexpr(HALF)


@triton.jit
def _add_row(acc, raw, xq, xd, xs, r, i, u0, K: tl.constexpr, FMT: tl.constexpr, N_UNITS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """acc [M, N, G] with this chunk's sums for activation row `r` added to its row `i` (the others as they
    were): the one-row kernel's `acc + sums`, for that row alone."""
    acts = chunk_acts(xq + r * K, xd + r * (K // QK_C), xs + r * (K // HALF_C), u0, FMT, N_UNITS, BLOCK_N, CHUNK)
    y = chunk_sums(raw, acts, u0, FMT, N_UNITS, CHUNK, MASKED)
    mine = (tl.arange(0, BLOCK_M) == i)[:, None, None]
    return tl.where(mine, acc + y[None, :, :], acc)


@triton.jit
def _rows_chunk(acc_a, acc_b, w_a, w_b, xq, xd, xs, m0, m, u0, K: tl.constexpr, FMT: tl.constexpr,
                N_UNITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                TWO: tl.constexpr, LAST: tl.constexpr, PARTIAL: tl.constexpr):  # fmt: skip
    """One chunk at unit u0: its weights of `w_a` (and `w_b` where TWO) loaded once, then summed against each
    of the tile's rows (rows past m read row m - 1; the store drops them)."""
    raw_a = raw_chunk(w_a, u0, FMT, N_UNITS, CHUNK, PARTIAL and LAST)
    raw_b = raw_a
    if TWO:
        raw_b = raw_chunk(w_b, u0, FMT, N_UNITS, CHUNK, PARTIAL and LAST)
    for i in tl.static_range(BLOCK_M):
        r = tl.minimum(m0 + i, m - 1).to(tl.int64)
        acc_a = _add_row(acc_a, raw_a, xq, xd, xs, r, i, u0, K, FMT, N_UNITS, BLOCK_M, BLOCK_N, CHUNK,
                         PARTIAL and LAST)  # fmt: skip
        if TWO:
            acc_b = _add_row(acc_b, raw_b, xq, xd, xs, r, i, u0, K, FMT, N_UNITS, BLOCK_M, BLOCK_N, CHUNK,
                             PARTIAL and LAST)  # fmt: skip
    return acc_a, acc_b


@triton.jit
def rows_dots(w_a, w_b, xq, xd, xs, m0, m, K: tl.constexpr, FMT: tl.constexpr, N_UNITS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, G: tl.constexpr,
              TWO: tl.constexpr):  # fmt: skip
    """x . row for the tile's weight rows of `w_a` (and `w_b` where TWO) and its activation rows m0 ..
    m0 + BLOCK_M - 1, [BLOCK_M, BLOCK_N] f32 each: every chunk but the last whole, the last masked where the
    row ends inside it, as the one-row loop sums them."""
    CHUNKS: tl.constexpr = (N_UNITS + CHUNK - 1) // CHUNK
    PARTIAL: tl.constexpr = N_UNITS % CHUNK != 0
    acc_a = tl.zeros([BLOCK_M, BLOCK_N, G], tl.float32)
    acc_b = acc_a
    for c in range(0, CHUNKS - 1):
        acc_a, acc_b = _rows_chunk(acc_a, acc_b, w_a, w_b, xq, xd, xs, m0, m, c * CHUNK, K, FMT, N_UNITS, BLOCK_M,
                                   BLOCK_N, CHUNK, TWO, False, PARTIAL)  # fmt: skip
    acc_a, acc_b = _rows_chunk(acc_a, acc_b, w_a, w_b, xq, xd, xs, m0, m, (CHUNKS - 1) * CHUNK, K, FMT, N_UNITS,
                               BLOCK_M, BLOCK_N, CHUNK, TWO, True, PARTIAL)  # fmt: skip
    return tl.sum(acc_a, 2), tl.sum(acc_b, 2)


@triton.jit
def _rows_parts_kernel(
    xq, xd, xs, m, parts, res, res_pitch,
    K: tl.constexpr, FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, G: tl.constexpr,
    ROW_BYTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr, BIAS: tl.constexpr,
    AT_ROW: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # `parts`: a `parts.PartsArgs`; BIAS and AT_ROW hold a bit a part; the residual is part 0's.
    pdl.begin(PDL)
    part, rows, n, w_rows = part_rows(parts, ROW_BYTES, BLOCK_N)
    m0 = tl.program_id(1) * BLOCK_M
    mi = m0 + tl.arange(0, BLOCK_M)
    y, _ = rows_dots(w_rows, w_rows, xq, xd, xs, m0, m, K, FMT, N_UNITS, BLOCK_M, BLOCK_N, CHUNK, G, False)
    store_part(y, part, rows, n, mi, m, parts.items, res, res_pitch, PARTS, BIAS, AT_ROW, HAS_RES)


@triton.jit
def _rows_glu_kernel(
    xq, xd, xs, m, w_gate, w_up, n, out, pitch,
    K: tl.constexpr, FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, G: tl.constexpr,
    ROW_BYTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_off = tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    m0 = tl.program_id(1) * BLOCK_M
    mi = m0 + tl.arange(0, BLOCK_M)
    gate, up = rows_dots(w_gate + row_off, w_up + row_off, xq, xd, xs, m0, m, K, FMT, N_UNITS, BLOCK_M, BLOCK_N,
                         CHUNK, G, True)  # fmt: skip
    store_glu(gate, up, rows, n, mi, m, out, pitch)


# --- launchers ---------------------------------------------------------------------------------------------------


def supports(fmt: Format | int, m: int, k: int) -> bool:
    """Whether these kernels take a product of `m` rows of `k` values in `fmt`: any rows, the one-row int8
    GEMV's formats and rows of whole units."""
    return m >= 1 and fmt in FORMATS and k % UNIT_VALUES[Format(fmt)] == 0


def row_tiles(m: int) -> tuple[int, int]:
    """(BLOCK_M, tiles of x's rows): every row in one tile up to the GEMV's rows, tiles of them past it."""
    block_m = min(triton.next_power_of_2(m), kernels.GEMV_ROWS)
    return block_m, triton.cdiv(m, block_m)


def _plan(x: Q8Acts, fmt: Format, tile: dict, n: int, *, glu: bool = False) -> tuple[dict, int, int]:
    """The launch's constexprs (the one-row kernel's tile for `fmt` and `n` weight rows, or the `tile` given as
    `q8.tile_plan` takes it, so the sums are its own), its m, and the tiles of its rows."""
    m, k = x.q.shape
    check_acts(x, k, m)
    plan = tile_plan(fmt, k, tile.get("block_n"), tile.get("warps"), tile.get("per_thread"), glu=glu, n=n)
    groups = plan["CHUNK"] * GROUPS[Format(fmt)]  # the groups a chunk: the accumulators' second axis
    block_m, m_tiles = row_tiles(m)
    consts = {key: plan[key] for key in ("FMT", "N_UNITS", "CHUNK", "ROW_BYTES", "BLOCK_N", "num_warps")}
    return consts | dict(K=k, G=groups, BLOCK_M=block_m), m, m_tiles


def gemv_q8_rows_parts(x: Q8Acts, parts: Sequence[Part | tuple], fmt: Format, *, residual: Tensor | None = None,
                       **tile: int) -> None:  # fmt: skip
    """One launch of up to four products of one format reading the quantized rows `x` (m, k): each part's
    `out` gets x @ W^T (+ bias), (m, n) or m rows of a table from a row at a device position; `residual`
    (m, n0) is added to part 0. `tile` (block_n, warps, per_thread) as `q8.gemv_q8_parts` takes it."""
    fmt = Format(fmt)
    parts = [Part(*p) for p in parts]
    if not 1 <= len(parts) <= PARTS_MOST:
        raise ValueError(f"a launch in parts takes 1..{PARTS_MOST} parts, not {len(parts)}")
    plan, m, m_tiles = _plan(x, fmt, tile, sum(p.n for p in parts))
    check_aligned([p.w for p in parts], fmt)
    entries: list[PartArgs] = []
    bias_bits = row_bits = 0
    for i, p in enumerate(parts):
        check_rows(p.w, fmt, p.n, plan["K"])
        check_bias(p.bias, p.n)
        if p.out.dtype not in (torch.float32, torch.float16):
            raise ValueError("out must be an f32 or f16 tensor")
        out, pitch, pos = part_out(p, m)
        bias_bits |= (p.bias is not None) << i
        row_bits |= (pos is not None) << i
        stand_in = x.d  # any device tensor stands in for an absent pointer, never read
        entries.append(PartArgs(p.w, p.n, out, pitch, stand_in if p.bias is None else p.bias,
                                stand_in if pos is None else pos))  # fmt: skip
    packed, tiles = pack_parts(entries, plan["BLOCK_N"], PartArgs(parts[0].w, 1, x.d, 0, x.d, x.d))
    if residual is not None and (tuple(residual.shape) != (m, parts[0].n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be ({m}, {parts[0].n}) with unit column stride")
    res, res_pitch = (x.d, 0) if residual is None else (residual, residual.stride(0))
    flags = dict(PARTS=len(parts), BIAS=bias_bits, AT_ROW=row_bits, HAS_RES=residual is not None)
    _rows_parts_kernel[(tiles, m_tiles)](x.q, x.d, x.s, m, packed, res, res_pitch, **flags, **plan, **pdl.options())


def gemv_q8_rows(x: Q8Acts, w: Tensor, fmt: Format, n: int, k: int, out: Tensor, *, bias: Tensor | None = None,
                 residual: Tensor | None = None, out_row: tuple[Tensor, int] | None = None,
                 **tile: int) -> Tensor:  # fmt: skip
    """out = x @ W^T (+ bias) (+ residual) for the quantized rows `x` (m, k); see `gemv_q8_rows_parts`."""
    if x.q.shape[-1] != k:
        raise ValueError(f"x has {x.q.shape[-1]} columns, the weights' rows {k}")
    gemv_q8_rows_parts(x, [Part(w, n, out, bias, out_row)], fmt, residual=residual, **tile)
    return out


def gemv_q8_rows_gate_up_glu(x: Q8Acts, w_gate: Tensor, w_up: Tensor, fmt: Format, n: int, k: int, out: Tensor,
                             **tile: int) -> Tensor:  # fmt: skip
    """out (m, n) = SiLU(x @ Wg^T) * (x @ Wu^T) in one launch for the quantized rows `x` (m, k), at the one-row
    GLU's tile."""
    fmt = Format(fmt)
    plan, m, m_tiles = _plan(x, fmt, tile, n, glu=True)
    if plan["K"] != k:
        raise ValueError(f"x has {plan['K']} columns, the weights' rows {k}")
    check_rows(w_gate, fmt, n, k)
    check_rows(w_up, fmt, n, k)
    check_aligned([w_gate, w_up], fmt)
    if out.dtype != torch.float32:
        raise ValueError("out must be an f32 tensor")
    part_out(Part(w_gate, n, out), m)
    grid = (triton.cdiv(n, plan["BLOCK_N"]), m_tiles)
    _rows_glu_kernel[grid](x.q, x.d, x.s, m, w_gate, w_up, n, out, out.stride(0), **plan, **pdl.options())
    return out


# The one-row module's launcher names, so a binder calls either module alike (`product_launch.q8_in`).
gemv_q8, gemv_q8_parts, gemv_q8_gate_up_glu = gemv_q8_rows, gemv_q8_rows_parts, gemv_q8_rows_gate_up_glu
