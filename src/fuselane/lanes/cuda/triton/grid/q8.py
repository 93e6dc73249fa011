"""The grid GEMV's dot on int8 activations (`quant.Q8Acts`, as the int8 GEMV reads them): a step's one row times
rows in a grid format, a group's 8 grid bytes against its 8 int8 activations in two `dp4a`.

Why: on f32 activations a grid value cost a byte permute, an add, a select, an FMA and an activation load of its
own (12.4 instructions a value in IQ3_S's k loop, RESULTS.md 2026-12-07 seventh), and the GEMV read 400-585 GB/s.
Here a group of 8 values costs its fields (`values.grid_group`, as before), its sign byte spread to two byte masks
(a multiply and a sign-replicating `prmt` each), the masks applied (an xor and an add a word: every grid byte of
the signed formats is 1..127, so ~b + 1 stays within its byte), one 64-bit load of its 8 activation codes, two
dp4a and one scaled add: an eighth of the activation loads, and the k loop 5.9-8.2 instructions a value where f32
took 9.7-12.1 (sm_90 SASS, `benchmarks/grid_sass.py --int8`; what remains is mostly the fields' loads and their
64-bit addresses). llama.cpp's vec-dot for these formats works the same way (grid bytes against q8_1 codes in
dp4a, signs as byte masks).

IQ1_S / IQ1_M have no signs but an offset of +-1/8 a group: the group's sum is dp4a(grid, codes) + offset *
dp4a(ones, codes), in f32 after the integer sums. Ternary formats keep the f32 GEMV (`gemv.grid_dot`).

Exact up to f32's rounding of the scaled sums: every integer sum is exact in int32 (8 products of at most
127 * 127), then converted once and scaled by the group's scale times its block's activation scale.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import QK, Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton.gemv.int8_words import INTERPRETED, dp4a
from fuselane.lanes.cuda.triton.grid.steps import live, pair_sums, step_groups
from fuselane.lanes.cuda.triton.grid.values import (
    FMT_IQ1_M,
    FMT_IQ1_S,
    LOW_WORD,
    TERNARY_FORMATS,
    WORD_SHIFT,
    grid_bytes,
    grid_group,
    table_bytes,
)
from fuselane.lanes.cuda.triton.quant import Q8Acts, check_acts

Q8_FORMATS = kernels.GRID_INT8_FORMATS  # every grid format but the ternary ones (no grid, no table rows)
if Q8_FORMATS & TERNARY_FORMATS:
    raise RuntimeError("a ternary format has no grid for the int8 dot")
SIGNED_FORMATS = Q8_FORMATS - {Format.IQ1_S, Format.IQ1_M}


def _check_grids() -> None:
    """The masks' negation (~b + 1 within a byte) needs every grid byte of a signed format in 1..127."""
    for fmt in SIGNED_FORMATS:
        grid = table_bytes(fmt)[: grid_bytes(fmt)].view("int8")
        if grid.min() < 1:
            raise RuntimeError(f"{fmt.name}'s grid holds {int(grid.min())}: a sign mask would carry out of its byte")


_check_grids()


