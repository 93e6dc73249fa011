"""The GEMV family's format facts: block layouts, code bits and the 2^23 trick, as constexprs every body reads.

One place for what a format *is* to the kernels (`formats.LAYOUTS`' byte offsets and sizes, the bits of its
codes as `fuselane.gguf.dequant` defines them), so the three GEMV bodies (`formats` for `rows`, `fast`, `q8`)
and the on-device dequantization read the same numbers; each body keeps only its own tiling's constants.
`check_layouts` fails at import if a layout stops meeting an alignment a load relies on.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselane.gguf.formats import IQ4_NL_VALUES, LAYOUTS, MXFP4_VALUES, QK, QK_K, Format
from fuselane.lanes.cuda.plan.kernels import (
    ROW_TAIL_D,
    kept_after_row,
    stored_block_bytes,
    stored_offset,
    tail_offset,
)

# --- layout facts, as constexprs the kernels can read --------------------------------------------------------


def const(value: int | float) -> tl.constexpr:
    """`value` as a constexpr a kernel reads (a module-level name a @triton.jit function may use)."""
    return tl.constexpr(value)


def offset(fmt: Format, field: str) -> tl.constexpr:
    """The byte offset of `field` in a block of `fmt` as the device keeps it (`kernels.stored_offset`), as a
    constexpr."""
    return const(stored_offset(fmt, field))


def nbytes(fmt: Format) -> tl.constexpr:
    """The bytes of a block of `fmt` as the device keeps it (`kernels.stored_block_bytes`), as a constexpr."""
    return const(stored_block_bytes(fmt))


def after_d(fmt: Format, field: str) -> tl.constexpr:
    """The byte offset of `field` from its block's d where the device keeps both after the row's blocks
    (`kernels.kept_after_row`), as a constexpr."""
    if not kept_after_row(fmt, field):
        raise ValueError(f"{Format(fmt).name}'s {field} is kept in its block, not after its row")
    lay = LAYOUTS[Format(fmt)]
    return const(lay.field(field).offset - lay.field("d").offset)


FMT_F32, FMT_F16, FMT_BF16 = const(Format.F32.value), const(Format.F16.value), const(Format.BF16.value)
FMT_Q8_0, FMT_Q4_0, FMT_Q4_1 = const(Format.Q8_0.value), const(Format.Q4_0.value), const(Format.Q4_1.value)
FMT_Q5_0, FMT_Q5_1 = const(Format.Q5_0.value), const(Format.Q5_1.value)
FMT_Q4_K, FMT_Q5_K, FMT_Q6_K = const(Format.Q4_K.value), const(Format.Q5_K.value), const(Format.Q6_K.value)
FMT_Q2_K, FMT_Q3_K = const(Format.Q2_K.value), const(Format.Q3_K.value)
FMT_IQ4_NL, FMT_IQ4_XS = const(Format.IQ4_NL.value), const(Format.IQ4_XS.value)
FMT_MXFP4 = const(Format.MXFP4.value)  # kept as IQ4_NL, its own table and its e after the row (`kernels`)

QK_C = const(QK)  # values of a 32-value block
HALF_QK = const(QK // 2)  # a 32-value 4-bit block's bytes: low nibbles are values 0-15, high nibbles 16-31
QK_K_C = const(QK_K)  # values of a K super-block
NO_FIELD = const(-1)  # a field offset a format does not have

# Q8_0 on the device (`run/stored.py`): a block's 32 codes Q8_0_BYTES (32) apart, its d after the row's blocks
# (`q8_0_d`); Q8_0_FILE_BYTES is the file's block, by which a row's stored bytes give its blocks
Q8_0_BYTES, Q8_0_QS = nbytes(Format.Q8_0), offset(Format.Q8_0, "qs")
Q8_0_FILE_BYTES, Q8_0_D_BYTES = const(LAYOUTS[Format.Q8_0].nbytes), const(ROW_TAIL_D[Format.Q8_0])
# Q4_0, IQ4_NL and IQ4_XS on the device (`run/stored.py`): a block's codes (16 bytes; IQ4_XS 128) one after another,
# its header after the row's blocks (`tail_d`: Q4_0's and IQ4_NL's d; IQ4_XS's d, scales_h and scales_l, 8 bytes)
Q4_0_BYTES, Q4_0_QS = nbytes(Format.Q4_0), offset(Format.Q4_0, "qs")
Q4_1_BYTES, Q4_1_D, Q4_1_QS = nbytes(Format.Q4_1), offset(Format.Q4_1, "d"), offset(Format.Q4_1, "qs")
Q4_1_M = offset(Format.Q4_1, "m")
Q5_0_BYTES, Q5_0_D, Q5_0_QS = nbytes(Format.Q5_0), offset(Format.Q5_0, "d"), offset(Format.Q5_0, "qs")
Q5_0_QH = offset(Format.Q5_0, "qh")
Q5_1_BYTES, Q5_1_D, Q5_1_QS = nbytes(Format.Q5_1), offset(Format.Q5_1, "d"), offset(Format.Q5_1, "qs")
Q5_1_M, Q5_1_QH = offset(Format.Q5_1, "m"), offset(Format.Q5_1, "qh")
Q4_K_BYTES, Q4_K_D, Q4_K_DMIN = nbytes(Format.Q4_K), offset(Format.Q4_K, "d"), offset(Format.Q4_K, "dmin")
Q4_K_SCALES, Q4_K_QS = offset(Format.Q4_K, "scales"), offset(Format.Q4_K, "qs")
Q5_K_BYTES, Q5_K_D, Q5_K_DMIN = nbytes(Format.Q5_K), offset(Format.Q5_K, "d"), offset(Format.Q5_K, "dmin")
Q5_K_SCALES, Q5_K_QH, Q5_K_QS = offset(Format.Q5_K, "scales"), offset(Format.Q5_K, "qh"), offset(Format.Q5_K, "qs")
# Q6_K on the device (`run/stored.py`): a block's ql, qh and scales Q6_K_BYTES (208) apart, its d after the row's
# blocks (`q6_k_d`); Q6_K_FILE_BYTES is the file's block, by which a row's stored bytes give its blocks
Q6_K_BYTES, Q6_K_SCALES = nbytes(Format.Q6_K), offset(Format.Q6_K, "scales")
Q6_K_FILE_BYTES, Q6_K_D_BYTES = const(LAYOUTS[Format.Q6_K].nbytes), const(ROW_TAIL_D[Format.Q6_K])
Q6_K_QL, Q6_K_QH = offset(Format.Q6_K, "ql"), offset(Format.Q6_K, "qh")
Q2_K_BYTES, Q2_K_SCALES, Q2_K_QS = nbytes(Format.Q2_K), offset(Format.Q2_K, "scales"), offset(Format.Q2_K, "qs")
Q2_K_D, Q2_K_DMIN = offset(Format.Q2_K, "d"), offset(Format.Q2_K, "dmin")
Q3_K_BYTES, Q3_K_HMASK, Q3_K_QS = nbytes(Format.Q3_K), offset(Format.Q3_K, "hmask"), offset(Format.Q3_K, "qs")
Q3_K_SCALES, Q3_K_D = offset(Format.Q3_K, "scales"), offset(Format.Q3_K, "d")
IQ4_NL_BYTES, IQ4_NL_QS = nbytes(Format.IQ4_NL), offset(Format.IQ4_NL, "qs")
MXFP4_BYTES, MXFP4_QS = nbytes(Format.MXFP4), offset(Format.MXFP4, "qs")
IQ4_XS_BYTES, IQ4_XS_QS = nbytes(Format.IQ4_XS), offset(Format.IQ4_XS, "qs")
IQ4_XS_SCALES_H, IQ4_XS_SCALES_L = after_d(Format.IQ4_XS, "scales_h"), after_d(Format.IQ4_XS, "scales_l")

# the `ROW_TAIL_D` formats: every format's flag, and their stored and file blocks' bytes and header bytes kept after
# a row (constexpr maps a kernel indexes by its FMT)
TAIL_C = const({int(f): f in ROW_TAIL_D for f in Format})
STORED_BYTES_C = const({int(f): stored_block_bytes(f) for f in ROW_TAIL_D})
FILE_BYTES_C = const({int(f): LAYOUTS[f].nbytes for f in ROW_TAIL_D})
TAIL_BYTES_C = const({int(f): ROW_TAIL_D[f] for f in ROW_TAIL_D})

# --- bit facts of the codes (the formats' definitions, as in dequant.py) --------------------------------------

NIBBLE_BITS = const(4)
NIBBLE = const(0x0F)
HIGH_NIBBLE = const(0xF0)  # a byte's high nibble in place: 16 times its code
HIGH_WEIGHT = const(16)  # what a high nibble kept in place is worth: 16 times its code
HIGH_STEP = const(1.0 / 16)  # the scale of a code kept 16 times over (a power of two: exact)
CRUMB = const(0x3)  # a 2-bit field
BIT = const(0x1)
Q4_BIAS = const(8)  # Q4_0: value = d * (code - 8)
Q5_BIAS = const(16)  # Q5_0: value = d * (code - 16)
Q6_BIAS = const(32)  # Q6_K: value = d * scale * (code - 32)
SIGN_BIT = const(0x80)  # an int8's sign bit: flipping it turns the signed byte q into the unsigned q + 128
SIGNED_BYTE_BIAS = const(0x80)
# Q4_K / Q5_K: 8 sub-blocks of 32, their 6-bit scales and mins packed in 12 bytes (three 32-bit words a, b,
# c): sub-blocks 0-3 keep theirs in the low 6 bits of a byte of a (scales) and b (mins); sub-blocks 4-7 take
# their low 4 bits from a nibble of c and their top 2 bits from the top 2 bits of a's (b's) byte.
K_PAIRS = const(4)  # pairs of sub-blocks: a pair's 32 qs bytes hold the first in low nibbles, the second in high
K_LOW_SUBS = const(4)  # sub-blocks whose scale and min are whole in one byte
SIX_BITS = const(0x3F)
K_TOP_SHIFT = const(6)  # where a byte of a / b keeps the top 2 bits of a later sub-block's scale / min
# Q6_K: two halves of 128 values. Byte b (0..63) of a half's ql holds value b in its low nibble and value
# 64 + b in its high one; qh byte b % 32 of the half holds their top 2 bits, as crumb b // 32 and 2 + b // 32.
Q6_SUB = const(16)  # values under one Q6_K scale: a slot's 16 ql bytes share one scale a nibble
Q6_SLOTS = const(8)  # 16-byte runs of ql a super-block has
Q6_HALF_SLOTS = const(4)  # ... a half has
Q6_HALF = const(128)  # values of a half
Q6_RUNS = const(8)  # runs of 32 values a super-block has (a run: one crumb of qh, one nibble of ql)
Q6_HALF_RUNS = const(4)  # ... a half has
Q6_RUN_SCALES = const(2)  # scales a run has: one a 16 values (Q6_SUB)
Q6_QL_HALF = const(64)  # ql bytes of a half
Q6_QH_HALF = const(32)  # qh bytes of a half
Q6_HIGH_SUBS = const(4)  # the high nibbles' sub-block is four on from the low nibbles'
Q6_HIGH_CRUMBS = const(4)  # ... and their top bits two crumbs (4 bits) up qh

WORD = const(4)  # bytes of the 32-bit words the K formats' headers are loaded as
BYTE_BITS = const(8)
BYTE = const(0xFF)  # a byte's bits
F16_BITS = const(0xFFFF)
HALF_WORD_BITS = const(16)

# Q2_K / Q3_K: two halves of 128 values, each 32 qs bytes of four crumbs (value 32j + l of a half is crumb j of
# its byte l); a sub-block of 16 values a scale (Q2_K: the scale's low nibble, the min's high one).
HALF_QS = const(32)  # qs bytes of a half
K_SUB = const(16)  # values under one scale
# Q3_K: hmask byte l holds the third bit of value l of each of the eight runs of 32 (bit 4 * half + run); its 16
# six-bit scales are stored + 32: the low 4 bits of scale i as nibble i // 8 of byte i % 8, the top 2 bits as
# crumb i // 4 of byte 8 + i % 4.
SIGNED_SCALE = const(32)  # Q3_K's and IQ4_XS's 6-bit scales are stored + 32
Q3_HIGH_SCALES, Q3_SCALE_ROWS = const(8), const(4)
Q3_LOW_SCALES = const(8)  # bytes of the scales' low nibbles
Q3_BIAS_CODE = const(4)  # a clear hmask bit makes the code 4 lower


def _table_words(values) -> tuple:
    """A 16-entry code table of signed bytes as four little-endian int32 words (bytes 4w..4w + 3)."""
    raw = bytes(v & 0xFF for v in values)
    return tuple(const(int.from_bytes(raw[4 * w : 4 * w + 4], "little", signed=True)) for w in range(4))


# IQ4_NL / IQ4_XS: the 16 values a code stands for; MXFP4: its (doubled) e2m1 values, kept the same way
IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3 = _table_words(IQ4_NL_VALUES)
MX_T0, MX_T1, MX_T2, MX_T3 = _table_words(MXFP4_VALUES)
IQ4_XS_SUB = const(32)  # IQ4_XS: values under one of its eight scales
# MXFP4's scale 2^(e - 128) from its e8m0 byte e, as ggml's `e8m0_to_fp32_half` makes it: for e < 2 an f32
# subnormal, 2^-128 << e; else the exponent field e - 1
E8M0_SUBNORMAL_BITS = const(0x00200000)  # the f32 bits of 2^-128
E8M0_NORMAL_FROM = const(2)
F32_MANTISSA_BITS = const(23)

# The 2^23 trick: 0x4B000000 are the bits of 2.0**23; OR-ing an integer u < 2^23 into them gives the float
# 2^23 + u exactly.
F32_TWO_23_BITS = const(0x4B000000)
F32_TWO_23 = const(8388608.0)


def check_layouts() -> None:
    """Fail at import if a layout no longer has the alignment the loads below take for granted."""
    for fmt in (Format.Q4_K, Format.Q5_K):
        lay = LAYOUTS[fmt]
        if lay.nbytes % WORD.value or lay.field("scales").offset % WORD.value:
            raise RuntimeError(f"{fmt.name}: the GEMV loads its header as 32-bit words; the layout moved")
    q3 = LAYOUTS[Format.Q3_K]
    scales, d = q3.field("scales"), q3.field("d")
    stored_runs = (stored_block_bytes(Format.Q3_K), q3.field("qs").offset, q3.field("hmask").offset, scales.offset)
    if any(v % 16 for v in stored_runs) or d.offset != scales.offset + scales.count:
        raise RuntimeError("Q3_K: the int8 GEMV loads its scales and d, qs and hmask runs as 16-byte words; moved")
    for fmt in ROW_TAIL_D:  # a split block: whole 16-byte units, its header one run of bytes
        lay, stored = LAYOUTS[fmt], stored_block_bytes(fmt)
        d = tail_offset(fmt)
        if stored % 16 or stored + ROW_TAIL_D[fmt] != lay.nbytes or d not in (0, stored):
            raise RuntimeError(f"{fmt.name}: the GEMVs load a block's runs as 16-byte words, its header after the row")
    if stored_block_bytes(Format.Q8_0) % 16 or stored_offset(Format.Q8_0, "qs"):
        raise RuntimeError("Q8_0: the GEMVs load a block's codes as two 16-byte words, d after the row; moved")
    q6 = LAYOUTS[Format.Q6_K]
    q6_runs = (stored_block_bytes(Format.Q6_K), q6.field("ql").offset, q6.field("qh").offset, q6.field("scales").offset)
    if any(v % 16 for v in q6_runs) or q6.field("d").offset != stored_block_bytes(Format.Q6_K):
        raise RuntimeError("Q6_K: the GEMVs load ql and qh runs as 16-byte words, d after the row; the layout moved")
    for fmt in (Format.Q5_0, Format.Q5_1):
        lay = LAYOUTS[fmt]
        if lay.nbytes % 2 or lay.field("qh").offset % 2:
            raise RuntimeError(f"{fmt.name}: the GEMV loads qh as two 16-bit halves; the layout moved")
    for fmt in (Format.Q8_0, Format.Q4_0, Format.Q4_1, Format.Q5_0, Format.Q5_1, Format.Q6_K):
        lay = LAYOUTS[fmt]
        names = {f.name for f in lay.fields}
        if lay.nbytes % 2 or any(lay.field(f).offset % 2 for f in ("d", "m") if f in names):
            raise RuntimeError(f"{fmt.name}: the GEMV loads f16 scales as 16-bit words; the layout moved")


check_layouts()


@triton.jit
def in_two_23(bits, bias):
    """u - bias as f32, exactly, from `bits`: 2^23's bits with an integer 0 <= u < 2^23 OR-ed in (the float
    2^23 + u), with one subtraction and no int-to-float convert. `bias` may be a constexpr (folded into the
    constant) or a tensor."""
    return bits.to(tl.float32, bitcast=True) - (bias + F32_TWO_23)


# --- reading a block's fields ---------------------------------------------------------------------------------


@triton.jit
def q6_k_d(row, unit, N_UNITS):
    """Pointers to the f16 d of block `unit` of the Q6_K rows at `row` (byte pointers to rows of N_UNITS blocks as
    the device keeps them: the d's follow the row's blocks, `run/stored.py`). A row's stored bytes give N_UNITS as
    ROW_BYTES // Q6_K_FILE_BYTES (its padding is under a block)."""
    return row + N_UNITS * Q6_K_BYTES + unit * Q6_K_D_BYTES


