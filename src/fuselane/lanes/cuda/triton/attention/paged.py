"""Paged decode attention: each row of a batch is its own sequence, attending its own cache rows, which lie in
fixed-size blocks of one pool (`fuselane.engine.blocks`), found through its block table.

Two launches a layer, both reading only device values (a captured CUDA graph replays them for any positions
and tables):

- `store_kv`: row i's new key and value (the step's staging rows, where the plan's products and rotations
  wrote them) into the pool at slot[i] (= table[pos // block] * block + pos % block, computed on the host
  with the table), rounded to the pool's f16 or f32 there;
- `paged_decode`: row i's query heads over pool rows of its blocks 0 .. len[i] - 1. A program takes
  `attn_kernels.attn_heads_a_block` query heads of one key/value group (one: the one-row decode's measured fact),
  a warp a head, with the running softmax of FlashDecode (`decode.fold_tile`: the same tile fold, the same
  2^(s * scale * log2 e - max) weights). A loop step reads a tile of `attn_kernels.ATTN_PAGED_TILE_ROWS` cache
  rows, each through its block's id in the row's table, so a step folds several blocks. Where the batch's
  rows and head blocks leave the chip's SMs idle (`paged_plan`: `shim.chunks_apart`), each row's span is cut
  into up to `splits` chunks of whole tiles (`attn_kernels.attn_splits` of the batch's head blocks; none under
  `attn_kernels.ATTN_MIN_CHUNK` rows, so a short row takes fewer and the programs past its chunks exit at once):
  each program of a cut row writes its partial (running max, sum of weights, weighted values) to scratch and
  ticks its row's head-block counter, and the last to finish merges them (`splits.merge_partials`, the
  log-sum-exp combine) and re-arms the counter, as the one-row decode does. One launch of (rows, head blocks,
  splits) programs; the splits are fixed when the launch is bound (rows, heads, the tables' width and the
  chip's SMs), never from the lengths, which are device values a captured graph replays with. As a dependent
  launch a program reads its first tile (the rows before the row's last: the step's inputs, `pdl`'s contract)
  before its wait and the row's last, which `store_kv` just stored, after it. The output is f32, and where the
  plan wants it also int8 activations (`splits.store_out`).

Tables are int32 (rows, width), padded past a sequence's blocks with any valid block id (never read: a row
reads only the blocks its length reaches).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import QK
from fuselane.lanes.cuda.plan import attn_kernels, kernels
from fuselane.lanes.cuda.plan.knobs import H200
from fuselane.lanes.cuda.plan.shim import chunks_apart
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.attention.decode import DECODE_MERGE_BATCH, DECODE_STAGES, fold_tile
from fuselane.lanes.cuda.triton.attention.splits import (
    LOG2E,
    interpreted,
    merge_partials,
    park_partial,
    seam_counters,
    store_out,
)
from fuselane.lanes.cuda.triton.quant import Q8Acts

STORE_WARPS = 4
STORE_BLOCK = 512  # values of a row a store program copies


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_pitch, v_pitch, kc_pitch, vc_pitch, cols_k, cols_v,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl.begin(PDL)
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    mk = offs < cols_k
    k = tl.load(k_ptr + i.to(tl.int64) * k_pitch + offs, mask=mk, other=0.0)
    tl.store(kc_ptr + slot * kc_pitch + offs, k.to(kc_ptr.dtype.element_ty), mask=mk)
    mv = offs < cols_v
    v = tl.load(v_ptr + i.to(tl.int64) * v_pitch + offs, mask=mv, other=0.0)
    tl.store(vc_ptr + slot * vc_pitch + offs, v.to(vc_ptr.dtype.element_ty), mask=mv)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """Row i of `k` and `v` (rows, cols) into the pools (2-D, f16 or f32) at row slots[i] (int32), one launch."""
    rows = k.shape[0]
    if v.shape[0] != rows or slots.numel() < rows or slots.dtype != torch.int32:
        raise ValueError(f"store_kv: {rows} key rows, {v.shape[0]} value rows and {slots.numel()} int32 slots")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("store_kv: the rows' values must be unit-stride")
    cols = max(k.shape[1], v.shape[1])
    _store_kv_kernel[(rows, triton.cdiv(cols, STORE_BLOCK))](
        k, v, k_pool, v_pool, slots, k.stride(0), v.stride(0), k_pool.stride(0), v_pool.stride(0),
        k.shape[1], v.shape[1], BLOCK=STORE_BLOCK, num_warps=STORE_WARPS, **pdl.options(),
    )  # fmt: skip


class PagedPlan(NamedTuple):
    """A paged decode attention's launch: query heads a program (of one key/value group), programs a row (the
    head blocks), and the splits of each row's span (fixed for the launch; a row's length picks how many work)."""

    heads_per_block: int
    head_blocks: int
    splits: int


def paged_plan(rows: int, heads: int, kv_heads: int, span: int, *, sms: int, splits: int | None = None,
               hd: int = 0) -> PagedPlan:  # fmt: skip
    """The launch of a paged decode attention of `rows` rows over spans of at most `span` cache rows (the tables'
    width in rows) on a chip of `sms` SMs: `attn_kernels.attn_heads_a_block` heads of a group a program, as the one-row
    decode; its span cut in `attn_kernels.attn_splits` of the batch's head blocks where `shim.chunks_apart` says the
    rows' head blocks alone leave the chip idle (or `splits`, where given). Never from the rows' lengths: they
    are device values, and a captured graph replays one launch for any of them."""
    if heads % kv_heads:
        raise ValueError(f"paged_decode: {heads} query heads do not share {kv_heads} key/value heads evenly")
    per_block = attn_kernels.attn_heads_a_block(heads // kv_heads, hd)
    blocks = heads // per_block
    if splits is None:
        splits = attn_kernels.attn_splits(rows * blocks, span, sms)
        if not chunks_apart(splits, rows, blocks, sms):
            splits = 1
    return PagedPlan(per_block, blocks, max(1, splits))


def paged_scratch_size(plan: PagedPlan, rows: int, heads: int, hd: int, *, quantized: bool = False) -> int:
    """f32 values of a paged attention's scratch: each row's heads' partials a split (hd weighted values, a max,
    a sum), then a counter a row's head block, then, for an int8 output (`quantized`), each row's seam counters
    (`splits.seam_counters`; int32, starting at zero; the kernel leaves them at zero). Zero where one split
    writes its result directly and the int8 form needs no seams."""
    seams = rows * seam_counters(heads * hd, hd, plan.heads_per_block) if quantized else 0
    if plan.splits == 1 and not seams:
        return 0
    return rows * heads * plan.splits * (hd + 2) + rows * plan.head_blocks + seams


@triton.jit
def _pool_at(table, start, hi, kvh, k_pitch, v_pitch, HD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
             TILE: tl.constexpr, G: tl.constexpr):  # fmt: skip
    """Where logical rows `start` .. `start + TILE` of a row's span lie in the pool, each through its block's id
    in the row's `table` (rows at or past `hi` at block 0's, never read): the keys' and values' offsets
    [G, TILE, D] (each warp reads its own copy of the tile), the logical rows [1, TILE, 1], the columns [G, 1, D]."""
    j = start + tl.arange(0, TILE)
    block = tl.load(table + j // BS, mask=j < hi, other=0)  # a tile's rows share a few ids: the loads hit L1
    r = (block.to(tl.int64) * BS + j % BS)[None, :, None]
    col = tl.arange(0, D)[None, None, :] + 0 * tl.arange(0, G)[:, None, None]
    return r * k_pitch + kvh * HD + col, r * v_pitch + kvh * HD + col, j[None, :, None], col


@triton.jit
def _pool_tile(k_ptr, v_ptr, table, start, below, hi, kvh, k_pitch, v_pitch, HD: tl.constexpr, D: tl.constexpr,
               BS: tl.constexpr, TILE: tl.constexpr, G: tl.constexpr):  # fmt: skip
    """A tile's keys and values [G, TILE, D] from logical row `start` (rows at or past `below` and the padding
    past HD zero): a tile of several pool blocks, one loop step."""
    k_at, v_at, j, col = _pool_at(table, start, hi, kvh, k_pitch, v_pitch, HD, D, BS, TILE, G)
    mask = (j < below) & (col < HD)
    return tl.load(k_ptr + k_at, mask=mask, other=0.0), tl.load(v_ptr + v_at, mask=mask, other=0.0)


@triton.jit
def _with_pool_row(k, v, k_ptr, v_ptr, table, start, row, hi, kvh, k_pitch, v_pitch, HD: tl.constexpr,
                   BS: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """`_pool_tile`'s tile from `start` with logical row `row` read into it: the row the launch before stored."""
    k_at, v_at, j, col = _pool_at(table, start, hi, kvh, k_pitch, v_pitch, HD, k.shape[2], BS, TILE, k.shape[0])
    mask = (j == row) & (col < HD)
    return tl.load(k_ptr + k_at, mask=mask, other=k), tl.load(v_ptr + v_at, mask=mask, other=v)


