"""What the split decode attentions share (`decode.py`'s head a block, `group_decode.py`'s packed group,
`paged.py`'s batch rows): the launch's shape, the cache's pitch, the splits' partials parked and merged with the
log-sum-exp combine, and the output's gate and int8 form in its store.

Softmax weights are computed as 2^(s * scale * log2 e - max): the scale folds into one multiply.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import QK
from fuselane.lanes.cuda.plan import attn_kernels, kernels
from fuselane.lanes.cuda.triton.quant import quantize_block

LOG2E = math.log2(math.e)

QB = tl.constexpr(QK)  # values a block of the int8 output


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1).

    Triton 3.6's interpreter runs `for i in range(lo, hi, step)` as Python's range, taking int() of the
    bounds' 1-element arrays, which NumPy 2 refuses. Interpreted, a loop whose bounds come from device memory
    (the position) runs as a while loop over the same tiles in the same order; compiled, it stays a for
    loop, which Triton's pipeliner overlaps with the loads of the next tile.
    """
    return bool(triton.knobs.runtime.interpret)


class DecodePlan(NamedTuple):
    """A decode attention's launch: query heads a block (a key/value group's), blocks (the groups), and the
    most chunks of the span."""

    heads_per_block: int
    head_blocks: int
    splits: int


def merge_round(rows: int, width: int, warps: int, splits: int, asked: int | None = None) -> int:
    """Splits a packed merge reads a round trip (a power of two, a tl.arange): as many as keep a block's `rows`
    rows of `width` f32 values a split within `attn_kernels.ATTN_GROUP_MERGE_HELD` values a thread, no more than the
    splits (rounded up to a power of two) or `asked`."""
    held = attn_kernels.ATTN_GROUP_MERGE_HELD * warps * kernels.WARP // (rows * width)
    batch = max(1, min(asked or held, held, triton.next_power_of_2(splits)))
    return 1 << (batch.bit_length() - 1)


def cache_pitch(cache: torch.Tensor, kv_heads: int, hd: int, name: str) -> int:
    if cache.dim() != 2 or cache.stride(1) != 1 or cache.shape[1] < kv_heads * hd:
        raise ValueError(f"{name}: a 2-D cache of unit-stride rows of at least {kv_heads * hd} values")
    return cache.stride(0)


@triton.jit
def gate_heads(o, gate_ptr, head, col, mask, GATE_HP: tl.constexpr, GATED: tl.constexpr):
    """o times sigmoid of each head's gate (AttnOutputGate), the gate's head `GATE_HP` values apart."""
    if GATED:
        z = tl.load(gate_ptr + head[:, None] * GATE_HP + col, mask=mask, other=0.0).to(tl.float32)
        o = o * tl.sigmoid(z)
    return o


