"""The int8 GEMV's (`q8`) per-format pieces for Q5_K, Q4_0, Q4_1, Q5_1, IQ4_NL, IQ4_XS, Q3_K and Q2_K: how a
chunk's bytes are loaded (`raw_chunk`) and how a group's codes meet their runs of 16 int8 activations in
dp4a (`chunk_sum`). `q8.row_dots` and every launch built on it (alone, in parts, with epilogues, the gate/up
GLU) call these through `q8.raw_chunk` and `q8.chunk_sums`, so a format here is a format of all of them.

A group is what one thread owns a chunk: 16-value runs of codes, each summed by a chain of four dp4a into an
int32, then scaled once in f32. The groups follow the formats' packing so a group's codes are one 16-byte
run (or two):
- Q5_K (32-value sub-blocks in nibble pairs, as Q4_K): eight groups a super-block; group r meets values
  64 (r // 2) + 16 (r % 2) + 0..15 ("lo") and the 16 from 32 on ("hi"), Q4_K's activation pattern: a 16-byte
  run of qs and the 16 qh bytes of its fifth bits.
- Q3_K and Q2_K (16-value sub-blocks in crumbs): four groups a super-block; group r is the 16-byte qs run
  32 n + 16 t (half n = r // 2, t = r % 2) whole, its crumb j run j (values 128 n + 32 j + 16 t + 0..15),
  and for Q3_K the hmask run 16 t of their third bits (bit 4 n + j). A group of one crumb pair (eight a
  super-block) loaded each qs byte twice and Q3_K's hmask bytes four times (the 7B in Q3_K_M: 386.8 -> 422.1
  tok/s decoding, with its GLU's tile). A Q3_K group of run t of both halves (two a super-block: the hmask run
  and the scale bytes loaded once for 128 values, 22 loads where these take 34) decoded 9 % slower at every
  tile swept (benchmarks/RESULTS.md, 2026-12-05). Q3_K's blocks are the lane's stored ones (112 bytes,
  `kernels.STORED_BLOCK_BYTES`): a group's 12 scale bytes and d are one 128-bit load, its qs and hmask runs one
  each, where the file's 110-byte blocks took 17 loads of 1-4 bytes (the 7B's GLU 28.7 -> 20.2 us, H200).
- the 32-value formats (Q4_0, Q4_1, Q5_1, IQ4_NL) and IQ4_XS's 32-value sub-blocks: a group a block, lo its
  low nibbles (values 0-15), hi its high ones (16-31).
Every group's codes are words held in the thread (`int8_words.ld4` where a run is 16-byte aligned: Q5_K's
176-byte blocks, Q3_K's stored 112-byte ones, and the split rows of IQ4_XS (128 bytes of codes a block, its
8-byte header after the row) and Q4_0 / IQ4_NL (16 bytes of codes, d after the row; two 64-bit loads where a row
does not end on 16 bytes); `ld2` for IQ4_XS's header; `ld_words` where a run is 4-byte aligned: Q4_1, Q5_1,
Q2_K), as `q8` holds Q4_K's and Q6_K's: no shared-memory exchange before a dp4a chain. Where the file's 18-byte
Q4_0 / IQ4_NL blocks put every other run 2 bytes past a word, a run took five 32-bit loads and four funnel shifts
(`int8_words.ld_run`).

Codes enter dp4a as stored (unsigned) and the format's offset is applied once a run from the activation's
16-value sum s: Q4_0's 8 and Q3_K's 4 as a bias, Q4_1's and Q5_1's minimum m and Q2_K's dmin * min as an
added term. A crumb is masked in place (4^j times its code, the run's sum shifted back: one instruction a
word, not two), and Q3_K's third bits are a second dp4a chain on the hmask bytes masked in place. IQ4_NL /
IQ4_XS codes index a table of 16 signed values: the table is four words in registers and a word of eight
codes becomes two words of four signed bytes in seven `prmt` byte permutes (`iq4_pair`), then signed dp4a
(the 7B in IQ4_XS: 335.1 -> 447.3 tok/s decoding, with its GLU's tile, from three permutes a four-code word
and 32-bit loads).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from fuselane.gguf.formats import LAYOUTS, QK, QK_K, Format
from fuselane.lanes.cuda.triton.gemv.fast import K_RUNS, RUN_BYTES, q4_k_scales_of
from fuselane.lanes.cuda.triton.gemv.int8_words import dot16_of, ld2, ld4, ld_scalar, ld_words, prmt, rotl
from fuselane.lanes.cuda.triton.gemv.layout import (
    BYTE,
    BYTE_BITS,
    CRUMB,
    FMT_IQ4_NL,
    FMT_IQ4_XS,
    FMT_MXFP4,
    FMT_Q2_K,
    FMT_Q3_K,
    FMT_Q4_0,
    FMT_Q4_1,
    FMT_Q5_1,
    FMT_Q5_K,
    HALF_WORD_BITS,
    IQ4_NL_BYTES,
    IQ4_NL_QS,
    IQ4_T0,
    IQ4_T1,
    IQ4_T2,
    IQ4_T3,
    IQ4_XS_BYTES,
    IQ4_XS_QS,
    IQ4_XS_SCALES_L,
    MX_T0,
    MX_T1,
    MX_T2,
    MX_T3,
    MXFP4_BYTES,
    MXFP4_QS,
    NIBBLE,
    NIBBLE_BITS,
    Q2_K_BYTES,
    Q2_K_D,
    Q2_K_QS,
    Q2_K_SCALES,
    Q3_K_BYTES,
    Q3_K_HMASK,
    Q3_K_QS,
    Q3_K_SCALES,
    Q3_LOW_SCALES,
    Q4_0_BYTES,
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
    e8m0_scale,
    tail_d,
)
from fuselane.lanes.cuda.triton.quant import CODES_ALIGN

LOW_NIBBLES = const(0x0F0F0F0F)  # the low nibble of each byte of a word
LOW_BITS = const(0x01010101)  # bit 0 of each byte
FIFTH_BITS = const(0x10101010)  # bit 4 of each byte
WORD_BITS = const(32)
# x * SPREAD puts bit i (0..3) of x at bit 8i + 4 (shifts 4, 11, 18, 25; the other products miss the mask)
SPREAD = const((1 << 4) | (1 << 11) | (1 << 18) | (1 << 25))
HALF_WORD = const(0xFFFF)
WORD_VALUES = const(4)  # codes a 32-bit word of a run
CRUMB_BITS = const(2)
Q3_BIAS = const(4.0)  # Q3_K: value = d * (scale - 32) * (code - 4), code = low 2 bits | hmask bit << 2
HBIT_SHIFT = const(2)  # Q3_K: where the hmask bit goes over the 2 low bits
# crumb j of each byte in place (4^j times its code), as int32 words: a run's codes are one mask, not a shift
# and a mask, and the run's code sum is shifted back once (exactly: every term is a multiple of 4^j)
CRUMB_0, CRUMB_1, CRUMB_2, CRUMB_3 = (const((0x03030303 << 2 * j) - ((1 << 32) if j == 3 else 0)) for j in range(4))
# IQ4_NL / IQ4_XS through `prmt` (whose selector nibbles are byte indices, bit 3 a sign mode left clear):
PICK_LOW3 = const(0x77777777)  # each code's byte in its half of the table
TABLE_HALF = const(0x44444444)  # bit 3 of each code moved to bit 2: the second word's byte (the table's 8-15)
IN_ORDER = const(0x32103210)  # bytes 0-3 in order, for each 16-bit half of a selector
EVEN_BYTES, ODD_BYTES = const(0x6420), const(0x7531)  # the low nibbles' values, the high nibbles'
QUAD = const(4)  # Q3_K / Q2_K: groups a super-block, each four runs of 16
DWORD_BYTES = const(8)  # an `ld2` load


def rows_on_16(fmt: Format) -> int:
    """Blocks a row must be a multiple of for a format's rows (its file blocks' bytes a row) to end on 16 bytes,
    so that every row's codes start where one 128-bit load reaches them."""
    return CODES_ALIGN // math.gcd(LAYOUTS[fmt].nbytes, CODES_ALIGN)


