"""Decode products by checkpoint rows: y (m, n) = x (m, k) @ W^T, W dequantized in the kernel.

A decode step's products read every weight once and do little arithmetic with it, so they run at the speed
the weights stream from memory. These kernels keep W as the checkpoint's bytes (a 1-D uint8 tensor holding
exactly the GGUF tensor: `n` rows of `k` values in whole blocks of the format) and decode it in registers,
block by block, with f32 sums: no dequantized copy is ever written or read.

Launch shape: a program takes a tile of BLOCK_N output rows for all m <= `kernels.GEMV_ROWS` input rows and
walks k in steps of whole blocks (`formats`). BLOCK_N and the warps a program come from the lane's
kernel facts: `kernels.rows_a_warp` rows a warp (four, eight lanes a row, for a wide product in a block
format met one row at a time; one, 32 lanes, otherwise) times a block of four or eight warps, so the shim's
promises (a part's rows whole warps of rows) are the launches' shapes. A batch's m past GEMV_ROWS runs in
tiles of GEMV_ROWS rows on the grid's second axis, each tile re-reading the weights (mostly from L2):
correct, but the tensor-core GEMM is the fast path there.

Bandwidth (an H200 reads ~4.8 TB/s, ~18 bytes a clock a SM): the weights are read once, each thread taking
whole runs of a block's bytes, a warp's lanes adjacent runs of a row, so every 32-byte sector is used whole.
What limits a 4-bit format is issue rate, not memory: at f32 (the `dequant` activations) every value costs a
decode, a float conversion and two FMAs. Compiled for sm_90 (Triton 3.6's ptxas), the k loop issues about
6.8 instructions a value for Q4_K, 7.8 for Q8_0, 9.7 for Q6_K, 11.5 for Q5_0 and 3.9 for F16, no spills;
at 128 instructions a clock a SM that is ~60 % of the HBM rate for Q4_K, ~70 % for Q8_0, ~45 % for Q6_K and
Q5_0, the full rate for F16. (The int8 activations' dp4a kernels are the lane's path past that.)

Three launchers, each one launch, none allocating:
- `gemv`: one product, with its bias, a residual added, or landing in a row of a table (a KV cache) at a
  position read on the device, so a captured CUDA graph replays at a new position;
- `gemv_parts`: up to `kernels.GEMM_PARTS` products of one format, or a step's of two, reading one activation
  (a layer's q, k and v), programs mapped to parts by their cumulative tiles;
- `gemv_gate_up_glu`: a gate and an up product with SwiGLU in the epilogue.
`epilogue` builds on these: `gemv_add_norm` (a step's projection plus residual whose last program norms
the row, GemvNormEpilogue in one launch) and `dequantize` (a whole matrix decoded on the device).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes, stored_span_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.formats import SLOTS, dot_rows
from fuselane.lanes.cuda.triton.gemv.parts import (
    Part,
    PartArgs,
    check_bias,
    check_rows,
    pack_parts,
    part_formats,
    part_out,
)

# The most f32 partial sums a thread keeps for its m rows' slot values: a step's slot is cut finer as m grows
# so that m times the values a thread holds stays within it. At 64 the sm_90 build needs at most 128
# registers at m = 1 (four 128-thread blocks a SM) and ~165 at m = 2..8, with no spills.
ACC_VALUES = 64

# Steps the k loop keeps in flight where its loads can go asynchronously (Triton's software pipeliner,
# `tl.range(num_stages=...)`, staging through shared memory with cp.async): one decoded while two stream in.
# A SM needs ~25 KB of loads in flight to cover HBM latency on an H200 (4.8 TB/s x ~0.7 us / 132 SMs); a Q4_K
# step of a 16-row tile is 4.6 KB, and a 4096-row product has ~2 programs a SM.
GEMV_STAGES = 3
# cp.async moves 4, 8 or 16 bytes from an address so aligned: a format whose units are whole 16-byte lines
# (Q4_K, Q5_K, the floats; Q3_K and the split formats as the lane stores them, `run/stored.py`) pipelines; the others'
# 2-byte-aligned blocks (Q5_0's 22 bytes, ...) cannot, and run one step at a time, their latency covered by
# occupancy (sm_90 SASS of Q8_0 and Q6_K in the file's 34- and 210-byte blocks had ~5 % fewer instructions a
# value unpipelined: the pipeliner's shared-memory staging bought them nothing).
ASYNC_ALIGN = 16


def stages(fmt: Format) -> int:
    """Pipeline stages of a format's k loop: GEMV_STAGES where every unit starts 16-byte aligned, else 1."""
    unit_bytes = stored_span_bytes(fmt, SLOTS[fmt].unit)
    return GEMV_STAGES if unit_bytes % ASYNC_ALIGN == 0 else 1


