"""Decoders of the grid formats: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (and the ternary TQ1_0,
TQ2_0, through `gguf.quants`).

A code of a grid format picks a row of one of llama.cpp's value grids (4 or 8 values, up to 2,048 rows), and a
sign pattern, or for IQ1 a sign of a shared offset, goes with it. Each decoder here gathers the row's signed
values from one table of every (grid row, sign pattern) pair, built once from `gguf.quants`' grids, and
multiplies them by the sub-block's scale: a gather and a multiply a value. `gguf.quants`' own decode
broadcasts over the grids: 38-61M values a second on two cores against these decoders' 323-571M
(`benchmarks/dequant_host.py`, RESULTS.md). The ternary formats decode as fast in `gguf.quants` and stay there.

The same numbers as `gguf.quants` bit for bit: every product is exact in float32 (an f16 scale, 11
significant bits, times a sub-scale of at most 5 bits, times a grid value below 64 or IQ1's value +- 1/8),
so the order of the factors cannot change a bit, and signs of zero follow the same rule in either order.
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType

from fuselane.gguf.block_views import Decoder, field, nibbles, scale
from fuselane.gguf.formats import LAYOUTS, Format

SIGN_BITS = 7  # IQ2_XXS / IQ2_XS / IQ3_XXS: a sign pattern of 8 values as a 7-bit index (the 8th its parity)
SIGN_MASK = (1 << SIGN_BITS) - 1
SCALE_SHIFT = 28  # IQ2_XXS / IQ3_XXS: a sub-block's 4-bit scale, the top of its u32 of sign indices
NIBBLE = 0xF
IQ2_STEP = np.float32(0.25)  # IQ2_*: value = d * (0.5 + scale) / 4 * grid value
IQ3_XXS_STEP = np.float32(0.5)
HALF = np.float32(0.5)
IQ1_LOW_BITS = 8  # IQ1_*: a grid index's low 8 bits in qs, its top 3 in qh
IQ1_SCALE_SHIFT = 12  # IQ1_S: a sub-block's 3-bit scale, bits 12-14 of its qh word
IQ1_S_NEGATIVE = 0x8000  # IQ1_S: the delta's sign, bit 15 of the qh word
IQ1_M_NEGATIVE = 0x08  # IQ1_M: the delta's sign, bit 3 of an entry's qh nibble
SEVEN = 0x7


def _grid(fmt: Format) -> np.ndarray:
    """`fmt`'s value grid from gguf.quants as (rows, values a row) float32."""
    cls = getattr(gguf_quants, fmt.name)
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape)


def _sign_bits(patterns: np.ndarray, width: int) -> np.ndarray:
    """+-1 float32 (len(patterns), width): bit j of each pattern set makes value j negative."""
    bits = (patterns.astype(np.uint32)[:, None] >> np.arange(width, dtype=np.uint32)) & 1
    return np.where(bits == 0, np.float32(1), np.float32(-1))


@functools.cache
def _ksigns() -> np.ndarray:
    """The 128 sign patterns of 8 values a 7-bit index stands for (ggml's ksigns_iq2xs) as bytes."""
    return np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8)


@functools.cache
def _signed_table(fmt: Format, patterns: int) -> np.ndarray:
    """Every (grid row, sign pattern) pair's signed values, (rows * patterns, width): the row's values times the
    pattern's signs (IQ2_XXS / IQ2_XS: the 128 ksigns; IQ2_S: 256 raw bytes; IQ3: 16 nibbles of 4 values)."""
    grid = _grid(fmt)
    width = grid.shape[1]
    raw = _ksigns() if patterns == SIGN_MASK + 1 else np.arange(patterns)
    return (grid[:, None, :] * _sign_bits(raw, width)[None]).reshape(-1, width)


