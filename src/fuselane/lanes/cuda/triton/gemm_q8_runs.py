"""One 32-value run of a tile of weight rows as the int8 GEMM multiplies it: int8 codes, scales and offsets.

`run(blk, j, FMT, lut)` takes `blk`, [BLOCK_N] uint8 pointers each to its row's block (a K format's
super-block, else a 32-value block) as the checkpoint stores it, and j, the run within the block (0-7 in a
super-block, 0 otherwise; a value of the GEMM's K loop, not a constant: every shift, byte offset and choice
that depends on it is computed, so one loop body serves all eight runs), and returns

    codes [BLOCK_N, 32] int8, s0, s1, m0, m1 [BLOCK_N] f32

with every weight of the run = s * code + m, (s0, m0) for its values 0-15 and (s1, m1) for 16-31 (the same
pair twice but in Q2_K, Q3_K and Q6_K, whose 16-value sub-blocks have scales of their own). Each format is
one small body: its code unpack and its run's scale and offset, from `formats.LAYOUTS`' byte offsets
(`gemv.layout`). The codes are the format's own (signed where the format subtracts a bias; the IQ4 formats'
are the values of their table, -127..113, read from `lut`), so s * code + m is the f32 weight
`fuselane.gguf.dequant` gives: s is d (times a sub-block scale, exact in f32), m the minimum (-dmin times a
K format's integer min, exact).

A run's bytes of a row are contiguous (a Q4_K pair's 32 qs bytes, a Q8_0 block's 32 codes), so a tile's
load is BLOCK_N rows of 16-32 contiguous bytes. Every byte is read as part of a 32-bit word and taken apart
with shifts: a load of 4 bytes or more a thread is one the software pipeliner can issue ahead as an
asynchronous copy, a 1- or 2-byte load is not (it would wait in every run). Where a format's block is a whole
number of words (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K; IQ4_XS's 128 as the lane keeps them, its header's words after the
row's blocks) its fields are read at their own word offsets (`blk` pointers). The other blocks (Q5_0
22 bytes, Q3_K 110; Q6_K's 208, Q8_0's 32 and Q4_0's and IQ4_NL's 16 as the lane keeps them, whose d lies after
the row's blocks) are read as only 2-aligned, so those bodies take the blocks'
byte offsets (`at`) and read the word at or below each field (`_word_below`); a run of 16 or 32 bytes that
starts 2 past a word boundary is rebuilt from the words there and the words one on (`_run_bytes`). Every
offset into a block is even, so a field never straddles more than two words, and every word read holds a byte
of the matrix (no read past its end).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselane.gguf.formats import LAYOUTS, Format
from fuselane.lanes.cuda.triton.gemv.layout import (
    BIT,
    CRUMB,
    F16_BITS,
    FMT_Q4_0,
    FMT_Q4_1,
    FMT_Q4_K,
    FMT_Q5_0,
    FMT_Q5_1,
    FMT_Q5_K,
    FMT_Q6_K,
    FMT_Q8_0,
    HALF_QK,
    IQ4_XS_SCALES_L,
    K_LOW_SUBS,
    NIBBLE,
    NIBBLE_BITS,
    Q4_0_QS,
    Q4_1_D,
    Q4_1_QS,
    Q4_BIAS,
    Q4_K_D,
    Q4_K_QS,
    Q4_K_SCALES,
    Q5_0_D,
    Q5_0_QH,
    Q5_0_QS,
    Q5_1_D,
    Q5_1_QH,
    Q5_1_QS,
    Q5_BIAS,
    Q5_K_D,
    Q5_K_QH,
    Q5_K_QS,
    Q5_K_SCALES,
    Q6_BIAS,
    Q6_HALF_SLOTS,
    Q6_K_QH,
    Q6_K_QL,
    Q6_K_SCALES,
    Q6_QH_HALF,
    Q6_QL_HALF,
    Q8_0_QS,
    QK_C,
    SIX_BITS,
    WORD,
    const,
    offset,
)

K_TOP = const(6)  # a Q4_K / Q5_K scale byte of sub-blocks 0-3 keeps a later sub-block's top 2 bits from bit 6
BYTE_BITS = const(8)
BYTE = const(0xFF)
HALF_WORD_BITS = const(16)  # a word's upper f16 (a K format's dmin, Q4_1's m) and IQ4_XS's scales_h

FMT_Q2_K, FMT_Q3_K = const(Format.Q2_K.value), const(Format.Q3_K.value)
FMT_IQ4_NL, FMT_IQ4_XS = const(Format.IQ4_NL.value), const(Format.IQ4_XS.value)
Q2_K_SCALES, Q2_K_QS = offset(Format.Q2_K, "scales"), offset(Format.Q2_K, "qs")
Q2_K_D = offset(Format.Q2_K, "d")  # dmin is the same word's upper half
Q3_K_HMASK, Q3_K_QS = offset(Format.Q3_K, "hmask"), offset(Format.Q3_K, "qs")
Q3_K_SCALES, Q3_K_D = offset(Format.Q3_K, "scales"), offset(Format.Q3_K, "d")
IQ4_NL_QS, IQ4_XS_QS = offset(Format.IQ4_NL, "qs"), offset(Format.IQ4_XS, "qs")
K2_HALF_RUNS = const(4)  # Q2_K / Q3_K: a half of 128 values is four runs, crumb c of qs byte i of the half
K2_QS_HALF = const(32)  # qs bytes of a half
Q3_BIAS = const(4)  # Q3_K: code = (2 low bits | high bit << 2) - 4
K_SIGNED_SCALE = const(32)  # Q3_K / IQ4_XS: a 6-bit scale stands for scale - 32
Q3_K_LOW_SCALES = const(8)  # Q3_K: scales 0-7 keep their low 4 bits in the low nibbles of bytes 0-7, 8-15 high
Q3_K_HIGH = const(8)  # ...and their top 2 bits as crumb s // 4 of byte 8 + s % 4
SUBS_A_RUN = const(2)  # Q2_K / Q3_K / Q6_K: 16-value sub-blocks a run
WORD_DOWN = const(-4)  # an offset & this: the word boundary at or below it (a mask: no signed division)
WORD_BYTE = const(3)  # an offset & this: its byte in its word


# the formats read as 32-bit words, and the field each keeps in the upper half of d's word
_WORD_PAIRS = {
    Format.Q4_1: "m",
    Format.Q5_1: "m",
    Format.Q2_K: "dmin",
    Format.Q4_K: "dmin",
    Format.Q5_K: "dmin",
    Format.IQ4_XS: "scales_h",
}
_WORD_FIELDS = {
    Format.Q5_1: "qh",
    Format.Q2_K: "scales",
    Format.Q4_K: "scales",
    Format.Q5_K: "scales",
    Format.IQ4_XS: "scales_l",
}


def check_word_layouts() -> None:
    """Fail at import if a format read as 32-bit words stops being whole words or its fields move."""
    for fmt, upper in _WORD_PAIRS.items():
        lay = LAYOUTS[fmt]
        d = lay.field("d").offset
        words = [lay.field(_WORD_FIELDS[fmt]).offset] if fmt in _WORD_FIELDS else []
        if (
            lay.nbytes % WORD.value
            or d % WORD.value
            or lay.field(upper).offset != d + 2
            or any(off % WORD.value for off in words)
        ):
            raise RuntimeError(f"{fmt.name}: the int8 GEMM reads its blocks as 32-bit words; the layout moved")


check_word_layouts()


@triton.jit
def _bytes(blk, off, idx):
    """Bytes off + idx[j] of each row's block: [BLOCK_N, len(idx)] int32."""
    return tl.load(blk[:, None] + off + idx[None, :]).to(tl.int32)