@triton.jit
def _paged_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, out_ptr, oq_ptr, od_ptr, os_ptr, acc_ptr, max_ptr, sum_ptr, count_ptr,
    seam_ptr,
    q_pitch, k_pitch, v_pitch, table_pitch, scale_log2e,
    HEADS: tl.constexpr, GROUP: tl.constexpr, HB: tl.constexpr, G_P2: tl.constexpr, HD: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, S_P2: tl.constexpr,
    MERGE_BATCH: tl.constexpr, MIN_CHUNK: tl.constexpr, Q8OUT: tl.constexpr, INTERPRETED: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    row = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    kvh = hb * HB // GROUP
    # the row's length, table and cache rows before its last are the step's inputs, read before the wait
    # (`pdl`'s contract); its last row, which the launch before stored, after it
    hi = tl.load(len_ptr + row)
    table = table_ptr + row.to(tl.int64) * table_pitch
    # this split's share of the row's span: equal shares of whole tiles, none under MIN_CHUNK rows, so a short
    # row runs as fewer splits (one: no merge) and the splits past its share exit at once
    chunk = tl.cdiv(tl.maximum(tl.cdiv(hi, SPLITS), MIN_CHUNK), TILE) * TILE
    active = tl.cdiv(hi, chunk)
    if split < active:
        lo = split * chunk
        top = tl.minimum(lo + chunk, hi)
        if PDL:  # the first tile in flight while the launch before finishes, as `decode._decode_kernel` does
            k0, v0 = _pool_tile(k_ptr, v_ptr, table, lo, tl.minimum(top, hi - 1), hi, kvh, k_pitch, v_pitch, HD, D,
                                BS, TILE, G_P2)  # fmt: skip
            if hi > 0:  # always; a wait behind a branch is not hoisted above the loads (ptxas hoists a plain one)
                pdl.wait(PDL)
            if (lo <= hi - 1) & (hi - 1 < lo + TILE):
                k0, v0 = _with_pool_row(k0, v0, k_ptr, v_ptr, table, lo, hi - 1, hi, kvh, k_pitch, v_pitch, HD, BS,
                                        TILE)  # fmt: skip
        else:
            k0, v0 = _pool_tile(k_ptr, v_ptr, table, lo, top, hi, kvh, k_pitch, v_pitch, HD, D, BS, TILE, G_P2)
        g = tl.arange(0, G_P2)
        heads_mask = g < HB
        head = hb * HB + tl.minimum(g, HB - 1)  # padded heads reread the block's last: finite, never stored
        col = tl.arange(0, D)[None, :]
        col_mask = col < HD
        offs = head[:, None] * HD + col  # [G, D]
        q = tl.load(q_ptr + row.to(tl.int64) * q_pitch + offs, mask=col_mask, other=0.0).to(tl.float32)[:, None, :]
        run_max = tl.full([G_P2], float("-inf"), tl.float32)
        run_sum = tl.zeros([G_P2], tl.float32)
        acc = tl.zeros([G_P2, D], tl.float32)
        run_max, run_sum, acc = fold_tile(q, run_max, run_sum, acc, k0, v0, lo, top, scale_log2e, TILE)
        if INTERPRETED:  # a loop whose bound is a device value runs as a while loop (see `splits.interpreted`)
            start = lo + TILE
            while start < top:
                k, v = _pool_tile(k_ptr, v_ptr, table, start, top, hi, kvh, k_pitch, v_pitch, HD, D, BS, TILE, G_P2)
                run_max, run_sum, acc = fold_tile(q, run_max, run_sum, acc, k, v, start, top, scale_log2e, TILE)
                start += TILE
        else:
            for start in range(lo + TILE, top, TILE):
                k, v = _pool_tile(k_ptr, v_ptr, table, start, top, hi, kvh, k_pitch, v_pitch, HD, D, BS, TILE, G_P2)
                run_max, run_sum, acc = fold_tile(q, run_max, run_sum, acc, k, v, start, top, scale_log2e, TILE)
        width: tl.constexpr = HEADS * HD
        o_row = row.to(tl.int64) * width
        nb_row = row.to(tl.int64) * (width // 32)  # the row's first 32-value block (read only with Q8OUT)
        seams = seam_ptr + nb_row  # the row's seam counters, a 32-value block each (read only at seams)
        store_mask = heads_mask[:, None] & col_mask
        if active == 1:
            store_out(acc / run_sum[:, None], offs, store_mask, head, out_ptr + o_row, oq_ptr + o_row,
                      od_ptr + nb_row, os_ptr + 2 * nb_row, HD, Q8OUT, hb * HB, HB, seams, width)  # fmt: skip
        else:
            # the row's partials: head h's split s at (row * HEADS + h) * SPLITS + s; a counter a row's head block
            base = row.to(tl.int64) * HEADS * SPLITS
            count = count_ptr + row * (HEADS // HB) + hb
            done = park_partial(acc, run_max, run_sum, acc_ptr + base * HD, max_ptr + base, sum_ptr + base, count,
                                head * SPLITS + split, col, store_mask, heads_mask, HD)  # fmt: skip
            if done == active - 1:
                merged = merge_partials(acc_ptr + base * HD, max_ptr + base, sum_ptr + base, head, heads_mask, col,
                                        col_mask, active, SPLITS, S_P2, MERGE_BATCH, HD)  # fmt: skip
                store_out(merged, offs, store_mask, head, out_ptr + o_row, oq_ptr + o_row, od_ptr + nb_row,
                          os_ptr + 2 * nb_row, HD, Q8OUT, hb * HB, HB, seams, width)  # fmt: skip
                tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")  # re-armed for the next launch


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
    *,
    heads: int,
    kv_heads: int,
    hd: int,
    scale: float,
    block_size: int,
    out_q8: Q8Acts | None = None,
    scratch: torch.Tensor | None = None,
    sms: int = H200.sms,
    splits: int | None = None,
    tile_rows: int = attn_kernels.ATTN_PAGED_TILE_ROWS,
    min_chunk: int = attn_kernels.ATTN_MIN_CHUNK,
    merge_batch: int = DECODE_MERGE_BATCH,
) -> None:
    """out[i] = attention of row i's `heads` query heads (q: rows x heads * hd, f32) over its first lens[i]
    cache rows, row r of them at pool row tables[i, r // block_size] * block_size + r % block_size (pools:
    2-D, kv_heads * hd values a row, f16 or f32). Query head h reads key/value head h // (heads // kv_heads).
    `out` (rows, heads * hd) f32; with `out_q8` its int8 form too (a row whole 32-value blocks). One launch.

    Its launch is `paged_plan`'s for a chip of `sms` SMs (`splits` overrides its splits); where that splits a
    row's span or the int8 form has seams, `scratch` is an f32 tensor of at least `paged_scratch_size` values
    (`quantized=out_q8 is not None`), zero when first given and kept for the launch's life (the kernel leaves
    its counters at zero). `tile_rows`, `min_chunk` and `merge_batch` are the kernel's facts, parameters only
    so tests reach several splits of short spans."""
    if heads % kv_heads or block_size & (block_size - 1) or tile_rows & (tile_rows - 1):
        raise ValueError(f"paged_decode: {heads} heads over {kv_heads} groups, blocks of {block_size} and tiles of "
                         f"{tile_rows} rows (powers of 2)")  # fmt: skip
    rows = q.shape[0] if q.dim() == 2 else 1
    if tables.dtype != torch.int32 or lens.dtype != torch.int32 or tables.shape[0] < rows or lens.numel() < rows:
        raise ValueError("paged_decode: int32 tables (rows, width) and lengths (rows)")
    plan = paged_plan(rows, heads, kv_heads, tables.shape[1] * block_size, sms=sms, splits=splits, hd=hd)
    if out_q8 is not None and heads * hd % QK:
        raise ValueError(f"paged_decode writes the int8 form of rows of whole {QK}-value blocks, not {heads} x {hd}")
    acc, top, total, count, seams = _partials(plan, rows, heads, hd, scratch, out, out_q8 is not None)
    group_p2 = triton.next_power_of_2(plan.heads_per_block)
    oq, od, os_ = out_q8 if out_q8 is not None else (out, out, out)
    _paged_kernel[(rows, plan.head_blocks, plan.splits)](
        q, k_pool, v_pool, tables, lens, out, oq, od, os_, acc, top, total, count, seams,
        q.stride(0) if q.dim() == 2 else 0, k_pool.stride(0), v_pool.stride(0), tables.stride(0), scale * LOG2E,
        HEADS=heads, GROUP=heads // kv_heads, HB=plan.heads_per_block, G_P2=group_p2, HD=hd,
        D=triton.next_power_of_2(hd), BS=block_size, TILE=tile_rows, SPLITS=plan.splits,
        S_P2=triton.next_power_of_2(plan.splits), MERGE_BATCH=min(merge_batch, triton.next_power_of_2(plan.splits)),
        MIN_CHUNK=min_chunk, Q8OUT=out_q8 is not None, INTERPRETED=interpreted(),
        num_warps=min(group_p2, kernels.MAX_BLOCK_WARPS), num_stages=DECODE_STAGES, **pdl.options(),
    )  # fmt: skip


def _partials(plan: PagedPlan, rows: int, heads: int, hd: int, scratch: torch.Tensor | None, out: torch.Tensor,
              quantized: bool):  # fmt: skip
    """The scratch's parts (weighted values, maxes, sums, int32 counters, int32 seam counters); `out` for each
    the launch never reads (one split writes its result directly; a block's heads whole blocks need no seams)."""
    need = paged_scratch_size(plan, rows, heads, hd, quantized=quantized)
    if not need:
        return out, out, out, out, out
    if scratch is None or scratch.dtype != torch.float32 or scratch.numel() < need:
        raise ValueError(f"paged_decode over {plan.splits} splits needs an f32 scratch of {need} values")
    parts = rows * heads * plan.splits
    counters = parts * (hd + 2) + rows * plan.head_blocks
    seams = scratch[counters:need].view(torch.int32) if need > counters else out
    return (
        scratch[: parts * hd],
        scratch[parts * hd : parts * (hd + 1)],
        scratch[parts * (hd + 1) : parts * (hd + 2)],
        scratch[parts * (hd + 2) : counters].view(torch.int32),
        seams,
    )
