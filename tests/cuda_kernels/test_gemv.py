"""The decode GEMV kernels against NumPy: x @ dequantize(raw).T in f64.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (small shapes: the interpreter is slow);
with one they run on the device, and the `cuda` tests add the real shapes (a 4096 x 4096 Q4_K projection, the
151936 x 896 Q8_0 output head).

The tolerance is derived, not picked. The kernels decode every weight to exactly the f32 value
`fuselane.gguf.dequant` gives (scale products are exact in f32, the K formats' minimum is subtracted with one
rounding either way: see `gemv_formats`), and the activations are the same f32 numbers in both, so only the
dot product rounds. Its k products and k - 1 sums in f32, in any order, put the result within
gamma_k * sum_i |w_i x_i| of the exact one, gamma_k = k u / (1 - k u), u = 2^-24 (Higham, "Accuracy and
Stability of Numerical Algorithms", section 3.1); a bias and a residual add two more roundings, each within
u of the running sum, so per output

    |y_kernel - y_exact| <= gamma_{k+2} * (sum_i |w_i x_i| + |bias| + |residual|).

The f64 reference is exact to 2^-29 of that bound, so the test checks it per output with no extra slack. A
wrong code, scale or offset moves an output by about its own size, thousands of times the bound.
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
from fuselane.lanes.cuda.plan import kernels  # noqa: E402
from fuselane.lanes.cuda.triton.gemv import rows as gemv_mod  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.rows import Part, gemv, gemv_gate_up_glu, gemv_parts  # noqa: E402

EPILOGUE_ROUNDINGS = 2  # a bias add and a residual add
# SiLU(g) * u: the Lipschitz constant of SiLU (its slope peaks at ~1.0998), and the roundings of its own
# ops in ulps of the result: e^-g (the GPU's exp2-based approximation is within 2 ulps), 1 + e^-g, the
# division and the product, with a factor 2 of room.
SILU_SLOPE = 1.1
GLU_ULPS = 12

ALL = (
    Format.F32,
    Format.F16,
    Format.BF16,
    Format.Q8_0,
    Format.Q4_0,
    Format.Q4_1,
    Format.Q5_0,
    Format.Q5_1,
    Format.Q4_K,
    Format.Q5_K,
    Format.Q6_K,
    # each value decoded alone (`formats._dot_values`): the f32 activations' path for the int8 GEMV's formats
    Format.Q2_K,
    Format.Q3_K,
    Format.IQ4_NL,
    Format.IQ4_XS,
    Format.MXFP4,
)
QUANTIZABLE = (Format.F32, Format.F16, Format.BF16, Format.Q8_0, Format.Q4_0, Format.Q4_1, Format.Q5_0, Format.Q5_1)
K = 512  # two K super-blocks, sixteen 32-value blocks: every format's loop takes more than one step
N = 36  # not a whole tile of rows: the last tile's rows past n are computed and dropped


def _x(m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((m, k)).astype(np.float32)


def _reference(x: np.ndarray, raw: np.ndarray, fmt: Format, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(x @ W^T exactly, sum_i |w_i x_i| per output), in f64."""
    w = dequantize(raw, fmt, (n, k), np.float64)
    x64 = x.astype(np.float64)
    return x64 @ w.T, np.abs(x64) @ np.abs(w).T


def _gemv_case(fmt: Format, raw: np.ndarray, m: int, n: int, k: int, rng: np.random.Generator) -> None:
    x = _x(m, k, rng)
    out = torch.full((m, n), float("nan"), device=DEVICE)
    gemv(dev(x), dev(raw), fmt, n, k, out)
    want, scale = _reference(x, raw, fmt, n, k)
    check(out, want, gamma(k) * scale)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_random_blocks(fmt: Format, m: int) -> None:
    rng = np.random.default_rng(int(fmt) * 10 + m)
    _gemv_case(fmt, raw_weights(fmt, N, K, rng), m, N, K, rng)


@pytest.mark.parametrize("fmt", QUANTIZABLE, ids=lambda f: f.name)
def test_quantized_values(fmt: Format) -> None:
    # weight-like values through llama.cpp's own rounding (gguf.quants): the scales a real file holds
    rng = np.random.default_rng(int(fmt))
    raw = file_blocks(fmt, quantize((rng.standard_normal((N, K)) * 0.02).astype(np.float32), fmt), K)
    _gemv_case(fmt, raw, 1, N, K, rng)


