"""Quantization formats and their block layouts: the one place that holds them.

A GGUF tensor is stored as rows of blocks; each block packs `values` numbers into `nbytes` bytes as a set of
named fields (scales, minimums, packed low bits, high bits). The dequantizer, the synthetic-checkpoint writer,
the file validator and (later) the GPU kernels all read these facts from here, so a layout is written once.
Offsets are bytes from the start of a block; the layouts are llama.cpp's (ggml-common.h).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class Format(enum.IntEnum):
    """Storage formats fuselane reads, numbered as GGUF numbers them (ggml_type)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


class FieldKind(enum.Enum):
    """What a block field holds, so a writer of random blocks knows which bytes must be sane numbers."""

    SCALE = "scale"  # a float scale (f16, or an e8m0 exponent for MXFP4)
    MIN = "min"  # a float minimum subtracted after scaling
    PACKED = "packed"  # packed quant codes or packed sub-block scales: any bit pattern is valid
    VALUES = "values"  # plain float values (the unquantized formats)


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a block: `count` items of `dtype` starting `offset` bytes into the block."""

    name: str
    offset: int
    dtype: str  # numpy dtype string, little-endian
    count: int
    kind: FieldKind

    @property
    def nbytes(self) -> int:
        return np.dtype(self.dtype).itemsize * self.count


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """A format's block: how many values it packs, in how many bytes, as which fields."""

    fmt: Format
    values: int
    nbytes: int
    fields: tuple[Field, ...]

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)


QK = 32  # values in a block of the 32-value formats
QK_K = 256  # values in a super-block of the K formats
K_SCALE_BYTES = 12  # packed 6-bit sub-block scales and mins of Q4_K / Q5_K
# the 16 values an IQ4_NL / IQ4_XS 4-bit code stands for (ggml's kvalues_iq4nl), before the block scale
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# the 16 e2m1 values an MXFP4 code stands for, doubled to be integers (ggml's kvalues_mxfp4); the e8m0
# scale is read as half its power of two (ggml_e8m0_to_fp32_half) to make up for the doubling
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _layout(fmt: Format, values: int, *fields: tuple[str, str, int, FieldKind]) -> BlockLayout:
    placed, offset = [], 0
    for name, dtype, count, kind in fields:
        placed.append(Field(name, offset, dtype, count, kind))
        offset += np.dtype(dtype).itemsize * count
    return BlockLayout(fmt, values, offset, tuple(placed))


S, M, P, V = FieldKind.SCALE, FieldKind.MIN, FieldKind.PACKED, FieldKind.VALUES

