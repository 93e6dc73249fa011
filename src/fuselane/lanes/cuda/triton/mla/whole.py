"""The latent attention's short-span path: a row's whole span in one program a head and a slice of the value
width, no partials and no merge up to `Short.share_rows` rows (`attention._latent_attention_kernel` takes it
where the row's live span, read on the device, is at most `Short.rows`); past that, a few shares of it (as many
as the chip runs at once) merged in one read by the last to end.

Why: at a short span (a decode step at depth 64: 65 cached rows, 75 KB) the split path's time is its serial
phases, not its bytes: a share's tile of products through shared memory (two barriers a score chunk), its
partial's store, a gpu-scope count, then the last program's L2 reads of every partial. Here a program scores
its head's query over every row of the span and sums only its slice of the latents (`Short.values` values): each
slice's program makes the scores again, which costs little at a short span (the programs run side by side and
read the span from L2) and leaves nothing to merge.

One head a program keeps every product in the layout its cached rows are loaded in: a tile's scores are the
rows' products with the query summed elementwise over the chunks of `Short.chunk` values ([tile rows, chunk] a
thread's share of both) and reduced across the chunk once a tile; the weighted latents and the softmax's sum
are kept a cached row each and reduced once, at the end. A tile's only exchange between warps is its maximum.
f32 products and sums, as the split path's.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from fuselane.lanes.cuda.plan import attn_kernels


@triton.jit
def _scores(qh, kc, k_pitch, n, keep, KW: tl.constexpr, KC: tl.constexpr, BN: tl.constexpr):
    """[rows]: the head's query (at `qh`) dotted with the cached rows `n`, `KC` values at a time, the chunks'
    products summed elementwise and reduced once."""
    s = tl.zeros([BN, KC], tl.float32)
    dk = tl.arange(0, KC)
    row = kc + n.to(tl.int64)[:, None] * k_pitch
    for c in tl.static_range(0, KW, KC):
        inside = c + dk < KW
        qc = tl.load(qh + c + dk, mask=inside, other=0.0).to(tl.float32)
        kt = tl.load(row + c + dk[None, :], mask=keep[:, None] & inside[None, :], other=0.0).to(tl.float32)
        s += kt * qc[None, :]
    return tl.sum(s, axis=1)


@triton.jit
def _fold(qh, m_i, l_i, acc, kc, k_pitch, vc, v_pitch, dv, vlive, start, end, scale, KW: tl.constexpr,
          KC: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """One tile of `BN` cached rows folded into the running maximum, and the rows' sums and weighted slices of
    latents (a row each, reduced at the end)."""
    n = start + tl.arange(0, BN)
    keep = n < end
    s = tl.where(keep, _scores(qh, kc, k_pitch, n, keep, KW, KC, BN) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    v = tl.load(vc + n.to(tl.int64)[:, None] * v_pitch + dv[None, :], mask=keep[:, None] & vlive[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    return m_new, l_i * alpha + p, acc * alpha + p[:, None] * v


@triton.jit
def _span(qh, kc, k_pitch, vc, v_pitch, dv, vlive, lo, hi, scale, KW: tl.constexpr, VS: tl.constexpr,
          BN: tl.constexpr, KC: tl.constexpr, STAGES: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """(maximum, sum, weighted slice of latents) of the head's query over cached rows lo..hi - 1."""
    m_i = float("-inf")
    l_i = tl.zeros([BN], tl.float32)
    acc = tl.zeros([BN, VS], tl.float32)
    if INTERPRETED:  # the interpreter takes no loop bound read from the device (`attention.splits.interpreted`)
        start = lo
        while start < hi:
            m_i, l_i, acc = _fold(qh, m_i, l_i, acc, kc, k_pitch, vc, v_pitch, dv, vlive, start, hi, scale, KW,
                                  KC, BN)  # fmt: skip
            start += BN
    else:
        for start in tl.range(lo, hi, BN, num_stages=STAGES):  # the next tiles' rows in flight (cp.async)
            m_i, l_i, acc = _fold(qh, m_i, l_i, acc, kc, k_pitch, vc, v_pitch, dv, vlive, start, hi, scale, KW,
                                  KC, BN)  # fmt: skip
    return m_i, tl.sum(l_i, axis=0), tl.sum(acc, axis=0)


@triton.jit
def _merge(region, count, m_i, l_i, acc, share, shares, o, vlive, VS: tl.constexpr, SHARES: tl.constexpr):
    """This share's partial into `region` (every share's maximum, then sums, then weighted slices), counted at
    `count`: the last share to arrive combines them all, in one read, into `o` and leaves the counter at zero.
    The partials are other SMs' writes: read from L2 (.cg), past this SM's L1."""
    j = tl.arange(0, VS)
    tl.store(region + share, m_i)
    tl.store(region + SHARES + share, l_i)
    tl.store(region + 2 * SHARES + share * VS + j, acc)
    tl.debug_barrier()  # every thread's stores before the gpu-scope acq_rel count (`attention._arrive`)
    if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == shares - 1:
        tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")
        sh = tl.arange(0, SHARES)
        here = sh < shares
        ms = tl.load(region + sh, mask=here, other=float("-inf"), cache_modifier=".cg")
        ls = tl.load(region + SHARES + sh, mask=here, other=0.0, cache_modifier=".cg")
        parts = tl.load(region + 2 * SHARES + sh[:, None] * VS + j[None, :], mask=here[:, None], other=0.0,
                        cache_modifier=".cg")  # fmt: skip
        w = tl.exp(ms - tl.max(ms, axis=0))
        tl.store(o, tl.sum(w[:, None] * parts, axis=0) / tl.sum(w * ls, axis=0), mask=vlive)


