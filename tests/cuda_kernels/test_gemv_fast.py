"""The one-row decode GEMV kernels (`gemv_fast`) against NumPy: x @ dequantize(raw).T in f64.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (small shapes); with one they run on the
device, and the `cuda` tests add real shapes. The tolerance is test_gemv.py's, derived, not picked: every
weight decodes to exactly the f32 value `fuselane.gguf.dequant` gives and the activations are the same f32
numbers, so only the dot product rounds: k products and k - 1 sums in any order put an output within
gamma_k * sum_i |w_i x_i| of the exact one (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1),
gamma_k = k u / (1 - k u), u = 2^-24; a bias and a residual add one rounding each. A wrong code, scale or
offset moves an output by about its own size, thousands of times the bound.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import CUDA, DEVICE, U32, CountLaunches, check, dev, file_blocks, gamma, raw_weights  # noqa: E402

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.gguf.quantize import quantize  # noqa: E402
from fuselane.lanes.cuda.triton.gemv import fast, fast_tiles  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.fast import (  # noqa: E402
    gemv_fast,
    gemv_fast_gate_up_glu,
    gemv_fast_parts,
    supports_fast,
)
from fuselane.lanes.cuda.triton.gemv.parts import PARTS_MOST  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.rows import Part  # noqa: E402

EPILOGUE_ROUNDINGS = 2  # a bias add and a residual add
# SiLU(g) * u (as test_gemv.py): SiLU's slope peaks at ~1.0998; its own ops round within a few ulps of the
# result (e^-g within 2 ulps on the GPU, 1 + e^-g, the division, the product), with a factor 2 of room.
SILU_SLOPE = 1.1
GLU_ULPS = 12

FORMATS = (Format.Q4_K, Format.Q6_K, Format.Q8_0, Format.Q5_0, Format.F16, Format.BF16)
BLOCKS_32 = (Format.Q8_0, Format.Q5_0, Format.F16, Format.BF16)  # rows of 32-value units: any multiple of 32 values
N = 37  # not a whole number of tiles at any BLOCK_N: the last tile's rows past n are computed and dropped
# rows of 2 super-blocks (one default Q4_K / Q6_K chunk) and of 3 (a whole chunk, then a partial one)
K_SHORT, K_PARTIAL = 512, 768
# 32-value formats: 3 blocks (one partial chunk), 10 (a whole chunk of 8 at block_n 16, then a partial one),
# 16 (one whole chunk at the default 8 rows)
K_BLOCKS = (96, 320, 512)
REAL_SEED = 70


def _x(k: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((1, k)).astype(np.float32)


def _reference(x: np.ndarray, raw: np.ndarray, fmt: Format, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(x @ W^T exactly, sum_i |w_i x_i| per output), in f64."""
    w = dequantize(raw, fmt, (n, k), np.float64)
    x64 = x.astype(np.float64)
    return x64 @ w.T, np.abs(x64) @ np.abs(w).T


def _case(fmt: Format, raw: np.ndarray, n: int, k: int, rng: np.random.Generator, **tile) -> None:
    x = _x(k, rng)
    out = torch.full((1, n), float("nan"), device=DEVICE)
    assert gemv_fast(dev(x), dev(raw), fmt, n, k, out, **tile) is out
    want, scale = _reference(x, raw, fmt, n, k)
    check(out, want, gamma(k) * scale)


@pytest.mark.parametrize("k", [K_SHORT, K_PARTIAL])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_random_blocks(fmt: Format, k: int) -> None:
    rng = np.random.default_rng(int(fmt) * 10 + k)
    _case(fmt, raw_weights(fmt, N, k, rng), N, k, rng)


@pytest.mark.parametrize("k", K_BLOCKS)
@pytest.mark.parametrize("fmt", BLOCKS_32, ids=lambda f: f.name)
def test_rows_of_odd_blocks(fmt: Format, k: int) -> None:
    # rows that are not whole 8-block chunks end in a partial chunk, with block_n 16 too (8-block chunks)
    rng = np.random.default_rng(int(fmt) * 100 + k)
    raw = raw_weights(fmt, N, k, rng)
    _case(fmt, raw, N, k, rng)
    _case(fmt, raw, N, k, rng, block_n=16)


