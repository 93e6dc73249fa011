"""Causal grouped-query attention of one query row on the device (FlashDecode), and its launcher.

It reads the KV cache (f16 or f32, one row of kv_heads * hd values a position, any row pitch) up to the
rows the position in the 1-element int32 device tensor `pos` reaches, so a captured CUDA graph replays at a
new position with no re-capture: every loop bound, every split's share of the span, is computed in the
kernel from `pos`.

FlashDecode. The span (cache rows 0..pos) is cut into up to `splits` chunks of at least `min_chunk` rows; a
block takes one chunk for `attn_kernels.attn_heads_a_block` query heads of one key/value group (one: see the
fact), one warp a head, on the CUDA cores in f32 (under the dequantized numerics; under the int8 ones
`flash_decode` launches `group_decode.py`'s kernel, a key/value group's heads packed into tensor-core rows). Its tensors
are laid out [heads, rows, hd] with a head's values last and contiguous: Triton gives each thread runs of
neighbouring values (vector loads) and the lanes the rest, so a row's dot is summed mostly in the thread and
then over a few lanes by shuffles, with no shared-memory round trip in the loop. (Laid out [heads, rows,
hd / 32, 32], each value of a row its own 2-byte load and each dot five shuffles, the kernel took 212
registers and 725 shuffles in its sm_90 SASS against 168 and 243: 8B span 576 6.8 -> 6.4 us, the 7B's
6.6 -> 6.4.) As a dependent launch a block reads its first tile (rows before the position, the step's inputs:
`pdl`'s contract) before its wait, so that round trip overlaps the end of the launch before, and reads the
position's row, which that launch appends, into the tile after it. A block whose chunk is the whole span
writes the output; otherwise each writes its partial (running max, sum of weights, unnormalized weighted
values) to scratch and the last block of the group to finish (an atomic counter a group, re-armed by that
block for the next launch) merges the partials with the log-sum-exp combine. One launch; the number of
splits is fixed when the plan is built (`decode_plan`: `attn_kernels.attn_splits` at the cache's length, where
`shim.chunks_apart` says the head blocks alone leave the chip idle), and blocks past the chunks a short span
needs exit at once.

The launch's shape, the partials' park and merge and the store are `splits.py`'s, shared with the packed and
the paged kernels. FlashPrefill (a chunk's rows, on the tensor cores) is `attention/prefill.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import QK
from fuselane.lanes.cuda.plan import attn_kernels, kernels
from fuselane.lanes.cuda.plan.knobs import H200, Chip
from fuselane.lanes.cuda.plan.shim import chunks_apart
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.attention import group_decode
from fuselane.lanes.cuda.triton.attention.splits import (
    LOG2E,
    DecodePlan,
    cache_pitch,
    gate_heads,
    interpreted,
    merge_partials,
    park_partial,
    seam_counters,
    store_out,
)

# Tiles of the cache a decode loop keeps in flight.
DECODE_STAGES = 3
# Splits' partials the merging block loads at a time (a [heads, 16, hd] tile: 16 values a thread at hd 128).
DECODE_MERGE_BATCH = 16


def decode_plan(
    heads: int,
    kv_heads: int,
    hd: int,
    cache_len: int,
    *,
    chip: Chip = H200,
    splits: int | None = None,
    heads_per_block: int | None = None,
) -> DecodePlan:
    """The launch of a decode attention over a cache of `cache_len` rows on `chip`: `attn_kernels.attn_heads_a_block`
    query heads of one key/value group a block (or `heads_per_block`), splits from `attn_kernels.attn_splits` where
    `shim.chunks_apart` says so (or `splits` where given)."""
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} key/value heads evenly")
    group = heads // kv_heads
    per_block = attn_kernels.attn_heads_a_block(group, hd) if heads_per_block is None else heads_per_block
    if per_block < 1 or group % per_block:
        raise ValueError(f"a block takes a divisor of the group's {group} heads, not {per_block}")
    blocks = heads // per_block
    if splits is None:
        splits = attn_kernels.attn_splits(blocks, cache_len, chip.sms)
        if not chunks_apart(splits, 1, blocks, chip.sms):
            splits = 1
    return DecodePlan(per_block, blocks, max(1, splits))


def decode_scratch_size(plan: DecodePlan, heads: int, hd: int) -> int:
    """f32 values of a decode attention's scratch: each head's partial a split (hd weighted values, a max,
    a sum), then a counter a group, then the output's seam counters (`splits.seam_counters`)."""
    return heads * plan.splits * (hd + 2) + plan.head_blocks + seam_counters(heads * hd, hd, plan.heads_per_block)


