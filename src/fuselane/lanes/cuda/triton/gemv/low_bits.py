"""The values of Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 blocks, a tile at a time, for the on-device decode
(`epilogue.dequantize`) and the GEMMs that stage weights through it (`epilogue.unit_values`).

The int8 GEMV (`q8_bodies`) multiplies these formats' codes as integers and never forms a weight; a prefill
product on f16 copies or an f16 scratch needs the weights themselves, and so does the GEMV by rows
(`formats.dot_rows`) under f32 activations. Each helper takes `blk` (pointers to the units' first bytes) and `t`
(the value indices wanted in a unit), of shapes that broadcast together (the whole-matrix decode's [U, 1] and
[1, T]; the GEMV's [1, N, B] and [A, 1, B]), and returns the values f32 in the broadcast shape, each the value
`fuselane.gguf.dequant` gives, bit for bit. That holds in any order of operations: every product here is
exact in f32 (an f16 scale's 11 significant bits times a 4-bit or signed 6-bit sub-scale times a code of at most
7 bits is at most 23 bits), and Q2_K's subtraction of its minimum is the one rounding, as in the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselane.lanes.cuda.triton.gemv.layout import (
    BIT,
    BYTE,
    BYTE_BITS,
    CRUMB,
    HALF_QK,
    HALF_QS,
    IQ4_NL_QS,
    IQ4_T0,
    IQ4_T1,
    IQ4_T2,
    IQ4_T3,
    IQ4_XS_QS,
    IQ4_XS_SCALES_H,
    IQ4_XS_SCALES_L,
    IQ4_XS_SUB,
    K_SUB,
    MX_T0,
    MX_T1,
    MX_T2,
    MX_T3,
    MXFP4_QS,
    NIBBLE,
    NIBBLE_BITS,
    Q2_K_D,
    Q2_K_DMIN,
    Q2_K_QS,
    Q2_K_SCALES,
    Q3_BIAS_CODE,
    Q3_HIGH_SCALES,
    Q3_K_D,
    Q3_K_HMASK,
    Q3_K_QS,
    Q3_K_SCALES,
    Q3_LOW_SCALES,
    Q3_SCALE_ROWS,
    Q6_HALF,
    SIGNED_SCALE,
    load_e8m0,
    load_f16,
)

CRUMBS_A_BYTE = tl.constexpr(4)  # 2-bit fields of a byte
RUNS_A_HALF = tl.constexpr(4)  # Q2_K / Q3_K: runs of 32 values a half (one crumb of each qs byte a run)
WORD_BYTES = tl.constexpr(4)  # bytes of an int32 word of the IQ4 table
SIGN_SHIFT = tl.constexpr(24)  # shifting a byte to an int32's top and back extends its sign


@triton.jit
def _byte(ptr):
    """The uint8 at each of `ptr`, as int32."""
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _bits(ptr, shift, MASK: tl.constexpr):
    """The field at `shift` of the byte at each of `ptr` (shapes that broadcast together), under MASK. (Here
    and below a constexpr meets a tensor from the right: Triton 3.6's interpreter turns `constexpr + tensor`
    into a tuple.)"""
    return (_byte(ptr) >> shift) & MASK


@triton.jit
def _crumb_codes(blk, t, QS: tl.constexpr):
    """Q2_K / Q3_K: the 2-bit code of value t of a 256-value block: half h = t // 128, run j, byte l of the
    half's 32 qs bytes (t = 128h + 32j + l), crumb j of that byte."""
    h, r = t // Q6_HALF, t % Q6_HALF
    return _bits(blk + QS + (h * HALF_QS + r % HALF_QS), 2 * (r // HALF_QS), CRUMB)


@triton.jit
def q2_k_values(blk, t):
    """Q2_K: value = (d * scale) * code - dmin * min, a 4-bit scale and min (low and high nibble of one byte)
    a sub-block of 16."""
    code = _crumb_codes(blk, t, Q2_K_QS).to(tl.float32)
    packed = _byte(blk + Q2_K_SCALES + t // K_SUB)
    scale = (load_f16(blk + Q2_K_D) * (packed & NIBBLE).to(tl.float32)) * code
    return scale - load_f16(blk + Q2_K_DMIN) * (packed >> NIBBLE_BITS).to(tl.float32)


@triton.jit
def q3_k_values(blk, t):
    """Q3_K: value = d * (scale - 32) * (code - 4 * (1 - hbit)), the third bit of the code from hmask (bit
    4h + j of byte l, as in `_crumb_codes`), a signed 6-bit scale a sub-block of 16."""
    h, r = t // Q6_HALF, t % Q6_HALF
    hbit = _bits(blk + Q3_K_HMASK + r % HALF_QS, h * RUNS_A_HALF + r // HALF_QS, BIT)
    code = _crumb_codes(blk, t, Q3_K_QS) + hbit * Q3_BIAS_CODE - Q3_BIAS_CODE
    i = t // K_SUB
    low = _bits(blk + Q3_K_SCALES + i % Q3_LOW_SCALES, (i // Q3_LOW_SCALES) * NIBBLE_BITS, NIBBLE)
    top = _bits(blk + Q3_K_SCALES + (i % Q3_SCALE_ROWS + Q3_HIGH_SCALES), 2 * (i // Q3_SCALE_ROWS), CRUMB)
    scale = (low | (top << NIBBLE_BITS)) - SIGNED_SCALE
    return (load_f16(blk + Q3_K_D) * scale.to(tl.float32)) * code.to(tl.float32)


@triton.jit
def iq4_value(code, MX: tl.constexpr = False):
    """The signed value a 4-bit IQ4 code stands for (`formats.IQ4_NL_VALUES`; MX: `formats.MXFP4_VALUES`), as
    f32: byte code % 4 of the table's word code // 4."""
    w = code // WORD_BYTES
    if MX:
        word = tl.where(w == 0, MX_T0, tl.where(w == 1, MX_T1, tl.where(w == 2, MX_T2, MX_T3)))
    else:
        word = tl.where(w == 0, IQ4_T0, tl.where(w == 1, IQ4_T1, tl.where(w == 2, IQ4_T2, IQ4_T3)))
    byte = (word >> ((code % WORD_BYTES) * BYTE_BITS)) & BYTE
    return ((byte << SIGN_SHIFT) >> SIGN_SHIFT).to(tl.float32)


@triton.jit
def _iq4_codes(qs, t):
    """IQ4_NL / IQ4_XS: the code of value t of a 32-value run of 16 qs bytes: the low nibbles are values 0-15,
    the high ones 16-31."""
    return _bits(qs + t % HALF_QK, (t // HALF_QK) * NIBBLE_BITS, NIBBLE)


@triton.jit
def iq4_nl_values(blk, qd, t):
    """IQ4_NL: value = d * table[code], a 32-value block, d at `qd` (after the row's blocks)."""
    return load_f16(qd) * iq4_value(_iq4_codes(blk + IQ4_NL_QS, t))


@triton.jit
def mxfp4_values(blk, qd, t):
    """MXFP4 as the device keeps it (IQ4_NL's layout): value = 2^(e - 128) * table[code], its e at `qd`."""
    return load_e8m0(qd) * iq4_value(_iq4_codes(blk + MXFP4_QS, t), True)


@triton.jit
def iq4_xs_values(blk, qd, t):
    """IQ4_XS: value = d * (scale - 32) * table[code], a signed 6-bit scale a run of 32 (its low 4 bits a nibble
    of scales_l, its top 2 bits a crumb of the 16-bit scales_h); d at `qd`, the scales after it (the block's
    header, after the row's blocks)."""
    run, r = t // IQ4_XS_SUB, t % IQ4_XS_SUB
    low = _bits(qd + IQ4_XS_SCALES_L + run // 2, (run % 2) * NIBBLE_BITS, NIBBLE)
    top = _bits(qd + IQ4_XS_SCALES_H + run // CRUMBS_A_BYTE, 2 * (run % CRUMBS_A_BYTE), CRUMB)
    scale = ((low | (top << NIBBLE_BITS)) - SIGNED_SCALE).to(tl.float32)
    codes = _iq4_codes(blk + IQ4_XS_QS + run * HALF_QK, r)
    return (load_f16(qd) * scale) * iq4_value(codes)
