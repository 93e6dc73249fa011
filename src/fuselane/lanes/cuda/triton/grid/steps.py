"""Where a step of the grid GEMV's k loop reads: for each of its groups of 8 values, the offset of the group's
super-block in the weight row, the group's index in it, and the index of its first value in the row.

Why a module: a step of the grid dot (`gemv.grid_dot`, `q8.grid_dot_q8`) takes either a slice of one super-block
(SLICE_C <= SUPER_C: every group of the step in one block, its offset one number) or several whole super-blocks
(SLICE_C a multiple of SUPER_C: each group its own block). The wide step exists for a product of few weight rows
and a long k (a 7B's down product: 3,584 rows of 18,944 values): a slice of one block gives a row's k to at most
32 threads, so the launch holds too few loads in flight to cover their latency (0.2 waves a SM on an H100,
benchmarks/RESULTS.md 2026-12-07 tenth); four blocks a step give a row 128. A row's blocks need not be a whole
number of steps: the last step's groups past the row read its last block again, and `live` says which count.
Both dots end alike too (`pair_sums`: a gated pair's two products, walked in one loop).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def step_groups(step, gi, NBYTES: tl.constexpr, SLICE_C: tl.constexpr, SUPER_C: tl.constexpr,
                GROUP_C: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
    """For the groups gi (0 .. SLICE_C / GROUP_C - 1) of k step `step` over a row of BLOCKS super-blocks of
    NBYTES bytes: (the byte offset of each group's block in the row: a scalar for a slice of one block, else
    [1, G]; each group's index in its block, [G]; its first value's index in the row, [G])."""
    groups: tl.constexpr = SLICE_C // GROUP_C
    if SLICE_C <= SUPER_C:
        slices: tl.constexpr = SUPER_C // SLICE_C
        off = (step // slices) * NBYTES
        g = (step % slices) * groups + gi
        first = step * SLICE_C + gi * GROUP_C
    else:
        block_groups: tl.constexpr = SUPER_C // GROUP_C
        span: tl.constexpr = SLICE_C // SUPER_C
        # past the row's last block (a last step of a row that is not whole steps), that block again
        block = tl.minimum(step * span + gi // block_groups, BLOCKS - 1)
        g = gi % block_groups
        off = (block * NBYTES)[None, :]
        first = block * SUPER_C + g * GROUP_C
    return off, g, first


@triton.jit
def live(step, gi, SLICE_C: tl.constexpr, SUPER_C: tl.constexpr, GROUP_C: tl.constexpr, BLOCKS: tl.constexpr):
    """[G] bool: which groups of step `step` lie in the row (`step_groups` gives the others the last block)."""
    return step * (SLICE_C // GROUP_C) + gi < BLOCKS * (SUPER_C // GROUP_C)


@triton.jit
def pair_sums(acc, acc2, AXIS: tl.constexpr, PAIR: tl.constexpr):
    """A dot's result: acc summed over AXIS, and acc2 too where PAIR (a gated pair's second product), else the
    first sum again."""
    y = tl.sum(acc, axis=AXIS)
    if PAIR:
        y2 = tl.sum(acc2, axis=AXIS)
    else:
        y2 = y
    return y, y2
