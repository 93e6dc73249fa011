"""The end of a chunk's grouped down launch (`grouped.down_grouped`): the weighted combine of each row's kept
experts, the arrays the fused op adds in (the residual), and the next norm where the plan defers it to the
mixture (MoeDeferredFinalize).

Each program has stored its tile's products, times their route weights, at their pairs' rows of a scratch.
A row's k pairs lie in k tiles (k experts), so a row's tile of the model's width is complete when the k-th of
them has stored it: each program counts its pairs' rows done on a counter per (row, tile of width), and the
program that brings one to k sums that row's k slots in slot order, from 0 (so the sum is the same whoever
takes it: deterministic, no floating-point atomics), adds the arrays in and stores the row's tile. With a
norm, each (row) counts its tiles of width summed, and the program that sums its last one norms the row.
Each counter is re-armed by the program that finds it full, so the launch replays in a CUDA graph.

Why the program that finds a counter full sees the others' stores (`fast_norm.norm_last`'s argument): a
block's barrier orders its threads' stores before its counter atomics, each a release at gpu scope; the
atomic that finds the count full reads the value every earlier release wrote and is an acquire; the loads
after it read L2 (.cg), never this SM's L1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True, slots=True)
class GroupedNorm:
    """The next norm the launch ends with: its weight, eps and the normed rows (rows, d) f32."""

    w: Tensor
    eps: float
    out: Tensor


@dataclass(frozen=True, slots=True)
class Combine:
    """Where the combine writes: sum_out (rows, d) f32, at most two (rows, d) arrays added in (either may be
    sum_out), the norm, and the zeroed counters (`counters`)."""

    sum_out: Tensor
    counters: Tensor
    adds: tuple[Tensor, ...] = ()
    norm: GroupedNorm | None = None


def counters_for(rows: int, width_tiles: int) -> int:
    """Counters a launch of `rows` rows and `width_tiles` tiles of the model's width takes: one a (row, tile),
    one a row."""
    return rows * width_tiles + rows


def counters(rows: int, width_tiles: int, device) -> Tensor:
    """The zeroed counters of a launch; each launch leaves them at zero."""
    return torch.zeros(counters_for(rows, width_tiles), dtype=torch.int32, device=device)


def combine_args(c: Combine, rows: int, d: int) -> tuple:
    """The kernel's arguments for `c`: the arrays added (stand-ins past them), sum_out, the norm's weight and
    rows, the counters, eps."""
    if len(c.adds) > 2 or any(a.numel() != rows * d for a in c.adds) or c.sum_out.numel() != rows * d:
        raise ValueError(f"sum_out and at most two added arrays of ({rows}, {d})")
    adds = (*c.adds, c.sum_out, c.sum_out)[:2]
    if c.norm is None:
        return (*adds, c.sum_out, c.sum_out, c.sum_out, c.counters, 0.0)
    if c.norm.out.numel() != rows * d or c.norm.w.numel() != d:
        raise ValueError(f"the norm's weight must be ({d},) and its rows ({rows}, {d})")
    return (*adds, c.sum_out, c.norm.w, c.norm.out, c.counters, float(c.norm.eps))


@triton.jit
def _done(ptrs, mask, full):
    """Counts each masked counter up by one (release); which of them this program found full (acquire), those
    re-armed."""
    tl.debug_barrier()
    seen = tl.atomic_add(ptrs, 1, mask=mask, sem="acq_rel", scope="gpu")
    last = mask & (seen == full - 1)
    tl.atomic_xchg(ptrs, 0, mask=last, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _norm_rows(sum_out, norm_w, normed, eps, row, mine, D: tl.constexpr, NORM_CHUNK: tl.constexpr,
               BLOCK_M: tl.constexpr):  # fmt: skip
    """normed[row] = sum_out[row] / sqrt(mean(sum_out[row]^2) + eps) * norm_w for the rows `mine` masks (the
    arithmetic of `norm.rms_norm`), their whole width in chunks."""
    offs = tl.arange(0, NORM_CHUNK)
    base = row.to(tl.int64)[:, None] * D
    squares = tl.zeros([BLOCK_M, NORM_CHUNK], tl.float32)
    for step in range(tl.cdiv(D, NORM_CHUNK)):
        at = step * NORM_CHUNK + offs
        m = mine[:, None] & (at < D)[None, :]
        s = tl.load(sum_out + base + at[None, :], mask=m, other=0.0, cache_modifier=".cg")
        squares += s * s
    r = tl.rsqrt(tl.sum(squares, 1) / D + eps)
    for step in range(tl.cdiv(D, NORM_CHUNK)):
        at = step * NORM_CHUNK + offs
        m = mine[:, None] & (at < D)[None, :]
        s = tl.load(sum_out + base + at[None, :], mask=m, other=0.0, cache_modifier=".cg")
        wn = tl.load(norm_w + at, mask=at < D, other=0.0)
        tl.store(normed + base + at[None, :], s * r[:, None] * wn[None, :], mask=m)


@triton.jit
def combine_rows(pair_out, a0, a1, sum_out, norm_w, normed, counters, eps, row, live, cols,
                 D: tl.constexpr, SLOTS: tl.constexpr, ADDS: tl.constexpr, NORM: tl.constexpr,
                 NORM_CHUNK: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """The program's share of the combine, its tile's products stored: the rows `live` of `row` whose tile of
    width `cols` it completes are summed over their slots in order (+ the added arrays) into sum_out, and,
    with NORM, the rows whose last tile that was are normed."""
    width_tiles = tl.num_programs(0)
    mine = _done(counters + row * width_tiles + tl.program_id(0), live, SLOTS)
    if tl.sum(mine.to(tl.int32), 0) > 0:
        keep = mine[:, None] & (cols < D)[None, :]
        at = row.to(tl.int64)[:, None] * D + cols[None, :]
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for j in tl.static_range(SLOTS):
            slot = (row * SLOTS + j).to(tl.int64)[:, None] * D + cols[None, :]
            total += tl.load(pair_out + slot, mask=keep, other=0.0, cache_modifier=".cg")
        if ADDS >= 1:
            total += tl.load(a0 + at, mask=keep, other=0.0)
        if ADDS >= 2:
            total += tl.load(a1 + at, mask=keep, other=0.0)
        tl.store(sum_out + at, total, mask=keep)
        if NORM:
            last = _done(counters + ROWS * width_tiles + row, mine, width_tiles)
            if tl.sum(last.to(tl.int32), 0) > 0:
                _norm_rows(sum_out, norm_w, normed, eps, row, last, D, NORM_CHUNK, BLOCK_M)