# Q4_0 / IQ4_NL rows of a multiple of this many blocks (8 of 18 bytes) end on 16 bytes, so every block's codes
# start on 16 (`kernels.ROW_ALIGN_BYTES`: rows end on 8)
# (MXFP4's rows, its 1-byte e after each 16 bytes of codes, end on 16 bytes at a multiple of 16 blocks)
WIDE_ROW_C = const({int(f): rows_on_16(f) for f in (Format.Q4_0, Format.IQ4_NL, Format.MXFP4)})

# Groups a unit (a block or super-block), and values a unit, of each format here
GROUPS = {
    Format.Q5_K: K_RUNS.value, Format.Q3_K: QUAD.value, Format.Q2_K: QUAD.value, Format.IQ4_XS: QK_K // QK,
    Format.Q4_0: 1, Format.Q4_1: 1, Format.Q5_1: 1, Format.IQ4_NL: 1, Format.MXFP4: 1,
}  # fmt: skip
UNIT_VALUES = {f: QK_K if f in (Format.Q5_K, Format.Q3_K, Format.Q2_K, Format.IQ4_XS) else QK for f in GROUPS}
FORMATS = frozenset(GROUPS)
# formats whose group r meets Q4_K's runs (64 (r // 2) + 16 (r % 2), and 32 on); the rest meet a 32-value block
K_PAIR_FORMATS = frozenset({Format.Q5_K})
# formats whose group r (of four) meets the runs 128 (r // 2) + 16 (r % 2) + 32 j, j = 0..3: a 16-byte run of
# crumbs, whole
K_QUAD_FORMATS = frozenset({Format.Q3_K, Format.Q2_K})
# the alignment each format's loads need of its rows' start: the 128-bit loads (`ld4`) of Q5_K's, Q3_K's (its
# stored 112-byte blocks) and the split formats' runs, the 32-bit words of Q4_1's, Q5_1's and Q2_K's runs
# (`ld_words`) and of Q5_1's qh and Q2_K's header and scales
ALIGN = {
    Format.Q5_K: 16, Format.Q3_K: 16, Format.IQ4_XS: 16, Format.Q4_0: 16, Format.IQ4_NL: 16, Format.MXFP4: 16,
    Format.Q4_1: 4, Format.Q5_1: 4, Format.Q2_K: 4,
}  # fmt: skip


