"""The int8 GEMV over a batch's rows (`gemv_q8_rows`) against the one-row int8 GEMV (`gemv_q8`) run on each row
alone: the same tile, the same per-group sums in the same order, the same epilogue, so bit for bit equal; and,
through that, within the one-row kernel's bound of x_q @ dequantize(raw).T (`test_gemv_q8.py`), checked here
once more against `gguf.quants`' dequantization for one format.

Tiny shapes (the interpreter runs every program's loop in Python): 3 and 5 rows (one tile of 4 or 8 rows with
rows past m dropped), 10 rows (two tiles of 8), rows not whole tiles of outputs, and a row walked in several
chunks with the last partial.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import CUDA, DEVICE, U16, check, dev, gamma, raw_weights  # noqa: E402
from test_gemv_q8 import GLU_ULPS, ROUNDINGS, SILU_SLOPE, _reference  # noqa: E402

from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.lanes.cuda.triton import quant  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.parts import Part  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.q8 import gemv_q8, gemv_q8_gate_up_glu, gemv_q8_parts  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.q8_rows import (  # noqa: E402
    gemv_q8_rows,
    gemv_q8_rows_gate_up_glu,
    gemv_q8_rows_parts,
    supports,
)

# (format, k, rows, tile): Q4_K walks its 5-unit rows in chunks of 2 (two rows a program, one warp, one
# (row, group) a thread), the last partial; Q6_K in three chunks of a unit (`SMALL_TILE`); Q8_0 in two tiles of
# 8 rows; Q5_0 in one tile of 8 rows with 3 dropped; Q8_0 and Q5_0 at their own tiles
SMALL_TILE = {"block_n": 4, "warps": 1, "per_thread": 1}
CASES = [
    (Format.Q4_K, 1280, 2, {"block_n": 2, "warps": 1, "per_thread": 1}), (Format.Q6_K, 768, 2, SMALL_TILE),
    (Format.Q8_0, 64, 10, {}), (Format.Q5_0, 96, 5, {}),
]  # fmt: skip
Q6_K_BYTES, Q6_K_CODE_BYTES = 210, 192  # a Q6_K block, and its ql and qh (its first bytes)
N = 5  # not whole tiles: rows past n are computed and dropped


def _acts(m: int, k: int, rng: np.random.Generator) -> quant.Q8Acts:
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 4.0, (m, 1))).astype(np.float32)
    x[0, : quant.QK] = 0.0  # an all-zero block: scale 0, codes 0
    return quant.quantize(dev(x), quant.empty_q8(m, k, DEVICE))


def _same(got: torch.Tensor, alone: torch.Tensor, bound: np.ndarray) -> None:
    """Bit for bit under the interpreter. Compiled, the last sum over a program's groups may take another order
    in the rows' 3-D accumulator's layout than in the one-row kernel's: each is within `bound` (the one-row
    kernel's own, `test_gemv_q8.py`) of the exact value, so they are within twice it of each other."""
    if not CUDA:
        assert torch.equal(got, alone)
    else:
        check(got, alone.cpu().double().numpy(), 2 * bound)


def _row(acts: quant.Q8Acts, i: int) -> quant.Q8Acts:
    """Row i alone, as the one-row kernel takes it (its own aligned copy)."""
    return quant.Q8Acts(acts.q[i : i + 1].clone(), acts.d[i : i + 1].clone(), acts.s[i : i + 1].clone())


def _alone(acts: quant.Q8Acts, run) -> torch.Tensor:
    """Each row through the one-row kernel (`run(row, i)` -> its (1, n) result), stacked."""
    return torch.cat([run(_row(acts, i), i) for i in range(acts.q.shape[0])])


