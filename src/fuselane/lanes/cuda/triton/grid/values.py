"""The values of the grid and ternary formats' 256-value super-blocks on the device, read from the file's own
block layout (`formats.LAYOUTS`) and one lookup table a format (`table_bytes`, `device_table`).

A grid format's code picks a row of one of llama.cpp's value grids (4 or 8 values a row) and a sign pattern
(IQ1: the sign of a shared offset of 1/8) goes with it; a sub-block scale multiplies the row. `grid_values` finds
for each wanted value t its row index, its sign and its sub-block's scale in the block's bytes, then gathers the
row's value from the table: bit for bit the f32 `fuselane.gguf.dequant` gives (`dequant_grid`, itself bit-equal to
`gguf.quants`). Every product is exact in f32 (an f16 scale's 11 significant bits times a sub-scale of at most 5
bits times a grid value below 64, or IQ1's value +- 1/8), so the order of the factors changes no bit; the order
of the reference is kept anyway, and a zero's sign follows the same IEEE rule in either order. The ternary
formats (TQ1_0, TQ2_0) need no table: a value is d times a digit - 1, the digit read from base-3 or 2-bit codes.

The table of a grid format, as `table_bytes` builds it from `gguf.quants`' grids (the layout the kernels read):
- bytes [0, rows * width): the grid, row r's `width` values (8; IQ3_XXS and IQ3_S 4) as signed bytes at r * width
  (IQ2 grids hold 8, 25, 43; IQ3_XXS 4..62; IQ3_S 1..15; IQ1 -1, 0, 1);
- for IQ2_XXS, IQ2_XS and IQ3_XXS, then 128 bytes at `*_KSIGNS` (rows * width): ggml's ksigns_iq2xs, the sign
  patterns of 8 values a 7-bit index stands for (bit j set: value j negative; the 8th bit the 7's parity).
IQ2_XXS 2,048 + 128 bytes, IQ2_XS 4,096 + 128, IQ2_S 8,192, IQ3_XXS 1,024 + 128, IQ3_S 2,048, IQ1_S and IQ1_M
16,384. A ternary format's table is one unread byte (a launch still takes a pointer).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import triton
import triton.language as tl
from gguf import quants as gguf_quants

from fuselane.gguf.formats import LAYOUTS, QK_K, Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton.gemv.int8_words import INTERPRETED, ld_scalar, prmt
from fuselane.lanes.cuda.triton.gemv.layout import BIT, BYTE_BITS, CRUMB, NIBBLE, NIBBLE_BITS, load_f16

if TYPE_CHECKING:
    import torch

KSIGN_FORMATS = frozenset({Format.IQ2_XXS, Format.IQ2_XS, Format.IQ3_XXS})  # sign patterns by 7-bit index
TERNARY_FORMATS = frozenset({Format.TQ1_0, Format.TQ2_0})
KSIGNS = np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8)  # ggml's ksigns_iq2xs: 128 patterns


def _grid_shape(fmt: Format) -> tuple[int, int]:
    """(rows, values a row) of `fmt`'s grid in `gguf.quants`."""
    rows, width = getattr(gguf_quants, fmt.name).grid_shape
    return int(rows), int(width)


def grid_bytes(fmt: Format) -> int:
    """Bytes of `fmt`'s grid in its table: where its ksigns begin."""
    rows, width = _grid_shape(fmt)
    return rows * width


def table_bytes(fmt: Format) -> np.ndarray:
    """`fmt`'s lookup table as the device reads it (the module's layout), uint8 1-D: the grid's rows of signed
    bytes, then the 128 ksigns where the format indexes sign patterns; one byte for a ternary format."""
    fmt = Format(fmt)
    if fmt not in kernels.GRID_GEMV_FORMATS:
        raise ValueError(f"no device table for {fmt.name}")
    if fmt in TERNARY_FORMATS:
        return np.zeros(1, dtype=np.uint8)
    cls = getattr(gguf_quants, fmt.name)
    cls.init_grid()
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(_grid_shape(fmt))
    parts = [grid.astype(np.int8).view(np.uint8).reshape(-1)]
    if fmt in KSIGN_FORMATS:
        parts.append(KSIGNS)
    return np.concatenate(parts)


def device_table(fmt: Format, device: torch.device | str) -> torch.Tensor:
    """`table_bytes(fmt)` as a uint8 tensor on `device`, built once a (format, device)."""
    return _device_table(Format(fmt), str(device))


