"""A QKV GEMV in parts with a query's and a key's heads turned in its epilogue: what every GEMV family's kernel
of that kind shares (`q8_rope`: the int8 GEMV's; `f32_rope`: the tile-streaming f32 GEMV's and the GEMV by rows').

Why: the rotations (q/k norm where the model has it, rope, the key's append to its cache) are otherwise a launch
of their own after the product (`rope.rope_q_k`), one of the seven a layer the lane's budget allows, and it reads
back what the product has just written. Here each program stores its rows (the family's epilogue), then counts
itself on its head's counter; the program that makes a head's count whole reads the head back from L2 (past its
SM's L1: the other programs wrote it), turns it with `rope.rotate_head` and re-arms the counter for the next
launch. The count is `q8_epilogue`'s semaphore pattern: the block's barrier, then an acq_rel atomic, so every
program's stores are visible to the one that finishes the head.

A head is HD / BLOCK_N programs of one part: the tile's rows divide the head (`check_tile`). The query's heads
land in their own buffer; the key's in the cache at the position (or in a buffer). The other parts (the value's
row of the cache, a bias) keep their plain epilogue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.graph.ops import Yarn
from fuselane.lanes.cuda.triton.gemv.parts import Part
from fuselane.lanes.cuda.triton.rope import check_head, frequencies, rotate_head

COUNTER_DTYPE = torch.int32


class Turn(NamedTuple):
    """A query's or a key's rotation as these launches take it: the part it turns, where the turned heads land
    (`out`, and the cache's row pitch where they land at the position's row), and the per-head norm's weight
    (hd,) where the model norms its heads first."""

    part: int
    out: Tensor
    heads: int
    cache_row_pitch: int | None = None
    norm_w: Tensor | None = None


@triton.jit
def turn_heads(
    part, tile, parts, q_out, k_out, k_pitch, q_w, k_w, pos, counters, eps, freq_exp, yarn_low, yarn_inv, yarn_cut,
    BLOCK_N: tl.constexpr, Q_PART: tl.constexpr, K_PART: tl.constexpr, Q_HEADS: tl.constexpr, HD: tl.constexpr,
    HALF_P2: tl.constexpr, NORM: tl.constexpr, K_AT_POS: tl.constexpr, YARN: tl.constexpr,
):  # fmt: skip
    """After a program of part `part` stored its rows (its tile `tile` of the part), count it on its head's
    counter; the program that completes the head turns it (the query into `q_out`, the key into `k_out`)."""
    if (part == Q_PART) | (part == K_PART):
        head = tile * BLOCK_N // HD
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
    """The zeroed counters a turning launch takes for a query of `heads` heads and a key of `kv_heads` (one a
    head); the kernel leaves them at zero."""
    return torch.zeros(heads + kv_heads, dtype=COUNTER_DTYPE, device=device)


def check_tile(block_n: int, hd: int) -> None:
    """A head's rows are whole programs: the tile's rows divide the head."""
    if hd % block_n:
        raise ValueError(f"a tile of {block_n} rows does not divide a head of {hd}")


def check_turns(parts: Sequence[Part], q: Turn, k: Turn, hd: int, counters: Tensor) -> None:
    """The query's and key's turns are two of the launch's parts, of whole f32 heads, normed alike, the query
    into a buffer, with the counters of their heads."""
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


def turn_args(q: Turn, k: Turn, pos: Tensor, counters: Tensor, *, hd: int, base: float, eps: float,
              yarn: Yarn | None) -> tuple[list, dict]:  # fmt: skip
    """`turn_heads`' arguments after the product's (q_out to eps) and its keywords (the frequencies' and the
    constants)."""
    k_pitch = 0 if k.cache_row_pitch is None else int(k.cache_row_pitch)
    q_w = q.out if q.norm_w is None else q.norm_w
    k_w = k.out if k.norm_w is None else k.norm_w
    args = [q.out, k.out, k_pitch, q_w, k_w, pos, counters, float(eps)]
    consts = dict(Q_PART=q.part, K_PART=k.part, Q_HEADS=q.heads, HD=hd, HALF_P2=triton.next_power_of_2(hd // 2),
                  NORM=q.norm_w is not None, K_AT_POS=k.cache_row_pitch is not None)  # fmt: skip
    return args, consts | frequencies(base, hd, yarn)
