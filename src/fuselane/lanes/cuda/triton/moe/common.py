"""What the mixture kernels share: the f32-activation product of a tile of checkpoint rows (every format the
decoded GEMV takes, `gemv.formats.dot_rows`) and its launch constants."""

from __future__ import annotations

import triton
import triton.language as tl

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.triton.gemv import rows as gemv_rows
from fuselane.lanes.cuda.triton.gemv.formats import dot_rows


@triton.jit
def row_dot(w_rows, x_row, FMT: tl.constexpr, STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr,
            BLOCK_N: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """x_row (one f32 row's pointer) . each of the tile's rows `w_rows` ([BLOCK_N] byte pointers): [BLOCK_N] f32."""
    y = dot_rows(w_rows, x_row + tl.arange(0, 1), FMT, STEPS, UNITS, SPLIT, 1, BLOCK_N, STAGES)
    return tl.reshape(y, [BLOCK_N])


def f32_plan(fmt: Format, n: int, k: int, prefix: str = "", m: int = 1,
             tile: tuple[int, int] | None = None) -> tuple[dict, int]:  # fmt: skip
    """The constants of `row_dot` (or `dot_rows` over `m` rows) for an (n, k) product in `fmt` (the GEMV's own
    tile, or `tile`: (rows a program, warps)), and its warps."""
    block_n, warps = tile if tile is not None else gemv_rows.tile(fmt, n, k, m)
    steps, units, split = gemv_rows.plan(fmt, k, block_n, warps, m)
    consts = dict(FMT=int(fmt), STEPS=steps, UNITS=units, SPLIT=split, BLOCK_N=block_n,
                  STAGES=gemv_rows.stages(fmt), ROW_BYTES=stored_row_bytes(fmt, k))  # fmt: skip
    return {prefix + name: v for name, v in consts.items()}, warps


def tiles(n: int, block_n: int) -> int:
    return triton.cdiv(n, block_n)