def int8_args(x: Q8Acts, fmt: Format, k: int, rows: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """The three activation pointers a grid launch takes for an activation in int8: (a stand-in for its f32 rows,
    never read: its scales, f32 too; its codes; its scales), x checked as `rows` rows of k values in a format this
    dot takes."""
    if fmt not in Q8_FORMATS:
        raise ValueError(f"the grid kernels' dot reads {fmt.name}'s activation as f32, not int8")
    check_acts(x, k, rows)
    return x.d, x.q, x.d


QB = tl.constexpr(QK)
LOW_SIGNS, HIGH_SIGNS = tl.constexpr(0x0F), tl.constexpr(0xF0)  # a sign byte's bits for values 0-3, 4-7
# times a sign byte's low nibble: its bit j (0..3) lands on bit 8j + 7, the top of byte j (every other product
# lands below a byte's top, and no two on one bit: no carries)
SPREAD_LOW = tl.constexpr((1 << 7) | (1 << 14) | (1 << 21) | (1 << 28))
# times its high nibble (bits 4..7 in place): bit j lands on bit 8 (j - 4) + 7
SPREAD_HIGH = tl.constexpr((1 << 3) | (1 << 10) | (1 << 17) | (1 << 24))
BYTE_ONES = tl.constexpr(0x01010101)
BYTE_TOP = tl.constexpr(7)
BYTE_BITS = tl.constexpr(8)
ALL_ONES = tl.constexpr(0xFF)


@triton.jit
def _byte_tops(x):
    """Each byte of x made 0xFF where its top bit is set, else 0: one `prmt` whose selector nibbles (8 + i)
    replicate byte i's sign."""
    if INTERPRETED:
        out = tl.zeros_like(x)
        for i in tl.static_range(4):
            out |= (((x >> (BYTE_BITS * i + BYTE_TOP)) & 1) * ALL_ONES) << (BYTE_BITS * i)
        return out
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0xBA98;", "=r,r", [x], tl.int32, True, 1)


@triton.jit
def signed_words(low, high, signs):
    """A group's two words of grid bytes (values 0-3, 4-7; each 1..127) with its sign byte applied: byte j
    negated where bit j is set, as (b ^ 0xFF) + 1 = 256 - b within the byte."""
    m_lo = _byte_tops((signs & LOW_SIGNS) * SPREAD_LOW)
    m_hi = _byte_tops((signs & HIGH_SIGNS) * SPREAD_HIGH)
    return (low ^ m_lo) + (m_lo & BYTE_ONES), (high ^ m_hi) + (m_hi & BYTE_ONES)


@triton.jit
def group_dot(low, high, signs, delta, a0, a1, FMT: tl.constexpr):
    """A group's 8 grid values (its `grid_group` fields) times its 8 int8 activations (words a0, a1), unscaled,
    as f32: the signed grid bytes' dp4a sums, or for IQ1 the grid's sums plus the offset times the codes' sum."""
    zero = tl.zeros_like(a0)
    if (FMT == FMT_IQ1_S) | (FMT == FMT_IQ1_M):
        sumi = dp4a(high, a1, dp4a(low, a0, zero, True), True)
        ones = tl.full(a0.shape, BYTE_ONES, tl.int32)
        codes = dp4a(ones, a1, dp4a(ones, a0, zero, True), True)
        v = sumi.to(tl.float32) + delta * codes.to(tl.float32)
    else:
        lo, hi = signed_words(low, high, signs)
        v = dp4a(hi, a1, dp4a(lo, a0, zero, True), True).to(tl.float32)
    return v


@triton.jit
def grid_dot_q8(
    w,
    w2,
    table,
    n,
    xq,
    xd,
    rows,
    x_cols,
    FMT: tl.constexpr,
    NBYTES: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLICE_C: tl.constexpr,
    SUPER_C: tl.constexpr,
    GROUP_C: tl.constexpr,
    PAIR: tl.constexpr = False,
    RUN_C: tl.constexpr = 1,
):
    """[BLOCK_N] f32: a step's one row, quantized (`xq` its int8 codes, 16-byte aligned; `xd` its 32-value
    blocks' scales), times the weight rows `rows` of `w` (a pointer, or one a weight row: a mixture's tile of
    several experts' rows) in the grid format FMT (one of Q8_FORMATS); rows past n decode row n - 1, which the
    caller's store drops. `x_cols` ([BLOCK_N] ints, multiples of 256) moves the activation for each weight row
    (zeros for a dense product; a tile of several experts' rows reads each its own pair's row). The k loop of
    `gemv.grid_dot` (`steps.step_groups`: a slice of a super-block a step, or several whole ones), a group's
    fields found once and its 8 values met in two dp4a. Where PAIR, the same rows of `w2` in the same loop (a
    gated pair: the activation's codes loaded once for both): a tuple of both, else (the product, itself).
    A thread takes RUN_C neighbouring groups of one 32-value sub-block in an unrolled loop, so the compiler loads
    the fields they share once (their block's d, the sub-block's scale and high bits, the activation's scale: IQ3_S
    6.75 loads a group against 9, sm_90), at RUN_C times the registers of a group."""
    at_row = tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES  # [N]
    w_rows, w2_rows = w + at_row, w2 + at_row
    groups: tl.constexpr = SLICE_C // GROUP_C
    blocks: tl.constexpr = ROW_BYTES // NBYTES
    tl.static_assert(QB % (RUN_C * GROUP_C) == 0, "a thread's run of groups lies in one 32-value sub-block")
    runs = tl.arange(0, groups // RUN_C)
    # each thread reads its own groups' codes and scales (from L1), as `grid_dot` reads x: a [G] load would be
    # spread to the [N, G] layout through shared memory a step
    own = x_cols[:, None]
    acc = tl.zeros([BLOCK_N, groups // RUN_C], tl.float32)
    acc2 = tl.zeros([BLOCK_N, groups // RUN_C], tl.float32)
    for step in tl.range(0, STEPS):
        for j in tl.static_range(RUN_C):
            gi = runs * RUN_C + j
            off, g, first = step_groups(step, gi, NBYTES, SLICE_C, SUPER_C, GROUP_C, blocks)
            low, high, signs, scale, delta = grid_group(w_rows[:, None] + off, table, g[None, :], FMT)
            at = first[None, :] + own  # [N, G]: each group's first value
            pair = tl.load((xq + at).to(tl.pointer_type(tl.int64)))  # its 8 codes, 8-aligned
            a0, a1 = (pair & LOW_WORD).to(tl.int32), (pair >> WORD_SHIFT).to(tl.int32)
            da = tl.load(xd + at // QB)
            if STEPS * SLICE_C > blocks * SUPER_C:  # a last step partly past the row: those groups count nothing
                da = tl.where(live(step, gi, SLICE_C, SUPER_C, GROUP_C, blocks)[None, :], da, 0.0)
            acc += (scale * da) * group_dot(low, high, signs, delta, a0, a1, FMT)
            if PAIR:
                low2, high2, signs2, scale2, delta2 = grid_group(w2_rows[:, None] + off, table, g[None, :], FMT)
                acc2 += (scale2 * da) * group_dot(low2, high2, signs2, delta2, a0, a1, FMT)
    return pair_sums(acc, acc2, 1, PAIR)
