"""Bandwidth-first decode GEMV for one activation row: y (1, n) = x (1, k) @ W^T, W as checkpoint bytes.

A decode step's products stream every weight byte once, so their speed is the rate the bytes arrive. These
kernels are the plain 2-D-tile shape that keeps the most bytes in flight for the least bookkeeping:

- a program takes BLOCK_N whole output rows (grid `cdiv(n, BLOCK_N)`, four warps) and walks them in chunks
  of CHUNK units (a unit: a 256-value K super-block, a 32-value block, or 256 f16 values), so each
  iteration issues one wide load of every row's code bytes, a few small loads of their scales and one of
  the chunk's activations;
- codes are decoded with integer ops into f32 tiles and multiplied into an f32 accumulator of the tile's
  own shape, ELEMENTWISE: the loop has no reductions and no cross-lane traffic; the value axes are summed
  once after it;
- a row whose units are not a whole number of chunks ends with one masked chunk; no other load is masked
  (rows past n read row n - 1, and the store drops them).

The tiles' axes are ordered for Triton's default layouts, which hand lanes to the fastest axis first and
leave the slowest axis to repeat inside a thread: a tile is [RUNS, BLOCK_N, C, VEC] with VEC the bytes one
load moves (16 where a format's blocks are 16-byte aligned, 2 where they are only 2-byte aligned), C the
chunk's scale groups (sub-block pairs, 16-byte runs, blocks) and RUNS the VEC-runs of a group. With
BLOCK_N * C >= 128 lanes a thread holds one group of one row whole, so it decodes that group's scales
once for all its values instead of once per load.

Codes become floats by the 2^23 trick: OR-ing an integer u < 2^23 into the bits of 2^23 gives the float
2^23 + u, and one subtraction leaves u: two full-rate ops where the int-to-float converter runs at a
fraction of the rate on Hopper. A high nibble (and Q6_K's high crumbs) is kept in place, 16 times its
code, and its scale taken a sixteenth, which is exact. Every decoded weight is bit for bit the f32 value of
`fuselane.gguf.dequant` (scale products are exact in f32; the K formats' minimum is subtracted with one
rounding, as gguf does), so only the dot product's summation order differs from the reference.

Launchers (raw uint8 weight tensors as `gemv.py` takes them; x (1, k) float; one launch each, none
allocating): `gemv_fast`, `gemv_fast_parts`, `gemv_fast_gate_up_glu`, and `supports_fast`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import LAYOUTS, QK, QK_K, Format, row_bytes
from fuselane.lanes.cuda.triton.gemv import Part


def _c(value: int | float) -> tl.constexpr:
    return tl.constexpr(value)


def _off(fmt: Format, field: str) -> tl.constexpr:
    return _c(LAYOUTS[fmt].field(field).offset)


# --- layout facts (formats.LAYOUTS), as constexprs the kernels read -----------------------------------------------

FMT_F16, FMT_Q8_0, FMT_Q5_0 = _c(Format.F16.value), _c(Format.Q8_0.value), _c(Format.Q5_0.value)
FMT_Q4_K, FMT_Q6_K = _c(Format.Q4_K.value), _c(Format.Q6_K.value)

Q8_0_BYTES, Q8_0_D, Q8_0_QS = _c(LAYOUTS[Format.Q8_0].nbytes), _off(Format.Q8_0, "d"), _off(Format.Q8_0, "qs")
Q5_0_BYTES, Q5_0_D = _c(LAYOUTS[Format.Q5_0].nbytes), _off(Format.Q5_0, "d")
Q5_0_QH, Q5_0_QS = _off(Format.Q5_0, "qh"), _off(Format.Q5_0, "qs")
Q4_K_BYTES, Q4_K_D, Q4_K_DMIN = _c(LAYOUTS[Format.Q4_K].nbytes), _off(Format.Q4_K, "d"), _off(Format.Q4_K, "dmin")
Q4_K_SCALES, Q4_K_QS = _off(Format.Q4_K, "scales"), _off(Format.Q4_K, "qs")
Q6_K_BYTES, Q6_K_D, Q6_K_SCALES = _c(LAYOUTS[Format.Q6_K].nbytes), _off(Format.Q6_K, "d"), _off(Format.Q6_K, "scales")
Q6_K_QL, Q6_K_QH = _off(Format.Q6_K, "ql"), _off(Format.Q6_K, "qh")

QK_C, QK_K_C = _c(QK), _c(QK_K)
F16_UNIT = _c(QK_K)  # values of an F16 row a unit: a chunk of 256 values, like a K super-block

# --- tile facts --------------------------------------------------------------------------------------------------

WIDE = _c(16)  # bytes of one load where a format's blocks are 16-byte aligned (Q4_K: 144-byte blocks)
NARROW = _c(2)  # ... where they are only 2-byte aligned (Q8_0: 34, Q5_0: 22, Q6_K: 210 bytes)
F16_VEC = _c(8)  # f16 values of one 16-byte load
# Q4_K: a super-block is 4 pairs of 32-value sub-blocks; a pair's 32 qs bytes hold sub-block 2j in their
# low nibbles and 2j + 1 in their high ones, each run of 16 bytes a thread's.
K_PAIRS = _c(4)
PAIR_BYTES = _c(32)
PAIR_RUNS = _c(2)  # 16-byte runs of a pair
# Q6_K: two halves of 128 values; byte b (0..63) of a half's ql holds value b (sub-block b // 16) in its low
# nibble and 64 + b (four sub-blocks on) in its high one; qh byte b % 32 of the half holds their top 2 bits
# at crumb b // 32 and 2 + b // 32. A 16-byte run r of ql (sub-blocks r and r + 4) is a thread's.
Q6_RUNS = _c(8)  # 16-byte runs of ql a super-block has: 4 a half
Q6_HALF_RUNS = _c(4)
Q6_RUN = _c(16)
Q6_HALF = _c(128)  # values of a half
Q6_QL_HALF = _c(64)  # ql bytes of a half; also how far a high nibble's value is from its low one's
Q6_QH_HALF = _c(32)  # qh bytes of a half
Q6_HIGH_SUBS = _c(4)  # sub-blocks from a low nibble's scale to its high nibble's
Q6_SUBS_HALF = _c(8)  # sub-blocks (scales) of a half
# Q8_0 / Q5_0: a block's 32 values as two planes of 16 (Q8_0: bytes 0-15 and 16-31; Q5_0: the 16 qs bytes'
# low nibbles, values 0-15, and high nibbles, values 16-31)
PLANE = _c(16)

# --- bit facts of the codes (the formats' definitions, as in fuselane.gguf.dequant) --------------------------

NIBBLE = _c(0x0F)
HIGH_NIBBLE = _c(0xF0)  # a byte's high nibble in place: 16 times its code
HIGH_STEP = _c(1.0 / 16)  # the scale of a code kept 16 times over (a power of two: exact)
# Q4_K 6-bit scales and mins of 8 sub-blocks in 12 bytes; read as the little-endian 16-bit pairs of bytes
# that hold sub-blocks 2j and 2j + 1 (a pair): for j < 2 the scales are the low 6 bits of bytes 2j, 2j + 1
# and the mins of bytes 2j + 4, 2j + 5; for j >= 2 the low 4 bits of both are the nibbles of bytes 2j + 4,
# 2j + 5 and their top 2 bits the top 2 bits of bytes 2j - 4, 2j - 3 (scales) and 2j, 2j + 1 (mins).
K_LOW_PAIRS = _c(2)  # pairs whose scales and mins sit whole in one byte each
SIX_BITS_2 = _c(0x3F3F)  # the low 6 bits of both bytes of a pair
NIBBLE_2 = _c(0x0F0F)
TOP_TWO_2 = _c(0x3030)  # a byte's top 2 bits shifted down to bits 4-5, both bytes
TOP_SHIFT = _c(2)  # bits 6-7 -> 4-5
NIBBLE_BITS = _c(4)
BYTE_BITS = _c(8)
BYTE = _c(0xFF)
HALF_WORD_BITS = _c(16)
PAIR_STRIDE = _c(2)  # bytes of a pair of scale bytes
K_MIN_BYTES = _c(4)  # from a pair's scale bytes to its min bytes (j < 2) / its low bits (j >= 2)
# Q6_K: a run's qh byte shifted left by 4 - 2 (r // 2) puts the low nibble's crumb at bits 4-5 and the high
# nibble's at bits 8-9: each on top of its nibble as kept in place.
Q6_CRUMB_LOW = _c(0x30)
Q6_CRUMB_HIGH = _c(0x300)
Q6_SHIFT_TOP = _c(4)
Q6_BIAS = _c(32)  # Q6_K: value = d * scale * (code - 32)
Q5_BIAS = _c(16)  # Q5_0: value = d * (code - 16)
Q5_FIFTH = _c(0x10)  # the fifth bit of a low-nibble code in place
Q5_FIFTH_HIGH = _c(0x100)  # ... of a high-nibble code kept 16 times over
SIGN_AND_TWO_23 = _c(0x4B000080)  # XOR-ed into a signed byte: q + 128 in 2^23's bits
SIGNED_BYTE_BIAS = _c(128)
# 0x4B000000 are the bits of 2^23: OR-ing an integer u < 2^23 into them gives the float 2^23 + u exactly.
F32_TWO_23_BITS = _c(0x4B000000)
F32_TWO_23 = _c(8388608.0)

# Units a chunk takes (one loop iteration), and the tile's rows, by default: see `_defaults`.
CHUNK_UNITS = {Format.Q4_K: 4, Format.Q6_K: 2, Format.Q8_0: 8, Format.Q5_0: 8, Format.F16: 2}
BLOCK_ROWS = {Format.Q4_K: 8, Format.Q6_K: 8, Format.Q8_0: 16, Format.Q5_0: 16, Format.F16: 8}
UNIT_VALUES = {Format.Q4_K: QK_K, Format.Q6_K: QK_K, Format.Q8_0: QK, Format.Q5_0: QK, Format.F16: QK_K}
WARPS = 4
PARTS_MOST = 4  # products one `gemv_fast_parts` launch takes
NO_TILE = 2**31 - 1  # stand-in tile boundary of an absent part: no program id reaches it