def decode_scratch(
    heads: int, hd: int, cache_len: int, device: torch.device | str, *, chip: Chip = H200, splits: int | None = None
) -> torch.Tensor:
    """A decode attention's scratch, allocated once with the plan and kept (its counters start at zero; the
    kernel leaves them at zero). Sized for any grouping of `heads`: the most splits `attn_kernels.attn_splits`
    gives (at one group), a counter a head and a seam counter a 32-value block of the output; pass `splits`
    where the launch names its own."""
    most = splits or attn_kernels.attn_splits(1, cache_len, chip.sms)
    return torch.zeros(heads * most * (hd + 2) + heads + heads * hd // QK, dtype=torch.float32, device=device)


@triton.jit
def _tile_at(start, kvh, k_pitch, v_pitch, HD: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, G: tl.constexpr):
    """Where a tile of cache rows from `start` lies: its keys' and values' offsets [G, TILE, D] (each warp
    reads its own copy of the tile), its rows [1, TILE, 1] and its columns [G, 1, D]."""
    r = (start + tl.arange(0, TILE))[None, :, None]
    col = tl.arange(0, D)[None, None, :] + 0 * tl.arange(0, G)[:, None, None]
    return r.to(tl.int64) * k_pitch + kvh * HD + col, r.to(tl.int64) * v_pitch + kvh * HD + col, r, col


@triton.jit
def _tile_kv(k_ptr, v_ptr, start, below, kvh, k_pitch, v_pitch, HD: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
             G: tl.constexpr):  # fmt: skip
    """A tile's keys and values [G, TILE, D] as the cache holds them: rows from `start`, those at or past
    `below` (and the padding past HD) zero. The values' axis is last and contiguous, so a thread's loads are
    vectors of neighbouring values."""
    k_at, v_at, r, col = _tile_at(start, kvh, k_pitch, v_pitch, HD, D, TILE, G)
    mask = (r < below) & (col < HD)
    return tl.load(k_ptr + k_at, mask=mask, other=0.0), tl.load(v_ptr + v_at, mask=mask, other=0.0)


@triton.jit
def _with_row(k, v, k_ptr, v_ptr, start, row, kvh, k_pitch, v_pitch, HD: tl.constexpr, TILE: tl.constexpr):
    """`_tile_kv`'s tile of rows from `start` with cache row `row` read into it: the position's row, which
    the launch before appended, read after the wait."""
    k_at, v_at, r, col = _tile_at(start, kvh, k_pitch, v_pitch, HD, k.shape[2], TILE, k.shape[0])
    mask = (r == row) & (col < HD)
    return tl.load(k_ptr + k_at, mask=mask, other=k), tl.load(v_ptr + v_at, mask=mask, other=v)


@triton.jit
def fold_tile(q, run_max, run_sum, acc, k, v, start, hi, scale_log2e, TILE: tl.constexpr):
    """One tile's keys and values (rows from `start`, those below `hi` live) into the running softmax of
    the group's heads.

    Shapes: q [G, 1, D] and acc [G, D] (the head's values, padded to a power of two D); keys and values
    [G, TILE, D]; scores [G, TILE]. A row's dot is mostly summed in the thread before the lanes' shuffles.
    """
    row = start + tl.arange(0, TILE)
    s = tl.sum(k.to(tl.float32) * q, axis=2) * scale_log2e  # [G, TILE]
    s = tl.where((row < hi)[None, :], s, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(s, axis=1))
    alpha = tl.exp2(run_max - new_max)  # 0 on the first tile, where run_max is -inf
    p = tl.exp2(s - new_max[:, None])
    run_sum = run_sum * alpha + tl.sum(p, axis=1)
    pv = tl.sum(p[:, :, None] * v.to(tl.float32), axis=1)  # [G, D]
    return new_max, run_sum, acc * alpha[:, None] + pv


@triton.jit
def _decode_tile(
    q, run_max, run_sum, acc, k_ptr, v_ptr, start, hi, kvh, k_pitch, v_pitch, scale_log2e,
    HD: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    """One tile of cached rows from `start` (rows below `hi`), read and folded (`fold_tile`)."""
    k, v = _tile_kv(k_ptr, v_ptr, start, hi, kvh, k_pitch, v_pitch, HD, D, TILE, G)
    return fold_tile(q, run_max, run_sum, acc, k, v, start, hi, scale_log2e, TILE)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    out_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    count_ptr,
    seam_ptr,
    oq_ptr,
    od_ptr,
    os_ptr,
    gate_ptr,
    k_pitch,
    v_pitch,
    scale_log2e,
    Q8OUT: tl.constexpr,
    WIDTH: tl.constexpr,
    GROUP: tl.constexpr,
    HB: tl.constexpr,
    G_P2: tl.constexpr,
    HD: tl.constexpr,
    D: tl.constexpr,
    TILE: tl.constexpr,
    SPLITS: tl.constexpr,
    S_P2: tl.constexpr,
    MERGE_BATCH: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    GATED: tl.constexpr,
    GATE_HP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.release(PDL)
    hb = tl.program_id(0)
    kvh = hb * HB // GROUP
    split = tl.program_id(1)
    # this split's share of the span 0..pos: equal shares of whole tiles, none under MIN_CHUNK rows. The
    # position and the cache's rows before it are the step's inputs, read before the wait (`pdl`'s contract).
    span = tl.load(pos_ptr) + 1
    chunk = tl.cdiv(tl.maximum(tl.cdiv(span, SPLITS), MIN_CHUNK), TILE) * TILE
    active = tl.cdiv(span, chunk)
    if split < active:
        lo = split * chunk
        hi = tl.minimum(lo + chunk, span)
        if PDL:
            # the first tile's rows before the position, read while the launch before still runs; the row at
            # the position (the launch before's) after the wait, into the same tile: the same sums either way
            before = tl.minimum(hi, span - 1)
            k0, v0 = _tile_kv(k_ptr, v_ptr, lo, before, kvh, k_pitch, v_pitch, HD, D, TILE, G_P2)
            if span > 0:  # always; a wait behind a branch is not hoisted above the loads (ptxas hoists a plain one)
                pdl.wait(PDL)
            if (lo <= span - 1) & (span - 1 < lo + TILE):
                k0, v0 = _with_row(k0, v0, k_ptr, v_ptr, lo, span - 1, kvh, k_pitch, v_pitch, HD, TILE)
        else:
            k0, v0 = _tile_kv(k_ptr, v_ptr, lo, hi, kvh, k_pitch, v_pitch, HD, D, TILE, G_P2)
        g = tl.arange(0, G_P2)
        heads_mask = g < HB
        # padded heads (a group of 7 in 8 warps) reread the block's last head: finite, never stored
        head = hb * HB + tl.minimum(g, HB - 1)
        col = tl.arange(0, D)[None, :]  # [1, D]
        col_mask = col < HD
        offs = head[:, None] * HD + col  # [G, D]
        q = tl.load(q_ptr + offs, mask=col_mask, other=0.0).to(tl.float32)[:, None, :]
        run_max = tl.full([G_P2], float("-inf"), tl.float32)
        run_sum = tl.zeros([G_P2], tl.float32)
        acc = tl.zeros([G_P2, D], tl.float32)
        run_max, run_sum, acc = fold_tile(q, run_max, run_sum, acc, k0, v0, lo, hi, scale_log2e, TILE)
        if INTERPRETED:  # the same tiles in the same order (see INTERPRETED)
            start = lo + TILE
            while start < hi:
                run_max, run_sum, acc = _decode_tile(
                    q, run_max, run_sum, acc, k_ptr, v_ptr, start, hi, kvh, k_pitch, v_pitch, scale_log2e,
                    HD, D, TILE, G_P2,
                )  # fmt: skip
                start += TILE
        else:
            for start in range(lo + TILE, hi, TILE):
                run_max, run_sum, acc = _decode_tile(
                    q, run_max, run_sum, acc, k_ptr, v_ptr, start, hi, kvh, k_pitch, v_pitch, scale_log2e,
                    HD, D, TILE, G_P2,
                )  # fmt: skip
        store_mask = heads_mask[:, None] & col_mask
        if active == 1:
            o = gate_heads(acc / run_sum[:, None], gate_ptr, head, col, store_mask, GATE_HP, GATED)
            store_out(o, offs, store_mask, head, out_ptr, oq_ptr, od_ptr, os_ptr, HD, Q8OUT, hb * HB, HB, seam_ptr,
                      WIDTH)  # fmt: skip
        else:
            part = head * SPLITS + split
            done = park_partial(acc, run_max, run_sum, acc_ptr, max_ptr, sum_ptr, count_ptr + hb, part, col,
                                store_mask, heads_mask, HD)  # fmt: skip
            if done == active - 1:
                merged = merge_partials(acc_ptr, max_ptr, sum_ptr, head, heads_mask, col, col_mask, active, SPLITS,
                                        S_P2, MERGE_BATCH, HD)  # fmt: skip
                merged = gate_heads(merged, gate_ptr, head, col, store_mask, GATE_HP, GATED)
                store_out(merged, offs, store_mask, head, out_ptr, oq_ptr, od_ptr, os_ptr, HD, Q8OUT, hb * HB, HB,
                          seam_ptr, WIDTH)  # fmt: skip
                tl.atomic_xchg(count_ptr + hb, 0, sem="relaxed", scope="gpu")  # re-armed for the next launch


def flash_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    out: torch.Tensor,
    *,
    heads: int,
    kv_heads: int,
    hd: int,
    scale: float,
    scratch: torch.Tensor | None,
    splits: int | None = None,
    chip: Chip = H200,
    tile_rows: int | None = None,
    min_chunk: int = attn_kernels.ATTN_MIN_CHUNK,
    merge_batch: int | None = None,
    heads_per_block: int | None = None,
    out_q8: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    gate: torch.Tensor | None = None,
    f16_ops: bool = False,
    **packed_facts: int,
) -> None:
    """FlashDecode: out (1, heads * hd) f32 = causal GQA of the one query row `q` (1, heads * hd) at position
    pos[0] over cache rows 0..pos[0]; query head h reads key/value head h // (heads // kv_heads).

    One launch of (groups, splits) blocks (`decode_plan`; `splits` overrides the plan's). `scratch` is
    `decode_scratch(heads, hd, cache_len, ...)`, kept for the plan's life; None only where the plan has one
    split and the output's int8 form (if any) needs no seam counters (`splits.seam_counters`). `tile_rows`,
    `min_chunk` and `merge_batch` are the kernel's facts, parameters only so tests reach several splits (and
    several batches of them in the merge) of a short cache. `out_q8`, a `quant.Q8Acts` of the output's width,
    also gets the output as int8 activations (the row whole 32-value blocks; a block shared by two blocks'
    heads, a seam, quantized by the later: `splits.store_out`).
    `gate` (heads, >= hd: each head's gate, rows any pitch; AttnOutputGate) multiplies the output by its
    sigmoid in the store. `f16_ops` (the int8 numerics' attention, `CudaShim.attention`): a group's heads
    multiply as the rows of f16 tensor-core products (`group_decode.py`), where the head's width allows it;
    `heads_per_block` and `min_chunk` are the other kernel's, `packed_facts` (warps, stages) this one's.
    """
    packed = f16_ops and group_decode.rows_packed(hd)
    if packed:
        plan = group_decode.group_plan(heads, kv_heads, k_cache.shape[0], chip.sms, splits)
        tile_rows = tile_rows or attn_kernels.ATTN_GROUP_TILE_ROWS
    else:
        tile_rows = tile_rows or attn_kernels.ATTN_DECODE_TILE_ROWS
        plan = decode_plan(
            heads, kv_heads, hd, k_cache.shape[0], chip=chip, splits=splits, heads_per_block=heads_per_block
        )
    # either kernel quantizes the blocks a block's heads hold whole, and shares the others (seams) between blocks
    if out_q8 is not None and heads * hd % QK:
        raise ValueError(f"a quantized attention output takes heads of whole {QK}-value blocks, or a row of them")
    seams = seam_counters(heads * hd, hd, plan.heads_per_block) if out_q8 is not None else 0
    acc = top = total = count = seam = out  # never read: one split writes its result directly, whole blocks alone
    if plan.splits > 1 or seams:
        need = decode_scratch_size(plan, heads, hd)
        if scratch is None or scratch.dtype != torch.float32 or scratch.numel() < need:
            raise ValueError(f"flash_decode over {plan.splits} splits ({seams} seams) needs an f32 scratch of {need} "
                             "values")  # fmt: skip
        parts = heads * plan.splits
        acc = scratch[: parts * hd]
        top = scratch[parts * hd : parts * (hd + 1)]
        total = scratch[parts * (hd + 1) : parts * (hd + 2)]
        count = scratch[parts * (hd + 2) : parts * (hd + 2) + plan.head_blocks].view(torch.int32)
        seam = scratch[need - seams : need].view(torch.int32) if seams else out
    if packed:
        group_decode.group_decode(
            q, k_cache, v_cache, pos, out, plan=plan, hd=hd, scale=scale, parts=(acc, top, total, count, seam),
            tile_rows=tile_rows, merge_batch=merge_batch, out_q8=out_q8, gate=gate, sms=chip.sms,
            **packed_facts,
        )  # fmt: skip
        return
    group_p2 = triton.next_power_of_2(plan.heads_per_block)
    _decode_kernel[(plan.head_blocks, plan.splits)](
        q,
        k_cache,
        v_cache,
        pos,
        out,
        acc,
        top,
        total,
        count,
        seam,
        *(out_q8 if out_q8 is not None else (out, out, out)),
        gate if gate is not None else out,
        cache_pitch(k_cache, kv_heads, hd, "k_cache"),
        cache_pitch(v_cache, kv_heads, hd, "v_cache"),
        scale * LOG2E,
        Q8OUT=out_q8 is not None,
        WIDTH=heads * hd,
        GROUP=heads // kv_heads,
        HB=plan.heads_per_block,
        G_P2=group_p2,
        HD=hd,
        D=triton.next_power_of_2(hd),
        TILE=tile_rows,
        SPLITS=plan.splits,
        S_P2=triton.next_power_of_2(plan.splits),
        MERGE_BATCH=min(merge_batch or DECODE_MERGE_BATCH, triton.next_power_of_2(plan.splits)),
        MIN_CHUNK=min_chunk,
        INTERPRETED=interpreted(),
        GATED=gate is not None,
        GATE_HP=gate.stride(0) if gate is not None else 0,
        num_warps=min(group_p2, kernels.MAX_BLOCK_WARPS),
        num_stages=DECODE_STAGES,
        **pdl.options(),
    )