@pytest.mark.parametrize("fmt", BLOCKS_32, ids=lambda f: f.name)
def test_quantized_values(fmt: Format) -> None:
    # weight-like values through llama.cpp's own rounding (gguf.quants): the scales a real file holds
    rng = np.random.default_rng(int(fmt))
    raw = file_blocks(fmt, quantize((rng.standard_normal((N, K_SHORT)) * 0.02).astype(np.float32), fmt), K_SHORT)
    _case(fmt, raw, N, K_SHORT, rng)


@pytest.mark.parametrize("tile", [{"block_n": 4}, {"block_n": 16}, {"block_n": 8, "warps": 2}], ids=str)
@pytest.mark.parametrize("fmt", [Format.Q4_K, Format.Q6_K], ids=lambda f: f.name)
def test_other_tiles(fmt: Format, tile: dict) -> None:
    # 4 rows take 4-super-block chunks (one partial chunk of 3), 16 rows one super-block a chunk
    rng = np.random.default_rng(int(fmt) + tile["block_n"])
    _case(fmt, raw_weights(fmt, N, K_PARTIAL, rng), N, K_PARTIAL, rng, **tile)


def test_without_the_prefetch_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    # the other loop schedule (read at launch) computes the same
    monkeypatch.setattr(fast, "PREFETCH_FENCE", False)
    rng = np.random.default_rng(15)
    _case(Format.Q4_K, raw_weights(Format.Q4_K, N, K_PARTIAL, rng), N, K_PARTIAL, rng)


def test_default_tiles_give_every_thread_its_groups() -> None:
    # the layout the kernels are written for: BLOCK_N rows x the chunk's scale groups = the block's threads
    # times the (row, group)s the format's tile gives a thread
    for fmt in FORMATS:
        for glu, tiles in ((False, fast_tiles.TILES), (True, fast_tiles.GLU_TILES)):
            plan = fast.launch_plan(fmt, 4096, None, None, glu=glu)
            groups = plan["BLOCK_N"] * plan["CHUNK"] * fast.GROUPS[fmt]
            assert groups == plan["num_warps"] * fast.LANES * tiles[fmt][1]
            assert plan["N_UNITS"] * fast.UNIT_VALUES[fmt] == 4096


def test_a_narrow_float_product_takes_more_programs() -> None:
    # a float product with a side under NARROW_SIDE (its parts' rows together) takes four rows a program and
    # two groups a thread, partial chunk or not; one long both ways, or one given a tile, keeps the format's
    side = fast_tiles.NARROW_SIDE
    for fmt in (Format.F16, Format.BF16):
        few_rows = fast.launch_plan(fmt, 1536 * 8, None, None, n=side - 1)
        short_rows = fast.launch_plan(fmt, 1536, None, None, n=side * 50)
        assert few_rows["BLOCK_N"] == short_rows["BLOCK_N"] == 4
        assert short_rows["CHUNK"] == 64  # 48 units: one partial chunk
        wide = fast.launch_plan(fmt, side, None, None, n=side)
        assert wide["BLOCK_N"] == fast_tiles.TILES[fmt][0]
        assert fast.launch_plan(fmt, 1536, 8, None, n=1)["BLOCK_N"] == 8
    assert fast.launch_plan(Format.Q8_0, 1536, None, None, n=1)["BLOCK_N"] == fast_tiles.TILES[Format.Q8_0][0]


@pytest.mark.parametrize("fmt", [Format.F16, Format.BF16], ids=lambda f: f.name)
def test_a_float_product_at_the_wide_tile(fmt: Format, monkeypatch: pytest.MonkeyPatch) -> None:
    # the interpreted shapes are all narrow: the wide tile (8 rows, a group a thread) runs here, whole and
    # partial chunks
    monkeypatch.setattr(fast_tiles, "NARROW_SIDE", 0)
    rng = np.random.default_rng(int(fmt) + 300)
    for k in (K_SHORT, K_BLOCKS[0]):
        assert fast.launch_plan(fmt, k, None, None, n=N)["BLOCK_N"] == fast_tiles.TILES[fmt][0]
        _case(fmt, raw_weights(fmt, N, k, rng), N, k, rng)


def test_supports_fast() -> None:
    assert all(supports_fast(fmt, 1) for fmt in FORMATS)
    assert not supports_fast(Format.Q4_K, 2)
    assert not supports_fast(Format.Q5_K, 1)
    assert supports_fast(int(Format.Q8_0), 1)