@functools.cache
def _offset_table(fmt: Format) -> np.ndarray:
    """IQ1: every grid row plus and minus its delta, (rows * 2, 8): row 2r + 1 the negative delta's."""
    grid = _grid(fmt)
    delta = getattr(gguf_quants, fmt.name).delta
    return np.stack([grid + delta, grid - delta], axis=1).reshape(-1, grid.shape[1])


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """Bytes (n, k) as their 2k nibbles, the low one first."""
    return nibbles(raw, 1).reshape(raw.shape[0], -1)


def _gather(table: np.ndarray, index: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """out = scale * table[index], `scale` (n, groups, 1) over `index` (n, groups, per group) rows."""
    rows = np.take(table, index, axis=0)  # (n, groups, per group, width)
    np.multiply(scale[..., None], rows, out=out.reshape(rows.shape))


def _iq2_xxs(blocks: np.ndarray, out: np.ndarray) -> None:
    lay = LAYOUTS[Format.IQ2_XXS]
    n = len(blocks)
    pairs = np.ascontiguousarray(field(blocks, lay, "qs")).view("<u4").reshape(n, 8, 2)
    grid = pairs[..., 0].copy().view(np.uint8).reshape(n, 8, 4)
    signs = (pairs[..., 1:] >> np.arange(0, 4 * SIGN_BITS, SIGN_BITS, dtype=np.uint32)) & SIGN_MASK
    db = scale(blocks, lay) * (HALF + (pairs[..., 1] >> SCALE_SHIFT).astype(np.float32)) * IQ2_STEP
    index = grid.astype(np.intp) * (SIGN_MASK + 1) + signs
    _gather(_signed_table(Format.IQ2_XXS, SIGN_MASK + 1), index, db[..., None], out)


def _iq2_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    lay = LAYOUTS[Format.IQ2_XS]
    n = len(blocks)
    qs = np.ascontiguousarray(field(blocks, lay, "qs")).view("<u2").reshape(n, 16, 2)
    db = scale(blocks, lay) * (HALF + _nibbles(field(blocks, lay, "scales")).astype(np.float32)) * IQ2_STEP
    index = (qs & 511).astype(np.intp) * (SIGN_MASK + 1) + (qs >> 9)
    _gather(_signed_table(Format.IQ2_XS, SIGN_MASK + 1), index, db[..., None], out)


def _iq2_s(blocks: np.ndarray, out: np.ndarray) -> None:
    lay = LAYOUTS[Format.IQ2_S]
    n = len(blocks)
    high = (field(blocks, lay, "qh")[..., None] >> np.arange(0, 8, 2, dtype=np.uint8)) & 3  # (n, 8, 4): 2 bits an index
    grid = field(blocks, lay, "qs").astype(np.intp) | (high.reshape(n, 32).astype(np.intp) << 8)
    db = scale(blocks, lay) * (HALF + _nibbles(field(blocks, lay, "scales")).astype(np.float32)) * IQ2_STEP
    index = (grid * 256 + field(blocks, lay, "signs")).reshape(n, 16, 2)
    _gather(_signed_table(Format.IQ2_S, 256), index, db[..., None], out)


def _iq3_nibbles(patterns: np.ndarray) -> np.ndarray:
    """Sign patterns of 8 values (n, k) as the two 4-value halves' nibbles (n, 2k), the first half first."""
    return _nibbles(patterns).astype(np.intp)


def _iq3_xxs(blocks: np.ndarray, out: np.ndarray) -> None:
    lay = LAYOUTS[Format.IQ3_XXS]
    n = len(blocks)
    words = np.ascontiguousarray(field(blocks, lay, "scales")).view(
        "<u4"
    )  # (n, 8): 4 sign indices and a scale a 32 values
    signs = (words[..., None] >> np.arange(0, 4 * SIGN_BITS, SIGN_BITS, dtype=np.uint32)) & SIGN_MASK
    patterns = _ksigns()[signs.reshape(n, 32)]
    db = scale(blocks, lay) * (HALF + (words >> SCALE_SHIFT).astype(np.float32)) * IQ3_XXS_STEP
    index = (field(blocks, lay, "qs").astype(np.intp) * 16 + _iq3_nibbles(patterns)).reshape(n, 8, 8)
    _gather(_signed_table(Format.IQ3_XXS, 16), index, db[..., None], out)


def _iq3_s(blocks: np.ndarray, out: np.ndarray) -> None:
    lay = LAYOUTS[Format.IQ3_S]
    n = len(blocks)
    high = (field(blocks, lay, "qh")[..., None] >> np.arange(8, dtype=np.uint8)) & 1  # (n, 8, 8): an index's 9th bit
    grid = field(blocks, lay, "qs").astype(np.intp) | (high.reshape(n, 64).astype(np.intp) << 8)
    db = scale(blocks, lay) * (1 + 2 * _nibbles(field(blocks, lay, "scales")))
    index = (grid * 16 + _iq3_nibbles(field(blocks, lay, "signs"))).reshape(n, 8, 8)
    _gather(_signed_table(Format.IQ3_S, 16), index, db[..., None], out)


def _iq1_s(blocks: np.ndarray, out: np.ndarray) -> None:
    lay = LAYOUTS[Format.IQ1_S]
    n = len(blocks)
    qh = np.ascontiguousarray(field(blocks, lay, "qh")).view("<u2")  # (n, 8): a word a 32 values
    high = (qh[..., None] >> np.arange(0, 12, 3, dtype=np.uint16)) & SEVEN  # (n, 8, 4)
    grid = field(blocks, lay, "qs").reshape(n, 8, 4).astype(np.intp) | (high.astype(np.intp) << IQ1_LOW_BITS)
    negative = ((qh & IQ1_S_NEGATIVE) != 0)[..., None]
    dl = scale(blocks, lay) * (2 * ((qh >> IQ1_SCALE_SHIFT) & SEVEN) + 1)
    _gather(_offset_table(Format.IQ1_S), grid * 2 + negative, dl[..., None], out)


def _iq1_m(blocks: np.ndarray, out: np.ndarray) -> None:
    lay = LAYOUTS[Format.IQ1_M]
    n = len(blocks)
    words = np.ascontiguousarray(field(blocks, lay, "scales")).view("<u2")  # (n, 4): 4 x 3-bit scales, a nibble of d
    d_bits = (words & np.uint16(0xF000)) >> np.arange(12, -1, -4, dtype=np.uint16)
    d = np.bitwise_or.reduce(d_bits, axis=1).view(np.float16).astype(np.float32)[:, None]
    scales = ((words[..., None] >> np.arange(0, 12, 3, dtype=np.uint16)) & SEVEN).reshape(n, 16)
    entries = _nibbles(field(blocks, lay, "qh"))  # (n, 32): an entry's top 3 index bits and its delta's sign
    grid = field(blocks, lay, "qs").astype(np.intp) | ((entries & SEVEN).astype(np.intp) << IQ1_LOW_BITS)
    negative = (entries & IQ1_M_NEGATIVE) != 0
    with np.errstate(invalid="ignore"):  # d's nibbles may spell a NaN, which decodes to NaN as in ggml
        dl = d * (2 * scales + 1)
    _gather(_offset_table(Format.IQ1_M), (grid * 2 + negative).reshape(n, 16, 2), dl[..., None], out)


def _through_gguf(fmt: Format) -> Decoder:
    qtype = GGMLQuantizationType(int(fmt))

    def decode(blocks: np.ndarray, out: np.ndarray) -> None:
        out[:] = gguf_quants.dequantize(blocks, qtype)

    return decode


DECODERS: dict[Format, Decoder] = {
    Format.IQ2_XXS: _iq2_xxs,
    Format.IQ2_XS: _iq2_xs,
    Format.IQ2_S: _iq2_s,
    Format.IQ3_XXS: _iq3_xxs,
    Format.IQ3_S: _iq3_s,
    Format.IQ1_S: _iq1_s,
    Format.IQ1_M: _iq1_m,
    Format.TQ1_0: _through_gguf(Format.TQ1_0),
    Format.TQ2_0: _through_gguf(Format.TQ2_0),
}