# --- loads ---------------------------------------------------------------------------------------------------


@triton.jit
def _i32(ptr):
    return ptr.to(tl.pointer_type(tl.int32))


@triton.jit
def _word(ptr):
    return ld_scalar(ptr, 4)


@triton.jit
def half_at(ptr):
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
    elif (FMT == FMT_Q4_0) | (FMT == FMT_IQ4_NL) | (FMT == FMT_MXFP4):  # d after the row, 16 codes on 16 bytes (or 8)
        tl.static_assert((Q4_0_BYTES == IQ4_NL_BYTES) & (Q4_0_QS == 0) & (IQ4_NL_QS == 0), "one layout for all")
        tl.static_assert((MXFP4_BYTES == IQ4_NL_BYTES) & (MXFP4_QS == 0), "one layout for all")
        blk = w_rows[:, None] + (unit * Q4_0_BYTES)[None, :]
        d_at = tail_d(w_rows[:, None], unit[None, :], N_UNITS, FMT)
        d = e8m0_scale(ld_scalar(d_at, 1)) if FMT == FMT_MXFP4 else half_at(d_at)
        if N_UNITS // WIDE_ROW_C[FMT] * WIDE_ROW_C[FMT] == N_UNITS:  # rows end on 16 bytes: one 128-bit load
            return (d,) + ld4(_i32(blk), True, PINNED)
        else:  # rows end on 8 bytes (`kernels.ROW_ALIGN_BYTES`)
            return (d,) + ld2(blk, PINNED) + ld2(blk + DWORD_BYTES, PINNED)
    elif FMT == FMT_Q4_1:
        blk = w_rows[:, None] + (unit * Q4_1_BYTES)[None, :]
        return (half_at(blk + Q4_1_D), half_at(blk + Q4_1_M)) + ld_words(blk + Q4_1_QS, PINNED)
    elif FMT == FMT_Q5_1:
        blk = w_rows[:, None] + (unit * Q5_1_BYTES)[None, :]
        return (half_at(blk + Q5_1_D), half_at(blk + Q5_1_M), _word(blk + Q5_1_QH)) + ld_words(blk + Q5_1_QS, PINNED)
    elif FMT == FMT_IQ4_XS:  # d and scales_h as one word, scales_l the next (after the row); a 16-byte qs run
        tl.static_assert(IQ4_XS_SCALES_L == 4, "IQ4_XS's header is one 8-byte load")
        blk = w_rows[:, None] + (unit * IQ4_XS_BYTES)[None, :]
        head = ld2(tail_d(w_rows[:, None], unit[None, :], N_UNITS, FMT))
        return head + ld4(_i32(blk + r * RUN_BYTES + IQ4_XS_QS), True, PINNED)
    elif FMT == FMT_Q3_K:  # the 12 scale bytes and d as one 16-byte load (a stored block's), qs and hmask runs
        blk = w_rows[:, None] + (unit * Q3_K_BYTES)[None, :]
        t = r % 2
        s0, s1, s2, dw = ld4(_i32(blk + Q3_K_SCALES), True, PINNED)
        # the group's four scale bytes t, t + 2, t + 4, t + 6 (low nibbles) and 8 + t, 10 + t (top crumbs): byte
        # t of each word and of its upper half, read by `_q3_run` from bit 0 (it masks what it reads)
        shift = t * BYTE_BITS
        lo, mid, hi = s0 >> shift, s1 >> shift, s2 >> shift
        scales = lo, lo >> HALF_WORD_BITS, mid, mid >> HALF_WORD_BITS, hi, hi >> HALF_WORD_BITS
        qs = ld4(_i32(blk + r * RUN_BYTES + Q3_K_QS), True, PINNED)
        return (_f16(dw),) + scales + qs + ld4(_i32(blk + t * RUN_BYTES + Q3_K_HMASK), True, PINNED)
    else:
        tl.static_assert(FMT == FMT_Q2_K, "no int8 GEMV body for this format")
        blk = w_rows[:, None] + (unit * Q2_K_BYTES)[None, :]
        sc = blk + Q2_K_SCALES + (r // 2) * Q3_LOW_SCALES  # the half's eight scale bytes
        head = _word(blk + Q2_K_D), _word(sc), _word(sc + 4)
        return head + ld_words(blk + r * RUN_BYTES + Q2_K_QS, PINNED)


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
def _q5_k_codes(q, qh, turn):
    """A word's four lo and four hi 5-bit codes: `q`'s low (high) nibbles under the fifth bits that `qh`'s bytes
    rotated by `turn` hold at bit 4 (bit 5), one rotation for both."""
    r = rotl(qh, turn)
    lo = (q & LOW_NIBBLES) | (r & FIFTH_BITS)
    hi = ((q >> NIBBLE_BITS) & LOW_NIBBLES) | ((r >> 1) & FIFTH_BITS)
    return lo, hi


@triton.jit
def k_pair_sums(lo, hi, d, dmin, scales, mins, da_lo, s_lo, da_hi, s_hi):
    """Q4_K's and Q5_K's sum of a group from its two runs' code sums (`lo`, `hi`): d * scale * sum * da -
    dmin * min * s each. The code sum times the 6-bit scale is an exact integer (under 2^24, so exact in f32
    too): one conversion a run for both, where a conversion each costs a quarter-rate instruction more."""
    y = (lo * (scales & BYTE)).to(tl.float32) * (d * da_lo) - (dmin * (mins & BYTE).to(tl.float32)) * s_lo
    y += (hi * (scales >> BYTE_BITS)).to(tl.float32) * (d * da_hi) - (dmin * (mins >> BYTE_BITS).to(tl.float32)) * s_hi
    return y


@triton.jit
def _q5_k(raw, acts, CHUNK: tl.constexpr):
    """Q5_K: as Q4_K (value = d * scale * code - dmin * min), each code's fifth bit bit 2j (lo) or 2j + 1 (hi)
    of its qh byte, j = r // 2 the group's pair of sub-blocks."""
    h0, h1, h2, h3, q0, q1, q2, q3, e0, e1, e2, e3 = raw
    da_lo, s_lo, da_hi, s_hi = acts[4], acts[5], acts[10], acts[11]
    d, dmin, scales, mins = q4_k_scales_of(h0, h1, h2, h3, CHUNK)
    # the pair's lo fifth bits are bit 2j of each qh byte: a left turn of 4 - 2j (mod 32) takes them to bit 4
    # and the hi ones (2j + 1) to bit 5; no byte's bits cross into another's fields (j = 3 turns right by 2)
    b = ((tl.arange(0, CHUNK * K_RUNS) % K_RUNS) // 2 * 2)[None, :]
    turn = (NIBBLE_BITS - b) & (WORD_BITS - 1)
    lo0, hi0 = _q5_k_codes(q0, e0, turn)
    lo1, hi1 = _q5_k_codes(q1, e1, turn)
    lo2, hi2 = _q5_k_codes(q2, e2, turn)
    lo3, hi3 = _q5_k_codes(q3, e3, turn)
    lo, hi = _runs(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, acts, False)
    return k_pair_sums(lo, hi, d, dmin, scales, mins, da_lo, s_lo, da_hi, s_hi)


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
def iq4_pair(q, MX: tl.constexpr = False):
    """A word of eight codes (byte i: one value's code in its low nibble, the value 16 on's in its high one)
    -> the word of the low nibbles' four signed table values and the word of the high ones'. Each 16-bit
    half of the word is a selector of four nibbles: its codes pick their bytes from the table's low half
    (codes 0-7) and its high half (8-15), and bit 3 of each picks between the two; then two permutes part
    the low nibbles' values from the high ones'. Seven `prmt` a word (eight values). MX: MXFP4's table."""
    sel = q & PICK_LOW3
    side = ((q >> 1) & TABLE_HALF) | IN_ORDER
    zero = tl.zeros_like(q)
    if MX:
        t0, t1, t2, t3 = zero + MX_T0, zero + MX_T1, zero + MX_T2, zero + MX_T3
    else:
        t0, t1, t2, t3 = zero + IQ4_T0, zero + IQ4_T1, zero + IQ4_T2, zero + IQ4_T3
    first = prmt(prmt(t0, t1, sel), prmt(t2, t3, sel), side)
    up, up_side = sel >> HALF_WORD_BITS, side >> HALF_WORD_BITS
    second = prmt(prmt(t0, t1, up), prmt(t2, t3, up), up_side)
    return prmt(first, second, zero + EVEN_BYTES), prmt(first, second, zero + ODD_BYTES)


@triton.jit
def _iq4_runs(q0, q1, q2, q3, acts, MX: tl.constexpr = False):
    """IQ4_NL / IQ4_XS / MXFP4: a block's low nibbles' table values with its first 16 activations, its high
    ones' with the next 16, as signed dp4a."""
    lo0, hi0 = iq4_pair(q0, MX)
    lo1, hi1 = iq4_pair(q1, MX)
    lo2, hi2 = iq4_pair(q2, MX)
    lo3, hi3 = iq4_pair(q3, MX)
    return _runs(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, acts, True)


@triton.jit
def _iq4_nl(raw, acts, MX: tl.constexpr = False):
    """IQ4_NL: value = d * table[code]; MX: MXFP4's table (its d the power of two its e stands for)."""
    d, q0, q1, q2, q3 = raw
    lo, hi = _iq4_runs(q0, q1, q2, q3, acts, MX)
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
def _quad_runs(CHUNK: tl.constexpr):
    """[1, G]: each group's index r in its super-block (Q3_K / Q2_K: half r // 2, run of 16 r % 2)."""
    return (tl.arange(0, CHUNK * QUAD) % QUAD)[None, :]


@triton.jit
def _crumb_sum(q, a0, a1, a2, a3, J: tl.constexpr, MASK: tl.constexpr):
    """A run's code sum: crumb J of the group's 16 qs bytes (`q`, four words) times its 16 activations, the
    crumbs masked in place and the sum shifted back."""
    q0, q1, q2, q3 = q
    return dot16_of(q0 & MASK, q1 & MASK, q2 & MASK, q3 & MASK, a0, a1, a2, a3, False) >> J * CRUMB_BITS


@triton.jit
def _q3_run(q, m, a0, a1, a2, a3, da, s, low, high, n, hbits, J: tl.constexpr, MASK: tl.constexpr):
    """Q3_K: run J of a group of half n, times its scale - 32: the codes crumb J of its qs bytes, + 4 where
    bit 4n + J of its hmask bytes is set (the bits summed apart, masked in place), - 4 (from the run's sum
    s); the scale's low 4 bits nibble n of `low`, its top 2 bits crumb 2n + J // 2 of `high`."""
    m0, m1, m2, m3 = m
    hb = hbits << J
    h = dot16_of(m0 & hb, m1 & hb, m2 & hb, m3 & hb, a0, a1, a2, a3, False)
    dot = _crumb_sum(q, a0, a1, a2, a3, J, MASK) + ((h >> (n * WORD_VALUES + J)) << HBIT_SHIFT)
    six = ((low >> n * NIBBLE_BITS) & NIBBLE) | (((high >> (n * 2 + J // 2) * CRUMB_BITS) & CRUMB) << NIBBLE_BITS)
    return (six - SIGNED_SCALE).to(tl.float32) * (dot.to(tl.float32) * da - s * Q3_BIAS)


@triton.jit
def _q3_k(raw, acts, CHUNK: tl.constexpr):
    """Q3_K: value = d * (scale - 32) * (code - 4) in 16-value sub-blocks. Group r: half n = r // 2, its qs
    bytes 32n + 16 (r % 2) + 0..15 whose crumb j is run j (values 128n + 32j + 16 (r % 2) + 0..15, sub-block
    8n + 2j + r % 2), the hmask bytes 16 (r % 2) + 0..15 their third bits."""
    d, l0, l1, l2, l3, h0, h1, q0, q1, q2, q3, m0, m1, m2, m3 = raw
    n = _quad_runs(CHUNK) // 2
    hbits = (tl.zeros_like(q0) + LOW_BITS) << n * WORD_VALUES
    q, m, a = (q0, q1, q2, q3), (m0, m1, m2, m3), acts
    y = _q3_run(q, m, a[0], a[1], a[2], a[3], a[4], a[5], l0, h0, n, hbits, 0, CRUMB_0)
    y += _q3_run(q, m, a[6], a[7], a[8], a[9], a[10], a[11], l1, h1, n, hbits, 1, CRUMB_1)
    y += _q3_run(q, m, a[12], a[13], a[14], a[15], a[16], a[17], l2, h0, n, hbits, 2, CRUMB_2)
    y += _q3_run(q, m, a[18], a[19], a[20], a[21], a[22], a[23], l3, h1, n, hbits, 3, CRUMB_3)
    return d * y


@triton.jit
def _q2_run(q, a0, a1, a2, a3, da, s, word, t, J: tl.constexpr, MASK: tl.constexpr):
    """Q2_K: run J of a group, as (its code sum times its scale, its min times the run's sum s); its scale
    byte is byte 2 (J % 2) + t of `word` (the scale's low nibble, the min's high one)."""
    sc = (word >> (t * BYTE_BITS + (J % 2) * HALF_WORD_BITS)) & BYTE
    c = _crumb_sum(q, a0, a1, a2, a3, J, MASK) * (sc & NIBBLE)  # exact: under 2^17
    return c.to(tl.float32) * da, (sc >> NIBBLE_BITS).to(tl.float32) * s


@triton.jit
def _q2_k(raw, acts, CHUNK: tl.constexpr):
    """Q2_K: value = d * (sc & 15) * code - dmin * (sc >> 4) in 16-value sub-blocks; group r's runs as
    Q3_K's, run j's scale byte 8 (r // 2) + 2j + r % 2 (`w0` the half's bytes 0-3, `w1` 4-7)."""
    dd, w0, w1, q0, q1, q2, q3 = raw
    t = _quad_runs(CHUNK) % 2
    q, a = (q0, q1, q2, q3), acts
    y0, m0 = _q2_run(q, a[0], a[1], a[2], a[3], a[4], a[5], w0, t, 0, CRUMB_0)
    y1, m1 = _q2_run(q, a[6], a[7], a[8], a[9], a[10], a[11], w0, t, 1, CRUMB_1)
    y2, m2 = _q2_run(q, a[12], a[13], a[14], a[15], a[16], a[17], w1, t, 2, CRUMB_2)
    y3, m3 = _q2_run(q, a[18], a[19], a[20], a[21], a[22], a[23], w1, t, 3, CRUMB_3)
    return _f16(dd) * ((y0 + y1) + (y2 + y3)) - _f16(dd >> HALF_WORD_BITS) * ((m0 + m1) + (m2 + m3))


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
    elif FMT == FMT_MXFP4:
        return _iq4_nl(raw, acts, True)
    elif FMT == FMT_IQ4_XS:
        return _iq4_xs(raw, acts, CHUNK)
    elif FMT == FMT_Q3_K:
        return _q3_k(raw, acts, CHUNK)
    else:
        tl.static_assert(FMT == FMT_Q2_K, "no int8 GEMV body for this format")
        return _q2_k(raw, acts, CHUNK)
