"""A decode step's routing inside the launch of the projection whose norm the router reads: the plan's RouterTopk
holding a NormQuant of a GemvNormEpilogue (the shared rule `route_in_norm`), one launch where the routing took
one of its own after the int8 add + norm GEMV (`gemv.q8_epilogue.gemv_q8_add_norm`).

The router reads the norm of s = x @ W^T + residual: its scores are W_r @ (s * r * g) = r * (W_r @ (g * s)), with
r = 1 / sqrt(mean(s^2) + eps) one number of the whole row and g the norm's weight. So each program, its rows of s
in registers, adds up its rows' share of every expert's score (the sum over its rows of W_r[e, row] * g[row] *
s[row]; the router's columns of its rows read before the wait for the launch before, as a weight) and stores it.
The last program of each group of programs (a self-resetting counter a group) sums its group's shares; the last
group's last program norms the row as `fast_norm.norm_row` does, which gives r, sums the groups' shares, scales
them by r and ranks the row as the routing launch does (`route._keep_by_count`'s places, a few experts at a
time: the softmax or sigmoid, the top-k, the renormalised and scaled weights). Two levels keep each tail's read near sqrt(programs) x experts values
(`moe_kernels.moe_route_groups`) instead of one program reading every program's shares, or the whole router;
the sums run in a fixed order, so a row's scores are the same bits at every replay.

The memory ordering is `fast_norm.norm_last`'s, twice: every program's stores, the block's barrier, an acq_rel
atomic at gpu scope on its group's counter; the group's last program's loads go to L2 (.cg), then its store of the
group's sum, a barrier and an acq_rel atomic on the launch's counter. Release and acquire chain: every program's
rows of s happen-before the last group's last program's loads, through its group's last program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import QK, Format
from fuselane.lanes.cuda.plan import moe_kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv import fast_norm
from fuselane.lanes.cuda.triton.gemv.epilogue import COUNTER_DTYPE, check_add_norm
from fuselane.lanes.cuda.triton.gemv.fast_norm import norm_row
from fuselane.lanes.cuda.triton.gemv.layout import FMT_F16, FMT_F32, HALF_WORD_BITS
from fuselane.lanes.cuda.triton.gemv.parts import check_rows
from fuselane.lanes.cuda.triton.gemv.q8 import check_aligned, row_dots, tile_plan
from fuselane.lanes.cuda.triton.moe.route import _probability
from fuselane.lanes.cuda.triton.quant import Q8Acts, check_acts

ROUTER_FORMATS = moe_kernels.MOE_ROUTE_IN_NORM_FORMATS


@triton.jit
def _router_columns(wr, rows, n, ex, E: tl.constexpr, RFMT: tl.constexpr, R_ROW_BYTES: tl.constexpr):
    """[E_BLOCK, BLOCK_N] f32: every expert's router values at the columns `rows` (zero past n and past E)."""
    m = (ex < E)[:, None] & (rows < n)[None, :]
    at = wr + ex.to(tl.int64)[:, None] * R_ROW_BYTES
    if RFMT == FMT_F32:
        v = tl.load(at.to(tl.pointer_type(tl.float32)) + rows[None, :], mask=m, other=0.0)
    elif RFMT == FMT_F16:
        v = tl.load(at.to(tl.pointer_type(tl.float16)) + rows[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        bits = tl.load(at.to(tl.pointer_type(tl.uint16)) + rows[None, :], mask=m, other=0).to(tl.int32)
        v = (bits << HALF_WORD_BITS).to(tl.float32, bitcast=True)  # BF16 is the top half of an f32
    return v


@triton.jit
def _sum_shares(shares, first, count, ex, MOST: tl.constexpr, SHARE_ROWS: tl.constexpr, E_BLOCK: tl.constexpr):
    """[E_BLOCK] f32: the sum of `count` (at most MOST) rows of shares from row `first`, SHARE_ROWS rows a pass,
    in row order. Loads read L2 (.cg): other programs wrote them."""
    k = tl.arange(0, SHARE_ROWS)
    acc = tl.zeros([SHARE_ROWS, E_BLOCK], tl.float32)
    for step in range(tl.cdiv(MOST, SHARE_ROWS)):
        at = step * SHARE_ROWS + k
        rows = (first + at).to(tl.int64)[:, None] * E_BLOCK
        acc += tl.load(shares + rows + ex[None, :], mask=(at < count)[:, None], other=0.0, cache_modifier=".cg")
    return tl.sum(acc, 0)


@triton.jit
def _rank(s, scores, ids, weights, bias, scale, E: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr,
          K_BLOCK: tl.constexpr, RENORM: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
          RANK_ROWS: tl.constexpr):  # fmt: skip
    """The row's kept experts and weights from its scores `s` (also stored at `scores`, visible to every thread):
    `route._keep_by_count`'s places (the experts ahead of each, a higher choice score or an equal one at a lower
    index), counted RANK_ROWS experts at a time so no thread holds more than a few of the comparisons (the whole
    experts x experts comparison took this launch to 254 registers a thread, against the GEMV's 45: one block a
    SM). The kept weights are stored as the pass finds them and renormalised after, by their sum."""
    ex = tl.arange(0, E_BLOCK)
    live = ex < E
    top, total = 0.0, 1.0
    if not SIGMOID:
        top = tl.max(tl.where(live, s, float("-inf")), 0)
        total = tl.sum(tl.where(live, tl.exp(s - top), 0.0), 0)
    c = _choice(s, ex, live, bias, top, total, SIGMOID, BIAS)
    mine = tl.arange(0, RANK_ROWS)
    kept_sum = 0.0
    for step in range(E_BLOCK // RANK_ROWS):
        at = step * RANK_ROWS + mine
        s_at = tl.load(scores + at, mask=at < E, other=0.0)
        c_at = _choice(s_at, at, at < E, bias, top, total, SIGMOID, BIAS)
        ahead = (c[None, :] > c_at[:, None]) | ((c[None, :] == c_at[:, None]) & (ex[None, :] < at[:, None]))
        place = tl.sum(ahead.to(tl.int32), 1)
        kept = (at < E) & (place < K)
        p = tl.where(kept, _probability(s_at, top, total, SIGMOID), 0.0)
        kept_sum += tl.sum(p, 0)
        tl.store(ids + place, at, mask=kept)
        tl.store(weights + place, p if RENORM else p * scale, mask=kept)
    if RENORM:
        tl.debug_barrier()  # every thread's kept weights stored before any is read back
        slot = tl.arange(0, K_BLOCK)
        w = tl.load(weights + slot, mask=slot < K, other=0.0)
        tl.debug_barrier()
        tl.store(weights + slot, w / kept_sum * scale, mask=slot < K)


@triton.jit
def _choice(s, ex, live, bias, top, total, SIGMOID: tl.constexpr, BIAS: tl.constexpr):
    """The scores the experts are ranked by (`route._rank_row`'s): the probabilities plus the correction bias
    where the model has one, the probabilities under a sigmoid, else the scores; -inf past the experts."""
    c = s
    if SIGMOID:
        c = _probability(s, top, total, SIGMOID)
    if BIAS:
        c = _probability(s, top, total, SIGMOID) + tl.load(bias + ex, mask=live, other=0.0)
    return tl.where(live, c, float("-inf"))


@triton.jit
def _q8_add_norm_route_kernel(
    xq, xd, xs, w, n, res, sum_out, norm_w, out, oq, od, os_, counter, eps,
    wr, shares, group_shares, group_counters, scores, ids, weights, bias, scale,
    FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FENCE: tl.constexpr, NORM_BLOCK: tl.constexpr, NORM_STEPS: tl.constexpr, DEPTH: tl.constexpr, PDL: tl.constexpr,
    E: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr, K_BLOCK: tl.constexpr, RENORM: tl.constexpr,
    SIGMOID: tl.constexpr, BIAS: tl.constexpr, RFMT: tl.constexpr, R_ROW_BYTES: tl.constexpr, GROUP: tl.constexpr,
    GROUPS: tl.constexpr, SHARE_ROWS: tl.constexpr, RANK_ROWS: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ex = tl.arange(0, E_BLOCK)
    keep = rows < n
    # the router's columns and the norm's weights at these rows are weights: read before the wait for the launch
    # that wrote x, a barrier after them so ptxas issues them there (`route._router_row`)
    wr_cols = _router_columns(wr, rows, n, ex, E, RFMT, R_ROW_BYTES)
    g = tl.load(norm_w + rows, mask=keep, other=0.0).to(tl.float32)
    tl.debug_barrier()
    w_rows = w + tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    y, _ = row_dots(w_rows, w_rows, xq, xd, xs, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, False, DEPTH, PDL)
    # `store_row`'s epilogue, its sum kept: the residual may be sum_out itself (each program reads only its rows)
    s = y + tl.load(res + rows, mask=keep, other=0.0).to(tl.float32)
    tl.store(sum_out + rows, s, mask=keep)
    # rows past n: their router columns and weights are zero, so they add nothing
    tl.store(shares + pid.to(tl.int64) * E_BLOCK + ex, tl.sum(wr_cols * (g * s)[None, :], 1))
    tl.debug_barrier()
    group = pid // GROUP
    members = tl.minimum(GROUP, tl.num_programs(0) - group * GROUP)
    done = tl.atomic_add(group_counters + group, 1, sem="acq_rel", scope="gpu")
    if done == members - 1:  # the group's last program: its members' shares are visible (`fast_norm.norm_last`)
        tl.atomic_xchg(group_counters + group, 0, sem="relaxed", scope="gpu")
        total = _sum_shares(shares, group * GROUP, members, ex, GROUP, SHARE_ROWS, E_BLOCK)
        tl.store(group_shares + group * E_BLOCK + ex, total)
        tl.debug_barrier()
        finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if finished == GROUPS - 1:  # the last group's: every program's rows of s and every group's sum
            r = norm_row(sum_out, norm_w, out, n, eps, oq, od, os_, NORM_BLOCK, NORM_STEPS, True)
            row = _sum_shares(group_shares, 0, GROUPS, ex, GROUPS, SHARE_ROWS, E_BLOCK) * r
            tl.store(scores + ex, row, mask=ex < E)
            tl.debug_barrier()  # `_rank` reads chunks of the scores back
            _rank(row, scores, ids, weights, bias, scale, E, E_BLOCK, K, K_BLOCK, RENORM, SIGMOID, BIAS, RANK_ROWS)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True, slots=True)
class RouteScratch:
    """What a launch that routes in its norm takes besides its operands: each program's shares of the scores
    (programs, experts') f32 and each group's (groups, experts') f32, written before they are read in every
    launch; the groups' counters (int32, zeroed, left at zero); the row's scores (experts,) f32."""

    shares: Tensor
    group_shares: Tensor
    group_counters: Tensor
    scores: Tensor


def _programs(fmt: Format, n: int, k: int) -> tuple[dict, int]:
    plan = tile_plan(fmt, k, None, None, None, n=n)
    return plan, triton.cdiv(n, plan["BLOCK_N"])


def route_scratch(device, fmt: Format, n: int, k: int, experts: int) -> RouteScratch:
    """The scratch of `gemv_q8_add_norm_route` for a product of n rows of k values in `fmt` and `experts` experts."""
    _, programs = _programs(Format(fmt), n, k)
    group, groups = moe_kernels.moe_route_groups(programs)
    e_block = triton.next_power_of_2(experts)
    return RouteScratch(
        torch.empty(programs * e_block, device=device),
        torch.empty(groups * e_block, device=device),
        torch.zeros(groups, dtype=COUNTER_DTYPE, device=device),
        torch.empty(e_block, device=device),
    )


def gemv_q8_add_norm_route(
    x: Q8Acts, w: Tensor, fmt: Format, n: int, k: int, residual: Tensor, sum_out: Tensor, norm_w: Tensor,
    eps: float, out: Tensor, out_q8: Q8Acts, counter: Tensor, router: Tensor, router_fmt: Format, experts: int,
    top_k: int, renorm: bool, ids: Tensor, weights: Tensor, scratch: RouteScratch, *, sigmoid: bool = False,
    bias: Tensor | None = None, scale: float = 1.0,
) -> Tensor:  # fmt: skip
    """`q8_epilogue.gemv_q8_add_norm` (sum_out = x @ W^T + residual, out = its RMS norm times norm_w, out_q8 its
    int8 form) that also routes the normed row as `route.route` does a decode step's one row: ids (top_k,) int32
    and weights (top_k,) f32 of the router `router` (experts, n) in `router_fmt` (F32, F16 or BF16). One launch;
    `scratch` is `route_scratch`'s for these shapes, `counter` `epilogue.gemv_add_norm_counter`'s. Returns out."""
    fmt, router_fmt = Format(fmt), Format(router_fmt)
    check_acts(x, k)
    check_rows(w, fmt, n, k)
    check_aligned([w], fmt)
    check_add_norm(residual, sum_out, norm_w, out, counter, n, x.q.device)
    check_acts(Q8Acts(out_q8.q.view(1, -1), out_q8.d, out_q8.s), n)
    if n % QK or router_fmt not in ROUTER_FORMATS or not 1 <= top_k <= experts:
        raise ValueError(f"routing in the norm takes whole {QK}-value blocks, a float router and 1 <= k <= experts")
    if ids.dtype != torch.int32 or ids.numel() != top_k or weights.numel() != top_k:
        raise ValueError(f"ids must be int32 and ids and weights ({top_k},)")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != experts):
        raise ValueError(f"the correction bias must be f32 ({experts},)")
    plan, programs = _programs(fmt, n, k)
    group, groups = moe_kernels.moe_route_groups(programs)
    e_block = triton.next_power_of_2(experts)
    if scratch.shares.numel() < programs * e_block or scratch.group_counters.numel() < groups:
        raise ValueError("the scratch is not route_scratch's for this product")
    chunk = max(min(triton.next_power_of_2(n), fast_norm.NORM_CHUNK), QK)
    share_rows = moe_kernels.moe_route_share_rows(max(group, groups), e_block, plan["num_warps"])
    _q8_add_norm_route_kernel[(programs,)](
        *x, w, n, residual, sum_out, norm_w, out, *out_q8, counter, float(eps),
        router, scratch.shares, scratch.group_shares, scratch.group_counters, scratch.scores, ids, weights,
        scratch.scores if bias is None else bias, float(scale),
        NORM_BLOCK=chunk, NORM_STEPS=triton.cdiv(n, chunk), E=experts, E_BLOCK=e_block, K=top_k,
        K_BLOCK=triton.next_power_of_2(top_k), RENORM=renorm, SIGMOID=sigmoid, BIAS=bias is not None,
        RFMT=int(router_fmt), R_ROW_BYTES=stored_row_bytes(router_fmt, n), GROUP=group, GROUPS=groups,
        SHARE_ROWS=share_rows, RANK_ROWS=moe_kernels.moe_route_share_rows(e_block, e_block, plan["num_warps"]),
        **plan, **pdl.options(),
    )  # fmt: skip
    return out
