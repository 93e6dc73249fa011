"""The grid GEMV in parts with a query's and a key's heads turned in its epilogue (`gemv.turn`), as `q8_rope` is for
the int8 GEMV and `f32_rope` for the f32 ones: a step's merged q/k product in a grid format and its rotations (q/k
norm where the model has it, rope, the key's append to its cache) in one launch.

Why: llama.cpp's IQ3_M, IQ3_XXS and IQ2_M recipes write a layer's q and k in one grid format; their rotations
took a launch of their own after the grid GEMV in parts, one of the seven a layer the lane's budget allows (the
7B in IQ3_M took 9 in its first layers, 7 in the rest). Each program stores its rows as `gemv_grid_parts` does,
then counts itself on its head's counter; the program that makes a head's count whole turns it. Every tile the
grid GEMV takes (`gemv.grid_tile`) divides `kernels.GRID_GEMV_MOST_TILE_ROWS` rows, so a head of a multiple of
that is whole programs.
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import Format
from fuselane.graph.ops import Yarn
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.parts import Part, first_tile
from fuselane.lanes.cuda.triton.gemv.turn import Turn, check_tile, check_turns, turn_args, turn_heads
from fuselane.lanes.cuda.triton.grid.gemv import grid_parts_product, parts_launch
from fuselane.lanes.cuda.triton.quant import Q8Acts


@triton.jit
def _grid_parts_rope_kernel(
    x, xq, xd, parts, res, table,
    q_out, k_out, k_pitch, q_w, k_w, pos, counters, eps, freq_exp, yarn_low, yarn_inv, yarn_cut,
    FMT: tl.constexpr, NBYTES: tl.constexpr, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, BLOCK_N: tl.constexpr,
    SLICE_C: tl.constexpr, SUPER_C: tl.constexpr, GROUP_C: tl.constexpr, TERNARY: tl.constexpr,
    PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr,
    Q_PART: tl.constexpr, K_PART: tl.constexpr, Q_HEADS: tl.constexpr, HD: tl.constexpr,
    HALF_P2: tl.constexpr, NORM: tl.constexpr, K_AT_POS: tl.constexpr, YARN: tl.constexpr, Q8IN: tl.constexpr,
    RUN_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    part = grid_parts_product(x, xq, xd, parts, res, table, FMT, NBYTES, ROW_BYTES, STEPS, BLOCK_N, SLICE_C,
                              SUPER_C, GROUP_C, TERNARY, PARTS, BIAS, AT_ROW, HAS_RES, Q8IN, RUN_C)  # fmt: skip
    turn_heads(part, tl.program_id(0) - first_tile(part, parts), parts, q_out, k_out, k_pitch, q_w, k_w, pos,
               counters, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, BLOCK_N, Q_PART, K_PART, Q_HEADS, HD, HALF_P2,
               NORM, K_AT_POS, YARN)  # fmt: skip


def gemv_grid_parts_rope(
    x: Tensor | Q8Acts, parts: Sequence[Part | tuple], fmt: Format, q: Turn, k: Turn, pos: Tensor, counters: Tensor, *,
    hd: int, base: float, eps: float = 0.0, yarn: Yarn | None = None,
) -> None:  # fmt: skip
    """`gemv.gemv_grid_parts` over a step's one row `x` (1, k; or its int8 form) in the grid format `fmt`, whose
    parts `q.part` and `k.part` (a query's and a key's raw heads, written to their parts' outputs) are then turned
    in the epilogue as `q8_rope.gemv_q8_parts_rope` turns them. `counters` are
    `turn.rope_counters(q.heads, k.heads)`'s."""
    parts = [Part(*p) for p in parts]
    check_turns(parts, q, k, hd, counters)
    k_in = (x.q if isinstance(x, Q8Acts) else x).shape[-1]
    tile, args, consts, tiles = parts_launch(x, parts, fmt, k_in, None)
    check_tile(tile.block_n, hd)
    targs, tconsts = turn_args(q, k, pos, counters, hd=hd, base=base, eps=eps, yarn=yarn)
    _grid_parts_rope_kernel[(tiles,)](*args, *targs, **consts, **tconsts, num_warps=tile.warps, **pdl.options())
