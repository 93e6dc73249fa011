"""Dequantize GGUF tensors to floats with vectorised NumPy.

The reference path of fuselane: the CPU runtime, the tests and the GPU kernels' checks all need a tensor's
float values, and they must be the values llama.cpp (and `gguf.quants`) would compute, bit for bit. Each
format is one small function that decodes a batch of blocks with whole-array operations; the driver walks
a tensor in chunks of blocks so that the temporaries stay a few MiB however large the tensor is, and writes
straight into the preallocated result. Field offsets come from `formats.LAYOUTS`, never from numbers here.
The grid and ternary formats (`formats.GRID_FORMATS`: IQ1_*, IQ2_*, IQ3_*, TQ*) decode in `dequant_grid`, from
`gguf.quants`' value grids; only the cpu lane reads them.

Why the results equal gguf's bit for bit: every product is exact in float32 (an f16 scale has 11
significant bits, and sub-scale times code is an integer below 2^12), so only the one addition of the
formats with a minimum rounds, and each decoder adds the same two float32 operands gguf does. Keep it so
when editing: fold a minimum into a product, or add before multiplying, and the last bit can differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import DTypeLike

from fuselane.errors import GgufError
from fuselane.gguf.block_views import Decoder
from fuselane.gguf.block_views import field as _field
from fuselane.gguf.block_views import nibbles as _nibbles
from fuselane.gguf.block_views import scale as _scale
from fuselane.gguf.dequant_grid import DECODERS as GRID_DECODERS
from fuselane.gguf.formats import (
    IQ4_NL_VALUES,
    LAYOUTS,
    MXFP4_VALUES,
    BlockLayout,
    Format,
    row_bytes,
    tensor_bytes,
)

# Bytes of blocks decoded per step: bounds the temporaries (codes, scales: a few MiB; the output, up to
# 7x the input, is written in place) while keeping the ~10 NumPy calls a step makes a negligible cost.
# Throughput is flat from 256 KiB to 16 MiB on a 2-core Xeon.
CHUNK_BYTES = 1 << 20

_DECODERS: dict[Format, Decoder] = {}
_IQ4_NL_TABLE = np.array(IQ4_NL_VALUES, dtype=np.int8)
_MXFP4_TABLE = np.array(MXFP4_VALUES, dtype=np.int8)
_SHIFT_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
_SHIFT_1BIT = np.arange(8, dtype=np.uint8).reshape(8, 1)


def _decoder(fmt: Format) -> Callable[[Decoder], Decoder]:
    def register(fn: Decoder) -> Decoder:
        _DECODERS[fmt] = fn
        return fn

    return register


def _crumbs(qs: np.ndarray, group: int) -> np.ndarray:
    """Bytes (n, k * group) as 2-bit codes (n, k, 4, group): bits 0-1 of each group, then 2-3, 4-5, 6-7."""
    g = np.ascontiguousarray(qs).reshape(qs.shape[0], -1, 1, group)
    return (g >> _SHIFT_2BIT) & np.uint8(3)


def _bit_planes(qh: np.ndarray) -> np.ndarray:
    """Bytes (n, 32) as bits (n, 8, 32): plane b holds bit b of every byte."""
    return (np.ascontiguousarray(qh)[:, None, :] >> _SHIFT_1BIT) & np.uint8(1)


def _signed(codes: np.ndarray, offset: int) -> np.ndarray:
    """Unsigned codes minus `offset`, in place, read as int8 (the codes and offsets all fit)."""
    np.subtract(codes, np.uint8(offset), out=codes)
    return codes.view(np.int8)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 packed bytes as 8 six-bit scales and 8 six-bit mins, each (n, 8) uint8."""
    # bytes 0-3: scales 0-3 (low 6 bits) + high bits of scales 4-7; bytes 4-7: the same for the mins;
    # bytes 8-11: low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=1)
    return sc, mn


# --- unquantized ---


