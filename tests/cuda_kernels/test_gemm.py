"""The prefill GEMM with in-kernel dequantization (`gemm`) against NumPy.

The reference multiplies exactly what the kernel multiplies: the activations rounded to f16 and every weight
the f32 value of `fuselane.gguf.dequant` rounded to f16 (the kernel's decode is bit-exact before that one
rounding, so the operands are the same numbers), in f64. Only the f32 sums round then: k products of f16
values are exact in f32 and k - 1 sums in any order put an output within gamma_k * sum_i |w_i x_i| (Higham
3.1), a bias and a residual one rounding each, an f16 output one more (relative 2^-11). A wrong code, scale,
row or column moves an output by about its own size, far past the bound.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import CUDA, DEVICE, U16, U32, check, dev, gamma, raw_weights  # noqa: E402

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.lanes.cuda.triton import gemm as G  # noqa: E402

FORMATS = [Format.Q4_K, Format.Q5_K, Format.Q6_K, Format.Q8_0, Format.Q5_0, Format.Q4_0, Format.F16]
# ...and the formats only the device values of `gemv/low_bits.py` decode
LOW_BITS = [Format.Q2_K, Format.Q3_K, Format.IQ4_NL, Format.IQ4_XS]
# Small tiles, so a few rows reach several tiles and a partial one of each kind.
TILE = dict(block_m=16, block_n=16)


def _case(fmt: Format, m: int, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    raw = raw_weights(fmt, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w16 = dequantize(raw, fmt, (n, k), dtype=np.float32).astype(np.float16).astype(np.float64)
    x16 = x.astype(np.float16).astype(np.float64)
    return raw, x, x16 @ w16.T, np.abs(x16) @ np.abs(w16).T


@pytest.mark.parametrize("fmt", FORMATS + LOW_BITS)
def test_gemm_matches_numpy(fmt):
    m, n, k = 20, 40, 512
    raw, x, want, mag = _case(fmt, m, n, k, int(fmt))
    out = torch.empty((m, n), device=DEVICE)
    G.gemm(dev(x), dev(raw), fmt, n, k, out, **TILE)
    check(out, want, gamma(k) * mag + 1e-30)


@pytest.mark.parametrize("fmt, k", [(Format.Q8_0, 160), (Format.IQ4_NL, 96), (Format.Q5_0, 1472), (Format.F16, 48)])
def test_rows_not_whole_128_value_steps(fmt, k):
    # a 32-value format's row of 5, 3 or 46 blocks: steps of the most blocks that divide it (one, one, two)
    assert G.step_units(fmt, k) * k > 0
    m, n = 10, 24
    raw, x, want, mag = _case(fmt, m, n, k, k)
    out = torch.empty((m, n), device=DEVICE)
    G.gemm(dev(x), dev(raw), fmt, n, k, out, **TILE)
    check(out, want, gamma(k) * mag + 1e-30)


def test_activations_past_f16_stay_finite():
    # rows of ~1e6 (f16 holds 65504) next to rows of ~1: each step's large rows are divided by a power of two
    # before their f16 rounding and scaled back, so the operands keep f16's relative rounding, 2^-11 each (a
    # value the division leaves below f16's normals, 2^-14, rounds within 2^-25 times its row's scale)
    fmt, m, n, k = Format.Q4_K, 20, 40, 512
    rng = np.random.default_rng(3)
    raw = raw_weights(fmt, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[::3] *= np.float32(1e6)
    w = dequantize(raw, fmt, (n, k), dtype=np.float32).astype(np.float16).astype(np.float64)
    xd = x.astype(np.float64)
    out = torch.empty((m, n), device=DEVICE)
    G.gemm(dev(x), dev(raw), fmt, n, k, out, **TILE)
    want, mag = xd @ w.T, np.abs(xd) @ np.abs(w).T
    scale = np.maximum(1.0, 2.0 ** np.ceil(np.log2(np.abs(xd).max(axis=1) / 2**14)))[:, None]
    bound = (gamma(k) + 2 * U16) * mag + scale * 2.0**-25 * np.abs(w).sum(axis=1)[None, :]
    assert np.abs(want).max() > np.finfo(np.float16).max
    check(out, want, bound)


def test_gemm_bias_residual_and_rows_of_a_table():
    fmt, m, n, k = Format.Q8_0, 9, 24, 256
    raw, x, want, mag = _case(fmt, m, n, k, 7)
    rng = np.random.default_rng(8)
    bias, res = rng.standard_normal(n).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    out = dev(res.copy())
    G.gemm(dev(x), dev(raw), fmt, n, k, out, bias=dev(bias), residual=out, **TILE)
    total = want + bias + res
    check(out, total, gamma(k) * mag + 2 * U32 * (np.abs(total) + np.abs(bias) + np.abs(res)))
    # rows 5 .. 5 + m of an f16 table of pitch n + 8, the position read from the device
    table = torch.zeros((m + 12, n + 8), dtype=torch.float16, device=DEVICE)
    pos = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    G.gemm(dev(x), dev(raw), fmt, n, k, table, out_row=(pos, n + 8), **TILE)
    got = table.double().cpu().numpy()
    assert not got[:5].any() and not got[5 + m :].any() and not got[:, n:].any(), "rows outside were written"
    bound = gamma(k) * mag + U16 * np.abs(want) + 2.0**-24
    assert np.all(np.abs(got[5 : 5 + m, :n] - want) <= bound)


def test_supports_and_refusals():
    assert G.supports(Format.Q4_K, 4096) and G.supports(Format.Q5_0, 896) and G.supports(Format.Q8_0, 4864)
    assert G.supports(Format.Q8_0, 96) and G.step_units(Format.Q8_0, 96) == 1  # three blocks: a block a step
    assert G.supports(Format.IQ4_XS, 4096) and G.supports(Format.MXFP4, 4096)  # MXFP4 kept as IQ4_NL is
    assert not G.supports(Format.Q4_K, 96)  # rows of whole super-blocks only
    raw = dev(raw_weights(Format.Q8_0, 8, 256, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="no prefill GEMM"):
        G.gemm(torch.zeros((4, 96), device=DEVICE), raw, Format.Q4_K, 8, 96, torch.empty((4, 8), device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        G.gemm(torch.zeros((4, 256), device=DEVICE), raw, Format.Q8_0, 8, 256, torch.empty((4, 9), device=DEVICE))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("fmt, n, k", [(Format.Q4_K, 4096, 4096), (Format.Q6_K, 4096, 12288), (Format.Q5_0, 4864, 896)])
def test_cuda_gemm_real_shapes(fmt, n, k):
    raw, x, want, mag = _case(fmt, 256, n, k, 3)
    out = torch.empty((256, n), device=DEVICE)
    G.gemm(dev(x), dev(raw), fmt, n, k, out)
    check(out, want, gamma(k) * mag + 1e-30)
