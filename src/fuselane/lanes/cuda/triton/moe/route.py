"""Routing on the device: each row's router scores (x @ Wr^T over every expert), its top-k experts and their
weights (the routing probabilities at the kept ones, renormalised over the k where the model says so, scaled),
and in a chunk the (row, slot) pairs ordered by expert (ExpertSort) and the pairs each expert takes (what the
grouped GEMM cuts into tiles, `grouped.py`), in one launch.

Gating: the softmax over every expert, or (DeepSeek-V3) each score's sigmoid with the experts ranked by their
probabilities plus a per-expert correction bias; the kept weights scaled by the model's factor.

Programs take tiles of experts of a block of rows (up to the GEMV's 8, which read the router's rows once;
a decode step's one row takes an expert a program, `moe_kernels.moe_route_tile`, whose f32 router row is read
before the wait for the launch that wrote x, `_router_row`; a chunk past the GEMV's rows by a float router takes
blocks of 16 rows by 32 router rows on the tensor cores, `_router_tile`, `moe_kernels.moe_route_chunk`) and store
the scores; a
block's last program to finish (a self-resetting counter a block, `fast_norm.norm_last`'s memory ordering)
ranks its rows, so a chunk's blocks are ranked in parallel. Ranking: a decode step's row of up to
`moe_kernels.MOE_RANK_BY_COUNT_EXPERTS` experts places each expert by the count of those ahead of it (one
comparison of every pair, one reduction); more experts take k arg-max passes, and a block of a chunk's
rows takes k arg-max passes over as many of its rows at once as keep a thread's share of the scores bounded
(`moe_kernels.moe_rank_rows`); both put the lower index first on a tie, as the cpu
lane's stable sort.

Sorting (a chunk), a stable counting sort by expert id, split so no program walks the pairs one pass after
another: each block's ranking program also counts its pairs of each expert (a histogram a block) and each
pair's place among its block's pairs of its expert (a comparison of the block's few pairs); the last block
ranked (another counter) turns the histograms into each (block, expert)'s first place (a running sum over
the blocks, each expert's start the pairs of lower experts) and stores every pair at its first place plus
its rank: a few vector passes over the pairs, none of them a comparison of every pair with every expert.
Ids are int32 and never leave the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan import kernels, moe_kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemm import F16_SAFE
from fuselane.lanes.cuda.triton.gemv.formats import dot_rows
from fuselane.lanes.cuda.triton.gemv.layout import FMT_F16, FMT_F32, HALF_WORD_BITS
from fuselane.lanes.cuda.triton.moe.common import f32_plan, tiles

# Pairs the sort's last program places a pass (ids, ranks and firsts loaded, the order stored: 4 of each a
# thread of eight warps), and the most values of the blocks' histograms a thread holds in a pass of its scan
# (8,192 values a pass at eight warps; 512 experts at once over four warps' threads held 64 and spilled).
PAIRS_A_PASS = 1024
HIST_A_THREAD = 32
# Values of a block's rows a pass of the rows' largest |value| (`_row_amax`) reads: 8 rows, 16 values a thread.
AMAX_CHUNK = tl.constexpr(512)
RANK_BY_COUNT = tl.constexpr(moe_kernels.MOE_RANK_BY_COUNT_EXPERTS)  # a kernel reads a constexpr global only
CHUNK_PRECISION = tl.constexpr(moe_kernels.MOE_ROUTE_CHUNK_PRECISION)


@triton.jit
def rank_row(scores, ids, weights, bias, scale, r, E: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr,
             K_BLOCK: tl.constexpr, RENORM: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
             ONE_ROW: tl.constexpr):  # fmt: skip
    """Row r's kept experts and weights from its scores (ONE_ROW: a block of one row, which may rank by count)."""
    ex = tl.arange(0, E_BLOCK)
    live = ex < E
    s = tl.load(scores + r * E + ex, mask=live, other=float("-inf"), cache_modifier=".cg")
    top, total = 0.0, 1.0
    if not SIGMOID:
        top = tl.max(s, 0)
        total = tl.sum(tl.where(live, tl.exp(s - top), 0.0), 0)
    p = tl.where(live, probability(s, top, total, SIGMOID), 0.0)
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
        _keep_by_passes(ids, weights, scale, scores, r, c, top, total, ex, E, K, K_BLOCK, RENORM, SIGMOID)