@_decoder(Format.F32)
def _f32(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = blocks.view("<f4")


@_decoder(Format.F16)
def _f16(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = blocks.view("<f2")


@_decoder(Format.BF16)
def _bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    # bf16 is the high half of an f32: shifting the bits keeps every value, NaN payloads included
    np.left_shift(blocks.view("<u2"), 16, out=out.view(np.uint32), dtype=np.uint32)


# --- 32-value blocks ---

_Q8_0, _Q4_0, _Q4_1 = LAYOUTS[Format.Q8_0], LAYOUTS[Format.Q4_0], LAYOUTS[Format.Q4_1]
_Q5_0, _Q5_1 = LAYOUTS[Format.Q5_0], LAYOUTS[Format.Q5_1]
_IQ4_NL, _MXFP4 = LAYOUTS[Format.IQ4_NL], LAYOUTS[Format.MXFP4]


@_decoder(Format.Q8_0)
def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_field(blocks, _Q8_0, "qs"), _scale(blocks, _Q8_0), out=out)


@_decoder(Format.Q4_0)
def _q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    codes = _signed(_nibbles(_field(blocks, _Q4_0, "qs"), 16), 8)
    np.multiply(codes.reshape(out.shape), _scale(blocks, _Q4_0), out=out)


@_decoder(Format.Q4_1)
def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    codes = _nibbles(_field(blocks, _Q4_1, "qs"), 16)
    np.multiply(codes.reshape(out.shape), _scale(blocks, _Q4_1), out=out)
    np.add(out, _scale(blocks, _Q4_1, "m"), out=out)


def _q5_codes(blocks: np.ndarray, lay: BlockLayout) -> np.ndarray:
    """Q5_0 / Q5_1: the 5-bit codes (n, 32); qh is a little-endian u32 whose bit j is value j's top bit."""
    codes = _nibbles(_field(blocks, lay, "qs"), 16).reshape(blocks.shape[0], 32)
    high = np.unpackbits(_field(blocks, lay, "qh"), axis=1, bitorder="little")
    codes |= high << np.uint8(4)
    return codes


@_decoder(Format.Q5_0)
def _q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    codes = _signed(_q5_codes(blocks, _Q5_0), 16)
    np.multiply(codes, _scale(blocks, _Q5_0), out=out)


@_decoder(Format.Q5_1)
def _q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_q5_codes(blocks, _Q5_1), _scale(blocks, _Q5_1), out=out)
    np.add(out, _scale(blocks, _Q5_1, "m"), out=out)


@_decoder(Format.IQ4_NL)
def _iq4_nl(blocks: np.ndarray, out: np.ndarray) -> None:
    values = np.take(_IQ4_NL_TABLE, _nibbles(_field(blocks, _IQ4_NL, "qs"), 16))  # 2x faster than []
    np.multiply(_scale(blocks, _IQ4_NL), values.reshape(out.shape), out=out)


@_decoder(Format.MXFP4)
def _mxfp4(blocks: np.ndarray, out: np.ndarray) -> None:
    e = _field(blocks, _MXFP4, "e").astype(np.uint32)
    # e8m0 2^(e-127), halved because the table is doubled; e < 2 halves into an f32 subnormal
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    values = np.take(_MXFP4_TABLE, _nibbles(_field(blocks, _MXFP4, "qs"), 16))
    with np.errstate(over="ignore"):  # the top exponents overflow to inf, as they do in ggml
        np.multiply(bits.view(np.float32), values.reshape(out.shape), out=out)


# --- 256-value super-blocks ---

_Q2_K, _Q3_K, _Q4_K = LAYOUTS[Format.Q2_K], LAYOUTS[Format.Q3_K], LAYOUTS[Format.Q4_K]
_Q5_K, _Q6_K, _IQ4_XS = LAYOUTS[Format.Q5_K], LAYOUTS[Format.Q6_K], LAYOUTS[Format.IQ4_XS]


@_decoder(Format.Q2_K)
def _q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    packed = _field(blocks, _Q2_K, "scales")
    dl = (_scale(blocks, _Q2_K) * (packed & 0x0F)).reshape(n, 16, 1)
    ml = (_scale(blocks, _Q2_K, "dmin") * (packed >> 4)).reshape(n, 16, 1)
    sub = out.reshape(n, 16, 16)
    np.multiply(dl, _crumbs(_field(blocks, _Q2_K, "qs"), 32).reshape(n, 16, 16), out=sub)
    np.subtract(sub, ml, out=sub)


