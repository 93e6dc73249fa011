"""Routing on the device: each row's router scores (x @ Wr^T over every expert), its top-k experts and their
weights (the routing probabilities at the kept ones, renormalised over the k where the model says so, scaled),
and in a chunk the (row, slot) pairs ordered by expert (ExpertSort) and the pairs each expert takes (what the
grouped GEMM cuts into tiles, `grouped.py`), in one launch.

Gating: the softmax over every expert, or (DeepSeek-V3) each score's sigmoid with the experts ranked by their
probabilities plus a per-expert correction bias; the kept weights scaled by the model's factor.

Programs take tiles of experts of a block of rows (up to the GEMV's 8, which read the router's rows once;
a decode step's one row takes an expert a program, `kernels.moe_route_tile`, whose f32 router row is read
before the wait for the launch that wrote x, `_router_row`) and store the scores; a
block's last program to finish (a self-resetting counter a block, `fast_norm.norm_last`'s memory ordering)
ranks its rows, so a chunk's blocks are ranked in parallel, and in a chunk the last block ranked (another
counter) sorts the pairs. Ranking: a decode step's row of up to `kernels.MOE_RANK_BY_COUNT_EXPERTS`
experts places each expert by the count of those ahead of it (one comparison of every pair, one
reduction); more experts, or a block of a chunk's rows, take k arg-max passes;
both put the lower index first on a tie, as the cpu lane's stable sort. Sorting: the stable counting sort
of the pairs by expert id (P * (E + 128) comparisons for P pairs and E experts). Ids are int32 and never
leave the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.formats import dot_rows
from fuselane.lanes.cuda.triton.gemv.layout import FMT_F32
from fuselane.lanes.cuda.triton.moe.common import f32_plan, tiles

# Pairs a pass of the counting sort takes: the one program that sorts walks a chunk's pairs twice (counting,
# then placing), a load from L2 and a few block reductions a pass, so fewer, wider passes are shorter;
# 128 a pass keep the launch within the registers its products take (ptxas, sm_90: 4 bytes spilled, 256
# spilled 464).
PAIRS_A_PASS = 128
RANK_BY_COUNT = tl.constexpr(kernels.MOE_RANK_BY_COUNT_EXPERTS)  # a kernel reads a constexpr global only


@triton.jit
def _rank_row(scores, ids, weights, bias, scale, r, E: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr,
              K_BLOCK: tl.constexpr, RENORM: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
              ONE_ROW: tl.constexpr):  # fmt: skip
    """Row r's kept experts and weights from its scores (ONE_ROW: a block of one row, which may rank by count)."""
    ex = tl.arange(0, E_BLOCK)
    live = ex < E
    s = tl.load(scores + r * E + ex, mask=live, other=float("-inf"), cache_modifier=".cg")
    if SIGMOID:  # each score's own probability; e^-s overflows to inf for s << 0: the right 0
        p = tl.where(live, 1.0 / (1.0 + tl.exp(-s)), 0.0)
    else:
        p = tl.where(live, tl.exp(s - tl.max(s, 0)), 0.0)
        p = p / tl.sum(p, 0)
    # the choice scores: the probabilities (plus the correction bias) where the model ranks by them; a
    # softmax without a bias ranks as its scores do
    c = s
    if SIGMOID:
        c = p
    if BIAS:
        c = p + tl.load(bias + ex, mask=live, other=0.0)
    c = tl.where(live, c, float("-inf"))
    if E_BLOCK <= RANK_BY_COUNT and ONE_ROW:
        _keep_by_count(ids, weights, scale, r, c, p, ex, live, K, RENORM)
    else:
        _keep_by_passes(ids, weights, scale, r, c, p, ex, K, K_BLOCK, RENORM)


@triton.jit
def _keep_by_count(ids, weights, scale, r, c, p, ex, live, K: tl.constexpr, RENORM: tl.constexpr):
    """Row r's kept experts by each one's place: the experts ahead of it (a higher choice score, or an equal
    one at a lower index: the arg-max passes' order), counted in one E x E comparison; the first K write
    their id and weight at their place."""
    ahead = (c[None, :] > c[:, None]) | ((c[None, :] == c[:, None]) & (ex[None, :] < ex[:, None]))
    place = tl.sum(ahead.to(tl.int32), 1)
    kept = live & (place < K)
    w = tl.where(kept, p, 0.0)
    if RENORM:
        w = w / tl.sum(w, 0)
    tl.store(ids + r * K + place, ex, mask=kept)
    tl.store(weights + r * K + place, w * scale, mask=kept)


