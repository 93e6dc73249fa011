"""The int8-activation decode GEMV (`gemv_q8`) and its quantizer (`quant`) against NumPy.

The quantizer's codes, scales and sums equal `quant.quantize_reference` bit for bit (the same f32 steps).
The products are checked against x_q @ dequantize(raw).T in f64, x_q the quantized activation's values: the
kernel's dp4a sums are exact integers, so only its f32 scale products and the f32 sum over runs round. Each
run's result is a code sum times two or three exact-in-f32 scale factors minus an offset term (Q4_K's
minimum, Q6_K's and Q5_0's code bias), each rounded a few times relative to its own size, then summed: within
gamma_(k + 8) times sum_i (|w_i| + |offset_i|) |x_i| of the exact value, offset_i the value a zero code decodes
to (Higham 3.1, as test_gemv_fast.py, with the offset split out because the kernel subtracts it apart).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kernel_checks import CUDA, DEVICE, check, dev, gamma, raw_weights  # noqa: E402

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import LAYOUTS, Format  # noqa: E402
from fuselane.lanes.cuda.triton import quant  # noqa: E402
from fuselane.lanes.cuda.triton.gemv import int8_words, q8_bodies, q8_tiles  # noqa: E402
from fuselane.lanes.cuda.triton.gemv import q8 as q8_module  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.q8 import gemv_q8, gemv_q8_gate_up_glu, gemv_q8_parts, supports  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.rows import Part  # noqa: E402

SUPER = (Format.Q4_K, Format.Q6_K, Format.Q5_K, Format.IQ4_XS, Format.Q3_K, Format.Q2_K)  # 256-value units
BLOCKS = (Format.Q8_0, Format.Q5_0, Format.Q4_0, Format.Q4_1, Format.Q5_1, Format.IQ4_NL, Format.MXFP4)  # 32 values
FORMATS = SUPER + BLOCKS
CODE_FIELDS = {
    Format.Q4_K: ("qs",), Format.Q6_K: ("ql", "qh"), Format.Q8_0: ("qs",), Format.Q5_0: ("qh", "qs"),
    Format.Q5_K: ("qh", "qs"), Format.Q4_0: ("qs",), Format.Q4_1: ("qs",), Format.Q5_1: ("qh", "qs"),
    Format.IQ4_NL: ("qs",), Format.IQ4_XS: ("qs",), Format.Q3_K: ("hmask", "qs"), Format.Q2_K: ("qs",),
    Format.MXFP4: ("qs",),
}  # fmt: skip
N = 37  # not whole tiles: rows past n are computed and dropped
# The formats added after the first four run fewer rows and widths: the interpreter's time is a program's
# loop, and the loop they share is the first four's (the IQ4 tables' emulated byte permutes cost the most)
NEWER = frozenset(SUPER[2:] + BLOCKS[2:])
ROWS = {f: 9 if f in NEWER else N for f in FORMATS}
KS = {f: (512, 768) for f in SUPER} | {f: (96, 320, 512) for f in BLOCKS}
KS |= {f: (512,) if f in SUPER else (96, 320) for f in NEWER}
# MXFP4's rows (17-byte blocks, its e after the row) end on 16 bytes at 16 blocks: the 128-bit loads there
KS[Format.MXFP4] = (96, 512)
ROUNDINGS = 8  # a run's scale products, its offset term and the epilogue's adds
SILU_SLOPE, GLU_ULPS = 1.1, 12  # as test_gemv_fast.py


def _zero_codes(raw: np.ndarray, fmt: Format) -> np.ndarray:
    """The same blocks with every code 0: each value decodes to its offset (minus the minimum or the bias)."""
    lay = LAYOUTS[fmt]
    blocks = raw.reshape(-1, lay.nbytes).copy()
    for name in CODE_FIELDS[fmt]:
        f = lay.field(name)
        blocks[:, f.offset : f.offset + f.nbytes] = 0
    return blocks.reshape(-1)


def _quantized(k: int, rng: np.random.Generator, m: int = 1):
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 4.0, (m, 1))).astype(np.float32)
    x[:, : quant.QK] = 0.0  # an all-zero block: scale 0, codes 0
    acts = quant.quantize(dev(x), quant.empty_q8(m, k, DEVICE))
    return x, acts


def _reference(acts, raw: np.ndarray, fmt: Format, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    xq = quant.dequantize(acts).cpu().double().numpy()
    w = dequantize(raw, fmt, (n, k), np.float64)
    off = dequantize(_zero_codes(raw, fmt), fmt, (n, k), np.float64)
    return xq @ w.T, np.abs(xq) @ (np.abs(w) + np.abs(off)).T


def test_quantize_matches_reference_bit_for_bit() -> None:
    rng = np.random.default_rng(5)
    x, acts = _quantized(1024 + 96, rng, m=3)
    codes, d, s = quant.quantize_reference(x)
    assert np.array_equal(acts.q.cpu().numpy(), codes)
    assert np.array_equal(acts.d.cpu().numpy(), d)
    assert np.array_equal(acts.s.cpu().numpy(), s)
    assert np.abs(codes).max() == 127 and not codes[:, :32].any()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_products(fmt: Format) -> None:
    n = ROWS[fmt]
    for k in KS[fmt]:
        rng = np.random.default_rng(int(fmt) * 1000 + k)
        raw = raw_weights(fmt, n, k, rng)
        _, acts = _quantized(k, rng)
        out = torch.full((1, n), float("nan"), device=DEVICE)
        assert gemv_q8(acts, dev(raw), fmt, n, k, out) is out
        want, scale = _reference(acts, raw, fmt, n, k)
        check(out, want, gamma(k + ROUNDINGS) * scale)


# k and a small tile (4 rows, one warp, one (row, group) a thread) that walk each row in several chunks, the
# last partial where the format's units allow
CHUNKED_K = {f: 1024 for f in SUPER} | {f: 800 for f in BLOCKS} | {f: 768 for f in NEWER if f in SUPER}
CHUNKED_K |= {f: 1792 for f in (Format.Q3_K, Format.Q2_K)}  # four groups a unit: two units a chunk, 3.5 chunks
SMALL_TILE = {"block_n": 4, "warps": 1, "per_thread": 1}
# the newer formats at the default depth and a program and a bit of rows (the loop at depth 1 is the same
# code for every format, and runs the first four)
DEPTHS = [(f, d) for f in FORMATS for d in ((2,) if f in NEWER else (1, 2))]


@pytest.mark.parametrize(("fmt", "depth"), DEPTHS, ids=lambda v: getattr(v, "name", str(v)))
def test_products_in_chunks_at_each_prefetch_depth(monkeypatch, fmt: Format, depth: int) -> None:
    monkeypatch.setattr(q8_module, "PREFETCH_DEPTH", depth)
    k, n = CHUNKED_K[fmt], 5 if fmt in NEWER else N
    plan = q8_module.tile_plan(fmt, k, **SMALL_TILE)
    assert plan["N_UNITS"] >= 3 * plan["CHUNK"] and plan["DEPTH"] == depth
    rng = np.random.default_rng(int(fmt) * 10 + depth)
    raw, up = raw_weights(fmt, n, k, rng), raw_weights(fmt, n, k, rng)
    _, acts = _quantized(k, rng)
    out = torch.full((1, n), float("nan"), device=DEVICE)
    gemv_q8(acts, dev(raw), fmt, n, k, out, **SMALL_TILE)
    want, scale = _reference(acts, raw, fmt, n, k)
    check(out, want, gamma(k + ROUNDINGS) * scale)
    gemv_q8_gate_up_glu(acts, dev(raw), dev(up), fmt, n, k, out, **SMALL_TILE)
    u, u_scale = _reference(acts, up, fmt, n, k)
    silu = want / (1 + np.exp(-want))
    bound = gamma(k + ROUNDINGS) * (SILU_SLOPE * scale * np.abs(u) + np.abs(silu) * u_scale)
    check(out, silu * u, bound + GLU_ULPS * 2.0**-24 * np.abs(silu * u))


@pytest.mark.parametrize("fmt", (Format.Q4_K, Format.Q8_0, Format.Q5_K, Format.Q4_0), ids=lambda f: f.name)
def test_parts_bias_residual_and_row(fmt: Format) -> None:
    k = 512
    rng = np.random.default_rng(int(fmt))
    ns = (N, 16, 9)
    raws = [raw_weights(fmt, n, k, rng) for n in ns]
    _, acts = _quantized(k, rng)
    bias = rng.standard_normal(ns[1]).astype(np.float32)
    res = rng.standard_normal((1, ns[0])).astype(np.float32)
    out0, out1 = dev(res.copy()), torch.zeros((1, ns[1]), device=DEVICE)
    table = torch.zeros((4, ns[2]), device=DEVICE)
    pos = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    parts = [Part(dev(raws[0]), ns[0], out0), Part(dev(raws[1]), ns[1], out1, dev(bias)),
             Part(dev(raws[2]), ns[2], table, None, (pos, ns[2]))]  # fmt: skip
    gemv_q8_parts(acts, parts, fmt, residual=out0)
    refs = [_reference(acts, raw, fmt, n, k) for raw, n in zip(raws, ns, strict=True)]
    check(out0, refs[0][0] + res, gamma(k + ROUNDINGS) * (refs[0][1] + np.abs(res)))
    check(out1, refs[1][0] + bias, gamma(k + ROUNDINGS) * (refs[1][1] + np.abs(bias)))
    assert not table[[0, 1, 3]].any()
    check(table[2:3], refs[2][0], gamma(k + ROUNDINGS) * refs[2][1])


# A launch in parts of two formats (a Q4_K_M layer's Q6_K value rows beside its Q4_K query and key, a Q5_K_M one's
# beside Q5_K, Q8_0 beside Q4_0): each part in its own format's body at the first part's tile, the second
# format's part with a bias and landing at a table's row.
MIXED = [(Format.Q4_K, Format.Q6_K), (Format.Q5_K, Format.Q6_K), (Format.Q4_0, Format.Q8_0)]


@pytest.mark.parametrize(("first", "second"), MIXED, ids=lambda f: f.name)
def test_parts_of_two_formats(first: Format, second: Format) -> None:
    k = 512
    rng = np.random.default_rng(int(first) * 31 + int(second))
    ns, fmts = (N, 9, 16), (first, second, first)
    raws = [raw_weights(f, n, k, rng) for f, n in zip(fmts, ns, strict=True)]
    _, acts = _quantized(k, rng)
    bias = rng.standard_normal(ns[1]).astype(np.float32)
    table = torch.zeros((4, ns[1]), device=DEVICE)
    pos = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    out0, out2 = torch.zeros((1, ns[0]), device=DEVICE), torch.zeros((1, ns[2]), device=DEVICE)
    parts = [Part(dev(raws[0]), ns[0], out0), Part(dev(raws[1]), ns[1], table, dev(bias), (pos, ns[1])),
             Part(dev(raws[2]), ns[2], out2)]  # fmt: skip
    gemv_q8_parts(acts, parts, fmts)
    refs = [_reference(acts, raw, f, n, k) for raw, f, n in zip(raws, fmts, ns, strict=True)]
    check(out0, refs[0][0], gamma(k + ROUNDINGS) * refs[0][1])
    check(table[1:2], refs[1][0] + bias, gamma(k + ROUNDINGS) * (refs[1][1] + np.abs(bias)))
    assert not table[[0, 2, 3]].any()
    check(out2, refs[2][0], gamma(k + ROUNDINGS) * refs[2][1])


# Qwen3-Next-80B-A3B's two-format launches in its Q4_K_M recipe (compiled): a delta-rule layer's Q6_K q/k/v rows
# beside its Q4_K gate and gates, a full-attention layer's Q4_K query/gate and key beside its Q6_K value rows
REAL_TWO_FORMATS = {
    "delta-rule": ((Format.Q6_K, 8192), (Format.Q4_K, 4096), (Format.Q4_K, 64)),
    "full-attention": ((Format.Q4_K, 8192), (Format.Q4_K, 512), (Format.Q6_K, 512)),
}


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("layer", REAL_TWO_FORMATS)
def test_parts_of_two_formats_at_real_widths(layer: str) -> None:
    k = 2048
    rng = np.random.default_rng(len(layer))
    fmts, ns = zip(*REAL_TWO_FORMATS[layer], strict=True)
    raws = [raw_weights(f, n, k, rng) for f, n in zip(fmts, ns, strict=True)]
    _, acts = _quantized(k, rng)
    outs = [torch.full((1, n), float("nan"), device=DEVICE) for n in ns]
    gemv_q8_parts(acts, [Part(dev(raw), n, out) for raw, n, out in zip(raws, ns, outs, strict=True)], fmts)
    for raw, f, n, out in zip(raws, fmts, ns, outs, strict=True):
        want, scale = _reference(acts, raw, f, n, k)
        check(out, want, gamma(k + ROUNDINGS) * scale)


def test_parts_take_at_most_two_formats() -> None:
    k = 256
    rng = np.random.default_rng(5)
    fmts = (Format.Q4_K, Format.Q6_K, Format.Q8_0)
    _, acts = _quantized(k, rng)
    parts = [Part(dev(raw_weights(f, 4, k, rng)), 4, torch.zeros((1, 4), device=DEVICE)) for f in fmts]
    with pytest.raises(ValueError, match="at most 2 formats"):
        gemv_q8_parts(acts, parts, fmts)


@pytest.mark.parametrize("fmt", (Format.Q4_K, Format.Q6_K, Format.Q8_0, Format.Q5_K, Format.Q2_K), ids=lambda f: f.name)
def test_gate_up_glu(fmt: Format) -> None:
    check_glu(fmt, N, 768 if fmt in SUPER else 320, np.random.default_rng(int(fmt) + 7))


def check_product(fmt: Format, n: int, k: int, rng: np.random.Generator, **tile) -> None:
    """`gemv_q8` of n random rows of k values in `fmt` at the module's tile (or `tile`), against the reference."""
    raw = raw_weights(fmt, n, k, rng)
    _, acts = _quantized(k, rng)
    out = torch.full((1, n), float("nan"), device=DEVICE)
    gemv_q8(acts, dev(raw), fmt, n, k, out, **tile)
    want, scale = _reference(acts, raw, fmt, n, k)
    check(out, want, gamma(k + ROUNDINGS) * scale)


