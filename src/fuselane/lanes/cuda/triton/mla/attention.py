"""Attention over the latent cache, absorbed: each head's query (`kv_lora + rope` values: its latent-space
part, then its rotated part) scores every cached row (the normed latent, then the shared rotated key) and
sums the rows' latents (their first `kv_lora` values, read in place from the cache) by the softmax of the
scores.

Every head reads the same cached rows (one kv head), so a program takes one query row and all its heads: a
tile of `BLOCK_N` cached rows is loaded once and scored for every head at once (two tile products, `tl.dot`,
the latent part and the rotated part, in f32 with IEEE products), the running maximum, sum and weighted
latents (the online softmax) kept in f32. A row's span (up to its own position, read on the device, so a
chunk is causal and a captured graph replays at any position) is cut into `splits` equal shares of whole
tiles, a program a share (flash-decoding): each writes its share's maximum, sum and weighted latents to a
scratch, and the row's last program to finish (a self-resetting counter a row, the routing launch's memory
ordering) merges them into the row's output. One launch. A batch's row attends its own sequence's block of
the cache at its own position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.attention.decode import interpreted

# Cached rows a program scores at a time: `tl.dot`'s smallest tile.
BLOCK_N = 16
WARPS = 8
MIN_DOT = 16  # `tl.dot`'s smallest M, N and K


@triton.jit
def _tile(ql, qr, m_i, l_i, acc, kc, k_pitch, vc, v_pitch, start, hi, LORA: tl.constexpr, ROPE: tl.constexpr,
          VD: tl.constexpr, L_P2: tl.constexpr, R_P2: tl.constexpr, V_P2: tl.constexpr,
          BLOCK_N: tl.constexpr):  # fmt: skip
    """One tile of cached rows folded into every head's running maximum, sum and weighted latents."""
    dl, dr, dv = tl.arange(0, L_P2), tl.arange(0, R_P2), tl.arange(0, V_P2)
    n = start + tl.arange(0, BLOCK_N)
    keep = n < hi
    row = kc + n.to(tl.int64)[:, None] * k_pitch
    kl = tl.load(row + dl[None, :], mask=keep[:, None] & (dl < LORA)[None, :], other=0.0).to(tl.float32)
    kr = tl.load(row + LORA + dr[None, :], mask=keep[:, None] & (dr < ROPE)[None, :], other=0.0).to(tl.float32)
    s = tl.dot(ql, tl.trans(kl), input_precision="ieee") + tl.dot(qr, tl.trans(kr), input_precision="ieee")
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
def _latent_attention_kernel(
    q, kc, k_pitch, vc, v_pitch, pos, out, part, counter, scale,
    HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr, VD: tl.constexpr, H_P2: tl.constexpr,
    L_P2: tl.constexpr, R_P2: tl.constexpr, V_P2: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    INTERPRETED: tl.constexpr, SEQ_ROWS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    r, sp = tl.program_id(0), tl.program_id(1)
    if SEQ_ROWS > 0:  # a batch: row r is sequence r's query at pos[r], over its own block of the cache
        end = tl.load(pos + r) + 1
        kc += r.to(tl.int64) * SEQ_ROWS * k_pitch
        vc += r.to(tl.int64) * SEQ_ROWS * v_pitch
    else:
        end = tl.load(pos) + r + 1
    chunk = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, end)
    hh = tl.arange(0, H_P2)
    live = hh < HEADS
    dl, dr, dv = tl.arange(0, L_P2), tl.arange(0, R_P2), tl.arange(0, V_P2)
    qrow = q + (r.to(tl.int64) * HEADS + tl.minimum(hh, HEADS - 1))[:, None] * (LORA + ROPE)
    ql = tl.load(qrow + dl[None, :], mask=(dl < LORA)[None, :], other=0.0).to(tl.float32) * scale
    qr = tl.load(qrow + LORA + dr[None, :], mask=(dr < ROPE)[None, :], other=0.0).to(tl.float32) * scale
    m_i = tl.full([H_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([H_P2], tl.float32)
    acc = tl.zeros([H_P2, V_P2], tl.float32)
    if INTERPRETED:  # the interpreter takes no loop bound read from the device (`attention.decode.interpreted`)
        start = lo
        while start < hi:
            m_i, l_i, acc = _tile(ql, qr, m_i, l_i, acc, kc, k_pitch, vc, v_pitch, start, hi, LORA, ROPE, VD, L_P2,
                                  R_P2, V_P2, BLOCK_N)  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _tile(ql, qr, m_i, l_i, acc, kc, k_pitch, vc, v_pitch, start, hi, LORA, ROPE, VD, L_P2,
                                  R_P2, V_P2, BLOCK_N)  # fmt: skip
    o = out + (r.to(tl.int64) * HEADS + hh)[:, None] * VD + dv[None, :]
    keep = live[:, None] & (dv < VD)[None, :]
    if SPLITS == 1:
        tl.store(o, acc / l_i[:, None], mask=keep)
    else:
        # this share's sums: the maximum and sum a head (an empty share: -inf and 0), then its weighted latents
        base = part + ((r.to(tl.int64) * SPLITS + sp) * H_P2 + hh) * (V_P2 + 2)
        tl.store(base, m_i)
        tl.store(base + 1, l_i)
        tl.store(base[:, None] + 2 + dv[None, :], acc)
        tl.debug_barrier()
        done = tl.atomic_add(counter + r, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:  # the row's last share merges them all
            tl.atomic_xchg(counter + r, 0, sem="relaxed", scope="gpu")
            big = tl.full([H_P2], float("-inf"), tl.float32)
            for s in range(SPLITS):
                at = part + ((r.to(tl.int64) * SPLITS + s) * H_P2 + hh) * (V_P2 + 2)
                big = tl.maximum(big, tl.load(at, cache_modifier=".cg"))
            total = tl.zeros([H_P2], tl.float32)
            merged = tl.zeros([H_P2, V_P2], tl.float32)
            for s in range(SPLITS):
                at = part + ((r.to(tl.int64) * SPLITS + s) * H_P2 + hh) * (V_P2 + 2)
                w = tl.exp(tl.load(at, cache_modifier=".cg") - big)  # an empty share weighs 0
                total += w * tl.load(at + 1, cache_modifier=".cg")
                merged += w[:, None] * tl.load(at[:, None] + 2 + dv[None, :], cache_modifier=".cg")
            tl.store(o, merged / total[:, None], mask=keep)


def _p2(n: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(n))


def scratch(rows: int, heads: int, vd: int, splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the shares' sums, the counters a row) a launch of `splits` shares takes; each launch leaves the
    counters at zero."""
    part = torch.empty(max(1, rows * splits * _p2(heads) * (_p2(vd) + 2)), dtype=torch.float32, device=device)
    return part, torch.zeros(rows, dtype=torch.int32, device=device)


def latent_attention(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, *,
    rows: int, heads: int, kw: int, vd: int, scale: float, seq_rows: int = 0, splits: int = 1,
    work: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:  # fmt: skip
    """out (rows, heads * vd) = softmax(q . keys * scale) @ values, row i of `q` (rows, heads * kw) at
    position pos[0] + i over cached rows 0..pos[0] + i; `kc` the cache (rows `kc.stride(0)` apart, `kw`
    values each: the first `vd` the latent, the rest the rotated key), `vc` its values (`vd` of a row, at
    `vc.stride(0)`), both read in place. A batch (`seq_rows` > 0): row i is its own sequence's query at
    pos[i], over cached rows i * seq_rows onwards. `splits` > 1 cuts each row's span into that many shares,
    merged through `work` (`scratch`)."""
    if kc.stride(-1) != 1 or vc.stride(-1) != 1 or q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("latent_attention: every row must be unit-stride")
    if splits > 1 and work is None:
        raise ValueError("a split attention merges its shares through a scratch")
    part, counter = work if work is not None else (out, out)  # one share: never read
    lora, rope = vd, kw - vd
    _latent_attention_kernel[(rows, splits)](
        q, kc, kc.stride(0), vc, vc.stride(0), pos, out, part, counter, scale, heads, lora, rope, vd, _p2(heads),
        _p2(lora), _p2(rope), _p2(vd), BLOCK_N, splits, interpreted(), seq_rows, num_warps=WARPS, **pdl.options(),
    )  # fmt: skip