LAYOUTS: dict[Format, BlockLayout] = {
    Format.F32: _layout(Format.F32, 1, ("v", "<f4", 1, V)),
    Format.F16: _layout(Format.F16, 1, ("v", "<f2", 1, V)),
    Format.BF16: _layout(Format.BF16, 1, ("v", "<u2", 1, V)),
    # d: scale; qs: 32 signed 8-bit codes
    Format.Q8_0: _layout(Format.Q8_0, QK, ("d", "<f2", 1, S), ("qs", "i1", QK, P)),
    # qs: low nibbles are values 0..15, high nibbles values 16..31; value = d * (q - 8)
    Format.Q4_0: _layout(Format.Q4_0, QK, ("d", "<f2", 1, S), ("qs", "u1", QK // 2, P)),
    Format.Q4_1: _layout(Format.Q4_1, QK, ("d", "<f2", 1, S), ("m", "<f2", 1, M), ("qs", "u1", QK // 2, P)),
    # qh: the fifth bit of each of the 32 values
    Format.Q5_0: _layout(Format.Q5_0, QK, ("d", "<f2", 1, S), ("qh", "u1", 4, P), ("qs", "u1", QK // 2, P)),
    Format.Q5_1: _layout(
        Format.Q5_1, QK, ("d", "<f2", 1, S), ("m", "<f2", 1, M), ("qh", "u1", 4, P), ("qs", "u1", QK // 2, P)
    ),
    # 16 sub-blocks of 16: 4-bit scale | 4-bit min each; 2-bit codes
    Format.Q2_K: _layout(
        Format.Q2_K,
        QK_K,
        ("scales", "u1", 16, P),
        ("qs", "u1", 64, P),
        ("d", "<f2", 1, S),
        ("dmin", "<f2", 1, M),
    ),
    # hmask: high bits; qs: low 2 bits; scales: 16 packed 6-bit scales
    Format.Q3_K: _layout(
        Format.Q3_K,
        QK_K,
        ("hmask", "u1", 32, P),
        ("qs", "u1", 64, P),
        ("scales", "u1", 12, P),
        ("d", "<f2", 1, S),
    ),
    # 8 sub-blocks of 32: 6-bit scale and min packed in 12 bytes; 4-bit codes
    Format.Q4_K: _layout(
        Format.Q4_K,
        QK_K,
        ("d", "<f2", 1, S),
        ("dmin", "<f2", 1, M),
        ("scales", "u1", K_SCALE_BYTES, P),
        ("qs", "u1", 128, P),
    ),
    Format.Q5_K: _layout(
        Format.Q5_K,
        QK_K,
        ("d", "<f2", 1, S),
        ("dmin", "<f2", 1, M),
        ("scales", "u1", K_SCALE_BYTES, P),
        ("qh", "u1", 32, P),
        ("qs", "u1", 128, P),
    ),
    # 16 sub-blocks of 16 with signed 8-bit scales; 6-bit codes as 4 low + 2 high bits
    Format.Q6_K: _layout(
        Format.Q6_K,
        QK_K,
        ("ql", "u1", 128, P),
        ("qh", "u1", 64, P),
        ("scales", "i1", 16, P),
        ("d", "<f2", 1, S),
    ),
    # 4-bit codes into a non-linear table
    Format.IQ4_NL: _layout(Format.IQ4_NL, QK, ("d", "<f2", 1, S), ("qs", "u1", QK // 2, P)),
    Format.IQ4_XS: _layout(
        Format.IQ4_XS,
        QK_K,
        ("d", "<f2", 1, S),
        ("scales_h", "<u2", 1, P),
        ("scales_l", "u1", QK_K // 64, P),
        ("qs", "u1", QK_K // 2, P),
    ),
    # e: shared power-of-two exponent (e8m0); qs: 4-bit e2m1 codes
    Format.MXFP4: _layout(Format.MXFP4, QK, ("e", "u1", 1, S), ("qs", "u1", QK // 2, P)),
    # The grid formats (GRID_FORMATS): codes index llama.cpp's tables of 4 or 8 values (its iq*_grid), with
    # separate sign bits and 3-4-bit sub-block scales; only the cpu lane decodes them (`dequant_grid`).
    # qs: eight u32 pairs, a pair's first four bytes grid indices, its second 4 x 7 sign bits and a 4-bit scale
    Format.IQ2_XXS: _layout(Format.IQ2_XXS, QK_K, ("d", "<f2", 1, S), ("qs", "u1", QK_K // 4, P)),
    # qs: 32 u16, 9 bits of grid index and 7 of signs; scales: two 4-bit scales a byte
    Format.IQ2_XS: _layout(
        Format.IQ2_XS, QK_K, ("d", "<f2", 1, S), ("qs", "u1", QK_K // 4, P), ("scales", "u1", QK_K // 32, P)
    ),
    # qs: low 8 bits of 32 grid indices; signs: one bit a value; qh: the indices' top 2 bits
    Format.IQ2_S: _layout(
        Format.IQ2_S,
        QK_K,
        ("d", "<f2", 1, S),
        ("qs", "u1", QK_K // 8, P),
        ("signs", "u1", QK_K // 8, P),
        ("qh", "u1", QK_K // 32, P),
        ("scales", "u1", QK_K // 32, P),
    ),
    # qs: 64 grid indices (4 values each); scales: eight u32 of 4 x 7 sign bits and a 4-bit scale
    Format.IQ3_XXS: _layout(
        Format.IQ3_XXS, QK_K, ("d", "<f2", 1, S), ("qs", "u1", QK_K // 4, P), ("scales", "u1", QK_K // 8, P)
    ),
    Format.IQ3_S: _layout(
        Format.IQ3_S,
        QK_K,
        ("d", "<f2", 1, S),
        ("qs", "u1", QK_K // 4, P),
        ("qh", "u1", QK_K // 32, P),
        ("signs", "u1", QK_K // 8, P),
        ("scales", "u1", QK_K // 64, P),
    ),
    # qs: low 8 bits of 32 grid indices; qh: 8 u16 of 4 x 3 index bits, a 3-bit scale and the delta's sign
    Format.IQ1_S: _layout(Format.IQ1_S, QK_K, ("d", "<f2", 1, S), ("qs", "u1", QK_K // 8, P), ("qh", "u1", 16, P)),
    # no field of its own holds d: the f16 is the top nibbles of the four u16 of `scales` (IQ1M_SCALE_NIBBLES)
    Format.IQ1_M: _layout(
        Format.IQ1_M, QK_K, ("qs", "u1", QK_K // 8, P), ("qh", "u1", QK_K // 16, P), ("scales", "u1", 8, P)
    ),
    # ternary: qs five base-3 digits a byte (240 values), qh four (16); value = d * (digit - 1)
    Format.TQ1_0: _layout(Format.TQ1_0, QK_K, ("qs", "u1", 48, P), ("qh", "u1", 4, P), ("d", "<f2", 1, S)),
    # ternary: 2-bit codes, value = d * (code - 1)
    Format.TQ2_0: _layout(Format.TQ2_0, QK_K, ("qs", "u1", QK_K // 4, P), ("d", "<f2", 1, S)),
}

# Formats whose codes index llama.cpp's value grids, or hold ternary digits: read from files and decoded by the
# cpu lane (`dequant_grid`, from `gguf.quants`' grids), by no kernel of the cuda lane.
GRID_FORMATS = frozenset(
    {
        Format.IQ2_XXS,
        Format.IQ2_XS,
        Format.IQ2_S,
        Format.IQ3_XXS,
        Format.IQ3_S,
        Format.IQ1_S,
        Format.IQ1_M,
        Format.TQ1_0,
        Format.TQ2_0,
    }
)
IQ1M_SCALE_NIBBLES = 4  # IQ1_M's f16 d: bits 12-15 of each of its `scales` u16, the first the lowest


def layout(fmt: Format) -> BlockLayout:
    """The block layout of `fmt`."""
    return LAYOUTS[fmt]


def is_supported(type_id: int) -> bool:
    """Whether a ggml type number is a format fuselane reads."""
    return type_id in Format._value2member_map_


def row_bytes(fmt: Format, n_values: int) -> int:
    """Bytes of one row of `n_values` values; the row must be whole blocks."""
    lay = LAYOUTS[fmt]
    if n_values % lay.values:
        raise ValueError(f"{fmt.name} rows are whole blocks of {lay.values} values, not {n_values}")
    return n_values // lay.values * lay.nbytes


def tensor_bytes(fmt: Format, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` (numpy order: the last axis is the row) in `fmt`."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * row_bytes(fmt, shape[-1])
