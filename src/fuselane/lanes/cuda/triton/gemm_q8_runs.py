"""One 32-value run of a tile of weight rows as the int8 GEMM multiplies it: int8 codes, scales and offsets.

`run(blk, J, FMT, lut)` takes `blk`, [BLOCK_N] uint8 pointers each to its row's block (a K format's
super-block, else a 32-value block) as the checkpoint stores it, and J, the run within the block (0-7 in a
super-block, 0 otherwise), and returns

    codes [BLOCK_N, 32] int8, s0, s1, m0, m1 [BLOCK_N] f32

with every weight of the run = s * code + m, (s0, m0) for its values 0-15 and (s1, m1) for 16-31 (the same
pair twice but in Q2_K, Q3_K and Q6_K, whose 16-value sub-blocks have scales of their own). Each format is
one small body: its code unpack and its run's scale and offset, from `formats.LAYOUTS`' byte offsets
(`gemv.layout`). The codes are the format's own (signed where the format subtracts a bias; the IQ4 formats'
are the values of their table, -127..113, read from `lut`), so s * code + m is the f32 weight
`fuselane.gguf.dequant` gives: s is d (times a sub-block scale, exact in f32), m the minimum (-dmin times a
K format's integer min, exact).

A run's bytes of a row are contiguous (a Q4_K pair's 32 qs bytes, a Q8_0 block's 32 codes), so a tile's
load is BLOCK_N rows of 16-32 contiguous bytes: the vector loads the layout's alignment allows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.triton.gemv.layout import (
    BIT,
    CRUMB,
    FMT_Q4_0,
    FMT_Q4_1,
    FMT_Q4_K,
    FMT_Q5_0,
    FMT_Q5_1,
    FMT_Q5_K,
    FMT_Q6_K,
    FMT_Q8_0,
    HALF_QK,
    K_LOW_SUBS,
    NIBBLE,
    NIBBLE_BITS,
    Q4_0_D,
    Q4_0_QS,
    Q4_1_D,
    Q4_1_M,
    Q4_1_QS,
    Q4_BIAS,
    Q4_K_D,
    Q4_K_DMIN,
    Q4_K_QS,
    Q4_K_SCALES,
    Q5_0_D,
    Q5_0_QH,
    Q5_0_QS,
    Q5_1_D,
    Q5_1_M,
    Q5_1_QH,
    Q5_1_QS,
    Q5_BIAS,
    Q5_K_D,
    Q5_K_DMIN,
    Q5_K_QH,
    Q5_K_QS,
    Q5_K_SCALES,
    Q6_BIAS,
    Q6_HALF_SLOTS,
    Q6_K_D,
    Q6_K_QH,
    Q6_K_QL,
    Q6_K_SCALES,
    Q6_QH_HALF,
    Q6_QL_HALF,
    Q8_0_D,
    Q8_0_QS,
    QK_C,
    SIX_BITS,
    const,
    load_f16,
    offset,
)

K_TOP = const(6)  # a Q4_K / Q5_K scale byte of sub-blocks 0-3 keeps a later sub-block's top 2 bits from bit 6
K_MINS = const(4)  # the mins' bytes follow the four scale bytes of sub-blocks 0-3
K_LOW_NIBBLES = const(8)  # bytes 8-11 hold sub-blocks 4-7's low bits: the scale's low nibble, the min's high
BYTE_BITS = const(8)

FMT_Q2_K, FMT_Q3_K = const(Format.Q2_K.value), const(Format.Q3_K.value)
FMT_IQ4_NL, FMT_IQ4_XS = const(Format.IQ4_NL.value), const(Format.IQ4_XS.value)
Q2_K_SCALES, Q2_K_QS = offset(Format.Q2_K, "scales"), offset(Format.Q2_K, "qs")
Q2_K_D, Q2_K_DMIN = offset(Format.Q2_K, "d"), offset(Format.Q2_K, "dmin")
Q3_K_HMASK, Q3_K_QS = offset(Format.Q3_K, "hmask"), offset(Format.Q3_K, "qs")
Q3_K_SCALES, Q3_K_D = offset(Format.Q3_K, "scales"), offset(Format.Q3_K, "d")
IQ4_NL_D, IQ4_NL_QS = offset(Format.IQ4_NL, "d"), offset(Format.IQ4_NL, "qs")
IQ4_XS_D, IQ4_XS_QS = offset(Format.IQ4_XS, "d"), offset(Format.IQ4_XS, "qs")
IQ4_XS_SCALES_H, IQ4_XS_SCALES_L = offset(Format.IQ4_XS, "scales_h"), offset(Format.IQ4_XS, "scales_l")
K2_HALF_RUNS = const(4)  # Q2_K / Q3_K: a half of 128 values is four runs, crumb c of qs byte i of the half
K2_QS_HALF = const(32)  # qs bytes of a half
Q3_BIAS = const(4)  # Q3_K: code = (2 low bits | high bit << 2) - 4
K_SIGNED_SCALE = const(32)  # Q3_K / IQ4_XS: a 6-bit scale stands for scale - 32
Q3_K_LOW_SCALES = const(8)  # Q3_K: scales 0-7 keep their low 4 bits in the low nibbles of bytes 0-7, 8-15 high
Q3_K_HIGH = const(8)  # ...and their top 2 bits as crumb j // 4 of byte 8 + j % 4


@triton.jit
def _bytes(blk, OFF: tl.constexpr, idx):
    """Bytes OFF + idx[j] of each row's block: [BLOCK_N, len(idx)] int32."""
    return tl.load(blk[:, None] + OFF + idx[None, :]).to(tl.int32)