@pytest.mark.parametrize(("fmt", "k", "m", "tile"), CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_rows_equal_each_row_alone(fmt: Format, k: int, m: int, tile: dict) -> None:
    rng = np.random.default_rng(int(fmt) * 100 + m)
    raw = raw_weights(fmt, N, k, rng)
    w, acts = dev(raw), _acts(m, k, rng)
    out = torch.full((m, N), float("nan"), device=DEVICE)
    assert gemv_q8_rows(acts, w, fmt, N, k, out, **tile) is out
    want = _alone(acts, lambda row, _: gemv_q8(row, w, fmt, N, k, torch.empty((1, N), device=DEVICE), **tile))
    _same(out, want, gamma(k + ROUNDINGS) * _reference(acts, raw, fmt, N, k)[1])


@pytest.mark.parametrize(
    ("fmt", "k", "m", "tile"), CASES[:1] + [(Format.Q8_0, 64, 2, {})], ids=lambda v: getattr(v, "name", str(v))
)
def test_gate_up_glu_rows_equal_each_row_alone(fmt: Format, k: int, m: int, tile: dict) -> None:
    rng = np.random.default_rng(int(fmt) + 7)
    raw_g, raw_u = raw_weights(fmt, N, k, rng), raw_weights(fmt, N, k, rng)
    wg, wu, acts = dev(raw_g), dev(raw_u), _acts(m, k, rng)
    out = torch.full((m, N), float("nan"), device=DEVICE)
    gemv_q8_rows_gate_up_glu(acts, wg, wu, fmt, N, k, out, **tile)
    empty = torch.empty((1, N), device=DEVICE)
    want = _alone(acts, lambda row, _: gemv_q8_gate_up_glu(row, wg, wu, fmt, N, k, empty.clone(), **tile))
    (g, g_scale), (u, u_scale) = _reference(acts, raw_g, fmt, N, k), _reference(acts, raw_u, fmt, N, k)
    silu = g / (1 + np.exp(-g))
    bound = gamma(k + ROUNDINGS) * (SILU_SLOPE * g_scale * np.abs(u) + np.abs(silu) * u_scale)
    _same(out, want, bound + GLU_ULPS * 2.0**-24 * np.abs(silu * u))


def test_parts_bias_residual_and_rows_at_a_position_equal_each_row_alone() -> None:
    """Three parts: a residual added to part 0, a bias on part 1, part 2's rows landing at rows pos .. pos + m - 1
    of a table (a batch's staging rows in f16, as a KV cache's)."""
    fmt, k, m = Format.Q4_K, 512, 3
    rng = np.random.default_rng(11)
    ns = (N, 16, 9)
    raws = [raw_weights(fmt, n, k, rng) for n in ns]
    ws = [dev(raw) for raw in raws]
    acts = _acts(m, k, rng)
    bias_np = rng.standard_normal(ns[1]).astype(np.float32)
    res = rng.standard_normal((m, ns[0])).astype(np.float32)
    bias, out0, out1 = dev(bias_np), dev(res.copy()), torch.zeros((m, ns[1]), device=DEVICE)
    table = torch.zeros((m + 3, ns[2]), dtype=torch.float16, device=DEVICE)
    pos = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    parts = [Part(ws[0], ns[0], out0), Part(ws[1], ns[1], out1, bias), Part(ws[2], ns[2], table, None, (pos, ns[2]))]
    gemv_q8_rows_parts(acts, parts, fmt, residual=out0)
    refs = [_reference(acts, raw, fmt, n, k) for raw, n in zip(raws, ns, strict=True)]
    for i in range(m):
        row, dres = _row(acts, i), dev(res[i : i + 1].copy())
        one = torch.zeros((1, ns[1]), device=DEVICE)
        cache = torch.zeros((1, ns[2]), dtype=torch.float16, device=DEVICE)
        zero = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        alone = [
            Part(ws[0], ns[0], dres),
            Part(ws[1], ns[1], one, bias),
            Part(ws[2], ns[2], cache, None, (zero, ns[2])),
        ]
        gemv_q8_parts(row, alone, fmt, residual=dres)
        bounds = [
            gamma(k + ROUNDINGS) * (ref[1][i : i + 1] + np.abs(extra))
            for ref, extra in zip(refs, (res[i], bias_np, 0.0), strict=True)
        ]
        _same(out0[i : i + 1], dres, bounds[0])
        _same(out1[i : i + 1], one, bounds[1])
        # the f16 rows: each sum rounded once more to f16, within half a step of f16 (relative) of it
        _same(table[2 + i : 3 + i], cache, bounds[2] + U16 * np.abs(refs[2][0][i : i + 1]))
    assert not table[[0, 1, 5]].any()


def test_rows_within_the_bound_of_gguf_dequantization() -> None:
    """The rows against x_q @ W.T in f64, W from `gguf.quants.dequantize` (the format's own library), within
    the one-row kernel's bound (`test_gemv_q8.py`): gamma_(k + 8) times sum_i (|w_i| + |offset_i|) |x_i|,
    offset_i the value a zero code decodes to (Q6_K's code bias, which the kernel subtracts apart)."""
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    fmt, k, m = Format.Q6_K, 512, 3
    rng = np.random.default_rng(5)
    raw = raw_weights(fmt, N, k, rng)
    acts = _acts(m, k, rng)
    out = torch.empty((m, N), device=DEVICE)
    gemv_q8_rows(acts, dev(raw), fmt, N, k, out)
    zero = raw.reshape(-1, Q6_K_BYTES).copy()
    zero[:, :Q6_K_CODE_BYTES] = 0  # ql and qh: every code 0
    w, off = (
        gguf_quants.dequantize(b.reshape(N, -1), GGMLQuantizationType.Q6_K).astype(np.float64) for b in (raw, zero)
    )
    xq = quant.dequantize(acts).cpu().double().numpy()
    check(out, xq @ w.T, gamma(k + 8) * (np.abs(xq) @ (np.abs(w) + np.abs(off)).T))


def test_supports_and_bad_inputs() -> None:
    assert supports(Format.Q4_K, 64, 512) and supports(Format.Q8_0, 2, 96)
    assert not supports(Format.Q4_K, 2, 96) and not supports(Format.F16, 2, 512)
    rng = np.random.default_rng(2)
    acts = _acts(2, 96, rng)
    w = dev(raw_weights(Format.Q8_0, N, 96, rng))
    with pytest.raises(ValueError, match=r"\(2, 5\)"):
        gemv_q8_rows(acts, w, Format.Q8_0, N, 96, torch.empty((1, N), device=DEVICE))
    with pytest.raises(ValueError, match="no int8 GEMV"):
        gemv_q8_rows(acts, w, Format.F16, N, 96, torch.empty((2, N), device=DEVICE))
