"""The int8 decode GEMV in parts with a query's and a key's heads turned in its epilogue: a layer's merged QKV
product and its rotations (q/k norm where the model has it, rope, the key's append to its cache) in one launch.

Why: the rotations are otherwise a launch of their own after the product (`rope.rope_q_k`), one of the seven
a layer the lane's budget allows, and it reads back what the product has just written. Here each program
stores its rows (`parts.store_parts`), then counts itself on its head's counter; the program that makes
a head's count whole reads the head back from L2 (past its SM's L1: the other programs wrote it), turns it
with `rope.rotate_head` and re-arms the counter for the next launch. The count is `q8_epilogue`'s
semaphore pattern: the block's barrier, then an acq_rel atomic, so every program's stores are visible to the
one that finishes the head.

A head is HD / BLOCK_N programs of one part: the tile's rows divide the head (`check_tile`). The query's heads
land in their own buffer; the key's in the cache at the position (or in a buffer). The other parts (the
value's row of the cache, a bias) keep their plain epilogue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import Format
from fuselane.graph.ops import Yarn
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.parts import Part, first_tile
from fuselane.lanes.cuda.triton.gemv.q8 import Q8Acts, parts_launch, parts_product
from fuselane.lanes.cuda.triton.rope import check_head, frequencies, rotate_head

COUNTER_DTYPE = torch.int32


class Turn(NamedTuple):
    """A query's or a key's rotation as this launch takes it: the part it turns, where the turned heads land
    (`out`, and the cache's row pitch where they land at the position's row), and the per-head norm's weight
    (hd,) where the model norms its heads first."""

    part: int
    out: Tensor
    heads: int
    cache_row_pitch: int | None = None
    norm_w: Tensor | None = None


@triton.jit
def _parts_rope_kernel(
    xq, xd, xs, parts, res,
    q_out, k_out, k_pitch, q_w, k_w, pos, counters, eps, freq_exp, yarn_low, yarn_inv, yarn_cut,
    FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FENCE: tl.constexpr, PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr,
    DEPTH: tl.constexpr, Q_PART: tl.constexpr, K_PART: tl.constexpr, Q_HEADS: tl.constexpr, HD: tl.constexpr,
    HALF_P2: tl.constexpr, NORM: tl.constexpr, K_AT_POS: tl.constexpr, YARN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    part = parts_product(
        xq, xd, xs, parts, res, FMT, N_UNITS, CHUNK, ROW_BYTES, BLOCK_N, FENCE, PARTS, BIAS, AT_ROW, HAS_RES, DEPTH, PDL
    )  # fmt: skip
    if (part == Q_PART) | (part == K_PART):
        head = (tl.program_id(0) - first_tile(part, parts)) * BLOCK_N // HD
        slot = head + tl.where(part == K_PART, Q_HEADS, 0)
        tl.debug_barrier()  # every thread's rows stored before the count
        done = tl.atomic_add(counters + slot, 1, sem="acq_rel", scope="gpu")
        if done == HD // BLOCK_N - 1:
            p = tl.load(pos)
            # each side names its own pointers: a name assigned in both branches would have to be one type
            if part == Q_PART:
                q_src = parts.items[Q_PART].out + head * HD
                rotate_head(q_src, q_out + head * HD, q_w, p, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, HD, HALF_P2,
                            NORM, True, YARN)  # fmt: skip
            else:
                k_row = p.to(tl.int64) * k_pitch if K_AT_POS else 0
                k_src = parts.items[K_PART].out + head * HD
                rotate_head(k_src, k_out + k_row + head * HD, k_w, p, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, HD,
                            HALF_P2, NORM, True, YARN)  # fmt: skip
            tl.atomic_xchg(counters + slot, 0, sem="relaxed", scope="gpu")  # re-armed for the next launch


def rope_counters(heads: int, kv_heads: int, device) -> Tensor:
    """The zeroed counters `gemv_q8_parts_rope` takes for a query of `heads` heads and a key of `kv_heads`
    (one a head); the kernel leaves them at zero."""
    return torch.zeros(heads + kv_heads, dtype=COUNTER_DTYPE, device=device)


def check_tile(block_n: int, hd: int) -> None:
    """A head's rows are whole programs: the tile's rows divide the head."""
    if hd % block_n:
        raise ValueError(f"a tile of {block_n} rows does not divide a head of {hd}")


def gemv_q8_parts_rope(
    x: Q8Acts, parts: Sequence[Part | tuple], fmt: Format, q: Turn, k: Turn, pos: Tensor, counters: Tensor, *,
    hd: int, base: float, eps: float = 0.0, block_n: int | None = None, warps: int | None = None,
    per_thread: int | None = None, yarn: Yarn | None = None,
) -> None:  # fmt: skip
    """`gemv_q8.gemv_q8_parts` whose parts `q.part` and `k.part` (a query's and a key's raw heads, written to
    their parts' outputs as before) are then turned in the epilogue as `rope.rope_q_k` turns them: normed
    where `norm_w` is given (both or neither), rotated to position pos[0], landing in `q.out` and in `k.out`
    (at row pos[0] where `cache_row_pitch` is given), by `yarn`'s stretched frequencies where given. `counters`
    are `rope_counters(q.heads, k.heads)`'s."""
    parts = [Part(*p) for p in parts]
    check_head(hd)
    if q.part == k.part or not (0 <= q.part < len(parts) and 0 <= k.part < len(parts)):
        raise ValueError(f"the query and the key turn two of the {len(parts)} parts, not {q.part} and {k.part}")
    for side in (q, k):
        if parts[side.part].n != side.heads * hd or parts[side.part].out.dtype != torch.float32:
            raise ValueError(f"part {side.part} must write {side.heads} heads of {hd} f32 values")
    if (q.norm_w is None) != (k.norm_w is None):
        raise ValueError("one launch turns a query and a key both normed or neither")
    if q.cache_row_pitch is not None:
        raise ValueError("the query's turned heads land in a buffer, not a cache")
    if counters.dtype != COUNTER_DTYPE or counters.numel() != q.heads + k.heads:
        raise ValueError(f"counters must be rope_counters({q.heads}, {k.heads})")
    plan, args, flags, tiles = parts_launch(x, parts, fmt, None, block_n, warps, per_thread)
    check_tile(plan["BLOCK_N"], hd)
    k_pitch = 0 if k.cache_row_pitch is None else int(k.cache_row_pitch)
    _parts_rope_kernel[(tiles,)](
        x.q, x.d, x.s, *args,
        q.out, k.out, k_pitch, q.out if q.norm_w is None else q.norm_w, k.out if k.norm_w is None else k.norm_w,
        pos, counters, float(eps),
        **flags, **plan, Q_PART=q.part, K_PART=k.part, Q_HEADS=q.heads, HD=hd,
        HALF_P2=triton.next_power_of_2(hd // 2), NORM=q.norm_w is not None, K_AT_POS=k.cache_row_pitch is not None,
        **frequencies(base, hd, yarn), **pdl.options(),
    )  # fmt: skip
