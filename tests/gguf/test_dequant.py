"""Dequantization equals `gguf.quants.dequantize` bit for bit, for every format fuselane reads.

No tolerance is needed anywhere: every product of an f16 scale (11 significant bits) with a sub-scale
and a code (an integer below 2^12) is exact in float32, and the formats with a minimum add the same two
float32 operands as gguf, so the comparisons are on the bit patterns, signs of zero included.
Inputs are both `random_blocks` (weight-like) and raw random bytes with only the f16 scale fields made
finite (subnormal, negative and huge scales, every packed bit pattern).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fuselane.errors import GgufError
from fuselane.gguf import dequant
from fuselane.gguf.dequant import dequantize, dequantize_rows
from fuselane.gguf.formats import GRID_FORMATS, IQ4_NL_VALUES, LAYOUTS, MXFP4_VALUES, FieldKind, Format, row_bytes
from fuselane.gguf.quantize import quantize, random_blocks

ALL = list(Format)
QUANTIZED = [f for f in Format if LAYOUTS[f].fields[0].kind is not FieldKind.VALUES]
QUANTIZABLE = [
    Format.F32,
    Format.F16,
    Format.BF16,
    Format.Q8_0,
    Format.Q4_0,
    Format.Q4_1,
    Format.Q5_0,
    Format.Q5_1,
]
FEW = settings(max_examples=12, deadline=None)


def _noise(fmt: Format, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes as (n_blocks, nbytes) blocks, with every float field's inf/NaN exponents made finite."""
    lay = LAYOUTS[fmt]
    blocks = rng.integers(0, 256, (n_blocks, lay.nbytes), dtype=np.uint8)
    top = {"<f2": (np.uint16, 0x7C00, 0x4000), "<f4": (np.uint32, 0x7F800000, 0x40000000)}
    if fmt is Format.BF16:
        top["<u2"] = (np.uint16, 0x7F80, 0x4000)
    for f in lay.fields:
        if f.dtype in top:
            kind, exp, flip = top[f.dtype]
            bits = blocks[:, f.offset : f.offset + f.nbytes].view(kind.__name__)
            # an all-ones exponent (inf / NaN) loses its top bit: finite, same sign and mantissa
            bits[(bits & kind(exp)) == kind(exp)] ^= kind(flip)
    return blocks


