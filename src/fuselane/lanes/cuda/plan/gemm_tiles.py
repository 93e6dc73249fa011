"""The int8 tensor-core GEMM's facts (`triton/gemm_q8.py`): the formats it multiplies and its tiles, in one table.

A prefill chunk's product y (m, n) = x (m, k) @ W^T reads its activation as the decode step's int8 form (codes
under one f32 scale a 32-value block, `triton/quant.py`) and W as the checkpoint's bytes: each 32-value run
of a weight row is unpacked to int8 codes in registers, multiplied on the int8 tensor cores (int32 sums) and
scaled in f32. The plan side (shim, rules) and the kernel read the same facts from here, so a product the
shim sends to the int8 GEMM is one the kernel takes. No torch or Triton here.

The tiles are the H200's (sm_90) measured best of the kernel that unrolled a super-block (benchmarks/RESULTS.md,
2026-12-01): 64 activation rows x 128 weight rows at 4 warps (128 x 128 at 8 warps spilled), and 32 x 128
for the formats of two MMAs a run (Q6_K's figure). The kernel now keeps one run live and pipelines its loads
(`triton/gemm_q8.py`); `benchmarks/gemm_q8_sweep.py` times the candidates of `SWEEP` (tiles and stages) on the
GPU in one call, and its best go here. At these, every format compiles for sm_90 (Triton 3.6) without a spill
(`benchmarks/gemm_q8_registers.py`).
"""

from __future__ import annotations

from typing import NamedTuple

from fuselane.gguf.formats import QK, QK_K, Format
from fuselane.lanes.cuda.plan.kernels import GEMV_ROWS


class GemmTile(NamedTuple):
    """A launch's tile: output rows (activation rows) and columns (weight rows) a program, warps, stages."""

    block_m: int
    block_n: int
    warps: int
    stages: int


# Formats whose 32-value runs unpack to int8 codes under one f32 scale (and one f32 offset where the format
# has a minimum) or two scales of 16 values (Q6_K's, Q3_K's sub-blocks): every run is one or two int8 MMAs.
INT8_GEMM_FORMATS = frozenset(
    {
        *(Format.Q4_0, Format.Q4_1, Format.Q5_0, Format.Q5_1, Format.Q8_0, Format.IQ4_NL),
        *(Format.Q2_K, Format.Q3_K, Format.Q4_K, Format.Q5_K, Format.Q6_K, Format.IQ4_XS),
    }
)
# ...of which these are K formats: a block is a 256-value super-block of eight runs.
SUPER_BLOCK_FORMATS = frozenset({Format.Q2_K, Format.Q3_K, Format.Q4_K, Format.Q5_K, Format.Q6_K, Format.IQ4_XS})
# ...and these scale each 16 values of a run apart: two MMAs a run, each with the other half's codes zeroed.
SPLIT_FORMATS = frozenset({Format.Q2_K, Format.Q3_K, Format.Q6_K})
# ...and these add a minimum (an offset) a run: the activation's block sums carry it (one FMA a run, two split).
MIN_FORMATS = frozenset({Format.Q2_K, Format.Q4_K, Format.Q5_K, Format.Q4_1, Format.Q5_1})

DEFAULT_TILE = GemmTile(block_m=64, block_n=128, warps=4, stages=3)
# A format of two MMAs a run holds two int32 tiles at once: 32 activation rows leave it its registers.
_SPLIT_TILE = GemmTile(block_m=32, block_n=128, warps=4, stages=3)
TILES: dict[Format, GemmTile] = {fmt: _SPLIT_TILE for fmt in SPLIT_FORMATS}
# The candidates a GPU sweep times (`benchmarks/gemm_q8_sweep.py`): activation rows, weight rows (the MMA's
# rows), warps and pipeline stages, every combination (54). 64 weight rows a warp group or more compile to
# Hopper's wgmma, whose sums the run's scaling waits for; 32 to mma.sync (sm_90, Triton 3.6), at 96-128
# registers a thread against 214-243 (Q4_K, `benchmarks/gemm_q8_registers.py`), so several blocks a SM.
SWEEP_M, SWEEP_N, SWEEP_WARPS, SWEEP_STAGES = (32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4)
SWEEP = tuple(
    GemmTile(bm, bn, warps, stages)
    for bm in SWEEP_M
    for bn in SWEEP_N
    for warps in SWEEP_WARPS
    for stages in SWEEP_STAGES
)


def tile(fmt: Format) -> GemmTile:
    """The tile a product in `fmt` launches with."""
    return TILES.get(fmt, DEFAULT_TILE)


def block_values(fmt: Format) -> int:
    """Values of one of the format's blocks: a super-block's 256 or a block's 32."""
    return QK_K if fmt in SUPER_BLOCK_FORMATS else QK


def int8_gemm(fmt: Format, m: int, k: int) -> bool:
    """Whether the int8 GEMM takes a product of `m` rows of `k` values in `fmt`: past the GEMV's rows, one of
    its formats, rows of whole blocks."""
    return m > GEMV_ROWS and fmt in INT8_GEMM_FORMATS and k % block_values(fmt) == 0