@triton.jit
def probability(s, top, total, SIGMOID: tl.constexpr):
    """A score's routing probability: its sigmoid (e^-s overflows to inf for s << 0: the right 0), or its share
    of the softmax whose largest score is `top` and whose sum of e^(s - top) is `total`. One expression for every
    expert of a row and for the kept ones read back, so both give the same bits."""
    if SIGMOID:
        return 1.0 / (1.0 + tl.exp(-s))
    return tl.exp(s - top) / total


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
def _keep_by_passes(ids, weights, scale, scores, r, c, top, total, ex, E: tl.constexpr, K: tl.constexpr,
                    K_BLOCK: tl.constexpr, RENORM: tl.constexpr, SIGMOID: tl.constexpr):  # fmt: skip
    """Row r's kept experts by K arg-max passes over the choice scores `c` (the lower index first on a tie); their
    probabilities from their scores read back after the passes (`probability`), one load instead of a reduction
    a pass."""
    slot = tl.arange(0, K_BLOCK)
    kept_ids = tl.zeros([K_BLOCK], tl.int32)
    for j in tl.static_range(K):
        best = tl.argmax(c, 0, tie_break_left=True)
        kept_ids = tl.where(slot == j, best.to(tl.int32), kept_ids)
        c = tl.where(ex == best, float("-inf"), c)
    chosen = tl.load(scores + r * E + kept_ids, mask=slot < K, other=0.0, cache_modifier=".cg")
    kept = tl.where(slot < K, probability(chosen, top, total, SIGMOID), 0.0)
    if RENORM:
        kept = kept / tl.sum(kept, 0)
    tl.store(ids + r * K + slot, kept_ids, mask=slot < K)
    tl.store(weights + r * K + slot, kept * scale, mask=slot < K)


@triton.jit
def _choice(scores, rows, live_rows, bias, ex, live, E: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr):
    """A block's rows' choice scores ([rows, E_BLOCK]) and each row's softmax top score and sum (`probability`'s;
    0 and 1 under SIGMOID): `rank_row`'s, a row each."""
    m = live_rows[:, None] & live[None, :]
    s = tl.load(scores + rows[:, None] * E + ex[None, :], mask=m, other=0.0, cache_modifier=".cg")
    s = tl.where(live[None, :], s, float("-inf"))  # a row past the chunk's ranks zeros, and stores nothing
    top = tl.zeros_like(rows).to(tl.float32)
    total = top + 1.0
    if not SIGMOID:
        top = tl.max(s, 1)
        total = tl.sum(tl.where(live[None, :], tl.exp(s - top[:, None]), 0.0), 1)
    p = tl.where(live[None, :], probability(s, top[:, None], total[:, None], SIGMOID), 0.0)
    c = s
    if SIGMOID:
        c = p
    if BIAS:
        c = p + tl.load(bias + ex, mask=live, other=0.0)[None, :]
    return tl.where(live[None, :], c, float("-inf")), top, total


@triton.jit
def _rank_rows(scores, ids, weights, bias, scale, first, E: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr,
               K_BLOCK: tl.constexpr, ROWS: tl.constexpr, RANK_ROWS: tl.constexpr, RENORM: tl.constexpr,
               SIGMOID: tl.constexpr, BIAS: tl.constexpr):  # fmt: skip
    """The kept experts and weights of RANK_ROWS of a chunk's rows from `first`, all at once: K arg-max passes
    over the [RANK_ROWS, E_BLOCK] choice scores (the lower index first on a tie, `_keep_by_passes`' order).
    Returns the kept ids ([RANK_ROWS, K_BLOCK], -1 past the chunk's rows and past K) and the experts each live
    row kept ([RANK_ROWS, E_BLOCK]) for the sort."""
    ex = tl.arange(0, E_BLOCK)
    rows = first + tl.arange(0, RANK_ROWS)
    live_rows = rows < ROWS
    c, top, total = _choice(scores, rows, live_rows, bias, ex, ex < E, E, SIGMOID, BIAS)
    slot = tl.arange(0, K_BLOCK)[None, :]
    kept_ids = tl.full([RANK_ROWS, K_BLOCK], -1, tl.int32)
    taken = tl.zeros([RANK_ROWS, E_BLOCK], tl.int32)
    for j in tl.static_range(K):
        best = tl.argmax(c, 1, tie_break_left=True)[:, None]  # [RANK_ROWS, 1]
        hit = ex[None, :] == best
        kept_ids = tl.where(slot == j, best.to(tl.int32), kept_ids)
        c = tl.where(hit, float("-inf"), c)
        taken = tl.where(hit & live_rows[:, None], 1, taken)
    at = rows[:, None] * K + slot
    m = live_rows[:, None] & (slot < K)
    # the kept experts' probabilities from their scores read back (`_keep_by_passes`' way)
    chosen = tl.load(scores + rows[:, None] * E + kept_ids, mask=m, other=0.0, cache_modifier=".cg")
    kept = tl.where(m, probability(chosen, top[:, None], total[:, None], SIGMOID), 0.0)
    if RENORM:
        kept = kept / tl.sum(kept, 1)[:, None]  # a row past the chunk sums to 0: not stored
    tl.store(ids + at, kept_ids, mask=m)
    tl.store(weights + at, kept * scale, mask=m)
    return tl.where(m, kept_ids, -1), taken