@triton.jit
def _word(blk, off):
    """The 32-bit word at byte off (a multiple of 4) of each row's block (a whole number of words): [BLOCK_N]."""
    return tl.load((blk + off).to(tl.pointer_type(tl.int32)))


@triton.jit
def _word_below(w, o):
    """The 32-bit word holding byte o ([BLOCK_N] int64 offsets, any alignment) of the matrix at `w` (16-aligned):
    a 4-byte load the pipeliner can stage, where a 2-aligned block's own f16 is a 2-byte one."""
    return tl.load((w + (o & WORD_DOWN)).to(tl.pointer_type(tl.int32)))


@triton.jit
def _u16_at(w, o):
    """The 16 bits at byte o (even) of the matrix, from the word holding them: [BLOCK_N] int32."""
    return (_word_below(w, o) >> ((o & WORD_BYTE) * BYTE_BITS).to(tl.int32)) & F16_BITS


@triton.jit
def _byte_at(w, o):
    """The byte at o of the matrix, from the word holding it: [BLOCK_N] int32."""
    return (_word_below(w, o) >> ((o & WORD_BYTE) * BYTE_BITS).to(tl.int32)) & BYTE


@triton.jit
def _f16_at(w, o):
    """The f16 at byte o (even) of the matrix, read from the word holding it, as f32."""
    return _u16_at(w, o).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _i8_pair_at(w, o):
    """The two int8 at bytes o (even) and o + 1 of the matrix, from the word holding both, as f32."""
    pair = _word_below(w, o) >> ((o & WORD_BYTE) * BYTE_BITS).to(tl.int32)
    return pair.to(tl.int8).to(tl.float32), (pair >> BYTE_BITS).to(tl.int8).to(tl.float32)


