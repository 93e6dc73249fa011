"""A chunk's grouped expert GEMM (`triton.moe.grouped`) against NumPy at tiny shapes, under the interpreter.

The reference multiplies what the kernels multiply: the activations rounded to f16 and each expert's weights
(`gguf.dequant`'s f32) rounded to f16, in f64. An f32 sum of k exact f16 products is within gamma_k * sum
|w x| (Higham 3.1); SiLU's slope (at most 1.1) and the up product carry the gate's error, and a few f32
roundings more each result (SiLU, the products, the route weight). The combine sums k slots and the added
arrays in f32: k + 2 roundings of their magnitudes. The norm is checked against the f64 norm of the sums
the kernel wrote, within `norm_rel`. A wrong expert, pair, tile or slot moves a value by about its size.

Routing is given (ids drawn, each row's experts distinct; the order NumPy's stable sort, the counts its
bincount), with an expert no pair routes to, one in every row (several tiles), and a chunk whose every pair
routes to one expert. Each launch runs twice: the counters re-arm and the sums are the same bit for bit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import CUDA, DEVICE, U16, dev, gamma, norm_rel, raw_weights, within  # noqa: E402

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import Format, row_bytes  # noqa: E402
from fuselane.lanes.cuda.plan import moe_kernels  # noqa: E402
from fuselane.lanes.cuda.triton.moe import grouped, route  # noqa: E402
from fuselane.lanes.cuda.triton.moe import grouped_combine as gc  # noqa: E402

ROUNDINGS = 6
SILU_SLOPE = 1.1
EPS = 1e-6
# small tiles, so a few pairs reach several tiles of an expert and of the width
TILE = dict(block_m=8, block_n=32)


def _experts(fmt: Format, experts: int, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of (experts, n, k) random rows, and their values rounded to f16 (kept f16: the real widths')."""
    raw = raw_weights(fmt, experts * n, k, rng)
    return raw, dequantize(raw, fmt, (experts, n, k), dtype=np.float32).astype(np.float16)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def _routing(rows: int, slots: int, experts: int, rng, *, every: int | None, none: int | None) -> np.ndarray:
    """(rows, slots) distinct experts a row: `every` in each row's first slot, `none` in no row."""
    pool = [e for e in range(experts) if e not in (every, none)]
    ids = np.stack([rng.permutation(pool)[: slots - (every is not None)] for _ in range(rows)])
    if every is not None:
        ids = np.concatenate([np.full((rows, 1), every), ids], axis=1)
    return ids.astype(np.int32)


