"""The one-row f32 decode GEMV's tiles (`fast`): rows a program and (row, group)s a thread, by format and by a
product's size.

Each table was chosen by timing on the GPU (`benchmarks/gemv_compare.py --tiles` for the kernels alone, the
whole decode step's graph replay for the float formats' small products). `fast.launch_plan` reads them at
launch, so a sweep may set them in place.
"""

from __future__ import annotations

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan import kernels

# Tiles by format: (rows a program, (row, group)s a thread a chunk: each one 16 bytes of codes in flight and
# an accumulator tile). Measured on the H200 (`benchmarks/gemv_compare.py --tiles`, GB/s of weights): the
# super-block formats read 10-45 % faster at 4 rows and two groups a thread (8B q/o 1,035 -> 1,217, gate
# 1,130 -> 1,639, down 1,121 -> 1,276, head 1,397 -> 1,682); the 32-value formats keep 8 rows and one.
TILES = {Format.Q4_K: (4, 2), Format.Q6_K: (4, 2), Format.Q8_0: (8, 1), Format.Q5_0: (8, 1), Format.F16: (8, 1)}
TILES[Format.BF16] = TILES[Format.F16]  # the same bytes a value (not swept)
# The gate/up GLU walks two matrices: Q4_K at 2 rows and two groups (8B gate 1,465 -> 2,003 GB/s), Q8_0 at
# 4 and two (0.6B gate 1,372 -> 1,617).
GLU_TILES = TILES | {Format.Q4_K: (2, 2), Format.Q8_0: (4, 2)}
# A row whose units do not fill whole chunks of a format's tile (the 7B's 14 and 74 super-blocks) takes the
# default tile, whose 2-unit chunk they fill: a partial last chunk cost the 7B's gate/up 17 % (1,766 -> 1,459).
DEFAULT_TILE = (8, 1)
# A float product whose rows are few or short (either side under NARROW_SIDE; a launch in parts its parts' rows
# together) is a few programs an SM at 8 rows a program, or a few chunks a program: its launch waits on round
# trips, not on HBM. It takes four rows and two groups a thread: twice the programs, each with twice the bytes
# in flight, partial chunk or not (a 1,536-value row is 48 units of a 64-unit chunk). A decode step's replay
# (H100, 2026-12-06), every product at 8 rows -> every one at this tile: Qwen2.5-0.5B in BF16 1.020 -> 0.771 ms,
# 1.5B 2.383 -> 1.677, 3B 3.690 -> 3.228, Qwen3-1.7B 2.137 -> 1.958, Qwen3-4B in F16 4.461 -> 4.127 (each of
# their products has a side of at most 2,560); the 7B in F16, whose every product is at least 3,584 both ways,
# 6.303 -> 6.375 (its o product alone at this tile 6.400). Where between 2,560 and 3,584 the gain ends is not
# measured.
NARROW_SIDE = 3072
NARROW_TILES = {Format.F16: (4, 2), Format.BF16: (4, 2)}


def narrow_tile(fmt: Format, k: int, n: int | None) -> tuple[int, int] | None:
    """The tile of a product of `n` rows of `k` values in `fmt` (its parts together) where it is a float product
    of few or short rows, else None (the format's own tile)."""
    if n is None or fmt not in NARROW_TILES or min(n, k) >= NARROW_SIDE:
        return None
    return NARROW_TILES[fmt]


if any(
    r > kernels.F32_GEMV_MOST_TILE_ROWS or r & (r - 1)
    for r, _ in (*TILES.values(), *GLU_TILES.values(), *NARROW_TILES.values(), DEFAULT_TILE)
):
    raise RuntimeError("a fast GEMV tile's rows must be a power of two within kernels.F32_GEMV_MOST_TILE_ROWS")