@functools.cache
def _device_table(fmt: Format, device: str) -> torch.Tensor:
    """`device_table`'s cache: one tensor a (format, device name)."""
    import torch

    return torch.from_numpy(table_bytes(fmt)).to(device)


def _at(fmt: Format, field: str) -> tl.constexpr:
    """The byte offset of `field` in a file block of `fmt`, as a constexpr."""
    return tl.constexpr(LAYOUTS[fmt].field(field).offset)


# --- formats and layouts, as constexprs ----------------------------------------------------------------------

FMT_IQ2_XXS, FMT_IQ2_XS = tl.constexpr(int(Format.IQ2_XXS)), tl.constexpr(int(Format.IQ2_XS))
FMT_IQ2_S, FMT_IQ3_XXS = tl.constexpr(int(Format.IQ2_S)), tl.constexpr(int(Format.IQ3_XXS))
FMT_IQ3_S, FMT_IQ1_S = tl.constexpr(int(Format.IQ3_S)), tl.constexpr(int(Format.IQ1_S))
FMT_IQ1_M, FMT_TQ1_0 = tl.constexpr(int(Format.IQ1_M)), tl.constexpr(int(Format.TQ1_0))
FMT_TQ2_0 = tl.constexpr(int(Format.TQ2_0))

IQ2_XXS_D, IQ2_XXS_QS = _at(Format.IQ2_XXS, "d"), _at(Format.IQ2_XXS, "qs")
IQ2_XS_D, IQ2_XS_QS, IQ2_XS_SCALES = _at(Format.IQ2_XS, "d"), _at(Format.IQ2_XS, "qs"), _at(Format.IQ2_XS, "scales")
IQ2_S_D, IQ2_S_QS, IQ2_S_SIGNS = _at(Format.IQ2_S, "d"), _at(Format.IQ2_S, "qs"), _at(Format.IQ2_S, "signs")
IQ2_S_QH, IQ2_S_SCALES = _at(Format.IQ2_S, "qh"), _at(Format.IQ2_S, "scales")
IQ3_XXS_D, IQ3_XXS_QS = _at(Format.IQ3_XXS, "d"), _at(Format.IQ3_XXS, "qs")
IQ3_XXS_SCALES = _at(Format.IQ3_XXS, "scales")
IQ3_S_D, IQ3_S_QS, IQ3_S_QH = _at(Format.IQ3_S, "d"), _at(Format.IQ3_S, "qs"), _at(Format.IQ3_S, "qh")
IQ3_S_SIGNS, IQ3_S_SCALES = _at(Format.IQ3_S, "signs"), _at(Format.IQ3_S, "scales")
IQ1_S_D, IQ1_S_QS, IQ1_S_QH = _at(Format.IQ1_S, "d"), _at(Format.IQ1_S, "qs"), _at(Format.IQ1_S, "qh")
IQ1_M_QS, IQ1_M_QH, IQ1_M_SCALES = _at(Format.IQ1_M, "qs"), _at(Format.IQ1_M, "qh"), _at(Format.IQ1_M, "scales")
TQ1_0_QS, TQ1_0_QH, TQ1_0_D = _at(Format.TQ1_0, "qs"), _at(Format.TQ1_0, "qh"), _at(Format.TQ1_0, "d")
TQ2_0_QS, TQ2_0_D = _at(Format.TQ2_0, "qs"), _at(Format.TQ2_0, "d")

# the tables (module docstring): values a grid row, and where the ksigns begin
ROW8, ROW4 = tl.constexpr(8), tl.constexpr(4)
IQ2_XXS_KSIGNS = tl.constexpr(grid_bytes(Format.IQ2_XXS))
IQ2_XS_KSIGNS = tl.constexpr(grid_bytes(Format.IQ2_XS))
IQ3_XXS_KSIGNS = tl.constexpr(grid_bytes(Format.IQ3_XXS))
if {_grid_shape(f)[1] for f in kernels.GRID_GEMV_FORMATS - TERNARY_FORMATS} != {ROW8.value, ROW4.value}:
    raise RuntimeError("a gguf.quants grid row is no longer 4 or 8 values wide")

BLOCK_VALUES = tl.constexpr(QK_K)  # values of a super-block

