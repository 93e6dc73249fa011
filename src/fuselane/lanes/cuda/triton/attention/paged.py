"""Paged decode attention: each row of a batch is its own sequence, attending its own cache rows, which lie in
fixed-size blocks of one pool (`fuselane.engine.blocks`), found through its block table.

Two launches a layer, both reading only device values (a captured CUDA graph replays them for any positions
and tables):

- `store_kv`: row i's new key and value (the step's staging rows, where the plan's products and rotations
  wrote them) into the pool at slot[i] (= table[pos // block] * block + pos % block, computed on the host
  with the table), rounded to the pool's f16 or f32 there;
- `paged_decode`: row i's query heads over pool rows of its blocks 0 .. len[i] - 1, a block of cache rows a
  tile. A program takes one key/value group of one row, its query heads one warp each, with the running
  softmax of FlashDecode (`decode.fold_tile`: the same tile fold, the same 2^(s * scale * log2 e - max)
  weights); the output is f32, and where the plan wants it also int8 activations (`decode.store_out`).

Tables are int32 (rows, width), padded past a sequence's blocks with any valid block id (never read: a row
reads only the blocks its length reaches). There is no split of a long span over several programs: a row's
group walks its whole span, so a long context at a small batch leaves SMs idle (the decode step of one
sequence, `decode.flash_decode`, splits; the batch's rows and groups fill the chip as the batch grows).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.attention.decode import fold_tile, interpreted, store_out
from fuselane.lanes.cuda.triton.quant import Q8Acts

LOG2E = math.log2(math.e)
STORE_WARPS = 4
STORE_BLOCK = 512  # values of a row a store program copies
MAX_WARPS = 8  # a program's warps: one a query head of its group, at most these


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


@triton.jit
def _block_tile(k_ptr, v_ptr, block, start, hi, kvh, k_pitch, v_pitch, HD: tl.constexpr, D: tl.constexpr,
                BS: tl.constexpr, G: tl.constexpr):  # fmt: skip
    """The keys and values [G, BS, D] of one pool block (logical rows from `start`, those at or past `hi` and
    the padding past HD zero)."""
    j = tl.arange(0, BS)[None, :, None]
    r = block.to(tl.int64) * BS + j
    col = tl.arange(0, D)[None, None, :] + 0 * tl.arange(0, G)[:, None, None]
    mask = (start + j < hi) & (col < HD)
    k = tl.load(k_ptr + r * k_pitch + kvh * HD + col, mask=mask, other=0.0)
    v = tl.load(v_ptr + r * v_pitch + kvh * HD + col, mask=mask, other=0.0)
    return k, v


@triton.jit
def _paged_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, out_ptr, oq_ptr, od_ptr, os_ptr,
    q_pitch, k_pitch, v_pitch, table_pitch, scale_log2e,
    HEADS: tl.constexpr, GROUP: tl.constexpr, G_P2: tl.constexpr, HD: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, Q8OUT: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    hi = tl.load(len_ptr + row)
    g = tl.arange(0, G_P2)
    heads_mask = g < GROUP
    head = kvh * GROUP + tl.minimum(g, GROUP - 1)  # padded heads reread the group's last: finite, never stored
    col = tl.arange(0, D)[None, :]
    col_mask = col < HD
    offs = head[:, None] * HD + col  # [G, D]
    q = tl.load(q_ptr + row.to(tl.int64) * q_pitch + offs, mask=col_mask, other=0.0).to(tl.float32)[:, None, :]
    run_max = tl.full([G_P2], float("-inf"), tl.float32)
    run_sum = tl.zeros([G_P2], tl.float32)
    acc = tl.zeros([G_P2, D], tl.float32)
    table = table_ptr + row.to(tl.int64) * table_pitch
    if INTERPRETED:  # a loop whose bound is a device value runs as a while loop (see `decode.interpreted`)
        start = hi * 0
        while start < hi:
            k, v = _block_tile(k_ptr, v_ptr, tl.load(table + start // BS), start, hi, kvh, k_pitch, v_pitch,
                               HD, D, BS, G_P2)  # fmt: skip
            run_max, run_sum, acc = fold_tile(q, run_max, run_sum, acc, k, v, start, hi, scale_log2e, BS)
            start += BS
    else:
        for start in range(0, hi, BS):
            k, v = _block_tile(k_ptr, v_ptr, tl.load(table + start // BS), start, hi, kvh, k_pitch, v_pitch,
                               HD, D, BS, G_P2)  # fmt: skip
            run_max, run_sum, acc = fold_tile(q, run_max, run_sum, acc, k, v, start, hi, scale_log2e, BS)
    width = HEADS * HD
    o_row = row.to(tl.int64) * width
    nb_row = row.to(tl.int64) * (width // 32)  # the row's first 32-value block (read only with Q8OUT)
    store_out(acc / run_sum[:, None], offs, heads_mask[:, None] & col_mask, head, out_ptr + o_row,
               oq_ptr + o_row, od_ptr + nb_row, os_ptr + 2 * nb_row, HD, Q8OUT)  # fmt: skip


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
) -> None:
    """out[i] = attention of row i's `heads` query heads (q: rows x heads * hd, f32) over its first lens[i]
    cache rows, row r of them at pool row tables[i, r // block_size] * block_size + r % block_size (pools:
    2-D, kv_heads * hd values a row, f16 or f32). Query head h reads key/value head h // (heads // kv_heads).
    `out` (rows, heads * hd) f32; with `out_q8` its int8 form too (hd a multiple of 32). One launch."""
    if heads % kv_heads or block_size & (block_size - 1):
        raise ValueError(f"paged_decode: {heads} heads over {kv_heads} groups, blocks of {block_size} (a power of 2)")
    rows = q.shape[0] if q.dim() == 2 else 1
    if tables.dtype != torch.int32 or lens.dtype != torch.int32 or tables.shape[0] < rows or lens.numel() < rows:
        raise ValueError("paged_decode: int32 tables (rows, width) and lengths (rows)")
    if out_q8 is not None and hd % 32:
        raise ValueError(f"paged_decode writes int8 heads of whole 32-value blocks, not {hd}")
    group = heads // kv_heads
    q_pitch = q.stride(0) if q.dim() == 2 else 0
    oq, od, os_ = out_q8 if out_q8 is not None else (out, out, out)
    _paged_kernel[(rows, kv_heads)](
        q, k_pool, v_pool, tables, lens, out, oq, od, os_,
        q_pitch, k_pool.stride(0), v_pool.stride(0), tables.stride(0), scale * LOG2E,
        HEADS=heads, GROUP=group, G_P2=triton.next_power_of_2(group), HD=hd, D=triton.next_power_of_2(hd),
        BS=block_size, Q8OUT=out_q8 is not None, INTERPRETED=interpreted(),
        num_warps=min(MAX_WARPS, triton.next_power_of_2(group)), **pdl.options(),
    )  # fmt: skip