@triton.jit
def q8_0_d(row, unit, N_UNITS):
    """Pointers to the f16 d of block `unit` of the Q8_0 rows at `row` (as `q6_k_d`: the d's follow the row's
    N_UNITS blocks of 32 codes, `run/stored.py`; a row's stored bytes give N_UNITS as ROW_BYTES // Q8_0_FILE_BYTES)."""
    return row + N_UNITS * Q8_0_BYTES + unit * Q8_0_D_BYTES


@triton.jit
def tail_d(row, unit, N_UNITS, FMT: tl.constexpr):
    """Pointers to the d of block `unit` of the rows at `row` (rows of N_UNITS blocks) of a `ROW_TAIL_D` format
    (`q6_k_d` and `q8_0_d` for any of them): its header's bytes (d, and the fields after it the row keeps with it:
    IQ4_XS's scales) follow the row's blocks."""
    return row + N_UNITS * STORED_BYTES_C[FMT] + unit * TAIL_BYTES_C[FMT]


@triton.jit
def block_d(row, unit, FMT: tl.constexpr, ROW_BYTES: tl.constexpr):
    """Where the f16 d of block `unit` of the rows at `row` (byte pointers or offsets of rows of ROW_BYTES stored
    bytes; broadcasting) lies, for a format that keeps a row's d's after its blocks (`tail_d`; a row's stored bytes
    give its blocks as ROW_BYTES // the file's block, its padding under a block); for any other format `row`
    itself (broadcast), which no decode reads."""
    if TAIL_C[FMT]:
        return tail_d(row, unit, ROW_BYTES // FILE_BYTES_C[FMT], FMT)
    else:
        return row + unit * 0


@triton.jit
def load_f16(ptr):
    """The f16 at each of `ptr` (uint8 pointers, 2-aligned), as f32."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def e8m0_scale(e):
    """MXFP4's scale from its exponent byte `e` (int32 0..255), as f32, exactly: 2^(e - 128)."""
    bits = tl.where(e < E8M0_NORMAL_FROM, E8M0_SUBNORMAL_BITS << e, (e - 1) << F32_MANTISSA_BITS)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_e8m0(ptr):
    """MXFP4's scale from the exponent byte at each of `ptr` (uint8 pointers), as f32."""
    return e8m0_scale(tl.load(ptr).to(tl.int32))


@triton.jit
def load_word(blk, OFF: tl.constexpr):
    """The aligned 32-bit word holding byte OFF of each block (`blk`: pointers to 4-aligned blocks)."""
    return tl.load((blk + (OFF - OFF % WORD)).to(tl.pointer_type(tl.int32)))


@triton.jit
def f16_in_word(blk, OFF: tl.constexpr):
    """The f16 at byte OFF of each 4-aligned block, read from its 32-bit word (a load the pipeliner can
    stage asynchronously, which a 2-byte load is not), as f32."""
    bits = (load_word(blk, OFF) >> (BYTE_BITS * (OFF % WORD))) & F16_BITS
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def k_scale_min(blk, SCALES: tl.constexpr, s):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block s[j] of block blk[r, j] ([N, B] pointers), [N, B]."""
    a = load_word(blk, SCALES)
    b = load_word(blk, SCALES + WORD)
    c = load_word(blk, SCALES + 2 * WORD)
    shift = ((s % K_LOW_SUBS) * BYTE_BITS)[None, :]  # the byte of each word that sub-block s reads
    sc_low = (a >> shift) & SIX_BITS
    mn_low = (b >> shift) & SIX_BITS
    sc_high = ((c >> shift) & NIBBLE) | (((a >> (shift + K_TOP_SHIFT)) & CRUMB) << NIBBLE_BITS)
    mn_high = ((c >> (shift + NIBBLE_BITS)) & NIBBLE) | (((b >> (shift + K_TOP_SHIFT)) & CRUMB) << NIBBLE_BITS)
    low = (s < K_LOW_SUBS)[None, :]
    return tl.where(low, sc_low, sc_high), tl.where(low, mn_low, mn_high)