# `grid_magnitude`: a signed byte b made b + 128 (its top bit flipped), permuted to byte 0 of a word whose
# bytes 1-2 are zero and byte 3 is 2^23's exponent (the selector's nibbles 4, 5, 7 pick bytes 0, 1, 3 of
# FLOAT_EXPONENT; `_under_exponent` spells both in its PTX), is the f32 2^23 + 128 + b
BYTE_FLIP = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as int32
FLOAT_EXPONENT = tl.constexpr(0x4B000000)
UNDER_EXPONENT = tl.constexpr(0x7540)
FLOAT_BIAS = tl.constexpr(8388736.0)  # 2^23 + 128
LOW_WORD, WORD_SHIFT = tl.constexpr(0xFFFFFFFF), tl.constexpr(32)  # an int64's halves

# --- the bits of the codes (as `dequant_grid` and `gguf.quants` read them) -----------------------------------

GRID_GROUP = 8  # values a group: one 8-wide grid row (two 4-wide), one sign byte or sign index
GROUP8_BITS = tl.constexpr(GRID_GROUP.bit_length() - 1)  # t >> 3: the group of 8 values t is in
GROUP8 = tl.constexpr(GRID_GROUP)
# a group g's sub-blocks: g >> 1 its sub-block of 16 values, g >> 2 of 32, g >> 3 of 64
SUB16_GROUPS, SUB32_GROUPS, SUB64_GROUPS = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
ROWS_A_GROUP = tl.constexpr(2)  # IQ3_XXS / IQ3_S: 4-wide grid rows a group of 8
GROUP4_BITS = tl.constexpr(2)  # t >> 2: the group of 4 values (one 4-wide grid row)
IN_GROUP8 = tl.constexpr(7)  # t & 7: t's place in its group of 8 (its bit of a sign byte)
IN_GROUP4 = tl.constexpr(3)
QUAD = tl.constexpr(3)  # & 3: a group's place among four (the four grid bytes and sign indices of a u32 pair)
PAIR_BYTES = tl.constexpr(8)  # IQ2_XXS: a sub-block of 32's two u32 (4 grid indices; 4 sign indices and a scale)
WORD_BYTES = tl.constexpr(4)
SIGN_SHIFT = tl.constexpr(24)  # a byte shifted to an int32's top and back: its sign extended
HALF_BYTES = tl.constexpr(2)  # bytes of a u16
SIGN_BITS = tl.constexpr(7)  # a 7-bit sign index into the ksigns
SIGN_MASK = tl.constexpr(0x7F)
SCALE_SHIFT = tl.constexpr(28)  # IQ2_XXS / IQ3_XXS: a sub-block's 4-bit scale, the top of its sign word
NINE_BITS = tl.constexpr(0x1FF)  # IQ2_XS: a u16's 9-bit grid index (its top 7 bits the sign index)
INDEX_HIGH_SHIFT = tl.constexpr(8)  # a grid index's bits above its low byte
HALF = tl.constexpr(0.5)
IQ2_STEP = tl.constexpr(0.25)  # IQ2_*: value = d * (0.5 + scale) * 0.25 * grid value
IQ3_XXS_STEP = tl.constexpr(0.5)  # IQ3_XXS: value = d * (0.5 + scale) * 0.5 * grid value
SEVEN = tl.constexpr(0x7)  # a 3-bit field (IQ1's index bits and scales)
THREE_BITS = tl.constexpr(3)
IQ1_DELTA, IQ1_NEG_DELTA = tl.constexpr(0.125), tl.constexpr(-0.125)  # IQ1: value = dl * (grid value +- 1/8)
IQ1_S_SCALE_SHIFT = tl.constexpr(12)  # IQ1_S: a sub-block's 3-bit scale, bits 12-14 of its qh word
IQ1_S_NEGATIVE = tl.constexpr(0x8000)  # IQ1_S: the delta's sign, bit 15 of the qh word
IQ1_M_NEGATIVE = tl.constexpr(0x08)  # IQ1_M: the delta's sign, bit 3 of an entry's qh nibble
IQ1_M_WORD_SHIFT = tl.constexpr(2)  # IQ1_M: i >> 2, the u16 of `scales` holding 3-bit scale i (four a word)
NIBBLE_SHIFT = tl.constexpr(1)  # g >> 1: the byte holding nibble g (two a byte)
CRUMB_SHIFT = tl.constexpr(2)  # g >> 2: the byte holding crumb g (four a byte)
CRUMB_BITS = tl.constexpr(2)
IQ2_XS_SIGN_SHIFT = tl.constexpr(9)  # IQ2_XS: a u16's sign index above its 9-bit grid index
HIGH_NIBBLE = tl.constexpr(0xF0)
# IQ1_M's f16 d: the top nibbles of its four `scales` u16 (bytes 1, 3, 5, 7), the first the lowest
IQ1_M_D0, IQ1_M_D1 = tl.constexpr(1), tl.constexpr(3)
IQ1_M_D2, IQ1_M_D3 = tl.constexpr(5), tl.constexpr(7)
# TQ1_0: 5 base-3 digits a qs byte, its first 32 bytes for values 0-159 (digit t // 32 of byte t % 32), its next
# 16 for 160-239 (digit (t - 160) // 16 of byte 32 + t % 16); qh's 4 bytes 4 digits each for 240-255
TQ1_RUN1, TQ1_RUN2 = tl.constexpr(160), tl.constexpr(240)  # first values of the 16-byte run and of qh
TQ1_RUN0_BYTES = 32  # qs bytes of the first run (values 0-159)
TQ1_RUN0_AT, TQ1_RUN1_AT = TQ1_0_QS, tl.constexpr(TQ1_0_QS.value + TQ1_RUN0_BYTES)  # where the qs runs begin
TQ1_RUN0_BITS, TQ1_RUN1_BITS, TQ1_QH_BITS = tl.constexpr(5), tl.constexpr(4), tl.constexpr(2)  # log2 of run bytes
TQ1_MAX_DIGITS = tl.constexpr(4)  # digits above the lowest of a byte: the multiplier is 3^digit, at most 81
TERNARY_BASE = tl.constexpr(3)
BYTE = tl.constexpr(0xFF)  # gguf multiplies a byte by 3^digit in uint8: modulo 256
TERNARY_BIAS = tl.constexpr(1)  # a ternary value is d * (digit - 1)
# TQ2_0: 2-bit codes, value t as crumb (t % 128) // 32 of byte 32 * (t // 128) + t % 32
TQ2_HALF_BITS, TQ2_RUN_BITS = tl.constexpr(7), tl.constexpr(5)
TQ2_HALF_BYTES, TQ2_RUN = tl.constexpr(32), tl.constexpr(31)


