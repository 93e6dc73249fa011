"""Attention over the latent cache, absorbed: each head's query (`kv_lora + rope` values: its latent-space
part, then its rotated part) scores every cached row (the normed latent, then the shared rotated key) and
sums the rows' latents (their first `kv_lora` values, read in place from the cache) by the softmax of the
scores.

A program takes one query row and one head and walks the cached rows up to the row's own position in tiles
of `BLOCK_N` (a batch's row: its own sequence's block of the cache), keeping the running maximum, sum and
weighted latents (the online softmax) in f32, so a chunk's rows are causal and a decode step reads the
position on the device (a captured graph replays at any position). One launch; the cache is read in its own
precision (f32 or f16) and summed in f32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.triton.attention.decode import interpreted

# Cached rows a program scores at a time.
BLOCK_N = 16
WARPS = 4


@triton.jit
def _tile(qv, m_i, l_i, acc, kc, k_pitch, vc, v_pitch, start, end, KW: tl.constexpr, VD: tl.constexpr,
          BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """One tile of cached rows folded into the running maximum, sum and weighted latents."""
    dk, dv = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    n = start + tl.arange(0, BLOCK_N)
    keep = n < end
    nn = n.to(tl.int64)[:, None]
    k = tl.load(kc + nn * k_pitch + dk[None, :], mask=keep[:, None] & (dk < KW)[None, :], other=0.0)
    s = tl.sum(k.to(tl.float32) * qv[None, :], axis=1)
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    v = tl.load(vc + nn * v_pitch + dv[None, :], mask=keep[:, None] & (dv < VD)[None, :], other=0.0)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
    return m_new, l_i, acc


@triton.jit
def _latent_attention_kernel(
    q, kc, k_pitch, vc, v_pitch, pos, out, scale,
    HEADS: tl.constexpr, KW: tl.constexpr, VD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr, SEQ_ROWS: tl.constexpr,
):  # fmt: skip
    r, h = tl.program_id(0), tl.program_id(1)
    if SEQ_ROWS > 0:  # a batch: row r is sequence r's query at pos[r], over its own block of the cache
        end = tl.load(pos + r) + 1
        kc += r.to(tl.int64) * SEQ_ROWS * k_pitch
        vc += r.to(tl.int64) * SEQ_ROWS * v_pitch
    else:
        end = tl.load(pos) + r + 1
    dk, dv = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    qv = tl.load(q + (r.to(tl.int64) * HEADS + h) * KW + dk, mask=dk < KW, other=0.0).to(tl.float32) * scale
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_V], tl.float32)
    if INTERPRETED:  # the interpreter takes no loop bound read from the device (`attention.decode.interpreted`)
        start = 0
        while start < end:
            m_i, l_i, acc = _tile(qv, m_i, l_i, acc, kc, k_pitch, vc, v_pitch, start, end, KW, VD, BLOCK_K,
                                  BLOCK_V, BLOCK_N)  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(0, end, BLOCK_N):
            m_i, l_i, acc = _tile(qv, m_i, l_i, acc, kc, k_pitch, vc, v_pitch, start, end, KW, VD, BLOCK_K,
                                  BLOCK_V, BLOCK_N)  # fmt: skip
    tl.store(out + (r.to(tl.int64) * HEADS + h) * VD + dv, acc / l_i, mask=dv < VD)


def latent_attention(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, *,
    rows: int, heads: int, kw: int, vd: int, scale: float, seq_rows: int = 0,
) -> None:  # fmt: skip
    """out (rows, heads * vd) = softmax(q . keys * scale) @ values, row i of `q` (rows, heads * kw) at
    position pos[0] + i over cached rows 0..pos[0] + i; `kc` the cache (rows `kc.stride(0)` apart, `kw`
    values each), `vc` its values (`vd` of a row, at `vc.stride(0)`), both read in place. A batch
    (`seq_rows` > 0): row i is its own sequence's query at pos[i], over cached rows i * seq_rows onwards."""
    if kc.stride(-1) != 1 or vc.stride(-1) != 1 or q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("latent_attention: every row must be unit-stride")
    _latent_attention_kernel[(rows, heads)](
        q, kc, kc.stride(0), vc, vc.stride(0), pos, out, scale, heads, kw, vd,
        triton.next_power_of_2(kw), triton.next_power_of_2(vd), BLOCK_N, interpreted(), seq_rows, num_warps=WARPS,
    )  # fmt: skip