@triton.jit
def _rank_block(scores, ids, weights, bias, scale, hist, rank, block, E: tl.constexpr, E_BLOCK: tl.constexpr,
                K: tl.constexpr, K_BLOCK: tl.constexpr, ROWS: tl.constexpr, ROW_BLOCK: tl.constexpr,
                RANK_ROWS: tl.constexpr, RENORM: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
                SORT: tl.constexpr):  # fmt: skip
    """A block of a chunk's rows ranked RANK_ROWS at a time (`_rank_rows`, `moe_kernels.moe_rank_rows`: a thread
    holds a bounded share of the [rows, experts] tile whatever the experts); with SORT, the block's share of
    the sort too (`_block_places`), the pairs of each expert in the rows already ranked carried from one group
    to the next, and the block's histogram stored at the end."""
    ex = tl.arange(0, E_BLOCK)
    before = tl.zeros([E_BLOCK], tl.int32)  # the pairs of each expert among the block's rows ranked so far
    for g in range(0, ROW_BLOCK // RANK_ROWS):
        first = block * ROW_BLOCK + g * RANK_ROWS
        kept, taken = _rank_rows(scores, ids, weights, bias, scale, first, E, E_BLOCK, K, K_BLOCK, ROWS, RANK_ROWS,
                                 RENORM, SIGMOID, BIAS)  # fmt: skip
        if SORT:
            before = _block_places(kept, taken, before, rank, first, E_BLOCK, K, K_BLOCK, RANK_ROWS)
    if SORT:
        tl.store(hist + block * E + ex, before, mask=ex < E)


@triton.jit
def _block_places(kept_ids, taken, before, rank, first, E_BLOCK: tl.constexpr, K: tl.constexpr,
                  K_BLOCK: tl.constexpr, RANK_ROWS: tl.constexpr):  # fmt: skip
    """A group of a block's rows' share of the stable sort: each pair's place among its block's pairs of its
    expert (rank[pair]), `before` ([E_BLOCK]) those of the block's earlier rows; returns `before` past these
    rows (the block's histogram hist[block, e] after its last group). A row's kept experts are distinct, so the
    pairs of its expert before it are the earlier rows that kept it: a running count down the rows of `taken`
    ([RANK_ROWS, E_BLOCK], the experts each row kept), read at each slot's expert. [RANK_ROWS, E_BLOCK] a pass,
    not a comparison of every pair of the block with every other (rows * K squared)."""
    ahead = tl.cumsum(taken, 0) - taken + before[None, :]
    ex = tl.arange(0, E_BLOCK)
    slot = tl.arange(0, K_BLOCK)[None, :]
    pairs = first * K + tl.arange(0, RANK_ROWS) * K
    for j in tl.static_range(K):
        e = tl.sum(tl.where(slot == j, kept_ids, 0), 1)  # [RANK_ROWS]: slot j's expert, -1 past the chunk
        tl.store(rank + pairs + j, tl.sum(tl.where(ex[None, :] == e[:, None], ahead, 0), 1), mask=e >= 0)
    return before + tl.sum(taken, 0)


@triton.jit
def _sort_pairs(ids, order, counts, hist, rank, P: tl.constexpr, E: tl.constexpr, E_BLOCK: tl.constexpr,
                BLOCKS: tl.constexpr, BLOCK_PAIRS: tl.constexpr, HB: tl.constexpr, PB: tl.constexpr,
                COUNT: tl.constexpr):  # fmt: skip
    """order[place] = p for every pair p, its place the pairs of lower experts (start[e]) + those of its expert in
    earlier blocks + its rank in its block: a stable counting sort by expert id, from the blocks' histograms
    (`_block_places`). The blocks' histograms become, in place, each (block, expert)'s first place; every
    load reads L2 (.cg): the other blocks' programs wrote them. With COUNT, counts[e] = the pairs of expert e."""
    ex = tl.arange(0, E_BLOCK)
    hb = tl.arange(0, HB)
    total = tl.zeros([E_BLOCK], tl.int32)
    for a in range(0, tl.cdiv(BLOCKS, HB)):
        b = a * HB + hb
        m = (b < BLOCKS)[:, None] & (ex < E)[None, :]
        total += tl.sum(tl.load(hist + b[:, None] * E + ex[None, :], mask=m, other=0, cache_modifier=".cg"), 0)
    seen = tl.cumsum(total, 0) - total  # each expert's first place, then past the blocks walked
    for a in range(0, tl.cdiv(BLOCKS, HB)):
        b = a * HB + hb
        m = (b < BLOCKS)[:, None] & (ex < E)[None, :]
        h = tl.load(hist + b[:, None] * E + ex[None, :], mask=m, other=0, cache_modifier=".cg")
        tl.store(hist + b[:, None] * E + ex[None, :], seen[None, :] + tl.cumsum(h, 0) - h, mask=m)
        seen += tl.sum(h, 0)
    tl.debug_barrier()  # the firsts stored by every thread before any reads them back
    for a in range(0, tl.cdiv(P, PB)):
        pa = a * PB + tl.arange(0, PB)
        m = pa < P
        e = tl.load(ids + pa, mask=m, other=0, cache_modifier=".cg")
        first = tl.load(hist + (pa // BLOCK_PAIRS) * E + e, mask=m, other=0, cache_modifier=".cg")
        place = first + tl.load(rank + pa, mask=m, other=0, cache_modifier=".cg")
        tl.store(order + place, pa, mask=m)
    if COUNT:
        tl.store(counts + ex, total, mask=ex < E)


@triton.jit
def _router_row(w_row, x, D: tl.constexpr, D_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """[1] f32: x . one f32 router row (a decode step's program, `moe_kernels.moe_route_tile`). The row is a weight,
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
def float_values(rows, at, mask, FMT: tl.constexpr):
    """f32: the values at index `at` of the float rows whose byte addresses are `rows` (F32, F16 or BF16; 0 where
    not `mask`)."""
    if FMT == FMT_F32:
        return tl.load(rows.to(tl.pointer_type(tl.float32)) + at, mask=mask, other=0.0)
    if FMT == FMT_F16:
        return tl.load(rows.to(tl.pointer_type(tl.float16)) + at, mask=mask, other=0.0).to(tl.float32)
    bits = tl.load(rows.to(tl.pointer_type(tl.uint16)) + at, mask=mask, other=0).to(tl.int32)
    return (bits << HALF_WORD_BITS).to(tl.float32, bitcast=True)  # BF16 is the top half of an f32


@triton.jit
def _router_tile(w, x, rows, e, ROWS: tl.constexpr, E: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr,
                 ROW_BYTES: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                 ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """[ROW_BLOCK, BLOCK_N] f32: a chunk's rows `rows` of x by the float router's rows `e`, on the tensor cores
    (`kernels.MOE_ROUTE_CHUNK_*`: three TF32 products a step, about f32's rounding), BLOCK_K values a step staged
    STAGES ahead. A row past the chunk reads its last, a router row past the experts the last expert's."""
    k = tl.arange(0, BLOCK_K)
    x_rows = x + tl.minimum(rows, ROWS - 1).to(tl.int64)[:, None] * D
    w_rows = w + tl.minimum(e, E - 1).to(tl.int64)[:, None] * ROW_BYTES
    acc = tl.zeros([ROW_BLOCK, BLOCK_N], tl.float32)
    for s in tl.range(0, tl.cdiv(D, BLOCK_K), num_stages=STAGES):
        at = s * BLOCK_K + k
        m = (at < D)[None, :]
        a = tl.load(x_rows + at[None, :], mask=m, other=0.0)
        b = float_values(w_rows, at[None, :], m, FMT)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=CHUNK_PRECISION)
    return acc


@triton.jit
def _row_amax(x, x_amax, x16, h_amax, rows, ROWS: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
              K_POW2: tl.constexpr, ROW_BLOCK: tl.constexpr):  # fmt: skip
    """The block's rows' largest |value| into x_amax and the rows divided by their f16 scale, rounded once, into
    x16 (the grouped gate/up's operand, `grouped`), and their pairs' entries of h_amax zeroed (the largest
    |SiLU(gate) * up| the gate/up launch then takes)."""
    live = rows < ROWS
    cols = tl.arange(0, AMAX_CHUNK)
    at_row = rows.to(tl.int64)[:, None] * D
    amax = tl.zeros([ROW_BLOCK], tl.float32)
    for c in range(0, tl.cdiv(D, AMAX_CHUNK)):
        at = c * AMAX_CHUNK + cols
        m = live[:, None] & (at < D)[None, :]
        amax = tl.maximum(amax, tl.max(tl.abs(tl.load(x + at_row + at[None, :], mask=m, other=0.0)), 1))
    tl.store(x_amax + rows, amax, mask=live)
    inv = (1.0 / f16_row_scale(amax))[:, None]
    for c in range(0, tl.cdiv(D, AMAX_CHUNK)):
        at = c * AMAX_CHUNK + cols
        m = live[:, None] & (at < D)[None, :]
        v = tl.load(x + at_row + at[None, :], mask=m, other=0.0)
        tl.store(x16 + at_row + at[None, :], (v * inv).to(tl.float16), mask=m)
    slot = tl.arange(0, K_POW2)[None, :]
    tl.store(h_amax + rows[:, None] * K + slot, tl.zeros([ROW_BLOCK, K_POW2], tl.int32),
             mask=live[:, None] & (slot < K))  # fmt: skip


@triton.jit
def _route_kernel(
    x, w, scores, ids, weights, order, counts, counter, hist, rank, x_amax, x16, h_amax, bias, scale,
    D: tl.constexpr, E: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr, K_BLOCK: tl.constexpr,
    ROWS: tl.constexpr, ROW_BLOCK: tl.constexpr, RENORM: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
    SORT: tl.constexpr, COUNT: tl.constexpr, HB: tl.constexpr, PB: tl.constexpr, AMAX: tl.constexpr,
    FMT: tl.constexpr, STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr, ROW_BYTES: tl.constexpr, D_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr, AMAX_ROWS: tl.constexpr, RANK_ROWS: tl.constexpr, PDL: tl.constexpr,
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
    elif CHUNK:  # a chunk's block of rows by a tile of a float router, on the tensor cores
        y = _router_tile(w, x, rows, e, ROWS, E, D, FMT, ROW_BYTES, BLOCK_K, STAGES, ROW_BLOCK, BLOCK_N)
    else:
        x_rows = x + tl.minimum(rows, ROWS - 1).to(tl.int64) * D  # a row past the chunk reads its last
        y = dot_rows(w + tl.minimum(e, E - 1).to(tl.int64) * ROW_BYTES, x_rows, FMT, STEPS, UNITS, SPLIT, ROW_BLOCK,
                     BLOCK_N, STAGES)  # fmt: skip
    tl.store(scores + rows[:, None] * E + e[None, :], y, mask=(rows < ROWS)[:, None] & (e < E)[None, :])
    if AMAX:  # the block's rows' largest values, AMAX_ROWS of them a program of the block's first
        if tl.program_id(0) * AMAX_ROWS < ROW_BLOCK:
            mine = block * ROW_BLOCK + tl.program_id(0) * AMAX_ROWS + tl.arange(0, AMAX_ROWS)
            _row_amax(x, x_amax, x16, h_amax, mine, ROWS, D, K, K_BLOCK, AMAX_ROWS)
    tl.debug_barrier()
    done = tl.atomic_add(counter + 1 + block, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:  # a block's last tile of experts ranks its rows: the blocks in parallel
        tl.atomic_xchg(counter + 1 + block, 0, sem="relaxed", scope="gpu")
        if ROW_BLOCK == 1:  # a decode step's row (never sorted)
            rank_row(scores, ids, weights, bias, scale, block, E, E_BLOCK, K, K_BLOCK, RENORM, SIGMOID, BIAS, True)
        else:
            _rank_block(scores, ids, weights, bias, scale, hist, rank, block, E, E_BLOCK, K, K_BLOCK, ROWS,
                        ROW_BLOCK, RANK_ROWS, RENORM, SIGMOID, BIAS, SORT)  # fmt: skip
        if SORT:
            tl.debug_barrier()
            ranked = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ranked == tl.num_programs(1) - 1:  # the last block ranked places every block's pairs
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                _sort_pairs(ids, order, counts, hist, rank, ROWS * K, E, E_BLOCK, tl.cdiv(ROWS, ROW_BLOCK),
                            ROW_BLOCK * K, HB, PB, COUNT)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RowScales:
    """What lets the grouped GEMM round its activations to f16 with one scale a row for the whole product (no
    branch in its k loop, which the software pipeliner then stages): x (rows,) f32, each chunk row's largest
    |value|, and x16 (rows, d) f16, each row divided by its scale (`f16_row_scale`) and rounded once, both
    written by the routing launch, which reads the rows anyway (the gate/up launch then reads half the bytes
    and converts nothing); h (pairs,) int32, the bits of each pair's largest |SiLU(gate) * up| (non-negative
    floats order as their bits), zeroed by the routing launch and raised by the gate/up launch's programs."""

    x: Tensor
    x16: Tensor
    h: Tensor


def row_scales(device, rows: int, k: int, d: int) -> RowScales:
    """Row scales for a chunk of `rows` rows of width `d` and `k` kept experts (each launch writes them)."""
    return RowScales(torch.zeros(rows, device=device), torch.zeros(rows, d, dtype=torch.float16, device=device),
                     torch.zeros(rows * k, dtype=torch.int32, device=device))  # fmt: skip


@triton.jit
def f16_row_scale(amax):
    """The power of two a row of largest |value| `amax` is divided by before its f16 rounding (1 within
    F16_SAFE): the prefill GEMM's (`gemm`), once a row instead of once a step."""
    return tl.where(amax > F16_SAFE, tl.exp2(tl.ceil(tl.log2(amax / F16_SAFE))), 1.0)


def sort_scratch(device, rows: int, experts: int, k: int) -> Tensor:
    """The int32 scratch a chunk's sort takes: each block of rows' pairs of each expert (then their first
    places), and each pair's rank in its block (sized for the GEMV's blocks of rows, the most a launch takes).
    Written before it is read in every launch: never zeroed."""
    return torch.empty(_blocks(rows, _row_block(rows)) * experts + rows * k, dtype=torch.int32, device=device)


def _row_block(rows: int, chunk: bool = False) -> int:
    """A block's rows: the tensor-core tile's (`chunk`), else the GEMV's (all rows up to its 8)."""
    return moe_kernels.MOE_ROUTE_CHUNK_ROWS if chunk else triton.next_power_of_2(min(rows, kernels.GEMV_ROWS))


def _blocks(rows: int, row_block: int) -> int:
    return triton.cdiv(rows, row_block)


def _sort_scratch(scratch: Tensor | None, rows: int, experts: int, k: int, stand_in: Tensor,
                  row_block: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The histograms' and the ranks' parts of `scratch` (stand-ins where there is no sort)."""
    if scratch is None:
        return stand_in, stand_in
    size = _blocks(rows, row_block) * experts
    if scratch.dtype != torch.int32 or scratch.numel() < size + rows * k:
        raise ValueError(f"the sort's scratch must be int32 of {size + rows * k} (sort_scratch)")
    return scratch[:size], scratch[size:]


def _chunk_plan(fmt: Format, experts: int, d: int) -> tuple[dict, int]:
    """`f32_plan`'s constants for the tensor-core tile (`kernels.MOE_ROUTE_CHUNK_*`; the GEMV's are not read)."""
    consts = dict(FMT=int(fmt), STEPS=0, UNITS=1, SPLIT=1, BLOCK_N=moe_kernels.MOE_ROUTE_CHUNK_EXPERTS,
                  STAGES=moe_kernels.MOE_ROUTE_CHUNK_STAGES, ROW_BYTES=stored_row_bytes(fmt, d))  # fmt: skip
    return consts, moe_kernels.MOE_ROUTE_CHUNK_WARPS


def counters(device, rows: int = 1) -> Tensor:
    """Zeroed counters a routing launch of `rows` rows takes (one a row, as many as its blocks of rows at most,
    and one for the blocks ranked); each launch leaves them at zero."""
    return torch.zeros(1 + rows, dtype=torch.int32, device=device)


def route(x: Tensor, w: Tensor, fmt: Format, experts: int, k: int, renorm: bool, ids: Tensor, weights: Tensor,
          scores: Tensor, counter: Tensor, order: Tensor | None = None, counts: Tensor | None = None, *,
          sigmoid: bool = False, bias: Tensor | None = None, scale: float = 1.0,
          scratch: Tensor | None = None, amax: RowScales | None = None,
          maxnreg: int | None = None) -> None:  # fmt: skip
    """ids (rows, k) int32 and weights (rows, k) f32 of x's rows (rows, d) f32 routed by the router `w`
    (experts, d) checkpoint rows in `fmt`; `scores` (rows, experts) f32 scratch; with `order` (rows * k,)
    int32 also the pairs ordered by expert, and with `counts` (experts,) int32 the pairs each expert takes.
    The probabilities are the softmax over every expert, or each score's sigmoid (`sigmoid`); the experts
    are ranked by their probabilities plus `bias` (experts,) f32 where given (DeepSeek-V3's correction),
    else by their scores; the kept weights are the probabilities (renormalised over the k where `renorm`)
    times `scale`. One launch; the sort takes `scratch` (`sort_scratch`; one is made where not given). With
    `amax` it also writes each row's largest |x| and zeroes the pairs' largest |h| (`RowScales`). `maxnreg` caps
    a thread's registers (the benchmark's trial: 2 blocks a SM for the scores, spilling in the ranking)."""
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
    chunk = moe_kernels.moe_route_chunk(fmt, rows)
    row_block, blocks = _row_block(rows, chunk), _blocks(rows, _row_block(rows, chunk))
    if chunk:
        plan, warps = _chunk_plan(Format(fmt), experts, d)
    else:
        plan, warps = f32_plan(Format(fmt), experts, d, m=row_block, tile=moe_kernels.moe_route_tile(rows))
    expert_tiles = tiles(experts, plan["BLOCK_N"])
    # the block's rows' largest values split among its first programs: a power of two of rows each, all covered
    amax_rows = triton.next_power_of_2(triton.cdiv(row_block, expert_tiles))
    sort = order is not None
    if sort and rows == 1:
        raise ValueError("a decode step's row is not sorted")
    hist, rank = _sort_scratch(scratch if scratch is not None or not sort else sort_scratch(x.device, rows, experts, k),
                               rows, experts, k, ids, row_block)  # fmt: skip
    if amax is not None and (not sort or amax.x.numel() != rows or amax.h.numel() != rows * k
                             or amax.h.dtype != torch.int32 or amax.x16.numel() != rows * d):  # fmt: skip
        raise ValueError(f"the row scales take a sorted chunk's ({rows},) f32, ({rows}, {d}) f16 and ({rows * k},) "
                         "int32")  # fmt: skip
    x_amax, x16, h_amax = (amax.x, amax.x16, amax.h) if amax is not None else (scores, scores, ids)
    hb = max(
        1, min(triton.next_power_of_2(blocks), HIST_A_THREAD * warps * kernels.WARP // triton.next_power_of_2(experts))
    )
    _route_kernel[(expert_tiles, blocks)](
        x, w, scores, ids, weights, order if sort else ids, ids if counts is None else counts, counter, hist, rank,
        x_amax, x16, h_amax, scores if bias is None else bias, float(scale),
        D=d, E=experts, E_BLOCK=triton.next_power_of_2(experts), K=k, K_BLOCK=triton.next_power_of_2(k),
        ROWS=rows, ROW_BLOCK=row_block, RENORM=renorm, SIGMOID=sigmoid, BIAS=bias is not None, SORT=sort,
        COUNT=counts is not None, AMAX=amax is not None, HB=hb, PB=PAIRS_A_PASS,
        D_BLOCK=triton.next_power_of_2(d), CHUNK=chunk, BLOCK_K=moe_kernels.MOE_ROUTE_CHUNK_K, AMAX_ROWS=amax_rows,
        RANK_ROWS=moe_kernels.moe_rank_rows(row_block, triton.next_power_of_2(experts), warps),
        num_warps=warps, **plan, **pdl.options(), **({} if maxnreg is None else dict(maxnreg=maxnreg)),
    )  # fmt: skip