# --- loads ---------------------------------------------------------------------------------------------------


@triton.jit
def _byte(ptr):
    """The uint8 at each of `ptr`, as int32. (Here and below a constexpr meets a tensor from the right: Triton
    3.6's interpreter turns `constexpr + tensor` into a tuple.)"""
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _group_byte(ptr):
    """The uint8 field of each group at `ptr` (a byte a group: IQ3_S's and IQ2_S's sign bytes, IQ2_S's and
    IQ1's grid bytes), as int32, loaded by inline asm: a thread's two neighbouring groups' bytes are contiguous,
    so a `tl.load` took them in one 16-bit load of a layout of its own and handed them back through shared
    memory, two barriers a step of the GEMV's k loop (sm_90 SASS)."""
    return ld_scalar(ptr, 1)


@triton.jit
def _u16(ptr):
    """The little-endian u16 at each of `ptr`, one 16-bit load, as int32: every u16 field of these formats lies
    at an even offset of a block and every block at an even offset of the rows (their sizes are even), where
    two byte loads cost a grid value of the GEMV an eighth of its loads."""
    return tl.load(ptr.to(tl.pointer_type(tl.uint16))).to(tl.int32)


@triton.jit
def _u32(ptr):
    """The little-endian u32 at each of `ptr` (2-aligned: blocks lie at any even offset), from its two u16, as
    int32 (its top bit the int's sign: the fields read from it are shifted down and masked)."""
    return _u16(ptr) | (_u16(ptr + HALF_BYTES) << (2 * BYTE_BITS))


@triton.jit
def _row_word(table, row, ROW: tl.constexpr, HIGH: tl.constexpr):
    """The int32 of grid row `row`'s signed bytes holding a group's values 0-3 (HIGH false) or 4-7: the row's
    first or second word where a row is 8 values, its only one where it is 4 (a group then spans two rows)."""
    at = row * ROW + (HIGH and ROW == ROW8) * WORD_BYTES
    return tl.load((table + at).to(tl.pointer_type(tl.int32)))


@triton.jit
def _row8_words(table, row):
    """The two int32 words of 8-wide grid row `row` (values 0-3, 4-7) from one 64-bit load (a row is 8-aligned
    in the table)."""
    both = tl.load((table + row * ROW8).to(tl.pointer_type(tl.int64)))
    return (both & LOW_WORD).to(tl.int32), (both >> WORD_SHIFT).to(tl.int32)