@triton.jit
def _keep_by_passes(ids, weights, scale, r, c, p, ex, K: tl.constexpr, K_BLOCK: tl.constexpr,
                    RENORM: tl.constexpr):  # fmt: skip
    """Row r's kept experts by K arg-max passes over the choice scores `c` (the lower index first on a tie)."""
    slot = tl.arange(0, K_BLOCK)
    kept_ids = tl.zeros([K_BLOCK], tl.int32)
    kept = tl.zeros([K_BLOCK], tl.float32)
    for j in tl.static_range(K):
        best = tl.argmax(c, 0, tie_break_left=True)
        kept_ids = tl.where(slot == j, best.to(tl.int32), kept_ids)
        kept = tl.where(slot == j, tl.sum(tl.where(ex == best, p, 0.0), 0), kept)
        c = tl.where(ex == best, float("-inf"), c)
    if RENORM:
        kept = kept / tl.sum(kept, 0)
    tl.store(ids + r * K + slot, kept_ids, mask=slot < K)
    tl.store(weights + r * K + slot, kept * scale, mask=slot < K)


@triton.jit
def _count_pairs(ids, P: tl.constexpr, PB: tl.constexpr, E_BLOCK: tl.constexpr):
    """[E_BLOCK] int32: the pairs routed to each expert."""
    ex = tl.arange(0, E_BLOCK)
    total = tl.zeros([E_BLOCK], tl.int32)
    for a in range(0, tl.cdiv(P, PB)):
        pa = a * PB + tl.arange(0, PB)
        ka = tl.load(ids + pa, mask=pa < P, other=-1, cache_modifier=".cg")
        total += tl.sum((ka[:, None] == ex[None, :]).to(tl.int32), 0)
    return total


@triton.jit
def _sort_pairs(ids, order, counts, P: tl.constexpr, PB: tl.constexpr, E: tl.constexpr, E_BLOCK: tl.constexpr,
                COUNT: tl.constexpr):  # fmt: skip
    """order[rank] = p, the rank of pair p its place among the pairs by (expert id, p): a stable counting sort.
    A pair's rank is its expert's first place (the pairs of lower experts) plus the pairs of its expert before
    it: those of earlier passes (a running count an expert) and of its own pass (a PB x PB comparison), so
    the work is P * (E + PB), not P * P. With COUNT, counts[e] = the pairs of expert e too."""
    ex = tl.arange(0, E_BLOCK)
    total = _count_pairs(ids, P, PB, E_BLOCK)
    seen = tl.cumsum(total, 0) - total  # the pairs before each expert's first, then before this pass's
    i = tl.arange(0, PB)
    for a in range(0, tl.cdiv(P, PB)):
        pa = a * PB + i
        ka = tl.load(ids + pa, mask=pa < P, other=-1, cache_modifier=".cg")
        hit = ka[:, None] == ex[None, :]
        first = tl.sum(tl.where(hit, seen[None, :], 0), 1)
        ahead = tl.sum(((ka[None, :] == ka[:, None]) & (i[None, :] < i[:, None])).to(tl.int32), 1)
        tl.store(order + first + ahead, pa, mask=pa < P)
        seen += tl.sum(hit.to(tl.int32), 0)
    if COUNT:
        tl.store(counts + ex, total, mask=ex < E)