def test_bias_and_residual() -> None:
    fmt, rng = Format.Q4_K, np.random.default_rng(20)
    raw, x = raw_weights(fmt, N, K_SHORT, rng), _x(K_SHORT, rng)
    bias = rng.standard_normal(N).astype(np.float32)
    res = rng.standard_normal((1, N)).astype(np.float32)
    want, scale = _reference(x, raw, fmt, N, K_SHORT)
    bound = gamma(K_SHORT + EPILOGUE_ROUNDINGS) * (scale + np.abs(bias) + np.abs(res))
    out = torch.empty((1, N), device=DEVICE)
    gemv_fast(dev(x), dev(raw), fmt, N, K_SHORT, out, bias=dev(bias), residual=dev(res))
    check(out, want + bias + res, bound)
    # the residual is the output itself: an in-place add
    out = dev(res).clone()  # on the CPU dev shares `res`' memory
    gemv_fast(dev(x), dev(raw), fmt, N, K_SHORT, out, residual=out)
    check(out, want + res, bound)


@pytest.mark.parametrize("pitch", [N, N + 12])
def test_out_row_at_a_device_position(pitch: int) -> None:
    fmt, rng, rows = Format.Q6_K, np.random.default_rng(30), 16
    raw, x = raw_weights(fmt, N, K_SHORT, rng), _x(K_SHORT, rng)
    want, scale = _reference(x, raw, fmt, N, K_SHORT)
    cache = torch.zeros((rows, pitch), device=DEVICE)
    pos = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    gemv_fast(dev(x), dev(raw), fmt, N, K_SHORT, cache, out_row=(pos, pitch))
    check(cache[5:6, :N], want, gamma(K_SHORT) * scale)
    pos.fill_(9)  # a new position in the same tensor, read on the device (as a graph replay would)
    gemv_fast(dev(x), dev(raw), fmt, N, K_SHORT, cache, out_row=(pos, pitch))
    check(cache[9:10, :N], want, gamma(K_SHORT) * scale)
    untouched = np.ones(rows, dtype=bool)
    untouched[[5, 9]] = False
    assert not cache[torch.from_numpy(untouched).to(DEVICE)].any()
    assert not cache[:, N:].any()


@pytest.mark.parametrize("fmt", [Format.Q4_K, Format.Q6_K, Format.Q8_0, Format.Q5_0], ids=lambda f: f.name)
def test_parts_in_one_launch(fmt: Format, monkeypatch: pytest.MonkeyPatch) -> None:
    # a layer's q, k and v: q with its bias, k into its own buffer, v into a cache row at a device position
    rng = np.random.default_rng(40 + int(fmt))
    k, widths = 256, (40, 12, 20)  # none a whole number of tiles
    x = _x(k, rng)
    raws = [raw_weights(fmt, n, k, rng) for n in widths]
    bias = rng.standard_normal(widths[0]).astype(np.float32)
    q_out = torch.empty((1, widths[0]), device=DEVICE)
    k_out = torch.empty((1, widths[1]), device=DEVICE)
    cache = torch.zeros((8, widths[2]), device=DEVICE)
    pos = torch.tensor([3], dtype=torch.int64, device=DEVICE)
    counter = CountLaunches(fast._parts_kernel)
    monkeypatch.setattr(fast, "_parts_kernel", counter)
    parts = [
        Part(dev(raws[0]), widths[0], q_out, bias=dev(bias)),
        (dev(raws[1]), widths[1], k_out, None, None),
        Part(dev(raws[2]), widths[2], cache, out_row=(pos, widths[2])),
    ]
    gemv_fast_parts(dev(x), parts, fmt)
    assert counter.launches == 1
    for i, (raw, n, got) in enumerate(zip(raws, widths, (q_out, k_out, cache[3:4]), strict=True)):
        want, scale = _reference(x, raw, fmt, n, k)
        b = bias if i == 0 else np.zeros(n)
        check(got, want + b, gamma(k + EPILOGUE_ROUNDINGS) * (scale + np.abs(b)))
    assert not cache[torch.arange(8, device=DEVICE) != 3].any()