@triton.jit
def _ksign_byte(table, word, g, KSIGNS: tl.constexpr):
    """The sign byte of group g from a word of four 7-bit sign indices (group g takes index g & 3), through the
    ksigns at table + KSIGNS: bit j set, value j negative."""
    return _byte(table + KSIGNS + ((word >> ((g & QUAD) * SIGN_BITS)) & SIGN_MASK))


@triton.jit
def _iq2_scale(d, scales, g):
    """IQ2_XS / IQ2_S: d * (0.5 + scale) * 0.25, the 4-bit scale of group g's sub-block of 16 (nibble
    (g >> 1) & 1 of byte g >> 2 of `scales`)."""
    scale = (_byte(scales + (g >> SUB32_GROUPS)) >> (((g >> SUB16_GROUPS) & BIT) * NIBBLE_BITS)) & NIBBLE
    return d * (scale.to(tl.float32) + HALF) * IQ2_STEP


# --- a group's fields: (the words of its grid values, its sign byte, its scale, IQ1's offset) ----------------


@triton.jit
def _iq2_xxs(blk, table, g):
    """IQ2_XXS: a sub-block of 32 is a u32 pair; the first's byte l the grid row of the l-th 8 values, the
    second four 7-bit sign indices and the 4-bit scale on top."""
    pair = blk + IQ2_XXS_QS + (g >> SUB32_GROUPS) * PAIR_BYTES
    row = _byte(pair + (g & QUAD))
    word = _u32(pair + WORD_BYTES)
    db = load_f16(blk + IQ2_XXS_D) * (((word >> SCALE_SHIFT) & NIBBLE).to(tl.float32) + HALF) * IQ2_STEP
    low, high = _row8_words(table, row)
    return low, high, _ksign_byte(table, word, g, IQ2_XXS_KSIGNS), db, 0.0


@triton.jit
def _iq2_xs(blk, table, g):
    """IQ2_XS: a u16 a group of 8, a 9-bit grid row and a 7-bit sign index; a 4-bit scale a sub-block of 16."""
    code = _u16(blk + IQ2_XS_QS + g * HALF_BYTES)
    signs = _byte(table + IQ2_XS_KSIGNS + (code >> IQ2_XS_SIGN_SHIFT))
    db = _iq2_scale(load_f16(blk + IQ2_XS_D), blk + IQ2_XS_SCALES, g)
    row = code & NINE_BITS
    low, high = _row8_words(table, row)
    return low, high, signs, db, 0.0


@triton.jit
def _iq2_s(blk, table, g):
    """IQ2_S: a grid row's low 8 bits in qs, its top 2 as crumb g % 4 of qh byte g // 4; a sign byte a group;
    a 4-bit scale a sub-block of 16."""
    high = (_byte(blk + IQ2_S_QH + (g >> CRUMB_SHIFT)) >> ((g & QUAD) * CRUMB_BITS)) & CRUMB
    row = _group_byte(blk + IQ2_S_QS + g) | (high << INDEX_HIGH_SHIFT)
    db = _iq2_scale(load_f16(blk + IQ2_S_D), blk + IQ2_S_SCALES, g)
    signs = _group_byte(blk + IQ2_S_SIGNS + g)
    low, high = _row8_words(table, row)
    return low, high, signs, db, 0.0


@triton.jit
def _iq3_xxs(blk, table, g):
    """IQ3_XXS: a byte of qs a grid row of 4 values (two a group, one u16 at an even offset); a sub-block of 32
    a u32 of four 7-bit sign indices (one a group of 8) and its 4-bit scale on top."""
    rows = _u16(blk + IQ3_XXS_QS + g * ROWS_A_GROUP)
    word = _u32(blk + IQ3_XXS_SCALES + (g >> SUB32_GROUPS) * WORD_BYTES)
    db = load_f16(blk + IQ3_XXS_D) * (((word >> SCALE_SHIFT) & NIBBLE).to(tl.float32) + HALF) * IQ3_XXS_STEP
    low, high = _row_word(table, rows & BYTE, ROW4, False), _row_word(table, rows >> BYTE_BITS, ROW4, True)
    return low, high, _ksign_byte(table, word, g, IQ3_XXS_KSIGNS), db, 0.0