# --- kernels -----------------------------------------------------------------------------------------------------


@triton.jit
def _pick(part, a0, a1, a2, a3, PARTS: tl.constexpr):
    """Argument `part` of a0..a3 (a scalar select; parts past PARTS are never picked)."""
    v = a0
    if PARTS > 1:
        v = tl.where(part == 1, a1, v)
    if PARTS > 2:
        v = tl.where(part == 2, a2, v)
    if PARTS > 3:
        v = tl.where(part == 3, a3, v)
    return v


@triton.jit
def store_rows(
    y,
    rows,
    n,
    mi,
    m,
    out,
    pitch,
    bias,
    pos,
    res,
    res_pitch,
    HAS_BIAS: tl.constexpr,
    AT_ROW: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    """The epilogue: + bias, + residual, stored at row mi (or pos[0] + mi) of `out`; rows past m or n dropped."""
    keep = rows < n
    mask = (mi < m)[:, None] & keep[None, :]
    if HAS_BIAS:
        y += tl.load(bias + rows, mask=keep, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        y += tl.load(res + mi.to(tl.int64)[:, None] * res_pitch + rows[None, :], mask=mask, other=0.0).to(tl.float32)
    at = mi.to(tl.int64)
    if AT_ROW:
        at += tl.load(pos).to(tl.int64)
    tl.store(out + at[:, None] * pitch + rows[None, :], y, mask=mask)


@triton.jit
def store_glu(gate, up, rows, n, mi, m, out, pitch):
    """SwiGLU of a gated pair's [BLOCK_M, BLOCK_N] sums stored at row mi of `out`; rows past m or n dropped."""
    # SiLU(g) = g / (1 + e^-g): for a very negative g, e^-g is inf and the quotient a signed zero, as it should
    y = gate / (1.0 + tl.exp(-gate)) * up
    mask = (mi < m)[:, None] & (rows < n)[None, :]
    tl.store(out + mi.to(tl.int64)[:, None] * pitch + rows[None, :], y, mask=mask)


@triton.jit
def store_part(
    y, part, rows, n, mi, m, p, res, res_pitch,
    PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """`store_rows` into the output of the part `part` of `p` (a `parts.PartsArgs`' items): BIAS and AT_ROW hold
    a bit a part; the residual is part 0's."""
    if PARTS == 1:
        store_rows(y, rows, n, mi, m, p[0].out, p[0].pitch, p[0].bias, p[0].pos, res, res_pitch, BIAS & 1, AT_ROW & 1,
                   HAS_RES)  # fmt: skip
    else:
        if part == 0:
            store_rows(y, rows, n, mi, m, p[0].out, p[0].pitch, p[0].bias, p[0].pos, res, res_pitch, BIAS & 1,
                       AT_ROW & 1, HAS_RES)  # fmt: skip
        for i in tl.static_range(1, PARTS):
            if part == i:
                store_rows(y, rows, n, mi, m, p[i].out, p[i].pitch, p[i].bias, p[i].pos, res, 0, (BIAS >> i) & 1,
                           (AT_ROW >> i) & 1, 0)  # fmt: skip


@triton.jit
def _gemv_parts_kernel(
    x, x_pitch, m, parts, res, res_pitch,
    FMT: tl.constexpr, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr,
    STAGES: tl.constexpr, SECOND: tl.constexpr, FMT_B: tl.constexpr, ROW_BYTES_B: tl.constexpr,
    STEPS_B: tl.constexpr, UNITS_B: tl.constexpr, SPLIT_B: tl.constexpr, STAGES_B: tl.constexpr,
    PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    parts_body(x, x_pitch, m, parts, res, res_pitch, FMT, ROW_BYTES, STEPS, UNITS, SPLIT, STAGES, SECOND, FMT_B,
               ROW_BYTES_B, STEPS_B, UNITS_B, SPLIT_B, STAGES_B, PARTS, BIAS, AT_ROW, HAS_RES, BLOCK_M,
               BLOCK_N)  # fmt: skip


@triton.jit
def parts_body(
    x, x_pitch, m, parts, res, res_pitch,
    FMT: tl.constexpr, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr,
    STAGES: tl.constexpr, SECOND: tl.constexpr, FMT_B: tl.constexpr, ROW_BYTES_B: tl.constexpr,
    STEPS_B: tl.constexpr, UNITS_B: tl.constexpr, SPLIT_B: tl.constexpr, STAGES_B: tl.constexpr,
    PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """A launch in parts' program (`parts`: a `parts.PartsArgs`; part p owns tiles [t_p, t_{p+1}); BIAS and AT_ROW
    hold a bit a part; the residual is part 0's): its part's rows summed and stored. SECOND holds a bit for each
    part in the second format (FMT_B and its k loop's constants), 0 where every part is in FMT: a program's part
    is one format, so it walks one body. Returns the part and the program's tile in it, for an epilogue of a
    kernel's own after it (`f32_rope`)."""
    p, t = parts.items, parts.first
    pid = tl.program_id(0)
    part = (pid >= t[0]).to(tl.int32)
    if PARTS > 2:
        part += (pid >= t[1]).to(tl.int32)
    if PARTS > 3:
        part += (pid >= t[2]).to(tl.int32)
    w = _pick(part, p[0].w, p[1].w, p[2].w, p[3].w, PARTS)
    n = _pick(part, p[0].n, p[1].n, p[2].n, p[3].n, PARTS)
    first = _pick(part, 0, t[0], t[1], t[2], PARTS)
    rows = (pid - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past the part's end read its last row (no masked loads in the k loop); the store drops them.
    row = tl.minimum(rows, n - 1).to(tl.int64)
    mi = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    x_rows = x + tl.minimum(mi, m - 1) * x_pitch
    if SECOND == 0:
        y = dot_rows(w + row * ROW_BYTES, x_rows, FMT, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES)
    elif ((tl.full((), SECOND, tl.int32) >> part) & 1) != 0:
        y = dot_rows(w + row * ROW_BYTES_B, x_rows, FMT_B, STEPS_B, UNITS_B, SPLIT_B, BLOCK_M, BLOCK_N, STAGES_B)
    else:
        y = dot_rows(w + row * ROW_BYTES, x_rows, FMT, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES)
    store_part(y, part, rows, n, mi, m, p, res, res_pitch, PARTS, BIAS, AT_ROW, HAS_RES)
    return part, pid - first


@triton.jit
def _gemv_glu_kernel(
    x,
    x_pitch,
    m,
    w_gate,
    w_up,
    n,
    out,
    pitch,
    FMT: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    STEPS: tl.constexpr,
    UNITS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_off = tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    mi = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    x_rows = x + tl.minimum(mi, m - 1) * x_pitch
    gate = dot_rows(w_gate + row_off, x_rows, FMT, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES)
    up = dot_rows(w_up + row_off, x_rows, FMT, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES)
    store_glu(gate, up, rows, n, mi, m, out, pitch)


# --- launch facts ------------------------------------------------------------------------------------------------


def largest_pow2_dividing(count: int, most: int) -> int:
    """The largest power of two <= `most` that divides `count`."""
    p = 1
    while p * 2 <= most and count % (p * 2) == 0:
        p *= 2
    return p


def plan(fmt: Format, k: int, block_n: int, warps: int, block_m: int) -> tuple[int, int, int]:
    """(steps, units a step, split) of the k loop (see `formats`): slots cut as finely as the registers
    ask, a step as many units as the block's threads a row take, a power of two dividing the row (so no
    step is partial and no load masked), and, where the row has too few units, slots cut finer still so
    that no thread idles."""
    s = SLOTS[fmt]
    if k % s.unit:
        raise ValueError(f"the {fmt.name} GEMV takes rows of whole {s.unit}-value units, not {k} values")
    threads_a_row = max(1, warps * kernels.WARP // block_n)
    split = 1
    while s.values // split > max(1, ACC_VALUES // block_m) and split < s.most_split:
        split *= 2
    units = largest_pow2_dividing(k // s.unit, max(1, threads_a_row // (s.base * split)))
    while units * s.base * split < threads_a_row and split < s.most_split:
        split *= 2
    return k // s.unit // units, units, split


def tile(fmt: Format, n: int, k: int, m: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of a product: the lane's rows a warp times the block's warps."""
    per_warp = kernels.rows_a_warp(fmt, n, k, m)
    warps = kernels.gemv_blk_norm_threads(per_warp) // kernels.WARP
    return per_warp * warps, warps


def check_x(x: torch.Tensor, k: int) -> int:
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or not x.is_floating_point():
        raise ValueError(f"x must be a float (m, {k}) tensor with unit column stride, got {tuple(x.shape)}")
    m = x.shape[0]
    if m < 1:
        raise ValueError("the GEMV needs at least one row of x")
    return m


def row_tiles(m: int) -> tuple[int, int]:
    """(BLOCK_M, tiles of x's rows): all m rows in one tile up to the GEMV's rows, tiles of them past it."""
    block_m = min(triton.next_power_of_2(m), kernels.GEMV_ROWS)
    return block_m, triton.cdiv(m, block_m)


# --- launchers ---------------------------------------------------------------------------------------------------


def parts_launch(x: torch.Tensor, parts: Sequence[Part | tuple], fmt: Format | Sequence[Format],
                 residual: torch.Tensor | None) -> tuple[tuple[int, int], list, dict]:  # fmt: skip
    """A launch in parts on `x`, checked: its grid, its arguments (the activation's first) and its constants
    (`num_warps` among them). `fmt`: the parts' format, or each part's, of at most
    `kernels.GEMV_PARTS_FORMATS`; the tile is the one of fewer rows a warp of the two."""
    parts = [Part(*p) for p in parts]
    if not 1 <= len(parts) <= kernels.GEMM_PARTS:
        raise ValueError(f"a launch in parts takes 1..{kernels.GEMM_PARTS} parts, not {len(parts)}")
    fmts = part_formats(fmt, len(parts))
    first = fmts[0]
    second = next((f for f in fmts if f is not first), first)
    if len(set(fmts)) > kernels.GEMV_PARTS_FORMATS:
        raise ValueError(f"a launch in parts takes at most {kernels.GEMV_PARTS_FORMATS} formats, not {len(set(fmts))}")
    k = x.shape[1]
    m = check_x(x, k)
    block_n, warps = min(tile(f, min(p.n for p in parts), k, m) for f in (first, second))
    block_m, m_tiles = row_tiles(m)
    entries: list[PartArgs] = []
    bias_bits = row_bits = 0
    for i, (p, f) in enumerate(zip(parts, fmts, strict=True)):
        check_rows(p.w, f, p.n, k)
        check_bias(p.bias, p.n)
        out, pitch, pos = part_out(p, m)
        bias_bits |= (p.bias is not None) << i
        row_bits |= (pos is not None) << i
        # an absent bias or position is never read: any tensor stands in for its pointer
        entries.append(PartArgs(p.w, p.n, out, pitch, x if p.bias is None else p.bias, x if pos is None else pos))
    packed, tiles = pack_parts(entries, block_n, PartArgs(x, 1, x, 0, x, x))
    if residual is not None and (tuple(residual.shape) != (m, parts[0].n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be ({m}, {parts[0].n}) with unit column stride")
    args = [
        x,
        x.stride(0),
        m,
        packed,
        x if residual is None else residual,
        0 if residual is None else residual.stride(0),
    ]
    consts = _loop_consts(first, k, block_n, warps, block_m, "")
    consts |= _loop_consts(second, k, block_n, warps, block_m, "_B")
    consts |= dict(SECOND=sum(1 << i for i, f in enumerate(fmts) if f is not first), PARTS=len(parts), BIAS=bias_bits,
                   AT_ROW=row_bits, HAS_RES=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                   num_warps=warps)  # fmt: skip
    return (tiles, m_tiles), args, consts


def _loop_consts(fmt: Format, k: int, block_n: int, warps: int, block_m: int, suffix: str) -> dict:
    """A format's k-loop constants at a launch's tile, each name with `suffix` (a launch's second format's)."""
    steps, units, split = plan(fmt, k, block_n, warps, block_m)
    consts = dict(FMT=int(fmt), ROW_BYTES=stored_row_bytes(fmt, k), STEPS=steps, UNITS=units, SPLIT=split,
                  STAGES=stages(fmt))  # fmt: skip
    return {name + suffix: v for name, v in consts.items()}


def gemv_parts(
    x: torch.Tensor,
    parts: Sequence[Part | tuple],
    fmt: Format | Sequence[Format],
    *,
    residual: torch.Tensor | None = None,
) -> None:
    """One launch of up to `kernels.GEMM_PARTS` products reading the same `x` (m, k), in one format or two
    (`fmt`: the parts', or each part's).

    Each part is a `Part` (or a tuple in its order: w, n, out, bias|None, out_row|None): its `out` gets
    x @ W^T (+ bias), (m, n) or rows of a table at a position read on the device. `residual` (m, n0), if
    given, is added to part 0 (it may be part 0's `out`). The tile shape is the narrowest part's (one row a
    warp where any part's is: a narrow key beside a wide query); any shape computes the same numbers.
    """
    grid, args, consts = parts_launch(x, parts, fmt, residual)
    _gemv_parts_kernel[grid](*args, **consts, **pdl.options())


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    fmt: Format,
    n: int,
    k: int,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_row: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """out = x (m, k) @ W^T (+ bias) (+ residual), W the n x k checkpoint rows `w` in `fmt`; returns `out`.

    With `out_row` = (pos, pitch), row r of the result lands at row pos[0] + r of the 2-D table `out` (rows
    `pitch` values apart, the first n of each written), the position read on the device. `residual` (m, n)
    may be `out` itself (an in-place add).
    """
    if x.dim() == 2 and x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weights' rows {k}")
    gemv_parts(x, [Part(w, n, out, bias, out_row)], fmt, residual=residual)
    return out


def gemv_gate_up_glu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    fmt: Format,
    n: int,
    k: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """out (m, n) = SiLU(x @ Wg^T) * (x @ Wu^T) in one launch, both matrices n x k checkpoint rows in `fmt`;
    returns `out`. A program takes the same rows of both, so the gate's and the up product's values meet in
    registers."""
    fmt = Format(fmt)
    m = check_x(x, k)
    check_rows(w_gate, fmt, n, k)
    check_rows(w_up, fmt, n, k)
    part_out(Part(w_gate, n, out), m)
    block_n, warps = tile(fmt, n, k, m)
    block_m, m_tiles = row_tiles(m)
    steps, units, split = plan(fmt, k, block_n, warps, block_m)
    _gemv_glu_kernel[(triton.cdiv(n, block_n), m_tiles)](
        x,
        x.stride(0),
        m,
        w_gate,
        w_up,
        n,
        out,
        out.stride(0),
        FMT=int(fmt),
        ROW_BYTES=stored_row_bytes(fmt, k),
        STEPS=steps,
        UNITS=units,
        SPLIT=split,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        STAGES=stages(fmt),
        num_warps=warps,
        **pdl.options(),
    )
    return out
