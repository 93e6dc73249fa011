"""Per-format inner loops of the decode GEMV: checkpoint rows dequantized in registers, block by block.

Each `_dot_*` helper takes a tile of weight rows (`w_rows`: [N] uint8 pointers, each to its row's first byte
of the GGUF tensor as stored) and of activation rows (`x_rows`: [M] pointers), walks the rows' `k` values in
`STEPS` steps of `UNITS` whole units (a K super-block, a 32-value block, or 32 float values), and returns the
products `[BLOCK_M, BLOCK_N]` in f32.

The tile. A step's values of a row are cut into B = UNITS * BASE * SPLIT slots, each a run of A packed bytes
of one unit (BASE slots a unit at the widest, each cut SPLIT ways); tensors are shaped `[A, N, B]`, slots
last. Triton's default layout gives lanes, then warps, to the last dimensions first, so the lanes of a warp
take one row's slots (a row a warp where a row has 32 slots, four rows a warp of eight lanes each where it
has 8: the shape `kernels.rows_a_warp` promises), and a thread holds its slot's A bytes in registers: it
decodes its slot's one or two sub-block scales once, for 2A (4-bit) or A values, reads the slot's bytes and
activations as whole vectors, and the row's sum is a warp's shuffle-reduction, once, after the loop. The
launcher (`rows.plan`) picks SPLIT and UNITS so that the slots of a row are the block's threads a row and
the values a thread holds fit its registers.

Why the loops look the way they do:
- Values are never put back in order. A slot's codes come out in whatever arrangement the layout packs them
  (a byte's low and high nibbles are values 16, 32 or 64 apart); the activations are loaded in that
  arrangement instead.
- Codes become floats by the 2^23 trick (`layout.in_two_23`): OR-ing an integer below 2^23 into the bits of 2^23
  and subtracting 2^23 is two full-rate ops, where the int-to-float converter runs at a quarter of the rate
  on Hopper and would hold a 4-bit format to about half the memory bandwidth. The bits are OR-ed into a byte
  once for both its nibbles; a high nibble is kept in place (16 times its code: one AND, no shift) and its
  scale taken a sixteenth, which is exact.
- The accumulator is the tile's own shape, summed once after the loop: the loop body is loads, integer
  decode and FMAs, with no cross-lane traffic.
- Every decoded weight is the f32 value `fuselane.gguf.dequant` gives, bit for bit: scale products are exact
  in f32 (an f16 scale has 11 significant bits, a sub-scale times a code fits in 13 more; a power of two
  scales exactly), and a minimum is added with one rounding, as gguf does (a fused multiply-add rounds the
  exact `d*q - m` once too). Only the dot product's summation order differs from the reference.
- Rows past a part's end are clamped to its last row by the caller, so no load in the loop is masked.
- Byte offsets are `formats.LAYOUTS`' and nothing else; `_check_layouts` fails at import if a layout stops
  meeting an alignment a load here relies on.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from fuselane.gguf.formats import QK, QK_K, Format
from fuselane.lanes.cuda.triton.gemv.layout import (
    BIT,
    CRUMB,
    F32_TWO_23_BITS,
    FMT_BF16,
    FMT_F16,
    FMT_F32,
    FMT_IQ4_NL,
    FMT_IQ4_XS,
    FMT_MXFP4,
    FMT_Q2_K,
    FMT_Q3_K,
    FMT_Q4_0,
    FMT_Q4_1,
    FMT_Q4_K,
    FMT_Q5_0,
    FMT_Q5_1,
    FMT_Q5_K,
    FMT_Q6_K,
    FMT_Q8_0,
    HALF_QK,
    HALF_WORD_BITS,
    HIGH_NIBBLE,
    HIGH_STEP,
    HIGH_WEIGHT,
    IQ4_NL_BYTES,
    IQ4_XS_BYTES,
    K_PAIRS,
    MXFP4_BYTES,
    NIBBLE,
    NIBBLE_BITS,
    NO_FIELD,
    Q2_K_BYTES,
    Q3_K_BYTES,
    Q4_0_BYTES,
    Q4_0_QS,
    Q4_1_BYTES,
    Q4_1_D,
    Q4_1_M,
    Q4_1_QS,
    Q4_BIAS,
    Q4_K_BYTES,
    Q4_K_D,
    Q4_K_DMIN,
    Q4_K_QS,
    Q4_K_SCALES,
    Q5_0_BYTES,
    Q5_0_D,
    Q5_0_QH,
    Q5_0_QS,
    Q5_1_BYTES,
    Q5_1_D,
    Q5_1_M,
    Q5_1_QH,
    Q5_1_QS,
    Q5_BIAS,
    Q5_K_BYTES,
    Q5_K_D,
    Q5_K_DMIN,
    Q5_K_QH,
    Q5_K_QS,
    Q5_K_SCALES,
    Q6_BIAS,
    Q6_HALF,
    Q6_HALF_SLOTS,
    Q6_HIGH_CRUMBS,
    Q6_HIGH_SUBS,
    Q6_K_BYTES,
    Q6_K_QH,
    Q6_K_QL,
    Q6_K_SCALES,
    Q6_QH_HALF,
    Q6_QL_HALF,
    Q6_SLOTS,
    Q6_SUB,
    Q8_0_BYTES,
    Q8_0_QS,
    QK_C,
    QK_K_C,
    SIGN_BIT,
    SIGNED_BYTE_BIAS,
    TAIL_C,
    f16_in_word,
    in_two_23,
    k_scale_min,
    load_f16,
    q6_k_d,
    q8_0_d,
    tail_d,
)
from fuselane.lanes.cuda.triton.gemv.low_bits import (
    iq4_nl_values,
    iq4_xs_values,
    mxfp4_values,
    q2_k_values,
    q3_k_values,
)

# --- decoding helpers -------------------------------------------------------------------------------------------


@triton.jit
def _units(w_rows, step, unit, UNITS: tl.constexpr, NBYTES: tl.constexpr):
    """Pointers [N, B] to the unit each slot reads in this step, of each row."""
    return w_rows[:, None] + ((unit + step * UNITS) * NBYTES)[None, :]


@triton.jit
def _acc_dot(acc, w, x_ptrs):
    """acc [M, A, N, B] += w [A, N, B] * x [M, A, B], the activations loaded (as f32) from `x_ptrs`."""
    return acc + w[None] * tl.load(x_ptrs).to(tl.float32)[:, :, None, :]


# --- K super-blocks ----------------------------------------------------------------------------------------------


@triton.jit
def _dot_k_pairs(
    w_rows,
    x_rows,
    STEPS: tl.constexpr,
    UNITS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    NBYTES: tl.constexpr,
    D: tl.constexpr,
    DMIN: tl.constexpr,
    SCALES: tl.constexpr,
    QH: tl.constexpr,
    QS: tl.constexpr,
):
    """Q4_K / Q5_K: a slot is (part of) a pair of sub-blocks: 32 qs bytes whose low nibbles are sub-block 2g
    and high nibbles 2g + 1; Q5_K (QH >= 0) adds bit s of qh byte i as sub-block s's fifth bit.
    value = d * scale * code - dmin * min."""
    B: tl.constexpr = UNITS * K_PAIRS * SPLIT
    A: tl.constexpr = QK_C // SPLIT
    slot = tl.arange(0, B)
    unit = slot // (K_PAIRS * SPLIT)
    g = (slot // SPLIT) % K_PAIRS
    i = (slot % SPLIT)[None, :] * A + tl.arange(0, A)[:, None]  # [A, B]: the byte of the pair
    val = unit[None, :] * QK_K_C + g[None, :] * (2 * QK_C) + i  # the value a low nibble holds
    lo_bit = (2 * g)[None, None, :]
    acc = tl.zeros([BLOCK_M, A, BLOCK_N, B], tl.float32)
    for step in tl.range(0, STEPS, num_stages=STAGES):
        blk = _units(w_rows, step, unit, UNITS, NBYTES)
        d, dmin = f16_in_word(blk, D), f16_in_word(blk, DMIN)
        sc_lo, mn_lo = k_scale_min(blk, SCALES, 2 * g)
        sc_hi, mn_hi = k_scale_min(blk, SCALES, 2 * g + 1)
        # 2^23's bits OR-ed in once for both nibbles, each then kept by one AND
        q = tl.load(blk[None] + (g[None, :] * QK_C + i + QS)[:, None, :]).to(tl.int32) | F32_TWO_23_BITS
        lo, hi = q & (F32_TWO_23_BITS | NIBBLE), q & (F32_TWO_23_BITS | HIGH_NIBBLE)
        if QH >= 0:
            qh = tl.load(blk[None] + (i + QH)[:, None, :]).to(tl.int32)
            lo |= ((qh >> lo_bit) & BIT) << NIBBLE_BITS
            hi |= ((qh >> (lo_bit + 1)) & BIT) << (2 * NIBBLE_BITS)
        w_lo = (d * sc_lo.to(tl.float32))[None] * in_two_23(lo, 0) - (dmin * mn_lo.to(tl.float32))[None]
        w_hi = (d * sc_hi.to(tl.float32) * HIGH_STEP)[None] * in_two_23(hi, 0) - (dmin * mn_hi.to(tl.float32))[None]
        xs = x_rows[:, None, None] + (val + step * (UNITS * QK_K_C))[None]
        acc = _acc_dot(acc, w_lo, xs)
        acc = _acc_dot(acc, w_hi, xs + QK_C)
    return tl.sum(tl.sum(acc, axis=1), axis=2)


@triton.jit
def _dot_q6_k(
    w_rows,
    x_rows,
    STEPS: tl.constexpr,
    UNITS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Q6_K: a slot is (part of) a 16-byte run of a half's ql: byte b (0..63) of the half holds value b of the
    half in its low nibble (sub-block b // 16) and value 64 + b in its high one (sub-block 4 on); their top
    2 bits are crumbs b // 32 and 2 + b // 32 of qh byte b % 32. value = d * scale * (code - 32)."""
    B: tl.constexpr = UNITS * Q6_SLOTS * SPLIT
    A: tl.constexpr = Q6_SUB // SPLIT
    slot = tl.arange(0, B)
    unit = slot // (Q6_SLOTS * SPLIT)
    j = (slot // SPLIT) % Q6_SLOTS
    half, run = j // Q6_HALF_SLOTS, j % Q6_HALF_SLOTS
    byte = run[None, :] * Q6_SUB + (slot % SPLIT)[None, :] * A + tl.arange(0, A)[:, None]  # [A, B]
    ql_byte = half[None, :] * Q6_QL_HALF + byte + Q6_K_QL
    qh_byte = half[None, :] * Q6_QH_HALF + byte % Q6_QH_HALF + Q6_K_QH
    lo_shift = (2 * (run // 2))[None, None, :]  # the low nibbles' top bits: crumb b // 32 of qh
    sub = half * (Q6_HALF // Q6_SUB) + run  # the low nibbles' sub-block; the high nibbles' is 4 on
    val = unit[None, :] * QK_K_C + half[None, :] * Q6_HALF + byte
    acc = tl.zeros([BLOCK_M, A, BLOCK_N, B], tl.float32)
    for step in tl.range(0, STEPS, num_stages=STAGES):
        blk = _units(w_rows, step, unit, UNITS, Q6_K_BYTES)
        d = load_f16(q6_k_d(w_rows[:, None], (unit + step * UNITS)[None, :], STEPS * UNITS))
        scales = (blk + Q6_K_SCALES + sub[None, :]).to(tl.pointer_type(tl.int8))
        sc_lo = tl.load(scales).to(tl.float32)
        sc_hi = tl.load(scales + Q6_HIGH_SUBS).to(tl.float32)
        ql = tl.load(blk[None] + ql_byte[:, None, :]).to(tl.int32) | F32_TWO_23_BITS
        qh = tl.load(blk[None] + qh_byte[:, None, :]).to(tl.int32)
        lo = (ql & (F32_TWO_23_BITS | NIBBLE)) | (((qh >> lo_shift) & CRUMB) << NIBBLE_BITS)
        hi = (ql & (F32_TWO_23_BITS | HIGH_NIBBLE)) | (
            ((qh >> (lo_shift + Q6_HIGH_CRUMBS)) & CRUMB) << (2 * NIBBLE_BITS)
        )
        w_lo = (d * sc_lo)[None] * in_two_23(lo, Q6_BIAS)
        w_hi = (d * sc_hi * HIGH_STEP)[None] * in_two_23(hi, Q6_BIAS * HIGH_WEIGHT)
        xs = x_rows[:, None, None] + (val + step * (UNITS * QK_K_C))[None]
        acc = _acc_dot(acc, w_lo, xs)
        acc = _acc_dot(acc, w_hi, xs + Q6_QL_HALF)
    return tl.sum(tl.sum(acc, axis=1), axis=2)


# --- 32-value blocks ---------------------------------------------------------------------------------------------


@triton.jit
def _dot_q8_0(
    w_rows,
    x_rows,
    STEPS: tl.constexpr,
    UNITS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Q8_0: a slot is (part of) a block's 32 signed bytes; value = d * q."""
    B: tl.constexpr = UNITS * SPLIT
    A: tl.constexpr = QK_C // SPLIT
    slot = tl.arange(0, B)
    unit = slot // SPLIT
    i = (slot % SPLIT)[None, :] * A + tl.arange(0, A)[:, None]  # [A, B]
    val = unit[None, :] * QK_C + i
    acc = tl.zeros([BLOCK_M, A, BLOCK_N, B], tl.float32)
    for step in tl.range(0, STEPS, num_stages=STAGES):
        blk = _units(w_rows, step, unit, UNITS, Q8_0_BYTES)
        d = load_f16(q8_0_d(w_rows[:, None], (unit + step * UNITS)[None, :], STEPS * UNITS))
        u = tl.load(blk[None] + (i + Q8_0_QS)[:, None, :]).to(tl.int32)
        # one XOR flips the sign bit (q + 128, unsigned) and sets 2^23's bits, which the byte does not touch
        w = d[None] * in_two_23(u ^ (F32_TWO_23_BITS | SIGN_BIT), SIGNED_BYTE_BIAS)
        acc = _acc_dot(acc, w, x_rows[:, None, None] + (val + step * (UNITS * QK_C))[None])
    return tl.sum(tl.sum(acc, axis=1), axis=2)


@triton.jit
def _dot_nibbles(
    w_rows,
    x_rows,
    STEPS: tl.constexpr,
    UNITS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    NBYTES: tl.constexpr,
    D: tl.constexpr,
    M: tl.constexpr,
    QH: tl.constexpr,
    QS: tl.constexpr,
    BIAS: tl.constexpr,
    FMT: tl.constexpr,
):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1: a slot is (part of) a block's 16 qs bytes; value i < 16 is the low nibble of
    byte i, value 16 + i its high nibble; the 5-bit formats (QH >= 0) add bit i of the little-endian 32-bit qh
    as the fifth bit. value = d * (code - BIAS), plus the block's minimum m where M >= 0; d at D in the block, or
    after the row's blocks where D < 0 (Q4_0: `layout.tail_d`)."""
    B: tl.constexpr = UNITS * SPLIT
    A: tl.constexpr = HALF_QK // SPLIT
    slot = tl.arange(0, B)
    unit = slot // SPLIT
    i = (slot % SPLIT)[None, :] * A + tl.arange(0, A)[:, None]  # [A, B]
    val = unit[None, :] * QK_C + i
    acc = tl.zeros([BLOCK_M, A, BLOCK_N, B], tl.float32)
    for step in tl.range(0, STEPS, num_stages=STAGES):
        blk = _units(w_rows, step, unit, UNITS, NBYTES)
        if D >= 0:
            d = load_f16(blk + D)
        else:
            d = load_f16(tail_d(w_rows[:, None], (unit + step * UNITS)[None, :], STEPS * UNITS, FMT))
        q = tl.load(blk[None] + (i + QS)[:, None, :]).to(tl.int32) | F32_TWO_23_BITS
        lo, hi = q & (F32_TWO_23_BITS | NIBBLE), q & (F32_TWO_23_BITS | HIGH_NIBBLE)
        if QH >= 0:
            qh_ptr = (blk + QH).to(tl.pointer_type(tl.uint16))
            qh = (tl.load(qh_ptr).to(tl.int32) | (tl.load(qh_ptr + 1).to(tl.int32) << HALF_WORD_BITS))[None]
            lo |= ((qh >> i[:, None, :]) & BIT) << NIBBLE_BITS
            hi |= ((qh >> (i + HALF_QK)[:, None, :]) & BIT) << (2 * NIBBLE_BITS)
        w_lo = d[None] * in_two_23(lo, BIAS)
        w_hi = (d * HIGH_STEP)[None] * in_two_23(hi, BIAS * HIGH_WEIGHT)
        if M >= 0:
            m = load_f16(blk + M)[None]
            w_lo += m
            w_hi += m
        xs = x_rows[:, None, None] + (val + step * (UNITS * QK_C))[None]
        acc = _acc_dot(acc, w_lo, xs)
        acc = _acc_dot(acc, w_hi, xs + HALF_QK)
    return tl.sum(tl.sum(acc, axis=1), axis=2)


# --- formats only the int8 GEMV decodes fast -------------------------------------------------------------------


@triton.jit
def _low_bit_values(blk, qd, t, FMT: tl.constexpr):
    """Values t of the units at `blk` (broadcasting together; `qd` their d's where kept after the row: IQ4_NL's
    and IQ4_XS's) of Q2_K, Q3_K, IQ4_NL or IQ4_XS, f32."""
    if FMT == FMT_Q2_K:
        v = q2_k_values(blk, t)
    elif FMT == FMT_Q3_K:
        v = q3_k_values(blk, t)
    elif FMT == FMT_IQ4_NL:
        v = iq4_nl_values(blk, qd, t)
    elif FMT == FMT_MXFP4:
        v = mxfp4_values(blk, qd, t)
    else:
        tl.static_assert(FMT == FMT_IQ4_XS, "no value decode for this format")
        v = iq4_xs_values(blk, qd, t)
    return v


@triton.jit
def _dot_values(
    w_rows,
    x_rows,
    STEPS: tl.constexpr,
    UNITS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    FMT: tl.constexpr,
    UNIT: tl.constexpr,
    NBYTES: tl.constexpr,
):
    """Q2_K / Q3_K / IQ4_NL / IQ4_XS: a slot is (part of) a run of 32 values of a unit, each value decoded
    alone by the whole-matrix decode's helpers (`low_bits`), its fields' bytes read again for each value
    (from L1). These formats' fast path is the int8 GEMV; this one is the f32 activations' (a step's one row
    under activations=dequant), one launch where a chunk's decode and cuBLAS took two and wrote an f16 copy."""
    RUNS: tl.constexpr = UNIT // QK_C
    B: tl.constexpr = UNITS * RUNS * SPLIT
    A: tl.constexpr = QK_C // SPLIT
    slot = tl.arange(0, B)
    unit = slot // (RUNS * SPLIT)
    t = (slot % (RUNS * SPLIT))[None, :] * A + tl.arange(0, A)[:, None]  # [A, B]: the value of the unit
    val = unit[None, :] * UNIT + t
    acc = tl.zeros([BLOCK_M, A, BLOCK_N, B], tl.float32)
    for step in tl.range(0, STEPS, num_stages=STAGES):
        blk = _units(w_rows, step, unit, UNITS, NBYTES)
        if TAIL_C[FMT]:
            qd = tail_d(w_rows[:, None], (unit + step * UNITS)[None, :], STEPS * UNITS, FMT)
        else:
            qd = blk  # read by no format here
        w = _low_bit_values(blk[None], qd[None], t[:, None, :], FMT)  # [A, N, B]
        acc = _acc_dot(acc, w, x_rows[:, None, None] + (val + step * (UNITS * UNIT))[None])
    return tl.sum(tl.sum(acc, axis=1), axis=2)


# --- floats ------------------------------------------------------------------------------------------------------


@triton.jit
def _dot_float(
    w_rows,
    x_rows,
    STEPS: tl.constexpr,
    UNITS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    FMT: tl.constexpr,
):
    """F32 / F16 / BF16 rows in units of 32 values. BF16 is the top half of an f32: shifting it up is exact."""
    B: tl.constexpr = UNITS * SPLIT
    A: tl.constexpr = QK_C // SPLIT
    slot = tl.arange(0, B)
    val = (slot // SPLIT)[None, :] * QK_C + (slot % SPLIT)[None, :] * A + tl.arange(0, A)[:, None]  # [A, B]
    acc = tl.zeros([BLOCK_M, A, BLOCK_N, B], tl.float32)
    for step in tl.range(0, STEPS, num_stages=STAGES):
        col = (val + step * (UNITS * QK_C))[:, None, :]
        if FMT == FMT_F32:
            w = tl.load(w_rows.to(tl.pointer_type(tl.float32))[None, :, None] + col)
        elif FMT == FMT_F16:
            w = tl.load(w_rows.to(tl.pointer_type(tl.float16))[None, :, None] + col).to(tl.float32)
        else:
            bits = tl.load(w_rows.to(tl.pointer_type(tl.uint16))[None, :, None] + col).to(tl.int32)
            w = (bits << HALF_WORD_BITS).to(tl.float32, bitcast=True)
        acc = _acc_dot(acc, w, x_rows[:, None, None] + (val + step * (UNITS * QK_C))[None])
    return tl.sum(tl.sum(acc, axis=1), axis=2)


# --- dispatch ----------------------------------------------------------------------------------------------------


@triton.jit
def dot_rows(
    w_rows,
    x_rows,
    FMT: tl.constexpr,
    STEPS: tl.constexpr,
    UNITS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
):
    """x_rows . w_rows for a tile: [BLOCK_M, BLOCK_N] f32, in STEPS steps of UNITS units a row, a unit's slots
    cut SPLIT ways (see the module's docstring)."""
    if FMT == FMT_Q4_K:
        y = _dot_k_pairs(
            w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES,
            Q4_K_BYTES, Q4_K_D, Q4_K_DMIN, Q4_K_SCALES, NO_FIELD, Q4_K_QS,
        )  # fmt: skip
    elif FMT == FMT_Q5_K:
        y = _dot_k_pairs(
            w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES,
            Q5_K_BYTES, Q5_K_D, Q5_K_DMIN, Q5_K_SCALES, Q5_K_QH, Q5_K_QS,
        )  # fmt: skip
    elif FMT == FMT_Q6_K:
        y = _dot_q6_k(w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES)
    elif FMT == FMT_Q8_0:
        y = _dot_q8_0(w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES)
    elif FMT == FMT_Q4_0:
        y = _dot_nibbles(
            w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES,
            Q4_0_BYTES, NO_FIELD, NO_FIELD, NO_FIELD, Q4_0_QS, Q4_BIAS, FMT,
        )  # fmt: skip
    elif FMT == FMT_Q4_1:
        y = _dot_nibbles(
            w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES,
            Q4_1_BYTES, Q4_1_D, Q4_1_M, NO_FIELD, Q4_1_QS, 0, FMT,
        )  # fmt: skip
    elif FMT == FMT_Q5_0:
        y = _dot_nibbles(
            w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES,
            Q5_0_BYTES, Q5_0_D, NO_FIELD, Q5_0_QH, Q5_0_QS, Q5_BIAS, FMT,
        )  # fmt: skip
    elif FMT == FMT_Q5_1:
        y = _dot_nibbles(
            w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES,
            Q5_1_BYTES, Q5_1_D, Q5_1_M, Q5_1_QH, Q5_1_QS, 0, FMT,
        )  # fmt: skip
    elif FMT == FMT_Q2_K:
        y = _dot_values(w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES, FMT, QK_K_C, Q2_K_BYTES)
    elif FMT == FMT_Q3_K:
        y = _dot_values(w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES, FMT, QK_K_C, Q3_K_BYTES)
    elif FMT == FMT_IQ4_XS:
        y = _dot_values(w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES, FMT, QK_K_C, IQ4_XS_BYTES)
    elif FMT == FMT_IQ4_NL:
        y = _dot_values(w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES, FMT, QK_C, IQ4_NL_BYTES)
    elif FMT == FMT_MXFP4:
        y = _dot_values(w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES, FMT, QK_C, MXFP4_BYTES)
    else:
        tl.static_assert((FMT == FMT_F32) | (FMT == FMT_F16) | (FMT == FMT_BF16), "no GEMV for this format")
        y = _dot_float(w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES, FMT)
    return y


# --- how each helper cuts its units into thread slots (read by the launcher) -------------------------------------


class Slots(NamedTuple):
    """A format's tiling: `unit` values a unit (what a step takes whole), `base` slots a unit at the widest,
    and `most_split`: the finest a slot may be cut (one byte, or one value, a thread)."""

    unit: int
    base: int
    most_split: int

    @property
    def values(self) -> int:
        """Values a thread holds per unit slot at the widest."""
        return self.unit // self.base


_NIBBLE_SLOTS = Slots(QK, 1, QK // 2)
SLOTS: dict[Format, Slots] = {
    Format.Q4_K: Slots(QK_K, K_PAIRS.value, QK),
    Format.Q5_K: Slots(QK_K, K_PAIRS.value, QK),
    Format.Q6_K: Slots(QK_K, Q6_SLOTS.value, Q6_SUB.value),
    Format.Q8_0: Slots(QK, 1, QK),
    Format.Q4_0: _NIBBLE_SLOTS,
    Format.Q4_1: _NIBBLE_SLOTS,
    Format.Q5_0: _NIBBLE_SLOTS,
    Format.Q5_1: _NIBBLE_SLOTS,
    # a slot a 32-value run, each value decoded alone (`_dot_values`)
    Format.Q2_K: Slots(QK_K, QK_K // QK, QK),
    Format.Q3_K: Slots(QK_K, QK_K // QK, QK),
    Format.IQ4_XS: Slots(QK_K, QK_K // QK, QK),
    Format.IQ4_NL: Slots(QK, 1, QK),
    Format.MXFP4: Slots(QK, 1, QK),
    Format.F32: Slots(QK, 1, QK),
    Format.F16: Slots(QK, 1, QK),
    Format.BF16: Slots(QK, 1, QK),
}