@triton.jit
def _iq3_s(blk, table, g):
    """IQ3_S: two grid rows of 4 values a group; a sign byte a group; value = d * (1 + 2 * scale), a 4-bit
    scale a sub-block of 32. Row i's low 8 bits are qs byte i, its 9th bit i % 8 of qh byte i // 8: a group's
    rows 2g and 2g + 1 are one u16 of qs (at an even offset) and two neighbouring bits of one qh byte."""
    i = g * ROWS_A_GROUP
    qs = _u16(blk + IQ3_S_QS + i)
    qh = _byte(blk + IQ3_S_QH + (i >> GROUP8_BITS)) >> (i & IN_GROUP8)
    low = _row_word(table, (qs & BYTE) | ((qh & BIT) << INDEX_HIGH_SHIFT), ROW4, False)
    high = _row_word(table, (qs >> BYTE_BITS) | (((qh >> 1) & BIT) << INDEX_HIGH_SHIFT), ROW4, True)
    scale = (_byte(blk + IQ3_S_SCALES + (g >> SUB64_GROUPS)) >> (((g >> SUB32_GROUPS) & BIT) * NIBBLE_BITS)) & NIBBLE
    db = load_f16(blk + IQ3_S_D) * (scale * 2 + 1).to(tl.float32)
    return low, high, _group_byte(blk + IQ3_S_SIGNS + g), db, 0.0


@triton.jit
def _iq1_s(blk, table, g):
    """IQ1_S: a grid row's low 8 bits in qs, its top 3 in the u16 of its sub-block of 32 (3 bits a group of 8,
    then the 3-bit scale and the delta's sign); value = d * (2 * scale + 1) * (grid value +- 1/8), no signs."""
    qh = _u16(blk + IQ1_S_QH + (g >> SUB32_GROUPS) * HALF_BYTES)
    row = _group_byte(blk + IQ1_S_QS + g) | (((qh >> ((g & QUAD) * THREE_BITS)) & SEVEN) << INDEX_HIGH_SHIFT)
    dl = load_f16(blk + IQ1_S_D) * (((qh >> IQ1_S_SCALE_SHIFT) & SEVEN) * 2 + 1).to(tl.float32)
    delta = tl.where((qh & IQ1_S_NEGATIVE) != 0, IQ1_NEG_DELTA, IQ1_DELTA)
    low, high = _row8_words(table, row)
    return low, high, 0, dl, delta


@triton.jit
def _iq1_m_d(blk):
    """IQ1_M's f16 d, its nibbles the top ones of the four u16 of `scales` (the first the lowest), as f32."""
    low = (_byte(blk + IQ1_M_SCALES + IQ1_M_D0) >> NIBBLE_BITS) | (_byte(blk + IQ1_M_SCALES + IQ1_M_D1) & HIGH_NIBBLE)
    high = (_byte(blk + IQ1_M_SCALES + IQ1_M_D2) >> NIBBLE_BITS) | (_byte(blk + IQ1_M_SCALES + IQ1_M_D3) & HIGH_NIBBLE)
    bits = low | (high << BYTE_BITS)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _iq1_m(blk, table, g):
    """IQ1_M: a grid row's low 8 bits in qs, its top 3 and the delta's sign in a nibble of qh (one a group of
    8); value = d * (2 * scale + 1) * (grid value +- 1/8), a 3-bit scale a sub-block of 16, no signs."""
    entry = (_byte(blk + IQ1_M_QH + (g >> NIBBLE_SHIFT)) >> ((g & BIT) * NIBBLE_BITS)) & NIBBLE
    row = _group_byte(blk + IQ1_M_QS + g) | ((entry & SEVEN) << INDEX_HIGH_SHIFT)
    i = g >> SUB16_GROUPS  # scale i: bits 3 * (i % 4) of u16 i // 4 of `scales`
    word = _u16(blk + IQ1_M_SCALES + (i >> IQ1_M_WORD_SHIFT) * HALF_BYTES)
    scale = (word >> ((i & QUAD) * THREE_BITS)) & SEVEN
    dl = _iq1_m_d(blk) * (scale * 2 + 1).to(tl.float32)
    delta = tl.where((entry & IQ1_M_NEGATIVE) != 0, IQ1_NEG_DELTA, IQ1_DELTA)
    low, high = _row8_words(table, row)
    return low, high, 0, dl, delta