@triton.jit
def _byte(blk, OFF: tl.constexpr):
    """Byte OFF of each row's block: [BLOCK_N] int32."""
    return tl.load(blk + OFF).to(tl.int32)


@triton.jit
def _nibble_run(blk, QS: tl.constexpr):
    """A 32-value block's 4-bit codes: bytes 0-15 hold values 0-15 in their low nibbles, 16-31 in the high."""
    i = tl.arange(0, QK_C)
    b = _bytes(blk, QS, i % HALF_QK)
    return tl.where((i < HALF_QK)[None, :], b & NIBBLE, b >> NIBBLE_BITS)


@triton.jit
def _fifth_bits(blk, QH: tl.constexpr):
    """Q5_0 / Q5_1: bit j of the block's 32-bit qh (little-endian bytes) is value j's top bit, as 16 * bit."""
    i = tl.arange(0, QK_C)
    return ((_bytes(blk, QH, i // BYTE_BITS) >> (i % BYTE_BITS)[None, :]) & BIT) << NIBBLE_BITS


@triton.jit
def _k_scale_min(blk, SCALES: tl.constexpr, J: tl.constexpr):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block J from the 12 packed bytes, [BLOCK_N] int32 each."""
    if J < K_LOW_SUBS:
        sc = _byte(blk, SCALES + J) & SIX_BITS
        mn = _byte(blk, SCALES + K_MINS + J) & SIX_BITS
    else:
        low = _byte(blk, SCALES + K_LOW_NIBBLES + J - K_LOW_SUBS)
        sc = (low & NIBBLE) | ((_byte(blk, SCALES + J - K_LOW_SUBS) >> K_TOP) << NIBBLE_BITS)
        mn = (low >> NIBBLE_BITS) | ((_byte(blk, SCALES + K_MINS + J - K_LOW_SUBS) >> K_TOP) << NIBBLE_BITS)
    return sc, mn


@triton.jit
def _k_run(blk, J: tl.constexpr, D: tl.constexpr, DMIN: tl.constexpr, SCALES: tl.constexpr, QS: tl.constexpr):
    """Q4_K / Q5_K sub-block J: its 4-bit codes (pair J // 2's 32 qs bytes, low nibbles first), d * scale and
    -dmin * min."""
    i = tl.arange(0, QK_C)
    codes = (_bytes(blk, QS + (J // 2) * QK_C, i) >> (NIBBLE_BITS * (J % 2))) & NIBBLE
    sc, mn = _k_scale_min(blk, SCALES, J)
    return codes, load_f16(blk + D) * sc.to(tl.float32), -(load_f16(blk + DMIN) * mn.to(tl.float32))


@triton.jit
def run(blk, J: tl.constexpr, FMT: tl.constexpr, lut):
    """(codes int8 [BLOCK_N, 32], s0, s1, m0, m1 [BLOCK_N] f32) of run J of each row's block (see the module).
    `lut` points at the 16 int8 values of `IQ4_NL_VALUES` (read by the IQ4 formats only)."""
    if FMT == FMT_Q6_K:
        codes, s0, s1, m0, m1 = _q6_k_run(blk, J)
    elif FMT == FMT_Q2_K:
        codes, s0, s1, m0, m1 = _q2_k_run(blk, J)
    elif FMT == FMT_Q3_K:
        codes, s0, s1, m0, m1 = _q3_k_run(blk, J)
    elif FMT == FMT_IQ4_NL:
        codes = tl.load(lut + _nibble_run(blk, IQ4_NL_QS))
        s0 = load_f16(blk + IQ4_NL_D)
        zero = tl.zeros(blk.shape, tl.float32)
        s1, m0, m1 = s0, zero, zero
    elif FMT == FMT_IQ4_XS:
        codes, s0, s1, m0, m1 = _iq4_xs_run(blk, J, lut)
    else:
        codes, s0, s1, m0, m1 = _one_scale_run(blk, J, FMT)
    return codes, s0, s1, m0, m1


@triton.jit
def _one_scale_run(blk, J: tl.constexpr, FMT: tl.constexpr):
    """A run under one scale and one offset (every format but Q6_K)."""
    zero = tl.zeros(blk.shape, tl.float32)
    if FMT == FMT_Q8_0:
        codes = tl.load(blk[:, None] + Q8_0_QS + tl.arange(0, QK_C)[None, :]).to(tl.int32)
        s = load_f16(blk + Q8_0_D)
        m = zero
    elif FMT == FMT_Q4_0:
        codes = _nibble_run(blk, Q4_0_QS) - Q4_BIAS
        s = load_f16(blk + Q4_0_D)
        m = zero
    elif FMT == FMT_Q4_1:
        codes = _nibble_run(blk, Q4_1_QS)
        s = load_f16(blk + Q4_1_D)
        m = load_f16(blk + Q4_1_M)
    elif FMT == FMT_Q5_0:
        codes = (_nibble_run(blk, Q5_0_QS) | _fifth_bits(blk, Q5_0_QH)) - Q5_BIAS
        s = load_f16(blk + Q5_0_D)
        m = zero
    elif FMT == FMT_Q5_1:
        codes = _nibble_run(blk, Q5_1_QS) | _fifth_bits(blk, Q5_1_QH)
        s = load_f16(blk + Q5_1_D)
        m = load_f16(blk + Q5_1_M)
    elif FMT == FMT_Q4_K:
        codes, s, m = _k_run(blk, J, Q4_K_D, Q4_K_DMIN, Q4_K_SCALES, Q4_K_QS)
    else:
        tl.static_assert(FMT == FMT_Q5_K, "the int8 GEMM has no body for this format")
        codes, s, m = _k_run(blk, J, Q5_K_D, Q5_K_DMIN, Q5_K_SCALES, Q5_K_QS)
        # sub-block J takes its fifth bit from bit J of each of the 32 qh bytes
        codes = codes | (((_bytes(blk, Q5_K_QH, tl.arange(0, QK_C)) >> J) & BIT) << NIBBLE_BITS)
    return codes.to(tl.int8), s, s, m, m


@triton.jit
def _q6_k_run(blk, J: tl.constexpr):
    """Q6_K run J: half J // 4, quarter q = J % 4 of it. Its low nibbles are ql bytes (q % 2) * 32 + i of the
    half (low nibbles for q < 2, high after), its top 2 bits crumb q of qh byte i of the half; two int8
    sub-block scales times d."""
    i = tl.arange(0, QK_C)
    half: tl.constexpr = J // Q6_HALF_SLOTS
    q: tl.constexpr = J - half * Q6_HALF_SLOTS
    low = _bytes(blk, Q6_K_QL + half * Q6_QL_HALF + (q % 2) * QK_C, i) >> (NIBBLE_BITS * (q // 2))
    top = (_bytes(blk, Q6_K_QH + half * Q6_QH_HALF, i) >> (2 * q)) & CRUMB
    codes = ((low & NIBBLE) | (top << NIBBLE_BITS)) - Q6_BIAS
    d = load_f16(blk + Q6_K_D)
    sc = blk.to(tl.pointer_type(tl.int8)) + Q6_K_SCALES + 2 * J
    s0 = d * tl.load(sc).to(tl.float32)
    s1 = d * tl.load(sc + 1).to(tl.float32)
    zero = tl.zeros(blk.shape, tl.float32)
    return codes.to(tl.int8), s0, s1, zero, zero


@triton.jit
def _crumb_run(blk, QS: tl.constexpr, J: tl.constexpr):
    """Q2_K / Q3_K run J's 2-bit codes: crumb J % 4 of qs bytes 0-31 of half J // 4."""
    half: tl.constexpr = J // K2_HALF_RUNS
    c: tl.constexpr = J - half * K2_HALF_RUNS
    return (_bytes(blk, QS + half * K2_QS_HALF, tl.arange(0, QK_C)) >> (2 * c)) & CRUMB


@triton.jit
def _q2_k_run(blk, J: tl.constexpr):
    """Q2_K run J: 2-bit codes; sub-blocks 2J and 2J + 1 of 16 each take d * (scale byte's low nibble) and
    -dmin * (its high nibble)."""
    d, dmin = load_f16(blk + Q2_K_D), load_f16(blk + Q2_K_DMIN)
    b0, b1 = _byte(blk, Q2_K_SCALES + 2 * J), _byte(blk, Q2_K_SCALES + 2 * J + 1)
    s0, s1 = d * (b0 & NIBBLE).to(tl.float32), d * (b1 & NIBBLE).to(tl.float32)
    m0, m1 = -(dmin * (b0 >> NIBBLE_BITS).to(tl.float32)), -(dmin * (b1 >> NIBBLE_BITS).to(tl.float32))
    return _crumb_run(blk, Q2_K_QS, J).to(tl.int8), s0, s1, m0, m1


@triton.jit
def _q3_k_scale(blk, S: tl.constexpr):
    """Q3_K's signed 6-bit scale S (0-15), as f32."""
    if S < Q3_K_LOW_SCALES:
        low = _byte(blk, Q3_K_SCALES + S) & NIBBLE
    else:
        low = _byte(blk, Q3_K_SCALES + S - Q3_K_LOW_SCALES) >> NIBBLE_BITS
    top = (_byte(blk, Q3_K_SCALES + Q3_K_HIGH + S % 4) >> (2 * (S // 4))) & CRUMB
    return ((low | (top << NIBBLE_BITS)) - K_SIGNED_SCALE).to(tl.float32)


@triton.jit
def _q3_k_run(blk, J: tl.constexpr):
    """Q3_K run J: 2-bit codes with bit J of each hmask byte as their third bit, less 4; sub-blocks 2J and
    2J + 1 take d times their signed scales."""
    high = ((_bytes(blk, Q3_K_HMASK, tl.arange(0, QK_C)) >> J) & BIT) << 2
    codes = (_crumb_run(blk, Q3_K_QS, J) | high) - Q3_BIAS
    d = load_f16(blk + Q3_K_D)
    zero = tl.zeros(blk.shape, tl.float32)
    return codes.to(tl.int8), d * _q3_k_scale(blk, 2 * J), d * _q3_k_scale(blk, 2 * J + 1), zero, zero


@triton.jit
def _iq4_xs_run(blk, J: tl.constexpr, lut):
    """IQ4_XS run J: the table's values of 16 qs bytes' nibbles (low: values 0-15, high: 16-31), under d times
    the run's signed 6-bit scale (a nibble of scales_l byte J // 2, and crumb J of the u16 scales_h)."""
    i = tl.arange(0, QK_C)
    b = _bytes(blk, IQ4_XS_QS + J * HALF_QK, i % HALF_QK)
    codes = tl.load(lut + tl.where((i < HALF_QK)[None, :], b & NIBBLE, b >> NIBBLE_BITS))
    low = (_byte(blk, IQ4_XS_SCALES_L + J // 2) >> (NIBBLE_BITS * (J % 2))) & NIBBLE
    scales_h = _byte(blk, IQ4_XS_SCALES_H) | (_byte(blk, IQ4_XS_SCALES_H + 1) << BYTE_BITS)
    top = (scales_h >> (2 * J)) & CRUMB
    s = load_f16(blk + IQ4_XS_D) * ((low | (top << NIBBLE_BITS)) - K_SIGNED_SCALE).to(tl.float32)
    zero = tl.zeros(blk.shape, tl.float32)
    return codes, s, s, zero, zero
