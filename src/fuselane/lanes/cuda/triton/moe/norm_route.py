"""A decode step's routing inside the launch of the projection whose norm the router reads: the plan's RouterTopk
holding a GemvNormEpilogue (or its NormQuant; the shared rule `route_in_norm`), one launch where the routing took
one of its own after the add + norm GEMV (`q8_epilogue.gemv_q8_add_norm`, the int8 one; `fast_norm`, the f32 one).

The router reads the norm of s = x @ W^T + residual: its scores are W_r @ (s * r * g) = r * (W_r @ (g * s)), with
r = 1 / sqrt(mean(s^2) + eps) one number of the whole row and g the norm's weight. So each program, its rows of s
in registers, adds up its rows' share of every expert's score (the sum over its rows of W_r[e, row] * g[row] *
s[row]; the router's columns of its rows read before the wait for the launch before, as a weight) and stores it.
The last program of each group of programs (a self-resetting counter a group) sums its group's shares; the last
group's last program norms the row as `fast_norm.norm_row` does, which gives r, sums the groups' shares, scales
them by r and ranks the row as the routing launch does (`route.rank_row`, by k arg-max passes: the softmax or
sigmoid, the top-k, the renormalised and scaled weights). Two levels keep each tail's read
near sqrt(programs) x experts values (`moe_kernels.moe_route_groups`) instead of one program reading every
program's shares, or the whole router; the sums run in a fixed order, so a row's scores are the same bits at
every replay.

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
from fuselane.lanes.cuda.triton.gemv.fast import launch_plan
from fuselane.lanes.cuda.triton.gemv.fast import row_dots as fast_row_dots
from fuselane.lanes.cuda.triton.gemv.fast_norm import check_fast_add_norm, norm_row
from fuselane.lanes.cuda.triton.gemv.parts import check_rows
from fuselane.lanes.cuda.triton.gemv.q8 import check_aligned, row_dots, tile_plan
from fuselane.lanes.cuda.triton.gemv.q8_epilogue import check_q8_out
from fuselane.lanes.cuda.triton.moe.route import float_values, rank_row
from fuselane.lanes.cuda.triton.quant import Q8Acts, check_acts

ROUTER_FORMATS = moe_kernels.MOE_ROUTE_IN_NORM_FORMATS


@triton.jit
def _before_wait(wr, norm_w, w, rows, n, E: tl.constexpr, E_BLOCK: tl.constexpr, RFMT: tl.constexpr,
                 R_ROW_BYTES: tl.constexpr, ROW_BYTES: tl.constexpr):  # fmt: skip
    """A program's weights read before the wait for the launch that wrote x, with a barrier after them so ptxas
    issues them there (`route._router_row`): every expert's router values at its rows ([E_BLOCK, BLOCK_N] f32,
    zero past n and past E) and the norm's weights at them; and its rows' first bytes (rows past n read the
    last row: no masked weight loads, the store drops them)."""
    ex = tl.arange(0, E_BLOCK)
    keep = rows < n
    live = (ex < E)[:, None] & keep[None, :]
    wr_cols = float_values(wr + ex.to(tl.int64)[:, None] * R_ROW_BYTES, rows[None, :], live, RFMT)
    g = tl.load(norm_w + rows, mask=keep, other=0.0).to(tl.float32)
    tl.debug_barrier()
    return wr_cols, g, w + tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES


@triton.jit
def _sum_shares(shares, first, count, ex, MOST: tl.constexpr, SHARE_ROWS: tl.constexpr, E_BLOCK: tl.constexpr):
    """[E_BLOCK] f32: the sum of `count` (at most MOST) rows of shares from row `first`, SHARE_ROWS rows a pass,
    in the same order at every launch. Loads read L2 (.cg): other programs wrote them."""
    k = tl.arange(0, SHARE_ROWS)
    acc = tl.zeros([SHARE_ROWS, E_BLOCK], tl.float32)
    for step in range(tl.cdiv(MOST, SHARE_ROWS)):
        at = step * SHARE_ROWS + k
        rows = (first + at).to(tl.int64)[:, None] * E_BLOCK
        acc += tl.load(shares + rows + ex[None, :], mask=(at < count)[:, None], other=0.0, cache_modifier=".cg")
    return tl.sum(acc, 0)


@triton.jit
def _route_tail(y, rows, n, res, sum_out, norm_w, out, oq, od, os_, counter, eps, wr_cols, g, shares, group_shares,
                group_counters, scores, ids, weights, bias, scale, NORM_BLOCK: tl.constexpr,
                NORM_STEPS: tl.constexpr, Q8OUT: tl.constexpr, E: tl.constexpr, E_BLOCK: tl.constexpr,
                K: tl.constexpr, K_BLOCK: tl.constexpr, RENORM: tl.constexpr, SIGMOID: tl.constexpr,
                BIAS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                SHARE_ROWS: tl.constexpr):  # fmt: skip
    """A program's end, its rows' products `y` in registers: the sum (`store_row`'s epilogue), its rows' shares of
    the scores, then the group's and the launch's last programs (the module's docstring)."""
    pid = tl.program_id(0)
    ex = tl.arange(0, E_BLOCK)
    keep = rows < n
    # the residual may be sum_out itself: each program reads only the rows it writes
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
            r = norm_row(sum_out, norm_w, out, n, eps, oq, od, os_, NORM_BLOCK, NORM_STEPS, Q8OUT)
            row = _sum_shares(group_shares, 0, GROUPS, ex, GROUPS, SHARE_ROWS, E_BLOCK) * r
            tl.store(scores + ex, row, mask=ex < E)
            tl.debug_barrier()  # the ranking reads the scores back
            # k arg-max passes, not the routing launch's one experts x experts count: that comparison took this
            # launch to 254 registers a thread against the GEMV's 45 (one block a SM)
            rank_row(scores, ids, weights, bias, scale, 0, E, E_BLOCK, K, K_BLOCK, RENORM, SIGMOID, BIAS, False)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _q8_add_norm_route_kernel(
    xq, xd, xs, w, n, res, sum_out, norm_w, out, oq, od, os_, counter, eps,
    wr, shares, group_shares, group_counters, scores, ids, weights, bias, scale,
    FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FENCE: tl.constexpr, NORM_BLOCK: tl.constexpr, NORM_STEPS: tl.constexpr, DEPTH: tl.constexpr,
    E: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr, K_BLOCK: tl.constexpr, RENORM: tl.constexpr,
    SIGMOID: tl.constexpr, BIAS: tl.constexpr, RFMT: tl.constexpr, R_ROW_BYTES: tl.constexpr, GROUP: tl.constexpr,
    GROUPS: tl.constexpr, SHARE_ROWS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wr_cols, g, w_rows = _before_wait(wr, norm_w, w, rows, n, E, E_BLOCK, RFMT, R_ROW_BYTES, ROW_BYTES)
    y, _ = row_dots(w_rows, w_rows, xq, xd, xs, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, False, DEPTH, PDL)
    _route_tail(y, rows, n, res, sum_out, norm_w, out, oq, od, os_, counter, eps, wr_cols, g, shares, group_shares,
                group_counters, scores, ids, weights, bias, scale, NORM_BLOCK, NORM_STEPS, True, E, E_BLOCK, K,
                K_BLOCK, RENORM, SIGMOID, BIAS, GROUP, GROUPS, SHARE_ROWS)  # fmt: skip


@triton.jit
def _fast_add_norm_route_kernel(
    x, w, n, res, sum_out, norm_w, out, counter, eps,
    wr, shares, group_shares, group_counters, scores, ids, weights, bias, scale,
    FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FENCE: tl.constexpr, NORM_BLOCK: tl.constexpr, NORM_STEPS: tl.constexpr,
    E: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr, K_BLOCK: tl.constexpr, RENORM: tl.constexpr,
    SIGMOID: tl.constexpr, BIAS: tl.constexpr, RFMT: tl.constexpr, R_ROW_BYTES: tl.constexpr, GROUP: tl.constexpr,
    GROUPS: tl.constexpr, SHARE_ROWS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wr_cols, g, w_rows = _before_wait(wr, norm_w, w, rows, n, E, E_BLOCK, RFMT, R_ROW_BYTES, ROW_BYTES)
    y, _ = fast_row_dots(w_rows, w_rows, x, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, False, PDL)
    _route_tail(y, rows, n, res, sum_out, norm_w, out, out, out, out, counter, eps, wr_cols, g, shares, group_shares,
                group_counters, scores, ids, weights, bias, scale, NORM_BLOCK, NORM_STEPS, False, E, E_BLOCK, K,
                K_BLOCK, RENORM, SIGMOID, BIAS, GROUP, GROUPS, SHARE_ROWS)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RouteScratch:
    """What a launch that routes in its norm takes besides its operands: each program's shares of the scores
    (programs, experts') f32 and each group's (groups, experts') f32, written before they are read in every
    launch; the groups' counters (int32, zeroed, left at zero); the row's scores (experts,) f32."""

    shares: Tensor
    group_shares: Tensor
    group_counters: Tensor
    scores: Tensor


@dataclass(frozen=True, slots=True)
class Routing:
    """A routing a launch runs in its norm: the router (experts, n) checkpoint rows in `fmt` (F32, F16 or BF16),
    `k` kept experts renormalised where `renorm`, the softmax or each score's sigmoid (`sigmoid`), DeepSeek's
    correction `bias` (experts,) f32 where the model has one, the kept weights times `scale`; the results ids (k,)
    int32 and weights (k,) f32, and the launch's `RouteScratch`."""

    router: Tensor
    fmt: Format
    experts: int
    k: int
    renorm: bool
    ids: Tensor
    weights: Tensor
    scratch: RouteScratch
    sigmoid: bool = False
    bias: Tensor | None = None
    scale: float = 1.0


def _plan(fmt: Format, n: int, k: int, int8: bool) -> tuple[dict, int]:
    """The product's launch plan (the int8 GEMV's, or the fast f32 GEMV's) and its programs."""
    plan = tile_plan(fmt, k, None, None, None, n=n) if int8 else launch_plan(fmt, k, None, None, n=n)
    return plan, triton.cdiv(n, plan["BLOCK_N"])


def route_scratch(device, fmt: Format, n: int, k: int, experts: int, int8: bool = True) -> RouteScratch:
    """The scratch of a launch that routes in its norm, for a product of n rows of k values in `fmt` (on the int8
    GEMV, or the fast f32 GEMV where not `int8`) and `experts` experts."""
    _, programs = _plan(Format(fmt), n, k, int8)
    group, groups = moe_kernels.moe_route_groups(programs)
    e_block = triton.next_power_of_2(experts)
    return RouteScratch(
        torch.empty(programs * e_block, device=device),
        torch.empty(groups * e_block, device=device),
        torch.zeros(groups, dtype=COUNTER_DTYPE, device=device),
        torch.empty(e_block, device=device),
    )


def _routing_args(rt: Routing, fmt: Format, n: int, k: int, int8: bool) -> tuple[tuple, dict, int]:
    """The routing's operands and constexprs for a launch of the product's plan, and its programs."""
    router_fmt = Format(rt.fmt)
    if n % QK or router_fmt not in ROUTER_FORMATS or not 1 <= rt.k <= rt.experts:
        raise ValueError(f"routing in the norm takes whole {QK}-value blocks, a float router and 1 <= k <= experts")
    if rt.ids.dtype != torch.int32 or rt.ids.numel() != rt.k or rt.weights.numel() != rt.k:
        raise ValueError(f"ids must be int32 and ids and weights ({rt.k},)")
    if rt.bias is not None and (rt.bias.dtype != torch.float32 or rt.bias.numel() != rt.experts):
        raise ValueError(f"the correction bias must be f32 ({rt.experts},)")
    plan, programs = _plan(fmt, n, k, int8)
    group, groups = moe_kernels.moe_route_groups(programs)
    e_block = triton.next_power_of_2(rt.experts)
    sc = rt.scratch
    if sc.shares.numel() < programs * e_block or sc.group_counters.numel() < groups:
        raise ValueError("the scratch is not route_scratch's for this product")
    chunk = max(min(triton.next_power_of_2(n), fast_norm.NORM_CHUNK), QK)
    warps = plan["num_warps"]
    args = (rt.router, sc.shares, sc.group_shares, sc.group_counters, sc.scores, rt.ids, rt.weights,
            sc.scores if rt.bias is None else rt.bias, float(rt.scale))  # fmt: skip
    consts = dict(
        NORM_BLOCK=chunk, NORM_STEPS=triton.cdiv(n, chunk), E=rt.experts, E_BLOCK=e_block, K=rt.k,
        K_BLOCK=triton.next_power_of_2(rt.k), RENORM=rt.renorm, SIGMOID=rt.sigmoid, BIAS=rt.bias is not None,
        RFMT=int(router_fmt), R_ROW_BYTES=stored_row_bytes(router_fmt, n), GROUP=group, GROUPS=groups,
        SHARE_ROWS=moe_kernels.moe_route_share_rows(max(group, groups), e_block, warps),
    )  # fmt: skip
    return args, consts | plan, programs


def gemv_q8_add_norm_route(x: Q8Acts, w: Tensor, fmt: Format, n: int, k: int, residual: Tensor, sum_out: Tensor,
                           norm_w: Tensor, eps: float, out: Tensor, out_q8: Q8Acts, counter: Tensor,
                           routing: Routing) -> Tensor:  # fmt: skip
    """`q8_epilogue.gemv_q8_add_norm` (sum_out = x @ W^T + residual, out = its RMS norm times norm_w, out_q8 its
    int8 form) that also routes the normed row as `route.route` does a decode step's one row (`routing`). One
    launch; `counter` is `epilogue.gemv_add_norm_counter`'s. Returns out."""
    fmt = Format(fmt)
    check_acts(x, k)
    check_rows(w, fmt, n, k)
    check_aligned([w], fmt)
    check_add_norm(residual, sum_out, norm_w, out, counter, n, x.q.device)
    check_q8_out(out_q8, n)
    args, consts, programs = _routing_args(routing, fmt, n, k, True)
    _q8_add_norm_route_kernel[(programs,)](
        *x, w, n, residual, sum_out, norm_w, out, *out_q8, counter, float(eps), *args, **consts, **pdl.options()
    )
    return out


def gemv_fast_add_norm_route(x: Tensor, w: Tensor, fmt: Format, n: int, k: int, residual: Tensor, sum_out: Tensor,
                             norm_w: Tensor, eps: float, out: Tensor, counter: Tensor,
                             routing: Routing) -> Tensor:  # fmt: skip
    """`fast_norm.gemv_fast_add_norm` (the f32 activation x (1, k), a format the fast GEMV takes) that also routes
    the normed row (`routing`), as `gemv_q8_add_norm_route`. Returns out."""
    fmt = Format(fmt)
    x2 = check_fast_add_norm(x, w, fmt, n, k, residual, sum_out, norm_w, out, counter)
    args, consts, programs = _routing_args(routing, fmt, n, k, False)
    _fast_add_norm_route_kernel[(programs,)](
        x2, w, n, residual, sum_out, norm_w, out, counter, float(eps), *args, **consts, **pdl.options()
    )
    return out
