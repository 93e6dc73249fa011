"""Launches past `gemv`'s plain products, over the same checkpoint bytes: a decode projection whose last block
norms the row it wrote (GemvNormEpilogue), and the whole-matrix decode the prefill GEMMs' dense weights
come from.

`gemv_add_norm` is one launch where the plain path takes two (`gemv` with a residual, then `norm.rms_norm`):
every program writes its tile of sum_out = x @ W^T + residual exactly as `gemv` does, then counts itself
done on a device counter; the program that finds itself last reads the whole sum_out row back, which every
other program has finished writing, and norms it. A row the block holds (at most `kernels.NORM_HELD_A_THREAD`
values a thread, `kernels.block_holds_its_norm`) stays in its registers between the sum of squares and the
scaling; a wider one (a 14B's 5,120 values in four warps) is walked in chunks of that size twice, read back
from L2 each time, as `fast_norm`'s and the int8 GEMV's last programs do (`kernels.norm_walked_in_chunks`).

`dequantize` decodes an (n, k) matrix of checkpoint bytes into f16 or f32 values on the device, each value
the f32 `fuselane.gguf.dequant` gives, bit for bit (rounded once to f16 for an f16 result), with the bit
facts and helpers of `formats`. A 4096 x 12288 Q4_K matrix is 28 MB read and 100 MB written (f16): tens
of microseconds of an H200's HBM time, where a decode on the host and its copy up take far longer.

`gemv_add_norm`'s memory ordering is not tested by Triton's interpreter, which runs programs one after another: the
comments at the counter say why the GPU's is right.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import LAYOUTS, QK, Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes, stored_span_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.formats import dot_rows
from fuselane.lanes.cuda.triton.gemv.layout import (
    BIT,
    CRUMB,
    F32_TWO_23_BITS,
    FMT_BF16,
    FMT_F16,
    FMT_F32,
    FMT_IQ4_NL,
    FMT_IQ4_XS,
    FMT_MXFP4,
    FMT_Q2_K,
    FMT_Q3_K,
    FMT_Q4_0,
    FMT_Q4_1,
    FMT_Q4_K,
    FMT_Q5_0,
    FMT_Q5_1,
    FMT_Q5_K,
    FMT_Q6_K,
    FMT_Q8_0,
    HALF_QK,
    HALF_WORD_BITS,
    K_PAIRS,
    NIBBLE,
    NIBBLE_BITS,
    NO_FIELD,
    Q4_0_QS,
    Q4_1_D,
    Q4_1_M,
    Q4_1_QS,
    Q4_BIAS,
    Q4_K_D,
    Q4_K_DMIN,
    Q4_K_QS,
    Q4_K_SCALES,
    Q5_0_D,
    Q5_0_QH,
    Q5_0_QS,
    Q5_1_D,
    Q5_1_M,
    Q5_1_QH,
    Q5_1_QS,
    Q5_BIAS,
    Q5_K_D,
    Q5_K_DMIN,
    Q5_K_QH,
    Q5_K_QS,
    Q5_K_SCALES,
    Q6_BIAS,
    Q6_HALF,
    Q6_HALF_RUNS,
    Q6_K_QH,
    Q6_K_QL,
    Q6_K_SCALES,
    Q6_QH_HALF,
    Q6_QL_HALF,
    Q6_RUN_SCALES,
    Q6_RUNS,
    Q6_SUB,
    Q8_0_QS,
    QK_C,
    block_d,
    in_two_23,
    k_scale_min,
    load_f16,
    q6_k_d,
)
from fuselane.lanes.cuda.triton.gemv.low_bits import (
    iq4_nl_values,
    iq4_xs_values,
    mxfp4_values,
    q2_k_values,
    q3_k_values,
)
from fuselane.lanes.cuda.triton.gemv.rows import (
    check_rows,
    check_x,
    largest_pow2_dividing,
    plan,
    stages,
    store_rows,
    tile,
)

# Result types of `dequantize`: the prefill GEMMs' f16 operands, or f32 (the reference's own values).
DEQUANT_OUT = (torch.float16, torch.float32)
# The done-counter of `gemv_add_norm`: a 32-bit atomic, far past any launch's programs.
COUNTER_DTYPE = torch.int32


# --- the product with its norm ----------------------------------------------------------------------------------


@triton.jit
def _gemv_add_norm_kernel(
    x,
    w,
    n,
    res,
    sum_out,
    norm_w,
    out,
    counter,
    eps,
    FMT: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    STEPS: tl.constexpr,
    UNITS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    NORM_CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past n read the last row (no masked loads in the k loop); the store drops them
    w_rows = w + tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    one = tl.arange(0, 1)  # the step's one row of x
    y = dot_rows(w_rows, x + one, FMT, STEPS, UNITS, SPLIT, 1, BLOCK_N, STAGES)
    # gemv's own epilogue: + residual (which may be sum_out itself: each program reads only the rows it writes)
    store_rows(y, rows, n, one, 1, sum_out, 0, sum_out, sum_out, res, 0, False, False, True)

    # Why the last program sees every program's sum_out, on the GPU:
    # - the block's barrier orders all its threads' stores before the counter's atomic, which one thread does
    #   (Triton lowers an atomic on a scalar pointer to one thread, its result broadcast through shared memory);
    # - that atomic is a release at gpu scope (acq_rel): the stores it orders are visible at gpu scope (in L2,
    #   as L1 writes through) to whoever acquires the counter's later value;
    # - the last program's atomic reads the value every other program's release wrote (a read-modify-write
    #   always reads the latest value in the counter's order), and is an acquire: everything those programs
    #   stored happens-before it, and the broadcast's barrier orders it before every thread's loads below;
    # - those loads read L2 (.cg), never this SM's L1: a line of sum_out may sit there stale, loaded as another
    #   tile's residual by an earlier program on this SM (sum_out may be the residual's buffer), and weak loads
    #   could hit it. This is CUTLASS's semaphore and `attention.flash_decode`'s merge.
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        offs = tl.arange(0, NORM_BLOCK)
        if NORM_CHUNKS == 1:  # the row held in registers
            mask = offs < n
            s = tl.load(sum_out + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            # the arithmetic of `norm.rms_norm`: r = 1 / sqrt(mean(s^2) + eps), out = (s * r) * w
            r = tl.rsqrt(tl.sum(s * s, axis=0) / n + eps)
            y_norm = s * r * tl.load(norm_w + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out + offs, y_norm.to(out.dtype.element_ty), mask=mask)
        else:  # walked in chunks: the squares summed a chunk at a time, then each chunk read again and scaled
            squares = tl.zeros([NORM_BLOCK], tl.float32)
            for c in range(NORM_CHUNKS):
                at = c * NORM_BLOCK + offs
                s = tl.load(sum_out + at, mask=at < n, other=0.0, cache_modifier=".cg").to(tl.float32)
                squares += s * s
            r = tl.rsqrt(tl.sum(squares, axis=0) / n + eps)
            for c in range(NORM_CHUNKS):
                at = c * NORM_BLOCK + offs
                s = tl.load(sum_out + at, mask=at < n, other=0.0, cache_modifier=".cg").to(tl.float32)
                y_norm = s * r * tl.load(norm_w + at, mask=at < n, other=0.0).to(tl.float32)
                tl.store(out + at, y_norm.to(out.dtype.element_ty), mask=at < n)
        # every other program has counted already: re-armed for the next launch (a CUDA graph's replay), which
        # stream order puts after this one's end, so no ordering is asked of the store
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def norm_tile(fmt: Format, n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of `gemv_add_norm`: the product's tile for one row (`gemv`'s), except that a Q8_0
    projection's block is at least the norm's own (`kernels.norm_threads`), as the shim reads it."""
    fmt = Format(fmt)
    block_n, warps = tile(fmt, n, k, 1)
    if fmt is Format.Q8_0:
        # a row a warp, so more warps only widen the tile; the k loop's plan is the same a row
        warps = max(warps, kernels.norm_threads(n) // kernels.WARP)
        block_n = kernels.rows_a_warp(fmt, n, k, 1) * warps
    return block_n, warps


def gemv_add_norm_counter(device: torch.device | str) -> torch.Tensor:
    """The counter `gemv_add_norm` takes: one int32 at zero on `device`, allocated once (before a CUDA graph is
    captured) and left at zero by every launch. Launches that may run at once (other streams) need their own."""
    return torch.zeros(1, dtype=COUNTER_DTYPE, device=device)


def check_row(t: torch.Tensor, n: int, name: str) -> None:
    if t.numel() != n or not t.is_contiguous() or not t.is_floating_point():
        raise ValueError(f"{name} must be a contiguous float tensor of {n} values (one row), got {tuple(t.shape)}")


def check_add_norm(residual, sum_out, norm_w, out, counter, n: int, device) -> None:
    """The operands an add + norm launch takes after its product: four rows of n values and its counter."""
    for t, name in ((residual, "residual"), (sum_out, "sum_out"), (norm_w, "norm_w"), (out, "out")):
        check_row(t, n, name)
    if counter.dtype != COUNTER_DTYPE or counter.numel() != 1 or counter.device != device:
        raise ValueError("counter must be one int32 on x's device (gemv_add_norm_counter)")


def gemv_add_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    fmt: Format,
    n: int,
    k: int,
    residual: torch.Tensor,
    sum_out: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    counter: torch.Tensor,
    *,
    norm_chunk: int | None = None,
) -> torch.Tensor:
    """One launch for a decode step's row: sum_out = x @ W^T + residual, then out = sum_out / sqrt(mean(sum_out^2)
    + eps) * norm_w, the norm done by the launch's last program over the sum_out it reads back; returns `out`.

    `x` is (1, k) or (k,), W the n x k checkpoint rows `w` in `fmt`; `residual`, `sum_out`, `norm_w` and `out`
    hold n values each, contiguous. `sum_out` may be `residual` (the residual stream updated in place);
    `out` and `x` must not overlap either. `counter` is `gemv_add_norm_counter`'s, at zero, and left at zero.
    A norm wider than the block holds (`kernels.block_holds_its_norm`) is walked in chunks of the most it holds
    (`norm_chunk`, a power of two, sets the chunk: tests).
    """
    fmt = Format(fmt)
    x2 = x.view(1, -1) if x.dim() == 1 else x
    if check_x(x2, k) != 1:
        raise ValueError(f"gemv_add_norm takes a decode step's one row of x, not {x2.shape[0]}")
    check_rows(w, fmt, n, k)
    check_add_norm(residual, sum_out, norm_w, out, counter, n, x.device)
    block_n, warps = norm_tile(fmt, n, k)
    held = warps * kernels.WARP * kernels.NORM_HELD_A_THREAD  # a power of two: the threads are
    chunk = min(triton.next_power_of_2(n), norm_chunk or held)
    steps, units, split = plan(fmt, k, block_n, warps, 1)
    _gemv_add_norm_kernel[(triton.cdiv(n, block_n),)](
        x2,
        w,
        n,
        residual,
        sum_out,
        norm_w,
        out,
        counter,
        float(eps),
        FMT=int(fmt),
        ROW_BYTES=stored_row_bytes(fmt, k),
        STEPS=steps,
        UNITS=units,
        SPLIT=split,
        BLOCK_N=block_n,
        STAGES=stages(fmt),
        NORM_BLOCK=chunk,
        NORM_CHUNKS=triton.cdiv(n, chunk),
        num_warps=warps,
        **pdl.options(),
    )
    return out


