"""Causal attention of a wide chunk over the expanded latent cache, on the tensor cores: the last of `Mla`'s
three launches (after the key half and the value half of the latent's expansion, `expand`).

Each head's query is its `nope` unrotated values (read in place in the query projection, at its pitch) then
its `rope` rotated values (the rotation's output); each cached row's key for that head is the head's `nope`
expanded values (the key half's output) then the rotated key every head shares (read in place from the latent
cache, after the latent); its value the head's `vd` expanded values (the value half's output). A program takes
BLOCK_M query rows of one head and walks the cached rows in tiles of BLOCK_N up to its last row's position
(read on the device, so a captured graph replays at any position): the scores are two tile products (the
unrotated part and the rotated part), the weighted values one, with an online softmax in f32 (weights as
2^(s * scale * log2 e - max), as the chunk attention's `attention.prefill`). The operands are f16 under the
int8 numerics (the f16 tensor cores: queries, keys, values and weights rounded to f16 in the kernel), else f32
as 3xTF32. Tiles wholly below a tile's first row's position run unmasked; those crossing the diagonal mask the
keys past each row's position. Widths that are not powers of two are padded to one and masked. The output
lands where the absorbed form's value half writes: each row's heads' `vd` values, the input of `attn_output`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.attention.prefill import F32_PRECISION, softmax_fold
from fuselane.lanes.cuda.triton.attention.splits import LOG2E, interpreted

# Query rows a program takes (a warpgroup MMA's M), and cached rows a tile: f16 operands take 64, f32's
# three-pass products 32 (as the chunk attention's tiles).
BLOCK_M = 64
BLOCK_N_F16 = 64
BLOCK_N_F32 = 32
WARPS = 8
DOT_MIN = 16  # tl.dot's smallest side


@triton.jit
def _dot(a, b, F16_OPS: tl.constexpr):
    if F16_OPS:
        y = tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        y = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=F32_PRECISION)
    return y


@triton.jit
def _tile(qn, qr, run_max, run_sum, acc, keys, k_pitch, kc, kc_pitch, values, v_pitch, h, n0, end, qpos,
          scale_log2e, NOPE: tl.constexpr, ROPE: tl.constexpr, VD: tl.constexpr, LORA: tl.constexpr,
          N_P2: tl.constexpr, R_P2: tl.constexpr, V_P2: tl.constexpr, BLOCK_N: tl.constexpr,
          F16_OPS: tl.constexpr, CAUSAL: tl.constexpr):  # fmt: skip
    """One tile of cached rows folded into the rows' running maximum, sum and weighted values."""
    n = n0 + tl.arange(0, BLOCK_N)
    live = (n < end)[:, None]
    dn, dr, dv = tl.arange(0, N_P2), tl.arange(0, R_P2), tl.arange(0, V_P2)
    rows = n.to(tl.int64)[:, None]
    kn = tl.load(keys + rows * k_pitch + h * NOPE + dn[None, :], mask=live & (dn < NOPE)[None, :], other=0.0)
    kr = tl.load(kc + rows * kc_pitch + LORA + dr[None, :], mask=live & (dr < ROPE)[None, :], other=0.0)
    v = tl.load(values + rows * v_pitch + h * VD + dv[None, :], mask=live & (dv < VD)[None, :], other=0.0)
    s = (_dot(qn, tl.trans(kn), F16_OPS) + _dot(qr, tl.trans(kr), F16_OPS)) * scale_log2e
    new_max, alpha, p, run_sum = softmax_fold(s, n, qpos, run_max, run_sum, CAUSAL)
    return new_max, run_sum, acc * alpha[:, None] + _dot(p, v, F16_OPS)