def test_refusals() -> None:
    rng = np.random.default_rng(50)
    raw, x = dev(raw_weights(Format.Q8_0, 8, 64, rng)), dev(_x(64, rng))
    parts = [Part(raw, 8, torch.empty((1, 8), device=DEVICE)) for _ in range(PARTS_MOST + 1)]
    with pytest.raises(ValueError, match="parts"):
        gemv_fast_parts(x, parts, Format.Q8_0)
    with pytest.raises(ValueError, match="bytes"):
        gemv_fast(x, raw[:-1].clone(), Format.Q8_0, 8, 64, torch.empty((1, 8), device=DEVICE))
    with pytest.raises(ValueError, match="no fast GEMV"):
        gemv_fast(x, raw, Format.Q4_0, 8, 64, torch.empty((1, 8), device=DEVICE))
    with pytest.raises(ValueError, match="a power of two"):
        gemv_fast(x, raw, Format.Q8_0, 8, 64, torch.empty((1, 8), device=DEVICE), block_n=6)
    with pytest.raises(ValueError, match="x must be"):
        gemv_fast(x.repeat(2, 1), raw, Format.Q8_0, 8, 64, torch.empty((2, 8), device=DEVICE))


def _glu_case(fmt: Format, n: int, k: int, rng: np.random.Generator) -> None:
    x = _x(k, rng)
    raw_g, raw_u = raw_weights(fmt, n, k, rng), raw_weights(fmt, n, k, rng)
    out = torch.empty((1, n), device=DEVICE)
    gemv_fast_gate_up_glu(dev(x), dev(raw_g), dev(raw_u), fmt, n, k, out)
    g, g_scale = _reference(x, raw_g, fmt, n, k)
    u, u_scale = _reference(x, raw_u, fmt, n, k)
    silu = g / (1 + np.exp(-g))
    want = silu * u
    # |d(SiLU(g) u)| <= slope |dg| (|u| + |du|) + |SiLU(g)| |du|, plus the epilogue's own roundings
    dg, du = gamma(k) * g_scale, gamma(k) * u_scale
    bound = SILU_SLOPE * dg * (np.abs(u) + du) + np.abs(silu) * du + GLU_ULPS * U32 * np.abs(want)
    check(out, want, bound)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_gate_up_glu(fmt: Format) -> None:
    _glu_case(fmt, N, K_PARTIAL if fmt in (Format.Q4_K, Format.Q6_K) else K_BLOCKS[1], np.random.default_rng(60))


# --- real shapes, on a GPU only ----------------------------------------------------------------------------------

# (format, n, k): a 7-8B model's projections and the output heads; a 1.5B's float o and gate products (the
# float GEMV's narrow tile)
REAL = [(Format.Q4_K, 4096, 4096), (Format.Q4_K, 12288, 4096), (Format.Q6_K, 4096, 12288),
        (Format.Q6_K, 151936, 4096), (Format.Q8_0, 151936, 896), (Format.Q5_0, 4864, 896),
        (Format.F16, 4096, 4096), (Format.BF16, 4096, 4096),
        (Format.F16, 1536, 1536), (Format.BF16, 8960, 1536)]  # fmt: skip
REF_ROWS = 8192  # rows of the f64 reference dequantized at a time on the device


def _device_reference(x: torch.Tensor, raw: np.ndarray, fmt: Format, n: int, k: int) -> tuple[np.ndarray, ...]:
    rows = raw.reshape(n, -1)
    want, scale = [], []
    for r in range(0, n, REF_ROWS):
        chunk = rows[r : r + REF_ROWS]
        w = torch.from_numpy(dequantize(chunk.reshape(-1), fmt, (chunk.shape[0], k))).to(DEVICE, torch.float64)
        want.append((x.double() @ w.T).cpu().numpy())
        scale.append((x.double().abs() @ w.abs().T).cpu().numpy())
    return np.concatenate(want, axis=1), np.concatenate(scale, axis=1)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(("fmt", "n", "k"), REAL, ids=lambda v: getattr(v, "name", str(v)))
def test_real_shapes(fmt: Format, n: int, k: int) -> None:
    rng = np.random.default_rng(REAL_SEED)
    raw, x = raw_weights(fmt, n, k, rng), dev(_x(k, rng))
    out = torch.empty((1, n), device=DEVICE)
    gemv_fast(x, dev(raw), fmt, n, k, out)
    torch.cuda.synchronize()
    want, scale = _device_reference(x, raw, fmt, n, k)
    check(out, want, gamma(k) * scale)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_real_gate_up_glu() -> None:
    _glu_case(Format.Q4_K, 12288, 4096, np.random.default_rng(REAL_SEED + 1))
