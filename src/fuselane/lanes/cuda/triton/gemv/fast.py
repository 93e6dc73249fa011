"""Bandwidth-first decode GEMV for one activation row: y (1, n) = x (1, k) @ W^T, W as checkpoint bytes.

A decode step's products stream every weight byte once, so they run at the rate the bytes arrive. These are
plain 2-D-tile kernels that keep bytes in flight with little bookkeeping:

- a program takes BLOCK_N whole rows (grid `cdiv(n, BLOCK_N)`, four warps) and walks them in chunks of CHUNK
  units (a K super-block, a 32-value block, 32 f16 values); each iteration first issues the next chunk's
  weight loads (a one-chunk register prefetch), then decodes and accumulates this one's;
- a chunk of a row is cut into scale groups (Q4_K, Q6_K: 16-byte runs of codes, one sub-block of each
  nibble; Q8_0, Q5_0: a block; F16: 32 values) and CHUNK makes BLOCK_N * groups the block's 128 threads
  (or twice that, two groups a thread, where a format's tile says so):
  a thread owns one (row, group), loads its codes as whole vectors (16 bytes, or 2-byte words where blocks
  are only 2-byte aligned), decodes its group's scales once, and multiplies its values into an f32
  accumulator of the tile's shape, ELEMENTWISE: no reductions and no cross-lane traffic in the loop;
- tiles are [BLOCK_N, G, 4, 4]: rows and groups take the lanes and warps (Triton's default layouts hand out
  lanes to tied axes in order), the 4-wide axes stay in the thread. The activations are loaded with the
  tile's full shape, so they land in the weights' layout (rows sharing an address are one broadcast), and
  no layout conversion in the loop goes through shared memory (checked in sm_90 SASS);
- a partial last chunk reads the row's last unit in place of the missing ones and zeroes them; no weight
  load is masked (rows past n read row n - 1, and the store drops them).

Codes become floats by the 2^23 trick: OR-ing an integer u < 2^23 into the bits of 2^23 gives the float
2^23 + u, and one subtraction leaves u: two full-rate ops, where the int-to-float converter runs at a
fraction of the rate on Hopper. A code is kept where it lies in its word (2^e times its value, its scale
taken 2^-e: exact), so most values cost one AND. Every decoded weight is bit for bit the f32 value of
`fuselane.gguf.dequant` (scale products are exact in f32; Q4_K's minimum is subtracted with one rounding,
as gguf does), so only the summation order differs from the reference.

sm_90 SASS of the loop (Triton 3.6, k = 4096, default tiles, PREFETCH_FENCE): ~6.8 instructions a value
for Q4_K, 7.4 for Q6_K, 6.1 for Q8_0, 7.6 for Q5_0, 3.6 for F16; 72-96 registers (the GLU 128-168), no spills.
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import LAYOUTS, QK, QK_K, Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv import fast_tiles
from fuselane.lanes.cuda.triton.gemv.layout import (
    BYTE,
    BYTE_BITS,
    F32_TWO_23_BITS,
    FMT_BF16,
    FMT_F16,
    FMT_Q4_K,
    FMT_Q5_0,
    FMT_Q6_K,
    FMT_Q8_0,
    HALF_WORD_BITS,
    NIBBLE,
    NIBBLE_BITS,
    Q4_K_BYTES,
    Q4_K_D,
    Q4_K_DMIN,
    Q4_K_QS,
    Q4_K_SCALES,
    Q5_0_BYTES,
    Q5_0_D,
    Q5_0_QH,
    Q5_0_QS,
    Q5_BIAS,
    Q6_BIAS,
    Q6_HALF,
    Q6_HIGH_SUBS,
    Q6_K_BYTES,
    Q6_K_QH,
    Q6_K_QL,
    Q6_K_SCALES,
    Q6_QH_HALF,
    Q6_QL_HALF,
    Q8_0_BYTES,
    Q8_0_QS,
    QK_C,
    QK_K_C,
    WORD,
    const,
    in_two_23,
    q6_k_d,
    q8_0_d,
)
from fuselane.lanes.cuda.triton.gemv.parts import Part, check_glu_out, check_rows, part_rows, parts_args, store_parts

# --- tiles -------------------------------------------------------------------------------------------------------

# Scale groups a unit has (Q4_K: 16-byte runs of qs, two a sub-block pair; Q6_K: 16-byte runs of ql, four a
# half) and values a unit. Eight rows a tile (TILES below has each format's): a 4096-row product is 512 programs,
# ~4 for each of an H200's 132 SMs, so small products still fill the machine; the chunk follows (2 super-
# blocks, 16 blocks, 512 f16 values an iteration).
K_RUNS, Q6_RUNS = const(8), const(8)
GROUPS = {Format.Q4_K: K_RUNS.value, Format.Q6_K: Q6_RUNS.value, Format.Q8_0: 1, Format.Q5_0: 1, Format.F16: 1}
GROUPS[Format.BF16] = 1  # BF16 rows as F16's: 32 values a unit, two 16-byte loads a thread
GROUPS_C = const({int(f): g for f, g in GROUPS.items()})
UNIT_VALUES = {Format.Q4_K: QK_K, Format.Q6_K: QK_K, Format.Q8_0: QK, Format.Q5_0: QK, Format.F16: QK, Format.BF16: QK}
WARPS, LANES = 4, 32
if frozenset(GROUPS) != kernels.FAST_GEMV_FORMATS:
    raise RuntimeError("kernels.FAST_GEMV_FORMATS must name this GEMV's formats (`GROUPS`)")
# A CTA barrier after each iteration's prefetch: without it ptxas (Triton 3.6, sm_90) sinks the next chunk's
# loads to the loop's end, so a warp waits out each chunk's latency; with it they issue first and a chunk's
# decode covers the next one's latency, for ~3 % more instructions and 60-96 registers. Read at launch:
# set False to time the other schedule.
PREFETCH_FENCE = True

QUAD = const(4)  # a thread's group as quads: 4 words (16 bytes) of codes, or 4 values (one 16-byte f32 load)
PAIR = const(2)  # 2-byte loads: the most that the 2-aligned blocks of Q8_0, Q5_0 and Q6_K allow
HALF_WORD = const(0xFFFF)
F32_EXP_BIAS, F32_MANT_BITS = const(127), const(23)
# Q4_K: a pair j of sub-blocks (2j in the low nibbles, 2j + 1 in the high ones) is 32 qs bytes, 64 values
PAIR_BYTES, PAIR_VALUES, RUN_BYTES, PAIR_RUNS = const(32), const(64), const(16), const(2)
LOW_3_BYTES = const(0xFFFFFF)  # bytes 0-2 of a word: their nibbles in place stay below 2^23's bits
TOP_SHIFT = const(12)  # the word 12 bits down: byte 2's high nibble at bits 8-11, byte 3's nibbles at 12-19
# Q4_K's 12 scale bytes as 16-bit pairs: pair j < 2 has its 6-bit scales in bytes 2j, 2j + 1 and its mins
# four bytes on; j >= 2 has both's low 4 bits as the nibbles of bytes 2j + 4, 2j + 5 and their top 2 bits
# as the top bits of bytes 2j - 4, 2j - 3 (scales) and 2j, 2j + 1 (mins).
K_LOW_PAIRS, K_MIN_BYTES, TOP_TWO_SHIFT = const(2), const(4), const(2)
SIX_BITS_2, NIBBLE_2, TOP_TWO_2 = const(0x3F3F), const(0x0F0F), const(0x3030)  # per byte of a 16-bit pair
# Q6_K: two halves of 128 values; byte b (0..63) of a half's ql holds value b (sub-block b // 16) in its low
# nibble and 64 + b (four sub-blocks on) in its high one; qh byte b % 32 of the half holds their top 2 bits
# as crumbs b // 32 and 2 + b // 32. A 16-byte run r of a half's ql is one sub-block of each nibble.
Q6_HALF_RUNS, Q6_RUN = const(4), const(16)
Q6_QH_RUNS, Q6_SUBS_HALF = const(2), const(8)
Q6_CRUMB_SHIFT = const(4)  # qh << (4 - 2 (r // 2)) puts both crumbs of a byte 4 bits over their nibbles
Q6_CRUMB = const(0x30)
SIGNED_BIAS = const(128)  # Q8_0: value = d * ((q + 128) - 128), q + 128 unsigned
SIGN_BITS = const(0x8080)  # XOR-ed into two signed bytes: q + 128 each, unsigned
HALF_BLOCK = const(16)  # Q8_0: bytes 0-15 and 16-31; Q5_0: values 0-15 (low nibbles) and 16-31 (high ones)
FIFTH_BIT = const(0x10)  # Q5_0: a code's fifth bit, over its low nibble
F16_RUN = const(8)  # F16: a unit's 32 values as 4 runs of 8, a quad of each plane


# the alignments the loads take for granted: Q4_K a 16-byte header (d, dmin, scales) and 16-byte runs;
# the other formats 2-byte words
if LAYOUTS[Format.Q4_K].nbytes % RUN_BYTES.value or LAYOUTS[Format.Q4_K].field("qs").offset != RUN_BYTES.value:
    raise RuntimeError("Q4_K: the fast GEMV's loads no longer fit the layout")
for _lay in (LAYOUTS[Format.Q8_0], LAYOUTS[Format.Q5_0], LAYOUTS[Format.Q6_K]):
    if _lay.nbytes % 2 or any(f.offset % 2 for f in _lay.fields if f.name != "scales"):
        raise RuntimeError(f"{_lay.fmt.name}: the fast GEMV loads 2-byte words; the layout moved")


# --- helpers -----------------------------------------------------------------------------------------------------


@triton.jit
def ld_once(ptr):
    """Weight bytes, read once: evict_first keeps them from pushing the activations out of L2."""
    return tl.load(ptr, eviction_policy="evict_first")


@triton.jit
def ld16(ptr, F16: tl.constexpr = False):
    """The 2-byte words at byte pointers `ptr` (2-aligned), as int32, or as f16 values (F16) in f32."""
    return ld_once(ptr.to(tl.pointer_type(tl.float16 if F16 else tl.uint16))).to(tl.float32 if F16 else tl.int32)


@triton.jit
def _acts(ptr, live, MASKED: tl.constexpr):
    """Activations as f32 (default caching: every program re-reads them); 0 past the row."""
    return tl.load(ptr, mask=live if MASKED else None, other=0.0 if MASKED else None).to(tl.float32)


@triton.jit
def _at(value, e):
    """value << e for an integer tensor e (the constant made a tensor first)."""
    return (tl.zeros_like(e) + value) << e


@triton.jit
def _pow2(e):
    """2^-e, e an integer tensor in 0..126, as f32 from its exponent bits (exact, no exp2)."""
    return ((-e + F32_EXP_BIAS) << F32_MANT_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _quads_of(N: tl.constexpr, STEP: tl.constexpr, RUN: tl.constexpr = QUAD):
    """Offsets [1, 1, 4, N] of a run as 4 quads (RUN apart) of N items STEP apart: 16 values (N = 4, STEP = 1),
    or the 2-byte words of a 16-byte run (N = 2, STEP = 2)."""
    return tl.arange(0, QUAD)[None, None, :, None] * RUN + tl.arange(0, N)[None, None, None, :] * STEP


@triton.jit
def _bytes(v):
    """[N, G, 4, 2] 16-bit words -> [N, G, 4, 2, 1], and the index e of their bytes as [1, 1, 1, 1, 2]."""
    return v[:, :, :, :, None], tl.arange(0, PAIR)[None, None, None, None, :]


@triton.jit
def _quads(wa, wb, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """Planes [N, G, 4, 2, 2] (a quad's 2-byte words, their bytes) -> [N, G, 4, 4]: bytes in memory order."""
    return tl.reshape(wa, [BLOCK_N, G, QUAD, QUAD]), tl.reshape(wb, [BLOCK_N, G, QUAD, QUAD])


# --- per format: decoding a chunk's raw bytes (`load_chunk`, loaded a chunk ahead) ----------------------------------
#
# Each `_w_*` returns two f32 planes (wa, wb) [N, G, 4, 4], which meet the activations `_activations` loads.


@triton.jit
def _header_u16(h0, h1, h2, h3, off):
    """The 16-bit word at byte `off` (even, < 16) of a Q4_K header held as 4 words."""
    word = tl.where(off < WORD, h0, tl.where(off < 2 * WORD, h1, tl.where(off < 3 * WORD, h2, h3)))
    return (word >> ((off % WORD) * BYTE_BITS)) & HALF_WORD


@triton.jit
def q4_k_scales(header, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Q4_K: each group's super-block d and dmin (f32, [N, G]) and its pair's 6-bit scales and mins as 16-bit
    pairs (sub-block 2j in the low byte, 2j + 1 in the high one), from the 16-byte headers as 4 words."""
    a, b = tl.split(tl.reshape(header, [BLOCK_N, CHUNK * K_RUNS, PAIR, PAIR]))
    h0, h2 = tl.split(a)
    h1, h3 = tl.split(b)
    return q4_k_scales_of(h0, h1, h2, h3, CHUNK)


@triton.jit
def q4_k_scales_of(h0, h1, h2, h3, CHUNK: tl.constexpr):
    """`q4_k_scales` from the header's four words held apart ([N, G] each)."""
    d = _header_u16(h0, h1, h2, h3, Q4_K_D).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = _header_u16(h0, h1, h2, h3, Q4_K_DMIN).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    j = ((tl.arange(0, CHUNK * K_RUNS) % K_RUNS) // PAIR_RUNS)[None, :]
    low = j < K_LOW_PAIRS
    p = _header_u16(h0, h1, h2, h3, j * PAIR + Q4_K_SCALES)  # bytes 2j, 2j + 1 of the scales
    q = _header_u16(h0, h1, h2, h3, j * PAIR + (Q4_K_SCALES + K_MIN_BYTES))
    r = _header_u16(h0, h1, h2, h3, j * PAIR - tl.where(low, 0, K_MIN_BYTES) + Q4_K_SCALES)
    scales = tl.where(low, p & SIX_BITS_2, (q & NIBBLE_2) | ((r >> TOP_TWO_SHIFT) & TOP_TWO_2))
    mins = tl.where(low, q & SIX_BITS_2, ((q >> NIBBLE_BITS) & NIBBLE_2) | ((p >> TOP_TWO_SHIFT) & TOP_TWO_2))
    return d, dmin, scales, mins


@triton.jit
def _w_q4_k(raw, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Q4_K: value = d * scale * code - dmin * min. A group is a 16-byte run of pair j's qs: wa its low
    nibbles (sub-block 2j), wb its high ones (2j + 1); [N, G, 4 words, 4 bytes]."""
    header, words = raw
    d, dmin, scales, mins = q4_k_scales(header, BLOCK_N, CHUNK)
    ds_a = (d * (scales & BYTE).to(tl.float32))[:, :, None, None]
    ds_b = (d * (scales >> BYTE_BITS).to(tl.float32))[:, :, None, None]
    dm_a = (dmin * (mins & BYTE).to(tl.float32))[:, :, None, None]
    dm_b = (dmin * (mins >> BYTE_BITS).to(tl.float32))[:, :, None, None]
    # Byte t of a word holds two codes, each kept where it lies: bytes 0-2's low nibbles (e = 8t) and bytes
    # 0-1's high ones (e = 8t + 4) in the word itself, the rest in the word 12 bits down (byte 2's high
    # nibble at e = 8, byte 3's at 12 and 16): all under 2^23's bits.
    t = tl.arange(0, QUAD)[None, None, None, :]
    w = words[:, :, :, None]
    w_in_place = (w & LOW_3_BYTES) | F32_TWO_23_BITS
    w_down = (w >> TOP_SHIFT) | F32_TWO_23_BITS
    e_lo = tl.where(t < 3, t * BYTE_BITS, TOP_SHIFT)
    e_hi = tl.where(t < 2, t * BYTE_BITS + NIBBLE_BITS, t * BYTE_BITS - TOP_SHIFT + NIBBLE_BITS)
    lo = tl.where(t < 3, w_in_place, w_down) & (_at(NIBBLE, e_lo) | F32_TWO_23_BITS)
    hi = tl.where(t < 2, w_in_place, w_down) & (_at(NIBBLE, e_hi) | F32_TWO_23_BITS)
    wa = in_two_23(lo, 0.0) * (ds_a * _pow2(e_lo)) - dm_a
    wb = in_two_23(hi, 0.0) * (ds_b * _pow2(e_hi)) - dm_b
    return wa, wb


@triton.jit
def q6_k_runs(u0, CHUNK: tl.constexpr):
    """Q6_K: each group's (a ql run's) unit, half and run of the half, [G] each."""
    g = tl.arange(0, CHUNK * Q6_RUNS)
    return g // Q6_RUNS + u0, (g % Q6_RUNS) // Q6_HALF_RUNS, g % Q6_HALF_RUNS


@triton.jit
def _w_q6_k(raw, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Q6_K: value = d * scale * (code - 32); wa the low nibbles of a run, wb the high ones."""
    d, sc_lo, sc_hi, ql, qh = raw
    _, _, r = q6_k_runs(0, CHUNK)
    ds_a = (d * sc_lo.to(tl.float32))[:, :, None, None, None]
    ds_b = (d * sc_hi.to(tl.float32))[:, :, None, None, None]
    ql, e = _bytes(ql | F32_TWO_23_BITS)
    top, _ = _bytes(qh << ((r // 2) * -2 + Q6_CRUMB_SHIFT)[None, :, None, None])
    # byte e of a 2-byte word, in place: 2^(8e) times the low nibble's code, 2^(8e + 4) times the high one's
    e_lo, e_hi = e * BYTE_BITS, e * BYTE_BITS + NIBBLE_BITS
    lo = (ql & (_at(NIBBLE, e_lo) | F32_TWO_23_BITS)) | (top & _at(Q6_CRUMB, e_lo))
    hi = (ql & (_at(NIBBLE, e_hi) | F32_TWO_23_BITS)) | (top & _at(Q6_CRUMB, e_hi))
    wa = in_two_23(lo, _at(Q6_BIAS, e_lo).to(tl.float32)) * (ds_a * _pow2(e_lo))
    wb = in_two_23(hi, _at(Q6_BIAS, e_hi).to(tl.float32)) * (ds_b * _pow2(e_hi))
    return _quads(wa, wb, BLOCK_N, CHUNK * Q6_RUNS)


@triton.jit
def _w_q8_0(raw, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Q8_0: value = d * q, q a signed byte; wa bytes 0-15 of a block, wb bytes 16-31."""
    d, qa, qb = raw
    # one XOR flips both bytes' sign bits (q + 128, unsigned) and sets 2^23's bits, which they do not touch
    qa, e = _bytes(qa ^ (F32_TWO_23_BITS | SIGN_BITS))
    qb, _ = _bytes(qb ^ (F32_TWO_23_BITS | SIGN_BITS))
    mask = _at(BYTE, e * BYTE_BITS) | F32_TWO_23_BITS  # byte e in place: 2^(8e) times its code
    bias = _at(SIGNED_BIAS, e * BYTE_BITS).to(tl.float32)
    scale = d[:, :, None, None, None] * _pow2(e * BYTE_BITS)
    wa = in_two_23(qa & mask, bias) * scale
    wb = in_two_23(qb & mask, bias) * scale
    return _quads(wa, wb, BLOCK_N, CHUNK)


@triton.jit
def _w_q5_0(raw, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Q5_0: value = d * (code - 16); qs byte i holds the low 4 bits of value i (wa) in its low nibble and of
    value 16 + i (wb) in its high one; bit v of the 32-bit qh is value v's fifth bit."""
    d, qh, qs = raw
    qs, e = _bytes(qs | F32_TWO_23_BITS)
    i = tl.arange(0, QUAD)[None, None, :, None, None] * QUAD + tl.arange(0, PAIR)[None, None, None, :, None] * PAIR + e
    fifth = qh[:, :, None, None, None] >> i  # bit 0: value i's fifth bit; bit 16: value 16 + i's
    e_lo, e_hi = e * BYTE_BITS, e * BYTE_BITS + NIBBLE_BITS  # the nibbles in place, as for Q6_K
    lo = (qs & (_at(NIBBLE, e_lo) | F32_TWO_23_BITS)) | ((fifth << (e_lo + NIBBLE_BITS)) & _at(FIFTH_BIT, e_lo))
    hi = ((fifth >> HALF_WORD_BITS) << (e_hi + NIBBLE_BITS)) & _at(FIFTH_BIT, e_hi)
    hi |= qs & (_at(NIBBLE, e_hi) | F32_TWO_23_BITS)
    d = d[:, :, None, None, None]
    wa = in_two_23(lo, _at(Q5_BIAS, e_lo).to(tl.float32)) * (d * _pow2(e_lo))
    wb = in_two_23(hi, _at(Q5_BIAS, e_hi).to(tl.float32)) * (d * _pow2(e_hi))
    return _quads(wa, wb, BLOCK_N, CHUNK)


# --- the loop ----------------------------------------------------------------------------------------------------


@triton.jit
def load_chunk(w_rows, u0, FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, CLAMP: tl.constexpr):
    """Units u0.. of each row (`w_rows`: [N] uint8 pointers) as a tuple of [N, G, ...] tiles of raw bytes;
    with CLAMP (a partial last chunk) units past the row read its last unit."""
    if FMT == FMT_Q6_K:
        unit, half, r = q6_k_runs(u0, CHUNK)
    else:
        unit = tl.arange(0, CHUNK * GROUPS_C[FMT]) // GROUPS_C[FMT] + u0
    if CLAMP:
        unit = tl.minimum(unit, N_UNITS - 1)
    if FMT == FMT_Q4_K:  # the 16-byte header (d, dmin, scales) and a 16-byte run of qs, as 4 words each
        blk = (w_rows[:, None] + (unit * Q4_K_BYTES)[None, :])[:, :, None]
        run = blk + ((tl.arange(0, CHUNK * K_RUNS) % K_RUNS) * RUN_BYTES + Q4_K_QS)[None, :, None]
        words = tl.arange(0, QUAD)[None, None, :]
        raw = ld_once(blk.to(tl.pointer_type(tl.uint32)) + words), ld_once(run.to(tl.pointer_type(tl.uint32)) + words)
    elif FMT == FMT_Q6_K:  # d, the run's two scales, its 16 ql bytes and the 16 qh bytes of their crumbs
        blk = w_rows[:, None] + (unit * Q6_K_BYTES)[None, :]
        sc = (blk + (half * Q6_SUBS_HALF + r + Q6_K_SCALES)[None, :]).to(tl.pointer_type(tl.int8))
        ql = (blk + (half * Q6_QL_HALF + r * Q6_RUN + Q6_K_QL)[None, :])[:, :, None, None] + _quads_of(PAIR, PAIR)
        qh = (blk + (half * Q6_QH_HALF + (r % Q6_QH_RUNS) * Q6_RUN + Q6_K_QH)[None, :])[:, :, None, None]
        raw = (
            ld16(q6_k_d(w_rows[:, None], unit[None, :], N_UNITS), True),
            ld_once(sc),
            ld_once(sc + Q6_HIGH_SUBS),
            ld16(ql),
            ld16(qh + _quads_of(PAIR, PAIR)),
        )
    elif FMT == FMT_Q8_0:  # d (after the row's blocks) and the block's two 16-byte halves
        blk = w_rows[:, None] + (unit * Q8_0_BYTES)[None, :]
        qs = blk[:, :, None, None] + Q8_0_QS + _quads_of(PAIR, PAIR)
        raw = ld16(q8_0_d(w_rows[:, None], unit[None, :], N_UNITS), True), ld16(qs), ld16(qs + HALF_BLOCK)
    elif FMT == FMT_Q5_0:  # d, qh as little-endian 32 bits, the 16 qs bytes
        blk = w_rows[:, None] + (unit * Q5_0_BYTES)[None, :]
        qh = ld16(blk + Q5_0_QH) | (ld16(blk + Q5_0_QH + PAIR) << HALF_WORD_BITS)
        raw = ld16(blk + Q5_0_D, True), qh, ld16(blk[:, :, None, None] + Q5_0_QS + _quads_of(PAIR, PAIR))
    else:
        tl.static_assert(FMT == FMT_F16 or FMT == FMT_BF16, "no fast GEMV for this format")
        rows = w_rows.to(tl.pointer_type(tl.float16 if FMT == FMT_F16 else tl.bfloat16))[:, None, None, None]
        rows += unit[None, :, None, None] * QK_C + _quads_of(QUAD, 1, F16_RUN)
        raw = ld_once(rows), ld_once(rows + QUAD)
    return raw


@triton.jit
def _activations(x, u0, FMT: tl.constexpr, N_UNITS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                 MASKED: tl.constexpr):  # fmt: skip
    """The activations both planes meet, (xa, xb), and the chunk's live units."""
    if FMT == FMT_Q4_K:  # run g % 8 of a super-block: pair (g % 8) // 2; xb is 32 values on (high nibbles)
        g = tl.arange(0, CHUNK * K_RUNS)[None, :, None, None]
        unit, run = g // K_RUNS + u0, g % K_RUNS
        off = unit * QK_K_C + (run // PAIR_RUNS) * PAIR_VALUES + (run % PAIR_RUNS) * RUN_BYTES + _quads_of(QUAD, 1)
        second: tl.constexpr = PAIR_BYTES
    elif FMT == FMT_Q6_K:  # run r of a half; xb is 64 values on (high nibbles)
        unit, half, r = q6_k_runs(u0, CHUNK)
        off = (unit * QK_K_C + half * Q6_HALF + r * Q6_RUN)[None, :, None, None] + _quads_of(QUAD, 1)
        unit = unit[None, :, None, None]
        second: tl.constexpr = Q6_QL_HALF
    elif FMT == FMT_F16 or FMT == FMT_BF16:  # values 8r + 0..3 of run r of a unit; xb the next 4
        unit = tl.arange(0, CHUNK)[None, :, None, None] + u0
        off = unit * QK_C + _quads_of(QUAD, 1, F16_RUN)
        second: tl.constexpr = QUAD
    else:  # a block; xb is its second half
        unit = tl.arange(0, CHUNK)[None, :, None, None] + u0
        off = unit * QK_C + _quads_of(QUAD, 1)
        second: tl.constexpr = HALF_BLOCK
    # the full [N, ...] shape puts the activations in the weights' layout (the rows' loads are one broadcast)
    xs = x + off + tl.zeros([BLOCK_N, 1, 1, 1], tl.int32)
    live = unit < N_UNITS
    return _acts(xs, live, MASKED), _acts(xs + second, live, MASKED), live


@triton.jit
def _fma(acc, raw, xa, xb, live, FMT: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
         MASKED: tl.constexpr):  # fmt: skip
    """acc += wa * xa; acc += wb * xb (two fused multiply-adds an element). In a partial chunk the missing
    units' weights are zeroed too: their activations are 0, but the stand-in weights could be inf."""
    if FMT == FMT_Q4_K:
        wa, wb = _w_q4_k(raw, BLOCK_N, CHUNK)
    elif FMT == FMT_Q6_K:
        wa, wb = _w_q6_k(raw, BLOCK_N, CHUNK)
    elif FMT == FMT_Q8_0:
        wa, wb = _w_q8_0(raw, BLOCK_N, CHUNK)
    elif FMT == FMT_Q5_0:
        wa, wb = _w_q5_0(raw, BLOCK_N, CHUNK)
    else:
        wa, wb = raw[0].to(tl.float32), raw[1].to(tl.float32)
    if MASKED:
        wa = tl.where(live, wa, 0.0)
        wb = tl.where(live, wb, 0.0)
    acc += wa * xa
    acc += wb * xb
    return acc


@triton.jit
def row_dots(w_a, w_b, x, FMT: tl.constexpr, BLOCK_N: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr,
              FENCE: tl.constexpr, TWO: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """x . row for the tile's rows of `w_a` (and of `w_b` where TWO), [N] f32 each: every iteration loads the
    next chunk's weights, then decodes and accumulates this one's. The first chunk's loads are written before
    the wait for the kernel that wrote x (`pdl`)."""
    CHUNKS: tl.constexpr = (N_UNITS + CHUNK - 1) // CHUNK
    PARTIAL: tl.constexpr = N_UNITS % CHUNK != 0
    G: tl.constexpr = CHUNK * (K_RUNS if FMT == FMT_Q4_K else (Q6_RUNS if FMT == FMT_Q6_K else 1))
    raw_a = load_chunk(w_a, 0, FMT, N_UNITS, CHUNK, PARTIAL and CHUNKS == 1)
    raw_b = raw_a
    acc_a = tl.zeros([BLOCK_N, G, QUAD, QUAD], tl.float32)
    acc_b = tl.zeros([1], tl.float32)  # a placeholder where not TWO
    if TWO:
        raw_b = load_chunk(w_b, 0, FMT, N_UNITS, CHUNK, PARTIAL and CHUNKS == 1)
        acc_b = tl.zeros([BLOCK_N, G, QUAD, QUAD], tl.float32)
    pdl.wait(PDL)
    for c in range(0, CHUNKS - 1):
        u0 = c * CHUNK
        next_a = load_chunk(w_a, u0 + CHUNK, FMT, N_UNITS, CHUNK, PARTIAL)
        if TWO:
            next_b = load_chunk(w_b, u0 + CHUNK, FMT, N_UNITS, CHUNK, PARTIAL)
        if FENCE:  # keeps ptxas from sinking the loads above to the loop's end (see PREFETCH_FENCE)
            tl.debug_barrier()
        xa, xb, live = _activations(x, u0, FMT, N_UNITS, BLOCK_N, CHUNK, False)
        acc_a = _fma(acc_a, raw_a, xa, xb, live, FMT, BLOCK_N, CHUNK, False)
        raw_a = next_a
        if TWO:
            acc_b = _fma(acc_b, raw_b, xa, xb, live, FMT, BLOCK_N, CHUNK, False)
            raw_b = next_b
    xa, xb, live = _activations(x, (CHUNKS - 1) * CHUNK, FMT, N_UNITS, BLOCK_N, CHUNK, PARTIAL)
    y_a = tl.sum(tl.sum(tl.sum(_fma(acc_a, raw_a, xa, xb, live, FMT, BLOCK_N, CHUNK, PARTIAL), 3), 2), 1)
    y_b = y_a
    if TWO:
        y_b = tl.sum(tl.sum(tl.sum(_fma(acc_b, raw_b, xa, xb, live, FMT, BLOCK_N, CHUNK, PARTIAL), 3), 2), 1)
    return y_a, y_b


# --- kernels -----------------------------------------------------------------------------------------------------


@triton.jit
def _parts_kernel(
    x, parts, res,
    FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FENCE: tl.constexpr, PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    # `parts`: a `parts.PartsArgs` (the parts' pointers, sizes and pitches as one tuple argument)
    part, rows, n, w_rows = part_rows(parts, ROW_BYTES, BLOCK_N)
    y, _ = row_dots(w_rows, w_rows, x, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, False, PDL)
    store_parts(y, rows, part, n, parts, res, PARTS, BIAS, AT_ROW, HAS_RES)


@triton.jit
def _glu_kernel(x, w_gate, w_up, n, out, FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr,
                ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, FENCE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl.release(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_off = tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    gate, up = row_dots(w_gate + row_off, w_up + row_off, x, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, True, PDL)
    # SiLU(g) = g / (1 + e^-g): for a very negative g, e^-g is inf and the quotient a signed zero, as it should
    tl.store(out + rows, gate / (1.0 + tl.exp(-gate)) * up, mask=rows < n)


# --- launchers ---------------------------------------------------------------------------------------------------


def supports_fast(fmt: Format | int, m: int) -> bool:
    """Whether these kernels take a product of `m` activation rows in `fmt`: one row, a format above."""
    return m == 1 and fmt in GROUPS


def launch_plan(
    fmt: Format,
    k: int,
    block_n: int | None,
    warps: int | None,
    per_thread: int | None = None,
    *,
    glu: bool = False,
    n: int | None = None,
) -> dict:
    """The launch's constexprs and warps for rows of `k` values, `n` of them where known (a float product of
    few or short rows takes `fast_tiles.narrow_tile`'s unless a tile is given). A chunk is as many units as
    give every thread `per_thread` (row, group)s: BLOCK_N * groups = the block's threads times that; or the
    row's units, rounded up to a power of two, if fewer."""
    if fmt not in GROUPS:
        raise ValueError(f"no fast GEMV for {Format(fmt).name}")
    unit = UNIT_VALUES[fmt]
    if k < 1 or k % unit:
        raise ValueError(f"the fast {fmt.name} GEMV takes rows of whole {unit}-value units, not {k} values")
    narrow = fast_tiles.narrow_tile(fmt, k, n) if block_n is None and per_thread is None else None
    if narrow is not None:
        rows, groups = narrow
    else:
        rows, groups = (fast_tiles.GLU_TILES if glu else fast_tiles.TILES)[fmt]
        if block_n is None and per_thread is None and (k // unit) % _chunk(fmt, k, rows, WARPS, groups):
            rows, groups = fast_tiles.DEFAULT_TILE
    block_n = rows if block_n is None else block_n
    warps = WARPS if warps is None else warps
    per_thread = groups if per_thread is None else per_thread
    for name, v in (("block_n", block_n), ("warps", warps), ("per_thread", per_thread)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, not {v}")
    n_units = k // unit
    chunk = _chunk(fmt, k, block_n, warps, per_thread)
    consts = dict(FMT=int(fmt), N_UNITS=n_units, CHUNK=chunk, ROW_BYTES=stored_row_bytes(fmt, k), BLOCK_N=block_n)
    return consts | {"FENCE": PREFETCH_FENCE, "num_warps": warps}


def _chunk(fmt: Format, k: int, block_n: int, warps: int, per_thread: int) -> int:
    """Units a chunk: enough for every thread's (row, group)s, at most the row's, rounded up to a power of two."""
    most = triton.next_power_of_2(k // UNIT_VALUES[fmt])
    return min(max(1, warps * LANES * per_thread // (block_n * GROUPS[fmt])), most)


def check_one_row(x: Tensor, k: int, weights: Sequence[Tensor], fmt: Format, n: int) -> None:
    if x.dim() != 2 or tuple(x.shape) != (1, k) or x.stride(1) != 1 or not x.is_floating_point():
        raise ValueError(f"x must be a float (1, {k}) tensor with unit column stride, got {tuple(x.shape)}")
    for w in weights:
        check_rows(w, fmt, n, k)


def gemv_fast_parts(x: Tensor, parts: Sequence[Part | tuple], fmt: Format, *, residual: Tensor | None = None,
                    block_n: int | None = None, warps: int | None = None,
                    per_thread: int | None = None) -> None:  # fmt: skip
    """One launch of up to four products of one format reading the same `x` (1, k).

    Each part is a `parts.Part` (or a tuple in its order: w, n, out, bias|None, out_row|None): its `out` gets
    x @ W^T (+ bias), (1, n), or row pos[0] of a table with out_row = (pos, pitch), the position read on the
    device. `residual` (1, n0), if given, is added to part 0 (it may be part 0's `out`). Programs map to
    (part, tile) by the parts' cumulative tile counts; `block_n`, `warps` and `per_thread` override the
    format's tile.
    """
    fmt = Format(fmt)
    k = x.shape[-1]
    check_one_row(x, k, [], fmt, 1)  # the activation; parts_args checks each part's weights
    plan = launch_plan(fmt, k, block_n, warps, per_thread, n=sum(Part(*p).n for p in parts))
    args, flags, tiles = parts_args(parts, fmt, k, plan["BLOCK_N"], x, residual)
    _parts_kernel[(tiles,)](x, *args, **flags, **plan, **pdl.options())


def gemv_fast(x: Tensor, w: Tensor, fmt: Format, n: int, k: int, out: Tensor, *, bias: Tensor | None = None,
              residual: Tensor | None = None, out_row: tuple[Tensor, int] | None = None, block_n: int | None = None,
              warps: int | None = None, per_thread: int | None = None) -> Tensor:  # fmt: skip
    """out = x (1, k) @ W^T (+ bias) (+ residual), W the n x k checkpoint rows `w` in `fmt`; returns `out`.

    With `out_row` = (pos, pitch) the result lands in row pos[0] of the 2-D table `out` (rows `pitch` values
    apart), the position read on the device. `residual` (1, n) may be `out` itself. `block_n` (a power of
    two), `warps` and `per_thread` override the format's tile.
    """
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the weights' rows {k}")
    one = [Part(w, n, out, bias, out_row)]
    gemv_fast_parts(x, one, fmt, residual=residual, block_n=block_n, warps=warps, per_thread=per_thread)
    return out


def gemv_fast_gate_up_glu(x: Tensor, w_gate: Tensor, w_up: Tensor, fmt: Format, n: int, k: int, out: Tensor, *,
                          block_n: int | None = None, warps: int | None = None,
                          per_thread: int | None = None) -> Tensor:  # fmt: skip
    """out (1, n) = SiLU(x @ Wg^T) * (x @ Wu^T) in one launch, both n x k checkpoint rows in `fmt`; returns
    `out`. A program walks the same rows of both, a chunk of each an iteration, into two accumulators."""
    fmt = Format(fmt)
    check_one_row(x, k, [w_gate, w_up], fmt, n)
    check_glu_out(out, n)
    plan = launch_plan(fmt, k, block_n, warps, per_thread, glu=True, n=n)
    _glu_kernel[(triton.cdiv(n, plan["BLOCK_N"]),)](x, w_gate, w_up, n, out, **plan, **pdl.options())
    return out