@triton.jit
def _expanded_kernel(
    q, q_row, q_head, qp, qp_row, keys, k_pitch, kc, kc_pitch, values, v_pitch, pos, out, rows, scale_log2e,
    HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, VD: tl.constexpr, LORA: tl.constexpr,
    N_P2: tl.constexpr, R_P2: tl.constexpr, V_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    F16_OPS: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    mt, h = tl.program_id(0), tl.program_id(1)
    p0 = tl.load(pos)
    mi = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = mi < rows
    row = tl.minimum(mi, rows - 1).to(tl.int64)  # rows past the chunk compute its last row's (never stored)
    dn, dr, dv = tl.arange(0, N_P2), tl.arange(0, R_P2), tl.arange(0, V_P2)
    qn = tl.load(q + row[:, None] * q_row + h * q_head + dn[None, :], mask=(dn < NOPE)[None, :], other=0.0)
    qr = tl.load(qp + row[:, None] * qp_row + h * ROPE + dr[None, :], mask=(dr < ROPE)[None, :], other=0.0)
    if F16_OPS:  # rounded once, not at every tile
        qn = qn.to(tl.float16)
        qr = qr.to(tl.float16)
    qpos = p0 + row
    first = mt * BLOCK_M
    last = tl.minimum(first + BLOCK_M - 1, rows - 1)
    full = (p0 + first + 1) // BLOCK_N * BLOCK_N  # keys below it every row of the tile sees
    end = p0 + last + 1
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_P2], tl.float32)
    if INTERPRETED:  # the interpreter takes no loop bound read from the device (`attention.splits.interpreted`)
        n0 = full * 0
        while n0 < full:
            run_max, run_sum, acc = _tile(
                qn, qr, run_max, run_sum, acc, keys, k_pitch, kc, kc_pitch, values, v_pitch, h, n0, end, qpos,
                scale_log2e, NOPE, ROPE, VD, LORA, N_P2, R_P2, V_P2, BLOCK_N, F16_OPS, False,
            )  # fmt: skip
            n0 += BLOCK_N
        while n0 < end:
            run_max, run_sum, acc = _tile(
                qn, qr, run_max, run_sum, acc, keys, k_pitch, kc, kc_pitch, values, v_pitch, h, n0, end, qpos,
                scale_log2e, NOPE, ROPE, VD, LORA, N_P2, R_P2, V_P2, BLOCK_N, F16_OPS, True,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(0, full, BLOCK_N):
            run_max, run_sum, acc = _tile(
                qn, qr, run_max, run_sum, acc, keys, k_pitch, kc, kc_pitch, values, v_pitch, h, n0, end, qpos,
                scale_log2e, NOPE, ROPE, VD, LORA, N_P2, R_P2, V_P2, BLOCK_N, F16_OPS, False,
            )  # fmt: skip
        for n0 in range(full, end, BLOCK_N):
            run_max, run_sum, acc = _tile(
                qn, qr, run_max, run_sum, acc, keys, k_pitch, kc, kc_pitch, values, v_pitch, h, n0, end, qpos,
                scale_log2e, NOPE, ROPE, VD, LORA, N_P2, R_P2, V_P2, BLOCK_N, F16_OPS, True,
            )  # fmt: skip
    o = acc / run_sum[:, None]
    dst = out + row[:, None] * (HEADS * VD) + h * VD + dv[None, :]
    tl.store(dst, o.to(out.dtype.element_ty), mask=valid[:, None] & (dv < VD)[None, :])


def _p2(n: int) -> int:
    return max(DOT_MIN, triton.next_power_of_2(n))


def expanded_attention(
    q: torch.Tensor, q_row: int, q_head: int, qp: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    kc: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, *,
    rows: int, heads: int, nope: int, rope: int, vd: int, lora: int, scale: float, f16_ops: bool,
) -> torch.Tensor:  # fmt: skip
    """out (rows, heads * vd) = causal attention of query rows pos[0]..pos[0] + rows - 1: head h of row i
    takes its `nope` values of `q` (rows `q_row`, heads `q_head` apart) and its `rope` values of `qp` (rows,
    heads * rope, any row pitch) against each cached row's `keys` (len, heads * nope) and the rotated key at
    `lora` of the cache `kc` (len, >= lora + rope), weighting `values` (len, heads * vd). `f16_ops`: f16
    operands (else 3xTF32). Returns `out`."""
    if not (keys.is_contiguous() and values.is_contiguous() and out.is_contiguous()):
        raise ValueError("expanded_attention: keys, values and out contiguous")
    if kc.dim() != 2 or kc.stride(1) != 1 or kc.shape[1] < lora + rope or qp.stride(-1) != 1:
        raise ValueError("expanded_attention: a 2-D cache of unit-stride rows of at least lora + rope values")
    qp_row = qp.stride(0) if qp.dim() == 2 else heads * rope
    block_n = BLOCK_N_F16 if f16_ops else BLOCK_N_F32
    _expanded_kernel[(triton.cdiv(rows, BLOCK_M), heads)](
        q, q_row, q_head, qp, qp_row, keys, heads * nope, kc, kc.stride(0), values, heads * vd, pos, out, rows,
        scale * LOG2E, HEADS=heads, NOPE=nope, ROPE=rope, VD=vd, LORA=lora, N_P2=_p2(nope), R_P2=_p2(rope),
        V_P2=_p2(vd), BLOCK_M=BLOCK_M, BLOCK_N=block_n, F16_OPS=f16_ops, INTERPRETED=interpreted(),
        num_warps=WARPS, **pdl.options(),
    )  # fmt: skip
    return out
