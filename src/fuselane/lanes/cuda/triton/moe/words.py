"""The grouped expert GEMM's weight decode from 32-bit words: a step's values (half a super-block or a whole
one; four or eight 32-value blocks) of BLOCK_N checkpoint rows as one [BLOCK_N, KW] f16 tile, each value
`fuselane.gguf.dequant`'s f32 rounded once to f16 (bit for bit).

`gemv.epilogue.unit_values` decodes a unit from per-value byte pointers: a load, an index computation and a
reshape a value or two, and byte loads, which the software pipeliner cannot stage asynchronously (cp.async
moves 4, 8 or 16 bytes). Here each field is loaded as whole 32-bit words in a tile shaped so that the values a
word holds are the broadcast of its shifts over the tile's trailing dimensions, and the tile's natural order
is the values' own: the reshape to [BLOCK_N, KW] moves nothing. A value then costs a shift, a mask (with the
2^23 trick's OR), a subtraction, a multiply-add and half a conversion; the scales are unpacked once a
sub-block.

- Q4_K (144-byte blocks, so every block is 4-aligned): qs chunk j (32 bytes) holds values 64j + l in its low
  nibbles and 64j + 32 + l in its high ones, so words [BLOCK_N, 4 (j), 1, 8 (i), 1] shifted by 4h + 8b give
  [BLOCK_N, 4, 2 (h), 8, 4 (b)]: value 64j + 32h + 4i + b, sub-block 2j + h.
- Q6_K (208-byte blocks as the lane keeps them, their d's after the row's: `run/stored.py`): half H's ql
  byte 4a + c (a < 16) holds value 128H + 4a + c in its low nibble and 64 more in its high one, qh byte
  32H + 4(a % 8) + c their top bits (crumb a // 8, and 2 more), so [BLOCK_N, 2 (H), 2 (nibble), 16 (a), 4 (c)]
  is value 128H + 64 * nibble + 4a + c, scale (128H + 64 * nibble + 4a) // 16.
- Q8_0 (32 code bytes a block as the lane keeps them, their d's after the row's): [BLOCK_N, block, 8 (word),
  4 (byte)], the signed byte through the 2^23 trick with its sign bit flipped; Q5_0 (22 bytes): [BLOCK_N,
  block, 2 (nibble), 4 (word of qs), 4 (byte)], value 16 * nibble + 4 * word + byte, its fifth bit that bit of
  qh.
- Q5_K (176-byte blocks): Q4_K's tile, each value's fifth bit from qh byte 4i + b (bit 2j + h) loaded as the
  same [BLOCK_N, 1, 1, 8 (i), 1] words.
- IQ4_XS (128 code bytes a super-block as the lane keeps them, its d and scales after the row's): 32-value runs
  as Q4_0's blocks, each run's scale from one word of scales_l and the word of d and scales_h.
- Q2_K (84-byte blocks) and Q3_K (110 in 112): qs byte 32 half + l holds value 128 half + 32j + l in crumb j,
  so words [BLOCK_N, half, 1, 8 (i), 1] shifted by 8b + 2j give [BLOCK_N, half, 4 (j), 8, 4 (b)]: value
  128 half + 32j + 4i + b; Q3_K's third bit is bit 4 half + j of hmask word i's byte b; a 16-value sub-block's
  scale (Q2_K's with its min) is a byte load a sub-block.
- Q4_0, IQ4_NL and MXFP4 (16 code bytes a block as the lane keeps them, each block's d, or MXFP4's exponent
  byte, after the row's): the codes as Q5_0's qs, [BLOCK_N, block, 2 (nibble), 4 (word), 4 (byte)]; value =
  d * (code - 8), or the scale times the code's value in the 16-entry table the unit decode reads
  (`low_bits.iq4_value`).

A field 2 bytes past a word (the 2-aligned formats' blocks at an odd multiple of 2 bytes) is read from its
two aligned neighbours (a funnel shift; the second word is not read where the field is aligned). A block's
last word so read may take up to 2 bytes past the block, within the 4-aligned word of its last bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselane.gguf.formats import LAYOUTS, Format
from fuselane.lanes.cuda.plan import moe_kernels
from fuselane.lanes.cuda.plan.kernels import stored_block_bytes, stored_row_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.layout import (
    BIT,
    BYTE,
    BYTE_BITS,
    CRUMB,
    F16_BITS,
    F32_TWO_23_BITS,
    FMT_IQ4_NL,
    FMT_IQ4_XS,
    FMT_MXFP4,
    FMT_Q2_K,
    FMT_Q3_K,
    FMT_Q4_0,
    FMT_Q4_K,
    FMT_Q5_0,
    FMT_Q5_K,
    FMT_Q6_K,
    FMT_Q8_0,
    HALF_QK,
    HALF_QS,
    HALF_WORD_BITS,
    IQ4_NL_QS,
    IQ4_XS_QS,
    IQ4_XS_SCALES_H,
    IQ4_XS_SCALES_L,
    K_LOW_SUBS,
    K_SUB,
    K_TOP_SHIFT,
    MXFP4_QS,
    NIBBLE,
    NIBBLE_BITS,
    Q2_K_D,
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
    Q4_0_QS,
    Q4_BIAS,
    Q4_K_QS,
    Q4_K_SCALES,
    Q5_0_BYTES,
    Q5_0_QH,
    Q5_0_QS,
    Q5_BIAS,
    Q5_K_QH,
    Q5_K_QS,
    Q5_K_SCALES,
    Q6_BIAS,
    Q6_K_QH,
    Q6_K_QL,
    Q6_K_SCALES,
    Q8_0_BYTES,
    Q8_0_D_BYTES,
    Q8_0_QS,
    SIGN_BIT,
    SIGNED_BYTE_BIAS,
    SIGNED_SCALE,
    SIX_BITS,
    STORED_BYTES_C,
    TAIL_BYTES_C,
    WORD,
    block_d,
    in_two_23,
    load_e8m0,
    load_f16,
)
from fuselane.lanes.cuda.triton.gemv.low_bits import iq4_value

# Q4_0's, IQ4_NL's and MXFP4's codes start their stored block (their d or exponent is kept after the row)
NIBBLES_QS = Q4_0_QS
if not Q4_0_QS == IQ4_NL_QS == MXFP4_QS:
    raise ImportError("Q4_0's, IQ4_NL's and MXFP4's codes no longer start their stored blocks alike")
# The formats this decode takes (every other keeps `unit_values`' path): the tile table's (`kernels`), which
# gives each its tiles.
FORMATS = moe_kernels.MOE_WORDS_FORMATS
# The values a step may take: a super-block's half or whole (a Q6_K half is its natural unit), four or eight
# 32-value blocks.
STEPS = (128, 256)
QK_K_VALUES = tl.constexpr(256)  # a super-block's values
SIGN_SHIFT = tl.constexpr(24)  # an int8 at the top of a word: shifted back down with its sign
BYTE_MISALIGN = tl.constexpr(3)  # a byte address's offset in its word


def takes(fmt: Format) -> bool:
    """Whether the word decode takes `fmt` (any row length: the grouped GEMM's K steps are whole blocks)."""
    return Format(fmt) in FORMATS


@triton.jit
def _f16_half(word, HIGH: tl.constexpr):
    """The f16 in the low (or high) half of each 32-bit word, as f32."""
    bits = (word >> (HALF_WORD_BITS * HIGH)) & F16_BITS
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_pairs_tile(w, off, part, FMT: tl.constexpr, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """[BLOCK_N, KW] f32: values part * KW on of the Q4_K or Q5_K super-blocks at byte offsets `off` ([BLOCK_N]
    int64, 4-aligned) of `w`; Q5_K's fifth bit of value 64j + 32h + l is bit 2j + h of qh byte l."""
    if FMT == FMT_Q5_K:
        qs_at, scales_at = Q5_K_QS, Q5_K_SCALES
    else:
        qs_at, scales_at = Q4_K_QS, Q4_K_SCALES
    p = (w + off).to(tl.pointer_type(tl.int32))[:, None, None, None, None]  # [BLOCK_N, 1, 1, 1, 1]
    j = part * (KW // 64) + tl.arange(0, KW // 64)[None, :, None, None, None]  # the qs chunks of 64 values
    h = tl.arange(0, 2)[None, None, :, None, None]
    i = tl.arange(0, 8)[None, None, None, :, None]
    b = tl.arange(0, 4)[None, None, None, None, :]
    words = tl.load(p + qs_at // WORD + j * 8 + i)  # [BLOCK_N, 4, 1, 8, 1]
    code = (words >> (h * NIBBLE_BITS + b * BYTE_BITS)) & NIBBLE  # [BLOCK_N, J, 2, 8, 4]
    if FMT == FMT_Q5_K:
        qh = tl.load(p + Q5_K_QH // WORD + i)  # [BLOCK_N, 1, 1, 8, 1]: qh bytes 4i..4i + 3
        code |= ((qh >> (b * BYTE_BITS + 2 * j + h)) & BIT) << NIBBLE_BITS
    code |= F32_TWO_23_BITS
    head = tl.load(p)  # d, dmin
    sa = tl.load(p + scales_at // WORD)
    sb = tl.load(p + scales_at // WORD + 1)
    sc_ = tl.load(p + scales_at // WORD + 2)
    s = 2 * j + h  # [1, J, 2, 1, 1]: the sub-block
    shift = (s % K_LOW_SUBS) * BYTE_BITS
    low = s < K_LOW_SUBS
    sc = tl.where(low, (sa >> shift) & SIX_BITS,
                  ((sc_ >> shift) & NIBBLE) | (((sa >> (shift + K_TOP_SHIFT)) & CRUMB) << NIBBLE_BITS))  # fmt: skip
    mn_high = ((sc_ >> (shift + NIBBLE_BITS)) & NIBBLE) | (((sb >> (shift + K_TOP_SHIFT)) & CRUMB) << NIBBLE_BITS)
    mn = tl.where(low, (sb >> shift) & SIX_BITS, mn_high)
    d_sc = _f16_half(head, 0) * sc.to(tl.float32)  # [BLOCK_N, J, 2, 1, 1]
    dmin_mn = _f16_half(head, 1) * mn.to(tl.float32)
    v = d_sc * in_two_23(code, 0) - dmin_mn
    return tl.reshape(v, [BLOCK_N, KW])


@triton.jit
def _word_at(p, mis):
    """The 32-bit words `mis` bits (0 or 16: where the block sits past its word) past the aligned uint32 words
    `p`: those words themselves, or the two aligned words around each, funnel-shifted."""
    lo = tl.load(p)
    hi = tl.load(p + 1, mask=mis > 0, other=0)  # an aligned block reads no byte past its own
    return (lo >> mis) | (hi << HALF_WORD_BITS)


@triton.jit
def _q6_k_tile(w, off, doff, part, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """[BLOCK_N, KW] f32: values part * KW on of the Q6_K super-blocks at byte offsets `off` ([BLOCK_N] int64,
    2-aligned) of `w`, their d's at `doff` (after their rows' blocks, `block_d`)."""
    lead = off & BYTE_MISALIGN
    mis = (lead * BYTE_BITS).to(tl.uint32)[:, None, None, None, None]  # 0 or 16
    p = (w + off - lead).to(tl.pointer_type(tl.uint32))[:, None, None, None, None]  # [BLOCK_N, 1, 1, 1, 1]
    hh = part * (KW // 128) + tl.arange(0, KW // 128)[None, :, None, None, None]  # the halves
    nib = tl.arange(0, 2)[None, None, :, None, None]  # the nibble
    a = tl.arange(0, 16)[None, None, None, :, None]  # the word of the half's ql
    c = tl.arange(0, 4)[None, None, None, None, :]  # the byte of the word
    ql = _word_at(p + Q6_K_QL // WORD + 16 * hh + a, mis)  # [BLOCK_N, H, 1, 16, 1]
    qh = _word_at(p + Q6_K_QH // WORD + 8 * hh + a % 8, mis)
    low = (ql >> (c * BYTE_BITS + nib * NIBBLE_BITS).to(tl.uint32)) & NIBBLE  # [BLOCK_N, H, 2, 16, 4]
    top = (qh >> (c * BYTE_BITS + (a // 8) * 2 + nib * NIBBLE_BITS).to(tl.uint32)) & CRUMB
    code = (low | (top << NIBBLE_BITS) | F32_TWO_23_BITS).to(tl.int32, bitcast=True)
    sw = _word_at(p + Q6_K_SCALES // WORD + 2 * hh + nib, mis).to(tl.int32, bitcast=True)  # [BLOCK_N, H, 2, 1, 1]
    sc = (sw << ((a // 4) * -BYTE_BITS + SIGN_SHIFT)) >> SIGN_SHIFT  # [BLOCK_N, H, 2, 16, 1]: signed
    d = _f16_at(w, doff)[:, None, None, None, None]
    v = (d * sc.to(tl.float32)) * in_two_23(code, Q6_BIAS)
    return tl.reshape(v, [BLOCK_N, KW])


@triton.jit
def _at(w, off, F: tl.constexpr):
    """The aligned uint32 pointers and the funnel shift (0 or 16 bits) of field F of the 2-aligned blocks at byte
    offsets `off` of `w`."""
    lead = (off + F) & BYTE_MISALIGN
    return (w + off + F - lead).to(tl.pointer_type(tl.uint32)), (lead * BYTE_BITS).to(tl.uint32)


@triton.jit
def _f16_at(w, off):
    """The f16 at the 2-aligned byte offsets `off` of `w`, as f32, from the aligned word holding it."""
    p, mis = _at(w, off, 0)
    return _f16_half((tl.load(p) >> mis).to(tl.int32, bitcast=True), 0)


@triton.jit
def _q8_0_tile(w, off, doff, part, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """[BLOCK_N, KW] f32: values part * KW on of the Q8_0 rows at byte offsets `off`: KW // 32 blocks of 32 codes
    as the device keeps them (their d's from `doff` on, after the row's blocks: `block_d`), [BLOCK_N, block, 8
    (word), 4 (byte)]; value = d * q, q the signed byte (through the 2^23 trick with its sign bit flipped: q + 128)."""
    u = (part * (KW // 32) + tl.arange(0, KW // 32))[None, :, None, None]
    blk = off[:, None, None, None] + u * Q8_0_BYTES
    p, mis = _at(w, blk, Q8_0_QS)
    words = _word_at(p + tl.arange(0, 8)[None, None, :, None], mis)  # [BLOCK_N, U, 8, 1]
    c = tl.arange(0, 4)[None, None, None, :]
    code = (((words >> (c * BYTE_BITS).to(tl.uint32)) & BYTE) ^ SIGN_BIT) | F32_TWO_23_BITS
    d = _f16_at(w, doff[:, None, None, None] + u * Q8_0_D_BYTES)
    v = d * in_two_23(code.to(tl.int32, bitcast=True), SIGNED_BYTE_BIAS)
    return tl.reshape(v, [BLOCK_N, KW])


@triton.jit
def _q5_0_tile(w, off, part, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """[BLOCK_N, KW] f32: values part * KW on of the Q5_0 rows at byte offsets `off`: KW // 32 blocks of 22
    bytes, [BLOCK_N, block, 2 (nibble), 4 (word of qs), 4 (byte)] (value 16 * nibble + 4 * word + byte), the
    fifth bit that value's bit of qh; value = d * (code - 16)."""
    u = part * (KW // 32) + tl.arange(0, KW // 32)
    blk = off[:, None, None, None, None] + u[None, :, None, None, None] * Q5_0_BYTES
    nib = tl.arange(0, 2)[None, None, :, None, None]
    i = tl.arange(0, 4)[None, None, None, :, None]
    c = tl.arange(0, 4)[None, None, None, None, :]
    p, mis = _at(w, blk, Q5_0_QS)
    qs = _word_at(p + i, mis)  # [BLOCK_N, U, 1, 4, 1]
    p, mis = _at(w, blk, Q5_0_QH)
    qh = _word_at(p, mis)  # [BLOCK_N, U, 1, 1, 1]
    low = (qs >> (c * BYTE_BITS + nib * NIBBLE_BITS).to(tl.uint32)) & NIBBLE
    top = (qh >> (nib * HALF_QK + i * WORD + c).to(tl.uint32)) & BIT
    code = (low | (top << NIBBLE_BITS) | F32_TWO_23_BITS).to(tl.int32, bitcast=True)
    v = _f16_at(w, blk) * in_two_23(code, Q5_BIAS)
    return tl.reshape(v, [BLOCK_N, KW])


@triton.jit
def _nibbles_tile(w, off, doff, part, FMT: tl.constexpr, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """[BLOCK_N, KW] f32: values part * KW on of the Q4_0, IQ4_NL or MXFP4 rows at byte offsets `off`: KW // 32
    blocks of 16 code bytes as the device keeps them (each block's d, or MXFP4's exponent byte, from `doff` on,
    after the row's blocks), [BLOCK_N, block, 2 (nibble), 4 (word), 4 (byte)] (value 16 * nibble + 4 * word +
    byte, as Q5_0's qs); value = d * (code - 8), d * table[code], or 2^(e - 128) * table[code]: each factor exact
    in f32 and so their product."""
    u = part * (KW // 32) + tl.arange(0, KW // 32)
    blk = off[:, None, None, None, None] + u[None, :, None, None, None] * STORED_BYTES_C[FMT]
    nib = tl.arange(0, 2)[None, None, :, None, None]
    i = tl.arange(0, 4)[None, None, None, :, None]
    c = tl.arange(0, 4)[None, None, None, None, :]
    p, mis = _at(w, blk, NIBBLES_QS)
    qs = _word_at(p + i, mis)  # [BLOCK_N, U, 1, 4, 1]
    code = ((qs >> (c * BYTE_BITS + nib * NIBBLE_BITS).to(tl.uint32)) & NIBBLE).to(tl.int32)
    tail = w + doff[:, None, None, None, None] + u[None, :, None, None, None] * TAIL_BYTES_C[FMT]
    if FMT == FMT_MXFP4:
        v = load_e8m0(tail) * iq4_value(code, True)
    elif FMT == FMT_IQ4_NL:
        v = load_f16(tail) * iq4_value(code)
    else:
        v = load_f16(tail) * (code - Q4_BIAS).to(tl.float32)
    return tl.reshape(v, [BLOCK_N, KW])


@triton.jit
def _iq4_xs_tile(w, off, doff, part, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """[BLOCK_N, KW] f32: values part * KW on of the IQ4_XS super-blocks at byte offsets `off` (their 128 code
    bytes as the device keeps them; each block's d, scales_h and scales_l, 8 bytes, from `doff` on, after the
    row's blocks), [BLOCK_N, run, 2 (nibble), 4 (word), 4 (byte)]: value 32 run + 16 nibble + 4 word + byte,
    = (d * (scale - 32)) * table[code], the run's signed 6-bit scale its nibble of scales_l under its crumb of
    scales_h (`low_bits.iq4_xs_values`' order of products)."""
    R: tl.constexpr = KW // 32
    run = part * R + tl.arange(0, R)[None, :, None, None, None]
    nib = tl.arange(0, 2)[None, None, :, None, None]
    i = tl.arange(0, 4)[None, None, None, :, None]
    c = tl.arange(0, 4)[None, None, None, None, :]
    p = (w + off).to(tl.pointer_type(tl.int32))[:, None, None, None, None]
    qs = tl.load(p + IQ4_XS_QS // WORD + run * (HALF_QK // WORD) + i)  # [BLOCK_N, R, 1, 4, 1]
    code = (qs >> (c * BYTE_BITS + nib * NIBBLE_BITS)) & NIBBLE
    head = (w + doff).to(tl.pointer_type(tl.int32))[:, None, None, None, None]
    d_h = tl.load(head)  # d, then scales_h
    low_scales = tl.load(head + IQ4_XS_SCALES_L // WORD)
    low = (low_scales >> ((run // 2) * BYTE_BITS + (run % 2) * NIBBLE_BITS)) & NIBBLE
    top = (d_h >> (2 * run + IQ4_XS_SCALES_H * BYTE_BITS)) & CRUMB  # the tensor first: see `low_bits._bits`
    scale = ((low | (top << NIBBLE_BITS)) - SIGNED_SCALE).to(tl.float32)  # [BLOCK_N, R, 1, 1, 1]
    v = (_f16_half(d_h, 0) * scale) * iq4_value(code)
    return tl.reshape(v, [BLOCK_N, KW])


@triton.jit
def _crumbs(w, off, part, QS: tl.constexpr, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """Q2_K's / Q3_K's 2-bit codes of values part * KW on, [BLOCK_N, half, 4 (j), 8 (i), 4 (b)] (value 128 half +
    32j + 4i + b: crumb j of qs byte 32 half + 4i + b), with the tile's half, j, i and b and its sub-blocks of 16."""
    H: tl.constexpr = KW // 128
    h = part * H + tl.arange(0, H)[None, :, None, None, None]
    j = tl.arange(0, 4)[None, None, :, None, None]
    i = tl.arange(0, 8)[None, None, None, :, None]
    b = tl.arange(0, 4)[None, None, None, None, :]
    p = (w + off).to(tl.pointer_type(tl.int32))[:, None, None, None, None]
    qs = tl.load(p + QS // WORD + h * (HALF_QS // WORD) + i)  # [BLOCK_N, H, 1, 8, 1]
    code = (qs >> (b * BYTE_BITS + 2 * j)) & CRUMB
    return code, h, j, i, b, h * (QK_K_VALUES // 2 // K_SUB) + 2 * j + i // (K_SUB // WORD)


@triton.jit
def _q2_k_tile(w, off, part, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """[BLOCK_N, KW] f32: values part * KW on of the Q2_K super-blocks at byte offsets `off` (84-byte blocks, so
    4-aligned): value = (d * scale) * code - dmin * min, a sub-block's 4-bit scale and min one scales byte
    (`low_bits.q2_k_values`' order of products)."""
    code, h, j, i, b, sub = _crumbs(w, off, part, Q2_K_QS, BLOCK_N, KW)
    packed = tl.load((w + off)[:, None, None, None, None] + Q2_K_SCALES + sub).to(tl.int32)  # [BLOCK_N, H, 4, 8, 1]
    head = tl.load((w + off).to(tl.pointer_type(tl.int32))[:, None, None, None, None] + Q2_K_D // WORD)  # d, dmin
    scaled = (_f16_half(head, 0) * (packed & NIBBLE).to(tl.float32)) * code.to(tl.float32)
    v = scaled - _f16_half(head, 1) * (packed >> NIBBLE_BITS).to(tl.float32)
    return tl.reshape(v, [BLOCK_N, KW])


@triton.jit
def _q3_k_tile(w, off, part, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """[BLOCK_N, KW] f32: values part * KW on of the Q3_K super-blocks at byte offsets `off` (110 bytes each in
    112 as the device keeps them): value = (d * (scale - 32)) * (code - 4 (1 - hbit)), the third bit bit 4 half + j
    of hmask byte 4i + b, a sub-block's signed 6-bit scale its nibble of the first 8 scales bytes under its crumb
    of the last 4 (`low_bits.q3_k_values`' order of products)."""
    code, h, j, i, b, sub = _crumbs(w, off, part, Q3_K_QS, BLOCK_N, KW)
    p = (w + off).to(tl.pointer_type(tl.int32))[:, None, None, None, None]
    hmask = tl.load(p + Q3_K_HMASK // WORD + i)  # [BLOCK_N, 1, 1, 8, 1]
    hbit = (hmask >> (b * BYTE_BITS + h * 4 + j)) & BIT
    code = code + hbit * Q3_BIAS_CODE - Q3_BIAS_CODE
    scales = (w + off)[:, None, None, None, None] + Q3_K_SCALES
    low = (tl.load(scales + sub % Q3_LOW_SCALES).to(tl.int32) >> ((sub // Q3_LOW_SCALES) * NIBBLE_BITS)) & NIBBLE
    top = (
        tl.load(scales + (sub % Q3_SCALE_ROWS + Q3_HIGH_SCALES)).to(tl.int32) >> (2 * (sub // Q3_SCALE_ROWS))
    ) & CRUMB
    scale = (low | (top << NIBBLE_BITS)) - SIGNED_SCALE
    d = _f16_at(w, off[:, None, None, None, None] + Q3_K_D)
    v = (d * scale.to(tl.float32)) * code.to(tl.float32)
    return tl.reshape(v, [BLOCK_N, KW])


@triton.jit
def word_tile(w, off, doff, part, FMT: tl.constexpr, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """[BLOCK_N, KW] f16: values part * KW on (KW 128 or 256: `STEPS`) of the super-blocks at byte offsets `off`
    ([BLOCK_N] int64) of `w` (uint8), decoded; `doff` their d's where the format keeps them apart (`block_d`)."""
    if (FMT == FMT_Q4_K) | (FMT == FMT_Q5_K):
        v = _k_pairs_tile(w, off, part, FMT, BLOCK_N, KW)
    elif FMT == FMT_Q6_K:
        v = _q6_k_tile(w, off, doff, part, BLOCK_N, KW)
    elif FMT == FMT_Q8_0:
        v = _q8_0_tile(w, off, doff, part, BLOCK_N, KW)
    elif FMT == FMT_IQ4_XS:
        v = _iq4_xs_tile(w, off, doff, part, BLOCK_N, KW)
    elif FMT == FMT_Q2_K:
        v = _q2_k_tile(w, off, part, BLOCK_N, KW)
    elif FMT == FMT_Q3_K:
        v = _q3_k_tile(w, off, part, BLOCK_N, KW)
    elif (FMT == FMT_MXFP4) | (FMT == FMT_IQ4_NL) | (FMT == FMT_Q4_0):
        v = _nibbles_tile(w, off, doff, part, FMT, BLOCK_N, KW)
    else:
        tl.static_assert(FMT == FMT_Q5_0, "no word decode for this format")
        v = _q5_0_tile(w, off, part, BLOCK_N, KW)
    return v.to(tl.float16)


@triton.jit
def _decode_kernel(w, out, ROW_BYTES: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr, VALUES: tl.constexpr,
                   NBYTES: tl.constexpr, BLOCK_N: tl.constexpr, KW: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl.begin(PDL)  # out[r, KW s:KW s + KW]: program 0's tile of rows, program 1's step s (the tests' entry)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(1)
    unit, part = (s * KW) // VALUES, (s * KW) % VALUES // KW  # the step's first block, and its part of it
    row = rows.to(tl.int64) * ROW_BYTES
    v = word_tile(w, row + unit * NBYTES, block_d(row, unit, FMT, ROW_BYTES), part, FMT, BLOCK_N, KW)
    cols = s * KW + tl.arange(0, KW)
    tl.store(out + rows[:, None] * K + cols[None, :], v)


def decode(w, fmt: Format, n: int, k: int, out, *, block_n: int = 4, step: int = 256) -> None:
    """out (n, k) f16 = the n x k checkpoint rows `w` in `fmt` decoded as the grouped GEMM does, `step`
    values a step (`block_n` divides n): so each format's word decode is checked against
    `fuselane.gguf.dequant` on its own."""
    fmt = Format(fmt)
    _decode_kernel[(triton.cdiv(n, block_n), k // step)](
        w, out, ROW_BYTES=stored_row_bytes(fmt, k), K=k, FMT=int(fmt), VALUES=LAYOUTS[fmt].values,
        NBYTES=stored_block_bytes(fmt), BLOCK_N=block_n, KW=step, **pdl.options(),
    )  # fmt: skip
