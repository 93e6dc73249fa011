"""A mixture's kept experts in a grid or ternary format for a decode step's or a batch's rows: the (row, slot)
pairs' products on the grid GEMV's dot (`gemv.grid_dot`), each program reading its pairs' expert ids on the
device and those experts' rows of the 3-D tensor (base + id * an expert's bytes). A chunk's pairs take the
grouped GEMM instead (`moe/grouped.py`, its weight tiles from `values.grid_tile`).

Two launches, as the other formats' (`moe/gate_up.py`, `moe/down.py`) with f32 activations, each tile the grid
GEMV's first tile's 16 weight rows (`EXPERT_TILE`), so a step's few pairs still spread over the chip:
- `grid_gate_up` (MoeGateUpAct): a program takes GATE_UP_ROWS rows of a pair's expert, those of its gate and
  of its up matrix in one tile, and stores their SwiGLU; a decode step's row in int8 where the plan quantized it
  (`q8.grid_dot_q8`: dp4a on the grid bytes), the f32 row otherwise;
- `grid_down_combine` (MoeDownCombine, MoeDeferredFinalize; the pairs' SwiGLU rows in int8 where the gate/up
  launch wrote them, GluActMulQuant): a program takes `down_rows(slots)` rows of the
  model's width for every kept expert of its row at once (slot-major, each weight row with its own pair's
  activation, as the int8 down's tile), so their loads are in flight together rather than one expert after
  another; it sums the slots' weighted products (a fixed tree, the same bits at every replay), then the arrays
  the plan adds in; where the plan defers the next norm to the mixture the row's last program norms it
  (`fast_norm.norm_last`), writing its int8 form too where an int8 product reads it.
A folded shared expert (SharedExpertFusion) is not taken: its products run apart (`fits._grid_launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import LAYOUTS, QK, QK_K, Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv import fast_norm
from fuselane.lanes.cuda.triton.gemv.epilogue import COUNTER_DTYPE
from fuselane.lanes.cuda.triton.gemv.fast_norm import norm_last
from fuselane.lanes.cuda.triton.gemv.q8_epilogue import check_q8_out, quantize_block_last
from fuselane.lanes.cuda.triton.grid.gemv import GridTile, dot_consts, grid_dot
from fuselane.lanes.cuda.triton.grid.q8 import grid_dot_q8, int8_args
from fuselane.lanes.cuda.triton.grid.values import device_table
from fuselane.lanes.cuda.triton.moe.down import Norm
from fuselane.lanes.cuda.triton.moe.down_rows import adds as added
from fuselane.lanes.cuda.triton.quant import Q8Acts, check_acts

# the int8 form of a normed row: a scale a 32-value block, a sum a 16-value half (`quant.Q8Acts`)
Q8_BLOCK, Q8_SUM = tl.constexpr(QK), tl.constexpr(QK // 2)
# the experts' tile: the grid GEMV's first (16 rows, 4 warps, 128 values a step), not yet swept for experts
EXPERT_TILE = GridTile(16, 4, 128)
# rows of the expert a gate/up program takes: its tile is those rows of the gate and of the up matrix
GATE_UP_ROWS = EXPERT_TILE.block_n // 2


@triton.jit
def _gate_up_kernel(
    x, xq, xd, w_gate, w_up, table, ids, out, oq, od, os_, counters,
    N: tl.constexpr, KD: tl.constexpr, SLOTS: tl.constexpr, EXPERT_BYTES: tl.constexpr, FMT: tl.constexpr,
    NBYTES: tl.constexpr, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, ROWS: tl.constexpr,
    SLICE_C: tl.constexpr, SUPER_C: tl.constexpr, GROUP_C: tl.constexpr, TERNARY: tl.constexpr, Q8IN: tl.constexpr,
    RUN_C: tl.constexpr,
    Q8OUT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)  # the ids and the activation are the launches' before
    pair = tl.program_id(1)
    e = tl.load(ids + pair).to(tl.int64)
    i = tl.arange(0, 2 * ROWS)  # the tile: ROWS rows of the gate, then the same rows of the up matrix
    rows = tl.program_id(0) * ROWS + i % ROWS
    base = e * EXPERT_BYTES
    w = tl.where(i < ROWS, w_gate + base, w_up + base)
    row = (pair // SLOTS).to(tl.int64)
    if Q8IN:  # the pair's row in int8: its codes and its blocks' scales
        y = grid_dot_q8(w, w, table, N, xq + row * KD, xd + row * (KD // Q8_BLOCK), rows, i * 0, FMT, NBYTES,
                        ROW_BYTES, STEPS, 2 * ROWS, SLICE_C, SUPER_C, GROUP_C, False, RUN_C)[0]  # fmt: skip
    else:
        y = grid_dot(w, w, table, N, x + row * KD + tl.arange(0, 1), rows, i * 0, FMT, NBYTES, ROW_BYTES, STEPS,
                     1, 2 * ROWS, SLICE_C, SUPER_C, GROUP_C, TERNARY)[0]  # fmt: skip
    halves = tl.reshape(y, [2, ROWS])
    half = tl.arange(0, 2)[:, None]
    gate = tl.sum(tl.where(half == 0, halves, 0.0), 0)
    up = tl.sum(tl.where(half == 1, halves, 0.0), 0)
    # SiLU(g) = g / (1 + e^-g): for a very negative g, e^-g is inf and the quotient a signed zero, as it should
    h = gate / (1.0 + tl.exp(-gate)) * up
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    at = pair.to(tl.int64)
    tl.store(out + at * N + r, h, mask=r < N)
    if Q8OUT:  # the pair's row in int8 for the down product, a block by the last of its programs
        blocks = N // Q8_BLOCK
        quantize_block_last(out + at * N, tl.program_id(0), N, oq + at * N, od + at * blocks,
                            os_ + at * (N // Q8_SUM), counters + at * blocks, ROWS)  # fmt: skip


@triton.jit
def _down_kernel(
    h, hq, hd, w, table, ids, weights, a0, a1, sum_out, norm_w, normed, oq, od, os_, counters, eps,
    D: tl.constexpr, DFF: tl.constexpr, SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, EXPERT_BYTES: tl.constexpr,
    ADDS: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, NORM_STEPS: tl.constexpr, Q8OUT: tl.constexpr,
    FMT: tl.constexpr, NBYTES: tl.constexpr, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, ROWS: tl.constexpr,
    SLICE_C: tl.constexpr, SUPER_C: tl.constexpr, GROUP_C: tl.constexpr, TERNARY: tl.constexpr, Q8IN: tl.constexpr,
    RUN_C: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    row = tl.program_id(1).to(tl.int64)
    first = tl.program_id(0) * ROWS
    # the tile: ROWS rows of the width for every kept expert at once (slot-major, the slots a power of two; those
    # past the row's read its last expert again and count 0), each weight row with its own pair's activation
    i = tl.arange(0, SLOTS_P2 * ROWS)
    slot = i // ROWS
    pair = row * SLOTS + tl.minimum(slot, SLOTS - 1)
    e = tl.load(ids + pair).to(tl.int64)
    wt = tl.where(slot < SLOTS, tl.load(weights + pair), 0.0)
    if Q8IN:  # each pair's SwiGLU row in int8 (the gate/up launch wrote it)
        we = w + e * EXPERT_BYTES
        y = grid_dot_q8(we, we, table, D, hq, hd, first + i % ROWS, pair * DFF, FMT, NBYTES, ROW_BYTES, STEPS,
                        SLOTS_P2 * ROWS, SLICE_C, SUPER_C, GROUP_C, False, RUN_C)[0]  # fmt: skip
    else:
        we = w + e * EXPERT_BYTES
        y = grid_dot(we, we, table, D, h + tl.arange(0, 1), first + i % ROWS, pair * DFF, FMT, NBYTES, ROW_BYTES,
                     STEPS, 1, SLOTS_P2 * ROWS, SLICE_C, SUPER_C, GROUP_C, TERNARY)[0]  # fmt: skip
    acc = tl.sum(tl.reshape(tl.reshape(y, [SLOTS_P2 * ROWS]) * wt, [SLOTS_P2, ROWS]), 0)
    if ADDS > 0:
        acc += added(a0, a1, row, first, D, ROWS, ADDS)
    cols = first + tl.arange(0, ROWS)
    tl.store(sum_out + row * D + cols, acc, mask=cols < D)
    if NORM:
        norm_last(sum_out + row * D, norm_w, normed + row * D, D, eps, counters + row, oq + row * D,
                  od + row * (D // Q8_BLOCK), os_ + row * (D // Q8_SUM), NORM_BLOCK, NORM_STEPS, Q8OUT)  # fmt: skip


def down_rows(slots: int) -> int:
    """Rows of the width a down program takes: the grid GEMV's tile shared among the kept experts' slots (a power
    of two), one row each at least."""
    return max(1, EXPERT_TILE.block_n // triton.next_power_of_2(slots))


def _check(w: Tensor, fmt: Format, n: int, k: int, ids: Tensor) -> int:
    """The experts the 3-D tensor `w` holds, its rows checked: whole super-blocks, whole experts."""
    if Format(fmt) not in kernels.GRID_GEMV_FORMATS:
        raise ValueError(f"no grid expert products for {Format(fmt).name}")
    if n < 1 or k < 1 or k % QK_K:
        raise ValueError(f"{fmt.name} experts take rows of whole {QK_K}-value blocks, not {k} values")
    expert = n * (k // QK_K) * LAYOUTS[fmt].nbytes
    if w.dtype != torch.uint8 or w.dim() != 1 or not w.is_contiguous() or w.numel() % expert or w.numel() == 0:
        raise ValueError(f"{fmt.name} experts of {n} rows of {k} must be contiguous 1-D uint8, whole experts")
    if ids.dtype != torch.int32 or ids.dim() != 2:
        raise ValueError("ids must be int32 (rows, slots)")
    return w.numel() // expert


def _acts(x: Tensor | Q8Acts, fmt: Format, k: int, rows: int, name: str) -> tuple[Tensor, Tensor, Tensor]:
    """A launch's three activation pointers (f32 rows, int8 codes, block scales; `q8.int8_args`) for `rows` rows
    of k values: an int8 form checked as such, or contiguous f32 rows standing for all three."""
    if isinstance(x, Q8Acts):
        return int8_args(x, fmt, k, rows)
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() != rows * k:
        raise ValueError(f"{name} must be contiguous f32 ({rows}, {k})")
    return x, x, x


def grid_gate_up(x: Tensor | Q8Acts, w_gate: Tensor, w_up: Tensor, fmt: Format, ids: Tensor, n: int, k: int,
                 out: Tensor, out_q8: Q8Acts | None = None, counters: Tensor | None = None) -> Tensor:  # fmt: skip
    """out (pairs, n) f32 = SiLU(x[row] @ Wg[e]^T) * (x[row] @ Wu[e]^T) for each (row, slot) pair, e = ids[pair]
    (int32 (rows, slots)), Wg and Wu (experts, n, k) checkpoint rows in the grid format `fmt`, x f32 (rows, k) or
    its int8 form (a grid format's, not a ternary one's: `q8.grid_dot_q8`). With `out_q8` each pair's row is
    written in int8 too (n whole 32-value blocks, each by the last of its programs: `counters`,
    `q8_counters(pairs * n)`'s). One launch."""
    fmt = Format(fmt)
    experts = _check(w_gate, fmt, n, k, ids)
    if w_up.numel() != w_gate.numel():
        raise ValueError("the gate and up experts must be the same shape")
    rows, slots = ids.shape
    xf, xq, xd = _acts(x, fmt, k, rows, "x")
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != rows * slots * n:
        raise ValueError(f"out must be contiguous f32 ({rows * slots}, {n})")
    if out_q8 is not None:
        pairs = ids.numel()
        check_acts(out_q8, n, pairs)
        if counters is None or counters.numel() != pairs * n // QK or counters.dtype != COUNTER_DTYPE:
            raise ValueError(f"the pairs' int8 form takes q8_counters({pairs * n})")
    oq = out_q8 if out_q8 is not None else (out, out, out)  # never read without Q8OUT
    _gate_up_kernel[(triton.cdiv(n, GATE_UP_ROWS), ids.numel())](
        xf, xq, xd, w_gate, w_up, device_table(fmt, w_gate.device), ids, out, *oq,
        counters if counters is not None else ids, N=n, KD=k, SLOTS=ids.shape[1],
        EXPERT_BYTES=w_gate.numel() // experts, ROWS=GATE_UP_ROWS,
        **dot_consts(fmt, k, EXPERT_TILE),
        Q8IN=isinstance(x, Q8Acts),
        Q8OUT=out_q8 is not None,
        num_warps=EXPERT_TILE.warps,
        **pdl.options(),
    )  # fmt: skip
    return out


def grid_down_combine(h: Tensor | Q8Acts, w: Tensor, fmt: Format, ids: Tensor, weights: Tensor, d: int, dff: int,
                      sum_out: Tensor, *, adds: tuple[Tensor, ...] = (), norm: Norm | None = None,
                      counter: Tensor | None = None) -> Tensor:  # fmt: skip
    """sum_out (rows, d) = sum over each row's slots j of weights[row, j] * (h[pair] @ Wd[ids[pair]]^T)
    (+ each of `adds`), Wd (experts, d, dff) checkpoint rows in the grid format `fmt`, h f32 (rows * slots, dff)
    or its int8 form (a grid format's, as `grid_gate_up` writes it);
    with `norm` (`moe.down.Norm`) each row's RMS norm too, by the row's last program, counted on `counter`
    (`moe.down.counters(rows)`, left at zero), and its int8 form where `norm.out_q8`. One launch."""
    fmt = Format(fmt)
    experts = _check(w, fmt, d, dff, ids)
    rows, slots = ids.shape
    hf, hq, hd = _acts(h, fmt, dff, rows * slots, "h")
    if weights.numel() != rows * slots or sum_out.numel() != rows * d:
        raise ValueError(f"weights must be ({rows}, {slots}) and sum_out ({rows}, {d})")
    if len(adds) > 2 or any(a.numel() != rows * d for a in adds):
        raise ValueError(f"at most two arrays of ({rows}, {d}) are added in")
    if norm is not None and (counter is None or counter.numel() < rows or norm.out.numel() != rows * d):
        raise ValueError(f"a norm takes a counter a row and an output of ({rows}, {d})")
    q8out = norm is not None and norm.out_q8 is not None
    if q8out:
        check_q8_out(norm.out_q8, d)  # type: ignore[union-attr]
    chunk = max(min(triton.next_power_of_2(d), fast_norm.NORM_CHUNK), QK)
    padded = (*adds, sum_out, sum_out)[:2]  # an absent array is never read
    oq = norm.out_q8 if q8out else (sum_out,) * 3  # type: ignore[union-attr]
    per = down_rows(slots)
    _down_kernel[(triton.cdiv(d, per), rows)](
        hf, hq, hd, w, device_table(fmt, w.device), ids, weights, *padded, sum_out,
        norm.w if norm else sum_out, norm.out if norm else sum_out, *oq,
        counter if counter is not None else ids, float(norm.eps if norm else 0.0),
        D=d, DFF=dff, SLOTS=slots, SLOTS_P2=triton.next_power_of_2(slots), EXPERT_BYTES=w.numel() // experts,
        ADDS=len(adds), NORM=norm is not None, NORM_BLOCK=chunk, NORM_STEPS=triton.cdiv(d, chunk), Q8OUT=q8out,
        ROWS=per, **dot_consts(fmt, dff, EXPERT_TILE), Q8IN=isinstance(h, Q8Acts),
        num_warps=EXPERT_TILE.warps, **pdl.options(),
    )  # fmt: skip
    return sum_out