def _blocks(fmt: Format, n_blocks: int, seed: int, source: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return random_blocks(fmt, n_blocks, rng) if source == "synth" else _noise(fmt, n_blocks, rng)


def _reference(raw: np.ndarray, fmt: Format, shape: tuple[int, ...]) -> np.ndarray:
    data = raw.reshape(*shape[:-1], row_bytes(fmt, shape[-1]))
    with np.errstate(over="ignore", invalid="ignore"):  # MXFP4: inf from its top exponents; IQ1_M: NaN d
        out = np.asarray(gguf_quants.dequantize(data, GGMLQuantizationType(int(fmt))), dtype=np.float32)
    assert out.shape == shape
    return out


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# --- layouts ---


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_layout_matches_ggml(fmt: Format) -> None:
    qtype = GGMLQuantizationType(int(fmt))
    assert qtype.name == fmt.name
    lay = LAYOUTS[fmt]
    assert (lay.values, lay.nbytes) == GGML_QUANT_SIZES[qtype]
    ends = [f.offset + f.nbytes for f in lay.fields]
    assert [f.offset for f in lay.fields] == [0, *ends[:-1]] and ends[-1] == lay.nbytes


def test_code_tables_match_gguf() -> None:
    assert IQ4_NL_VALUES == gguf_quants.IQ4_NL.kvalues
    assert MXFP4_VALUES == gguf_quants.MXFP4.kvalues


# A grid or ternary block of all-zero codes at d = 1: every value is the first entry of llama.cpp's table for
# the format (ggml-common.h: iq2xxs/iq2xs/iq2s_grid[0] eight 8s, iq3xxs_grid[0] four 4s, iq3s_grid[0] four 1s,
# iq1s_grid[0] eight -1s) times the zero scale's step (IQ2: (0.5 + 0) / 4, IQ3_XXS: (0.5 + 0) / 2, IQ3_S and
# IQ1: 2 * 0 + 1), IQ1's + 1/8 delta added; a ternary digit 0 is -1. Independent of gguf: it checks where each
# layout puts d and that the decoder reads the format named.
ZERO_CODE_VALUES = {
    Format.IQ2_XXS: 1.0,
    Format.IQ2_XS: 1.0,
    Format.IQ2_S: 1.0,
    Format.IQ3_XXS: 1.0,
    Format.IQ3_S: 1.0,
    Format.IQ1_S: -0.875,
    Format.IQ1_M: -0.875,
    Format.TQ1_0: -1.0,
    Format.TQ2_0: -1.0,
}


@pytest.mark.parametrize("fmt", sorted(GRID_FORMATS), ids=lambda f: f.name)
def test_zero_codes_decode_to_the_tables_first_entry(fmt: Format) -> None:
    lay = LAYOUTS[fmt]
    block = np.zeros((1, lay.nbytes), np.uint8)
    one = np.array([1.0], np.float16).view(np.uint16)
    if fmt is Format.IQ1_M:  # d's four nibbles are the top ones of the four scale words
        words = block[:, lay.field("scales").offset :].view("<u2")
        words[0] = [((int(one[0]) >> (4 * i)) & 0xF) << 12 for i in range(4)]
    else:
        block[:, lay.field("d").offset :][:, :2].view("<f2")[:] = 1.0
    assert set(dequantize(block.reshape(-1), fmt, (lay.values,)).tolist()) == {ZERO_CODE_VALUES[fmt]}


@pytest.mark.parametrize("fmt", sorted(GRID_FORMATS), ids=lambda f: f.name)
def test_grid_formats_match_gguf_at_every_table_row(fmt: Format) -> None:
    # 4,096 blocks of random codes reach each grid row (at most 2,048) with each sign pattern many times over
    lay = LAYOUTS[fmt]
    shape = (16, 256 * lay.values)
    raw = _blocks(fmt, 4096, 11, "noise").reshape(-1)
    assert _same_bits(dequantize(raw, fmt, shape), _reference(raw, fmt, shape))


# --- equality with gguf ---


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@FEW
@given(
    rows=st.integers(1, 6),
    blocks_per_row=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    source=st.sampled_from(["synth", "noise"]),
)
def test_matches_gguf(fmt: Format, rows: int, blocks_per_row: int, seed: int, source: str) -> None:
    lay = LAYOUTS[fmt]
    shape = (rows, blocks_per_row * lay.values)
    raw = _blocks(fmt, rows * blocks_per_row, seed, source).reshape(-1)
    ours = dequantize(raw, fmt, shape)
    assert _same_bits(ours, _reference(raw, fmt, shape))
    if source == "synth":
        assert np.isfinite(ours).all()


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_matches_gguf_across_chunks(fmt: Format, monkeypatch: pytest.MonkeyPatch) -> None:
    # a chunk of 7 blocks does not divide the 3 x 10 blocks: rows and chunks cut across each other
    lay = LAYOUTS[fmt]
    monkeypatch.setattr(dequant, "CHUNK_BYTES", 7 * lay.nbytes)
    shape = (2, 3, 10 * lay.values)
    raw = _blocks(fmt, 60, 7, "noise").reshape(-1)
    assert _same_bits(dequantize(raw, fmt, shape), _reference(raw, fmt, shape))


@pytest.mark.parametrize("fmt", [Format.F32, Format.F16, Format.BF16], ids=lambda f: f.name)
def test_unquantized_pass_nonfinite_bits_through(fmt: Format) -> None:
    raw = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
    shape = (raw.size // LAYOUTS[fmt].nbytes,)
    assert _same_bits(dequantize(raw, fmt, shape), _reference(raw, fmt, shape))


def test_reads_a_memmap(tmp_path) -> None:
    blocks = random_blocks(Format.Q4_K, 40, np.random.default_rng(5))
    path = tmp_path / "t.bin"
    blocks.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    shape = (8, 5 * 256)
    assert _same_bits(dequantize(mapped, Format.Q4_K, shape), dequantize(blocks.reshape(-1), Format.Q4_K, shape))


def test_empty_tensor() -> None:
    out = dequantize(np.zeros(0, np.uint8), Format.Q4_0, (0, 64))
    assert out.shape == (0, 64) and out.dtype == np.float32


# --- rows, dtypes ---


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@FEW
@given(data=st.data(), n_rows=st.integers(1, 9), blocks_per_row=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_rows_equal_whole_tensor_rows(
    fmt: Format, data: st.DataObject, n_rows: int, blocks_per_row: int, seed: int
) -> None:
    shape = (n_rows, blocks_per_row * LAYOUTS[fmt].values)
    raw = _blocks(fmt, n_rows * blocks_per_row, seed, "noise").reshape(-1)
    rows = data.draw(st.lists(st.integers(0, n_rows - 1), max_size=12))
    full = dequantize(raw, fmt, shape)
    assert _same_bits(dequantize_rows(raw, fmt, shape, rows), full[np.asarray(rows, dtype=np.int64)])
    grid = np.array([[n_rows - 1, 0], [0, 0]])  # index arrays keep their shape, like numpy's take
    assert _same_bits(dequantize_rows(raw, fmt, shape, grid), full[grid])


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_float64_is_float32_widened(fmt: Format) -> None:
    lay = LAYOUTS[fmt]
    shape = (5, 2 * lay.values)
    raw = _blocks(fmt, 10, 11, "noise").reshape(-1)
    f32 = dequantize(raw, fmt, shape)
    f64 = dequantize(raw, fmt, shape, dtype=np.float64)
    assert f64.dtype == np.float64
    assert np.array_equal(f64.view(np.uint64), f32.astype(np.float64).view(np.uint64))
    rows = dequantize_rows(raw, fmt, shape, [4, 1], dtype=np.float64)
    assert np.array_equal(rows.view(np.uint64), f32[[4, 1]].astype(np.float64).view(np.uint64))


# --- errors ---


def test_bad_inputs_raise_gguf_error() -> None:
    raw = random_blocks(Format.Q4_0, 4, np.random.default_rng(0)).reshape(-1)  # 4 blocks = (2, 64)
    for bad in (raw[:-1], np.concatenate([raw, raw[:1]])):
        with pytest.raises(GgufError, match="needs 72 bytes"):
            dequantize(bad, Format.Q4_0, (2, 64))
    with pytest.raises(GgufError, match="whole blocks of 32"):
        dequantize(raw, Format.Q4_0, (4, 36))
    with pytest.raises(GgufError, match="whole blocks of 256"):
        dequantize(np.zeros(144, np.uint8), Format.Q4_K, (128,))
    with pytest.raises(GgufError, match="shape"):
        dequantize(raw, Format.Q4_0, ())
    with pytest.raises(GgufError, match="uint8"):
        dequantize(raw.view(np.int8), Format.Q4_0, (2, 64))
    with pytest.raises(GgufError, match="Q8_K"):
        dequantize(raw, GGMLQuantizationType.Q8_K, (2, 64))
    with pytest.raises(GgufError, match="99"):
        dequantize(raw, 99, (2, 64))
    with pytest.raises(GgufError, match="out of range"):
        dequantize_rows(raw, Format.Q4_0, (2, 64), [0, 2])
    with pytest.raises(GgufError, match="out of range"):
        dequantize_rows(raw, Format.Q4_0, (2, 64), [-1])
    with pytest.raises(GgufError, match="2-D"):
        dequantize_rows(raw, Format.Q4_0, (1, 2, 64), [0])


# --- random_blocks, quantize ---


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("scale", [0.02, 1.0])
def test_random_blocks_have_the_intended_size(fmt: Format, scale: float) -> None:
    lay = LAYOUTS[fmt]
    n = 8192 if lay.values == 1 else 65536 // lay.values
    blocks = random_blocks(fmt, n, np.random.default_rng(1), scale=scale)
    assert blocks.dtype == np.uint8 and blocks.shape == (n, lay.nbytes)
    again = random_blocks(fmt, n, np.random.default_rng(1), scale=scale)
    assert np.array_equal(blocks, again)
    values = dequantize(blocks.reshape(-1), fmt, (n * lay.values,)).astype(np.float64)
    assert np.isfinite(values).all()
    rms = np.sqrt(np.mean(values**2))
    assert 0.8 * scale < rms < 1.25 * scale, rms
    assert abs(values.mean()) < 0.15 * scale
    for f in lay.fields:
        if f.kind is FieldKind.SCALE and f.dtype == "<f2":
            assert (blocks[:, f.offset : f.offset + 2].view("<f2") > 0).all()


@pytest.mark.parametrize("fmt", QUANTIZABLE, ids=lambda f: f.name)
@FEW
@given(rows=st.integers(1, 4), blocks_per_row=st.integers(1, 3), seed=st.integers(0, 2**16))
@example(rows=2, blocks_per_row=3, seed=536)  # a Q5_0 block whose clipped code misses by a step and d's rounding
def test_quantize_matches_gguf_and_round_trips(fmt: Format, rows: int, blocks_per_row: int, seed: int) -> None:
    lay = LAYOUTS[fmt]
    shape = (rows, blocks_per_row * 32)  # 32: whole blocks of every quantizable format
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    raw = quantize(x, fmt)
    assert raw.dtype == np.uint8 and raw.shape == (rows * row_bytes(fmt, shape[1]),)
    expected = gguf_quants.quantize(x, GGMLQuantizationType(int(fmt)))
    assert np.array_equal(raw, np.ascontiguousarray(expected).view(np.uint8).reshape(-1))
    err = np.abs(dequantize(raw, fmt, shape) - x).reshape(-1, lay.values)
    if fmt is Format.F32:
        assert not err.any()
    elif lay.values == 1:
        rel = 2.0**-11 if fmt is Format.F16 else 2.0**-8  # half an ulp of an 11- or 8-bit significand
        # below f16's smallest normal (2^-14) the step is fixed: half of the smallest subnormal, 2^-25
        floor = 2.0**-25 if fmt is Format.F16 else 0.0
        assert (err <= np.maximum(rel * np.abs(x).reshape(err.shape), floor)).all()
    else:
        d = np.abs(raw.reshape(-1, lay.nbytes)[:, :2].view("<f2").astype(np.float32))
        # Q8_0 rounds to the nearest code: half a step, plus up to 127 codes times the f16 rounding of d;
        # the 4/5-bit formats truncate x/d + 0.5 and clip the top code, so they may miss by a whole step,
        # plus up to 16 codes times that rounding
        bound = d * (0.5 + 127 * 2.0**-11) if fmt is Format.Q8_0 else d * (1 + 16 * 2.0**-11)
        assert (err <= bound * (1 + 1e-6)).all()


def test_quantize_refuses_what_it_cannot_do() -> None:
    with pytest.raises(GgufError, match="Q4_K"):
        quantize(np.zeros(256, np.float32), Format.Q4_K)
    with pytest.raises(GgufError, match="whole blocks of 32"):
        quantize(np.zeros((2, 40), np.float32), Format.Q8_0)