@triton.jit
def grid_group(blk, table, g, FMT: tl.constexpr):
    """The fields of the groups g (0..31) of 8 values of the blocks at `blk` (uint8 pointers to each block's
    first byte in the file's layout; shapes that broadcast together) in a grid format `FMT` (not a ternary
    one), for `grid_entry`: the two int32 words of their 8 grid values (signed bytes, values 0-3 then 4-7),
    their sign byte (bit j set: value j negative; 0 for IQ1), their scale and IQ1's offset (0.0 for the others).
    Found once a group: a GEMV decodes its 8 values from them alone."""
    if FMT == FMT_IQ2_XXS:
        f = _iq2_xxs(blk, table, g)
    elif FMT == FMT_IQ2_XS:
        f = _iq2_xs(blk, table, g)
    elif FMT == FMT_IQ2_S:
        f = _iq2_s(blk, table, g)
    elif FMT == FMT_IQ3_XXS:
        f = _iq3_xxs(blk, table, g)
    elif FMT == FMT_IQ3_S:
        f = _iq3_s(blk, table, g)
    elif FMT == FMT_IQ1_S:
        f = _iq1_s(blk, table, g)
    else:
        tl.static_assert(FMT == FMT_IQ1_M, "no grid group for this format")
        f = _iq1_m(blk, table, g)
    return f


@triton.jit
def grid_entry(low, high, signs, scale, delta, j, FMT: tl.constexpr):
    """Value j (0..7; a tensor, or a constexpr in a GEMV's unrolled group) of a group from its `grid_group`
    fields in `FMT`: scale * its grid value, negated where its sign bit is set (IQ1: scale * (its grid value +
    delta)). Every step is exact in f32 (a grid value plus IQ1's 1/8 has 5 significant bits), so this is
    `gguf.dequant`'s value bit for bit."""
    word = tl.where(j < WORD_BYTES, low, high)
    # byte j % 4 to the word's top ((3 - j % 4) bytes up, as ((j % 4) ^ 3)), then back down with its sign
    grid = ((word << (((j & QUAD) ^ QUAD) * BYTE_BITS)) >> SIGN_SHIFT).to(tl.float32)
    if (FMT == FMT_IQ1_S) | (FMT == FMT_IQ1_M):
        v = scale * (grid + delta)  # no signs
    else:
        v = scale * tl.where(((signs >> j) & BIT) != 0, -grid, grid)
    return v


@triton.jit
def flip_bytes(word):
    """A word of four signed grid bytes, each made unsigned (b + 128), for `grid_magnitude`."""
    return word ^ BYTE_FLIP


