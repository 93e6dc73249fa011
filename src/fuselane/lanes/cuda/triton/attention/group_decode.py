"""FlashDecode with a key/value group's query heads as the rows of tensor-core products (AttnGqaRowPacking).

Why: `decode.py`'s kernel takes one query head a block on the CUDA cores, so a group of G heads reads its
key/value head's rows G times over. At a long span those reads come from L2 and bound the launch: a 7B's layer
at 4,096 cached rows reads 8.4 MB of cache, 59 MB through L2 (11.5 us a launch against ~2.5 us for the 8.4 MB
from memory; `benchmarks/RESULTS.md`). Here a block takes a whole group over its share of the span: the
group's queries are the rows (padded to tl.dot's 16) of one product with a tile of keys, and the weights the
rows of one with the tile's values, so each cached row is read once a step.

The products are f16 on the tensor cores, the int8 numerics' attention (`CudaShim.attention`: queries,
keys, values and weights rounded to f16, as a prefill chunk's; the f32 sums and softmax as `decode.py`'s).
The query is scaled by scale * log2 e before its rounding, so the scores come out in base-2 units and a large
query keeps f16's range. Everything else is `decode.py`'s: the span cut into splits computed in the kernel
from the position (a graph replays at any position), the first tile read before the dependent launch's wait,
the splits' partials merged by the group's last block (one counter a group) with the log-sum-exp combine, the
output's gate and int8 form in the store.

Measured (H200, caches read cold, 4,096 rows): the 7B's heads 16.2 -> 9.2 us a launch, the 8B's 17.2 -> 10.4;
tg128 at depth 4,096 401.7 -> 429.7 and 361.6 -> 390.6 tok/s (`benchmarks/RESULTS.md`). The 8B's 16.8 MB at
10.4 us is 1.6 TB/s: the chain of round trips (the first tile, the partial and the counter, the merge's loads)
bounds it now. Compiled for sm_90 with the launch's 16-byte-aligned pointers, the plan's launches take 165-225
registers and no stack at the reference heads, the later tiles copied in with cp.async.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.plan import attn_kernels
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.attention.prefill import DOT_MIN, softmax_fold
from fuselane.lanes.cuda.triton.attention.splits import (
    LOG2E,
    DecodePlan,
    cache_pitch,
    gate_heads,
    interpreted,
    merge_partials,
    merge_round,
    park_partial,
    store_out,
)


def rows_packed(hd: int) -> bool:
    """Whether a head of `hd` values takes the packed kernel: tl.dot's sides are powers of two of at least 16."""
    return hd >= DOT_MIN and hd & (hd - 1) == 0


def group_plan(heads: int, kv_heads: int, cache_len: int, sms: int, splits: int | None = None) -> DecodePlan:
    """The packed launch over a cache of `cache_len` rows: a block a key/value group and split, splits from
    `attn_kernels.attn_group_splits` (or `splits` where given)."""
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} key/value heads evenly")
    if splits is None:
        splits = attn_kernels.attn_group_splits(kv_heads, cache_len, sms)
    return DecodePlan(heads // kv_heads, kv_heads, max(1, splits))


@triton.jit
def _rows_kv(k_ptr, v_ptr, start, below, kvh, k_pitch, v_pitch, HD: tl.constexpr, TILE: tl.constexpr):
    """A tile of the group's keys and values [TILE, HD] from cache row `start`, rows at or past `below` zero."""
    r = start + tl.arange(0, TILE)
    col = tl.arange(0, HD)[None, :]
    live = (r < below)[:, None]
    k = tl.load(k_ptr + r[:, None].to(tl.int64) * k_pitch + kvh * HD + col, mask=live, other=0.0)
    v = tl.load(v_ptr + r[:, None].to(tl.int64) * v_pitch + kvh * HD + col, mask=live, other=0.0)
    return k, v


@triton.jit
def _with_row(k, v, k_ptr, v_ptr, start, row, kvh, k_pitch, v_pitch, HD: tl.constexpr, TILE: tl.constexpr):
    """`_rows_kv`'s tile from `start` with cache row `row` (the launch before's append) read into it."""
    r = start + tl.arange(0, TILE)
    col = tl.arange(0, HD)[None, :]
    at = (r == row)[:, None]
    k = tl.load(k_ptr + r[:, None].to(tl.int64) * k_pitch + kvh * HD + col, mask=at, other=k)
    v = tl.load(v_ptr + r[:, None].to(tl.int64) * v_pitch + kvh * HD + col, mask=at, other=v)
    return k, v


@triton.jit
def _fold(q, run_max, run_sum, acc, k, v, start, last, TILE: tl.constexpr):
    """A tile's keys and values (rows from `start`, those past `last` masked) into the group's running
    softmax: q [R, HD] f16 in base-2 units, acc [R, HD] f32."""
    s = tl.dot(q, tl.trans(k.to(tl.float16)))  # [R, TILE]
    n = start + tl.arange(0, TILE)
    last_row = tl.zeros([q.shape[0]], tl.int32) + last
    new_max, alpha, p, run_sum = softmax_fold(s, n, last_row, run_max, run_sum, True)
    return new_max, run_sum, acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))