@pytest.mark.parametrize("fmt", [Format.Q8_0, Format.Q5_0, Format.F16], ids=lambda f: f.name)
def test_rows_of_odd_blocks(fmt: Format) -> None:
    # 3 blocks of 32 (or 96 f16 values) a row: a step takes one block (32 values), three steps a row
    rng = np.random.default_rng(7)
    k = 3 * 32
    _gemv_case(fmt, raw_weights(fmt, N, k, rng), 2, N, k, rng)


def test_wide_tile() -> None:
    # a wide Q4_K product met one row at a time takes four rows a warp: 16-row tiles of four warps
    n, k = kernels.WIDE_N, kernels.WIDE_K
    warps = kernels.GEMV_BLOCK_WARPS_FOUR_ROWS
    assert gemv_mod.tile(Format.Q4_K, n, k, 1) == (kernels.ROWS_A_WARP_WIDE * warps, warps)
    rng = np.random.default_rng(11)
    _gemv_case(Format.Q4_K, raw_weights(Format.Q4_K, n, k, rng), 1, n, k, rng)


# the anchors' products: (n, k) of q, k/v, o, gate/up, down and the output head of the four shapes
ANCHOR_PRODUCTS = [(896, 896), (128, 896), (4864, 896), (896, 4864), (151936, 896), (1024, 1024), (3072, 1024),
                   (1024, 3072), (3584, 3584), (18944, 3584), (3584, 18944), (4096, 4096), (12288, 4096),
                   (4096, 12288), (151936, 4096)]  # fmt: skip


@pytest.mark.parametrize("m", [1, 3, kernels.GEMV_ROWS])
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_plan_gives_every_thread_a_slot(fmt: Format, m: int) -> None:
    # a step is whole units that divide the row, and its slots of a row are the block's threads a row
    slots = gemv_mod.SLOTS[fmt]
    for n, k in ANCHOR_PRODUCTS:
        if k % slots.unit:
            continue  # the checkpoint cannot hold such rows in this format
        block_n, warps = gemv_mod.tile(fmt, n, k, m)
        block_m, _ = gemv_mod.row_tiles(m)
        steps, units, split = gemv_mod.plan(fmt, k, block_n, warps, block_m)
        assert steps * units * slots.unit == k
        assert units * slots.base * split * block_n == warps * kernels.WARP, (n, k)
        assert block_m * slots.values // split <= gemv_mod.ACC_VALUES or split == slots.most_split


def test_more_rows_than_the_gemv_takes() -> None:
    # a batch's rows past GEMV_ROWS run in tiles of them
    rng = np.random.default_rng(12)
    m = kernels.GEMV_ROWS + 3
    _gemv_case(Format.Q8_0, raw_weights(Format.Q8_0, N, K, rng), m, N, K, rng)


@pytest.mark.parametrize("m", [1, 3])
def test_bias_and_residual(m: int) -> None:
    fmt, rng = Format.Q4_K, np.random.default_rng(20 + m)
    raw, x = raw_weights(fmt, N, K, rng), _x(m, K, rng)
    bias = rng.standard_normal(N).astype(np.float32)
    res = rng.standard_normal((m, N)).astype(np.float32)
    want, scale = _reference(x, raw, fmt, N, K)
    bound = gamma(K + EPILOGUE_ROUNDINGS) * (scale + np.abs(bias) + np.abs(res))

    out = torch.empty((m, N), device=DEVICE)
    gemv(dev(x), dev(raw), fmt, N, K, out, bias=dev(bias), residual=dev(res))
    check(out, want + bias + res, bound)

    # the residual is the output itself: an in-place add
    out = dev(res).clone()  # on the CPU dev shares `res`' memory
    gemv(dev(x), dev(raw), fmt, N, K, out, residual=out)
    check(out, want + res, bound)