@triton.jit
def _router_row(w_row, x, D: tl.constexpr, D_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """[1] f32: x . one f32 router row (a decode step's program, `kernels.moe_route_tile`). The row is a weight,
    so it is loaded before the wait for the launch that wrote x (`pdl`): a coherent load with a barrier after
    it, which ptxas does not sink below the barrier nor hoist the wait above, so the row's DRAM round trip
    runs under the launch before's serial tail (its last program's norm) instead of after it."""
    cols = tl.arange(0, D_BLOCK)
    wr = tl.load(w_row.to(tl.pointer_type(tl.float32)) + cols, mask=cols < D, other=0.0)
    tl.debug_barrier()
    pdl.wait(PDL)
    xr = tl.load(x + cols, mask=cols < D, other=0.0)
    return tl.sum(wr * xr, 0) + tl.zeros([1], tl.float32)


@triton.jit
def _route_kernel(
    x, w, scores, ids, weights, order, counts, counter, bias, scale,
    D: tl.constexpr, E: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr, K_BLOCK: tl.constexpr,
    ROWS: tl.constexpr, ROW_BLOCK: tl.constexpr, RENORM: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
    SORT: tl.constexpr, COUNT: tl.constexpr,
    PB: tl.constexpr,
    FMT: tl.constexpr, STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr, ROW_BYTES: tl.constexpr, D_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if ROWS == 1 and BLOCK_N == 1 and FMT == FMT_F32:  # the router row read before the wait (`_router_row`)
        pdl.release(PDL)
    else:
        pdl.begin(PDL)
    block = tl.program_id(1)
    rows = block * ROW_BLOCK + tl.arange(0, ROW_BLOCK)
    e = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if ROWS == 1 and BLOCK_N == 1 and FMT == FMT_F32:
        y = _router_row(w + tl.program_id(0).to(tl.int64) * ROW_BYTES, x, D, D_BLOCK, PDL)[None, :]
    else:
        x_rows = x + tl.minimum(rows, ROWS - 1).to(tl.int64) * D  # a row past the chunk reads its last
        y = dot_rows(w + tl.minimum(e, E - 1).to(tl.int64) * ROW_BYTES, x_rows, FMT, STEPS, UNITS, SPLIT, ROW_BLOCK,
                     BLOCK_N, STAGES)  # fmt: skip
    tl.store(scores + rows[:, None] * E + e[None, :], y, mask=(rows < ROWS)[:, None] & (e < E)[None, :])
    tl.debug_barrier()
    done = tl.atomic_add(counter + 1 + block, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:  # a block's last tile of experts ranks its rows: the blocks in parallel
        tl.atomic_xchg(counter + 1 + block, 0, sem="relaxed", scope="gpu")
        for i in range(0, ROW_BLOCK):
            if block * ROW_BLOCK + i < ROWS:
                _rank_row(scores, ids, weights, bias, scale, block * ROW_BLOCK + i, E, E_BLOCK, K, K_BLOCK, RENORM,
                          SIGMOID, BIAS, ROW_BLOCK == 1)  # fmt: skip
        if SORT:
            tl.debug_barrier()
            ranked = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ranked == tl.num_programs(1) - 1:  # the last block ranked sorts every row's pairs
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                _sort_pairs(ids, order, counts, ROWS * K, PB, E, E_BLOCK, COUNT)


def counters(device, rows: int = 1) -> Tensor:
    """Zeroed counters a routing launch of `rows` rows takes (one a row, as many as its blocks of rows at most,
    and one for the blocks ranked); each launch leaves them at zero."""
    return torch.zeros(1 + rows, dtype=torch.int32, device=device)


def route(x: Tensor, w: Tensor, fmt: Format, experts: int, k: int, renorm: bool, ids: Tensor, weights: Tensor,
          scores: Tensor, counter: Tensor, order: Tensor | None = None, counts: Tensor | None = None, *,
          sigmoid: bool = False, bias: Tensor | None = None, scale: float = 1.0) -> None:  # fmt: skip
    """ids (rows, k) int32 and weights (rows, k) f32 of x's rows (rows, d) f32 routed by the router `w`
    (experts, d) checkpoint rows in `fmt`; `scores` (rows, experts) f32 scratch; with `order` (rows * k,)
    int32 also the pairs ordered by expert, and with `counts` (experts,) int32 the pairs each expert takes.
    The probabilities are the softmax over every expert, or each score's sigmoid (`sigmoid`); the experts
    are ranked by their probabilities plus `bias` (experts,) f32 where given (DeepSeek-V3's correction),
    else by their scores; the kept weights are the probabilities (renormalised over the k where `renorm`)
    times `scale`. One launch."""
    rows, d = x.shape
    if ids.dtype != torch.int32 or ids.numel() != rows * k or weights.numel() != rows * k:
        raise ValueError(f"ids must be int32 and ids and weights ({rows}, {k})")
    if scores.numel() < rows * experts or not 1 <= k <= experts:
        raise ValueError(f"scores must hold ({rows}, {experts}) and 1 <= k <= {experts}")
    if counter.numel() < 1 + rows:
        raise ValueError(f"a routing launch of {rows} rows takes {1 + rows} counters")
    if counts is not None and (order is None or counts.dtype != torch.int32 or counts.numel() != experts):
        raise ValueError(f"counts must be int32 ({experts},), written with the order")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != experts):
        raise ValueError(f"the correction bias must be f32 ({experts},)")
    row_block = triton.next_power_of_2(min(rows, kernels.GEMV_ROWS))
    plan, warps = f32_plan(Format(fmt), experts, d, m=row_block, tile=kernels.moe_route_tile(rows))
    sort = order is not None
    _route_kernel[(tiles(experts, plan["BLOCK_N"]), triton.cdiv(rows, row_block))](
        x, w, scores, ids, weights, order if sort else ids, ids if counts is None else counts, counter,
        scores if bias is None else bias, float(scale),
        D=d, E=experts, E_BLOCK=triton.next_power_of_2(experts), K=k, K_BLOCK=triton.next_power_of_2(k),
        ROWS=rows, ROW_BLOCK=row_block, RENORM=renorm, SIGMOID=sigmoid, BIAS=bias is not None, SORT=sort,
        COUNT=counts is not None, PB=PAIRS_A_PASS, D_BLOCK=triton.next_power_of_2(d),
        num_warps=warps, **plan, **pdl.options(),
    )  # fmt: skip
