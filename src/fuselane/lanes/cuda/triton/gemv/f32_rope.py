"""The f32 decode GEMVs in parts with a query's and a key's heads turned in their epilogue (`turn`), as
`q8_rope` is for the int8 GEMV: under activations=dequant a layer's merged QKV product and its rotations in one
launch, on the tile-streaming GEMV (`fast`: Q4_K, Q6_K, Q8_0, Q5_0, F16, BF16) or the GEMV by rows (`rows`:
every other format it decodes, and parts of two formats, a step's one row).

Why: without it a mixture's layer under dequant took 8 launches where its value product was in another format
than its query's (a Q4_K_M recipe's Q6_K attn_v): the QKV product, the rotations, the value's, the attention,
the output projection, the router, the experts' gate/up and their down. The tiles of both GEMVs are powers of
two of at most `kernels.F32_GEMV_MOST_TILE_ROWS` rows, so a head of a multiple of that is whole programs.
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import Format
from fuselane.graph.ops import Yarn
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv import fast, rows
from fuselane.lanes.cuda.triton.gemv.parts import Part, first_tile, part_formats, part_rows, parts_args, store_parts
from fuselane.lanes.cuda.triton.gemv.turn import Turn, check_tile, check_turns, turn_args, turn_heads


@triton.jit
def _fast_parts_rope_kernel(
    x, parts, res,
    q_out, k_out, k_pitch, q_w, k_w, pos, counters, eps, freq_exp, yarn_low, yarn_inv, yarn_cut,
    FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FENCE: tl.constexpr, PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr,
    Q_PART: tl.constexpr, K_PART: tl.constexpr, Q_HEADS: tl.constexpr, HD: tl.constexpr,
    HALF_P2: tl.constexpr, NORM: tl.constexpr, K_AT_POS: tl.constexpr, YARN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    part, row_ids, n, w_rows = part_rows(parts, ROW_BYTES, BLOCK_N)
    y, _ = fast.row_dots(w_rows, w_rows, x, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, False, PDL)
    store_parts(y, row_ids, part, n, parts, res, PARTS, BIAS, AT_ROW, HAS_RES)
    turn_heads(part, tl.program_id(0) - first_tile(part, parts), parts, q_out, k_out, k_pitch, q_w, k_w, pos,
               counters, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, BLOCK_N, Q_PART, K_PART, Q_HEADS, HD, HALF_P2,
               NORM, K_AT_POS, YARN)  # fmt: skip


@triton.jit
def _rows_parts_rope_kernel(
    x, x_pitch, m, parts, res, res_pitch,
    q_out, k_out, k_pitch, q_w, k_w, pos, counters, eps, freq_exp, yarn_low, yarn_inv, yarn_cut,
    FMT: tl.constexpr, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr,
    STAGES: tl.constexpr, SECOND: tl.constexpr, FMT_B: tl.constexpr, ROW_BYTES_B: tl.constexpr,
    STEPS_B: tl.constexpr, UNITS_B: tl.constexpr, SPLIT_B: tl.constexpr, STAGES_B: tl.constexpr,
    PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, Q_PART: tl.constexpr, K_PART: tl.constexpr, Q_HEADS: tl.constexpr,
    HD: tl.constexpr, HALF_P2: tl.constexpr, NORM: tl.constexpr, K_AT_POS: tl.constexpr, YARN: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    part, tile = rows.parts_body(x, x_pitch, m, parts, res, res_pitch, FMT, ROW_BYTES, STEPS, UNITS, SPLIT, STAGES,
                                 SECOND, FMT_B, ROW_BYTES_B, STEPS_B, UNITS_B, SPLIT_B, STAGES_B, PARTS, BIAS, AT_ROW,
                                 HAS_RES, BLOCK_M, BLOCK_N)  # fmt: skip
    turn_heads(part, tile, parts, q_out, k_out, k_pitch, q_w, k_w, pos, counters, eps, freq_exp, yarn_low, yarn_inv,
               yarn_cut, BLOCK_N, Q_PART, K_PART, Q_HEADS, HD, HALF_P2, NORM, K_AT_POS, YARN)  # fmt: skip


def takes(fmt: Format) -> str | None:
    """Which f32 GEMV turns a step's query and key in `fmt` ('fast' or 'rows'), or None: the plan's fact."""
    return kernels.f32_turning_gemv(Format(fmt), 1)


def gemv_f32_parts_rope(
    x: Tensor, parts: Sequence[Part | tuple], fmt: Format | Sequence[Format], q: Turn, k: Turn, pos: Tensor,
    counters: Tensor, *, hd: int, base: float, eps: float = 0.0, yarn: Yarn | None = None,
) -> None:  # fmt: skip
    """The f32 GEMV in parts over one row `x` (1, k) (`fast.gemv_fast_parts` in its formats, else
    `rows.gemv_parts`, which takes parts of two formats too) whose parts `q.part` and `k.part` are then turned
    in the epilogue as `q8_rope.gemv_q8_parts_rope` turns them. `counters` are `turn.rope_counters(q.heads,
    k.heads)`'s."""
    parts = [Part(*p) for p in parts]
    fmts = part_formats(fmt, len(parts))
    check_turns(parts, q, k, hd, counters)
    targs, tconsts = turn_args(q, k, pos, counters, hd=hd, base=base, eps=eps, yarn=yarn)
    width = x.shape[-1]
    one = fmts[0] if len(set(fmts)) == 1 else None
    if one is not None and takes(one) == "fast":
        fast.check_one_row(x, width, [], one, 1)
        plan = fast.launch_plan(one, width, None, None, n=sum(p.n for p in parts))
        args, flags, tiles = parts_args(parts, one, width, plan["BLOCK_N"], x, None)
        check_tile(plan["BLOCK_N"], hd)
        _fast_parts_rope_kernel[(tiles,)](x, *args, *targs, **flags, **plan, **tconsts, **pdl.options())
        return
    if any(not kernels.rows_gemv(f, 1) for f in fmts) or x.dim() != 2 or x.shape[0] != 1:
        names = ", ".join(sorted({f.name for f in fmts}))
        raise ValueError(f"the f32 GEMVs turn one row's heads in the formats they decode, not {names}")
    grid, args, consts = rows.parts_launch(x, parts, fmts, None)
    check_tile(consts["BLOCK_N"], hd)
    _rows_parts_rope_kernel[grid](*args, *targs, **consts, **tconsts, **pdl.options())