# --- the whole-matrix decode ------------------------------------------------------------------------------------


@triton.jit
def _nibble_values(blk, qd, t, D: tl.constexpr, M: tl.constexpr, QH: tl.constexpr, QS: tl.constexpr,
                   BIAS: tl.constexpr):  # fmt: skip
    """Q4_0 / Q4_1 / Q5_0 / Q5_1: value t < 16 is the low nibble of qs byte t, 16 + t its high nibble; the
    5-bit formats (QH >= 0) take bit t of the little-endian 32-bit qh as the fifth bit.
    value = d * (code - BIAS), plus the minimum m where M >= 0 (one rounding, as gguf's); d at D in the block,
    or at `qd` where D < 0 (Q4_0's, after the row's blocks)."""
    q = tl.load(blk + QS + (t % HALF_QK)[None, :]).to(tl.int32)
    code = (q >> ((t // HALF_QK) * NIBBLE_BITS)[None, :]) & NIBBLE
    if QH >= 0:
        qh_ptr = (blk + QH).to(tl.pointer_type(tl.uint16))
        qh = tl.load(qh_ptr).to(tl.int32) | (tl.load(qh_ptr + 1).to(tl.int32) << HALF_WORD_BITS)
        code |= ((qh >> t[None, :]) & BIT) << NIBBLE_BITS
    if D >= 0:
        d = load_f16(blk + D)
    else:
        d = load_f16(qd)
    v = d * in_two_23(code | F32_TWO_23_BITS, BIAS)
    if M >= 0:
        v += load_f16(blk + M)
    return v


@triton.jit
def _k_pair_values(blk, D: tl.constexpr, DMIN: tl.constexpr, SCALES: tl.constexpr, QH: tl.constexpr, QS: tl.constexpr):
    """Q4_K / Q5_K: sub-block s of 8 (values 32s .. 32s + 31 of t); sub-blocks 2g and 2g + 1 share the 32 qs
    bytes from 32g, the first in low nibbles; Q5_K (QH >= 0) takes bit s of qh byte i as value 32s + i's fifth.
    value = (d * scale) * code - dmin * min, every product exact, the difference rounded once. The tile is
    [U, sub-block, value of it], returned so (a reshape to [U, 256] costs a layout change through shared memory
    and twice the registers), so each sub-block's scale and min are unpacked once, not once a value."""
    s = tl.arange(0, 2 * K_PAIRS)
    i = tl.arange(0, QK_C)
    at = blk[:, :, None] + ((s // 2) * QK_C)[None, :, None] + i[None, None, :]  # [U, 8, 32]: the code's byte
    code = (tl.load(at + QS).to(tl.int32) >> ((s % 2) * NIBBLE_BITS)[None, :, None]) & NIBBLE
    if QH >= 0:
        qh = tl.load(blk[:, :, None] + QH + i[None, None, :]).to(tl.int32)
        code |= ((qh >> s[None, :, None]) & BIT) << NIBBLE_BITS
    sc, mn = k_scale_min(blk, SCALES, s)  # [U, 8]
    d_sc = (load_f16(blk + D) * sc.to(tl.float32))[:, :, None]
    dmin_mn = (load_f16(blk + DMIN) * mn.to(tl.float32))[:, :, None]
    return d_sc * in_two_23(code | F32_TWO_23_BITS, 0) - dmin_mn


@triton.jit
def _q6_k_values(blk, qd, t):
    """Q6_K: value r of half h (t = 128h + r) is nibble r // 64 of ql byte 64h + r % 64 under crumb r // 32 of
    qh byte 32h + r % 32; a signed 8-bit scale a sub-block of 16. value = (d * scale) * (code - 32), d at `qd`
    (after the row's blocks: `layout.block_d`)."""
    h, r = t // Q6_HALF, t % Q6_HALF
    ql = tl.load(blk + Q6_K_QL + (h * Q6_QL_HALF + r % Q6_QL_HALF)[None, :]).to(tl.int32)
    qh = tl.load(blk + Q6_K_QH + (h * Q6_QH_HALF + r % Q6_QH_HALF)[None, :]).to(tl.int32)
    code = ((ql >> ((r // Q6_QL_HALF) * NIBBLE_BITS)[None, :]) & NIBBLE) | (
        ((qh >> (2 * (r // Q6_QH_HALF))[None, :]) & CRUMB) << NIBBLE_BITS
    )
    sc = tl.load((blk + Q6_K_SCALES + (t // Q6_SUB)[None, :]).to(tl.pointer_type(tl.int8))).to(tl.float32)
    return (load_f16(qd) * sc) * in_two_23(code | F32_TWO_23_BITS, Q6_BIAS)


@triton.jit
def _q6_runs():
    """([8, 1, 1] run of 32 values, [1, 2, 16] value of the run): the axes of `_q6_k_tile`."""
    s = tl.arange(0, Q6_RUNS)[:, None, None]
    return s, tl.arange(0, Q6_RUN_SCALES)[None, :, None] * Q6_SUB + tl.arange(0, Q6_SUB)[None, None, :]


@triton.jit
def _q6_k_tile(blk, qd):
    """Q6_K units as their [U, run of 32, half of it, value of that] tile: `_q6_k_values`' values, each run s
    (values 32s ..) under crumb s % 4 of qh and nibble (s % 4) // 2 of ql, each half a run under one scale, so a
    thread unpacks a scale once for its 16 values, not once a value."""
    s, i = _q6_runs()
    h, q = s // Q6_HALF_RUNS, s % Q6_HALF_RUNS
    at = blk[:, :, None, None]
    ql = tl.load(at + Q6_K_QL + (h * Q6_QL_HALF + (q % 2) * QK_C + i)[None]).to(tl.int32)
    qh = tl.load(at + Q6_K_QH + (h * Q6_QH_HALF + i)[None]).to(tl.int32)
    code = ((ql >> ((q // 2) * NIBBLE_BITS)[None]) & NIBBLE) | (((qh >> (2 * q)[None]) & CRUMB) << NIBBLE_BITS)
    runs = (s * Q6_RUN_SCALES + tl.arange(0, Q6_RUN_SCALES)[None, :, None])[None]  # [1, 8, 2, 1]: a half-run's scale
    sc = tl.load((at + Q6_K_SCALES + runs).to(tl.pointer_type(tl.int8))).to(tl.float32)
    return (load_f16(qd)[:, :, None, None] * sc) * in_two_23(code | F32_TWO_23_BITS, Q6_BIAS)


@triton.jit
def _k_pair_tile(blk, FMT: tl.constexpr):
    """Q4_K / Q5_K units as their [U, sub-block, value of it] tile (see `_k_pair_values`)."""
    if FMT == FMT_Q4_K:
        v3 = _k_pair_values(blk, Q4_K_D, Q4_K_DMIN, Q4_K_SCALES, NO_FIELD, Q4_K_QS)
    else:
        v3 = _k_pair_values(blk, Q5_K_D, Q5_K_DMIN, Q5_K_SCALES, Q5_K_QH, Q5_K_QS)
    return v3


@triton.jit
def _flat_values(blk, qd, t, FMT: tl.constexpr):
    """[U, len(t)] f32 values t of the units `blk` of any other format (`qd`: their d's where kept after their
    row's blocks, `layout.block_d`): bit for bit gguf's."""
    if FMT == FMT_Q6_K:
        v = _q6_k_values(blk, qd, t)
    elif FMT == FMT_Q8_0:
        q = tl.load((blk + Q8_0_QS + t[None, :]).to(tl.pointer_type(tl.int8))).to(tl.float32)
        v = load_f16(qd) * q
    elif FMT == FMT_Q4_0:
        v = _nibble_values(blk, qd, t, NO_FIELD, NO_FIELD, NO_FIELD, Q4_0_QS, Q4_BIAS)
    elif FMT == FMT_Q4_1:
        v = _nibble_values(blk, qd, t, Q4_1_D, Q4_1_M, NO_FIELD, Q4_1_QS, 0)
    elif FMT == FMT_Q5_0:
        v = _nibble_values(blk, qd, t, Q5_0_D, NO_FIELD, Q5_0_QH, Q5_0_QS, Q5_BIAS)
    elif FMT == FMT_Q5_1:
        v = _nibble_values(blk, qd, t, Q5_1_D, Q5_1_M, Q5_1_QH, Q5_1_QS, 0)
    elif FMT == FMT_Q2_K:
        v = q2_k_values(blk, t[None, :])
    elif FMT == FMT_Q3_K:
        v = q3_k_values(blk, t[None, :])
    elif FMT == FMT_IQ4_NL:
        v = iq4_nl_values(blk, qd, t[None, :])
    elif FMT == FMT_MXFP4:
        v = mxfp4_values(blk, qd, t[None, :])
    elif FMT == FMT_IQ4_XS:
        v = iq4_xs_values(blk, qd, t[None, :])
    elif FMT == FMT_F32:
        v = tl.load(blk.to(tl.pointer_type(tl.float32)) + t[None, :])
    elif FMT == FMT_F16:
        v = tl.load(blk.to(tl.pointer_type(tl.float16)) + t[None, :]).to(tl.float32)
    else:
        tl.static_assert(FMT == FMT_BF16, "no decode for this format")
        # bf16 is the top half of an f32: shifting it up is exact, NaN payloads included
        bits = tl.load(blk.to(tl.pointer_type(tl.uint16)) + t[None, :]).to(tl.int32)
        v = (bits << HALF_WORD_BITS).to(tl.float32, bitcast=True)
    return v


@triton.jit
def _dequant_kernel(
    w,
    out,
    units,
    units_a_row,
    pitch,
    FMT: tl.constexpr,
    VALUES: tl.constexpr,
    NBYTES: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    UNITS: tl.constexpr,
    PDL: tl.constexpr,
):
    # a program decodes UNITS whole units (blocks, or runs of VALUES float values) of the flat tensor
    pdl.begin(PDL)
    u = tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS)
    keep = u < units
    # units past the end decode the last one (no masked loads); the store drops them
    last = tl.minimum(u, units - 1)
    row, unit = (w + (last // units_a_row) * ROW_BYTES)[:, None], (last % units_a_row)[:, None]
    blk = row + unit * NBYTES
    t = tl.arange(0, VALUES)
    first = out + (u // units_a_row) * pitch + (u % units_a_row) * VALUES  # [U]: each unit's first value
    if (FMT == FMT_Q4_K) | (FMT == FMT_Q5_K):
        v3 = _k_pair_tile(blk, FMT)
        at = tl.arange(0, 2 * K_PAIRS)[None, :, None] * QK_C + tl.arange(0, QK_C)[None, None, :]
        tl.store(first[:, None, None] + at, v3.to(out.dtype.element_ty), mask=keep[:, None, None])
    elif FMT == FMT_Q6_K:
        v4 = _q6_k_tile(blk, q6_k_d(row, unit, units_a_row))
        s, i = _q6_runs()
        at = (s * QK_C + i)[None]
        tl.store(first[:, None, None, None] + at, v4.to(out.dtype.element_ty), mask=keep[:, None, None, None])
    else:
        v = _flat_values(blk, block_d(row, unit, FMT, ROW_BYTES), t, FMT)
        # an f16 result is the f32 value rounded once, to nearest even (as NumPy's astype rounds)
        tl.store(first[:, None] + t[None, :], v.to(out.dtype.element_ty), mask=keep[:, None])


@triton.jit
def unit_values(blk, qd, FMT: tl.constexpr, VALUES: tl.constexpr):
    """[U, VALUES] f32: the values of the U units `blk` ([U, 1] pointers to each unit's first byte; `qd` their
    d's where the format keeps them apart, `layout.block_d`) in `FMT`, each the f32 `fuselane.gguf.dequant`
    gives, bit for bit (for the prefill GEMM's tiles; a K-quant's [U, 8, 32] tile is reshaped here, where the
    GEMM stages it through shared memory anyway)."""
    if (FMT == FMT_Q4_K) | (FMT == FMT_Q5_K):
        v = tl.reshape(_k_pair_tile(blk, FMT), [blk.shape[0], VALUES])
    else:
        v = _flat_values(blk, qd, tl.arange(0, VALUES), FMT)
    return v


def decode_unit(fmt: Format, k: int) -> int:
    """Values a unit of the decode: a block of a quantized format; a float format's run of up to 32 values,
    a power of two dividing the row (a float row is any length)."""
    if LAYOUTS[fmt].values > 1:
        return LAYOUTS[fmt].values
    return largest_pow2_dividing(k, QK)


def dequantize(
    w: torch.Tensor, fmt: Format, n: int, k: int, out: torch.Tensor, *, values_warps: tuple[int, int] | None = None
) -> torch.Tensor:
    """out (n, k) = the values of the n x k checkpoint rows `w` (1-D uint8, the GGUF tensor's bytes) in `fmt`,
    decoded on the device; returns `out`.

    `out` is an f16 or f32 2-D tensor of unit column stride, rows at any pitch. Every value is the f32
    `fuselane.gguf.dequant.dequantize` gives, bit for bit; an f16 `out` holds it rounded to nearest even.
    One launch, any format `gemv` takes, in the format's tile (`kernels.dequant_tile`: values a program,
    warps); `values_warps` overrides it only for the sweep that measures them (`benchmarks/dequant_sweep.py`).
    A grid or ternary format's matrix is decoded by its own kernel (`grid.decode`).
    """
    fmt = Format(fmt)
    if fmt in kernels.GRID_GEMV_FORMATS:
        from fuselane.lanes.cuda.triton.grid.decode import dequantize_grid

        return dequantize_grid(w, fmt, n, k, out)
    if fmt not in kernels.DEQUANT_FORMATS:
        raise ValueError(f"no device decode for {fmt.name}")
    check_rows(w, fmt, n, k)
    if out.dtype not in DEQUANT_OUT or out.dim() != 2 or tuple(out.shape) != (n, k) or out.stride(1) != 1:
        raise ValueError(f"out must be an f16 or f32 ({n}, {k}) tensor with unit column stride")
    values = decode_unit(fmt, k)
    units_a_row = k // values
    units = n * units_a_row
    if units == 0:
        return out
    program_values, warps = values_warps or kernels.dequant_tile(fmt)
    per_program = max(1, program_values // values)
    _dequant_kernel[(triton.cdiv(units, per_program),)](
        w,
        out,
        units,
        units_a_row,
        out.stride(0),
        FMT=int(fmt),
        VALUES=values,
        NBYTES=stored_span_bytes(fmt, values),
        ROW_BYTES=stored_row_bytes(fmt, k),
        UNITS=per_program,
        num_warps=warps,
        **pdl.options(),
    )
    return out
