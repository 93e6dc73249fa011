"""The super-block prefill GEMM (`gemm_sb`, Q4_K and Q6_K) against `gguf.quants` dequantization, in f64.

The reference is built from gguf's own dequantizer, not the kernel's decode. The activation is the f16 rounding
`f16_scale.to_f16` makes (its own tests check it), as f64.

Q4_K: the kernel multiplies exactly d * sc * q and dmin * mn (nothing rounded to f16), so the reference is
x16 @ W^T with W gguf's f32 weights. Its error: f32 sums of exact products, gamma_k of the magnitudes of the two
terms taken apart (the d term and the minimum term can each exceed |w|), a few f32 roundings of the scaling
(and of gguf's own f32 weights), and the minimum's sub-block sums held as an f16 head and tail: relative 2^-22,
and a tail below f16's normals rounds within 2^-25 (times 32, the sums' shift: 2^-25 times the row's |minima|).
The two terms' weights come from gguf too, each with the other scale's bytes zeroed.

Q6_K: the kernel rounds sc * (q - 32) to f16 once and multiplies by d in f32, so the reference takes gguf's
weights with d set to 1.0 (exactly sc * (q - 32)), rounds them to f16 and multiplies by each super-block's d.
A wrong code, sub-scale, row or column moves an output by about its own size, far past the bounds.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")
quants = pytest.importorskip("gguf.quants")

from gguf.constants import GGMLQuantizationType as QT  # noqa: E402
from kernel_checks import CUDA, DEVICE, U16, U32, check, dev, gamma, raw_weights  # noqa: E402

from fuselane.gguf.formats import Format, row_bytes  # noqa: E402
from fuselane.lanes.cuda.triton import f16_scale, f16_sums  # noqa: E402
from fuselane.lanes.cuda.triton import gemm_sb as G  # noqa: E402

SUPER = G.SUPER
TILE = dict(block_m=16, block_n=16)  # small tiles: a few rows reach several tiles and partial ones
Q4K_D, Q4K_DMIN = slice(0, 2), slice(2, 4)  # byte ranges of a Q4_K super-block's d and dmin
Q6K_D = slice(208, 210)
F16_ONE = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
SUBNORMAL_HALF_STEP = 2.0**-25


def _blocks(raw: np.ndarray, fmt: Format) -> np.ndarray:
    return raw.reshape(-1, row_bytes(fmt, SUPER)).copy()


def _dequant(blocks: np.ndarray, qt: QT, n: int, k: int) -> np.ndarray:
    return quants.dequantize(blocks.reshape(-1), qt).reshape(n, k).astype(np.float64)


def _q4k_reference(raw: np.ndarray, n: int, k: int):
    """gguf's weights, and the magnitudes of their d term and their minimum term apart."""
    blocks = _blocks(raw, Format.Q4_K)
    main, low = blocks.copy(), blocks.copy()
    main[:, Q4K_DMIN] = 0  # d * sc * q
    low[:, Q4K_D] = 0  # -dmin * mn
    w = _dequant(blocks, QT.Q4_K, n, k)
    return w, np.abs(_dequant(main, QT.Q4_K, n, k)), np.abs(_dequant(low, QT.Q4_K, n, k))


