"""A mixture's kept experts in a grid or ternary format for a step's or a batch's rows (`triton.grid.experts`)
against NumPy in f64 at tiny shapes, under the interpreter on a CPU (compiled on a GPU).

Each product is the f64 product of the dequantized experts (`gguf.dequant`, bit for bit what the kernel
decodes) with the f32 activation, within gamma_(k + 8) of sum |w x| per dot (Higham 3.1), carried through
SiLU, the route weights and the adds; the norm within `norm_rel` more, its int8 form bit for bit the lane's
own quantize of the normed row. A wrong expert, slot or tile moves a value by about its size.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, dev, gamma, norm_rel, raw_weights  # noqa: E402

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.lanes.cuda.triton import quant  # noqa: E402
from fuselane.lanes.cuda.triton.gemv import fast_norm  # noqa: E402
from fuselane.lanes.cuda.triton.grid.experts import grid_down_combine, grid_gate_up  # noqa: E402
from fuselane.lanes.cuda.triton.moe import down  # noqa: E402

ROUNDINGS = 8
SILU_SLOPE = 1.1  # |d/dg SiLU(g)| <= 1.1
EPS = 1e-6
IDS = np.array([[3, 1, 0], [0, 3, 2]], dtype=np.int32)  # expert 4 idle; 3 and 0 in both rows


def _experts(fmt: Format, experts: int, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    raw = raw_weights(fmt, experts * n, k, rng)
    return raw, dequantize(raw, fmt, (experts, n, k), dtype=np.float64)


def _dot_bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return gamma(x.shape[-1] + ROUNDINGS) * (np.abs(w) @ np.abs(x))


def _values(acts: quant.Q8Acts, rows: int, k: int) -> np.ndarray:
    """The values an int8 form's codes stand for, (rows, k) f64."""
    codes = acts.q.cpu().numpy().astype(np.float64).reshape(rows, -1, 32)
    return (codes * acts.d.cpu().numpy().astype(np.float64).reshape(rows, -1, 1)).reshape(rows, k)