@_decoder(Format.Q3_K)
def _q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    packed = _field(blocks, _Q3_K, "scales")
    # 16 six-bit scales: low 4 bits in bytes 0-7 (low nibbles first), high 2 bits in bytes 8-11
    low = _nibbles(packed[:, :8], 8).reshape(n, 16)
    high = _crumbs(packed[:, 8:], 4).reshape(n, 16)
    scales = _signed(low | (high << np.uint8(4)), 32)
    dl = (_scale(blocks, _Q3_K) * scales).reshape(n, 16, 1)
    # a clear hmask bit means the 2-bit code is 4 lower: code = (low | hbit << 2) - 4
    codes = _crumbs(_field(blocks, _Q3_K, "qs"), 32).reshape(n, 256)
    codes |= _bit_planes(_field(blocks, _Q3_K, "hmask")).reshape(n, 256) << np.uint8(2)
    np.multiply(dl, _signed(codes, 4).reshape(n, 16, 16), out=out.reshape(n, 16, 16))


def _k_affine(blocks: np.ndarray, lay: BlockLayout, codes: np.ndarray, out: np.ndarray) -> None:
    """Q4_K / Q5_K: value = d * scale * code - dmin * min, per sub-block of 32."""
    n = blocks.shape[0]
    sc, mn = _k_scale_min(_field(blocks, lay, "scales"))
    d = (_scale(blocks, lay) * sc).reshape(n, 8, 1)
    dm = (_scale(blocks, lay, "dmin") * mn).reshape(n, 8, 1)
    sub = out.reshape(n, 8, 32)
    np.multiply(d, codes.reshape(n, 8, 32), out=sub)
    np.subtract(sub, dm, out=sub)


@_decoder(Format.Q4_K)
def _q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    _k_affine(blocks, _Q4_K, _nibbles(_field(blocks, _Q4_K, "qs"), 32), out)


@_decoder(Format.Q5_K)
def _q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    codes = _nibbles(_field(blocks, _Q5_K, "qs"), 32).reshape(n, 8, 32)
    # sub-block b takes its fifth bit from bit b of the 32 qh bytes
    codes |= _bit_planes(_field(blocks, _Q5_K, "qh")) << np.uint8(4)
    _k_affine(blocks, _Q5_K, codes, out)


@_decoder(Format.Q6_K)
def _q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    # each half of 128 values: ql gives 64 bytes of nibbles, qh 32 bytes of four 2-bit top parts
    codes = _nibbles(_field(blocks, _Q6_K, "ql"), 64).reshape(n, 256)
    codes |= _crumbs(_field(blocks, _Q6_K, "qh"), 32).reshape(n, 256) << np.uint8(4)
    d = (_scale(blocks, _Q6_K) * _field(blocks, _Q6_K, "scales")).reshape(n, 16, 1)
    np.multiply(d, _signed(codes, 32).reshape(n, 16, 16), out=out.reshape(n, 16, 16))


@_decoder(Format.IQ4_XS)
def _iq4_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    # 8 six-bit scales: low 4 bits as nibbles of scales_l, high 2 bits as pairs of the u16 scales_h
    low = _nibbles(_field(blocks, _IQ4_XS, "scales_l"), 1).reshape(n, 8)
    shifts = np.arange(0, 16, 2, dtype=np.uint16)
    high = ((_field(blocks, _IQ4_XS, "scales_h") >> shifts) & 3).astype(np.uint8)
    dl = (_scale(blocks, _IQ4_XS) * _signed(low | (high << np.uint8(4)), 32)).reshape(n, 8, 1)
    values = np.take(_IQ4_NL_TABLE, _nibbles(_field(blocks, _IQ4_XS, "qs"), 16))
    np.multiply(dl, values.reshape(n, 8, 32), out=out.reshape(n, 8, 32))


_DECODERS.update(GRID_DECODERS)  # the grid and ternary formats (`dequant_grid`)


# --- drivers ---


def _resolve(fmt: Format | int) -> tuple[Format, BlockLayout, Decoder]:
    try:
        fmt = Format(fmt)
        return fmt, LAYOUTS[fmt], _DECODERS[fmt]
    except (ValueError, KeyError):
        name = getattr(fmt, "name", None) or f"ggml type {fmt}"
        raise GgufError(f"cannot dequantize tensor format {name}: fuselane does not read it") from None


