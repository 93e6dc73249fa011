"""The int8 GEMV's (`q8`) per-format pieces for Q5_K, Q4_0, Q4_1, Q5_1, IQ4_NL, IQ4_XS, Q3_K and Q2_K: how a
chunk's bytes are loaded (`raw_chunk`) and how a group's codes meet its two runs of 16 int8 activations in
dp4a (`chunk_sum`). `q8.row_dots` and every launch built on it (alone, in parts, with epilogues, the gate/up
GLU) call these through `q8.raw_chunk` and `q8.chunk_sums`, so a format here is a format of all of them.

A group is what one thread owns a chunk: two 16-value runs of codes, each summed by a chain of four dp4a into
an int32, then scaled once in f32. The groups follow the formats' packing so a group's bytes are one or two
16-byte runs:
- the K formats with 32-value sub-blocks in nibble pairs (Q5_K, as Q4_K) and those with 16-value sub-blocks in
  crumbs (Q3_K, Q2_K): eight groups a super-block; group r meets values 64 (r // 2) + 16 (r % 2) + 0..15
  ("lo") and the 16 from 32 on ("hi"), Q4_K's activation pattern. Q5_K's group is a 16-byte run of qs and the
  16 qh bytes of its fifth bits; Q3_K's and Q2_K's a 16-byte run of qs (bytes 32 n + 16 t of half n) whose
  crumbs 2 j' and 2 j' + 1 (j' = (r // 2) % 2) are its lo and hi sub-blocks, and for Q3_K the 16 hmask bytes of
  their third bits;
- the 32-value formats (Q4_0, Q4_1, Q5_1, IQ4_NL) and IQ4_XS's 32-value sub-blocks: a group a block, lo its
  low nibbles (values 0-15), hi its high ones (16-31).
Every group's codes are 4 words held in the thread (`int8_words.ld4` where a run is 16-byte aligned: Q5_K's
176-byte blocks; `ld_words` where it is 4-byte aligned: Q4_1, Q5_1, IQ4_XS, Q2_K; `ld_run` where it is only
2-byte aligned: Q4_0, IQ4_NL, Q3_K), as `q8` holds Q4_K's and Q6_K's: no shared-memory exchange before a
dp4a chain.

Codes enter dp4a as stored (unsigned) and the format's offset is applied once a run from the activation's
16-value sum s: Q4_0's 8 and Q3_K's 4 as a bias, Q4_1's and Q5_1's minimum m and Q2_K's dmin * min as an
added term. IQ4_NL / IQ4_XS codes index a table of 16 signed values: the table is four words in registers
and a word of four codes becomes four signed bytes in three `prmt` byte permutes (`iq4_values`), then a
signed dp4a.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselane.gguf.formats import QK, QK_K, Format
from fuselane.lanes.cuda.triton.gemv.fast import K_RUNS, RUN_BYTES, q4_k_scales_of
from fuselane.lanes.cuda.triton.gemv.int8_words import dot16_of, ld4, ld_run, ld_scalar, ld_words, prmt
from fuselane.lanes.cuda.triton.gemv.layout import (
    BYTE,
    BYTE_BITS,
    CRUMB,
    FMT_IQ4_NL,
    FMT_IQ4_XS,
    FMT_Q2_K,
    FMT_Q3_K,
    FMT_Q4_0,
    FMT_Q4_1,
    FMT_Q5_1,
    FMT_Q5_K,
    HALF_QS,
    HALF_WORD_BITS,
    IQ4_NL_BYTES,
    IQ4_NL_D,
    IQ4_NL_QS,
    IQ4_T0,
    IQ4_T1,
    IQ4_T2,
    IQ4_T3,
    IQ4_XS_BYTES,
    IQ4_XS_D,
    IQ4_XS_QS,
    IQ4_XS_SCALES_L,
    NIBBLE,
    NIBBLE_BITS,
    Q2_K_BYTES,
    Q2_K_D,
    Q2_K_QS,
    Q2_K_SCALES,
    Q3_HIGH_SCALES,
    Q3_K_BYTES,
    Q3_K_D,
    Q3_K_HMASK,
    Q3_K_QS,
    Q3_K_SCALES,
    Q3_SCALE_ROWS,
    Q4_0_BYTES,
    Q4_0_D,
    Q4_0_QS,
    Q4_1_BYTES,
    Q4_1_D,
    Q4_1_M,
    Q4_1_QS,
    Q4_BIAS,
    Q5_1_BYTES,
    Q5_1_D,
    Q5_1_M,
    Q5_1_QH,
    Q5_1_QS,
    Q5_K_BYTES,
    Q5_K_QH,
    Q5_K_QS,
    SIGNED_SCALE,
    const,
)

LOW_NIBBLES = const(0x0F0F0F0F)  # the low nibble of each byte of a word
CRUMBS = const(0x03030303)  # the low 2 bits of each byte
LOW_BITS = const(0x01010101)  # bit 0 of each byte
FIFTH_BITS = const(0x10101010)  # bit 4 of each byte
# x * SPREAD puts bit i (0..3) of x at bit 8i + 4 (shifts 4, 11, 18, 25; the other products miss the mask)
SPREAD = const((1 << 4) | (1 << 11) | (1 << 18) | (1 << 25))
HALF_WORD = const(0xFFFF)
WORD_VALUES = const(4)  # codes a 32-bit word of a run
CRUMB_BITS = const(2)
Q3_BIAS = const(4.0)  # Q3_K: value = d * (scale - 32) * (code - 4), code = low 2 bits | hmask bit << 2
HBIT_SHIFT = const(2)  # Q3_K: where the hmask bit goes over the 2 low bits
HALF_RUNS = const(2)  # Q3_K / Q2_K: a half of 128 values is two pairs of runs
PICK_LOW3, PICK_BIT3 = const(0x7777), const(0x8888)  # a selector's per-nibble byte index, and its table half
IN_ORDER = const(0x3210)  # a selector taking bytes 0-3 in order; + 4 a nibble takes the second word's byte
LOW_BYTE, SECOND_BYTE = const(0xFF), const(0xFF00)

# Groups a unit (a block or super-block), and values a unit, of each format here
GROUPS = {
    Format.Q5_K: K_RUNS.value, Format.Q3_K: K_RUNS.value, Format.Q2_K: K_RUNS.value, Format.IQ4_XS: QK_K // QK,
    Format.Q4_0: 1, Format.Q4_1: 1, Format.Q5_1: 1, Format.IQ4_NL: 1,
}  # fmt: skip
UNIT_VALUES = {f: QK_K if f in (Format.Q5_K, Format.Q3_K, Format.Q2_K, Format.IQ4_XS) else QK for f in GROUPS}
FORMATS = frozenset(GROUPS)
# formats whose group r meets Q4_K's runs (64 (r // 2) + 16 (r % 2), and 32 on); the rest meet a 32-value block
K_PAIR_FORMATS = frozenset({Format.Q5_K, Format.Q3_K, Format.Q2_K})
# the alignment each format's loads need of its rows' start: Q5_K's 128-bit loads (`ld4`), the 32-bit words
# of Q4_1's, Q5_1's, IQ4_XS's and Q2_K's runs (`ld_words`) and of Q5_1's qh, IQ4_XS's header and Q2_K's d and
# dmin
ALIGN = {Format.Q5_K: 16, Format.Q4_1: 4, Format.Q5_1: 4, Format.IQ4_XS: 4, Format.Q2_K: 4}


# --- loads ---------------------------------------------------------------------------------------------------


@triton.jit
def _i32(ptr):
    return ptr.to(tl.pointer_type(tl.int32))


@triton.jit
def _byte(ptr):
    return ld_scalar(ptr, 1)


@triton.jit
def _word(ptr):
    return ld_scalar(ptr, 4)


@triton.jit
def _half(ptr):
    """The f16 at each 2-aligned byte address, as f32."""
    return _f16(ld_scalar(ptr, 2))


@triton.jit
def raw_chunk(w_rows, u0, FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, CLAMP: tl.constexpr,
              GROUPS_A_UNIT: tl.constexpr, PINNED: tl.constexpr = False):  # fmt: skip
    """The chunk at unit u0 of each row (`w_rows`: [N] uint8 pointers) as a tuple of [N, G] tensors, a group's
    bytes in one thread; with CLAMP (a partial last chunk) units past the row read its last unit. PINNED: the
    runs' loads take the coherent path (`weight_loads`; the scalar fields stay on the read-only one)."""
    g = tl.arange(0, CHUNK * GROUPS_A_UNIT)
    unit = g // GROUPS_A_UNIT + u0
    if CLAMP:
        unit = tl.minimum(unit, N_UNITS - 1)
    r = (g % GROUPS_A_UNIT)[None, :]
    if FMT == FMT_Q5_K:  # the 16-byte header, a 16-byte run of qs and the 16 qh bytes of its fifth bits
        blk = w_rows[:, None] + (unit * Q5_K_BYTES)[None, :]
        head, qs = ld4(_i32(blk), True, PINNED), ld4(_i32(blk + r * RUN_BYTES + Q5_K_QS), True, PINNED)
        return head + qs + ld4(_i32(blk + (r % 2) * RUN_BYTES + Q5_K_QH), True, PINNED)
    elif FMT == FMT_Q4_0:
        blk = w_rows[:, None] + (unit * Q4_0_BYTES)[None, :]
        return (_half(blk + Q4_0_D),) + ld_run(blk + Q4_0_QS, PINNED)
    elif FMT == FMT_IQ4_NL:
        blk = w_rows[:, None] + (unit * IQ4_NL_BYTES)[None, :]
        return (_half(blk + IQ4_NL_D),) + ld_run(blk + IQ4_NL_QS, PINNED)
    elif FMT == FMT_Q4_1:
        blk = w_rows[:, None] + (unit * Q4_1_BYTES)[None, :]
        return (_half(blk + Q4_1_D), _half(blk + Q4_1_M)) + ld_words(blk + Q4_1_QS, PINNED)
    elif FMT == FMT_Q5_1:
        blk = w_rows[:, None] + (unit * Q5_1_BYTES)[None, :]
        return (_half(blk + Q5_1_D), _half(blk + Q5_1_M), _word(blk + Q5_1_QH)) + ld_words(blk + Q5_1_QS, PINNED)
    elif FMT == FMT_IQ4_XS:  # d and scales_h as one word, scales_l as the next; the sub-block's 16 qs bytes
        blk = w_rows[:, None] + (unit * IQ4_XS_BYTES)[None, :]
        head = _word(blk + IQ4_XS_D), _word(blk + IQ4_XS_SCALES_L)
        return head + ld_words(blk + r * RUN_BYTES + IQ4_XS_QS, PINNED)
    elif FMT == FMT_Q3_K:  # d, the bytes of the lo and hi sub-blocks' scales, the qs run, the hmask run
        blk = w_rows[:, None] + (unit * Q3_K_BYTES)[None, :]
        pair, t = r // 2, r % 2
        i_lo = pair * Q3_SCALE_ROWS + t
        sc = blk + Q3_K_SCALES
        scales = (
            _byte(sc + i_lo % Q3_HIGH_SCALES), _byte(sc + Q3_HIGH_SCALES + i_lo % Q3_SCALE_ROWS),
            _byte(sc + (i_lo + 2) % Q3_HIGH_SCALES), _byte(sc + Q3_HIGH_SCALES + (i_lo + 2) % Q3_SCALE_ROWS),
        )  # fmt: skip
        qs = ld_run(blk + (pair // HALF_RUNS) * HALF_QS + t * RUN_BYTES + Q3_K_QS, PINNED)
        return (_half(blk + Q3_K_D),) + scales + qs + ld_run(blk + t * RUN_BYTES + Q3_K_HMASK, PINNED)
    else:
        tl.static_assert(FMT == FMT_Q2_K, "no int8 GEMV body for this format")
        blk = w_rows[:, None] + (unit * Q2_K_BYTES)[None, :]
        pair, t = r // 2, r % 2
        i_lo = pair * Q3_SCALE_ROWS + t
        sc = blk + Q2_K_SCALES
        head = _word(blk + Q2_K_D), _byte(sc + i_lo), _byte(sc + i_lo + 2)
        return head + ld_words(blk + (pair // HALF_RUNS) * HALF_QS + t * RUN_BYTES + Q2_K_QS, PINNED)


# --- the sums a group --------------------------------------------------------------------------------------------


@triton.jit
def _f16(bits):
    """The f16 in the low 16 bits of int32 `bits`, as f32."""
    return (bits & HALF_WORD).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _runs(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, acts, SIGNED: tl.constexpr):
    """The two 16-value dot products of a group (int32, [N, G] each): lo codes with the low run's
    activations, hi codes with the high run's."""
    a0, a1, a2, a3, _, _, b0, b1, b2, b3, _, _ = acts
    return dot16_of(lo0, lo1, lo2, lo3, a0, a1, a2, a3, SIGNED), dot16_of(hi0, hi1, hi2, hi3, b0, b1, b2, b3, SIGNED)


@triton.jit
def _nibble_runs(q0, q1, q2, q3, acts):
    """A block's low nibbles with its first 16 activations and its high nibbles with the next 16."""
    return _runs(
        q0 & LOW_NIBBLES, q1 & LOW_NIBBLES, q2 & LOW_NIBBLES, q3 & LOW_NIBBLES,
        (q0 >> NIBBLE_BITS) & LOW_NIBBLES, (q1 >> NIBBLE_BITS) & LOW_NIBBLES,
        (q2 >> NIBBLE_BITS) & LOW_NIBBLES, (q3 >> NIBBLE_BITS) & LOW_NIBBLES, acts, False,
    )  # fmt: skip


@triton.jit
def _q5_k_codes(q, qh, bit):
    """Four 5-bit codes a word: the low nibbles of `q`'s bytes under bit `bit` of `qh`'s."""
    return (q & LOW_NIBBLES) | (((qh >> bit) & LOW_BITS) << NIBBLE_BITS)


@triton.jit
def _q5_k(raw, acts, CHUNK: tl.constexpr):
    """Q5_K: as Q4_K (value = d * scale * code - dmin * min), each code's fifth bit bit 2j (lo) or 2j + 1 (hi)
    of its qh byte, j = r // 2 the group's pair of sub-blocks."""
    h0, h1, h2, h3, q0, q1, q2, q3, e0, e1, e2, e3 = raw
    da_lo, s_lo, da_hi, s_hi = acts[4], acts[5], acts[10], acts[11]
    d, dmin, scales, mins = q4_k_scales_of(h0, h1, h2, h3, CHUNK)
    b = ((tl.arange(0, CHUNK * K_RUNS) % K_RUNS) // 2 * 2)[None, :]
    lo, hi = _runs(
        _q5_k_codes(q0, e0, b), _q5_k_codes(q1, e1, b), _q5_k_codes(q2, e2, b), _q5_k_codes(q3, e3, b),
        _q5_k_codes(q0 >> NIBBLE_BITS, e0, b + 1), _q5_k_codes(q1 >> NIBBLE_BITS, e1, b + 1),
        _q5_k_codes(q2 >> NIBBLE_BITS, e2, b + 1), _q5_k_codes(q3 >> NIBBLE_BITS, e3, b + 1), acts, False,
    )  # fmt: skip
    y = lo.to(tl.float32) * (d * (scales & BYTE).to(tl.float32) * da_lo) - (dmin * (mins & BYTE).to(tl.float32)) * s_lo
    y += (
        hi.to(tl.float32) * (d * (scales >> BYTE_BITS).to(tl.float32) * da_hi)
        - (dmin * (mins >> BYTE_BITS).to(tl.float32)) * s_hi
    )
    return y


@triton.jit
def _q4_0(raw, acts):
    """Q4_0: value = d * (code - 8); the bias is taken once a block from the 32 values' code sums."""
    d, q0, q1, q2, q3 = raw
    da, s_lo, s_hi = acts[4], acts[5], acts[11]
    lo, hi = _nibble_runs(q0, q1, q2, q3, acts)
    return d * ((lo + hi).to(tl.float32) * da - Q4_BIAS * (s_lo + s_hi))


@triton.jit
def _q4_1(raw, acts):
    """Q4_1: value = d * code + m."""
    d, m, q0, q1, q2, q3 = raw
    da, s_lo, s_hi = acts[4], acts[5], acts[11]
    lo, hi = _nibble_runs(q0, q1, q2, q3, acts)
    return d * da * (lo + hi).to(tl.float32) + m * (s_lo + s_hi)


@triton.jit
def _fifth(qh, w: tl.constexpr):
    """Bits 4w..4w + 3 of `qh` (the fifth bits of a word's four codes) at bit 4 of each byte."""
    return (((qh >> w * WORD_VALUES) & NIBBLE) * SPREAD) & FIFTH_BITS


@triton.jit
def _q5_1(raw, acts):
    """Q5_1: value = d * code + m; bit v of the 32-bit qh is value v's fifth bit."""
    d, m, qh, q0, q1, q2, q3 = raw
    da, s_lo, s_hi = acts[4], acts[5], acts[11]
    up = qh >> HALF_WORD_BITS  # values 16-31's fifth bits
    lo, hi = _runs(
        (q0 & LOW_NIBBLES) | _fifth(qh, 0), (q1 & LOW_NIBBLES) | _fifth(qh, 1),
        (q2 & LOW_NIBBLES) | _fifth(qh, 2), (q3 & LOW_NIBBLES) | _fifth(qh, 3),
        ((q0 >> NIBBLE_BITS) & LOW_NIBBLES) | _fifth(up, 0), ((q1 >> NIBBLE_BITS) & LOW_NIBBLES) | _fifth(up, 1),
        ((q2 >> NIBBLE_BITS) & LOW_NIBBLES) | _fifth(up, 2), ((q3 >> NIBBLE_BITS) & LOW_NIBBLES) | _fifth(up, 3),
        acts, False,
    )  # fmt: skip
    return d * da * (lo + hi).to(tl.float32) + m * (s_lo + s_hi)


@triton.jit
def iq4_values(codes):
    """A word of four codes (0..15, a byte each) -> the word of their four signed table values: the codes as
    a selector's nibbles, each picks its byte of the table's low half (codes 0-7) and its high half (8-15),
    then bit 3 picks between the two."""
    packed = codes | (codes >> NIBBLE_BITS)  # byte 0: codes 0 and 1 as nibbles; byte 2: codes 2 and 3
    sel = (packed & LOW_BYTE) | ((packed >> BYTE_BITS) & SECOND_BYTE)
    t0 = tl.zeros_like(codes) + IQ4_T0
    low = prmt(t0, t0 * 0 + IQ4_T1, sel & PICK_LOW3)
    high = prmt(t0 * 0 + IQ4_T2, t0 * 0 + IQ4_T3, sel & PICK_LOW3)
    return prmt(low, high, ((sel & PICK_BIT3) >> 1) | IN_ORDER)


@triton.jit
def _iq4_runs(q0, q1, q2, q3, acts):
    """IQ4_NL / IQ4_XS: a block's low nibbles' table values with its first 16 activations, its high ones'
    with the next 16, as signed dp4a."""
    return _runs(
        iq4_values(q0 & LOW_NIBBLES), iq4_values(q1 & LOW_NIBBLES),
        iq4_values(q2 & LOW_NIBBLES), iq4_values(q3 & LOW_NIBBLES),
        iq4_values((q0 >> NIBBLE_BITS) & LOW_NIBBLES), iq4_values((q1 >> NIBBLE_BITS) & LOW_NIBBLES),
        iq4_values((q2 >> NIBBLE_BITS) & LOW_NIBBLES), iq4_values((q3 >> NIBBLE_BITS) & LOW_NIBBLES), acts, True,
    )  # fmt: skip


@triton.jit
def _iq4_nl(raw, acts):
    """IQ4_NL: value = d * table[code]."""
    d, q0, q1, q2, q3 = raw
    lo, hi = _iq4_runs(q0, q1, q2, q3, acts)
    return d * acts[4] * (lo + hi).to(tl.float32)


@triton.jit
def _iq4_xs(raw, acts, CHUNK: tl.constexpr):
    """IQ4_XS: value = d * (scale - 32) * table[code] in sub-block ib = g % 8, its 6-bit scale's low 4 bits
    nibble ib of scales_l, its top 2 bits crumb ib of scales_h."""
    head, low_scales, q0, q1, q2, q3 = raw
    ib = (tl.arange(0, CHUNK * K_RUNS) % K_RUNS)[None, :]
    high = (head >> HALF_WORD_BITS) & HALF_WORD
    ls = ((low_scales >> ib * NIBBLE_BITS) & NIBBLE) | (((high >> ib * CRUMB_BITS) & CRUMB) << NIBBLE_BITS)
    lo, hi = _iq4_runs(q0, q1, q2, q3, acts)
    return _f16(head) * (ls - SIGNED_SCALE).to(tl.float32) * acts[4] * (lo + hi).to(tl.float32)


@triton.jit
def _crumb_codes(q, shift):
    """Four 2-bit codes a word: the crumbs at `shift` of `q`'s bytes."""
    return (q >> shift) & CRUMBS


@triton.jit
def _q3_codes(q, hm, shift, bit):
    """Four 3-bit codes a word: the crumbs at `shift` of `q`'s bytes under bit `bit` of `hm`'s."""
    return _crumb_codes(q, shift) | (((hm >> bit) & LOW_BITS) << HBIT_SHIFT)


@triton.jit
def _q3_scale(low_byte, high_byte, n, pair):
    """Q3_K: a sub-block's scale - 32, its low 4 bits nibble n (the half) of one byte, its top 2 bits crumb
    `pair` of another."""
    six = ((low_byte >> n * NIBBLE_BITS) & NIBBLE) | (((high_byte >> pair * CRUMB_BITS) & CRUMB) << NIBBLE_BITS)
    return (six - SIGNED_SCALE).to(tl.float32)


@triton.jit
def _q3_k(raw, acts, CHUNK: tl.constexpr):
    """Q3_K: value = d * (scale - 32) * (code - 4) in 16-value sub-blocks. Group r: pair P = r // 2 of runs,
    half n = P // 2, crumbs j = 2 (P % 2) (lo) and j + 1 (hi) of its qs run, hmask bits 4n + j."""
    d, sl_lo, sh_lo, sl_hi, sh_hi, q0, q1, q2, q3, m0, m1, m2, m3 = raw
    da_lo, s_lo, da_hi, s_hi = acts[4], acts[5], acts[10], acts[11]
    pair = ((tl.arange(0, CHUNK * K_RUNS) % K_RUNS) // 2)[None, :]
    n, j = pair // HALF_RUNS, (pair % HALF_RUNS) * 2
    sh, bit = j * CRUMB_BITS, n * WORD_VALUES + j
    lo, hi = _runs(
        _q3_codes(q0, m0, sh, bit), _q3_codes(q1, m1, sh, bit), _q3_codes(q2, m2, sh, bit), _q3_codes(q3, m3, sh, bit),
        _q3_codes(q0, m0, sh + CRUMB_BITS, bit + 1), _q3_codes(q1, m1, sh + CRUMB_BITS, bit + 1),
        _q3_codes(q2, m2, sh + CRUMB_BITS, bit + 1), _q3_codes(q3, m3, sh + CRUMB_BITS, bit + 1), acts, False,
    )  # fmt: skip
    y = _q3_scale(sl_lo, sh_lo, n, pair) * (lo.to(tl.float32) * da_lo - Q3_BIAS * s_lo)
    y += _q3_scale(sl_hi, sh_hi, n, pair) * (hi.to(tl.float32) * da_hi - Q3_BIAS * s_hi)
    return d * y


@triton.jit
def _q2_k(raw, acts, CHUNK: tl.constexpr):
    """Q2_K: value = d * (sc & 15) * code - dmin * (sc >> 4) in 16-value sub-blocks; group r's codes are
    crumbs j = 2 ((r // 2) % 2) (lo) and j + 1 (hi) of its qs run."""
    dd, sc_lo, sc_hi, q0, q1, q2, q3 = raw
    da_lo, s_lo, da_hi, s_hi = acts[4], acts[5], acts[10], acts[11]
    sh = (((tl.arange(0, CHUNK * K_RUNS) % K_RUNS) // 2 % HALF_RUNS) * 2 * CRUMB_BITS)[None, :]
    up = sh + CRUMB_BITS
    lo, hi = _runs(
        _crumb_codes(q0, sh), _crumb_codes(q1, sh), _crumb_codes(q2, sh), _crumb_codes(q3, sh),
        _crumb_codes(q0, up), _crumb_codes(q1, up), _crumb_codes(q2, up), _crumb_codes(q3, up), acts, False,
    )  # fmt: skip
    d, dmin = _f16(dd), _f16(dd >> HALF_WORD_BITS)
    y = lo.to(tl.float32) * (d * (sc_lo & NIBBLE).to(tl.float32) * da_lo)
    y += hi.to(tl.float32) * (d * (sc_hi & NIBBLE).to(tl.float32) * da_hi)
    return y - dmin * ((sc_lo >> NIBBLE_BITS).to(tl.float32) * s_lo + (sc_hi >> NIBBLE_BITS).to(tl.float32) * s_hi)


@triton.jit
def group_sums(raw, acts, FMT: tl.constexpr, CHUNK: tl.constexpr):
    """A chunk's sums a group ([N, G] f32) in one of this module's formats."""
    if FMT == FMT_Q5_K:
        return _q5_k(raw, acts, CHUNK)
    elif FMT == FMT_Q4_0:
        return _q4_0(raw, acts)
    elif FMT == FMT_Q4_1:
        return _q4_1(raw, acts)
    elif FMT == FMT_Q5_1:
        return _q5_1(raw, acts)
    elif FMT == FMT_IQ4_NL:
        return _iq4_nl(raw, acts)
    elif FMT == FMT_IQ4_XS:
        return _iq4_xs(raw, acts, CHUNK)
    elif FMT == FMT_Q3_K:
        return _q3_k(raw, acts, CHUNK)
    else:
        tl.static_assert(FMT == FMT_Q2_K, "no int8 GEMV body for this format")
        return _q2_k(raw, acts, CHUNK)