def _sorted(ids: np.ndarray, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable").astype(np.int32)
    return dev(order), dev(np.bincount(flat, minlength=experts).astype(np.int32))


def _glu(wg, wu, x16):
    """SiLU(gate) * up for each pair in f64, and its bound."""
    wg, wu = wg.astype(np.float64), wu.astype(np.float64)
    g, u = np.einsum("pnk,pk->pn", wg, x16), np.einsum("pnk,pk->pn", wu, x16)
    k = x16.shape[-1]
    dg = gamma(k) * np.einsum("pnk,pk->pn", np.abs(wg), np.abs(x16))
    du = gamma(k) * np.einsum("pnk,pk->pn", np.abs(wu), np.abs(x16))
    silu = g / (1 + np.exp(-g))
    want = silu * u
    return want, SILU_SLOPE * dg * np.abs(u) + np.abs(silu) * du + gamma(ROUNDINGS) * np.abs(want) + 1e-30


CASES = {
    # K formats (a super-block a step), a residual, the next norm; expert 3 idle, expert 0 in every row
    "q4_k-q6_k-norm": (Format.Q4_K, Format.Q6_K, 12, 2, 5, 256, 256, dict(every=0, none=3), 1, True),
    # 32-value formats (four blocks a step), two arrays added, one of them the sum's own buffer
    "q8_0-q5_0-adds": (Format.Q8_0, Format.Q5_0, 11, 3, 6, 128, 128, dict(every=None, none=2), 2, False),
    # every pair to one expert: its tiles are the chunk's, the others' none
    "one-expert": (Format.Q4_0, Format.Q8_0, 17, 1, 4, 128, 128, dict(every=1, none=None), 1, False),
    # the word decode a whole super-block a step (the table's is half of one); Q6_K's rows of 210 bytes put
    # every other row's block 2 bytes past a word
    "q6_k-q4_k-whole-steps": (Format.Q6_K, Format.Q4_K, 10, 2, 4, 256, 256, dict(every=None, none=1), 1, True),
    # rows the word decode's 128-value steps do not divide (160 and 96 values: IQ4_NL, llama.cpp's fallback for a
    # low-bit recipe's rows that are not whole super-blocks): the unit decode, a block a step
    "iq4_nl-q8_0-odd-rows": (Format.IQ4_NL, Format.Q8_0, 9, 2, 4, 160, 96, dict(every=None, none=1), 1, True),
}
# the values a step each case's word decode takes (the table's where not named)
STEPS = {"q6_k-q4_k-whole-steps": 256}


# Each word format at both launches' table tiles (`moe_kernels.moe_gemm_tile`: 64 pairs, up to 256 weight rows, the
# table's values a step; Q6_K, Q8_0 and Q5_0's gate/up the launch's default), at shapes a tile or two wide. A
# few pairs an expert (at most `moe_kernels.MOE_FEW_PAIRS`) take the few pairs' tiles where the table has them
# (Q4_K's 16-pair tiles, Q6_K's down); "-many" cases give each expert more.
TABLE_CASES = {
    "q4_k-q4_k": (Format.Q4_K, Format.Q4_K, 4, 2, 2, 256, 256, dict(every=0, none=None), 1, True),
    "q4_k-q4_k-many": (Format.Q4_K, Format.Q4_K, 18, 2, 2, 256, 256, dict(every=None, none=None), 1, False),
    "q8_0-q6_k": (Format.Q8_0, Format.Q6_K, 4, 2, 2, 256, 256, dict(every=None, none=None), 1, False),
    "q8_0-q6_k-many": (Format.Q8_0, Format.Q6_K, 18, 2, 2, 256, 256, dict(every=0, none=None), 1, True),
    "q6_k-q5_0": (Format.Q6_K, Format.Q5_0, 4, 2, 3, 256, 128, dict(every=2, none=None), 1, False),
    "q5_0-q8_0": (Format.Q5_0, Format.Q8_0, 4, 2, 3, 128, 128, dict(every=None, none=0), 1, True),
    # llama.cpp's MXFP4_MOE experts: both launches from words (the launches' default tiles)
    "mxfp4-mxfp4": (Format.MXFP4, Format.MXFP4, 6, 2, 3, 256, 128, dict(every=None, none=None), 1, True),
    # Q4_0's and IQ4_NL's 16 code bytes a block, as MXFP4's, their f16 d's after the row's blocks
    "q4_0-iq4_nl": (Format.Q4_0, Format.IQ4_NL, 6, 2, 3, 128, 256, dict(every=1, none=None), 1, False),
    # IQ4_XS's super-blocks (a scale a 32-value run, its d and scales after the row's blocks)
    "iq4_xs-iq4_xs": (Format.IQ4_XS, Format.IQ4_XS, 5, 2, 3, 256, 256, dict(every=None, none=2), 1, True),
    # the low-bit recipes' experts: Q2_K's and Q3_K's crumbs, a scale a 16-value sub-block
    "q2_k-q3_k": (Format.Q2_K, Format.Q3_K, 5, 2, 3, 256, 256, dict(every=0, none=None), 1, False),
    # the grid formats' tiles from their tables (`grid.values.grid_tile`): 8-wide and 4-wide grid rows, IQ1's
    # offset, and a ternary format's values each alone
    "iq2_xxs-iq3_s": (Format.IQ2_XXS, Format.IQ3_S, 5, 2, 3, 256, 256, dict(every=None, none=1), 1, True),
    "iq1_m-tq2_0": (Format.IQ1_M, Format.TQ2_0, 4, 2, 3, 256, 512, dict(every=0, none=None), 1, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_experts_match_numpy(case):
    _match_numpy(CASES[case], dict(TILE, step=STEPS.get(case)), len(case))


@pytest.mark.parametrize("case", list(TABLE_CASES))
def test_grouped_experts_at_the_tables_tiles(case):
    _match_numpy(TABLE_CASES[case], {}, len(case), runs=1)


def _match_numpy(shape: tuple, tile: dict, seed: int, runs: int = 2) -> None:
    """Both grouped launches of `shape` (CASES') at `tile` (the table's where not given) against NumPy, each
    launch `runs` times (twice: the counters re-arm and the sums stay the same bit for bit)."""
    fmt_gu, fmt_d, rows, slots, experts, d, dff, routing, adds, norm = shape
    rng = np.random.default_rng(seed)
    rg, wg = _experts(fmt_gu, experts, dff, d, rng)
    ru, wu = _experts(fmt_gu, experts, dff, d, rng)
    rd, wd = _experts(fmt_d, experts, d, dff, rng)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    ids = _routing(rows, slots, experts, rng, **routing)
    rw = rng.uniform(0.1, 1.0, (rows, slots)).astype(np.float32)
    order, counts = _sorted(ids, experts)
    pairs = rows * slots

    h = torch.full((pairs, dff), np.nan, device=DEVICE)
    for _ in range(runs):
        grouped.gate_up_grouped(dev(x), dev(rg), dev(ru), fmt_gu, experts, slots, order, counts, dff, d, h, **tile)
    e = ids.reshape(-1)
    want_h, bound_h = _glu(wg[e], wu[e], _f16(x)[np.arange(pairs) // slots])
    within(h.double().cpu().numpy().reshape(-1), want_h.reshape(-1), bound_h.reshape(-1), "gate/up")

    res = [rng.standard_normal((rows, d)).astype(np.float32) for _ in range(adds)]
    sum_out = dev(res[-1].copy())  # the last array added is the sum's own buffer
    added = tuple(dev(r) for r in res[:-1]) + (sum_out,)
    norm_w = dev(rng.standard_normal(d).astype(np.float32))
    gnorm = gc.GroupedNorm(norm_w, EPS, torch.zeros((rows, d), device=DEVICE)) if norm else None
    width_tiles = grouped.down_width_tiles(fmt_d, d, tile.get("block_n"), pairs / experts)
    c = gc.Combine(sum_out, gc.counters(rows, width_tiles, DEVICE), added, gnorm)
    pair_out = torch.empty(pairs * d, device=DEVICE)
    first = None
    for _ in range(runs):
        sum_out.copy_(dev(res[-1]))
        grouped.down_grouped(h, dev(rd), fmt_d, experts, order, counts, dev(rw), d, dff, pair_out, c, **tile)
        assert not c.counters.any(), "a counter was left armed"
        first = sum_out.clone() if first is None else first
    assert torch.equal(first, sum_out), "the combine's sum changed between launches"

    hv, wde = _f16(h.double().cpu().numpy()), wd[e].astype(np.float64)
    prods = np.einsum("pdk,pk->pd", wde, hv) * rw.reshape(-1, 1)
    mags = np.einsum("pdk,pk->pd", np.abs(wde), np.abs(hv)) * rw.reshape(-1, 1)
    want = prods.reshape(rows, slots, d).sum(1) + sum(r.astype(np.float64) for r in res)
    terms = np.abs(prods).reshape(rows, slots, d).sum(1) + sum(np.abs(r) for r in res)
    bound = gamma(dff + 1) * mags.reshape(rows, slots, d).sum(1) + gamma(slots + adds + 1) * terms + 1e-30
    got = sum_out.double().cpu().numpy()
    within(got.reshape(-1), want.reshape(-1), bound.reshape(-1), "down + combine")
    if norm:
        normed = got / np.sqrt((got * got).mean(-1, keepdims=True) + EPS) * gnorm.w.double().cpu().numpy()
        out = gnorm.out.double().cpu().numpy()
        within(out.reshape(-1), normed.reshape(-1), (norm_rel(d) * np.abs(normed)).reshape(-1) + 1e-30, "norm")


def test_activations_past_f16_stay_finite():
    # rows of the down products' input of ~1e6 (f16 holds 65504) beside rows of ~1: a step's large rows are
    # divided by a power of two before their f16 rounding and scaled back, so each operand keeps f16's relative
    # rounding, 2^-11 (a value the division leaves below f16's normals, 2^-14, rounds within 2^-25 of its scale)
    fmt, rows, slots, experts, d, dff = Format.Q4_K, 9, 2, 3, 256, 256
    rng = np.random.default_rng(11)
    rd, wd = _experts(fmt, experts, d, dff, rng)
    ids = _routing(rows, slots, experts, rng, every=None, none=None)
    order, counts = _sorted(ids, experts)
    h = rng.standard_normal((rows * slots, dff)).astype(np.float32)
    h[::3] *= np.float32(1e6)
    rw = np.ones((rows, slots), np.float32)
    sum_out = torch.zeros((rows, d))
    c = gc.Combine(sum_out, gc.counters(rows, -(-d // TILE["block_n"]), DEVICE))
    grouped.down_grouped(dev(h), dev(rd), fmt, experts, order, counts, dev(rw), d, dff, torch.empty(rows * slots * d),
                         c, **TILE)  # fmt: skip
    w, hd = wd[ids.reshape(-1)].astype(np.float64), h.astype(np.float64)
    prods = np.einsum("pdk,pk->pd", w, hd)
    mags = np.einsum("pdk,pk->pd", np.abs(w), np.abs(hd))
    scale = np.maximum(1.0, 2.0 ** np.ceil(np.log2(np.abs(hd).max(axis=1) / 2**14)))[:, None]
    tiny = scale * 2.0**-25 * np.abs(w).sum(axis=2)
    bound = (gamma(dff) + 2 * U16) * mags + tiny
    bound = bound.reshape(rows, slots, d).sum(1) + gamma(slots + 1) * np.abs(prods).reshape(rows, slots, d).sum(1)
    assert np.abs(prods).max() > np.finfo(np.float16).max
    within(sum_out.double().numpy().reshape(-1), prods.reshape(rows, slots, d).sum(1).reshape(-1), bound.reshape(-1),
           "down past f16")  # fmt: skip


def test_row_scales_take_activations_past_f16():
    # the launches as the lane binds them: the routing launch writes each row's largest |x| and zeroes the
    # pairs' largest |h|, gate/up takes one scale a row and raises h's, down takes h's: rows of x past f16's range
    # stay finite and within f16's rounding of each operand, as a step's scale keeps them
    fmt, rows, slots, experts, d, dff = Format.Q4_K, 9, 2, 3, 256, 256
    rng = np.random.default_rng(12)
    router = rng.standard_normal((experts, d)).astype(np.float32)
    (rg, wg), (ru, wu), (rd, wd) = (_experts(fmt, experts, n, k, rng) for n, k in ((dff, d), (dff, d), (d, dff)))
    x = rng.standard_normal((rows, d)).astype(np.float32)
    x[::4] *= np.float32(3e5)
    ids, weights = torch.zeros((rows, slots), dtype=torch.int32), torch.zeros((rows, slots))
    order, counts = torch.zeros(rows * slots, dtype=torch.int32), torch.zeros(experts, dtype=torch.int32)
    amax = route.row_scales(DEVICE, rows, slots, d)
    amax.h.fill_(-1)  # the routing launch zeroes it
    route.route(dev(x), dev(router.view(np.uint8)), Format.F32, experts, slots, True, ids, weights,
                torch.zeros((rows, experts)), route.counters(DEVICE, rows), order, counts, amax=amax)  # fmt: skip
    assert np.array_equal(amax.x.numpy(), np.abs(x).max(1))
    assert np.array_equal(amax.x16.numpy(), _scaled16(x))
    h = torch.zeros((rows * slots, dff))
    grouped.gate_up_grouped(dev(x), dev(rg), dev(ru), fmt, experts, slots, order, counts, dff, d, h, amax=amax,
                            **TILE)  # fmt: skip
    hs = h.double().numpy()
    assert np.isfinite(hs).all() and np.abs(hs).max() > np.finfo(np.float16).max
    assert np.array_equal(amax.h.numpy().view(np.float32), np.abs(h.numpy()).max(1))
    e = ids.numpy().reshape(-1)
    xv = x.astype(np.float64)[np.arange(rows * slots) // slots]
    scale = np.maximum(1.0, 2.0 ** np.ceil(np.log2(np.abs(xv).max(axis=1) / 2**14)))[:, None]
    g = np.einsum("pnk,pk->pn", wg[e].astype(np.float64), xv)
    u = np.einsum("pnk,pk->pn", wu[e].astype(np.float64), xv)
    mg = np.einsum("pnk,pk->pn", np.abs(wg[e]).astype(np.float64), np.abs(xv))
    mu = np.einsum("pnk,pk->pn", np.abs(wu[e]).astype(np.float64), np.abs(xv))
    tiny_g = scale * 2.0**-25 * np.abs(wg[e]).astype(np.float64).sum(axis=2)
    tiny_u = scale * 2.0**-25 * np.abs(wu[e]).astype(np.float64).sum(axis=2)
    silu = g / (1 + np.exp(-g))
    dg, du = (gamma(d) + 2 * U16) * mg + tiny_g, (gamma(d) + 2 * U16) * mu + tiny_u
    bound = SILU_SLOPE * dg * np.abs(u) + np.abs(silu) * du + gamma(ROUNDINGS) * np.abs(silu * u) + 1e-30
    within(hs.reshape(-1), (silu * u).reshape(-1), bound.reshape(-1), "gate/up past f16")
    sum_out = torch.zeros((rows, d))
    c = gc.Combine(sum_out, gc.counters(rows, -(-d // TILE["block_n"]), DEVICE))
    grouped.down_grouped(h, dev(rd), fmt, experts, order, counts, torch.ones((rows, slots)), d, dff,
                         torch.empty(rows * slots * d), c, h_amax=amax.h, **TILE)  # fmt: skip
    w = np.abs(wd[e].astype(np.float64))
    prods = np.einsum("pdk,pk->pd", wd[e].astype(np.float64), hs)
    hscale = np.maximum(1.0, 2.0 ** np.ceil(np.log2(np.abs(hs).max(axis=1) / 2**14)))[:, None]
    bound = (gamma(dff) + 2 * U16) * np.einsum("pdk,pk->pd", w, np.abs(hs)) + hscale * 2.0**-25 * w.sum(axis=2)
    bound = bound.reshape(rows, slots, d).sum(1) + gamma(slots + 1) * np.abs(prods).reshape(rows, slots, d).sum(1)
    within(sum_out.double().numpy().reshape(-1), prods.reshape(rows, slots, d).sum(1).reshape(-1), bound.reshape(-1),
           "down past f16")  # fmt: skip


@pytest.mark.parametrize("hist_a_thread", [route.HIST_A_THREAD, 0], ids=["one-pass", "many-passes"])
def test_route_sorts_and_counts_each_experts_pairs(hist_a_thread, monkeypatch):
    # more pairs than a pass of the sort's placing takes, over many blocks of rows: each expert's first place
    # carries from block to block, and from one pass to the next (of the placing, and of the blocks' histograms
    # where a pass takes few of them: at 0 values a thread, one block's histogram a pass, the least)
    monkeypatch.setattr(route, "HIST_A_THREAD", hist_a_thread)
    rng = np.random.default_rng(5)
    rows, experts, d, k = route.PAIRS_A_PASS // 2 + 10, 6, 64, 2
    w = rng.standard_normal((experts, d)).astype(np.float32)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    ids, weights = torch.zeros((rows, k), dtype=torch.int32), torch.zeros((rows, k))
    order, counts = torch.zeros(rows * k, dtype=torch.int32), torch.full((experts,), -1, dtype=torch.int32)
    scores = torch.zeros((rows, experts))
    route.route(dev(x), dev(w.view(np.uint8)), Format.F32, experts, k, True, ids, weights, scores,
                route.counters(DEVICE, rows), order, counts)  # fmt: skip
    got = ids.numpy().reshape(-1)
    assert np.array_equal(counts.numpy(), np.bincount(got, minlength=experts))
    assert np.array_equal(order.numpy(), np.argsort(got, kind="stable"))


def test_refusals():
    raw = dev(raw_weights(Format.Q8_0, 2 * 8, 96, np.random.default_rng(0)))
    order, counts = torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    assert not grouped.takes(Format.Q4_K, 8, 96) and grouped.takes(Format.Q4_K, 8, 256)
    assert grouped.takes(Format.Q8_0, 8, 96) and grouped.takes(Format.MXFP4, 8, 96)  # a block a step
    with pytest.raises(ValueError, match="no grouped GEMM"):
        grouped.gate_up_grouped(torch.zeros((2, 96)), raw, raw, Format.Q4_K, 2, 2, order, counts, 8, 96,
                                torch.zeros((4, 8)))  # fmt: skip


@pytest.mark.parametrize("fmt", [Format.Q4_0, Format.IQ4_NL, Format.MXFP4], ids=lambda f: f.name)
def test_16_byte_block_experts_decode_from_words_where_rows_are_whole_steps(fmt):
    # their unit decode spilled (sm_90: 255 registers and 752-792 stack bytes a thread in the gate/up launch)
    for launch, k in ((grouped.GATE_UP, 2048), (grouped.DOWN, 768)):
        assert grouped.format_consts(fmt, 8, k, launch=launch)["WORDS"]
    assert not grouped.format_consts(fmt, 8, 96, launch=grouped.DOWN)["WORDS"]  # a block a step


# --- compiled, at Qwen3-30B-A3B's widths (n_embd 2048, 128 experts, top-8, expert ffn 768) ------------------


REAL = (512, 8, 128, 2048, 768)  # rows, kept experts, experts, n_embd, expert ffn
V2_LITE = (512, 6, 64, 2048, 1408)  # DeepSeek-V2-Lite's: its down rows take a 32-value format


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(
    ("fmt_gu", "fmt_d", "shape", "row_scales"),
    [
        (Format.Q4_K, Format.Q4_K, REAL, True),
        (Format.Q4_K, Format.Q6_K, REAL, True),
        (Format.Q4_K, Format.Q6_K, REAL, False),
        (Format.Q4_K, Format.Q5_0, V2_LITE, True),
        (Format.Q4_K, Format.Q8_0, V2_LITE, True),
        (Format.MXFP4, Format.MXFP4, REAL, True),
        (Format.Q4_0, Format.IQ4_XS, REAL, True),
        (Format.Q2_K, Format.Q3_K, REAL, True),
    ],
)
def test_cuda_grouped_experts_real_widths(fmt_gu, fmt_d, shape, row_scales):
    # a sample of rows against the f64 reference, each of their experts dequantized alone (the cost); with the
    # row scales as the routing launch leaves them, or a step's own
    rows, slots, experts, d, dff = shape
    rng = np.random.default_rng(9)
    rg, ru, rd = (raw_weights(f, experts * n, kk, rng) for f, n, kk in ((fmt_gu, dff, d),) * 2 + ((fmt_d, d, dff),))
    x = rng.standard_normal((rows, d)).astype(np.float32)
    ids = np.stack([rng.permutation(experts)[:slots] for _ in range(rows)]).astype(np.int32)
    rw = rng.uniform(0.0, 0.3, (rows, slots)).astype(np.float32)
    order, counts = _sorted(ids, experts)
    pairs = rows * slots
    h = torch.empty((pairs, dff), device=DEVICE)
    zeros = torch.zeros(pairs, dtype=torch.int32, device=DEVICE)
    amax = route.RowScales(dev(np.abs(x).max(1)), dev(_scaled16(x)), zeros)
    grouped.gate_up_grouped(dev(x), dev(rg), dev(ru), fmt_gu, experts, slots, order, counts, dff, d, h,
                            amax=amax if row_scales else None)  # fmt: skip
    res = rng.standard_normal((rows, d)).astype(np.float32)
    sum_out = dev(res.copy())
    gnorm = gc.GroupedNorm(dev(np.ones(d, np.float32)), EPS, torch.zeros((rows, d), device=DEVICE))
    width_tiles = grouped.down_width_tiles(fmt_d, d)
    c = gc.Combine(sum_out, gc.counters(rows, width_tiles, DEVICE), (sum_out,), gnorm)
    pair_out = torch.empty(pairs * d, device=DEVICE)
    grouped.down_grouped(h, dev(rd), fmt_d, experts, order, counts, dev(rw), d, dff, pair_out, c,
                         h_amax=amax.h if row_scales else None)  # fmt: skip
    torch.cuda.synchronize()
    assert not c.counters.any()
    got, out, hs = (t.double().cpu().numpy() for t in (sum_out, gnorm.out, h))
    for r in rng.choice(rows, 4, replace=False):
        hv, prods, mags = _f16(hs[r * slots : (r + 1) * slots]), [], []
        for j, e in enumerate(ids[r]):
            wg, wu = (_expert(raw, fmt_gu, e, dff, d)[None] for raw in (rg, ru))
            want_h, bound_h = _glu(wg, wu, _f16(x[r])[None])
            within(hs[r * slots + j], want_h[0], bound_h[0], f"gate/up {r}, {j}")
            wd = _expert(rd, fmt_d, e, d, dff).astype(np.float64)
            prods.append(rw[r, j] * (wd @ hv[j]))
            mags.append(rw[r, j] * (np.abs(wd) @ np.abs(hv[j])))
        want = np.sum(prods, 0) + res[r]
        bound = gamma(dff + 1) * np.sum(mags, 0) + gamma(slots + 2) * (np.abs(prods).sum(0) + np.abs(res[r])) + 1e-30
        within(got[r], want, bound, f"down + combine {r}")
        normed = got[r] / np.sqrt((got[r] * got[r]).mean() + EPS)
        within(out[r], normed, norm_rel(d) * np.abs(normed) + 1e-30, f"norm {r}")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("shape", [REAL, V2_LITE], ids=["30b-a3b", "v2-lite"])
def test_cuda_route_sorts_a_chunk(shape):
    # a real chunk's routing: the order is the stable sort of the ids it wrote, the counts their histogram, each
    # row's experts distinct and its weights renormalised; twice, so the counters re-arm. The scores (the
    # tensor-core tile's three TF32 products, `moe_kernels.moe_route_chunk`) are within f32's rounding of the f64
    # product, and every row whose k-th and next scores are apart keeps the f64 product's experts
    rows, k, experts, d, _ = shape
    rng = np.random.default_rng(3)
    w = rng.standard_normal((experts, d)).astype(np.float32)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    ids, weights = torch.zeros((rows, k), dtype=torch.int32, device=DEVICE), torch.zeros((rows, k), device=DEVICE)
    order, counts = torch.zeros(rows * k, dtype=torch.int32, device=DEVICE), torch.zeros(experts, dtype=torch.int32,
                                                                                        device=DEVICE)  # fmt: skip
    counter, amax = route.counters(DEVICE, rows), route.row_scales(DEVICE, rows, k, d)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 4 * gamma(d) * (np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64))
    top = np.sort(exact, -1)[:, ::-1]
    apart = top[:, k - 1] - top[:, k] > 1e-3 * np.abs(top[:, 0])  # far past f32's rounding of the sums
    assert apart.mean() > 0.9
    for _ in range(2):
        scores = torch.zeros((rows, experts), device=DEVICE)
        route.route(dev(x), dev(w.view(np.uint8)), Format.F32, experts, k, True, ids, weights, scores, counter, order,
                    counts, amax=amax)  # fmt: skip
        assert np.all(np.abs(scores.cpu().numpy() - exact) <= bound)
        got = ids.cpu().numpy()
        want = np.argsort(-exact, axis=-1, kind="stable")[:, :k]
        assert np.array_equal(np.sort(got[apart], 1), np.sort(want[apart], 1))
        assert all(len(set(r)) == k for r in got)
        assert np.array_equal(order.cpu().numpy(), np.argsort(got.reshape(-1), kind="stable"))
        assert np.array_equal(counts.cpu().numpy(), np.bincount(got.reshape(-1), minlength=experts))
        np.testing.assert_allclose(weights.sum(1).cpu().numpy(), 1.0, rtol=1e-5)
        assert not counter.any() and not amax.h.any()
        assert np.array_equal(amax.x.cpu().numpy(), np.abs(x).max(1))
        assert np.array_equal(amax.x16.cpu().numpy(), _scaled16(x))


def _scaled16(x: np.ndarray) -> np.ndarray:
    """Each row divided by the power of two that brings it within 2^14 (1 where it is), rounded once to f16."""
    scale = np.maximum(1.0, 2.0 ** np.ceil(np.log2(np.abs(x).astype(np.float64).max(axis=1) / 2**14)))
    return (x / scale[:, None].astype(np.float32)).astype(np.float16)


def _expert(raw: np.ndarray, fmt: Format, e: int, n: int, k: int) -> np.ndarray:
    """Expert e's (n, k) values of a 3-D expert tensor's bytes, rounded to f16."""
    size = n * row_bytes(fmt, k)
    return dequantize(raw[e * size : (e + 1) * size], fmt, (n, k), dtype=np.float32).astype(np.float16)


def test_a_chunk_of_few_pairs_an_expert_takes_the_few_pairs_tiles():
    """At most MOE_FEW_PAIRS pairs an expert on average (the 80B-A3B's ~10 of a 512-row chunk's) take the timed
    few-pairs tiles; more, or a format without one, the word decode's table."""
    few, many = moe_kernels.MOE_FEW_PAIRS, moe_kernels.MOE_FEW_PAIRS + 1
    for (fmt, launch), tile in moe_kernels.MOE_FEW_PAIRS_TILES.items():
        assert moe_kernels.moe_gemm_tile(fmt, launch, few) == tile
        assert moe_kernels.moe_gemm_tile(fmt, launch, many) == moe_kernels.MOE_WORDS_TILES.get(
            (fmt, launch), moe_kernels.MOE_WORDS_DEFAULT[launch]
        )
    assert (
        moe_kernels.moe_gemm_tile(Format.Q8_0, moe_kernels.MoeLaunch.DOWN, 1)
        == moe_kernels.MOE_WORDS_TILES[Format.Q8_0, moe_kernels.MoeLaunch.DOWN]
    )
    d = 2048
    assert grouped.down_width_tiles(Format.Q4_K, d, pairs_an_expert=few) == d // 128
    assert grouped.down_width_tiles(Format.Q4_K, d, pairs_an_expert=many) == d // 256
