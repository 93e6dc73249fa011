"""Make GGUF tensor bytes: quantize real values, or generate random blocks for synthetic checkpoints.

Tests and the synthetic-checkpoint writer need tensor data in every format fuselane reads. `quantize`
encodes given values in the simple formats by delegating to `gguf.quants` (llama.cpp's own Python port),
so our bytes are the bytes llama.cpp's tools would write. `random_blocks` makes blocks for any format
straight from random bytes, which is fast enough for 8B-shaped files: every packed bit pattern is valid,
so only the float scale and minimum fields need choosing, and they are chosen so the decoded values are
finite and of a weight-like size.
"""

from __future__ import annotations

import functools
from statistics import NormalDist

import numpy as np
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from fuselane.errors import GgufError
from fuselane.gguf.formats import IQ1M_SCALE_NIBBLES, LAYOUTS, Field, FieldKind, Format

_QUANTIZABLE = (
    Format.F32,
    Format.F16,
    Format.BF16,
    Format.Q8_0,
    Format.Q4_0,
    Format.Q4_1,
    Format.Q5_0,
    Format.Q5_1,
)

# Per quantized format: (rms, min_factor). A block's MIN field is min_factor * d, which centres its
# values on zero on average (Q4_1 / Q5_1 add their minimum, so theirs is negative). rms is the
# root-mean-square of the decoded values of uniformly random blocks with d = 1 and that minimum,
# measured over 2^20 blocks; dividing the wanted size by it gives d.
_SYNTH: dict[Format, tuple[float, float]] = {
    Format.Q8_0: (73.9, 0.0),
    Format.Q4_0: (4.64, 0.0),
    Format.Q4_1: (4.61, -7.5),
    Format.Q5_0: (9.25, 0.0),
    Format.Q5_1: (9.23, -15.5),
    Format.Q2_K: (13.9, 1.5),
    Format.Q3_K: (43.4, 0.0),
    Format.Q4_K: (258.0, 7.5),
    Format.Q5_K: (527.0, 15.5),
    Format.Q6_K: (1370.0, 0.0),
    Format.IQ4_NL: (67.4, 0.0),
    Format.IQ4_XS: (1250.0, 0.0),
    Format.MXFP4: (5.85, 0.0),
    Format.IQ2_XXS: (53.4, 0.0),
    Format.IQ2_XS: (55.9, 0.0),
    Format.IQ2_S: (56.4, 0.0),
    Format.IQ3_XXS: (142.0, 0.0),
    Format.IQ3_S: (140.0, 0.0),
    Format.IQ1_S: (7.21, 0.0),
    Format.IQ1_M: (7.20, 0.0),
    Format.TQ1_0: (0.817, 0.0),
    Format.TQ2_0: (0.707, 0.0),  # its codes made ternary (`_ternary`): 0 half the time, -1 and 1 a quarter each
}

# d is drawn from [1 - JITTER, 1 + JITTER] times its target, so blocks differ but the size barely moves
JITTER = 0.25
_F16_TINY = 2.0**-24  # the smallest positive f16: a tiny `scale` still gives d > 0
_LEVELS = 1 << 16


