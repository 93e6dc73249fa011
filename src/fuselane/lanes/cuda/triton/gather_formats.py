"""The embedding gather's (`norm.embed_norm`) value decoders for Q5_K, Q4_0, Q4_1, Q5_1, IQ4_NL, IQ4_XS, Q3_K,
Q2_K and MXFP4: value j of a checkpoint row, read byte by byte, as f32 bit for bit as `fuselane.gguf.dequant`
decodes it.

Why: a decode step starts with one row of the embedding table, gathered and normed in one launch from the
file's own blocks. The recipes put the table in the file's base format (a Q5_K_M file's is Q5_K, a Q2_K
file's Q2_K), so every format a matrix may be stored in needs a decoder here; a row is a few thousand values,
so these favour plainness over speed. Exactness: a scale product (f16 times a code or a sub-block scale of
at most 8 bits) is exact in f32, and a minimum is added or subtracted with one rounding, as dequant does.

`norm._decode` hands these formats to `decode` with the address of a block's d (IQ4_XS's, with its scales, after
its row's blocks on the device, as Q4_0's and IQ4_NL's d); the offsets it passes are the layout's
fields under the gather's names (0 for a field kept after the row): OFF_DMIN a
minimum (dmin, or Q4_1's / Q5_1's m), OFF_SCALES the packed scales (IQ4_XS's scales_l), OFF_QH the high bits (qh,
or Q3_K's hmask).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.triton.gemv.layout import IQ4_XS_SCALES_H, IQ4_XS_SCALES_L, const, e8m0_scale
from fuselane.lanes.cuda.triton.gemv.low_bits import iq4_value

Q5_K = const(int(Format.Q5_K))
Q4_0 = const(int(Format.Q4_0))
Q4_1 = const(int(Format.Q4_1))
Q5_1 = const(int(Format.Q5_1))
IQ4_NL = const(int(Format.IQ4_NL))
IQ4_XS = const(int(Format.IQ4_XS))
MXFP4 = const(int(Format.MXFP4))
Q3_K = const(int(Format.Q3_K))
Q2_K = const(int(Format.Q2_K))
FORMATS = frozenset({
    Format.Q5_K, Format.Q4_0, Format.Q4_1, Format.Q5_1, Format.IQ4_NL, Format.IQ4_XS, Format.Q3_K, Format.Q2_K,
    Format.MXFP4,
})  # fmt: skip
# every format's flag, as a constexpr map (compiled Triton indexes a constexpr dict, but has no `in`)
DECODES_C = const({int(f): f in FORMATS for f in Format})
# field names the gather passes each format's offsets under (`norm.embed_norm`), where the layout's differ
MIN_FIELD = {Format.Q4_1: "m", Format.Q5_1: "m"}
HIGH_FIELD = {Format.Q3_K: "hmask"}
SCALES_FIELD = {Format.IQ4_XS: "scales_l"}  # (kept after the row with d: read from d's address)

HALF_BLOCK, SUB, HALF, NIBBLE_BITS = const(16), const(32), const(128), const(4)
Q4_ZERO, Q3_ZERO, SCALE_ZERO = const(8), const(4), const(32)  # Q4_0's code bias, Q3_K's, and the signed scales'


@triton.jit
def _byte(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, mask):
    bits = _byte(p, mask) | (_byte(p + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(blk, OFF_QS: tl.constexpr, t, mask):
    """A 32-value block's code t: nibble t // 16 of qs byte t % 16."""
    return (_byte(blk + OFF_QS + t % HALF_BLOCK, mask) >> ((t // HALF_BLOCK) * NIBBLE_BITS)) & 0xF


@triton.jit
def _fifth(blk, OFF_QH: tl.constexpr, t, mask):
    """Q5_0 / Q5_1: bit t of the 32-bit qh, at bit 4."""
    return ((_byte(blk + OFF_QH + t // 8, mask) >> (t % 8)) & 1) << NIBBLE_BITS


@triton.jit
def _k_scale_min(blk, OFF_SCALES: tl.constexpr, sb, mask):
    """Q5_K: sub-block sb's 6-bit scale and min (as Q4_K's, `norm._decode`)."""
    a = _byte(blk + OFF_SCALES + sb % 4, mask)
    b = _byte(blk + OFF_SCALES + sb % 4 + 4, mask)
    c = _byte(blk + OFF_SCALES + sb % 4 + 8, mask)
    low = sb < 4
    sc = tl.where(low, a & 0x3F, (c & 0xF) | ((a >> 6) << 4))
    mn = tl.where(low, b & 0x3F, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def decode(blk, dp, t, mask, FMT: tl.constexpr, OFF_DMIN: tl.constexpr, OFF_SCALES: tl.constexpr,
           OFF_QS: tl.constexpr, OFF_QH: tl.constexpr):  # fmt: skip
    """Value t of the block at byte address `blk` (t and blk tensors of one shape), its d at `dp` (in the block, or
    after its row's blocks: `layout.block_d`), as f32."""
    if FMT == Q5_K:  # Q4_K's codes and scales, and bit sb of qh[t % 32] over each code
        sb = t // SUB
        nib = (_byte(blk + OFF_QS + (t // 64) * 32 + t % SUB, mask) >> ((sb % 2) * 4)) & 0xF
        code = nib | (((_byte(blk + OFF_QH + t % SUB, mask) >> sb) & 1) << NIBBLE_BITS)
        sc, mn = _k_scale_min(blk, OFF_SCALES, sb, mask)
        v = (_f16(dp, mask) * sc) * code.to(tl.float32) - _f16(blk + OFF_DMIN, mask) * mn
    elif FMT == Q4_0:
        v = (_nibble(blk, OFF_QS, t, mask) - Q4_ZERO).to(tl.float32) * _f16(dp, mask)
    elif FMT == Q4_1:
        v = _nibble(blk, OFF_QS, t, mask).to(tl.float32) * _f16(dp, mask) + _f16(blk + OFF_DMIN, mask)
    elif FMT == Q5_1:
        code = _nibble(blk, OFF_QS, t, mask) | _fifth(blk, OFF_QH, t, mask)
        v = code.to(tl.float32) * _f16(dp, mask) + _f16(blk + OFF_DMIN, mask)
    elif FMT == IQ4_NL:
        v = _f16(dp, mask) * iq4_value(_nibble(blk, OFF_QS, t, mask))
    elif FMT == MXFP4:
        v = e8m0_scale(_byte(dp, mask)) * iq4_value(_nibble(blk, OFF_QS, t, mask), True)
    elif FMT == IQ4_XS:  # sub-block ib's scale: nibble ib % 2 of scales_l[ib // 2] under crumb ib of scales_h (after d)
        ib = t // SUB
        high = _byte(dp + IQ4_XS_SCALES_H + ib // 4, mask) >> ((ib % 4) * 2) & 0x3
        ls = ((_byte(dp + IQ4_XS_SCALES_L + ib // 2, mask) >> ((ib % 2) * NIBBLE_BITS)) & 0xF) | (high << NIBBLE_BITS)
        code = _nibble(blk + ib * HALF_BLOCK, OFF_QS, t % SUB, mask)
        v = (_f16(dp, mask) * (ls - SCALE_ZERO).to(tl.float32)) * iq4_value(code)
    elif FMT == Q3_K:  # value t: half n, crumb j of qs[32n + b] and bit 4n + j of hmask[b] (b = t % 32)
        n, j, b = t // HALF, (t % HALF) // SUB, t % SUB
        i = t // HALF_BLOCK  # its scale: nibble i // 8 of scales[i % 8] under crumb i // 4 of scales[8 + i % 4]
        low = (_byte(blk + OFF_SCALES + i % 8, mask) >> ((i // 8) * NIBBLE_BITS)) & 0xF
        sc = low | (((_byte(blk + OFF_SCALES + 8 + i % 4, mask) >> ((i // 4) * 2)) & 0x3) << NIBBLE_BITS)
        crumb = (_byte(blk + OFF_QS + n * SUB + b, mask) >> (j * 2)) & 0x3
        code = crumb | (((_byte(blk + OFF_QH + b, mask) >> (n * 4 + j)) & 1) << 2)
        v = (_f16(dp, mask) * (sc - SCALE_ZERO).to(tl.float32)) * (code - Q3_ZERO).to(tl.float32)
    else:
        tl.static_assert(FMT == Q2_K, "no gather decoder for this format")
        n, j, b = t // HALF, (t % HALF) // SUB, t % SUB
        sc = _byte(blk + OFF_SCALES + t // HALF_BLOCK, mask)
        crumb = (_byte(blk + OFF_QS + n * SUB + b, mask) >> (j * 2)) & 0x3
        dl = _f16(dp, mask) * (sc & 0xF).to(tl.float32)
        v = dl * crumb.to(tl.float32) - _f16(blk + OFF_DMIN, mask) * (sc >> NIBBLE_BITS).to(tl.float32)
    return v