def check_glu(fmt: Format, n: int, k: int, rng: np.random.Generator, **tile) -> None:
    """`gemv_q8_gate_up_glu` of a random pair of n rows of k values in `fmt` (at `tile` where given), against the
    reference."""
    wg, wu = raw_weights(fmt, n, k, rng), raw_weights(fmt, n, k, rng)
    _, acts = _quantized(k, rng)
    out = torch.full((1, n), float("nan"), device=DEVICE)
    gemv_q8_gate_up_glu(acts, dev(wg), dev(wu), fmt, n, k, out, **tile)
    (g, g_scale), (u, u_scale) = _reference(acts, wg, fmt, n, k), _reference(acts, wu, fmt, n, k)
    silu = g / (1 + np.exp(-g))
    bound = gamma(k + ROUNDINGS) * (SILU_SLOPE * g_scale * np.abs(u) + np.abs(silu) * u_scale)
    check(out, silu * u, bound + GLU_ULPS * 2.0**-24 * np.abs(silu * u))


def test_q4_k_rows_and_activations_must_be_16_byte_aligned() -> None:
    # Q4_K's header, its runs of codes and the activation's codes are read 16 bytes a load (`_ld4`)
    rng = np.random.default_rng(3)
    k = 256
    raw = dev(raw_weights(Format.Q4_K, 2, k, rng))
    _, acts = _quantized(k, rng)
    out = torch.empty((1, 2), device=DEVICE)
    shifted = torch.zeros(raw.numel() + 4, dtype=torch.uint8, device=DEVICE)[4:]
    shifted.copy_(raw)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemv_q8(acts, shifted, Format.Q4_K, 2, k, out)
    codes = torch.zeros(k + 4, dtype=torch.int8, device=DEVICE)[4:].view(1, k)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemv_q8(quant.Q8Acts(codes, acts.d, acts.s), raw, Format.Q4_K, 2, k, out)
    # the block scales and sums too: a Q3_K / Q2_K group reads four blocks' scales in one 128-bit load
    scales = torch.zeros(k // 32 + 1, device=DEVICE)[1:]
    with pytest.raises(ValueError, match="scales and sums must start 16-byte aligned"):
        gemv_q8(quant.Q8Acts(acts.q, scales, acts.s), raw, Format.Q4_K, 2, k, out)


@triton.jit
def _runs_kernel(src, at, out, RUNS: tl.constexpr):
    """The four words of the 16 bytes at each byte offset `at` of `src`, read by `int8_words.ld_run`."""
    i = tl.arange(0, RUNS)
    w0, w1, w2, w3 = int8_words.ld_run((src + tl.load(at + i))[None, :])
    j = i[None, :] * 4
    tl.store(out + j, w0)
    tl.store(out + j + 1, w1)
    tl.store(out + j + 2, w2)
    tl.store(out + j + 3, w3)


def test_runs_two_bytes_past_a_word_are_read_whole() -> None:
    # Q6_K's blocks are 210 bytes, so every other block's runs start 2 bytes past a word: five aligned
    # words are read and shifted into place; runs that start on a word take no shift
    data = np.random.default_rng(5).integers(0, 256, 64, dtype=np.uint8)
    at = np.array([0, 2, 4, 6, 14, 18, 30, 42], dtype=np.int32)  # each run's 16 bytes and next 2 in `data`
    out = torch.zeros(4 * len(at), dtype=torch.int32, device=DEVICE)
    _runs_kernel[(1,)](dev(data), dev(at), out, RUNS=len(at))
    want = np.concatenate([data[a : a + 16].view("<i4") for a in at])
    assert np.array_equal(out.cpu().numpy(), want)


@triton.jit
def _rotl_kernel(src, out, N: tl.constexpr):
    """Each word of `src` turned left by 0..31 bits (`int8_words.rotl`), [N, 32] into `out`."""
    i = tl.arange(0, N)[:, None]
    s = tl.arange(0, 32)[None, :]
    tl.store(out + i * 32 + s, int8_words.rotl(tl.load(src + i) + s * 0, s))


def test_a_word_turns_left_by_every_amount() -> None:
    # Q5_K's codes take their fifth bits from a turn of the qh word by 4 - 2j (mod 32): 0 and 30 among them
    words = np.random.default_rng(6).integers(-(2**31), 2**31, 8, dtype=np.int64).astype(np.int32)
    out = torch.zeros((8, 32), dtype=torch.int32, device=DEVICE)
    _rotl_kernel[(1,)](dev(words), out, N=8)
    u = words.view(np.uint32).astype(np.uint64)[:, None]
    s = np.arange(32, dtype=np.uint64)[None, :]
    want = (((u << s) | (u >> (32 - s))) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)  # 32-bit words in 64
    assert np.array_equal(out.cpu().numpy(), want)


def test_supports() -> None:
    assert supports(Format.Q4_K, 1, 512) and not supports(Format.Q4_K, 2, 512)
    assert not supports(Format.Q4_K, 1, 96) and supports(Format.Q8_0, 1, 96)
    assert not supports(Format.F16, 1, 512) and not supports(Format.BF16, 1, 512)
    for fmt in SUPER:
        assert supports(fmt, 1, 512) and not supports(fmt, 1, 96), fmt
    for fmt in BLOCKS:
        assert supports(fmt, 1, 96), fmt


def test_iq4_values_are_the_table() -> None:
    # every code 0..15 in every byte of a word, through the byte permutes
    from fuselane.gguf.formats import IQ4_NL_VALUES

    codes = np.array([[c, (c + 5) % 16, (c + 9) % 16, 15 - c] for c in range(16)], dtype=np.uint8)
    words = torch.from_numpy(codes.view("<i4").reshape(-1).copy()).to(DEVICE)
    out = torch.zeros_like(words)
    _iq4_kernel[(1,)](words, out, N=16)
    got = out.cpu().numpy().view(np.int8).reshape(16, 4)
    assert np.array_equal(got, np.array(IQ4_NL_VALUES, dtype=np.int8)[codes])


@triton.jit
def _iq4_kernel(words, out, N: tl.constexpr):
    i = tl.arange(0, N)
    values, _ = q8_bodies.iq4_pair(tl.load(words + i))  # the low nibbles' values: the codes' own
    tl.store(out + i, values)


# The new formats at real widths, compiled: the 7B's q (3584 x 3584) and down (3584 x 18944, the tall tile),
# the 8B's gate/up GLU (12288 x 4096)
REAL = ((3584, 3584), (3584, 18944))
NEW = (Format.Q5_K, Format.IQ4_XS, Format.Q3_K, Format.Q2_K, Format.Q4_0, Format.Q4_1, Format.Q5_1, Format.IQ4_NL)


# The tiles a wide row's launch takes that no short row's does (`q8_tiles`: the tables past SHORT_K values), at
# small widths here so the interpreter runs them: Q4_0's and IQ4_NL's own at wide rows (8 blocks a row, each
# block's codes one 128-bit load), IQ4_XS's and Q6_K's tall rows, Q6_K's and Q5_K's gated pairs; a program's
# rows and one more, so the last is masked.
WIDE_ROW_TILES = [
    ("GLU_TILES", Format.Q4_0, 256), ("GLU_TILES", Format.IQ4_NL, 256), ("TILES", Format.Q4_0, 256),
    ("TALL_TILES", Format.Q4_0, 512), ("TALL_TILES", Format.IQ4_XS, 512), ("TALL_TILES", Format.Q6_K, 512),
    ("GLU_TILES", Format.Q6_K, 256), ("GLU_TILES", Format.Q5_K, 256),
]  # fmt: skip


@pytest.mark.parametrize(("table", "fmt", "k"), WIDE_ROW_TILES, ids=lambda v: getattr(v, "name", str(v)))
def test_a_wide_rows_tile_at_a_small_width(table: str, fmt: Format, k: int) -> None:
    rows, warps, per_thread = getattr(q8_tiles, table)[fmt]
    tile = {"block_n": rows, "warps": warps, "per_thread": per_thread}
    rng = np.random.default_rng(int(fmt) + len(table))
    if table == "GLU_TILES":
        check_glu(fmt, rows + 1, k, rng, **tile)
    else:
        check_product(fmt, rows + 1, k, rng, **tile)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("fmt", (*NEW, Format.Q6_K), ids=lambda f: f.name)
def test_real_widths(fmt: Format) -> None:
    rng = np.random.default_rng(int(fmt) + 99)
    for n, k in REAL:
        check_product(fmt, n, k, rng)
    check_glu(fmt, 12288, 4096, rng)


# Rows under SHORT_K at real widths, compiled: the 1.5B's width (its rows a program's count and two more, so the
# last program's rows are masked) and the 4B's
SHORT_REAL = ((1538, 1536), (2560, 2560))
# a narrow model's down (the 1.5B's: 1,536 rows of 8,960), at NARROW_TALL_TILES
NARROW_TALL_REAL = (1536, 8960)
SHORT_GLU_REAL = (8960, 1536)  # the 1.5B's gated pair


def test_a_rows_length_picks_its_tile() -> None:
    for k, table in ((q8_tiles.SHORT_K - 256, q8_tiles.SHORT_TILES), (q8_tiles.SHORT_K, q8_tiles.TILES)):
        plan = q8_module.tile_plan(Format.Q6_K, k, None, None, None)
        assert (plan["BLOCK_N"], plan["num_warps"]) == table[Format.Q6_K][:2], k
    assert q8_tiles.SHORT_TILES[Format.Q6_K] != q8_tiles.TILES[Format.Q6_K]
    # a tall row's tile by its launch's rows: a narrow model's down, a wide one's, and rows not said
    tall = q8_tiles.TALL_K
    for n, table in (
        (2048, q8_tiles.NARROW_TALL_TILES),
        (q8_tiles.SHORT_K, q8_tiles.TALL_TILES),
        (None, q8_tiles.TALL_TILES),
    ):
        assert q8_tiles.tile_of(Format.Q4_K, tall, n) == table[Format.Q4_K], n
    assert q8_tiles.NARROW_TALL_TILES[Format.Q4_K] != q8_tiles.TALL_TILES[Format.Q4_K]
    # a gated pair's tile by its rows' length: Q4_0's short rows keep the tile its wide ones left
    for k, table in ((q8_tiles.SHORT_K - 256, q8_tiles.SHORT_GLU_TILES), (q8_tiles.SHORT_K, q8_tiles.GLU_TILES)):
        assert q8_tiles.tile_of(Format.Q4_0, k, glu=True) == table[Format.Q4_0], k
    assert q8_tiles.SHORT_GLU_TILES[Format.Q4_0] != q8_tiles.GLU_TILES[Format.Q4_0]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("fmt", (Format.Q6_K, Format.Q4_K), ids=lambda f: f.name)
def test_short_real_widths(fmt: Format) -> None:
    rng = np.random.default_rng(int(fmt) + 7)
    for n, k in (*SHORT_REAL, NARROW_TALL_REAL):
        check_product(fmt, n, k, rng)
    check_glu(fmt, *SHORT_GLU_REAL, rng)


def _same_codes(q8, values: torch.Tensor) -> None:
    codes, d, s = quant.quantize_reference(values.detach().cpu().numpy().reshape(1, -1))
    assert np.array_equal(q8.q.cpu().numpy().reshape(1, -1), codes)
    assert np.array_equal(q8.d.cpu().numpy().reshape(1, -1), d)
    assert np.array_equal(q8.s.cpu().numpy().reshape(1, -1), s)


@pytest.mark.parametrize("chunk", [None, 32], ids=["one-pass", "chunked"])
@pytest.mark.parametrize("fmt", (Format.Q4_K, Format.Q8_0), ids=lambda f: f.name)
def test_add_norm_writes_its_norm_quantized(monkeypatch, fmt: Format, chunk: int | None) -> None:
    from kernel_checks import norm_rel

    from fuselane.lanes.cuda.triton.gemv import epilogue as gemv_epilogue
    from fuselane.lanes.cuda.triton.gemv import fast_norm as gemv_fast_norm
    from fuselane.lanes.cuda.triton.gemv import q8_epilogue as gemv_q8_epilogue

    if chunk:  # the last program walks the row in chunks of 32 values
        monkeypatch.setattr(gemv_fast_norm, "NORM_CHUNK", chunk)
    n, k = 96, 512
    rng = np.random.default_rng(int(fmt) + 3)
    raw = raw_weights(fmt, n, k, rng)
    _, acts = _quantized(k, rng)
    res = rng.standard_normal(n).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    sum_out, out = dev(res.copy()), torch.zeros(n, device=DEVICE)
    out_q8 = quant.empty_q8(1, n, DEVICE)
    counter = gemv_epilogue.gemv_add_norm_counter(DEVICE)
    w = dev(raw)
    gemv_q8_epilogue.gemv_q8_add_norm(acts, w, fmt, n, k, sum_out, sum_out, dev(norm_w), 1e-6, out, out_q8, counter)
    want, scale = _reference(acts, raw, fmt, n, k)
    check(sum_out.view(1, n), want + res, gamma(k + ROUNDINGS) * (scale + np.abs(res)))
    s = sum_out.cpu().double().numpy()
    normed = s / np.sqrt(np.mean(s * s) + 1e-6) * norm_w
    check(out, normed, norm_rel(n) * np.abs(normed) * 2)
    _same_codes(out_q8, out)
    assert int(counter.item()) == 0


def test_glu_writes_its_result_quantized() -> None:
    from fuselane.lanes.cuda.triton.gemv import q8_epilogue as gemv_q8_epilogue

    fmt, n, k = Format.Q4_K, 96, 512
    rng = np.random.default_rng(11)
    wg, wu = dev(raw_weights(fmt, n, k, rng)), dev(raw_weights(fmt, n, k, rng))
    _, acts = _quantized(k, rng)
    plain, out = torch.zeros((1, n), device=DEVICE), torch.zeros((1, n), device=DEVICE)
    out_q8, counters = quant.empty_q8(1, n, DEVICE), gemv_q8_epilogue.q8_counters(n, DEVICE)
    gemv_q8_gate_up_glu(acts, wg, wu, fmt, n, k, plain)
    gemv_q8_epilogue.gemv_q8_gate_up_glu_q8(acts, wg, wu, fmt, n, k, out, out_q8, counters)
    assert torch.equal(out, plain)
    _same_codes(out_q8, out)
    assert not counters.any()


# Compiled for sm_90 without a GPU (Triton's PTX, then ptxas): the compiled path differs from the interpreted
# one (inline asm for dp4a, prmt and the loads; no `in` on constexprs), so CI builds it too. One format for
# each kind of load: Q5_K (`ld4`), Q2_K (`ld_words`, 1- and 4-byte `ld_scalar`), IQ4_NL (`ld_run`, `prmt`,
# 2-byte `ld_scalar`).
_COMPILE = """
import sys
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.triton.gemv import q8
for name in sys.argv[1:]:
    plan = q8.tile_plan(Format[name], 4096, None, None, None, glu=True)
    warps = plan.pop("num_warps")
    consts = dict(plan, PDL=True)
    sig = {"xq": "*i8", "xd": "*fp32", "xs": "*fp32", "w_gate": "*u8", "w_up": "*u8", "n": "i32", "out": "*fp32"}
    sig |= {c: "constexpr" for c in consts}
    src = ASTSource(q8._glu_kernel, sig, constexprs={(list(sig).index(c),): v for c, v in consts.items()})
    kernel = compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert kernel.asm["ptx"].count("dp4a") and kernel.asm["cubin"], name
"""


@pytest.mark.skipif(CUDA, reason="on a GPU the other tests compile and run the kernels")
def test_bodies_compile_for_sm90() -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE, "Q5_K", "Q2_K", "IQ4_NL"], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
