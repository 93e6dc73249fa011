"""The int8 decode GEMV in parts with a query's and a key's heads turned in its epilogue (`turn`): a layer's
merged QKV product and its rotations (q/k norm where the model has it, rope, the key's append to its cache) in
one launch. `f32_rope` is the same launch for the f32 GEMVs (activations=dequant)."""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import Format
from fuselane.graph.ops import Yarn
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.parts import Part, first_tile
from fuselane.lanes.cuda.triton.gemv.q8 import Q8Acts, parts_launch, parts_product
from fuselane.lanes.cuda.triton.gemv.turn import (
    COUNTER_DTYPE,
    Turn,
    check_tile,
    check_turns,
    rope_counters,
    turn_args,
    turn_heads,
)

__all__ = ["COUNTER_DTYPE", "Turn", "check_tile", "gemv_q8_parts_rope", "rope_counters"]


@triton.jit
def _parts_rope_kernel(
    xq, xd, xs, parts, res,
    q_out, k_out, k_pitch, q_w, k_w, pos, counters, eps, freq_exp, yarn_low, yarn_inv, yarn_cut,
    FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FENCE: tl.constexpr, PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr,
    DEPTH: tl.constexpr, Q_PART: tl.constexpr, K_PART: tl.constexpr, Q_HEADS: tl.constexpr, HD: tl.constexpr,
    HALF_P2: tl.constexpr, NORM: tl.constexpr, K_AT_POS: tl.constexpr, YARN: tl.constexpr, SECOND: tl.constexpr,
    FMT_B: tl.constexpr, N_UNITS_B: tl.constexpr, CHUNK_B: tl.constexpr, ROW_BYTES_B: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    part = parts_product(
        xq, xd, xs, parts, res, FMT, N_UNITS, CHUNK, ROW_BYTES, BLOCK_N, FENCE, PARTS, BIAS, AT_ROW, HAS_RES, DEPTH,
        PDL, SECOND, FMT_B, N_UNITS_B, CHUNK_B, ROW_BYTES_B,
    )  # fmt: skip
    turn_heads(part, tl.program_id(0) - first_tile(part, parts), parts, q_out, k_out, k_pitch, q_w, k_w, pos,
               counters, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, BLOCK_N, Q_PART, K_PART, Q_HEADS, HD, HALF_P2,
               NORM, K_AT_POS, YARN)  # fmt: skip


def gemv_q8_parts_rope(
    x: Q8Acts, parts: Sequence[Part | tuple], fmt: Format | Sequence[Format], q: Turn, k: Turn, pos: Tensor,
    counters: Tensor, *,
    hd: int, base: float, eps: float = 0.0, block_n: int | None = None, warps: int | None = None,
    per_thread: int | None = None, yarn: Yarn | None = None,
) -> None:  # fmt: skip
    """`gemv_q8.gemv_q8_parts` whose parts `q.part` and `k.part` (a query's and a key's raw heads, written to
    their parts' outputs as before) are then turned in the epilogue as `rope.rope_q_k` turns them: normed
    where `norm_w` is given (both or neither), rotated to position pos[0], landing in `q.out` and in `k.out`
    (at row pos[0] where `cache_row_pitch` is given), by `yarn`'s stretched frequencies where given. `counters`
    are `rope_counters(q.heads, k.heads)`'s. `fmt`: the parts' format or each part's, as `gemv_q8_parts`."""
    parts = [Part(*p) for p in parts]
    check_turns(parts, q, k, hd, counters)
    plan, args, flags, tiles = parts_launch(x, parts, fmt, None, block_n, warps, per_thread)
    check_tile(plan["BLOCK_N"], hd)
    targs, tconsts = turn_args(q, k, pos, counters, hd=hd, base=base, eps=eps, yarn=yarn)
    _parts_rope_kernel[(tiles,)](x.q, x.d, x.s, *args, *targs, **flags, **plan, **tconsts, **pdl.options())