@triton.jit
def _run_bytes(w, o, N: tl.constexpr):
    """Bytes o .. o + N - 1 of the matrix (o even: [BLOCK_N] int64 offsets into a 2-aligned block; N 16 or 32),
    [BLOCK_N, N] int32, read as 32-bit words from the word boundary at or below o: N / 4 + 1 words, as the
    N / 4 there and the N / 4 one on; where o is 2 past a boundary each run word is the upper half of one and
    the lower of the next. Every load is 4 bytes a thread, so the pipeliner stages it."""
    i = tl.arange(0, N // WORD)
    words = (w + (o & WORD_DOWN)[:, None] + (i * WORD)[None, :]).to(tl.pointer_type(tl.int32))
    off = ((o & WORD_BYTE).to(tl.int32) >> 1)[:, None]  # 1 where o is 2 past a boundary
    # the words one on are read only where they hold run bytes (else the same words again): the last one
    # of a row's last run would otherwise lie past the matrix
    here, on = tl.load(words), tl.load(words + off)
    run = tl.where(off != 0, ((here >> HALF_WORD_BITS) & F16_BITS) | (on << HALF_WORD_BITS), here)
    lanes = (tl.arange(0, WORD) * BYTE_BITS)[None, None, :]
    return tl.reshape((run[:, :, None] >> lanes) & BYTE, [run.shape[0], N])


@triton.jit
def _nibbles_at(w, o):
    """A 32-value block's 16 qs bytes at o (2-aligned) as its two halves of 4-bit codes, [BLOCK_N, 16] each:
    values 0-15 are the bytes' low nibbles, 16-31 their high ones."""
    b = _run_bytes(w, o, HALF_QK)
    return b & NIBBLE, b >> NIBBLE_BITS


@triton.jit
def _halves(low, high):
    """Two [BLOCK_N, 16] halves of a run as one [BLOCK_N, 32]: low's values first."""
    both = tl.permute(tl.join(low, high), (0, 2, 1))  # [BLOCK_N, 2, 16]
    return tl.reshape(both, [low.shape[0], QK_C])


@triton.jit
def _f16_pair(word):
    """The two f16 halves of a 32-bit word (low, high), as f32."""
    low = (word & F16_BITS).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (word >> HALF_WORD_BITS).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _nibble_run(blk, QS: tl.constexpr):
    """A 32-value block's 4-bit codes: bytes 0-15 hold values 0-15 in their low nibbles, 16-31 in the high."""
    i = tl.arange(0, QK_C)
    b = _bytes(blk, QS, i % HALF_QK)
    return tl.where((i < HALF_QK)[None, :], b & NIBBLE, b >> NIBBLE_BITS)


@triton.jit
def _k_scale_min(blk, SCALES: tl.constexpr, j):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes (words a, b, c), [BLOCK_N]
    int32 each. Sub-blocks 0-3 hold theirs in the low 6 bits of byte j of a (scales) and b (mins); 4-7 take
    their low 4 bits from the nibbles of byte j - 4 of c and their top 2 bits from the top of byte j - 4 of a
    (b). Both are computed and one kept, as j is not a constant."""
    a, b, c = _word(blk, SCALES), _word(blk, SCALES + WORD), _word(blk, SCALES + 2 * WORD)
    shift = (j % K_LOW_SUBS) * BYTE_BITS
    sc_high = ((c >> shift) & NIBBLE) | (((a >> (shift + K_TOP)) & CRUMB) << NIBBLE_BITS)
    mn_high = ((c >> (shift + NIBBLE_BITS)) & NIBBLE) | (((b >> (shift + K_TOP)) & CRUMB) << NIBBLE_BITS)
    high = j >= K_LOW_SUBS
    return tl.where(high, sc_high, (a >> shift) & SIX_BITS), tl.where(high, mn_high, (b >> shift) & SIX_BITS)


@triton.jit
def _k_run(blk, j, D: tl.constexpr, SCALES: tl.constexpr, QS: tl.constexpr):
    """Q4_K / Q5_K sub-block j: its 4-bit codes (pair j // 2's 32 qs bytes, low nibbles first), d * scale and
    -dmin * min (d and dmin: the f16 halves of the block's first word)."""
    i = tl.arange(0, QK_C)
    codes = (_bytes(blk, QS + (j // 2) * QK_C, i) >> (NIBBLE_BITS * (j % 2))) & NIBBLE
    sc, mn = _k_scale_min(blk, SCALES, j)
    d, dmin = _f16_pair(_word(blk, D))
    return codes, d * sc.to(tl.float32), -(dmin * mn.to(tl.float32))


@triton.jit
def run(w, at, dat, j, FMT: tl.constexpr, lut):
    """(codes int8 [BLOCK_N, 32], s0, s1, m0, m1 [BLOCK_N] f32) of run j of each row's block (see the module),
    the blocks at byte offsets `at` ([BLOCK_N] int64) of the matrix `w`, their d's at `dat` where the format keeps
    them after a row's blocks (`kernels.ROW_TAIL_D`: `layout.block_d`). `lut` points at the 16 int8 values of
    `IQ4_NL_VALUES` (read by the IQ4 formats only)."""
    blk = w + at
    if FMT == FMT_Q6_K:
        codes, s0, s1, m0, m1 = _q6_k_run(w, at, dat, j)
    elif FMT == FMT_Q2_K:
        codes, s0, s1, m0, m1 = _q2_k_run(blk, j)
    elif FMT == FMT_Q3_K:
        codes, s0, s1, m0, m1 = _q3_k_run(w, at, j)
    elif FMT == FMT_IQ4_NL:
        codes = tl.load(lut + _halves(*_nibbles_at(w, at + IQ4_NL_QS)))
        s0 = _f16_at(w, dat)
        zero = tl.zeros(blk.shape, tl.float32)
        s1, m0, m1 = s0, zero, zero
    elif FMT == FMT_IQ4_XS:
        codes, s0, s1, m0, m1 = _iq4_xs_run(blk, w + dat, j, lut)
    else:
        codes, s0, s1, m0, m1 = _one_scale_run(w, at, dat, j, FMT)
    return codes, s0, s1, m0, m1


@triton.jit
def _one_scale_run(w, at, dat, j, FMT: tl.constexpr):
    """A run under one scale and one offset (Q8_0 and Q4_0, whose d is at `dat`, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K)."""
    blk = w + at
    zero = tl.zeros(blk.shape, tl.float32)
    if FMT == FMT_Q8_0:
        codes = _run_bytes(w, at + Q8_0_QS, QK_C)  # unsigned bytes: the int8 cast below gives the signed codes back
        s = _f16_at(w, dat)
        m = zero
    elif FMT == FMT_Q4_0:
        codes = _halves(*_nibbles_at(w, at + Q4_0_QS)) - Q4_BIAS
        s = _f16_at(w, dat)
        m = zero
    elif FMT == FMT_Q4_1:
        codes = _nibble_run(blk, Q4_1_QS)
        s, m = _f16_pair(_word(blk, Q4_1_D))  # d, then m in the same word
    elif FMT == FMT_Q5_0:
        # bit i of the 32-bit qh (two 16-bit halves: the 22-byte block is 2-aligned) is value i's fifth bit,
        # added to each half before they are put together
        low, high = _nibbles_at(w, at + Q5_0_QS)
        i = tl.arange(0, HALF_QK)[None, :]
        low |= ((_u16_at(w, at + Q5_0_QH)[:, None] >> i) & BIT) << NIBBLE_BITS
        high |= ((_u16_at(w, at + Q5_0_QH + 2)[:, None] >> i) & BIT) << NIBBLE_BITS
        codes = _halves(low, high) - Q5_BIAS
        s = _f16_at(w, at + Q5_0_D)
        m = zero
    elif FMT == FMT_Q5_1:
        # bit i of the 32-bit qh (one word) is value i's fifth bit
        qh = _word(blk, Q5_1_QH)[:, None] >> tl.arange(0, QK_C)[None, :]
        codes = _nibble_run(blk, Q5_1_QS) | ((qh & BIT) << NIBBLE_BITS)
        s, m = _f16_pair(_word(blk, Q5_1_D))
    elif FMT == FMT_Q4_K:
        codes, s, m = _k_run(blk, j, Q4_K_D, Q4_K_SCALES, Q4_K_QS)
    else:
        tl.static_assert(FMT == FMT_Q5_K, "the int8 GEMM has no body for this format")
        codes, s, m = _k_run(blk, j, Q5_K_D, Q5_K_SCALES, Q5_K_QS)
        # sub-block j takes its fifth bit from bit j of each of the 32 qh bytes
        codes = codes | (((_bytes(blk, Q5_K_QH, tl.arange(0, QK_C)) >> j) & BIT) << NIBBLE_BITS)
    return codes.to(tl.int8), s, s, m, m


@triton.jit
def _q6_k_run(w, at, dat, j):
    """Q6_K run j: half j // 4, quarter q = j % 4 of it. Its low nibbles are ql bytes (q % 2) * 32 + i of the
    half (low nibbles for q < 2, high after), its top 2 bits crumb q of qh byte i of the half; two int8
    sub-block scales (bytes 2j, 2j + 1) times d (at `dat`, after the row's blocks)."""
    half = j // Q6_HALF_SLOTS
    q = j % Q6_HALF_SLOTS
    low = _run_bytes(w, at + Q6_K_QL + half * Q6_QL_HALF + (q % 2) * QK_C, QK_C) >> (NIBBLE_BITS * (q // 2))
    top = (_run_bytes(w, at + Q6_K_QH + half * Q6_QH_HALF, QK_C) >> (2 * q)) & CRUMB
    codes = ((low & NIBBLE) | (top << NIBBLE_BITS)) - Q6_BIAS
    d = _f16_at(w, dat)
    sc0, sc1 = _i8_pair_at(w, at + Q6_K_SCALES + SUBS_A_RUN * j)
    zero = tl.zeros(at.shape, tl.float32)
    return codes.to(tl.int8), d * sc0, d * sc1, zero, zero


@triton.jit
def _crumb_run(blk, QS: tl.constexpr, j):
    """Q2_K run j's 2-bit codes: crumb j % 4 of qs bytes 0-31 of half j // 4."""
    half = j // K2_HALF_RUNS
    c = j % K2_HALF_RUNS
    return (_bytes(blk, QS + half * K2_QS_HALF, tl.arange(0, QK_C)) >> (2 * c)) & CRUMB


@triton.jit
def _q2_k_run(blk, j):
    """Q2_K run j: 2-bit codes; sub-blocks 2j and 2j + 1 of 16 each take d * (scale byte's low nibble) and
    -dmin * (its high nibble). Their two scale bytes are half of word j // 2 of the scales."""
    d, dmin = _f16_pair(_word(blk, Q2_K_D))
    pair = _word(blk, Q2_K_SCALES + (j // 2) * WORD) >> (HALF_WORD_BITS * (j % 2))
    b0, b1 = pair & BYTE, (pair >> BYTE_BITS) & BYTE
    s0, s1 = d * (b0 & NIBBLE).to(tl.float32), d * (b1 & NIBBLE).to(tl.float32)
    m0, m1 = -(dmin * (b0 >> NIBBLE_BITS).to(tl.float32)), -(dmin * (b1 >> NIBBLE_BITS).to(tl.float32))
    return _crumb_run(blk, Q2_K_QS, j).to(tl.int8), s0, s1, m0, m1


@triton.jit
def _q3_k_scale(w, at, s):
    """Q3_K's signed 6-bit scale s (0-15), as f32: its low nibble is nibble s // 8 of byte s % 8, its top 2 bits
    crumb s // 4 of byte 8 + s % 4 (of the 12 scale bytes)."""
    byte = _byte_at(w, at + Q3_K_SCALES + s % Q3_K_LOW_SCALES)
    low = (byte >> (NIBBLE_BITS * (s // Q3_K_LOW_SCALES))) & NIBBLE
    top = (_byte_at(w, at + Q3_K_SCALES + Q3_K_HIGH + s % 4) >> (2 * (s // 4))) & CRUMB
    return ((low | (top << NIBBLE_BITS)) - K_SIGNED_SCALE).to(tl.float32)


@triton.jit
def _q3_k_run(w, at, j):
    """Q3_K run j: 2-bit codes (crumb j % 4 of qs bytes 0-31 of half j // 4) with bit j of each hmask byte as
    their third bit, less 4; sub-blocks 2j and 2j + 1 take d times their signed scales. The 110-byte blocks
    are 2-aligned: read as words."""
    high = ((_run_bytes(w, at + Q3_K_HMASK, QK_C) >> j) & BIT) << 2
    crumbs = _run_bytes(w, at + Q3_K_QS + (j // K2_HALF_RUNS) * K2_QS_HALF, QK_C) >> (2 * (j % K2_HALF_RUNS))
    codes = ((crumbs & CRUMB) | high) - Q3_BIAS
    d = _f16_at(w, at + Q3_K_D)
    zero = tl.zeros(at.shape, tl.float32)
    s0 = d * _q3_k_scale(w, at, SUBS_A_RUN * j)
    s1 = d * _q3_k_scale(w, at, SUBS_A_RUN * j + 1)
    return codes.to(tl.int8), s0, s1, zero, zero


@triton.jit
def _iq4_xs_run(blk, head_at, j, lut):
    """IQ4_XS run j: the table's values of 16 qs bytes' nibbles (low: values 0-15, high: 16-31), under d times
    the run's signed 6-bit scale: its low 4 bits nibble j of the 32-bit scales_l, its top 2 crumb j of the
    u16 scales_h (the upper half of d's word). The header (d's word, then scales_l) is at `head_at`, after the
    row's blocks."""
    i = tl.arange(0, QK_C)
    b = _bytes(blk, IQ4_XS_QS + j * HALF_QK, i % HALF_QK)
    codes = tl.load(lut + tl.where((i < HALF_QK)[None, :], b & NIBBLE, b >> NIBBLE_BITS))
    head = _word(head_at, 0)
    low = (_word(head_at, IQ4_XS_SCALES_L) >> (NIBBLE_BITS * j)) & NIBBLE
    top = (head >> (HALF_WORD_BITS + 2 * j)) & CRUMB
    d = (head & F16_BITS).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    s = d * ((low | (top << NIBBLE_BITS)) - K_SIGNED_SCALE).to(tl.float32)
    zero = tl.zeros(blk.shape, tl.float32)
    return codes, s, s, zero, zero