@pytest.mark.parametrize("pitch", [N, N + 12])
def test_out_row_at_a_device_position(pitch: int) -> None:
    fmt, rng, m, rows = Format.Q6_K, np.random.default_rng(30), 2, 16
    raw, x = raw_weights(fmt, N, K, rng), _x(m, K, rng)
    want, scale = _reference(x, raw, fmt, N, K)
    cache = torch.zeros((rows, pitch), device=DEVICE)
    pos = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    gemv(dev(x), dev(raw), fmt, N, K, cache, out_row=(pos, pitch))
    check(cache[5 : 5 + m, :N], want, gamma(K) * scale)
    # a new position in the same tensor: the launch reads it on the device (as a graph replay would)
    pos.fill_(9)
    gemv(dev(x), dev(raw), fmt, N, K, cache, out_row=(pos, pitch))
    check(cache[9 : 9 + m, :N], want, gamma(K) * scale)
    untouched = np.ones(rows, dtype=bool)
    untouched[[5, 6, 9, 10]] = False
    assert not cache[torch.from_numpy(untouched).to(DEVICE)].any()
    assert not cache[:, N:].any()


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("fmt", [Format.Q8_0, Format.Q4_K, Format.Q5_0], ids=lambda f: f.name)
def test_parts_in_one_launch(fmt: Format, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # a layer's q, k and v: q with its bias, k into its own buffer, v into a cache row at a device position
    rng = np.random.default_rng(40 + m)
    k, widths = 256, (64, 32, 32)
    x = _x(m, k, rng)
    raws = [raw_weights(fmt, n, k, rng) for n in widths]
    bias = rng.standard_normal(widths[0]).astype(np.float32)
    q_out = torch.empty((m, widths[0]), device=DEVICE)
    k_out = torch.empty((m, widths[1]), device=DEVICE)
    cache = torch.zeros((8, widths[2]), device=DEVICE)
    pos = torch.tensor([3], dtype=torch.int64, device=DEVICE)
    counter = CountLaunches(gemv_mod._gemv_parts_kernel)
    monkeypatch.setattr(gemv_mod, "_gemv_parts_kernel", counter)
    gemv_parts(
        dev(x),
        [
            Part(dev(raws[0]), widths[0], q_out, bias=dev(bias)),
            (dev(raws[1]), widths[1], k_out, None, None),
            Part(dev(raws[2]), widths[2], cache, out_row=(pos, widths[2])),
        ],
        fmt,
    )
    assert counter.launches == 1
    results = (q_out, k_out, cache[3 : 3 + m])
    for i, (raw, n, got) in enumerate(zip(raws, widths, results, strict=True)):
        want, scale = _reference(x, raw, fmt, n, k)
        b = bias if i == 0 else np.zeros(n)
        check(got, want + b, gamma(k + EPILOGUE_ROUNDINGS) * (scale + np.abs(b)))


def test_parts_of_a_wide_and_a_narrow_product() -> None:
    # a query wide enough for four rows a warp beside a key of one: the launch takes the narrow part's tile
    rng = np.random.default_rng(44)
    fmt, k, widths = Format.Q4_K, kernels.WIDE_K, (kernels.WIDE_N, 32)
    assert kernels.rows_a_warp(fmt, widths[0], k, 1) != kernels.rows_a_warp(fmt, widths[1], k, 1)
    x = _x(1, k, rng)
    raws = [raw_weights(fmt, n, k, rng) for n in widths]
    outs = [torch.empty((1, n), device=DEVICE) for n in widths]
    gemv_parts(dev(x), [Part(dev(r), n, o) for r, n, o in zip(raws, widths, outs, strict=True)], fmt)
    for raw, n, got in zip(raws, widths, outs, strict=True):
        want, scale = _reference(x, raw, fmt, n, k)
        check(got, want, gamma(k) * scale)


# A step's launch in parts of two formats under activations=dequant (Qwen3-Next's Q4_K_M recipe: a delta-rule
# layer's Q6_K q/k/v rows beside its Q4_K gate; its IQ4_XS recipe: Q5_K beside IQ4_XS, decoded a value at a
# time): each part in its own format's k loop at the launch's one tile, the second format's part with a bias and
# landing at a table's row at a device position
# (Q3_K beside Q5_K: its Q3_K_M recipe; Q8_0 beside F32: a file whose gates' rows the converter kept in floats)
@pytest.mark.parametrize(
    ("first", "second"),
    [(Format.Q4_K, Format.Q6_K), (Format.IQ4_XS, Format.Q5_K), (Format.Q3_K, Format.Q5_K), (Format.Q8_0, Format.F32)],
    ids=lambda f: f.name,
)
def test_parts_of_two_formats(first: Format, second: Format, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(int(first) * 31 + int(second))
    k, widths, fmts = 256, (32, 8, 16), (first, second, first)
    x = _x(1, k, rng)
    raws = [raw_weights(f, n, k, rng) for f, n in zip(fmts, widths, strict=True)]
    bias = rng.standard_normal(widths[1]).astype(np.float32)
    table = torch.zeros((4, widths[1]), device=DEVICE)
    pos = torch.tensor([2], dtype=torch.int64, device=DEVICE)
    outs = [torch.zeros((1, widths[0]), device=DEVICE), table, torch.zeros((1, widths[2]), device=DEVICE)]
    counter = CountLaunches(gemv_mod._gemv_parts_kernel)
    monkeypatch.setattr(gemv_mod, "_gemv_parts_kernel", counter)
    parts = [Part(dev(raws[0]), widths[0], outs[0]), Part(dev(raws[1]), widths[1], table, dev(bias), (pos, widths[1])),
             Part(dev(raws[2]), widths[2], outs[2])]  # fmt: skip
    gemv_parts(dev(x), parts, fmts)
    assert counter.launches == 1
    for i, (raw, f, n) in enumerate(zip(raws, fmts, widths, strict=True)):
        want, scale = _reference(x, raw, f, n, k)
        b = bias if i == 1 else np.zeros(n)
        got = table[2:3] if i == 1 else outs[i]
        check(got, want + b, gamma(k + EPILOGUE_ROUNDINGS) * (scale + np.abs(b)))
    assert not table[[0, 1, 3]].any()


def test_parts_take_at_most_two_formats() -> None:
    rng = np.random.default_rng(52)
    fmts = (Format.Q4_K, Format.Q6_K, Format.Q8_0)
    x = dev(_x(1, 256, rng))
    parts = [Part(dev(raw_weights(f, 4, 256, rng)), 4, torch.zeros((1, 4), device=DEVICE)) for f in fmts]
    with pytest.raises(ValueError, match="at most 2 formats"):
        gemv_parts(x, parts, fmts)


def test_parts_take_at_most_gemm_parts() -> None:
    rng = np.random.default_rng(50)
    raw, x = dev(raw_weights(Format.Q8_0, 8, 64, rng)), dev(_x(1, 64, rng))
    parts = [Part(raw, 8, torch.empty((1, 8), device=DEVICE)) for _ in range(kernels.GEMM_PARTS + 1)]
    with pytest.raises(ValueError, match="parts"):
        gemv_parts(x, parts, Format.Q8_0)


def test_wrong_byte_count_is_refused() -> None:
    rng = np.random.default_rng(51)
    raw, x = dev(raw_weights(Format.Q4_K, 8, 256, rng)), dev(_x(1, 256, rng))
    with pytest.raises(ValueError, match="bytes"):
        gemv(x, raw[:-1].clone(), Format.Q4_K, 8, 256, torch.empty((1, 8), device=DEVICE))


def _glu_case(fmt: Format, m: int, n: int, k: int, rng: np.random.Generator) -> None:
    x = _x(m, k, rng)
    raw_g, raw_u = raw_weights(fmt, n, k, rng), raw_weights(fmt, n, k, rng)
    out = torch.empty((m, n), device=DEVICE)
    gemv_gate_up_glu(dev(x), dev(raw_g), dev(raw_u), fmt, n, k, out)
    g, g_scale = _reference(x, raw_g, fmt, n, k)
    u, u_scale = _reference(x, raw_u, fmt, n, k)
    silu = g / (1 + np.exp(-g))
    want = silu * u
    # |d(SiLU(g) u)| <= slope |dg| (|u| + |du|) + |SiLU(g)| |du|, plus the epilogue's own roundings
    dg, du = gamma(k) * g_scale, gamma(k) * u_scale
    bound = SILU_SLOPE * dg * (np.abs(u) + du) + np.abs(silu) * du + GLU_ULPS * U32 * np.abs(want)
    check(out, want, bound)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("fmt", [Format.Q4_K, Format.Q6_K, Format.Q8_0], ids=lambda f: f.name)
def test_gate_up_glu(fmt: Format, m: int) -> None:
    _glu_case(fmt, m, N, K, np.random.default_rng(60 + m))


# --- real shapes, on a GPU only ----------------------------------------------------------------------------------


def _real_case(fmt: Format, n: int, k: int) -> None:
    rng = np.random.default_rng(70)
    raw = raw_weights(fmt, n, k, rng)
    x = _x(1, k, rng)
    out = torch.empty((1, n), device=DEVICE)
    gemv(dev(x), dev(raw), fmt, n, k, out)
    torch.cuda.synchronize()
    w = torch.from_numpy(dequantize(raw, fmt, (n, k))).to(DEVICE, torch.float64)
    x64 = dev(x).double()
    want = (x64 @ w.T).cpu().numpy()
    scale = (x64.abs() @ w.abs().T).cpu().numpy()
    check(out, want, gamma(k) * scale)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_real_q4_k_projection() -> None:
    _real_case(Format.Q4_K, 4096, 4096)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_real_q8_0_output_head() -> None:
    _real_case(Format.Q8_0, 151936, 896)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_real_q6_k_gate_up_glu() -> None:
    _glu_case(Format.Q6_K, 1, 4864, 4096, np.random.default_rng(71))
