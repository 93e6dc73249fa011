"""Causal grouped-query attention of a prefill chunk's rows on the tensor cores (FlashPrefill).

Query rows are packed with their group's heads (row-major over (row, head of the group)) into
tiles of `block_m`, so a tile of keys and values serves every head of its group; scores and the weighted sum
are `tl.dot`s (tensor cores on the GPU). The operands are f16 under the int8 numerics (their f16 tensor
cores: queries, keys, values and weights rounded to f16 in the kernel) and f32 otherwise, multiplied as
3xTF32 on the tensor cores (`F32_DOT_PRECISION`: within a few 2^-20 of f32 a product, where plain TF32 would
round to 2^-11; the dequantized numerics keep attention in f32). Key tiles wholly below a tile's first row's
position run unmasked; only those crossing the diagonal apply the causal mask.

Softmax weights are computed as 2^(s * scale * log2 e - max), as in the decode kernels; `splits.py` has what they
read of the cache (`cache_pitch`) and of the interpreter (`interpreted`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import QK
from fuselane.lanes.cuda.triton import pdl, quant
from fuselane.lanes.cuda.triton.attention.splits import LOG2E, cache_pitch, interpreted

# Prefill tiles, by operand type, as compiled for sm_90 without spilling (f16) or nearly (f32):
# - f16: 64 query rows (a warpgroup MMA's M: four warps) by 64 keys, two stages: 168 registers, the next
#   key/value tile copied in (cp.async) while this one multiplies (wgmma);
# - f32: 64 by 32 keys, at 3xTF32 (below): three tensor-core passes hold each operand twice, and 64 keys spill.
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N_F16 = 64
PREFILL_BLOCK_N_F32 = 32
PREFILL_WARPS = 4
PREFILL_STAGES = 2
# f32 operands multiply as 3xTF32: each operand split into a TF32 head and a TF32 tail, three tensor-core
# products, each product within 3 * 2^-20 of its value (f32's own rounding is 2^-24, plain TF32's 2^-11).
# "ieee" (FMA dots on the CUDA cores) is exact f32 but spills kilobytes a thread at every tile tried.
F32_DOT_PRECISION = "tf32x3"
F32_PRECISION: tl.constexpr = tl.constexpr(F32_DOT_PRECISION)
# tl.dot's smallest side.
DOT_MIN = 16


@triton.jit
def softmax_fold(s, n, qpos, run_max, run_sum, CAUSAL: tl.constexpr):
    """A tile's base-2 scores `s` (query rows x keys `n`) folded into the rows' running maximum and sum: (the new
    maximum, the factor on what was summed before, the tile's weights, the new sum). CAUSAL masks keys past each
    query's position `qpos`."""
    if CAUSAL:
        s = tl.where(n[None, :] <= qpos[:, None], s, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(s, axis=1))
    alpha = tl.exp2(run_max - new_max)
    p = tl.exp2(s - new_max[:, None])
    return new_max, alpha, p, run_sum * alpha + tl.sum(p, axis=1)


@triton.jit
def _prefill_tile(
    q,
    run_max,
    run_sum,
    acc,
    k_ptr,
    v_ptr,
    kvh,
    n0,
    end,
    qpos,
    k_pitch,
    v_pitch,
    scale_log2e,
    HD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F16_OPS: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """One key/value tile of the online softmax; CAUSAL masks keys past each query's position. A head of HD
    values is a tile of D (a power of two), its padding zero."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    k_addr = k_ptr + n[:, None].to(tl.int64) * k_pitch + kvh * HD + d[None, :]
    v_addr = v_ptr + n[:, None].to(tl.int64) * v_pitch + kvh * HD + d[None, :]
    if CAUSAL:
        k = tl.load(k_addr, mask=(n < end)[:, None] & (d < HD)[None, :], other=0.0)
        v = tl.load(v_addr, mask=(n < end)[:, None] & (d < HD)[None, :], other=0.0)
    elif D == HD:
        k = tl.load(k_addr)
        v = tl.load(v_addr)
    else:
        k = tl.load(k_addr, mask=(d < HD)[None, :], other=0.0)
        v = tl.load(v_addr, mask=(d < HD)[None, :], other=0.0)
    if F16_OPS:
        s = tl.dot(q, tl.trans(k.to(tl.float16)))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=F32_PRECISION)
    new_max, alpha, p, run_sum = softmax_fold(s * scale_log2e, n, qpos, run_max, run_sum, CAUSAL)
    if F16_OPS:
        pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
    else:
        pv = tl.dot(p, v.to(tl.float32), input_precision=F32_PRECISION)
    return new_max, run_sum, acc * alpha[:, None] + pv


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    out_ptr,
    q_pitch,
    k_pitch,
    v_pitch,
    out_pitch,
    rows,
    scale_log2e,
    oq,
    od,
    os_,
    q8_cols,
    gate_ptr,
    gate_pitch,
    GROUP: tl.constexpr,
    HD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F16_OPS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    Q8OUT: tl.constexpr,
    GATED: tl.constexpr = False,
    GATE_HP: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    pdl.begin(PDL)
    mt = tl.program_id(0)
    kvh = tl.program_id(1)
    pos = tl.load(pos_ptr)
    # tile row mi is query row mi // GROUP's head kvh * GROUP + mi % GROUP; rows past the chunk compute a
    # copy of its last row (finite, never stored)
    mi = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = mi < rows * GROUP
    row = tl.minimum(mi // GROUP, rows - 1)
    head = kvh * GROUP + mi % GROUP
    d = tl.arange(0, D)
    q = tl.load(q_ptr + row[:, None].to(tl.int64) * q_pitch + head[:, None] * HD + d[None, :],
                mask=(d < HD)[None, :], other=0.0)  # fmt: skip
    q = q.to(tl.float16) if F16_OPS else q.to(tl.float32)
    qpos = pos + row
    first = tl.minimum(mt * BLOCK_M // GROUP, rows - 1)
    last = tl.minimum((mt * BLOCK_M + BLOCK_M - 1) // GROUP, rows - 1)
    # keys below `full` every row of the tile sees; the tiles from there to `end` cross the diagonal
    full = (pos + first + 1) // BLOCK_N * BLOCK_N
    end = pos + last + 1
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if INTERPRETED:  # the same tiles in the same order (see INTERPRETED)
        n0 = full * 0
        while n0 < full:
            run_max, run_sum, acc = _prefill_tile(
                q, run_max, run_sum, acc, k_ptr, v_ptr, kvh, n0, end, qpos, k_pitch, v_pitch, scale_log2e,
                HD, D, BLOCK_N, F16_OPS, False,
            )  # fmt: skip
            n0 += BLOCK_N
        while n0 < end:
            run_max, run_sum, acc = _prefill_tile(
                q, run_max, run_sum, acc, k_ptr, v_ptr, kvh, n0, end, qpos, k_pitch, v_pitch, scale_log2e,
                HD, D, BLOCK_N, F16_OPS, True,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(0, full, BLOCK_N):
            run_max, run_sum, acc = _prefill_tile(
                q, run_max, run_sum, acc, k_ptr, v_ptr, kvh, n0, end, qpos, k_pitch, v_pitch, scale_log2e,
                HD, D, BLOCK_N, F16_OPS, False,
            )  # fmt: skip
        for n0 in range(full, end, BLOCK_N):
            run_max, run_sum, acc = _prefill_tile(
                q, run_max, run_sum, acc, k_ptr, v_ptr, kvh, n0, end, qpos, k_pitch, v_pitch, scale_log2e,
                HD, D, BLOCK_N, F16_OPS, True,
            )  # fmt: skip
    out = acc / run_sum[:, None]
    if GATED:  # AttnOutputGate: each head's output times the sigmoid of its gate
        z = tl.load(gate_ptr + row[:, None].to(tl.int64) * gate_pitch + head[:, None] * GATE_HP + d[None, :],
                    mask=(d < HD)[None, :], other=0.0)  # fmt: skip
        out = out * tl.sigmoid(z.to(tl.float32))
    dst = out_ptr + row[:, None].to(tl.int64) * out_pitch + head[:, None] * HD + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (d < HD)[None, :])
    if Q8OUT:  # the output's int8 form too: a head's values are whole 32-value blocks of its row
        _store_q8(out, row, head, valid, oq, od, os_, q8_cols, HD, D, BLOCK_M)


@triton.jit
def _store_q8(out, row, head, valid, oq, od, os_, q8_cols, HD: tl.constexpr, D: tl.constexpr,
              BLOCK_M: tl.constexpr):  # fmt: skip
    """Quantize each tile row's head (HD values, HD / 32 blocks, in a tile of D: the padding's blocks are not
    stored) into the Q8Acts of rows of q8_cols values."""
    NB: tl.constexpr = HD // quant.QB_C
    NB_P: tl.constexpr = D // quant.QB_C
    codes, d, sums = quant.quantize_block(tl.reshape(out, [BLOCK_M * NB_P, quant.QB_C]), quant.QB_C)
    at = tl.arange(0, NB_P)[None, :]
    blk = tl.reshape(row[:, None].to(tl.int64) * (q8_cols // quant.QB_C) + head[:, None] * NB + at,
                     [BLOCK_M * NB_P])  # fmt: skip
    live = tl.reshape(valid[:, None] & (at < NB), [BLOCK_M * NB_P])
    tl.store(oq + blk[:, None] * quant.QB_C + tl.arange(0, quant.QB_C)[None, :], codes, mask=live[:, None])
    tl.store(od + blk, d, mask=live)
    tl.store(os_ + blk[:, None] * 2 + tl.arange(0, 2)[None, :], sums, mask=live[:, None])


def flash_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    out: torch.Tensor,
    *,
    rows: int,
    heads: int,
    kv_heads: int,
    hd: int,
    scale: float,
    block_m: int = PREFILL_BLOCK_M,
    block_n: int | None = None,
    f16_ops: bool | None = None,
    out_q8: quant.Q8Acts | None = None,
    gate: torch.Tensor | None = None,
) -> None:
    """FlashPrefill: out (rows, heads * hd) = causal GQA of `rows` query rows `q` (rows, heads * hd, any row
    pitch) at positions pos[0]..pos[0] + rows - 1 over cache rows 0..pos[0] + rows - 1.

    One launch of (query tiles, kv_heads) blocks; each tile packs `block_m` (row, head-of-group) pairs.
    `f16_ops`: multiply on the f16 tensor cores, the operands rounded to f16 in the kernel (the int8 numerics'
    attention, `CudaShim.attention`); 3xTF32 dots otherwise; None: f16 where `q` is. A head of `hd` values (any
    even width) is a tile of the power of two at least as wide and at least 16 (tl.dot's smallest side), its
    padding zero; `block_m` and `block_n` are kernel facts, parameters only for tests. With
    `out_q8` (AttnOutputQuant: heads of whole 32-value blocks) the launch also writes `out` quantized, as
    `quant.quantize` would, for a product on the int8 tensor cores. `gate` (rows, heads, >= hd; AttnOutputGate)
    multiplies each head's output by its sigmoid in the store.
    """
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} key/value heads evenly")
    if q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("flash_prefill: the query's and the output's values must be unit-stride")
    group = heads // kv_heads
    if out_q8 is not None:
        if hd % QK:
            raise ValueError(f"flash_prefill quantizes heads of whole {QK}-value blocks, not {hd}")
        quant.check_acts(out_q8, heads * hd, rows)
    q8 = out_q8 if out_q8 is not None else (out, out, out)
    if f16_ops is None:
        f16_ops = q.dtype == torch.float16
    if block_n is None:
        block_n = PREFILL_BLOCK_N_F16 if f16_ops else PREFILL_BLOCK_N_F32
    grid = (triton.cdiv(rows * group, block_m), kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        pos,
        out,
        q.stride(0),
        cache_pitch(k_cache, kv_heads, hd, "k_cache"),
        cache_pitch(v_cache, kv_heads, hd, "v_cache"),
        out.stride(0),
        rows,
        scale * LOG2E,
        *q8,
        heads * hd,
        gate if gate is not None else out,
        gate.stride(0) if gate is not None else 0,
        GROUP=group,
        HD=hd,
        D=max(DOT_MIN, triton.next_power_of_2(hd)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        F16_OPS=f16_ops,
        INTERPRETED=interpreted(),
        Q8OUT=out_q8 is not None,
        GATED=gate is not None,
        GATE_HP=gate.stride(1) if gate is not None else 0,
        num_warps=PREFILL_WARPS,
        num_stages=PREFILL_STAGES,
        **pdl.options(),
    )