def quantize(values: np.ndarray, fmt: Format | int) -> np.ndarray:
    """Encode `values` (last axis whole blocks) in `fmt`; returns the tensor's bytes as 1-D uint8.

    Supports F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, with llama.cpp's rounding (via
    `gguf.quants`). Raises GgufError for another format or a last axis that is not whole blocks.
    """
    try:
        fmt = Format(fmt)
    except ValueError:
        raise GgufError(f"cannot quantize to ggml type {fmt}: fuselane does not know it") from None
    if fmt not in _QUANTIZABLE:
        raise GgufError(f"cannot quantize to {fmt.name}: only {', '.join(f.name for f in _QUANTIZABLE)}")
    values = np.asarray(values)
    block = LAYOUTS[fmt].values
    if values.ndim == 0 or values.shape[-1] % block:
        raise GgufError(f"cannot quantize shape {values.shape} to {fmt.name}: rows must be whole blocks of {block}")
    if fmt is Format.F32:
        data = values.astype("<f4")
    elif fmt is Format.F16:
        data = values.astype("<f2")
    else:
        data = gguf_quantize(values, GGMLQuantizationType(int(fmt)))
    return np.ascontiguousarray(data).view(np.uint8).reshape(-1)


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    # full-range 64-bit draws are the fastest uniform bytes a Generator gives (~8x uint8 draws)
    words = rng.integers(0, np.iinfo(np.uint64).max, size=-(-n // 8), dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:n]


@functools.cache
def _normal_quantiles() -> np.ndarray:
    """The standard normal's quantiles at the midpoints of 2^16 equal-probability bins, ascending."""
    inv = NormalDist().inv_cdf
    return np.array([inv((i + 0.5) / _LEVELS) for i in range(_LEVELS)])


def _random_values(fmt: Format, n: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    # Drawing a uniform 16-bit index into a table of normal quantiles is a normal sample at 2^16 levels
    # (enough for weights) at the cost of a gather; numpy's f16 conversion and normal draws are ~10x slower.
    values = (_normal_quantiles() * scale).astype(np.float32)
    if fmt is Format.F32:
        table = values.view(np.uint32)
    elif fmt is Format.F16:
        table = values.astype("<f2").view(np.uint16)
    else:  # BF16: the f32 bits rounded to nearest even on the 16 that are dropped (the values are finite)
        bits = values.view(np.uint32)
        table = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(
            np.uint16
        )
    index = _random_bytes(rng, 2 * n).view("<u2")
    out = np.empty(n, dtype=table.dtype)
    step = 1 << 20  # take() widens the indices to intp: a chunk at a time keeps that copy small
    for start in range(0, n, step):
        np.take(table, index[start : start + step], out=out[start : start + step])
    return out.view(np.uint8)


def _field_view(blocks: np.ndarray, f: Field) -> np.ndarray:
    return blocks[:, f.offset : f.offset + f.nbytes].view(f.dtype)


def _iq1m_scale(scales: np.ndarray, d: np.ndarray) -> None:
    """IQ1_M's d (n, 1) f16 into the top nibbles of its four scale words (n, 4), the first word the lowest."""
    bits = d.view(np.uint16)
    nibble = np.uint16(16 // IQ1M_SCALE_NIBBLES)
    scales &= np.uint16(0x0FFF)
    for i in range(IQ1M_SCALE_NIBBLES):
        scales[:, i] |= ((bits[:, 0] >> np.uint16(nibble * i)) & np.uint16(0xF)) << np.uint16(12)


def _ternary(codes: np.ndarray) -> None:
    """TQ2_0's 2-bit codes made ternary in place: code 3 (value 2d, which no ternary model has) becomes 1 (0)."""
    threes = (codes >> np.uint8(1)) & codes & np.uint8(0x55)  # the low bit of each 2-bit code that is 3
    codes ^= threes << np.uint8(1)


def random_blocks(fmt: Format, n_blocks: int, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """`n_blocks` random blocks of `fmt` as uint8 (n_blocks, block bytes), decoding to values of ~`scale`.

    Packed fields are uniform random bytes. Scale fields are positive finite f16 numbers (for MXFP4 an
    e8m0 exponent) chosen so the decoded values' root-mean-square is about `scale`; minimum fields are
    set to centre the values near zero. Unquantized formats hold normal(0, scale) values. Fast: a few
    seconds for gigabytes of blocks.
    """
    fmt = Format(fmt)
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"random_blocks needs a positive finite scale, not {scale}")
    lay = LAYOUTS[fmt]
    if lay.fields[0].kind is FieldKind.VALUES:
        return _random_values(fmt, n_blocks * lay.values, rng, scale).reshape(n_blocks, lay.nbytes)
    blocks = _random_bytes(rng, n_blocks * lay.nbytes).reshape(n_blocks, lay.nbytes)
    rms, min_factor = _SYNTH[fmt]
    target = rng.random((n_blocks, 1), dtype=np.float32)
    target *= np.float32(2 * JITTER * scale / rms)
    target += np.float32((1 - JITTER) * scale / rms)
    if fmt is Format.MXFP4:
        # decoded values are 2^(e - 128) * code, so the exponent is a rounded log2 of the wanted step
        e = np.rint(np.log2(target)) + 128
        _field_view(blocks, lay.field("e"))[:] = np.clip(e, 0, 254).astype(np.uint8)
        return blocks
    d = np.maximum(target, np.float32(_F16_TINY)).astype(np.float16)
    if fmt is Format.IQ1_M:
        _iq1m_scale(_field_view(blocks, lay.field("scales")).view("<u2"), d)
    if fmt is Format.TQ2_0:
        _ternary(_field_view(blocks, lay.field("qs")))
    for f in lay.fields:
        if f.kind is FieldKind.SCALE:
            _field_view(blocks, f)[:] = d
        elif f.kind is FieldKind.MIN:
            _field_view(blocks, f)[:] = (np.float32(min_factor) * d.astype(np.float32)).astype(np.float16)
    return blocks
