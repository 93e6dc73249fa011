"""Attention over the latent cache, absorbed: each head's query (`kv_lora + rope` values: its latent-space
part, then its rotated part) scores every cached row (the normed latent, then the shared rotated key) and
sums the rows' latents (their first `kv_lora` values, read in place from the cache) by the softmax of the
scores.

Every head reads the same cached rows (one kv head), so a program takes a query row's block of heads
(`attn_kernels.MLA_HEADS_A_PROGRAM`) and a slice of the value width (`attn_kernels.MLA_VALUE_SLICES`: the whole of it):
a tile of `MLA_TILE_ROWS` cached rows is loaded once and scored for every head of the block at once. The
scores are a sum of tile products (`tl.dot`, f32 with IEEE products, on the CUDA cores) over
`MLA_SCORE_CHUNK` query values at a time, each chunk of the query read again a tile (from L1 or L2): Triton's f32
product keeps each thread's rows of both operands over the whole summed width in registers, so one product
over the 576 values held a thread's whole query rows and spilled them. The weighted latents are one more
product, the running maximum, sum and weighted latents (the online softmax) kept in f32.

A row's span (up to its own position, read on the device, so a chunk is causal and a captured graph replays
at any position) is cut into `splits` equal shares of whole tiles, a program a share and block (flash-decoding):
each writes its share's maximum, sum and weighted latents (a partial) to a scratch. The shares are fixed when
the step is built, at the cache's length; a step's shares past its position hold no rows and exit at once,
neither writing nor counting. The partials merge in two levels (`clusters`): the last of each cluster of about
sqrt(splits) shares to finish (a self-resetting counter a cluster, the routing launch's memory ordering)
combines its cluster's into one more partial, and the last cluster to finish combines those into the row's
output (a single cluster: straight into it). A merge reads `attn_kernels.MLA_MERGE_BATCH` partials a round trip,
combined by a running maximum. One launch. A batch's row attends its own sequence's block of the cache at its
own position.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.plan import attn_kernels
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.attention.splits import interpreted
from fuselane.lanes.cuda.triton.mla import whole


@triton.jit
def _scores(qh, kc, k_pitch, n, keep, live, KW: tl.constexpr, KC: tl.constexpr, HB: tl.constexpr,
            BLOCK_N: tl.constexpr):  # fmt: skip
    """[heads, rows] the block's heads' queries (rows `qh`) dotted with the tile's cached rows `n`, `KC`
    values of each at a time."""
    s = tl.zeros([HB, BLOCK_N], tl.float32)
    dk = tl.arange(0, KC)
    row = kc + n.to(tl.int64)[:, None] * k_pitch
    for c in tl.static_range(0, KW, KC):
        inside = (c + dk < KW)[None, :]
        qc = tl.load(qh[:, None] + c + dk[None, :], mask=live[:, None] & inside, other=0.0).to(tl.float32)
        kt = tl.load(row + c + dk[None, :], mask=keep[:, None] & inside, other=0.0).to(tl.float32)
        s = tl.dot(qc, tl.trans(kt), s, input_precision="ieee")
    return s


@triton.jit
def _tile(qh, live, m_i, l_i, acc, kc, k_pitch, vc, v_pitch, dv, start, hi, scale, KW: tl.constexpr,
          VD: tl.constexpr, KC: tl.constexpr, HB: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """One tile of cached rows folded into the block's heads' running maximum, sum and weighted latents."""
    n = start + tl.arange(0, BLOCK_N)
    keep = n < hi
    s = _scores(qh, kc, k_pitch, n, keep, live, KW, KC, HB, BLOCK_N) * scale
    s = tl.where(keep[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    v = tl.load(vc + n.to(tl.int64)[:, None] * v_pitch + dv[None, :], mask=keep[:, None] & (dv < VD)[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _combine(region, first, count, HB: tl.constexpr, VB: tl.constexpr, SLOTS: tl.constexpr,
             MERGE_BATCH: tl.constexpr):  # fmt: skip
    """(maximum, sum, weighted latents) of `count` partials from slot `first` of a row's block's `region` (every
    slot's maxima, then their sums, then their weighted latents), combined by a running maximum as the online
    softmax does. The partials are other SMs' writes: read from L2 (.cg), past this SM's L1."""
    h = tl.arange(0, HB)
    latents = region + 2 * SLOTS * HB
    top = tl.full([HB], float("-inf"), tl.float32)
    total = tl.zeros([HB], tl.float32)
    merged = tl.zeros([HB, VB], tl.float32)
    i = count * 0  # a while loop: its bound is a device value (`attention.splits.interpreted`)
    while i < count:  # MERGE_BATCH partials a step, their loads in flight together
        for j in tl.static_range(MERGE_BATCH):
            slot, here = first + i + j, i + j < count
            m_s = tl.load(region + slot * HB + h, mask=here, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(region + (SLOTS + slot) * HB + h, mask=here, other=0.0, cache_modifier=".cg")
            rows = (slot * HB + h)[:, None] * VB + tl.arange(0, VB)[None, :]
            a_s = tl.load(latents + rows, mask=here, other=0.0, cache_modifier=".cg")
            new = tl.maximum(top, m_s)  # the first slot holds rows: finite from the first step on
            kept, w = tl.exp(top - new), tl.exp(m_s - new)
            total = total * kept + w * l_s
            merged = merged * kept[:, None] + w[:, None] * a_s
            top = new
        i += MERGE_BATCH
    return top, total, merged


@triton.jit
def _out(out, r, hh, dv, merged, total, HEADS: tl.constexpr, VD: tl.constexpr):
    """Row `r`'s heads `hh`, values `dv`: the weighted latents over their sum (the pointers made here, not
    held in registers through a merge)."""
    o = out + (r.to(tl.int64) * HEADS + hh)[:, None] * VD + dv[None, :]
    tl.store(o, merged / total[:, None], mask=(hh < HEADS)[:, None] & (dv < VD)[None, :])


@triton.jit
def _put(region, slot, top, total, acc, HB: tl.constexpr, VB: tl.constexpr, SLOTS: tl.constexpr):
    """A partial (the maximum and the sum a head, its weighted latents) into `slot` of `region`."""
    h = slot * HB + tl.arange(0, HB)
    tl.store(region + h, top)
    tl.store(region + SLOTS * HB + h, total)
    tl.store(region + 2 * SLOTS * HB + h[:, None] * VB + tl.arange(0, VB)[None, :], acc)


@triton.jit
def _arrive(count):
    """This program's partial, written, counted at `count`: the partials before the gpu-scope acq_rel atomic
    (CUTLASS's semaphore pattern), so the last to arrive sees every one. Returns the programs before it."""
    tl.debug_barrier()
    return tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")


@triton.jit
def _share_out(region, counts, sp, shares, m_i, l_i, acc, out, r, hh, dv, HEADS: tl.constexpr, VD: tl.constexpr,
               HB: tl.constexpr, VB: tl.constexpr, SPLITS: tl.constexpr, CLUSTER: tl.constexpr,
               CLUSTERS: tl.constexpr, SLOTS: tl.constexpr, MERGE_BATCH: tl.constexpr):  # fmt: skip
    """A share's partial into the block's `region`, merged in two levels: the last of each cluster of
    `CLUSTER` shares to arrive combines the cluster's into a slot past the shares', and the last cluster to
    arrive combines those into the output (one cluster: straight into it). Each level's counter (`counts`:
    a cluster's, then the clusters') is left at zero by its last program."""
    _put(region, sp, m_i, l_i, acc, HB, VB, SLOTS)
    k = sp // CLUSTER
    members = tl.minimum(CLUSTER, shares - k * CLUSTER)
    if _arrive(counts + k) == members - 1:
        tl.atomic_xchg(counts + k, 0, sem="relaxed", scope="gpu")
        top, total, merged = _combine(region, k * CLUSTER, members, HB, VB, SLOTS, MERGE_BATCH)
        clusters = tl.cdiv(shares, CLUSTER)
        if clusters == 1:
            _out(out, r, hh, dv, merged, total, HEADS, VD)
        else:
            _put(region, SPLITS + k, top, total, merged, HB, VB, SLOTS)
            if _arrive(counts + CLUSTERS) == clusters - 1:
                tl.atomic_xchg(counts + CLUSTERS, 0, sem="relaxed", scope="gpu")
                top, total, merged = _combine(region, SPLITS, clusters, HB, VB, SLOTS, MERGE_BATCH)
                _out(out, r, hh, dv, merged, total, HEADS, VD)


@triton.jit
def _attend(q, kc, k_pitch, vc, v_pitch, out, part, counter, scale, r, sp, g, end, chunk, shares,
            HEADS: tl.constexpr, KW: tl.constexpr, VD: tl.constexpr, HB: tl.constexpr, VB: tl.constexpr,
            SLICES: tl.constexpr, GROUPS: tl.constexpr, KC: tl.constexpr, BLOCK_N: tl.constexpr,
            SPLITS: tl.constexpr, CLUSTER: tl.constexpr, CLUSTERS: tl.constexpr, SLOTS: tl.constexpr,
            MERGE_BATCH: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """Share `sp` (rows `sp * chunk` onwards, up to `end`) of row `r`'s block `g` of heads and values: its
    output where it is the row's only share, else its partial, and a merge where it is the last to end."""
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, end)
    hh = (g // SLICES) * HB + tl.arange(0, HB)
    live = hh < HEADS
    qh = q + (r.to(tl.int64) * HEADS + hh) * KW
    dv = (g % SLICES) * VB + tl.arange(0, VB)
    m_i = tl.full([HB], float("-inf"), tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, VB], tl.float32)
    if INTERPRETED:  # the interpreter takes no loop bound read from the device (`attention.splits.interpreted`)
        start = lo
        while start < hi:
            m_i, l_i, acc = _tile(qh, live, m_i, l_i, acc, kc, k_pitch, vc, v_pitch, dv, start, hi, scale, KW, VD,
                                  KC, HB, BLOCK_N)  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _tile(qh, live, m_i, l_i, acc, kc, k_pitch, vc, v_pitch, dv, start, hi, scale, KW, VD,
                                  KC, HB, BLOCK_N)  # fmt: skip
    if SPLITS == 1:
        _out(out, r, hh, dv, acc, l_i, HEADS, VD)
    else:
        block = r.to(tl.int64) * GROUPS + g
        _share_out(part + block * SLOTS * HB * (VB + 2), counter + block * (CLUSTERS + 1), sp, shares, m_i, l_i,
                   acc, out, r, hh, dv, HEADS, VD, HB, VB, SPLITS, CLUSTER, CLUSTERS, SLOTS, MERGE_BATCH)  # fmt: skip


@triton.jit
def _split(q, kc, k_pitch, vc, v_pitch, out, part, counter, scale, r, sp, g, end, HEADS: tl.constexpr,
           KW: tl.constexpr, VD: tl.constexpr, HB: tl.constexpr, VB: tl.constexpr, SLICES: tl.constexpr,
           GROUPS: tl.constexpr, KC: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
           CLUSTER: tl.constexpr, CLUSTERS: tl.constexpr, SLOTS: tl.constexpr, MERGE_BATCH: tl.constexpr,
           INTERPRETED: tl.constexpr):  # fmt: skip
    """Share `sp` of row `r`'s span of `end` rows, block `g`: the span cut into `SPLITS` equal shares of whole
    tiles, the shares that hold rows run (a short span's tiles fill the first few; the others neither write a
    partial nor count, so the merge reads only these), a program past the last share (`sp` >= SPLITS, where the
    grid is widened for the short path) none."""
    chunk = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N
    shares = tl.cdiv(end, chunk)
    if sp < shares:
        _attend(q, kc, k_pitch, vc, v_pitch, out, part, counter, scale, r, sp, g, end, chunk, shares, HEADS, KW, VD,
                HB, VB, SLICES, GROUPS, KC, BLOCK_N, SPLITS, CLUSTER, CLUSTERS, SLOTS, MERGE_BATCH,
                INTERPRETED)  # fmt: skip


@triton.jit
def _latent_attention_kernel(
    q, kc, k_pitch, vc, v_pitch, pos, out, part, counter, spart, scount, scale,
    HEADS: tl.constexpr, KW: tl.constexpr, VD: tl.constexpr, HB: tl.constexpr, VB: tl.constexpr,
    SLICES: tl.constexpr, GROUPS: tl.constexpr, KC: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    CLUSTER: tl.constexpr, CLUSTERS: tl.constexpr, SLOTS: tl.constexpr, MERGE_BATCH: tl.constexpr,
    SHORT_ROWS: tl.constexpr, VS: tl.constexpr, BN_S: tl.constexpr, KC_S: tl.constexpr, STAGES_S: tl.constexpr,
    SHARES_S: tl.constexpr, SHARE_ROWS: tl.constexpr,
    INTERPRETED: tl.constexpr, SEQ_ROWS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    r, sp, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if SEQ_ROWS > 0:  # a batch: row r is sequence r's query at pos[r], over its own block of the cache
        end = tl.load(pos + r) + 1
        kc += r.to(tl.int64) * SEQ_ROWS * k_pitch
        vc += r.to(tl.int64) * SEQ_ROWS * v_pitch
    else:
        end = tl.load(pos) + r + 1
    if SHORT_ROWS > 0:  # a span of at most SHORT_ROWS rows runs whole (`whole`): its programs renumbered
        if end <= SHORT_ROWS:
            p = sp * GROUPS + g
            if p < HEADS * ((VD + VS - 1) // VS) * SHARES_S:
                whole.whole(q, kc, k_pitch, vc, v_pitch, out, spart, scount, scale, r, p, end, HEADS, KW, VD, VS,
                            BN_S, KC_S, STAGES_S, SHARES_S, SHARE_ROWS, INTERPRETED)  # fmt: skip
        else:
            _split(q, kc, k_pitch, vc, v_pitch, out, part, counter, scale, r, sp, g, end, HEADS, KW, VD, HB, VB,
                   SLICES, GROUPS, KC, BLOCK_N, SPLITS, CLUSTER, CLUSTERS, SLOTS, MERGE_BATCH,
                   INTERPRETED)  # fmt: skip
    else:
        _split(q, kc, k_pitch, vc, v_pitch, out, part, counter, scale, r, sp, g, end, HEADS, KW, VD, HB, VB, SLICES,
               GROUPS, KC, BLOCK_N, SPLITS, CLUSTER, CLUSTERS, SLOTS, MERGE_BATCH, INTERPRETED)  # fmt: skip


def clusters(splits: int) -> tuple[int, int, int]:
    """(shares a cluster, clusters, partial slots) of a launch of `splits` shares: about sqrt(splits) clusters
    of as many shares, so each level of the merge reads about sqrt(splits) partials; one cluster (no second
    level) up to `attn_kernels.MLA_MERGE_BATCH` shares."""
    cluster = max(attn_kernels.MLA_MERGE_BATCH, math.isqrt(splits - 1) + 1) if splits > 1 else 1
    count = triton.cdiv(splits, cluster)
    return cluster, count, splits + (count if count > 1 else 0)


def blocks(heads: int, vd: int, heads_a_program: int, value_slices: int) -> tuple[int, int, int]:
    """(heads a program, a value slice's width, programs a row and share) for `heads` heads of `vd` values,
    at most `heads_a_program` heads a program (a power of two: a program's tile of heads) and the values in
    `value_slices` slices."""
    hb = min(triton.next_power_of_2(heads), heads_a_program)
    vb = triton.next_power_of_2(triton.cdiv(vd, value_slices))
    return hb, vb, triton.cdiv(heads, hb) * value_slices


def groups(heads: int, vd: int, value_slices: int = attn_kernels.MLA_VALUE_SLICES,
           heads_a_program: int = attn_kernels.MLA_HEADS_A_PROGRAM) -> int:  # fmt: skip
    """Programs a row and share: its blocks of heads times its value slices (`attn_kernels.mla_splits` takes
    them as the launch's head blocks)."""
    return blocks(heads, vd, heads_a_program, value_slices)[2]


def scratch(rows: int, heads: int, vd: int, splits: int, device, *, value_slices: int = attn_kernels.MLA_VALUE_SLICES,
            heads_a_program: int = attn_kernels.MLA_HEADS_A_PROGRAM,
            short: whole.Short = whole.PLAN) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(the shares' sums, the counters a row and block) a launch of `splits` shares takes, the short path's
    shares' (`short`) after them; each launch leaves the counters at zero."""
    hb, vb, g = blocks(heads, vd, heads_a_program, value_slices)
    _, count, slots = clusters(splits)
    sums, counts = short.scratch(rows, heads, vd)
    part = torch.empty(max(1, rows * g * slots * hb * (vb + 2) + sums), dtype=torch.float32, device=device)
    return part, torch.zeros(rows * g * (count + 1) + counts, dtype=torch.int32, device=device)


def _short_work(work: tuple[torch.Tensor, torch.Tensor], rows: int, heads: int, vd: int, short: whole.Short):
    """The short path's partials and counters: the scratch's last values (`scratch`)."""
    part, counter = work
    sums, counts = short.scratch(rows, heads, vd)
    return part[part.numel() - sums :], counter[counter.numel() - counts :]


def latent_attention(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, *,
    rows: int, heads: int, kw: int, vd: int, scale: float, seq_rows: int = 0, splits: int = 1,
    work: tuple[torch.Tensor, torch.Tensor] | None = None, value_slices: int = attn_kernels.MLA_VALUE_SLICES,
    heads_a_program: int = attn_kernels.MLA_HEADS_A_PROGRAM, warps: int = attn_kernels.MLA_WARPS,
    short: whole.Short = whole.PLAN,
) -> None:  # fmt: skip
    """out (rows, heads * vd) = softmax(q . keys * scale) @ values, row i of `q` (rows, heads * kw) at
    position pos[0] + i over cached rows 0..pos[0] + i; `kc` the cache (rows `kc.stride(0)` apart, `kw`
    values each: the first `vd` the latent, the rest the rotated key), `vc` its values (`vd` of a row, at
    `vc.stride(0)`), both read in place. A batch (`seq_rows` > 0): row i is its own sequence's query at
    pos[i], over cached rows i * seq_rows onwards. `splits` > 1 cuts each row's span into that many shares,
    merged through `work` (`scratch`, made for the same `value_slices`, `heads_a_program` and `short`); a row
    whose span is at most `short.rows` runs it whole instead (`whole`: the grid widened to its programs where the
    shares' are fewer), in `short.shares` shares at most (merged through the end of `work`). The blocks and
    `warps` default to the plan's (`kernels.MLA_*`)."""
    if kc.stride(-1) != 1 or vc.stride(-1) != 1 or q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("latent_attention: every row must be unit-stride")
    if (splits > 1 or short.shares > 1) and work is None:
        raise ValueError("a split attention merges its shares through a scratch")
    hb, vb, g = blocks(heads, vd, heads_a_program, value_slices)
    cluster, count, slots = clusters(splits)
    part, counter = work if work is not None else (out, out)  # one share: never read
    spart, scount = _short_work(work, rows, heads, vd, short) if short.shares > 1 else (part, counter)
    wide = max(splits, triton.cdiv(short.programs(heads, vd), g))
    _latent_attention_kernel[(rows, wide, g)](
        q, kc, kc.stride(0), vc, vc.stride(0), pos, out, part, counter, spart, scount, scale, heads, kw, vd, hb, vb,
        value_slices, g,
        attn_kernels.MLA_SCORE_CHUNK, attn_kernels.MLA_TILE_ROWS, splits, cluster, count, slots,
        attn_kernels.MLA_MERGE_BATCH,
        *short.constants(), interpreted(), seq_rows,
        num_warps=warps, **pdl.options(),
    )  # fmt: skip
