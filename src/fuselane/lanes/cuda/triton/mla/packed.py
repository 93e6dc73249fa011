"""The absorbed latent attention's decode with a row's heads as the rows of f16 tensor-core products (as
`attention/group_decode.py` packs a key/value group's heads), under the int8 numerics' attention.

Why: `attention.py`'s split path scores on the CUDA cores in f32 (IEEE products, `MLA_SCORE_CHUNK` query
values a product, each product's operands through shared memory and a barrier), so a tile of 16 cached rows
costs a program some 40 barriers, and at 4,096 rows V2-Lite's launch took 66.9 us (H200, its cache in L2,
`benchmarks/mla_decode_sweep.py`) for 4.7 MB. Every head reads the same cached row (one kv head), so here a
program takes all of a row's heads (padded to tl.dot's 16) as the rows of two products a tile: the scores,
the heads' latent part by the tile's latents and their rotated part by its rotated keys, and the weighted
latents, the tile's weights by the same latents (the values are the latents: one load of a tile serves both).

The numerics are `group_decode.py`'s (`CudaShim.attention` under int8: queries, keys, values and weights
rounded to f16, f32 sums and softmax): the query is scaled by scale * log2 e before its rounding, so scores
come out in base-2 units. The value width is cut into `attn_kernels.MLA_PACKED_VALUE_SLICES` slices, a program a
slice (each scores the tile again, from L2 after the first), so a row's merge reads a slice's partials, not
the width's. The span is cut into splits computed in the kernel from the position (a graph replays at any
position), each split's partial parked and merged by the slice's last program (`attention.splits`).

A decode step's row, a narrow chunk's rows (row r at pos[0] + r), or a batch's rows each over its own block of
the cache (`seq_rows`).
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
    interpreted,
    merge_partials,
    merge_round,
    park_partial,
)


@triton.jit
def _tile(q_lat, q_rot, run_max, run_sum, acc, kc, k_pitch, start, hi, vs, LORA: tl.constexpr,
          ROT: tl.constexpr, VB: tl.constexpr, SLICES: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """A tile of cached rows from `start` (those at or past `hi` masked) folded into the heads' running softmax:
    scores from the latents and the rotated keys, weighted latents of value slice `vs`."""
    n = start + tl.arange(0, TILE)
    live = (n < hi)[:, None]
    row = kc + n.to(tl.int64)[:, None] * k_pitch
    lat = tl.load(row + tl.arange(0, LORA)[None, :], mask=live, other=0.0).to(tl.float16)  # [TILE, LORA]
    rot = tl.load(row + LORA + tl.arange(0, ROT)[None, :], mask=live, other=0.0).to(tl.float16)  # [TILE, ROT]
    s = tl.dot(q_lat, tl.trans(lat)) + tl.dot(q_rot, tl.trans(rot))  # [R, TILE]
    last = tl.zeros([q_lat.shape[0]], tl.int32) + (hi - 1)
    new_max, alpha, p, run_sum = softmax_fold(s, n, last, run_max, run_sum, True)
    if SLICES == 1:
        v = lat
    else:  # the slice's latents, again: from L1 or L2 (the whole row was just read)
        v = tl.load(row + vs * VB + tl.arange(0, VB)[None, :], mask=live, other=0.0).to(tl.float16)
    return new_max, run_sum, acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)


@triton.jit
def _packed_kernel(q, kc, k_pitch, pos, out, acc_ptr, max_ptr, sum_ptr, count_ptr, scale_log2e,
                   HEADS: tl.constexpr, R: tl.constexpr, LORA: tl.constexpr, ROT: tl.constexpr, VB: tl.constexpr,
                   SLICES: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, S_P2: tl.constexpr,
                   MERGE_BATCH: tl.constexpr, SEQ_ROWS: tl.constexpr, INTERPRETED: tl.constexpr,
                   PDL: tl.constexpr):  # fmt: skip
    pdl.begin(PDL)
    vs, split, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if SEQ_ROWS > 0:  # a batch: row r is sequence r's query at pos[r], over its own block of the cache
        span = tl.load(pos + r) + 1
        kc += r.to(tl.int64) * SEQ_ROWS * k_pitch
    else:  # a chunk's row r at pos[0] + r
        span = tl.load(pos) + r + 1
    chunk = tl.cdiv(tl.cdiv(span, SPLITS), TILE) * TILE
    active = tl.cdiv(span, chunk)
    if split < active:
        lo = split * chunk
        hi = tl.minimum(lo + chunk, span)
        g = tl.arange(0, R)
        head = tl.minimum(g, HEADS - 1)  # padded rows reread the last head: finite, never stored
        qh = q + (r.to(tl.int64) * HEADS + head)[:, None] * (LORA + ROT)
        q_lat = (tl.load(qh + tl.arange(0, LORA)[None, :]) * scale_log2e).to(tl.float16)
        q_rot = (tl.load(qh + LORA + tl.arange(0, ROT)[None, :]) * scale_log2e).to(tl.float16)
        run_max = tl.full([R], float("-inf"), tl.float32)
        run_sum = tl.zeros([R], tl.float32)
        acc = tl.zeros([R, VB], tl.float32)
        if INTERPRETED:  # the interpreter takes no loop bound read from the device (`attention.splits.interpreted`)
            start = lo
            while start < hi:
                run_max, run_sum, acc = _tile(q_lat, q_rot, run_max, run_sum, acc, kc, k_pitch, start, hi, vs, LORA,
                                              ROT, VB, SLICES, TILE)  # fmt: skip
                start += TILE
        else:
            for start in range(lo, hi, TILE):
                run_max, run_sum, acc = _tile(q_lat, q_rot, run_max, run_sum, acc, kc, k_pitch, start, hi, vs, LORA,
                                              ROT, VB, SLICES, TILE)  # fmt: skip
        live = g < HEADS
        col = tl.arange(0, VB)[None, :]
        mask = live[:, None] & (col < VB)
        o_at = out + (r.to(tl.int64) * HEADS + head)[:, None] * (SLICES * VB) + vs * VB + col
        if active == 1:
            tl.store(o_at, acc / run_sum[:, None], mask=mask)
        else:
            # each (row, slice) its own partials and counter
            at = r * SLICES + vs
            parts = at * HEADS * SPLITS * VB
            done = park_partial(acc, run_max, run_sum, acc_ptr + parts, max_ptr + at * HEADS * SPLITS,
                                sum_ptr + at * HEADS * SPLITS, count_ptr + at, head * SPLITS + split, col, mask, live,
                                VB)  # fmt: skip
            if done == active - 1:
                merged = merge_partials(acc_ptr + parts, max_ptr + at * HEADS * SPLITS, sum_ptr + at * HEADS * SPLITS,
                                        head, live, col, col < VB, active, SPLITS, S_P2, MERGE_BATCH, VB)  # fmt: skip
                tl.store(o_at, merged, mask=mask)
                tl.atomic_xchg(count_ptr + at, 0, sem="relaxed", scope="gpu")  # re-armed for the next launch


def _p2(n: int) -> bool:
    """A side tl.dot takes: a power of two of at least 16."""
    return n >= DOT_MIN and n & (n - 1) == 0


def value_slices(vd: int) -> int:
    """Slices of a `vd`-value width the programs take: `attn_kernels.MLA_PACKED_VALUE_SLICES`, fewer where a slice
    would be narrower than tl.dot's 16."""
    return max(1, min(attn_kernels.MLA_PACKED_VALUE_SLICES, vd // DOT_MIN))


def takes(heads: int, kw: int, vd: int) -> bool:
    """Whether a latent attention of `heads` heads, keys of `kw` values and values of the first `vd` of them has
    this kernel: the latent and the rotated part tl.dot's sides, the heads within one program's rows
    (`attn_kernels.MLA_PACKED_MOST_HEADS`)."""
    return _p2(vd) and _p2(kw - vd) and 0 < heads <= attn_kernels.MLA_PACKED_MOST_HEADS


def splits(rows: int, vd: int, span: int, sms: int) -> int:
    """Splits of a row's span: `attn_kernels.attn_group_splits`' (a power of two, the chip filled `ATTN_GROUP_WAVES`
    times by the rows' value slices, a tile a split at least)."""
    return attn_kernels.attn_group_splits(rows * value_slices(vd), span, sms, attn_kernels.MLA_PACKED_TILE_ROWS)


def scratch(rows: int, heads: int, vd: int, splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the splits' partials: weighted values, then each slice's maxima, then its sums; a counter a row and
    slice) a launch takes; each launch leaves the counters at zero."""
    parts, slices = rows * heads * splits, value_slices(vd)
    return (torch.empty(max(1, parts * (vd + 2 * slices)), dtype=torch.float32, device=device),
            torch.zeros(rows * slices, dtype=torch.int32, device=device))  # fmt: skip


def latent_attention(q: torch.Tensor, kc: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, *, rows: int, heads: int,
                     kw: int, vd: int, scale: float, splits: int, work: tuple[torch.Tensor, torch.Tensor] | None,
                     seq_rows: int = 0) -> None:  # fmt: skip
    """out (rows, heads * vd) f32 = softmax(q . keys * scale) @ values for row i of `q` (rows, heads * kw) at
    pos[0] (a batch, `seq_rows` > 0: pos[i], over cached rows i * seq_rows onwards) over the cached rows up to
    it; `kc` the cache (`kw` values a row at `kc.stride(0)`: the latent, then the rotated key), its first `vd`
    the values. `splits` > 1 merges through `work` (`scratch`)."""
    if kc.stride(-1) != 1 or q.stride(-1) != 1 or out.stride(-1) != 1 or not takes(heads, kw, vd):
        raise ValueError(f"the packed latent attention takes unit-stride rows of heads its kernel holds, not "
                         f"{heads} heads of {kw} -> {vd}")  # fmt: skip
    if splits > 1 and work is None:
        raise ValueError("a split attention merges its shares through a scratch")
    slices = value_slices(vd)
    vb = vd // slices
    part, counter = work if work is not None else (out, out)
    parts = rows * heads * splits  # a row's heads' splits: their values, then a slice's maxima, then its sums
    acc, top, total = part[: parts * vd], part[parts * vd : parts * (vd + slices)], part[parts * (vd + slices) :]
    r = max(DOT_MIN, triton.next_power_of_2(heads))
    warps = attn_kernels.MLA_PACKED_WARPS
    _packed_kernel[(slices, splits, rows)](
        q, kc, kc.stride(0), pos, out, acc, top if splits > 1 else out, total if splits > 1 else out, counter,
        scale * LOG2E, HEADS=heads, R=r, LORA=vd, ROT=kw - vd, VB=vb, SLICES=slices,
        TILE=attn_kernels.MLA_PACKED_TILE_ROWS,
        SPLITS=splits, S_P2=triton.next_power_of_2(splits), MERGE_BATCH=merge_round(r, vb, warps, splits),
        SEQ_ROWS=seq_rows, INTERPRETED=interpreted(), num_warps=warps, num_stages=attn_kernels.MLA_PACKED_STAGES,
        **pdl.options(),
    )  # fmt: skip