def _q6k_reference(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """d * f16(sc * (q - 32)): gguf's weights under d = 1 rounded to f16, times each super-block's d."""
    blocks = _blocks(raw, Format.Q6_K)
    d = blocks[:, Q6K_D].copy().view(np.float16).astype(np.float64).reshape(n, k // SUPER)
    blocks[:, Q6K_D] = F16_ONE
    w16 = _dequant(blocks, QT.Q6_K, n, k).astype(np.float16).astype(np.float64)
    return w16 * np.repeat(d, SUPER, axis=1)


def _x16(x: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """The activation as the lane rounds it (`f16_scale.to_f16`): f16 rows, their scales, and x16 * s in f64."""
    x16 = torch.empty(x.shape, dtype=torch.float16, device=DEVICE)
    s = torch.empty(x.shape[0], dtype=torch.float32, device=DEVICE)
    f16_scale.to_f16(dev(x), x16, s)
    return x16, s, x16.double().cpu().numpy() * s.double().cpu().numpy()[:, None]


def _sums(x: np.ndarray) -> torch.Tensor:
    """The activation's sub-block sums as `f16_sums` writes them (its f16 rows checked against `to_f16`'s)."""
    m, k = x.shape
    x16, s, sums = (torch.empty(x.shape, dtype=torch.float16, device=DEVICE), torch.empty(m, device=DEVICE),
                    torch.empty((m, k // 16), dtype=torch.float16, device=DEVICE))  # fmt: skip
    f16_sums.f16_sums(dev(x), x16, s, sums)
    want16, want_s, _ = _x16(x)
    assert torch.equal(x16, want16) and torch.equal(s, want_s), "f16_sums rounds the rows unlike to_f16"
    return sums


def _run(fmt: Format, x: np.ndarray, raw: np.ndarray, n: int, k: int, **kw) -> torch.Tensor:
    out = torch.empty((x.shape[0], n), device=DEVICE)
    x16, s, _ = _x16(x)
    sums = _sums(x) if fmt is Format.Q4_K else None
    return G.gemm_sb(x16, s, sums, dev(raw), fmt, n, k, out, **TILE, **kw)


def test_sub_block_sums_are_head_and_tail_of_the_f16_rows_sums():
    # each 32 values' sum of the f16 rows (scaled rows included) / 32: head + tail within 2^-22 of it relative
    # (the f32 sum of 32 f16 values within gamma_31, the tail's rounding 2^-22) and 2^-25 absolute (a tail
    # under f16's normals); the rows are to_f16's, bit for bit (`_sums`)
    m, k = 6, 3 * SUPER
    rng = np.random.default_rng(15)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[::2] *= np.float32(1e6)
    got = _sums(x).double().cpu().numpy().reshape(m, k // 32, 2).sum(axis=2)
    x16, _, _ = _x16(x)
    groups = x16.double().cpu().numpy().reshape(m, k // 32, 32)
    want, mag = groups.sum(axis=2) / 32, np.abs(groups).sum(axis=2) / 32
    bound = (gamma(31) + 2.0**-22) * mag + SUBNORMAL_HALF_STEP
    assert np.all(np.abs(got - want) <= bound)


def _q4k_bound(xd: np.ndarray, main: np.ndarray, low: np.ndarray, k: int) -> np.ndarray:
    terms = np.abs(xd) @ (main + low).T
    return (gamma(k + SUPER) + U16 * U16 * 4 + 6 * U32) * terms + SUBNORMAL_HALF_STEP * low.sum(axis=1)[None, :]


@pytest.mark.parametrize("scale", [1.0, 1e6], ids=["unit", "past-f16"])
def test_q4_k_matches_gguf(scale):
    # rows past f16's range (every third times 1e6) take a power-of-two scale that the epilogue multiplies back
    m, n, k = 20, 40, 2 * SUPER
    rng = np.random.default_rng(11)
    raw = raw_weights(Format.Q4_K, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[::3] *= np.float32(scale)
    w, main, low = _q4k_reference(raw, n, k)
    _, _, xd = _x16(x)
    out = _run(Format.Q4_K, x, raw, n, k)
    check(out, xd @ w.T, _q4k_bound(xd, main, low, k))


def test_q4_k_minimum_sums_keep_their_tail():
    # only the minimum term (d zeroed), activations near 1 with 11 bits each: a sub-block's sum takes ~16 bits,
    # so its f16 head alone would be off by ~2^-12 of the output, far past the bound the head and tail meet
    m, n, k = 8, 16, SUPER
    rng = np.random.default_rng(14)
    blocks = _blocks(raw_weights(Format.Q4_K, n, k, rng), Format.Q4_K)
    blocks[:, Q4K_D] = 0
    raw = blocks.reshape(-1)
    x = (1 + rng.integers(0, 1024, (m, k)) / 1024).astype(np.float32)
    w, main, low = _q4k_reference(raw, n, k)
    _, _, xd = _x16(x)
    check(_run(Format.Q4_K, x, raw, n, k), xd @ w.T, _q4k_bound(xd, main, low, k))


def test_q6_k_matches_gguf():
    m, n, k = 20, 40, 2 * SUPER
    rng = np.random.default_rng(12)
    raw = raw_weights(Format.Q6_K, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = _q6k_reference(raw, n, k)
    _, _, xd = _x16(x)
    out = _run(Format.Q6_K, x, raw, n, k)
    check(out, xd @ w.T, (gamma(k) + 3 * U32) * (np.abs(xd) @ np.abs(w).T))


def test_bias_residual_and_rows_of_a_table():
    fmt, m, n, k = Format.Q6_K, 9, 24, SUPER
    rng = np.random.default_rng(13)
    raw = raw_weights(fmt, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias, res = rng.standard_normal(n).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    w = _q6k_reference(raw, n, k)
    x16, s, xd = _x16(x)
    want, mag = xd @ w.T, np.abs(xd) @ np.abs(w).T
    out = dev(res.copy())
    G.gemm_sb(x16, s, None, dev(raw), fmt, n, k, out, bias=dev(bias), residual=out, **TILE)
    total = want + bias + res
    check(out, total, (gamma(k) + 3 * U32) * mag + 2 * U32 * (np.abs(total) + np.abs(bias) + np.abs(res)))
    table = torch.zeros((m + 12, n + 8), dtype=torch.float16, device=DEVICE)
    pos = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    G.gemm_sb(x16, s, None, dev(raw), fmt, n, k, table, out_row=(pos, n + 8), **TILE)
    got = table.double().cpu().numpy()
    assert not got[:5].any() and not got[5 + m :].any() and not got[:, n:].any(), "rows outside were written"
    assert np.all(np.abs(got[5 : 5 + m, :n] - want) <= (gamma(k) + 3 * U32) * mag + U16 * np.abs(want) + 2.0**-24)


def test_supports_and_refusals():
    assert G.supports(Format.Q4_K, 3584) and G.supports(Format.Q6_K, 18944)
    assert not G.supports(Format.Q5_K, 4096) and not G.supports(Format.Q4_K, 896) and not G.supports(Format.Q8_0, 256)
    raw = dev(raw_weights(Format.Q4_K, 8, SUPER, np.random.default_rng(0)))
    x16, s = torch.zeros((4, SUPER), dtype=torch.float16, device=DEVICE), torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match="no super-block GEMM"):
        G.gemm_sb(x16, s, None, raw, Format.Q5_K, 8, SUPER, torch.empty((4, 8), device=DEVICE))
    with pytest.raises(ValueError, match="x16 must be"):
        G.gemm_sb(x16.float(), s, None, raw, Format.Q4_K, 8, SUPER, torch.empty((4, 8), device=DEVICE))
    with pytest.raises(ValueError, match="sub-block sums"):
        G.gemm_sb(x16, s, None, raw, Format.Q4_K, 8, SUPER, torch.empty((4, 8), device=DEVICE))
    sums = torch.zeros((4, SUPER // 16), dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="out must be"):
        G.gemm_sb(x16, s, sums, raw, Format.Q4_K, 8, SUPER, torch.empty((4, 9), device=DEVICE))


def test_narrow_tiles_where_the_wide_grid_leaves_sms_idle():
    # a 7B's 256-row chunk on an H200's 132 SMs: q/o (3584 rows: 28 programs), k/v (512) and down take 64 weight
    # rows a program; gate/up (18944 rows: 148 programs) the full 128
    assert [G.weight_rows(256, n, 132) for n in (3584, 512, 18944)] == [G.NARROW_N, G.NARROW_N, G.BLOCK_N]
    assert G.weight_rows(4096, 3584, 132) == G.BLOCK_N  # 28 x 32 programs fill it


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("fmt, n, k", [(Format.Q4_K, 18944, 3584), (Format.Q6_K, 3584, 18944)])
def test_cuda_real_shapes_at_the_default_tile(fmt, n, k):
    rng = np.random.default_rng(3)
    raw = raw_weights(fmt, n, k, rng)
    x = rng.standard_normal((256, k)).astype(np.float32)
    _, _, xd = _x16(x)
    out = torch.empty((256, n), device=DEVICE)
    G.product(dev(x), dev(raw), fmt, n, k, out)
    if fmt is Format.Q4_K:
        w, main, low = _q4k_reference(raw, n, k)
        bound = _q4k_bound(xd, main, low, k)
    else:
        w = _q6k_reference(raw, n, k)
        bound = (gamma(k) + 3 * U32) * (np.abs(xd) @ np.abs(w).T)
    check(out, xd @ w.T, bound)
