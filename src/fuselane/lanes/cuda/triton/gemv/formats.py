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
launcher (`gemv._plan`) picks SPLIT and UNITS so that the slots of a row are the block's threads a row and
the values a thread holds fit its registers.

Why the loops look the way they do:
- Values are never put back in order. A slot's codes come out in whatever arrangement the layout packs them
  (a byte's low and high nibbles are values 16, 32 or 64 apart); the activations are loaded in that
  arrangement instead.
- Codes become floats by the 2^23 trick (`_in_two_23`): OR-ing an integer below 2^23 into the bits of 2^23
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

from fuselane.gguf.formats import LAYOUTS, QK, QK_K, Format

# --- layout facts, as constexprs the kernels can read --------------------------------------------------------


def _c(value: int | float) -> tl.constexpr:
    return tl.constexpr(value)


def _off(fmt: Format, field: str) -> tl.constexpr:
    return _c(LAYOUTS[fmt].field(field).offset)


def _nbytes(fmt: Format) -> tl.constexpr:
    return _c(LAYOUTS[fmt].nbytes)


FMT_F32, FMT_F16, FMT_BF16 = _c(Format.F32.value), _c(Format.F16.value), _c(Format.BF16.value)
FMT_Q8_0, FMT_Q4_0, FMT_Q4_1 = _c(Format.Q8_0.value), _c(Format.Q4_0.value), _c(Format.Q4_1.value)
FMT_Q5_0, FMT_Q5_1 = _c(Format.Q5_0.value), _c(Format.Q5_1.value)
FMT_Q4_K, FMT_Q5_K, FMT_Q6_K = _c(Format.Q4_K.value), _c(Format.Q5_K.value), _c(Format.Q6_K.value)

QK_C = _c(QK)  # values of a 32-value block
HALF_QK = _c(QK // 2)  # a 32-value 4-bit block's bytes: low nibbles are values 0-15, high nibbles 16-31
QK_K_C = _c(QK_K)  # values of a K super-block
NO_FIELD = _c(-1)  # a field offset a format does not have

Q8_0_BYTES, Q8_0_D, Q8_0_QS = _nbytes(Format.Q8_0), _off(Format.Q8_0, "d"), _off(Format.Q8_0, "qs")
Q4_0_BYTES, Q4_0_D, Q4_0_QS = _nbytes(Format.Q4_0), _off(Format.Q4_0, "d"), _off(Format.Q4_0, "qs")
Q4_1_BYTES, Q4_1_D, Q4_1_QS = _nbytes(Format.Q4_1), _off(Format.Q4_1, "d"), _off(Format.Q4_1, "qs")
Q4_1_M = _off(Format.Q4_1, "m")
Q5_0_BYTES, Q5_0_D, Q5_0_QS = _nbytes(Format.Q5_0), _off(Format.Q5_0, "d"), _off(Format.Q5_0, "qs")
Q5_0_QH = _off(Format.Q5_0, "qh")
Q5_1_BYTES, Q5_1_D, Q5_1_QS = _nbytes(Format.Q5_1), _off(Format.Q5_1, "d"), _off(Format.Q5_1, "qs")
Q5_1_M, Q5_1_QH = _off(Format.Q5_1, "m"), _off(Format.Q5_1, "qh")
Q4_K_BYTES, Q4_K_D, Q4_K_DMIN = _nbytes(Format.Q4_K), _off(Format.Q4_K, "d"), _off(Format.Q4_K, "dmin")
Q4_K_SCALES, Q4_K_QS = _off(Format.Q4_K, "scales"), _off(Format.Q4_K, "qs")
Q5_K_BYTES, Q5_K_D, Q5_K_DMIN = _nbytes(Format.Q5_K), _off(Format.Q5_K, "d"), _off(Format.Q5_K, "dmin")
Q5_K_SCALES, Q5_K_QH, Q5_K_QS = _off(Format.Q5_K, "scales"), _off(Format.Q5_K, "qh"), _off(Format.Q5_K, "qs")
Q6_K_BYTES, Q6_K_D, Q6_K_SCALES = _nbytes(Format.Q6_K), _off(Format.Q6_K, "d"), _off(Format.Q6_K, "scales")
Q6_K_QL, Q6_K_QH = _off(Format.Q6_K, "ql"), _off(Format.Q6_K, "qh")

# --- bit facts of the codes (the formats' definitions, as in dequant.py) --------------------------------------

NIBBLE_BITS = _c(4)
NIBBLE = _c(0x0F)
HIGH_NIBBLE = _c(0xF0)  # a byte's high nibble in place: 16 times its code
HIGH_WEIGHT = _c(16)  # what a high nibble kept in place is worth: 16 times its code
HIGH_STEP = _c(1.0 / 16)  # the scale of a code kept 16 times over (a power of two: exact)
CRUMB = _c(0x3)  # a 2-bit field
BIT = _c(0x1)
Q4_BIAS = _c(8)  # Q4_0: value = d * (code - 8)
Q5_BIAS = _c(16)  # Q5_0: value = d * (code - 16)
Q6_BIAS = _c(32)  # Q6_K: value = d * scale * (code - 32)
SIGN_BIT = _c(0x80)  # an int8's sign bit: flipping it turns the signed byte q into the unsigned q + 128
SIGNED_BYTE_BIAS = _c(0x80)
# Q4_K / Q5_K: 8 sub-blocks of 32, their 6-bit scales and mins packed in 12 bytes (three 32-bit words a, b,
# c): sub-blocks 0-3 keep theirs in the low 6 bits of a byte of a (scales) and b (mins); sub-blocks 4-7 take
# their low 4 bits from a nibble of c and their top 2 bits from the top 2 bits of a's (b's) byte.
K_PAIRS = _c(4)  # pairs of sub-blocks: a pair's 32 qs bytes hold the first in low nibbles, the second in high
K_LOW_SUBS = _c(4)  # sub-blocks whose scale and min are whole in one byte
SIX_BITS = _c(0x3F)
K_TOP_SHIFT = _c(6)  # where a byte of a / b keeps the top 2 bits of a later sub-block's scale / min
# Q6_K: two halves of 128 values. Byte b (0..63) of a half's ql holds value b in its low nibble and value
# 64 + b in its high one; qh byte b % 32 of the half holds their top 2 bits, as crumb b // 32 and 2 + b // 32.
Q6_SUB = _c(16)  # values under one Q6_K scale: a slot's 16 ql bytes share one scale a nibble
Q6_SLOTS = _c(8)  # 16-byte runs of ql a super-block has
Q6_HALF_SLOTS = _c(4)  # ... a half has
Q6_HALF = _c(128)  # values of a half
Q6_QL_HALF = _c(64)  # ql bytes of a half
Q6_QH_HALF = _c(32)  # qh bytes of a half
Q6_HIGH_SUBS = _c(4)  # the high nibbles' sub-block is four on from the low nibbles'
Q6_HIGH_CRUMBS = _c(4)  # ... and their top bits two crumbs (4 bits) up qh

WORD = _c(4)  # bytes of the 32-bit words the K formats' headers are loaded as
BYTE_BITS = _c(8)
F16_BITS = _c(0xFFFF)
HALF_WORD_BITS = _c(16)

# The 2^23 trick: 0x4B000000 are the bits of 2.0**23; OR-ing an integer u < 2^23 into them gives the float
# 2^23 + u exactly.
F32_TWO_23_BITS = _c(0x4B000000)
F32_TWO_23 = _c(8388608.0)


def _check_layouts() -> None:
    """Fail at import if a layout no longer has the alignment the loads below take for granted."""
    for fmt in (Format.Q4_K, Format.Q5_K):
        lay = LAYOUTS[fmt]
        if lay.nbytes % WORD.value or lay.field("scales").offset % WORD.value:
            raise RuntimeError(f"{fmt.name}: the GEMV loads its header as 32-bit words; the layout moved")
    for fmt in (Format.Q5_0, Format.Q5_1):
        lay = LAYOUTS[fmt]
        if lay.nbytes % 2 or lay.field("qh").offset % 2:
            raise RuntimeError(f"{fmt.name}: the GEMV loads qh as two 16-bit halves; the layout moved")
    for fmt in (Format.Q8_0, Format.Q4_0, Format.Q4_1, Format.Q5_0, Format.Q5_1, Format.Q6_K):
        lay = LAYOUTS[fmt]
        names = {f.name for f in lay.fields}
        if lay.nbytes % 2 or any(lay.field(f).offset % 2 for f in ("d", "m") if f in names):
            raise RuntimeError(f"{fmt.name}: the GEMV loads f16 scales as 16-bit words; the layout moved")


_check_layouts()


# --- decoding helpers -------------------------------------------------------------------------------------------


@triton.jit
def _in_two_23(bits, BIAS: tl.constexpr):
    """u - BIAS as f32, exactly, from `bits`: 2^23's bits with an integer 0 <= u < 2^23 OR-ed in (the float
    2^23 + u), with one subtraction and no int-to-float convert."""
    return bits.to(tl.float32, bitcast=True) - (F32_TWO_23 + BIAS)


@triton.jit
def _f16(ptr):
    """The f16 at each of `ptr` (uint8 pointers, 2-aligned), as f32."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _word(blk, OFF: tl.constexpr):
    """The aligned 32-bit word holding byte OFF of each block (`blk`: pointers to 4-aligned blocks)."""
    return tl.load((blk + (OFF - OFF % WORD)).to(tl.pointer_type(tl.int32)))


@triton.jit
def _f16_in_word(blk, OFF: tl.constexpr):
    """The f16 at byte OFF of each 4-aligned block, read from its 32-bit word (a load the pipeliner can
    stage asynchronously, which a 2-byte load is not), as f32."""
    bits = (_word(blk, OFF) >> (BYTE_BITS * (OFF % WORD))) & F16_BITS
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(blk, SCALES: tl.constexpr, s):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block s[j] of block blk[r, j] ([N, B] pointers), [N, B]."""
    a = _word(blk, SCALES)
    b = _word(blk, SCALES + WORD)
    c = _word(blk, SCALES + 2 * WORD)
    shift = ((s % K_LOW_SUBS) * BYTE_BITS)[None, :]  # the byte of each word that sub-block s reads
    sc_low = (a >> shift) & SIX_BITS
    mn_low = (b >> shift) & SIX_BITS
    sc_high = ((c >> shift) & NIBBLE) | (((a >> (shift + K_TOP_SHIFT)) & CRUMB) << NIBBLE_BITS)
    mn_high = ((c >> (shift + NIBBLE_BITS)) & NIBBLE) | (((b >> (shift + K_TOP_SHIFT)) & CRUMB) << NIBBLE_BITS)
    low = (s < K_LOW_SUBS)[None, :]
    return tl.where(low, sc_low, sc_high), tl.where(low, mn_low, mn_high)


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
        d, dmin = _f16_in_word(blk, D), _f16_in_word(blk, DMIN)
        sc_lo, mn_lo = _k_scale_min(blk, SCALES, 2 * g)
        sc_hi, mn_hi = _k_scale_min(blk, SCALES, 2 * g + 1)
        # 2^23's bits OR-ed in once for both nibbles, each then kept by one AND
        q = tl.load(blk[None] + (g[None, :] * QK_C + i + QS)[:, None, :]).to(tl.int32) | F32_TWO_23_BITS
        lo, hi = q & (F32_TWO_23_BITS | NIBBLE), q & (F32_TWO_23_BITS | HIGH_NIBBLE)
        if QH >= 0:
            qh = tl.load(blk[None] + (i + QH)[:, None, :]).to(tl.int32)
            lo |= ((qh >> lo_bit) & BIT) << NIBBLE_BITS
            hi |= ((qh >> (lo_bit + 1)) & BIT) << (2 * NIBBLE_BITS)
        w_lo = (d * sc_lo.to(tl.float32))[None] * _in_two_23(lo, 0) - (dmin * mn_lo.to(tl.float32))[None]
        w_hi = (d * sc_hi.to(tl.float32) * HIGH_STEP)[None] * _in_two_23(hi, 0) - (dmin * mn_hi.to(tl.float32))[None]
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
        d = _f16(blk + Q6_K_D)
        scales = (blk + Q6_K_SCALES + sub[None, :]).to(tl.pointer_type(tl.int8))
        sc_lo = tl.load(scales).to(tl.float32)
        sc_hi = tl.load(scales + Q6_HIGH_SUBS).to(tl.float32)
        ql = tl.load(blk[None] + ql_byte[:, None, :]).to(tl.int32) | F32_TWO_23_BITS
        qh = tl.load(blk[None] + qh_byte[:, None, :]).to(tl.int32)
        lo = (ql & (F32_TWO_23_BITS | NIBBLE)) | (((qh >> lo_shift) & CRUMB) << NIBBLE_BITS)
        hi = (ql & (F32_TWO_23_BITS | HIGH_NIBBLE)) | (
            ((qh >> (lo_shift + Q6_HIGH_CRUMBS)) & CRUMB) << (2 * NIBBLE_BITS)
        )
        w_lo = (d * sc_lo)[None] * _in_two_23(lo, Q6_BIAS)
        w_hi = (d * sc_hi * HIGH_STEP)[None] * _in_two_23(hi, Q6_BIAS * HIGH_WEIGHT)
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
        d = _f16(blk + Q8_0_D)
        u = tl.load(blk[None] + (i + Q8_0_QS)[:, None, :]).to(tl.int32)
        # one XOR flips the sign bit (q + 128, unsigned) and sets 2^23's bits, which the byte does not touch
        w = d[None] * _in_two_23(u ^ (F32_TWO_23_BITS | SIGN_BIT), SIGNED_BYTE_BIAS)
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
):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1: a slot is (part of) a block's 16 qs bytes; value i < 16 is the low nibble of
    byte i, value 16 + i its high nibble; the 5-bit formats (QH >= 0) add bit i of the little-endian 32-bit qh
    as the fifth bit. value = d * (code - BIAS), plus the block's minimum m where M >= 0."""
    B: tl.constexpr = UNITS * SPLIT
    A: tl.constexpr = HALF_QK // SPLIT
    slot = tl.arange(0, B)
    unit = slot // SPLIT
    i = (slot % SPLIT)[None, :] * A + tl.arange(0, A)[:, None]  # [A, B]
    val = unit[None, :] * QK_C + i
    acc = tl.zeros([BLOCK_M, A, BLOCK_N, B], tl.float32)
    for step in tl.range(0, STEPS, num_stages=STAGES):
        blk = _units(w_rows, step, unit, UNITS, NBYTES)
        d = _f16(blk + D)
        q = tl.load(blk[None] + (i + QS)[:, None, :]).to(tl.int32) | F32_TWO_23_BITS
        lo, hi = q & (F32_TWO_23_BITS | NIBBLE), q & (F32_TWO_23_BITS | HIGH_NIBBLE)
        if QH >= 0:
            qh_ptr = (blk + QH).to(tl.pointer_type(tl.uint16))
            qh = (tl.load(qh_ptr).to(tl.int32) | (tl.load(qh_ptr + 1).to(tl.int32) << HALF_WORD_BITS))[None]
            lo |= ((qh >> i[:, None, :]) & BIT) << NIBBLE_BITS
            hi |= ((qh >> (i + HALF_QK)[:, None, :]) & BIT) << (2 * NIBBLE_BITS)
        w_lo = d[None] * _in_two_23(lo, BIAS)
        w_hi = (d * HIGH_STEP)[None] * _in_two_23(hi, BIAS * HIGH_WEIGHT)
        if M >= 0:
            m = _f16(blk + M)[None]
            w_lo += m
            w_hi += m
        xs = x_rows[:, None, None] + (val + step * (UNITS * QK_C))[None]
        acc = _acc_dot(acc, w_lo, xs)
        acc = _acc_dot(acc, w_hi, xs + HALF_QK)
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
            Q4_0_BYTES, Q4_0_D, NO_FIELD, NO_FIELD, Q4_0_QS, Q4_BIAS,
        )  # fmt: skip
    elif FMT == FMT_Q4_1:
        y = _dot_nibbles(
            w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES,
            Q4_1_BYTES, Q4_1_D, Q4_1_M, NO_FIELD, Q4_1_QS, 0,
        )  # fmt: skip
    elif FMT == FMT_Q5_0:
        y = _dot_nibbles(
            w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES,
            Q5_0_BYTES, Q5_0_D, NO_FIELD, Q5_0_QH, Q5_0_QS, Q5_BIAS,
        )  # fmt: skip
    elif FMT == FMT_Q5_1:
        y = _dot_nibbles(
            w_rows, x_rows, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES,
            Q5_1_BYTES, Q5_1_D, Q5_1_M, Q5_1_QH, Q5_1_QS, 0,
        )  # fmt: skip
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
    Format.F32: Slots(QK, 1, QK),
    Format.F16: Slots(QK, 1, QK),
    Format.BF16: Slots(QK, 1, QK),
}