@triton.jit
def _under_exponent(word, J: tl.constexpr):
    """The f32 2^23 + byte J of `word` (0..3): the byte permuted to byte 0 of FLOAT_EXPONENT's word, in one
    `prmt` whose operand and selector are immediates (as tensors, each permute took a move beside it)."""
    if INTERPRETED:
        sel = tl.zeros_like(word) + (UNDER_EXPONENT | J)
        bits = prmt(word, tl.zeros_like(word) + FLOAT_EXPONENT, sel)
    elif J == 0:
        bits = tl.inline_asm_elementwise("prmt.b32 $0, $1, 0x4b000000, 0x7540;", "=r,r", [word], tl.int32, True, 1)
    elif J == 1:
        bits = tl.inline_asm_elementwise("prmt.b32 $0, $1, 0x4b000000, 0x7541;", "=r,r", [word], tl.int32, True, 1)
    elif J == 2:
        bits = tl.inline_asm_elementwise("prmt.b32 $0, $1, 0x4b000000, 0x7542;", "=r,r", [word], tl.int32, True, 1)
    else:
        bits = tl.inline_asm_elementwise("prmt.b32 $0, $1, 0x4b000000, 0x7543;", "=r,r", [word], tl.int32, True, 1)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def grid_magnitude(low, high, signs, delta, J: tl.constexpr, FMT: tl.constexpr):
    """Value J (a constexpr, 0..7) of a group's grid row unscaled, from its words made unsigned (`flip_bytes`):
    its signed grid value, negated where its sign bit is set (IQ1: plus the offset `delta`). Byte J % 4 is put
    under the exponent of 2^23 by one byte permute, so the f32 2^23 + 128 + b less FLOAT_BIAS is b exactly: no
    int-to-float conversion (a quarter-rate instruction on sm_90) and no shifts. The sign as a select: sm_90
    moves seven sign bits to predicates in one instruction and negates in the add (an xor of the f32's sign bit
    took a shift and a logic op a value: 198 instructions where that took 212 in IQ3_S's k loop, 16 values a
    thread). The GEMV's dot (`gemv.grid_dot`) scales a group's sum once."""
    # J % 4 spelled with // (the interpreter's J is a Python int, which has no % with a constexpr)
    grid = _under_exponent(low if J < WORD_BYTES else high, J - (J // WORD_BYTES) * WORD_BYTES) - FLOAT_BIAS
    if (FMT == FMT_IQ1_S) | (FMT == FMT_IQ1_M):
        v = grid + delta  # no signs
    else:
        v = tl.where(((signs >> J) & BIT) != 0, -grid, grid)
    return v


@triton.jit
def _tq1_0(blk, t):
    """TQ1_0: digit j of a byte q is ((q * 3^j mod 256) * 3) >> 8 (gguf's base-3 code, top digit first);
    value = d * (digit - 1). Runs: qs bytes 0-31 for values 0-159, 32-47 for 160-239, qh for 240-255."""
    in_run1, in_qh = t >= TQ1_RUN1, t >= TQ1_RUN2
    rel = tl.where(in_qh, t - TQ1_RUN2, tl.where(in_run1, t - TQ1_RUN1, t))
    bits = tl.where(in_qh, TQ1_QH_BITS, tl.where(in_run1, TQ1_RUN1_BITS, TQ1_RUN0_BITS))
    start = tl.where(in_qh, TQ1_0_QH, tl.where(in_run1, TQ1_RUN1_AT, TQ1_RUN0_AT))
    digit = rel >> bits
    q = _byte(blk + (start + (rel - (digit << bits))))
    for j in tl.static_range(TQ1_MAX_DIGITS):
        q = tl.where(digit > j, (q * TERNARY_BASE) & BYTE, q)
    code = (q * TERNARY_BASE) >> BYTE_BITS
    return load_f16(blk + TQ1_0_D) * (code - TERNARY_BIAS).to(tl.float32)


@triton.jit
def _tq2_0(blk, t):
    """TQ2_0: value t is crumb (t % 128) // 32 of byte 32 * (t // 128) + t % 32; value = d * (code - 1)."""
    at = (t >> TQ2_HALF_BITS) * TQ2_HALF_BYTES + (t & TQ2_RUN)
    crumb = ((t >> TQ2_RUN_BITS) & QUAD) * CRUMB_BITS
    code = (_byte(blk + TQ2_0_QS + at) >> crumb) & CRUMB
    return load_f16(blk + TQ2_0_D) * (code - TERNARY_BIAS).to(tl.float32)


@triton.jit
def grid_values(blk, table, t, FMT: tl.constexpr):
    """The f32 values t (int32 indices 0..255 in a super-block) of the blocks at `blk` (uint8 pointers to each
    block's first byte in the file's layout), of shapes that broadcast together (the whole-matrix decode's
    [U, 1] and [1, T]), in the format `FMT` (`int(Format.X)`, one of kernels.GRID_GEMV_FORMATS); `table` points to
    `device_table(FMT)`. Bit for bit `fuselane.gguf.dequant`'s values, signs of zero included."""
    if FMT == FMT_TQ1_0:
        v = _tq1_0(blk, t)
    elif FMT == FMT_TQ2_0:
        v = _tq2_0(blk, t)
    else:
        low, high, signs, scale, delta = grid_group(blk, table, t >> GROUP8_BITS, FMT)
        v = grid_entry(low, high, signs, scale, delta, t & IN_GROUP8, FMT)
    return v


@triton.jit
def grid_tile(blk, table, first, FMT: tl.constexpr, BLOCK_N: tl.constexpr, VALUES: tl.constexpr):
    """[BLOCK_N, VALUES] f32: values first .. first + VALUES - 1 (a multiple of 8 within one super-block) of each of
    the blocks at `blk` ([BLOCK_N] uint8 pointers), in the values' order: a grid format's groups' fields found
    once a group and its 8 values broadcast over a trailing axis of 8, so the reshape to the tile moves no value;
    a ternary format's values each alone. The grouped expert GEMM's weight tile (`moe/grouped.py`)."""
    if (FMT == FMT_TQ1_0) | (FMT == FMT_TQ2_0):
        v = grid_values(blk[:, None], table, (first + tl.arange(0, VALUES))[None, :], FMT)
    else:
        g = first // GROUP8 + tl.arange(0, VALUES // GROUP8)
        low, high, signs, scale, delta = grid_group(blk[:, None, None], table, g[None, :, None], FMT)
        j = tl.arange(0, GROUP8)[None, None, :]
        v = tl.reshape(grid_entry(low, high, signs, scale, delta, j, FMT), [BLOCK_N, VALUES])
    return v