# 8-wide and 4-wide grid rows, IQ1's offset, a ternary format's digits; 48 rows: three tiles, the last partial. On
# int8 rows (a grid format's), each row quantized by the lane (`quant.quantize`): the products over its codes in
# f64, the gate's and the up product's integer sums exact, so within the f32 dot's bound of them
@pytest.mark.parametrize(
    ("fmt", "int8"),
    [(Format.IQ2_XXS, False), (Format.IQ3_S, False), (Format.IQ1_M, False), (Format.TQ1_0, False),
     (Format.IQ2_XXS, True), (Format.IQ3_S, True), (Format.IQ1_M, True)],
)  # fmt: skip
@pytest.mark.parametrize("rows", [1, 2])
def test_gate_up_reads_only_the_kept_experts(fmt, int8, rows):
    rng = np.random.default_rng(int(fmt) * (5 if int8 else 1) + rows)
    experts, n, k, slots = 5, 48, 512, 3
    rg, wg = _experts(fmt, experts, n, k, rng)
    ru, wu = _experts(fmt, experts, n, k, rng)
    x32 = rng.standard_normal((rows, k)).astype(np.float32)
    acts = quant.quantize(dev(x32), quant.empty_q8(rows, k, DEVICE)) if int8 else dev(x32)
    x = _values(acts, rows, k) if int8 else x32.astype(np.float64)
    ids = IDS[:rows]
    out = torch.full((rows * slots, n), np.nan, device=DEVICE)
    grid_gate_up(acts, dev(rg), dev(ru), fmt, dev(ids), n, k, out)
    for p, e in enumerate(ids.reshape(-1)):
        xr = x[p // slots]
        g, u = wg[e] @ xr, wu[e] @ xr
        silu = g / (1 + np.exp(-g))
        bound = SILU_SLOPE * _dot_bound(wg[e], xr) * np.abs(u) + np.abs(silu) * _dot_bound(wu[e], xr)
        bound += 4 * gamma(1) * np.abs(silu * u) + 1e-30
        got = out[p].double().cpu().numpy()
        assert np.all(np.abs(got - silu * u) <= bound), f"pair {p}"


@pytest.mark.parametrize("fmt", [Format.IQ2_S, Format.IQ1_S])
def test_the_int8_pairs_feed_the_int8_down(fmt):
    # gate/up writes each pair's SwiGLU row in int8 too (the lane's own quantize of it, bit for bit, the counters
    # left at zero); the down reads those codes: within the f32 dot's bound of f64 over them
    from fuselane.lanes.cuda.triton.gemv.q8_epilogue import q8_counters

    rng = np.random.default_rng(int(fmt))
    experts, d, dff, k, rows, slots = 5, 64, 256, 256, 1, 3
    rg, _ = _experts(fmt, experts, dff, k, rng)
    ru, _ = _experts(fmt, experts, dff, k, rng)
    rd, wd = _experts(fmt, experts, d, dff, rng)
    ids, pairs = IDS[:rows], rows * slots
    x = quant.quantize(dev(rng.standard_normal((rows, k)).astype(np.float32)), quant.empty_q8(rows, k, DEVICE))
    h, hq = torch.empty((pairs, dff), device=DEVICE), quant.empty_q8(pairs, dff, DEVICE)
    counters = q8_counters(pairs * dff, DEVICE)
    grid_gate_up(x, dev(rg), dev(ru), fmt, dev(ids), dff, k, h, hq, counters)
    for got, ref in zip(hq, quant.quantize(h, quant.empty_q8(pairs, dff, DEVICE)), strict=True):
        assert torch.equal(got.cpu(), ref.cpu())
    assert not counters.any()
    weights = rng.random((rows, slots)).astype(np.float32)
    sum_out = torch.empty((rows, d), device=DEVICE)
    grid_down_combine(hq, dev(rd), fmt, dev(ids), dev(weights), d, dff, sum_out)
    hx = _values(hq, pairs, dff)
    for r in range(rows):
        terms = [weights[r, j] * (wd[ids[r, j]] @ hx[r * slots + j]) for j in range(slots)]
        bound = sum(weights[r, j] * _dot_bound(wd[ids[r, j]], hx[r * slots + j]) for j in range(slots))
        bound += slots * gamma(2) * sum(np.abs(t) for t in terms) + 1e-30
        assert np.all(np.abs(sum_out[r].double().cpu().numpy() - sum(terms)) <= bound)


@pytest.mark.parametrize(
    ("fmt", "rows", "adds", "norm", "q8"),
    [(Format.IQ2_XS, 1, 1, True, True), (Format.IQ3_XXS, 2, 2, True, False), (Format.IQ1_S, 2, 1, False, False),
     (Format.TQ2_0, 1, 0, True, False), (Format.IQ2_S, 1, 1, True, False)],
)  # fmt: skip
def test_down_combines_adds_and_norms(fmt, rows, adds, norm, q8, monkeypatch):
    # a width of 64 normed in two chunks of 32 (the last program reads the row back); a second launch runs the
    # same, each counter re-armed; the last array added may be the sum's own buffer
    monkeypatch.setattr(fast_norm, "NORM_CHUNK", 32)
    rng = np.random.default_rng(int(fmt) * 3 + rows)
    experts, d, dff, slots = 5, 64, 256, 3
    rd, wd = _experts(fmt, experts, d, dff, rng)
    h = rng.standard_normal((rows * slots, dff)).astype(np.float32)
    ids = IDS[:rows]
    wts = rng.uniform(0.1, 0.6, (rows, slots)).astype(np.float32)
    res = [rng.standard_normal((rows, d)).astype(np.float32) for _ in range(adds)]
    norm_w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    sum_out, out = torch.zeros((rows, d), device=DEVICE), torch.zeros((rows, d), device=DEVICE)
    out_q8 = quant.empty_q8(rows, d, DEVICE) if q8 else None
    counter = down.counters(rows, DEVICE)
    spec = down.Norm(dev(norm_w), EPS, out, out_q8) if norm else None
    for _ in range(2):
        grid_down_combine(dev(h), dev(rd), fmt, dev(ids), dev(wts), d, dff, sum_out, adds=tuple(dev(r) for r in res),
                          norm=spec, counter=counter)  # fmt: skip
    assert not counter.any(), "a counter was left armed"
    hv = h.astype(np.float64)
    for r in range(rows):
        want = sum((a[r].astype(np.float64) for a in res), np.zeros(d))
        bound = sum((np.abs(a[r]) * gamma(slots + adds) for a in res), np.zeros(d))
        for j in range(slots):
            pair, e = r * slots + j, ids[r, j]
            y = wd[e] @ hv[pair]
            want = want + wts[r, j] * y
            bound = bound + wts[r, j] * _dot_bound(wd[e], hv[pair]) + gamma(slots + adds + 1) * np.abs(wts[r, j] * y)
        got = sum_out[r].double().cpu().numpy()
        assert np.all(np.abs(got - want) <= bound + 1e-30), f"row {r}"
        if norm:
            normed = got / np.sqrt(np.mean(got**2) + EPS) * norm_w
            np.testing.assert_allclose(out[r].double().cpu().numpy(), normed, rtol=4 * norm_rel(d), atol=0)
    if q8:
        codes, scales, _ = quant.quantize_reference(out.cpu().numpy())
        assert np.array_equal(out_q8.q.cpu().numpy(), codes) and np.array_equal(out_q8.d.cpu().numpy(), scales)


def test_the_grid_experts_refuse_what_they_do_not_take():
    rng = np.random.default_rng(0)
    raw, _ = _experts(Format.IQ2_XXS, 2, 16, 256, rng)
    x, ids, out = torch.zeros((1, 256)), dev(np.array([[0, 1]], dtype=np.int32)), torch.zeros((2, 16))
    with pytest.raises(ValueError, match="no grid expert products for Q4_K"):
        grid_gate_up(x, dev(raw), dev(raw), Format.Q4_K, ids, 16, 256, out)
    with pytest.raises(ValueError, match="whole 256-value blocks"):
        grid_gate_up(x, dev(raw), dev(raw), Format.IQ2_XXS, ids, 32, 128, out)
    with pytest.raises(ValueError, match="whole experts"):
        grid_gate_up(x, dev(raw)[:-1], dev(raw)[:-1], Format.IQ2_XXS, ids, 16, 256, out)
    with pytest.raises(ValueError, match="out must be"):
        grid_gate_up(x, dev(raw), dev(raw), Format.IQ2_XXS, ids, 16, 256, torch.zeros((1, 16)))
    with pytest.raises(ValueError, match="counter"):
        grid_down_combine(torch.zeros((2, 256)), dev(raw), Format.IQ2_XXS, ids, torch.ones(2), 16, 256,
                          torch.zeros(16), norm=down.Norm(torch.ones(16), EPS, torch.zeros(16)))  # fmt: skip