@triton.jit
def whole(q, kc, k_pitch, vc, v_pitch, out, part, counter, scale, r, p, end, HEADS: tl.constexpr, KW: tl.constexpr,
          VD: tl.constexpr, VS: tl.constexpr, BN: tl.constexpr, KC: tl.constexpr, STAGES: tl.constexpr,
          SHARES: tl.constexpr, SHARE_ROWS: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """Program `p` of row `r` (its share of the span, its head, its slice of `VS` values) over the row's cached
    rows 0..end - 1: the softmax-weighted latents of that slice, straight into the output where the span is one
    share (at most `SHARE_ROWS` rows, or SHARES 1), else merged by the last share to end through `part` (a
    region of partials a row's unit, `Short.line` values apart) and `counter` (one a row's unit)."""
    slices: tl.constexpr = (VD + VS - 1) // VS
    units: tl.constexpr = HEADS * slices
    share, u = p // units, p % units
    h = u // slices
    dv = (u % slices) * VS + tl.arange(0, VS)
    vlive = dv < VD
    qh = q + (r.to(tl.int64) * HEADS + h) * KW
    o = out + (r.to(tl.int64) * HEADS + h) * VD + dv
    if SHARES > 1:  # the span's shares, from its live length: whole tiles, SHARE_ROWS rows each at least
        shares = tl.minimum(SHARES, tl.cdiv(end, SHARE_ROWS))
        chunk = tl.cdiv(tl.cdiv(end, shares), BN) * BN
        shares = tl.cdiv(end, chunk)
        if share < shares:
            lo = share * chunk
            m_i, l_i, acc = _span(qh, kc, k_pitch, vc, v_pitch, dv, vlive, lo, tl.minimum(lo + chunk, end), scale,
                                  KW, VS, BN, KC, STAGES, INTERPRETED)  # fmt: skip
            if shares == 1:
                tl.store(o, acc / l_i, mask=vlive)
            else:
                unit = r.to(tl.int64) * units + u
                line: tl.constexpr = (SHARES * (VS + 2) + 15) // 16 * 16
                _merge(part + unit * line, counter + unit, m_i, l_i, acc, share, shares, o, vlive, VS, SHARES)
    else:
        m_i, l_i, acc = _span(qh, kc, k_pitch, vc, v_pitch, dv, vlive, end * 0, end, scale, KW, VS, BN, KC, STAGES,
                              INTERPRETED)  # fmt: skip
        tl.store(o, acc / l_i, mask=vlive)


@dataclass(frozen=True, slots=True)
class Short:
    """The short-span path's shape: spans of at most `rows` cached rows run whole (0: never), a program takes a
    head and `values` values of the width, `tile_rows` cached rows at a time, `chunk` query values a product
    step, its tiles' loads `stages` deep; a span longer than `share_rows` is cut into at most `shares` shares
    merged by the last to end (1: never). The defaults are the plan's (`kernels.MLA_SHORT_*`); the lane sets
    `shares` by its chip (`mla_launch.short_path`)."""

    rows: int = attn_kernels.MLA_SHORT_ROWS
    values: int = attn_kernels.MLA_SHORT_VALUES
    tile_rows: int = attn_kernels.MLA_SHORT_TILE_ROWS
    chunk: int = attn_kernels.MLA_SHORT_CHUNK
    stages: int = attn_kernels.MLA_SHORT_STAGES
    shares: int = 1
    share_rows: int = attn_kernels.MLA_SHORT_SHARE_ROWS

    def __post_init__(self) -> None:
        if self.shares < 1 or self.shares & (self.shares - 1):
            raise ValueError(f"the short path's shares are a power of two (one read merges them), not {self.shares}")

    def units(self, heads: int, vd: int) -> int:
        """Programs a row and share: a head's slices of the width."""
        return heads * triton.cdiv(vd, self.values)

    def programs(self, heads: int, vd: int) -> int:
        """Programs a row the path takes for `heads` heads of `vd` values: every share's units."""
        return self.units(heads, vd) * self.shares if self.rows > 0 else 0

    def line(self) -> int:
        """f32 values a row's unit's partials take (every share's maximum, sum and weighted slice), in whole
        16-value lines (the kernel's `line`)."""
        return 16 * triton.cdiv(self.shares * (self.values + 2), 16)

    def scratch(self, rows: int, heads: int, vd: int) -> tuple[int, int]:
        """(f32 values of partials, counters) the shares take: none with one share."""
        if self.shares == 1 or self.rows == 0:
            return 0, 0
        units = rows * self.units(heads, vd)
        return units * self.line(), units

    def constants(self) -> tuple[int, ...]:
        """The kernel's constexprs, in its order (SHORT_ROWS, VS, BN_S, KC_S, STAGES_S, SHARES_S, SHARE_ROWS)."""
        return self.rows, self.values, self.tile_rows, self.chunk, self.stages, self.shares, self.share_rows


PLAN = Short()  # the plan's
NEVER = Short(rows=0)  # every span split, as a chunk's rows past the GEMV's take it