@triton.jit
def store_out(o, offs, store_mask, head, out_ptr, oq_ptr, od_ptr, os_ptr, HD: tl.constexpr, Q8OUT: tl.constexpr,
              first=0, HB: tl.constexpr = 1, seam_ptr=0, WIDTH: tl.constexpr = 0):  # fmt: skip
    """A block's heads' outputs o [G, D] at `offs`: f32, and where Q8OUT also as int8 activations
    (`quant.Q8Acts`): each head's values in 32-value blocks where HD is a multiple of 32; otherwise the 32-value
    blocks of the row (WIDTH values) that the block's HB heads from head `first` on touch, read back after the
    block's barrier, each by the last block to store into it (`_store_span_q8`; `seam_ptr`: the row's seam
    counters, `seam_counters`)."""
    tl.store(out_ptr + offs, o, mask=store_mask)
    if Q8OUT:
        if (HD // QB) * QB == HD:  # heads of whole blocks
            G: tl.constexpr = o.shape[0]
            D: tl.constexpr = o.shape[1]
            NB: tl.constexpr = D // QB
            codes, d, sums = quantize_block(tl.reshape(o, [G * NB, QB]), QB)
            tl.store(oq_ptr + offs, tl.reshape(codes, [G, D]), mask=store_mask)
            j = tl.arange(0, NB)[None, :]
            blk = head[:, None] * (HD // QB) + j  # [G, NB]
            live = (j < HD // QB) & (tl.max(store_mask.to(tl.int32), 1) > 0)[:, None]
            tl.store(od_ptr + blk, tl.reshape(d, [G, NB]), mask=live)
            two = tl.arange(0, 2)[None, None, :]
            tl.store(os_ptr + blk[:, :, None] * 2 + two, tl.reshape(sums, [G, NB, 2]), mask=live[:, :, None])
        else:
            _store_span_q8(out_ptr, oq_ptr, od_ptr, os_ptr, seam_ptr, first * HD, HB * HD, WIDTH)


def seam_counters(width: int, hd: int, heads_per_block: int) -> int:
    """Counters a row's output needs for its int8 form: one a 32-value block where a block's heads are not
    whole 32-value blocks together (`attn_kernels.attn_block_whole_blocks`), so neighbouring blocks share one (a
    seam); none otherwise. int32, zero when first given; the kernels leave them at zero."""
    return 0 if attn_kernels.attn_block_whole_blocks(hd, heads_per_block) else width // QK


@triton.jit
def _store_span_q8(out_ptr, oq_ptr, od_ptr, os_ptr, seam_ptr, start, SPAN: tl.constexpr, WIDTH: tl.constexpr):
    """The int8 form of the row's 32-value blocks that the SPAN values from `start`, which this block's threads
    have just stored, touch. A 32-value block the span holds whole is this block's to quantize; one it shares
    with a neighbouring block's span (a seam: only the span's first and last blocks can be) is the last
    sharer's: each sharer ticks the seam's counter after its stores, and the one whose tick completes the count
    reads the block back, quantizes it and re-arms the counter. The order is `park_partial`'s: the block's
    barrier, the counter's acq_rel atomic (a scalar's: one thread's, its result broadcast to the block), a
    barrier, then reads from L2 (.cg), past this SM's L1, where other SMs' stores are."""
    tl.debug_barrier()
    BP: tl.constexpr = triton.next_power_of_2(triton.cdiv(SPAN, QB) + 1)  # the most blocks a span touches
    blk = start // QB + tl.arange(0, BP)
    live = (blk * QB < start + SPAN) & (blk < WIDTH // QB)
    if (SPAN // QB) * QB == SPAN:  # spans of whole blocks (two heads of 80): no seams, every block this one's
        _quantize_blocks(out_ptr, oq_ptr, od_ptr, os_ptr, blk, live)
    else:
        first, last = start // QB, (start + SPAN - 1) // QB
        first_mine = _seam_tick(seam_ptr, first, SPAN, WIDTH)
        last_mine = first_mine
        if last != first:
            last_mine = _seam_tick(seam_ptr, last, SPAN, WIDTH)
        tl.debug_barrier()
        inner = (blk != first) & (blk != last)
        mine = live & (inner | ((blk == first) & first_mine) | ((blk == last) & last_mine))
        _quantize_blocks(out_ptr, oq_ptr, od_ptr, os_ptr, blk, mine)
        # re-armed by the sharer that completed it, after its reads: the next launch (a replayed graph's) comes
        # after this one's end in stream order
        if first_mine & (_seam_sharers(first, SPAN, WIDTH) > 1):
            tl.atomic_xchg(seam_ptr + first, 0, sem="relaxed", scope="gpu")
        if (last != first) & last_mine & (_seam_sharers(last, SPAN, WIDTH) > 1):
            tl.atomic_xchg(seam_ptr + last, 0, sem="relaxed", scope="gpu")


@triton.jit
def _quantize_blocks(out_ptr, oq_ptr, od_ptr, os_ptr, blk, mine):
    """The int8 form of the row's 32-value blocks `blk` that `mine` masks, read from L2 (.cg)."""
    at = blk[:, None] * QB + tl.arange(0, QB)[None, :]  # [BP, QB]
    v = tl.load(out_ptr + at, mask=mine[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
    codes, d, sums = quantize_block(v, QB)
    tl.store(oq_ptr + at, codes, mask=mine[:, None])
    tl.store(od_ptr + blk, d, mask=mine)
    tl.store(os_ptr + blk[:, None] * 2 + tl.arange(0, 2)[None, :], sums, mask=mine[:, None])


@triton.jit
def _seam_sharers(b, SPAN: tl.constexpr, WIDTH: tl.constexpr):
    """How many spans [k * SPAN, (k + 1) * SPAN) of the row share 32-value block b: from its first value's
    span to its last's."""
    lo = b * QB
    return (tl.minimum(lo + QB, WIDTH) - 1) // SPAN - lo // SPAN + 1


@triton.jit
def _seam_tick(seam_ptr, b, SPAN: tl.constexpr, WIDTH: tl.constexpr):
    """Whether this block quantizes 32-value block b: it is the only span's, or this block's tick on its
    counter is the sharers' last."""
    sharers = _seam_sharers(b, SPAN, WIDTH)
    mine = sharers == 1
    if sharers > 1:
        mine = tl.atomic_add(seam_ptr + b, 1, sem="acq_rel", scope="gpu") == sharers - 1
    return mine


@triton.jit
def park_partial(acc, run_max, run_sum, acc_ptr, max_ptr, sum_ptr, count_ptr, part, col, store_mask, heads_mask,
                 HD: tl.constexpr):  # fmt: skip
    """A split's partial (its heads' running max, sum of weights and unnormalized weighted values) into scratch
    at `part` (one a head), then one tick of its group's counter: returns the ticks before it, so the block that
    reads the group's splits less one merges them."""
    tl.store(acc_ptr + part[:, None] * HD + col, acc, mask=store_mask)
    tl.store(max_ptr + part, run_max, mask=heads_mask)
    tl.store(sum_ptr + part, run_sum, mask=heads_mask)
    # every thread's partial is stored before one thread's release: the block's barrier, then the counter's
    # acq_rel atomic (CUTLASS's semaphore pattern); the last block's acquire sees them all
    tl.debug_barrier()
    return tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")


@triton.jit
def merge_partials(acc_ptr, max_ptr, sum_ptr, head, heads_mask, col, col_mask, active, SPLITS: tl.constexpr,
                   S_P2: tl.constexpr, MERGE_BATCH: tl.constexpr, HD: tl.constexpr):  # fmt: skip
    """The heads' outputs [G, D] from their `active` splits' partials (head h's split s at h * SPLITS + s): the
    log-sum-exp combine, normalized. Where one batch takes every split (MERGE_BATCH >= S_P2) the values are
    loaded with the maxima and sums, one round trip to L2; otherwise in batches after them."""
    # partials are other SMs' writes: read them from L2 (.cg), past this SM's L1
    s_ = tl.arange(0, S_P2)[None, :]
    parts = head[:, None] * SPLITS + s_  # [G, S_P2]
    here = (s_ < active) & heads_mask[:, None]
    maxes = tl.load(max_ptr + parts, mask=here, other=float("-inf"), cache_modifier=".cg")
    sums = tl.load(sum_ptr + parts, mask=here, other=0.0, cache_modifier=".cg")
    if MERGE_BATCH >= S_P2:
        values = tl.load(
            acc_ptr + parts[:, :, None] * HD + col[:, None, :],
            mask=here[:, :, None] & col_mask[:, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # [G, S_P2, D]
    top = tl.max(maxes, axis=1)  # [G]
    top = tl.where(heads_mask, top, 0.0)
    total = tl.sum(tl.exp2(maxes - top[:, None]) * sums, axis=1)
    if MERGE_BATCH >= S_P2:
        merged = tl.sum(tl.exp2(maxes - top[:, None])[:, :, None] * values, axis=1)
    else:
        # the partials in batches of MERGE_BATCH splits, each batch's loads in flight together
        merged = tl.zeros([head.shape[0], col.shape[1]], tl.float32)
        i = active * 0  # a while loop: its bound is a device value (see `interpreted`)
        while i < active:
            b = i + tl.arange(0, MERGE_BATCH)[None, :]  # [1, B]
            batch = head[:, None] * SPLITS + b  # [G, B]
            in_batch = (b < active) & heads_mask[:, None]
            m_b = tl.load(max_ptr + batch, mask=in_batch, other=float("-inf"), cache_modifier=".cg")
            a_b = tl.load(
                acc_ptr + batch[:, :, None] * HD + col[:, None, :],
                mask=in_batch[:, :, None] & col_mask[:, None, :],
                other=0.0,
                cache_modifier=".cg",
            )  # [G, B, D]
            merged += tl.sum(tl.exp2(m_b - top[:, None])[:, :, None] * a_b, axis=1)
            i += MERGE_BATCH
    return merged / total[:, None]
