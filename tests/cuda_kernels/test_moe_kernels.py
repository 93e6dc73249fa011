"""The mixture kernels (`triton.moe`) against NumPy at tiny shapes, under the interpreter on a CPU.

Routing: the ids equal NumPy's stable arg-sort of the scores (the scores are spaced so no rounding can swap
two), the weights are the softmax at them (renormalised or not) within a few f32 roundings, the chunk's
order is NumPy's stable arg-sort of the ids. Products: each against the f64 product of the dequantized
weights (`gguf.dequant`) with the activation the kernel reads (f32 rows, or the int8 form's values), within
gamma_(k + 8) of sum |w x| per dot (Higham 3.1, as test_gemv_q8.py) carried through SiLU, the weights and the
adds; the norm within `norm_rel` more.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, dev, file_bytes_of, gamma, norm_rel, raw_weights  # noqa: E402

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.lanes.cuda.plan import kernels, moe_kernels  # noqa: E402
from fuselane.lanes.cuda.triton import quant  # noqa: E402
from fuselane.lanes.cuda.triton.gemv import q8 as gemv_q8  # noqa: E402
from fuselane.lanes.cuda.triton.moe import down, gate_up, route, shared  # noqa: E402

ROUNDINGS = 8
SILU_SLOPE = 1.1  # |d/dg SiLU(g)| <= 1.1


def _matrices(fmt: Format, experts: int, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    raw = raw_weights(fmt, experts * n, k, rng)
    return raw, dequantize(raw, fmt, (experts, n, k), dtype=np.float64)


def _softmax_topk(scores: np.ndarray, k: int, renorm: bool):
    ids = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    kept = np.take_along_axis(p, ids, -1)
    return ids, kept / kept.sum(-1, keepdims=True) if renorm else kept


@pytest.mark.parametrize(
    ("renorm", "rows", "experts"), [(True, 1, 12), (False, 1, 12), (True, 3, 12), (False, 3, 12), (True, 1, 160)]
)
def test_route_ranks_the_experts_and_sorts_the_pairs(renorm, rows, experts):
    # up to moe_kernels.MOE_RANK_BY_COUNT_EXPERTS a row's experts are ranked by counting, past it by arg-max passes
    rng = np.random.default_rng(1)
    d, k = 64, 3
    w = rng.standard_normal((experts, d)).astype(np.float32)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    ids, weights = torch.zeros((rows, k), dtype=torch.int32), torch.zeros((rows, k))
    order = torch.zeros(rows * k, dtype=torch.int32) if rows > 1 else None
    scores, counter = torch.zeros((rows, experts)), route.counters(DEVICE, rows)
    for _ in range(2):  # the counter re-arms: a second launch runs the same
        route.route(dev(x), dev(w.view(np.uint8)), Format.F32, experts, k, renorm, ids, weights, scores, counter,
                    order)  # fmt: skip
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    top = np.sort(exact, -1)[:, ::-1]
    assert np.all(top[:, k - 1] - top[:, k] > 1e-3), "a near-tie: pick another seed"
    want_ids, want_w = _softmax_topk(exact, k, renorm)
    assert np.array_equal(ids.numpy(), want_ids)
    np.testing.assert_allclose(weights.numpy(), want_w, rtol=1e-5, atol=1e-7)
    if order is not None:
        assert np.array_equal(order.numpy(), np.argsort(want_ids.reshape(-1), kind="stable"))
    assert not counter.any()


@pytest.mark.parametrize(
    ("fmt", "experts", "d"),
    [(Format.F32, 12, 96), (Format.BF16, 72, 64), (Format.F16, 40, 64), (Format.F32, 300, 64)],
    ids=["f32-one-tile", "bf16-three-tiles", "f16-two-tiles", "f32-ranked-in-groups-of-rows"],
)
def test_a_chunks_routing_product_on_the_tensor_core_tile(fmt, experts, d):
    # past the GEMV's rows a float router multiplies as tensor-core tiles (`moe_kernels.moe_route_chunk`): blocks of
    # 16 rows (the last partial) by 32 router rows (the last partial), a width past whole 64-value steps (96),
    # each block's rows' largest values split among its programs; ids, weights, order, counts and row scales as
    # the GEMV's tile gives them. 300 experts: a block is ranked a group of its rows at a time
    # (`moe_kernels.moe_rank_rows`), the sort's places carried across the groups, the last block's groups partly
    # or wholly past the chunk
    rng = np.random.default_rng(6)
    rows, k = 21, 3
    assert moe_kernels.moe_route_chunk(fmt, rows) and not moe_kernels.moe_route_chunk(fmt, kernels.GEMV_ROWS)
    block, warps = moe_kernels.MOE_ROUTE_CHUNK_ROWS, moe_kernels.MOE_ROUTE_CHUNK_WARPS
    groups = block // moe_kernels.moe_rank_rows(block, 1 << (experts - 1).bit_length(), warps)
    assert (groups > 2) == (experts > 256)
    dtype = {Format.F32: np.float32, Format.F16: np.float16, Format.BF16: np.float32}[fmt]
    w = rng.standard_normal((experts, d)).astype(dtype)
    if fmt is Format.BF16:  # the top half of each f32
        w = (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    raw = (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8) if fmt is Format.BF16 else w.view(np.uint8)
    x = (rng.standard_normal((rows, d)) * np.where(np.arange(rows) % 5 == 0, 1e5, 1.0)[:, None]).astype(np.float32)
    ids, weights = torch.zeros((rows, k), dtype=torch.int32), torch.zeros((rows, k))
    order, counts = torch.zeros(rows * k, dtype=torch.int32), torch.full((experts,), -1, dtype=torch.int32)
    scores, counter = torch.zeros((rows, experts)), route.counters(DEVICE, rows)
    amax = route.row_scales(DEVICE, rows, k, d)
    amax.h.fill_(7)
    for _ in range(2):  # the counters re-arm: a second launch runs the same
        route.route(dev(x), dev(raw.reshape(-1)), fmt, experts, k, True, ids, weights, scores, counter, order,
                    counts, amax=amax)  # fmt: skip
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 4 * gamma(d) * (np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64))
    assert np.all(np.abs(scores.numpy() - exact) <= bound)
    top = np.sort(exact, -1)[:, ::-1]
    assert np.all((top[:, k - 1] - top[:, k]) / np.abs(top[:, 0]) > 1e-4), "a near-tie: pick another seed"
    want_ids, want_w = _softmax_topk(exact, k, True)
    assert np.array_equal(ids.numpy(), want_ids)
    np.testing.assert_allclose(weights.numpy(), want_w, rtol=1e-5, atol=1e-7)
    assert np.array_equal(order.numpy(), np.argsort(want_ids.reshape(-1), kind="stable"))
    assert np.array_equal(counts.numpy(), np.bincount(want_ids.reshape(-1), minlength=experts))
    big = np.abs(x).max(1)
    assert np.array_equal(amax.x.numpy(), big)
    scale = np.where(big > 2.0**14, 2.0 ** np.ceil(np.log2(big / 2.0**14)), 1.0).astype(np.float32)
    assert np.array_equal(amax.x16.numpy(), (x / scale[:, None]).astype(np.float16))
    assert not amax.h.any() and not counter.any()


def test_a_decode_row_scores_each_expert_over_a_width_past_a_power_of_two():
    # the one-row routing path (an expert a program, its f32 router row read before the wait) masks the
    # columns past the width: 96 values in a block of 128
    rng = np.random.default_rng(3)
    experts, d, k = 12, 96, 2
    w = rng.standard_normal((experts, d)).astype(np.float32)
    x = rng.standard_normal((1, d)).astype(np.float32)
    ids, weights = torch.zeros((1, k), dtype=torch.int32), torch.zeros((1, k))
    scores = torch.zeros((1, experts))
    route.route(dev(x), dev(w.view(np.uint8)), Format.F32, experts, k, True, ids, weights, scores,
                route.counters(DEVICE, 1))  # fmt: skip
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = gamma(d) * (np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64))
    assert np.all(np.abs(scores.numpy() - exact) <= bound)
    assert np.array_equal(ids.numpy(), _softmax_topk(exact, k, True)[0])


@pytest.mark.parametrize("experts", [12, 160])
def test_route_keeps_the_lower_index_first_on_a_tie(experts):
    """Two equal router rows score the same bits: the lower index takes the earlier slot (a stable sort), by
    counting (12 experts) as by arg-max passes (160)."""
    rng = np.random.default_rng(4)
    d, k = 64, 3
    x = rng.standard_normal((1, d)).astype(np.float32)
    w = (rng.standard_normal((experts, d)) * 0.01).astype(np.float32)
    w[9] = x[0] / np.linalg.norm(x[0])  # the top score, then 2 and 7 equal
    w[7] = w[2] = w[9] * 0.5
    ids, weights = torch.zeros((1, k), dtype=torch.int32), torch.zeros((1, k))
    scores, counter = torch.zeros((1, experts)), route.counters(DEVICE, 1)
    route.route(dev(x), dev(w.view(np.uint8)), Format.F32, experts, k, True, ids, weights, scores, counter)
    assert ids.numpy().tolist() == [[9, 2, 7]]
    assert weights[0, 1] == weights[0, 2]


def _q8(x: np.ndarray):
    acts = quant.quantize(dev(x), quant.empty_q8(*x.shape, DEVICE))
    return acts, quant.dequantize(acts).double().numpy()


def _glu_bound(wg, wu, xv, g, u):
    dg = gamma(xv.shape[-1] + ROUNDINGS) * (np.abs(wg) @ np.abs(xv))
    du = gamma(xv.shape[-1] + ROUNDINGS) * (np.abs(wu) @ np.abs(xv))
    silu = g / (1 + np.exp(-g))
    return SILU_SLOPE * dg * np.abs(u) + np.abs(silu) * du + 4 * gamma(1) * np.abs(silu * u) + 1e-30


@pytest.mark.parametrize(
    ("fmt", "int8", "rows"),
    [(Format.Q8_0, True, 1), (Format.Q4_K, True, 1), (Format.Q6_K, False, 1), (Format.Q8_0, False, 2)],
)
def test_gate_up_reads_only_the_kept_experts(fmt, int8, rows):
    rng = np.random.default_rng(2)
    experts, n, k, slots = 5, 64, 256, 2
    rg, wg = _matrices(fmt, experts, n, k, rng)
    ru, wu = _matrices(fmt, experts, n, k, rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    ids_np = np.array([[3, 1], [0, 3]][:rows], dtype=np.int32)
    out = torch.zeros((rows * slots, n))
    q8out = quant.empty_q8(rows * slots, n, DEVICE) if int8 else None
    xin, xv = _q8(x) if int8 else (dev(x), x.astype(np.float64))
    gate_up.gate_up(xin, dev(rg), dev(ru), fmt, dev(ids_np), n, k, out, q8out)
    for p, e in enumerate(ids_np.reshape(-1)):
        xr = xv[p // slots]
        g, u = wg[e] @ xr, wu[e] @ xr
        want = g / (1 + np.exp(-g)) * u
        got = out[p].double().numpy()
        assert np.all(np.abs(got - want) <= _glu_bound(wg[e], wu[e], xr, g, u)), f"pair {p}"
    if int8:
        codes, d, sums = quant.quantize_reference(out.numpy())
        assert np.array_equal(q8out.q.numpy(), codes) and np.array_equal(q8out.d.numpy(), d)


def _shared(rng, d: int, sdff: int, fmt: Format):
    """A folded shared expert of `sdff` values, its scratch holding its SwiGLU and sigmoid as the gate/up
    launch would write them (rounded from f64), and its term of the down's sum with that term's bound."""
    s, glu, gate, glu_bound = _shared_expert(rng, d, sdff, fmt)
    s.scratch.copy_(torch.from_numpy(np.append(glu, gate).astype(np.float32)))
    wd = dequantize(file_bytes_of(fmt, s.down, sdff), fmt, (d, sdff)).astype(np.float64)
    bound = gamma(d + ROUNDINGS) * (np.abs(wd) @ (np.abs(glu) + glu_bound))
    return s, gate * (wd @ glu), gate * bound


def _shared_expert(rng, d: int, sdff: int, fmt: Format, int8: bool = False, gated: bool = True):
    """A shared expert (`shared.Shared`, gate/up/down in `fmt`, an f32 score row where `gated`) and, in f64, its
    SwiGLU (from the input's int8 form where `int8`), its gate's sigmoid (1 ungated) and the SwiGLU's bound."""
    rg, wg = _matrices(fmt, 1, sdff, d, rng)
    ru, wu = _matrices(fmt, 1, sdff, d, rng)
    rd, _ = _matrices(fmt, 1, d, sdff, rng)
    sc = (rng.standard_normal((1, d)) * 0.1).astype(np.float32)
    x = rng.standard_normal((1, d)).astype(np.float32)
    score, score_fmt = (dev(sc.view(np.uint8)), Format.F32) if gated else (None, None)
    g, u = dev(rg), dev(ru)
    tiles = int8 and shared.swiglu_tiles(fmt, fmt, sdff, d, g, u)  # as the binding decides it
    q8 = quant.empty_q8(1, sdff, DEVICE) if shared.int8_down(fmt, sdff, False, tiles) else None
    s = shared.Shared(dev(x), g, u, dev(rd), score, fmt, fmt, score_fmt, sdff, torch.zeros(sdff + 1), q8, tiles=tiles)
    xv = x[0].astype(np.float64)
    gate = 1 / (1 + np.exp(-(sc[0].astype(np.float64) @ xv))) if gated else 1.0  # the score reads the f32 input
    if int8:
        xv = _q8(x)[1][0]
    g, u = wg[0] @ xv, wu[0] @ xv
    return s, g / (1 + np.exp(-g)) * u, gate, _glu_bound(wg[0], wu[0], xv, g, u)


@pytest.mark.parametrize(("fmt", "int8", "sdff"), [(Format.Q8_0, True, 96), (Format.Q4_K, True, 256),
                                                   (Format.Q5_0, False, 64)])  # fmt: skip
@pytest.mark.parametrize("shared_int8", [True, False])
@pytest.mark.parametrize("gated", [True, False])
def test_a_folded_shared_expert_rides_the_gate_up_launch(fmt, int8, sdff, shared_int8, gated, monkeypatch):
    # its SwiGLU and sigmoid land in its scratch row beside the kept experts' products, which stay as they
    # were; a width of 96 is more tiles than the kept experts' 64 rows take. Under int8 activations its
    # SwiGLU takes the kept experts' int8 tiles (moe_kernels.MOE_SHARED_INT8) or the f32 products. An ungated
    # expert (DeepSeek's) has no score program: 1 where the sigmoid goes, its SwiGLU tiles all the same.
    monkeypatch.setattr(shared.moe_kernels, "MOE_SHARED_INT8", shared_int8)
    rng = np.random.default_rng(6)
    experts, n, k, slots = 4, 64, 256, 2
    rg, _ = _matrices(fmt, experts, n, k, rng)
    ru, _ = _matrices(fmt, experts, n, k, rng)
    s, glu, gate, glu_bound = _shared_expert(rng, k, sdff, fmt, int8 and shared_int8, gated)
    x = s.x.numpy()
    xin = _q8(x)[0] if int8 else dev(x)
    ids = dev(np.array([[3, 1]], dtype=np.int32))
    alone, beside = torch.zeros((slots, n)), torch.zeros((slots, n))
    gate_up.gate_up(xin, dev(rg), dev(ru), fmt, ids, n, k, alone)
    gate_up.gate_up(xin, dev(rg), dev(ru), fmt, ids, n, k, beside, shared=s)
    assert torch.equal(alone, beside)
    got = s.scratch.double().numpy()
    assert np.all(np.abs(got[:sdff] - glu) <= glu_bound)
    if not gated:
        assert got[sdff] == 1.0
        return
    score = s.score.numpy().view(np.float32).astype(np.float64)
    # the sigmoid's slope is at most 1/4: the score's product bound, then the sigmoid's own roundings
    bound = 0.25 * gamma(k + ROUNDINGS) * (np.abs(score) @ np.abs(x[0].astype(np.float64))) + gamma(4) * gate
    assert abs(got[sdff] - gate) <= bound


NEW, OLD = moe_kernels.MoeDown.READ_AHEAD, moe_kernels.MoeDown.SERIAL


@pytest.mark.parametrize(
    ("fmt", "int8", "rows", "shared", "dff", "slots", "variant", "d", "packed"),
    [(Format.Q8_0, True, 1, True, 256, 2, NEW, 32, False), (Format.Q6_K, True, 1, False, 256, 2, NEW, 32, False),
     (Format.Q8_0, False, 2, False, 256, 2, NEW, 32, False), (Format.Q5_0, False, 1, True, 256, 2, NEW, 32, False),
     (Format.Q4_K, True, 1, False, 768, 2, NEW, 32, False), (Format.Q4_K, True, 1, False, 256, 3, NEW, 32, False),
     (Format.Q5_0, True, 1, True, 256, 3, NEW, 32, False), (Format.Q8_0, True, 1, True, 256, 2, NEW, 64, False),
     (Format.Q8_0, True, 1, True, 256, 2, OLD, 64, False), (Format.Q5_0, True, 1, True, 256, 3, NEW, 64, True),
     (Format.Q4_K, True, 1, False, 256, 3, OLD, 32, True), (Format.Q8_0, True, 1, True, 256, 2, NEW, 32, True)],
)  # fmt: skip
def test_down_combines_adds_and_norms(fmt, int8, rows, shared, dff, slots, variant, d, packed, monkeypatch):
    # 768 values: Q4_K's three super-blocks (Qwen3-30B-A3B's experts); three kept experts: the int8 tile's
    # slots are four, the last one padding that must count 0; packed (moe_kernels.MOE_DOWN_PACKED), ten rows a
    # program of three experts, 30 of 32 entries, the last program's two rows past the width. A width of 64
    # walks the norm's row in two chunks of 32; both variants (MoeDown) sum the same terms.
    monkeypatch.setattr(down.fast_norm, "NORM_CHUNK", 32)
    rng = np.random.default_rng(3)
    experts = 5
    rd, wd = _matrices(fmt, experts, d, dff, rng)
    h = rng.standard_normal((rows * slots, dff)).astype(np.float32)
    ids_np = np.array([[4, 2, 1], [2, 0, 3]], dtype=np.int32)[:rows, :slots]
    wts = rng.uniform(0.1, 0.6, (rows, slots)).astype(np.float32)
    res = rng.standard_normal((rows, d)).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    hin, hv = _q8(h) if int8 else (dev(h), h.astype(np.float64))
    s, s_want, s_bound = _shared(rng, d, 128, fmt) if shared else (None, 0.0, 0.0)
    sum_out, out = torch.zeros((rows, d)), torch.zeros((rows, d))
    out_q8 = quant.empty_q8(rows, d, DEVICE) if int8 else None
    counter = down.counters(rows, DEVICE)
    for _ in range(2):  # every counter re-arms: a second launch runs the same
        down.down_combine(hin, dev(rd), fmt, dev(ids_np), dev(wts), d, dff, sum_out, adds=(dev(res),), shared=s,
                          norm=down.Norm(dev(norm_w), 1e-6, out, out_q8), counter=counter,
                          variant=variant, tile=down.Tile(packed=packed))  # fmt: skip
    assert not counter.any()
    for r in range(rows):
        want = res[r].astype(np.float64) + s_want
        bound = np.abs(res[r]) * gamma(slots + 2) + s_bound
        for j in range(slots):
            pair = r * slots + j
            y = wd[ids_np[r, j]] @ hv[pair]
            want = want + wts[r, j] * y
            bound = bound + wts[r, j] * gamma(dff + ROUNDINGS) * (np.abs(wd[ids_np[r, j]]) @ np.abs(hv[pair]))
            bound = bound + gamma(slots + 2) * np.abs(wts[r, j] * y)
        got = sum_out[r].double().numpy()
        assert np.all(np.abs(got - want) <= bound + 1e-30), f"row {r}"
        normed = got / np.sqrt(np.mean(got**2) + 1e-6) * norm_w
        np.testing.assert_allclose(out[r].double().numpy(), normed, rtol=4 * norm_rel(d), atol=0)
    if int8:
        codes, dq, _ = quant.quantize_reference(out.numpy())
        assert np.array_equal(out_q8.q.numpy(), codes)


# Qwen3-30B-A3B's and Qwen3-Next's experts, and six kept (DeepSeek-V2's count) of whole super-blocks
@pytest.mark.parametrize(("k", "dff"), [(8, 768), (10, 512), (6, 1536)])
@pytest.mark.parametrize("packed", [False, True])
def test_the_decode_down_tile_gives_each_thread_one_group_in_whole_chunks(k, dff, packed):
    """The int8 down tile (`moe_kernels.MOE_DOWN_TILE`): every kept expert a slot, or packed every (row, expert) an
    entry, one (row, 16-value group) a thread, and the row's super-blocks whole chunks (no masked chunk
    re-reading a unit)."""
    rows = moe_kernels.moe_down_rows(k, packed=packed)
    entries = moe_kernels.moe_down_entries(k, rows)
    assert entries == moe_kernels.MOE_DOWN_TILE and rows * k <= entries
    if packed:
        assert entries - rows * k < k  # no whole row more would fit
    else:
        assert rows * moe_kernels.moe_down_slots(k) == entries
    plan = gemv_q8.tile_plan(Format.Q4_K, dff, entries, moe_kernels.MOE_DOWN_WARPS, moe_kernels.MOE_DOWN_PER_THREAD)
    groups = entries * plan["CHUNK"] * gemv_q8.GROUPS[Format.Q4_K]
    assert groups == plan["num_warps"] * kernels.WARP * moe_kernels.MOE_DOWN_PER_THREAD
    assert plan["N_UNITS"] % plan["CHUNK"] == 0


@pytest.mark.parametrize(("fmt", "dff", "warps"), [(Format.Q5_0, 160, 2), (Format.Q4_K, 1024, 1)])
def test_the_down_orders_and_depths_give_the_same_bits(fmt, dff, warps):
    """MoeDown.READ_AHEAD at one, two and three chunks in flight (`down_rows.kept_dots`) sums what the old
    order sums, in its order, without a shared expert: the same bits. One warp a 32-row tile takes a unit a
    chunk (Q4_K's four: the loop and each tail), two warps two units (Q5_0's three chunks, the last partial)."""
    rng = np.random.default_rng(5)
    experts, d, slots = 4, 32, 2
    rd, _ = _matrices(fmt, experts, d, dff, rng)
    hin, _ = _q8(rng.standard_normal((slots, dff)).astype(np.float32))
    ids, wts = dev(np.array([[3, 1]], dtype=np.int32)), dev(rng.uniform(0.1, 0.6, (1, slots)).astype(np.float32))
    res, norm_w = dev(rng.standard_normal((1, d)).astype(np.float32)), dev(np.ones(d, np.float32))
    got = []
    for variant, depth in [(OLD, None), (NEW, 1), (NEW, 2), (NEW, 3)]:
        sum_out, out, out_q8 = torch.zeros((1, d)), torch.zeros((1, d)), quant.empty_q8(1, d, DEVICE)
        down.down_combine(hin, dev(rd), fmt, ids, wts, d, dff, sum_out, adds=(res,),
                          norm=down.Norm(norm_w, 1e-6, out, out_q8), counter=down.counters(1, DEVICE), variant=variant,
                          tile=down.Tile(moe_kernels.MOE_DOWN_TILE, warps, 1, depth))  # fmt: skip
        got.append([t.numpy().copy() for t in (sum_out, out, out_q8.q, out_q8.d)])
    assert np.isfinite(got[0][0]).all()
    for other in got[1:]:
        for a, b in zip(got[0], other, strict=True):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("fmt", [Format.Q4_K, Format.Q8_0])
@pytest.mark.parametrize("gated", [True, False])
def test_a_shared_expert_in_int8_tiles_takes_an_int8_down_product(fmt, gated):
    # where its SwiGLU runs as the kept experts' int8 tiles (`shared.swiglu_tiles`), the gate/up launch writes
    # that row's int8 form, bit for bit the quantizer's, and the down launch's product reads it: in Q4_K and
    # Q8_0 too, not only in the formats the f32 GEMV by rows does not decode at speed
    rng = np.random.default_rng(8)
    experts, n, k, slots, sdff = 4, 256, 256, 2, 256
    rg, _ = _matrices(fmt, experts, n, k, rng)
    ru, _ = _matrices(fmt, experts, n, k, rng)
    s, _, gate, _ = _shared_expert(rng, k, sdff, fmt, True, gated)
    assert s.tiles and s.down_int8
    ids = dev(np.array([[3, 1]], dtype=np.int32))
    h = torch.zeros((slots, n))
    gate_up.gate_up(_q8(s.x.numpy())[0], dev(rg), dev(ru), fmt, ids, n, k, h, shared=s)
    codes, dq, _ = quant.quantize_reference(s.scratch[:sdff].view(1, sdff).numpy())
    assert np.array_equal(s.scratch_q8.q.numpy(), codes) and np.array_equal(s.scratch_q8.d.numpy(), dq)
    glu_q = quant.dequantize(s.scratch_q8).double().numpy()[0]
    rd, wd = _matrices(fmt, experts, k, n, rng)
    hin, hv = _q8(h.numpy())
    wts = rng.uniform(0.1, 0.6, (1, slots)).astype(np.float32)
    sum_out = torch.zeros((1, k))
    down.down_combine(hin, dev(rd), fmt, ids, dev(wts), k, n, sum_out, shared=s, counter=down.counters(1, DEVICE))
    sd = dequantize(file_bytes_of(fmt, s.down, sdff), fmt, (k, sdff)).astype(np.float64)
    got_gate = float(s.scratch[sdff])
    want = got_gate * (sd @ glu_q)
    bound = got_gate * gamma(sdff + ROUNDINGS) * (np.abs(sd) @ np.abs(glu_q)) + gamma(slots + 2) * np.abs(want)
    for j, e in enumerate((3, 1)):
        y = wd[e] @ hv[j]
        want = want + wts[0, j] * y
        bound = (
            bound
            + wts[0, j] * gamma(n + ROUNDINGS) * (np.abs(wd[e]) @ np.abs(hv[j]))
            + gamma(slots + 2) * np.abs(wts[0, j] * y)
        )
    assert np.all(np.abs(sum_out[0].double().numpy() - want) <= bound + 1e-30)
    if not gated:
        assert got_gate == 1.0
        return
    score, x = s.score.numpy().view(np.float32).astype(np.float64), s.x.double().numpy()[0]
    assert abs(got_gate - gate) <= 0.25 * gamma(k + ROUNDINGS) * (np.abs(score) @ np.abs(x)) + gamma(4) * gate
