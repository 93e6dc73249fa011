"""The kept experts' gate and up products with their SwiGLU, one launch over only their rows: a grid of (tiles
of the expert's rows, (row, slot) pairs), each program reading its pair's expert id on the device and that
expert's rows of the 3-D tensors (base + id * an expert's bytes).

The activation is the int8 GEMV's (`gemv.q8.row_dots`, a decode step's one row where the plan quantized it)
or f32 rows (`gemv.formats.dot_rows`, every format: a chunk's rows, the dequantized numerics). Under int8 a
program's tile is whole 32-value blocks, so it writes its result's int8 form (`quant.store_quantized`) for
the down products too, with no launch of its own.

A decode step's folded shared expert (SharedExpertFusion, `shared.py`) takes one more column of programs: its
SwiGLU's tiles and its gate's sigmoid, into the scratch row the down launch reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import QK, Format
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv import q8 as gemv_q8
from fuselane.lanes.cuda.triton.gemv.q8 import row_dots
from fuselane.lanes.cuda.triton.moe.common import f32_plan, row_dot, tiles
from fuselane.lanes.cuda.triton.moe.shared import Shared, int8_takes, phase_consts, shared_phase
from fuselane.lanes.cuda.triton.quant import Q8Acts, check_acts, store_quantized

# A program's rows: one 32-value block of the output, quantized whole; a (row, group) of each chunk a thread.
# Eight warps, not four: a decode step's launch is a few programs a SM (Qwen3-30B-A3B: 24 tiles x 8 kept
# experts, 192 programs for 132 SMs), so its warps are all a SM has to hide the dp4a chains' and the loads'
# latency. At four warps and two (row, group)s a thread (ptxas sm_90, Q4_K: 158 registers, Q6_K 218) a SM
# ran one or two warps a scheduler; at eight, one a thread (86 and 126 registers), two or four, every program
# still resident at once (two blocks a SM), the same weights in flight a program.
Q8_ROWS, Q8_WARPS, Q8_PER_THREAD = QK, 8, 1


@triton.jit
def _gate_up_kernel(
    x, xq, xd, xs, w_gate, w_up, ids, out, oq, od, os_, sx, w_sg, w_su, w_sc, sh, shq, shd, shs, pairs,
    N: tl.constexpr, KD: tl.constexpr, SLOTS: tl.constexpr, EXPERT_BYTES: tl.constexpr,
    Q8IN: tl.constexpr, Q8OUT: tl.constexpr,
    FMT: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    N_UNITS: tl.constexpr, CHUNK: tl.constexpr, FENCE: tl.constexpr, DEPTH: tl.constexpr,
    STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
    SHARED: tl.constexpr, SHARED_Q8: tl.constexpr, SHARED_Q8OUT: tl.constexpr, SDFF: tl.constexpr,
    NA: tl.constexpr, SCORED: tl.constexpr,
    SG_FMT: tl.constexpr, SG_STEPS: tl.constexpr, SG_UNITS: tl.constexpr, SG_SPLIT: tl.constexpr,
    SG_BLOCK_N: tl.constexpr, SG_STAGES: tl.constexpr, SG_ROW_BYTES: tl.constexpr,
    SC_FMT: tl.constexpr, SC_STEPS: tl.constexpr, SC_UNITS: tl.constexpr, SC_SPLIT: tl.constexpr,
    SC_STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # The expert ids are the last launch's, so the wait comes first; the next launch is released only after it,
    # so a launch after this one starts once the routing has ended and may read its ids before its own wait
    # (`down._kept_q8`).
    pdl.wait(PDL)
    pdl.release(PDL)
    pair = tl.program_id(1)
    if SHARED and pair == pairs:  # the shared expert's column: NA programs, the rest of the column idle
        ticket = tl.program_id(0)
        if not SCORED and ticket == 0:  # an ungated expert: its scale is 1 where a gated one's sigmoid goes
            tl.store(sh + SDFF, 1.0)
        if SHARED_Q8 and ticket < NA - SCORED:  # its SwiGLU's tiles as a kept expert's, from the int8 activation
            rows = ticket * BLOCK_N + tl.arange(0, BLOCK_N)
            off = tl.minimum(rows, SDFF - 1).to(tl.int64) * ROW_BYTES
            gate, up = row_dots(w_sg + off, w_su + off, xq, xd, xs, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, True,
                                DEPTH, False)  # fmt: skip
            glu = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(sh + rows, glu, mask=rows < SDFF)
            if SHARED_Q8OUT:  # its int8 form, a block a tile, for the down launch's int8 product
                store_quantized(glu, ticket * BLOCK_N, SDFF, shq, shd, shs)
        elif ticket < NA:
            shared_phase(sx, w_sg, w_su, w_sc, sh, ticket, SDFF, NA, SCORED, SG_FMT, SG_STEPS, SG_UNITS,
                         SG_SPLIT, SG_BLOCK_N, SG_STAGES, SG_ROW_BYTES, SC_FMT, SC_STEPS, SC_UNITS, SC_SPLIT,
                         SC_STAGES)  # fmt: skip
    elif tl.program_id(0) < TILES:
        _kept_pair(x, xq, xd, xs, w_gate, w_up, ids, out, oq, od, os_, pair, N, KD, SLOTS, EXPERT_BYTES, Q8IN,
                   Q8OUT, FMT, ROW_BYTES, BLOCK_N, N_UNITS, CHUNK, FENCE, DEPTH, STEPS, UNITS, SPLIT,
                   STAGES)  # fmt: skip


@triton.jit
def _kept_pair(
    x, xq, xd, xs, w_gate, w_up, ids, out, oq, od, os_, pair,
    N: tl.constexpr, KD: tl.constexpr, SLOTS: tl.constexpr, EXPERT_BYTES: tl.constexpr,
    Q8IN: tl.constexpr, Q8OUT: tl.constexpr,
    FMT: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    N_UNITS: tl.constexpr, CHUNK: tl.constexpr, FENCE: tl.constexpr, DEPTH: tl.constexpr,
    STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Tile program_id(0) of a kept expert's (row, slot) pair: its SwiGLU, and its int8 form under Q8OUT."""
    e = tl.load(ids + pair).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    off = e * EXPERT_BYTES + tl.minimum(rows, N - 1).to(tl.int64) * ROW_BYTES
    if Q8IN:
        gate, up = row_dots(w_gate + off, w_up + off, xq, xd, xs, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, True, DEPTH,
                            False)  # fmt: skip
    else:
        x_row = x + (pair // SLOTS) * KD
        gate = row_dot(w_gate + off, x_row, FMT, STEPS, UNITS, SPLIT, BLOCK_N, STAGES)
        up = row_dot(w_up + off, x_row, FMT, STEPS, UNITS, SPLIT, BLOCK_N, STAGES)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out + pair * N + rows, h, mask=rows < N)
    if Q8OUT:
        store_quantized(h, tl.program_id(0) * BLOCK_N, N, oq + pair * N, od + pair * (N // 32), os_ + pair * (N // 16))


def gate_up(x: Tensor | Q8Acts, w_gate: Tensor, w_up: Tensor, fmt: Format, ids: Tensor, n: int, k: int,
            out: Tensor, out_q8: Q8Acts | None = None, shared: Shared | None = None) -> Tensor:  # fmt: skip
    """out (pairs, n) f32 = SiLU(x[row] @ Wg[e]^T) * (x[row] @ Wu[e]^T) for each (row, slot) pair, e = ids[pair]
    (int32, (rows, slots)), Wg and Wu (experts, n, k) checkpoint rows in `fmt`; x f32 (rows, k), or one row's
    int8 form (a Q8Acts), with `out_q8` the result's int8 form too. With `shared` (a decode step's one row),
    its SwiGLU and its gate's sigmoid into its scratch row too. One launch."""
    fmt = Format(fmt)
    pairs = ids.numel()
    if ids.dtype != torch.int32 or tuple(out.shape[-1:]) != (n,) or out.numel() != pairs * n:
        raise ValueError(f"ids must be int32 and out ({pairs}, {n})")
    q8in = isinstance(x, Q8Acts)
    common = dict(N=n, KD=k, SLOTS=ids.shape[-1], EXPERT_BYTES=n * stored_row_bytes(fmt, k), Q8IN=q8in,
                  Q8OUT=out_q8 is not None)  # fmt: skip
    if q8in:
        check_acts(x, k)
        if pairs != ids.shape[-1] or not int8_takes(fmt, n, k):
            raise ValueError("the int8 expert products take one row of whole blocks in the int8 GEMV's formats")
        gemv_q8.check_aligned([w_gate, w_up], fmt)
        plan = gemv_q8.tile_plan(fmt, k, Q8_ROWS, Q8_WARPS, Q8_PER_THREAD)
        warps = plan.pop("num_warps")
        consts = plan | dict(STEPS=1, UNITS=1, SPLIT=1, STAGES=1)
        args = (x.q, *x)
    else:
        if out_q8 is not None:
            raise ValueError("the expert products write their int8 form only from int8 activations")
        consts, warps = f32_plan(fmt, n, k)
        consts |= dict(N_UNITS=1, CHUNK=1, FENCE=False, DEPTH=1)
        args = (x, x, x, x)
    if shared is not None and pairs != ids.shape[-1]:
        raise ValueError("a shared expert folds into a decode step's one row")
    oq = out_q8 if out_q8 is not None else (out, out, out)
    # the shared expert's SwiGLU as the kept experts' int8 tiles where its binding said so (`shared.swiglu_tiles`)
    shared_q8 = shared is not None and shared.tiles
    if shared_q8 and not (q8in and shared.fmt is fmt):
        raise ValueError("a folded shared expert's int8 tiles are the kept experts': their format, int8 activations")
    if shared is not None and shared.down_int8 and not shared_q8:
        raise ValueError("a folded shared expert's int8 down reads the int8 form its SwiGLU's int8 tiles write")
    sconsts, na = phase_consts(shared, k, warps, consts["BLOCK_N"] if shared_q8 else None)
    s = shared
    q8out = s is not None and s.down_int8
    sq8 = s.scratch_q8 if s is not None and s.scratch_q8 is not None else (out,) * 3
    score = s.score if s is not None and s.score is not None else out  # an ungated expert's: a stand-in
    sargs = (s.x, s.gate, s.up, score, s.scratch, *sq8) if s is not None else (out,) * 8
    n_tiles = tiles(n, consts["BLOCK_N"])
    _gate_up_kernel[(max(n_tiles, na), pairs + (s is not None))](
        *args, w_gate, w_up, ids, out, *oq, *sargs, pairs, **common, **consts, **sconsts, TILES=n_tiles,
        SHARED=s is not None, SHARED_Q8=shared_q8, SHARED_Q8OUT=q8out, NA=na, num_warps=warps, **pdl.options(),
    )  # fmt: skip
    return out