def _check_shape(fmt: Format, lay: BlockLayout, shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if not shape or min(shape) < 0:
        raise GgufError(f"bad {fmt.name} tensor shape {shape}: need one or more non-negative dimensions")
    if shape[-1] % lay.values:
        raise GgufError(f"bad {fmt.name} tensor shape {shape}: rows must be whole blocks of {lay.values} values")
    return shape


def _check_dtype(dtype: DTypeLike) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.float32, np.float64):
        raise ValueError(f"dequantize to float32 or float64, not {dt}")
    return dt


def _as_bytes(raw: np.ndarray, fmt: Format, shape: tuple[int, ...], expected: int) -> np.ndarray:
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 1:
        raise GgufError(f"{fmt.name} tensor data must be a 1-D uint8 array")
    if raw.size != expected:
        raise GgufError(f"{fmt.name} tensor of shape {shape} needs {expected} bytes, got {raw.size}")
    return raw


def _decode_blocks(decode: Decoder, lay: BlockLayout, blocks: np.ndarray, out: np.ndarray) -> None:
    """Decode blocks (n, nbytes) into out (n, values) of float32 or float64, a chunk at a time."""
    step = max(1, CHUNK_BYTES // lay.nbytes)
    scratch = None if out.dtype == np.float32 else np.empty((min(step, len(out)), lay.values), np.float32)
    for start in range(0, len(out), step):
        chunk = blocks[start : start + step]
        if scratch is None:
            decode(chunk, out[start : start + step])
        else:
            # f64 output is the f32 result widened: compute in f32 so both are the same values
            decode(chunk, scratch[: len(chunk)])
            out[start : start + step] = scratch[: len(chunk)]


def dequantize(raw: np.ndarray, fmt: Format | int, shape: Sequence[int], dtype: DTypeLike = np.float32) -> np.ndarray:
    """Decode a whole tensor.

    `raw` is the tensor's bytes as a 1-D uint8 array (a memmap slice is read in chunks, never copied whole);
    `shape` is in numpy order, its last axis a row of whole blocks. Returns a new array of `shape` in
    `dtype` (float32, or float64 holding exactly the float32 values). Raises GgufError for a format
    fuselane does not read, a shape that is not whole blocks, or a byte count that does not fit the shape.
    """
    fmt, lay, decode = _resolve(fmt)
    shape = _check_shape(fmt, lay, shape)
    dt = _check_dtype(dtype)
    raw = _as_bytes(raw, fmt, shape, tensor_bytes(fmt, shape))
    out = np.empty(shape, dtype=dt)
    _decode_blocks(decode, lay, raw.reshape(-1, lay.nbytes), out.reshape(-1, lay.values))
    return out


def dequantize_rows(
    raw: np.ndarray,
    fmt: Format | int,
    shape: Sequence[int],
    rows: np.ndarray | Sequence[int],
    dtype: DTypeLike = np.float32,
) -> np.ndarray:
    """Decode only `rows` (indices along the first axis) of a 2-D tensor, like `dequantize(...)[rows]`.

    The result has shape `rows.shape + (shape[1],)`. Reads just those rows' bytes, so gathering a few
    embedding rows of a large table stays cheap. Rows may repeat and come in any order; an index out of
    range raises GgufError, as do the errors of `dequantize`.
    """
    fmt, lay, decode = _resolve(fmt)
    shape = _check_shape(fmt, lay, shape)
    if len(shape) != 2:
        raise GgufError(f"dequantize_rows needs a 2-D tensor, got shape {shape}")
    dt = _check_dtype(dtype)
    raw = _as_bytes(raw, fmt, shape, tensor_bytes(fmt, shape))
    idx = np.asarray(rows)
    if idx.size and idx.dtype.kind not in "iu":
        raise GgufError(f"row indices of a {fmt.name} tensor must be integers, not {idx.dtype}")
    idx = idx.astype(np.int64, copy=False)
    if idx.size and (idx.min() < 0 or idx.max() >= shape[0]):
        raise GgufError(f"row index out of range for a {fmt.name} tensor of {shape[0]} rows")
    picked = raw.reshape(shape[0], row_bytes(fmt, shape[1]))[idx.reshape(-1)]
    out = np.empty((*idx.shape, shape[1]), dtype=dt)
    _decode_blocks(decode, lay, picked.reshape(-1, lay.nbytes), out.reshape(-1, lay.values))
    return out
