"""The kept experts' down products and their weighted combine, in one launch: a program takes a tile of the
model's width for a row and sums, slot by slot, its weight times its expert's rows (read at base + id * an
expert's bytes, the id on the device) times the slot's activation row (int8 or f32), then adds the arrays
the plan sums in (the residual; a shared expert computed apart) and, where the plan defers the next norm to
the mixture (MoeDeferredFinalize), the last program norms the row (`fast_norm.norm_last`), writing its int8
form too under int8 activations.

A folded shared expert (SharedExpertFusion, a decode step's one row): the gate/up launch before this one has
written its SwiGLU and its gate's sigmoid into a scratch row (`shared.py`); each program adds sigmoid * (its
down rows . that row), read after its wait like the kept experts' activations.

Under int8 activations a program's product tile is every kept expert's rows at once (`moe_kernels.moe_down_rows`
rows of each, expert-major, each row with its own slot's activation; the experts' slots a power of two, or
packed, `moe_kernels.MOE_DOWN_PACKED`, a number of rows that need not be), so the experts' weights stream in
together; with f32 activations the slots are summed one after another.
Those weights always take the coherent path with a barrier after them (`weight_loads.PINNED`, whatever the
lane's `weight_loads` knob): a decode row of an expert is a few chunks (Qwen3-30B-A3B's 768 values, three Q4_K
super-blocks), and on the read-only path ptxas sinks each chunk's loads below the last chunk's dp4a (sm_90
SASS: chunk 1's 128-bit loads after chunk 0's IDP.4A, chunk 2's after chunk 1's), so a program made one DRAM
round trip a chunk; pinned, all of them are issued before the first sum at the same registers for Q4_K
(`moe_kernels.MOE_DOWN_UNPINNED` says where not). The int8 launch reads the ids and the first chunks' weights
before its wait for the gate/up launch (`_kept_q8`), so a program's round trips to them run under that
launch's end. Under `moe_kernels.MoeDown.READ_AHEAD` (the table's) the route weights are read with the ids and the
residual right after the wait (`down_rows.kept_dots`), so no load sits between a program's last dp4a and its
store.
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
from fuselane.lanes.cuda.triton.gemv import q8 as gemv_q8
from fuselane.lanes.cuda.triton.gemv.fast_norm import norm_last
from fuselane.lanes.cuda.triton.gemv.q8 import row_dots
from fuselane.lanes.cuda.triton.gemv.weight_loads import PINNED
from fuselane.lanes.cuda.triton.moe import shared as shared_mod
from fuselane.lanes.cuda.triton.moe.common import f32_plan, row_dot, tiles
from fuselane.lanes.cuda.triton.moe.down_rows import adds, kept_dots
from fuselane.lanes.cuda.triton.quant import Q8Acts, check_acts


@dataclass(frozen=True, slots=True)
class Norm:
    """The next norm the launch ends with: its weight, eps, the normed row and (int8 numerics) its int8 form."""

    w: Tensor
    eps: float
    out: Tensor
    out_q8: Q8Acts | None = None


@dataclass(frozen=True, slots=True)
class Tile:
    """The int8 down program's tile: weight rows a program (every slot's), warps, (row, group)s a thread
    (`gemv.q8.tile_plan`), under MoeDown.READ_AHEAD the chunks in flight (`moe_kernels.moe_down_depth`, the
    format's where None), and whether the tile is packed (`moe_kernels.moe_down_rows`); the kernels table's by
    default."""

    rows: int = moe_kernels.MOE_DOWN_TILE
    warps: int = moe_kernels.MOE_DOWN_WARPS
    per_thread: int = moe_kernels.MOE_DOWN_PER_THREAD
    depth: int | None = None
    packed: bool | None = None  # rows a program over the experts, not their slots (moe_kernels.MOE_DOWN_PACKED)


@triton.jit
def _down_kernel(
    h, hq, hd, hs, w, ids, weights, a0, a1, sum_out, norm_w, out, oq, od, os_, counters, eps, w_sd, sh, shq, shd,
    shs, D: tl.constexpr, DFF: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr, ENTRIES: tl.constexpr,
    EXPERT_BYTES: tl.constexpr, Q8IN: tl.constexpr, ADDS: tl.constexpr, NORM: tl.constexpr, Q8OUT: tl.constexpr,
    NORM_BLOCK: tl.constexpr, NORM_STEPS: tl.constexpr, SHARED: tl.constexpr, SDFF: tl.constexpr,
    FMT: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    N_UNITS: tl.constexpr, CHUNK: tl.constexpr, FENCE: tl.constexpr, DEPTH: tl.constexpr,
    STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
    SD_FMT: tl.constexpr, SD_STEPS: tl.constexpr, SD_UNITS: tl.constexpr, SD_SPLIT: tl.constexpr,
    SD_STAGES: tl.constexpr, SD_ROW_BYTES: tl.constexpr, SD_Q8: tl.constexpr, SD_FMT_Q8: tl.constexpr,
    SD_N_UNITS: tl.constexpr, SD_CHUNK: tl.constexpr, SD_FENCE: tl.constexpr, SD_DEPTH: tl.constexpr,
    AHEAD: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if EARLY:  # the experts' ids and weights are read before the wait (`_kept_q8`)
        pdl.release(PDL)
    else:
        pdl.begin(PDL)
    row = tl.program_id(1)
    _down_rows(h, hq, hd, hs, w, ids, weights, a0, a1, sum_out, w_sd, sh, shq, shd, shs, row, tl.program_id(0),
               D, DFF, K, ROWS, ENTRIES, EXPERT_BYTES, Q8IN, ADDS, SHARED, SDFF, FMT, ROW_BYTES, BLOCK_N,
               N_UNITS, CHUNK, FENCE, DEPTH, STEPS, UNITS, SPLIT, STAGES, SD_FMT, SD_STEPS, SD_UNITS,
               SD_SPLIT, SD_STAGES, SD_ROW_BYTES, SD_Q8, SD_FMT_Q8, SD_N_UNITS, SD_CHUNK, SD_FENCE, SD_DEPTH,
               AHEAD, EARLY, PDL)  # fmt: skip
    if NORM:
        norm_last(sum_out + row * D, norm_w, out + row * D, D, eps, counters + row, oq + row * D,
                  od + row * (D // 32), os_ + row * (D // 16), NORM_BLOCK, NORM_STEPS, Q8OUT)  # fmt: skip


@triton.jit
def _kept_q8(hq, hd, hs, w, ids, weights, a0, a1, row, tile, D: tl.constexpr, DFF: tl.constexpr, K: tl.constexpr,
             ROWS: tl.constexpr, ENTRIES: tl.constexpr, EXPERT_BYTES: tl.constexpr, FMT: tl.constexpr,
             ROW_BYTES: tl.constexpr,
             BLOCK_N: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, FENCE: tl.constexpr,
             DEPTH: tl.constexpr, ADDS: tl.constexpr, AHEAD: tl.constexpr, EARLY: tl.constexpr,
             PDL: tl.constexpr):  # fmt: skip
    """[BLOCK_N] f32: the weighted sum of row `row`'s kept experts' down products at tile `tile` of the width
    (its ROWS rows, the rest of BLOCK_N past them), every expert's rows in one int8 product tile of ENTRIES
    weight rows (expert-major: entry i is expert i // ROWS's row i % ROWS), each with its own pair's activation,
    so all their loads stream together (`moe_kernels.MOE_DOWN_TILE`). Entries past K experts read the last
    expert's rows again and count 0.

    EARLY (a dependent launch, `pdl`): the ids and the first chunks' weights are read before the wait for the
    launch before, so their round trips run under its end. Safe because the ids are the routing's, two
    launches back: the gate/up launch releases its dependents only after its own wait, which ends with the
    routing, so every later launch starts after the routing's writes (read from L2, `.cg`, never a line
    this SM's L1 kept from an earlier layer). The activations are the gate/up launch's: read after the wait.

    AHEAD (MoeDown.READ_AHEAD): the loop is `down_rows.kept_dots`, which reads the route weights with the
    ids and the first ADDS arrays added in (`down_rows.adds`, summed here) right after the wait, their round
    trips under the products'; otherwise `q8.row_dots`, the route weights read after it and the arrays added
    in by the caller."""
    i = tl.arange(0, ENTRIES)
    slot = i // ROWS
    pair = row * K + tl.minimum(slot, K - 1)
    rc = tl.minimum(tile * ROWS + i % ROWS, D - 1).to(tl.int64)
    off = tl.load(ids + pair, cache_modifier=".cg").to(tl.int64) * EXPERT_BYTES + rc * ROW_BYTES
    p = pair.to(tl.int64)[:, None]
    xq, xd, xs = hq + p * DFF, hd + p * (DFF // 32), hs + p * (DFF // 16)
    if AHEAD:
        wy, res = kept_dots(w + off, xq, xd, xs, weights + pair, a0, a1, row, tile * ROWS, slot < K, D, FMT,
                            ENTRIES, BLOCK_N, N_UNITS, CHUNK, FENCE, DEPTH, ADDS, EARLY, PDL)  # fmt: skip
        return _by_row(wy, i, ROWS, ENTRIES, BLOCK_N) + res
    y, _ = row_dots(w + off, w + off, xq, xd, xs, FMT, ENTRIES, N_UNITS, CHUNK, FENCE, False, DEPTH,
                    EARLY and PDL, EARLY)  # fmt: skip
    wy = tl.where(slot < K, tl.load(weights + pair) * y, 0.0)
    return _by_row(wy, i, ROWS, ENTRIES, BLOCK_N)


@triton.jit
def _by_row(wy, i, ROWS: tl.constexpr, ENTRIES: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N] f32: each of the program's rows' sum of its entries of `wy` (entry i is row i % ROWS), slot by
    slot: a reshape where the rows are a power of two, else each row's entries picked out of the tile."""
    if ROWS == BLOCK_N:
        y = tl.sum(tl.reshape(wy, [ENTRIES // ROWS, ROWS]), 0)
    else:
        y = tl.sum(tl.where((i % ROWS)[:, None] == tl.arange(0, BLOCK_N)[None, :], wy[:, None], 0.0), 0)
    return y


@triton.jit
def _down_rows(
    h, hq, hd, hs, w, ids, weights, a0, a1, sum_out, w_sd, sh, shq, shd, shs, row, tile,
    D: tl.constexpr, DFF: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr, ENTRIES: tl.constexpr,
    EXPERT_BYTES: tl.constexpr, Q8IN: tl.constexpr, ADDS: tl.constexpr, SHARED: tl.constexpr, SDFF: tl.constexpr,
    FMT: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    N_UNITS: tl.constexpr, CHUNK: tl.constexpr, FENCE: tl.constexpr, DEPTH: tl.constexpr,
    STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
    SD_FMT: tl.constexpr, SD_STEPS: tl.constexpr, SD_UNITS: tl.constexpr, SD_SPLIT: tl.constexpr,
    SD_STAGES: tl.constexpr, SD_ROW_BYTES: tl.constexpr, SD_Q8: tl.constexpr, SD_FMT_Q8: tl.constexpr,
    SD_N_UNITS: tl.constexpr, SD_CHUNK: tl.constexpr, SD_FENCE: tl.constexpr, SD_DEPTH: tl.constexpr,
    AHEAD: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Tile `tile` of row `row`'s sum: its kept experts' weighted down products, the shared expert's (its row
    written by the gate/up launch), the arrays added in; stored to sum_out. AHEAD (MoeDown.READ_AHEAD): the arrays added
    in are read with the products (`_kept_q8`), or, where the launch has waited already (not EARLY), first of
    all, their round trip under the products'."""
    lane = tl.arange(0, BLOCK_N)
    rows = tile * ROWS + lane  # ROWS of them the program's (BLOCK_N where the rows are a power of two)
    rc = tl.minimum(rows, D - 1).to(tl.int64)
    IN_PRODUCTS: tl.constexpr = AHEAD and Q8IN
    FIRST: tl.constexpr = AHEAD and not IN_PRODUCTS and not EARLY
    LAST: tl.constexpr = ADDS if not (IN_PRODUCTS or FIRST) else 0
    if FIRST:
        acc = adds(a0, a1, row, tile * ROWS, D, BLOCK_N, ADDS)
    else:
        acc = tl.zeros([BLOCK_N], tl.float32)
    if Q8IN:
        acc = _kept_q8(hq, hd, hs, w, ids, weights, a0, a1, row, tile, D, DFF, K, ROWS, ENTRIES, EXPERT_BYTES, FMT,
                       ROW_BYTES, BLOCK_N, N_UNITS, CHUNK, FENCE, DEPTH, ADDS if IN_PRODUCTS else 0, IN_PRODUCTS,
                       EARLY, PDL)  # fmt: skip
    else:
        for j in tl.static_range(K):
            pair = row * K + j
            off = tl.load(ids + pair).to(tl.int64) * EXPERT_BYTES + rc * ROW_BYTES
            y = row_dot(w + off, h + pair * DFF, FMT, STEPS, UNITS, SPLIT, BLOCK_N, STAGES)
            acc += tl.load(weights + pair) * y
    if SHARED and SD_Q8:  # after the products, so after the wait: the row's int8 form is the launch before's
        sd = w_sd + rc * SD_ROW_BYTES
        ys, _ = row_dots(sd, sd, shq, shd, shs, SD_FMT_Q8, BLOCK_N, SD_N_UNITS, SD_CHUNK, SD_FENCE, False,
                         SD_DEPTH, False)  # fmt: skip
        acc += tl.load(sh + SDFF, cache_modifier=".cg") * ys
    elif SHARED:  # after the products, so after the wait: the row is the launch before's
        ys = row_dot(w_sd + rc * SD_ROW_BYTES, sh, SD_FMT, SD_STEPS, SD_UNITS, SD_SPLIT, BLOCK_N, SD_STAGES)
        acc += tl.load(sh + SDFF, cache_modifier=".cg") * ys
    if LAST >= 1:
        acc += adds(a0, a1, row, tile * ROWS, D, BLOCK_N, LAST)
    tl.store(sum_out + row * D + rows, acc, mask=(lane < ROWS) & (rows < D))


def counters(rows: int, device) -> Tensor:
    """The zeroed counters a launch of `rows` rows takes; each launch leaves them at zero."""
    return torch.zeros(rows, dtype=torch.int32, device=device)


def down_combine(h: Tensor | Q8Acts, w: Tensor, fmt: Format, ids: Tensor, weights: Tensor, d: int, dff: int,
                 sum_out: Tensor, *, adds: tuple[Tensor, ...] = (), shared: shared_mod.Shared | None = None,
                 norm: Norm | None = None, counter: Tensor, variant: moe_kernels.MoeDown | None = None,
                 tile: Tile | None = None) -> Tensor:  # fmt: skip
    """sum_out (rows, d) = sum over each row's slots j of weights[row, j] * (h[pair] @ Wd[ids[pair]]^T) (+ the
    shared expert's sigmoid-gated output) (+ each of `adds`), Wd (experts, d, dff) checkpoint rows in `fmt`,
    h (rows * slots, dff) f32 or its int8 form; with `norm`, its RMS norm of each row too. One launch.
    `variant` (default `moe_kernels.MOE_DOWN_VARIANT`) and `tile` (default the kernels table's) are for timing
    one against another (`benchmarks/moe_decode.py`); every choice sums the same terms."""
    fmt = Format(fmt)
    variant = moe_kernels.MOE_DOWN_VARIANT if variant is None else moe_kernels.MoeDown(variant)
    tile = tile or Tile()
    if tile.depth is not None and not (
        1 <= tile.depth <= moe_kernels.MOE_DOWN_MAX_DEPTH and variant is moe_kernels.MoeDown.READ_AHEAD
    ):
        raise ValueError(f"a depth (1 to {moe_kernels.MOE_DOWN_MAX_DEPTH}) is the new order's (MoeDown.READ_AHEAD)")
    rows, k = ids.shape
    if ids.dtype != torch.int32 or weights.numel() != rows * k or sum_out.numel() != rows * d:
        raise ValueError(f"ids must be int32 (rows, k), weights as many, sum_out ({rows}, {d})")
    if len(adds) > 2 or any(a.numel() != rows * d for a in adds):
        raise ValueError(f"at most two arrays of ({rows}, {d}) are added in")
    if shared is not None and rows != 1:
        raise ValueError("a shared expert folds into a decode step's one row")
    q8in = isinstance(h, Q8Acts)
    if q8in:
        check_acts(h, dff, rows * k)
        gemv_q8.check_aligned([w], fmt)
        per = moe_kernels.moe_down_rows(k, tile.rows, tile.packed)
        entries = moe_kernels.moe_down_entries(k, per)
        block_n = triton.next_power_of_2(per)
        consts = gemv_q8.tile_plan(fmt, dff, entries, tile.warps, tile.per_thread)
        warps = consts.pop("num_warps")
        consts |= dict(BLOCK_N=block_n, ROWS=per, ENTRIES=entries, STEPS=1, UNITS=1, SPLIT=1, STAGES=1)
        if fmt not in moe_kernels.MOE_DOWN_UNPINNED:
            consts["FENCE"] = PINNED
        if variant is moe_kernels.MoeDown.READ_AHEAD:  # `down_rows.kept_dots`' own depth
            consts["DEPTH"] = tile.depth or moe_kernels.moe_down_depth(fmt)
        hargs = (h.q, *h)
    else:
        consts, warps = f32_plan(fmt, d, dff)
        block_n = per = consts["BLOCK_N"]
        consts |= dict(N_UNITS=1, CHUNK=1, FENCE=False, DEPTH=1, ROWS=per, ENTRIES=per)
        hargs = (h, h, h, h)
    sconsts = shared_mod.down_consts(shared, d, block_n, warps)
    nb = tiles(d, per)
    chunk = max(min(triton.next_power_of_2(d), fast_norm.NORM_CHUNK), QK)
    q8out = norm is not None and norm.out_q8 is not None
    oq = norm.out_q8 if q8out else (sum_out, sum_out, sum_out)  # type: ignore[union-attr]
    s = shared
    sq8 = s.scratch_q8 if s is not None and s.scratch_q8 is not None else (sum_out,) * 3
    sargs = (s.down, s.scratch, *sq8) if s is not None else (sum_out,) * 5
    padded = (*adds, sum_out, sum_out)[:2]
    _down_kernel[(nb, rows)](
        *hargs, w, ids, weights, *padded, sum_out,
        norm.w if norm else sum_out, norm.out if norm else sum_out, *oq, counter, float(norm.eps if norm else 0.0),
        *sargs, D=d, DFF=dff, K=k, EXPERT_BYTES=d * stored_row_bytes(fmt, dff), Q8IN=q8in,
        ADDS=len(adds), NORM=norm is not None, Q8OUT=q8out, NORM_BLOCK=chunk, NORM_STEPS=triton.cdiv(d, chunk),
        SHARED=s is not None, AHEAD=variant is moe_kernels.MoeDown.READ_AHEAD, EARLY=q8in,
        **consts, **sconsts, num_warps=warps,
        **pdl.options(),
    )  # fmt: skip
    return sum_out
