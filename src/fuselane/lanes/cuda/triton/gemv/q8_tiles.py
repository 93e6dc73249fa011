"""The int8 GEMV's tiles (`q8`): rows a program, warps, (row, group)s a thread, by format and by a launch's shape.

Each entry was chosen by timing the whole decode step's graph replay on the H200 over a sweep of candidates
(`benchmarks/tile_sweep.py`, which sets these tables in place): a GEMV's kernel time alone misleads, and a tile
that suits a 7B's rows can leave a narrow model's programs mostly idle. `tile_of` picks a launch's entry from
its rows' length and, for a tall launch, its rows; `kernels.INT8_GEMV_TILE_ROWS` (the plan's fact of the rows a
program takes, which the rotation's epilogue checks a head against) is the most any entry takes.
"""

from __future__ import annotations

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.triton.gemv import q8_bodies

# Tiles (rows a program, warps, (row, group)s a thread), chosen by timing the whole decode step's graph
# replay on the H200 over a sweep of each (`activations=int8`, `benchmarks/tile_sweep.py`): Q4_K at 4 rows
# and 8 warps (8B 3.149 -> 3.067 ms), Q6_K at 2 rows and 8 warps (3.067 -> 3.046 ms); under dependent
# launches Q8_0 at 2 rows (0.6B 0.826 -> 0.793 ms) and the Q4_K gate/up GLU at 8 rows and 2 warps, two
# (row, group)s a thread: 2-unit chunks, so both the 8B's 16-unit rows and the 7B's 14 are whole chunks
# (8B 2.728 -> 2.583 ms, 7B 2.356 -> 2.266 ms against the earlier 2 rows / 4 warps and 4 rows / 2 warps);
# Q5_0 stays at 4 rows (2 rows: 0.5B 0.597 -> 0.634 ms). The kernel figures of `gemv_compare.py --q8`
# pointed elsewhere: it re-reads one matrix from L2.
# The formats of `q8_bodies` take the tile of the format whose loads theirs follow: the super-block formats
# Q4_K's, the 32-value block formats Q5_0's, except where a sweep of the 7B's step in its llama.cpp mix
# chose (2026-12-03): the Q3_K gate/up GLU at 4 rows (Q3_K_M 2.594 -> 2.384 ms against 8 rows; 8 rows
# take 255 registers), IQ4_XS's at 8 rows and 4 warps, one (row, group) a thread (IQ4_XS 2.385 -> 2.247 ms),
# and Q3_K's tall rows (Q2_K's ffn_down) at 2 rows and 4 warps (Q2_K 2.360 -> 2.179 ms). Q2_K's tall rows,
# never written by llama.cpp's recipes, follow Q3_K's (the same groups); no other tile of the sweep beat
# Q3_K's or IQ4_XS's 4-row tile, nor Q2_K's 8-row GLU (`benchmarks/RESULTS.md`).
TILES = {Format.Q4_K: (4, 8, 1), Format.Q6_K: (2, 8, 1), Format.Q8_0: (2, 2, 2), Format.Q5_0: (4, 2, 2)}
TILES |= {f: TILES[Format.Q4_K] if q8_bodies.GROUPS[f] > 1 else TILES[Format.Q5_0] for f in q8_bodies.FORMATS}
# Q3_K's and Q2_K's rows at two rows and two warps, two (row, group)s a thread, where Q4_K's eight warps left
# a program one pass over its rows (the whole step, 2026-12-04: the 7B in Q3_K_M 2.398 -> 2.363 ms, in Q2_K
# 2.199 -> 2.163, (4, 2, 2) within 0.5 % of it; Qwen2.5-1.5B's, through SHORT_TILES, 1.067 -> 1.035 and 1.014
# -> 1.002). IQ4_XS's lost at every other tile of the same sweep.
TILES |= {f: (2, 2, 2) for f in q8_bodies.K_QUAD_FORMATS}
GLU_TILES = TILES | {f: (8, 2, 2) for f in (Format.Q4_K, Format.Q5_K, Format.Q2_K)}
GLU_TILES |= {Format.Q3_K: (4, 2, 2), Format.IQ4_XS: (8, 4, 1)}
# A Q6_K gated pair (llama.cpp's Q6_K mix) at four rows and two warps, two (row, group)s a thread, not Q6_K's
# two rows and eight warps: the whole step, 2026-12-04, Qwen2.5-1.5B in Q6_K 1.362 -> 1.063 ms, the 7B 3.191
# -> 3.045 (four warps, one (row, group) a thread: 1.073 and 3.028).
GLU_TILES[Format.Q6_K] = (4, 2, 2)
# Rows of at least TALL_K values (a down projection's: the 7B's 18,944, the 8B's 12,288) leave few rows a
# program for the SMs' streams: Q6_K's at two rows and eight warps a program (7B 2.829 -> 2.692 ms, 8B
# 3.312 -> 3.145 ms at the earlier tiles), Q4_K's at four rows and two warps, two (row, group)s a thread
# (8B 2.578 -> 2.545 ms, 7B 2.264 -> 2.252 ms against two rows and eight warps).
TALL_K = 8192
TALL_TILES = TILES | {f: (4, 2, 2) for f in (Format.Q4_K, Format.Q5_K, Format.IQ4_XS)}
TALL_TILES |= {f: (2, 4, 2) for f in q8_bodies.K_QUAD_FORMATS}
TALL_TILES[Format.Q6_K] = (2, 8, 1)
# ...and a tall launch of fewer than SHORT_K rows (a narrow model's down projection: its width) has few programs
# at four rows each: Q4_K's take two (the whole step, 2026-12-04: Qwen2.5-3B 1.527 -> 1.477 ms, Qwen3-4B
# 1.815 -> 1.791, the 1.5B 1.103 -> 1.098); Q6_K's gained nowhere (within 0.3 % or lost on the 3B and 4B).
NARROW_TALL_TILES = TALL_TILES | {Format.Q4_K: (2, 2, 2)}
# Rows of fewer than SHORT_K values (a 1.5B's to a 4B's width: 6-10 super-blocks) leave many of an eight-warp
# program's threads without a group (Q6_K's two rows of six super-blocks: 96 (row, group)s for 256 threads):
# Q6_K's take four rows and two warps, two (row, group)s a thread, the output head's among them (the whole
# step, 2026-12-04: Qwen2.5-1.5B 1.103 -> 0.979 ms, 3B 1.525 -> 1.463, Qwen3-4B 1.813 -> 1.770). The sweep
# gave the other formats' entries no such gain (Q4_K's, and its gated pair's, were within 1 % or lost on one
# of the three), so they keep TILES'.
SHORT_K = 3072
SHORT_TILES = TILES | {Format.Q6_K: (4, 2, 2)}
# Q8_0 as the lane keeps it (a block's codes two 128-bit loads, `run/stored.py`; set after the tables above took
# (2, 2, 2) from TILES): the whole step of Qwen3-0.6B (H100, 2026-12-06) at (2, 2, 2) everywhere 0.766 ms; its
# short rows (k 1,024) at four rows and four warps 0.708, its 3,072-value down at two rows and eight warps 0.737;
# its gated pair within 1 % at every tile (`benchmarks/RESULTS.md`).
SHORT_TILES[Format.Q8_0] = (4, 4, 1)
TILES[Format.Q8_0] = (2, 8, 1)
# A gated pair of short rows keeps GLU_TILES' entries as they stand here; the entries set after this line are
# the wide rows' alone.
SHORT_GLU_TILES = dict(GLU_TILES)
# Wide rows' gated pairs and tall rows since the split Q6_K rows took the GLU to 241 registers a thread (the whole
# step, H100, 2026-12-06, `benchmarks/RESULTS.md`): a Q6_K gated pair at two rows and four warps, two (row,
# group)s a thread (the 7B in Q6_K 3.287 -> 2.844 ms, the 8B 3.217 -> 3.004; (2, 4, 1) 2.806 and 3.126), Q6_K's
# tall rows at (2, 2, 2) (the Q6_K 7B 2.905 -> 2.807, the Q4_K_M 7B 2.359 -> 2.314, 8B 2.604 -> 2.569, the
# Q5_K_M 7B 2.652 -> 2.611), and a Q5_K gated pair at eight rows and four warps (the Q5_K_M 7B 2.746 -> 2.658).
GLU_TILES[Format.Q6_K], GLU_TILES[Format.Q5_K] = (2, 4, 2), (8, 4, 1)
TALL_TILES[Format.Q6_K] = (2, 2, 2)
# ...and a narrow model's Q6_K down projections too, which kept the eight-warp tile after the wide rows' moved
# (the whole step, H100, 2026-12-06: Qwen2.5-3B in Q6_K 1.747 -> 1.623 ms, Qwen3-4B 2.104 -> 2.056, the 1.5B
# 1.103 -> 1.086, the 3B in Q4_K_M 1.542 -> 1.506; (2, 4, 2) won on the 1.5B alone, 1.031, and lost on the 4B).
NARROW_TALL_TILES[Format.Q6_K] = TALL_TILES[Format.Q6_K]
# Q4_0 and IQ4_NL as the lane keeps them (a block's codes one 128-bit load, `run/stored.py`): the whole step of
# the 7B in Q4_0 (H100, 2026-12-06) 2.256 ms at Q5_0's (4, 2, 2) everywhere; its attention rows at four rows and
# four warps, one (row, group) a thread, 2.144; its 18,944-value down at two rows and two warps 2.173; both with
# its gated pair at eight rows and four warps 2.037. The 1.5B's and 0.5B's short rows gained at no tile (their
# gated pair at (8, 4, 1): 0.956 -> 0.949 and 0.564 -> 0.574 ms), so they keep Q5_0's. IQ4_XS's tall rows at two
# rows and four warps (the 7B 2.390 -> 2.277 ms; (2, 8, 1) 2.278).
# MXFP4, kept as IQ4_NL is, takes its tiles (not swept).
for nibbles in (Format.Q4_0, Format.IQ4_NL, Format.MXFP4):
    TILES[nibbles], TALL_TILES[nibbles], GLU_TILES[nibbles] = (4, 4, 1), (2, 2, 2), (8, 4, 1)
TALL_TILES[Format.IQ4_XS] = (2, 4, 1)


def tile_of(fmt: Format, k: int, n: int | None = None, *, glu: bool = False) -> tuple[int, int, int]:
    """The tile (rows a program, warps, (row, group)s a thread) the int8 GEMV takes for `n` rows of `k` values in
    `fmt`: the GLU's (a short row's under SHORT_K values); a tall row's, from TALL_K values (a narrow one's under
    SHORT_K rows, where `n` is known); a short row's, under SHORT_K values; else TILES'."""
    if glu:
        return (SHORT_GLU_TILES if k < SHORT_K else GLU_TILES)[fmt]
    if k >= TALL_K:
        return (NARROW_TALL_TILES if n is not None and n < SHORT_K else TALL_TILES)[fmt]
    return (SHORT_TILES if k < SHORT_K else TILES)[fmt]