@triton.jit
def _group_decode_kernel(
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
    G_P2: tl.constexpr,
    R: tl.constexpr,
    HD: tl.constexpr,
    TILE: tl.constexpr,
    SPLITS: tl.constexpr,
    S_P2: tl.constexpr,
    MERGE_BATCH: tl.constexpr,
    INTERPRETED: tl.constexpr,
    GATED: tl.constexpr,
    GATE_HP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.release(PDL)
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    # equal shares of whole tiles, none under a tile; the position and the rows before it are the step's
    # inputs, read before the wait (`pdl`'s contract)
    span = tl.load(pos_ptr) + 1
    chunk = tl.cdiv(tl.cdiv(span, SPLITS), TILE) * TILE
    active = tl.cdiv(span, chunk)
    if split < active:
        lo = split * chunk
        hi = tl.minimum(lo + chunk, span)
        if PDL:
            k0, v0 = _rows_kv(k_ptr, v_ptr, lo, tl.minimum(hi, span - 1), kvh, k_pitch, v_pitch, HD, TILE)
            if span > 0:  # always; behind a branch so ptxas keeps the wait after the loads (`decode.py`)
                pdl.wait(PDL)
            if (lo <= span - 1) & (span - 1 < lo + TILE):
                k0, v0 = _with_row(k0, v0, k_ptr, v_ptr, lo, span - 1, kvh, k_pitch, v_pitch, HD, TILE)
        else:
            k0, v0 = _rows_kv(k_ptr, v_ptr, lo, hi, kvh, k_pitch, v_pitch, HD, TILE)
        g = tl.arange(0, R)
        # padded rows reread the group's last head: finite, never stored
        head = kvh * GROUP + tl.minimum(g, GROUP - 1)
        col = tl.arange(0, HD)[None, :]
        q = tl.load(q_ptr + head[:, None] * HD + col).to(tl.float32)
        q = (q * scale_log2e).to(tl.float16)
        run_max = tl.full([R], float("-inf"), tl.float32)
        run_sum = tl.zeros([R], tl.float32)
        acc = tl.zeros([R, HD], tl.float32)
        run_max, run_sum, acc = _fold(q, run_max, run_sum, acc, k0, v0, lo, hi - 1, TILE)
        if INTERPRETED:  # the same tiles in the same order (`splits.interpreted`)
            start = lo + TILE
            while start < hi:
                k, v = _rows_kv(k_ptr, v_ptr, start, hi, kvh, k_pitch, v_pitch, HD, TILE)
                run_max, run_sum, acc = _fold(q, run_max, run_sum, acc, k, v, start, hi - 1, TILE)
                start += TILE
        else:
            for start in range(lo + TILE, hi, TILE):
                k, v = _rows_kv(k_ptr, v_ptr, start, hi, kvh, k_pitch, v_pitch, HD, TILE)
                run_max, run_sum, acc = _fold(q, run_max, run_sum, acc, k, v, start, hi - 1, TILE)
        live = g < GROUP
        store_mask = live[:, None] & (col < HD)
        if active == 1:
            o = gate_heads(acc / run_sum[:, None], gate_ptr, head, col, store_mask, GATE_HP, GATED)
            store_out(o, head[:, None] * HD + col, store_mask, head, out_ptr, oq_ptr, od_ptr, os_ptr, HD, Q8OUT,
                      kvh * GROUP, GROUP, seam_ptr, WIDTH)  # fmt: skip
        else:
            done = park_partial(acc, run_max, run_sum, acc_ptr, max_ptr, sum_ptr, count_ptr + kvh,
                                head * SPLITS + split, col, store_mask, live, HD)  # fmt: skip
            if done == active - 1:
                # the merge takes the group's heads only (G_P2 rows, not the products' R)
                h = tl.arange(0, G_P2)
                m_live = h < GROUP
                m_head = kvh * GROUP + tl.minimum(h, GROUP - 1)
                m_mask = m_live[:, None] & (col < HD)
                merged = merge_partials(acc_ptr, max_ptr, sum_ptr, m_head, m_live, col, col < HD, active, SPLITS,
                                        S_P2, MERGE_BATCH, HD)  # fmt: skip
                merged = gate_heads(merged, gate_ptr, m_head, col, m_mask, GATE_HP, GATED)
                store_out(merged, m_head[:, None] * HD + col, m_mask, m_head, out_ptr, oq_ptr, od_ptr, os_ptr, HD,
                          Q8OUT, kvh * GROUP, GROUP, seam_ptr, WIDTH)  # fmt: skip
                tl.atomic_xchg(count_ptr + kvh, 0, sem="relaxed", scope="gpu")  # re-armed for the next launch


def group_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    out: torch.Tensor,
    *,
    plan: DecodePlan,
    hd: int,
    scale: float,
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tile_rows: int,
    merge_batch: int | None,
    out_q8: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    gate: torch.Tensor | None,
    sms: int,
    warps: int | None = None,
    stages: int = attn_kernels.ATTN_GROUP_STAGES,
) -> None:
    """The packed launch of `decode.flash_decode` (which checks its arguments and cuts its scratch into
    `parts`: the partials' values, maxima, sums, the groups' counters and the output's seam counters, where a
    group's heads are not whole 32-value blocks together). `warps` and `stages` are kernel facts, parameters
    for the sweep."""
    group = plan.heads_per_block
    group_p2 = triton.next_power_of_2(group)
    warps = warps or attn_kernels.attn_group_warps(group, hd, plan.head_blocks * plan.splits, sms)
    # each merge batch holds G_P2 x batch x HD f32 values over the block's threads
    batch = merge_round(group_p2, hd, warps, plan.splits, merge_batch)
    _group_decode_kernel[(plan.head_blocks, plan.splits)](
        q,
        k_cache,
        v_cache,
        pos,
        out,
        *parts,
        *(out_q8 if out_q8 is not None else (out, out, out)),
        gate if gate is not None else out,
        cache_pitch(k_cache, plan.head_blocks, hd, "k_cache"),
        cache_pitch(v_cache, plan.head_blocks, hd, "v_cache"),
        scale * LOG2E,
        Q8OUT=out_q8 is not None,
        WIDTH=plan.head_blocks * group * hd,
        GROUP=group,
        G_P2=group_p2,
        R=max(DOT_MIN, group_p2),
        HD=hd,
        TILE=tile_rows,
        SPLITS=plan.splits,
        S_P2=triton.next_power_of_2(plan.splits),
        MERGE_BATCH=batch,
        INTERPRETED=interpreted(),
        GATED=gate is not None,
        GATE_HP=gate.stride(0) if gate is not None else 0,
        num_warps=warps,
        num_stages=stages,
        **pdl.options(),
    )
