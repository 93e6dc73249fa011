"""RMS norms on the device: NormWeight, AddNorm (per row or per head) and EmbedNorm (gather, dequantize, norm).

Every norm here is one launch with a block a row (a unit: a whole row, or one head of a row for the per-head
norms of q and k). A block's threads come from `kernels.norm_threads`, the same fact the shim reads, so a
fused op the optimizer builds is one these kernels run. A row that fits one tile (eight values a thread, the
norm's two 16-byte loads) is held in registers between the sum of squares and the scaling; a wider one is
read twice (the second pass hits L2), which keeps the block's registers bounded for any width.

The arithmetic matches the cpu lane's parts: `s = x + residual`, `r = 1 / sqrt(mean(s^2) + eps)`,
`out = (s * r) * w`, all in f32 whatever the input's storage. Under int8 activations a norm may also write
its rows quantized (`out_q8`, the plan's NormQuant / AddNormQuant), a 32-value block at a time as `quant`
does, so the product that reads them needs no launch of its own to quantize.

The embedding gather dequantizes its rows in the kernel from the checkpoint's own blocks, reading each
field at its byte offset in the block as the device keeps it (`kernels.stored_offset`): the table stays in its
quantized form on the device, and a token's row costs a few hundred bytes instead of a dequantized copy of the
table. Fields are read a byte at a time and assembled, so a block of any byte size (22 for Q5_0) needs no
alignment (a split format's d, Q6_K's or Q8_0's, sits after its row's blocks on the device: `layout.block_d`); a step
gathers one row, so the extra loads cost nothing that matters.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import LAYOUTS, QK, Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.kernels import (
    ROW_TAIL_D,
    kept_after_row,
    stored_block_bytes,
    stored_offset,
    stored_row_bytes,
)
from fuselane.lanes.cuda.triton import gather_formats, pdl
from fuselane.lanes.cuda.triton.gemv.layout import block_d
from fuselane.lanes.cuda.triton.grid.values import device_table, grid_values
from fuselane.lanes.cuda.triton.quant import Q8Acts, check_acts, store_quantized

QB = tl.constexpr(QK)  # values an int8 block's scale covers
HALF_QB = tl.constexpr(QK // 2)  # values a code sum covers

# Formats the gather decodes in its kernel, by ggml type number (constexpr so each compiles its own decoder).
F32: tl.constexpr = tl.constexpr(int(Format.F32))
F16: tl.constexpr = tl.constexpr(int(Format.F16))
BF16: tl.constexpr = tl.constexpr(int(Format.BF16))
Q8_0: tl.constexpr = tl.constexpr(int(Format.Q8_0))
Q5_0: tl.constexpr = tl.constexpr(int(Format.Q5_0))
Q4_K: tl.constexpr = tl.constexpr(int(Format.Q4_K))
Q6_K: tl.constexpr = tl.constexpr(int(Format.Q6_K))
# every format's flag: its d kept after its row's blocks (`layout.block_d`), not at OFF_D in a block
ROW_TAIL_C = tl.constexpr({int(f): f in ROW_TAIL_D for f in Format})
GATHER_FORMATS = (
    frozenset({Format.F32, Format.F16, Format.BF16, Format.Q8_0, Format.Q5_0, Format.Q4_K, Format.Q6_K})
    | gather_formats.FORMATS
    | kernels.GRID_GEMV_FORMATS
)
# every format's flag: a grid or ternary format, decoded from its table (`grid.values.grid_values`)
GRID_C = tl.constexpr({int(f): f in kernels.GRID_GEMV_FORMATS for f in Format})

# Code offsets that make the formats' unsigned codes signed (ggml's): Q5_0 codes are 5 bits around 16,
# Q6_K codes 6 bits around 32.
Q5_0_ZERO: tl.constexpr = tl.constexpr(16)
Q6_K_ZERO: tl.constexpr = tl.constexpr(32)


class RowTile(NamedTuple):
    """How a norm's block walks a row: `block` values a step, `chunks` steps, `warps` warps."""

    block: int
    chunks: int
    warps: int


def row_tile(cols: int) -> RowTile:
    """The tile of a norm over `cols`-wide units: the block's threads from `kernels.norm_threads`, each taking
    `kernels.NORM_VALUES_A_THREAD` values a step (no more than the row, rounded to a power of two)."""
    threads = kernels.norm_threads(cols)
    block = min(triton.next_power_of_2(cols), threads * kernels.NORM_VALUES_A_THREAD)
    return RowTile(block, triton.cdiv(cols, block), threads // kernels.WARP)


# --- plain and residual norms ----------------------------------------------------------------------------


@triton.jit
def _sum_in(x_row, res_row, offs, cols, HAS_RES: tl.constexpr):
    """One tile of the unit: x, plus the residual where there is one, in f32."""
    mask = offs < cols
    s = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        s += tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit
def _store(y, first, cols, out_row, q_row, d_row, s_row, mask, Q8OUT: tl.constexpr):
    """Values first.. of a unit's normed row: to `out`, and where Q8OUT also quantized (`quant.Q8Acts`)."""
    tl.store(out_row + first + tl.arange(0, y.shape[0]), y.to(out_row.dtype.element_ty), mask=mask)
    if Q8OUT:
        store_quantized(y, first, cols, q_row, d_row, s_row)


@triton.jit
def rms_norm_unit(
    x_ptr, res_ptr, sum_ptr, w_ptr, out_ptr, x_pitch, res_pitch, sum_pitch, out_pitch, q_ptr, d_ptr, s_ptr, cols,
    eps, row, unit, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
    Q8OUT: tl.constexpr,
):  # fmt: skip
    """Row `row`'s unit at value `unit` normed (`_rms_norm_kernel`'s program; a launch that norms beside other
    work, `mla.parts.norm_rope`, calls it for its norm's programs, at the warps `row_tile` gives)."""
    x_row = x_ptr + row * x_pitch + unit
    res_row = res_ptr + row * res_pitch + unit
    sum_row = sum_ptr + row * sum_pitch + unit
    out_row = out_ptr + row * out_pitch + unit
    q_row, d_row, s_row = q_ptr + row * cols, d_ptr + row * (cols // QB), s_ptr + row * (cols // HALF_QB)
    offs = tl.arange(0, BLOCK)
    if CHUNKS == 1:  # the row fits the block's registers: read it once
        mask = offs < cols
        s = _sum_in(x_row, res_row, offs, cols, HAS_RES)
        if HAS_RES:
            tl.store(sum_row + offs, s.to(sum_ptr.dtype.element_ty), mask=mask)
        r = tl.rsqrt(tl.sum(s * s, axis=0) / cols + eps)
        y = s * r
        if HAS_W:
            y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        _store(y, 0, cols, out_row, q_row, d_row, s_row, mask, Q8OUT)
    else:
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for c in tl.static_range(CHUNKS):
            s = _sum_in(x_row, res_row, c * BLOCK + offs, cols, HAS_RES)
            if HAS_RES:
                tl.store(sum_row + c * BLOCK + offs, s.to(sum_ptr.dtype.element_ty), mask=c * BLOCK + offs < cols)
            squares += s * s
        r = tl.rsqrt(tl.sum(squares, axis=0) / cols + eps)
        if HAS_RES:
            # the second pass reads the sum back from sum_out, which may be the residual's own buffer (the
            # residual stream updated in place); the barrier makes every thread's first-pass stores visible
            tl.debug_barrier()
        for c in tl.static_range(CHUNKS):
            mask = c * BLOCK + offs < cols
            if HAS_RES:
                y = tl.load(sum_row + c * BLOCK + offs, mask=mask, other=0.0).to(tl.float32) * r
            else:
                y = tl.load(x_row + c * BLOCK + offs, mask=mask, other=0.0).to(tl.float32) * r
            if HAS_W:
                y = y * tl.load(w_ptr + c * BLOCK + offs, mask=mask, other=0.0).to(tl.float32)
            _store(y, c * BLOCK, cols, out_row, q_row, d_row, s_row, mask, Q8OUT)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    sum_ptr,
    w_ptr,
    out_ptr,
    x_pitch,
    res_pitch,
    sum_pitch,
    out_pitch,
    q_ptr,
    d_ptr,
    s_ptr,
    cols,
    eps,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    Q8OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    # program (row, unit): a unit is `cols` values at unit * cols of the row (a head, or the whole row); an
    # int8 form is written only for whole rows (one unit), contiguous
    pdl.begin(PDL)
    rms_norm_unit(
        x_ptr, res_ptr, sum_ptr, w_ptr, out_ptr, x_pitch, res_pitch, sum_pitch, out_pitch, q_ptr, d_ptr, s_ptr, cols,
        eps, tl.program_id(0).to(tl.int64), tl.program_id(1) * cols, HAS_RES, HAS_W, BLOCK, CHUNKS, Q8OUT,
    )  # fmt: skip


def _check_q8(out_q8: Q8Acts, rows: int, units: int, cols: int, tile: RowTile) -> None:
    if units != 1 or cols % QK or tile.block % QK:
        raise ValueError(f"rms_norm: an int8 form takes whole rows of whole {QK}-value blocks, not units of {cols}")
    check_acts(out_q8, cols, rows)


def _rows_of(t: torch.Tensor, cols: int, name: str) -> torch.Tensor:
    """`t` as 2-D rows of whole `cols`-wide units, read in place (a view, never a copy)."""
    if t.dim() != 2:
        t = t.view(-1, t.shape[-1])
    if t.stride(-1) != 1 or t.shape[1] % cols:
        raise ValueError(f"{name}: rows of unit-stride values, whole units of {cols}; got {tuple(t.shape)}")
    return t


def _launch_norm(
    x: torch.Tensor,
    w: torch.Tensor | None,
    out: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    sum_out: torch.Tensor | None,
    cols: int,
    out_q8: Q8Acts | None = None,
) -> None:
    if (residual is None) != (sum_out is None):
        raise ValueError("rms_norm: a residual needs sum_out to write the sum to, and sum_out needs a residual")
    x2 = _rows_of(x, cols, "x")
    out2 = _rows_of(out, cols, "out")
    res2 = _rows_of(residual, cols, "residual") if residual is not None else x2
    sum2 = _rows_of(sum_out, cols, "sum_out") if sum_out is not None else out2
    rows, units = x2.shape[0], x2.shape[1] // cols
    tile = row_tile(cols)
    if out_q8 is not None:
        _check_q8(out_q8, rows, units, cols, tile)
    _rms_norm_kernel[(rows, units)](
        x2,
        res2,
        sum2,
        w if w is not None else x2,
        out2,
        x2.stride(0),
        res2.stride(0),
        sum2.stride(0),
        out2.stride(0),
        *(out_q8 if out_q8 is not None else (out2, out2, out2)),
        cols,
        float(eps),
        HAS_RES=residual is not None,
        HAS_W=w is not None,
        BLOCK=tile.block,
        CHUNKS=tile.chunks,
        Q8OUT=out_q8 is not None,
        num_warps=tile.warps,
        **pdl.options(),
    )


def rms_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    sum_out: torch.Tensor | None = None,
    out_q8: Q8Acts | None = None,
) -> None:
    """out = s / sqrt(mean(s^2) + eps) * w over each `w.numel()`-wide unit of each row, where s = x + residual
    (written to `sum_out`, the AddNorm form) or s = x (NormWeight).

    `x` (rows, units * cols) with unit-stride rows at any pitch (a part of a wider tensor is read in place);
    a unit narrower than the row is a head (the per-head norm of q or k, `x` viewed as (rows * heads, hd)).
    With `out_q8` (whole rows of whole 32-value blocks) `out` is also written quantized, as `quant.quantize`
    would write it. One launch, a block a unit.
    """
    _launch_norm(x, w, out, eps, residual, sum_out, w.numel(), out_q8)


def rms_norm_plain(x: torch.Tensor, out: torch.Tensor, eps: float, *, cols: int | None = None) -> None:
    """The bare RmsNorm primitive (no weight): out = x / sqrt(mean(x^2) + eps) over each `cols`-wide unit
    (the whole row by default), as a plan with the norm_weight rule held runs it."""
    _launch_norm(x, None, out, eps, None, None, cols if cols is not None else x.shape[-1])


# --- the embedding gather --------------------------------------------------------------------------------


@triton.jit
def _byte(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.uint32)


@triton.jit
def _f16_at(p, mask):
    """The little-endian f16 at byte address p, as f32."""
    bits = _byte(p, mask) | (_byte(p + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _i8_at(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _decode(
    row,
    j,
    mask,
    grid_table,
    FMT: tl.constexpr,
    VALUES: tl.constexpr,
    NBYTES: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    OFF_D: tl.constexpr,
    OFF_DMIN: tl.constexpr,
    OFF_SCALES: tl.constexpr,
    OFF_QS: tl.constexpr,
    OFF_QH: tl.constexpr,
):
    """Values j of a checkpoint row at byte address `row` (ROW_BYTES as the device keeps it), as f32, exactly
    as `dequant` decodes them (each product of a scale and a code is exact in f32, so only a minimum's
    subtraction rounds, as it does there)."""
    blk = row + (j // VALUES) * NBYTES
    t = j % VALUES
    if FMT == F32:
        bits = _byte(row + 4 * j, mask)
        bits |= _byte(row + 4 * j + 1, mask) << 8
        bits |= _byte(row + 4 * j + 2, mask) << 16
        bits |= _byte(row + 4 * j + 3, mask) << 24
        v = bits.to(tl.float32, bitcast=True)
    elif FMT == F16:
        v = _f16_at(row + 2 * j, mask)
    elif FMT == BF16:
        bits = (_byte(row + 2 * j, mask) | (_byte(row + 2 * j + 1, mask) << 8)) << 16
        v = bits.to(tl.float32, bitcast=True)
    elif FMT == Q8_0:
        v = _i8_at(blk + OFF_QS + t, mask) * _f16_at(block_d(row, j // VALUES, FMT, ROW_BYTES), mask)
    elif FMT == Q5_0:
        # value t: its low four bits are nibble (t // 16) of qs[t % 16]; its fifth is bit t of qh (a u32)
        nib = (_byte(blk + OFF_QS + t % 16, mask) >> ((t // 16) * 4)) & 0xF
        high = (_byte(blk + OFF_QH + t // 8, mask) >> (t % 8)) & 1
        code = (nib | (high << 4)).to(tl.int32) - Q5_0_ZERO
        v = code.to(tl.float32) * _f16_at(blk + OFF_D, mask)
    elif FMT == Q4_K:
        # eight sub-blocks of 32; sub-block sb's codes are nibble (sb % 2) of qs[(t // 64) * 32 + t % 32];
        # its 6-bit scale and min: sb < 4 the low six bits of scales[sb] and scales[sb + 4]; sb >= 4 a nibble
        # of scales[sb + 4] under the top two bits of scales[sb - 4] and scales[sb]
        sb = t // 32
        nib = (_byte(blk + OFF_QS + (t // 64) * 32 + t % 32, mask) >> ((sb % 2) * 4)) & 0xF
        a = _byte(blk + OFF_SCALES + sb % 4, mask)
        b = _byte(blk + OFF_SCALES + sb % 4 + 4, mask)
        c = _byte(blk + OFF_SCALES + sb % 4 + 8, mask)
        low = sb < 4
        sc = tl.where(low, a & 0x3F, (c & 0xF) | ((a >> 6) << 4))
        mn = tl.where(low, b & 0x3F, (c >> 4) | ((b >> 6) << 4))
        d = _f16_at(blk + OFF_D, mask) * sc.to(tl.float32)
        dmin = _f16_at(blk + OFF_DMIN, mask) * mn.to(tl.float32)
        v = d * nib.to(tl.float32) - dmin
    elif GRID_C[FMT]:  # from the format's table (`grid.values`); a value past the row reads the row's first
        blk = row + tl.where(mask, j // VALUES, 0) * NBYTES
        v = grid_values(blk, grid_table, tl.where(mask, t, 0), FMT)
    elif gather_formats.DECODES_C[FMT]:
        if ROW_TAIL_C[FMT]:
            dp = block_d(row, j // VALUES, FMT, ROW_BYTES)
        else:
            dp = blk + OFF_D
        v = gather_formats.decode(blk, dp, t, mask, FMT, OFF_DMIN, OFF_SCALES, OFF_QS, OFF_QH)
    else:
        tl.static_assert(FMT == Q6_K, "no gather decoder for this format")
        # two halves of 128: value r of half h takes nibble (r // 64) of ql[h * 64 + r % 64] and, above it,
        # bits 2 * (r // 32) of qh[h * 32 + r % 32]; a signed 8-bit scale a sub-block of 16
        h = t // 128
        r = t % 128
        nib = (_byte(blk + OFF_QS + h * 64 + r % 64, mask) >> ((r // 64) * 4)) & 0xF
        top = (_byte(blk + OFF_QH + h * 32 + r % 32, mask) >> ((r // 32) * 2)) & 0x3
        code = (nib | (top << 4)).to(tl.int32) - Q6_K_ZERO
        d = _f16_at(block_d(row, j // VALUES, FMT, ROW_BYTES), mask)
        d *= _i8_at(blk + OFF_SCALES + t // 16, mask)
        v = d * code.to(tl.float32)
    return v


@triton.jit
def _embed_norm_kernel(
    table_ptr,
    grid_table,
    ids_ptr,
    w_ptr,
    rows_ptr,
    out_ptr,
    rows_pitch,
    out_pitch,
    cols,
    eps,
    ROW_BYTES: tl.constexpr,
    FMT: tl.constexpr,
    VALUES: tl.constexpr,
    NBYTES: tl.constexpr,
    OFF_D: tl.constexpr,
    OFF_DMIN: tl.constexpr,
    OFF_SCALES: tl.constexpr,
    OFF_QS: tl.constexpr,
    OFF_QH: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    i = tl.program_id(0).to(tl.int64)
    # int64: a table's bytes pass 2^31 (152k rows of 5120 f16 values are 1.5 GiB)
    row = table_ptr + tl.load(ids_ptr + i).to(tl.int64) * ROW_BYTES
    rows_row = rows_ptr + i * rows_pitch
    out_row = out_ptr + i * out_pitch
    offs = tl.arange(0, BLOCK)
    if CHUNKS == 1:  # the row fits the block's registers: decode it once
        mask = offs < cols
        v = _decode(
            row, offs, mask, grid_table, FMT, VALUES, NBYTES, ROW_BYTES, OFF_D, OFF_DMIN, OFF_SCALES, OFF_QS, OFF_QH
        )
        v = tl.where(mask, v, 0.0)
        tl.store(rows_row + offs, v.to(rows_ptr.dtype.element_ty), mask=mask)
        r = tl.rsqrt(tl.sum(v * v, axis=0) / cols + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + offs, (v * r * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for c in tl.static_range(CHUNKS):
            j = c * BLOCK + offs
            mask = j < cols
            v = _decode(
                row, j, mask, grid_table, FMT, VALUES, NBYTES, ROW_BYTES, OFF_D, OFF_DMIN, OFF_SCALES, OFF_QS, OFF_QH
            )
            v = tl.where(mask, v, 0.0)
            tl.store(rows_row + j, v.to(rows_ptr.dtype.element_ty), mask=mask)
            squares += v * v
        r = tl.rsqrt(tl.sum(squares, axis=0) / cols + eps)
        for c in tl.static_range(CHUNKS):
            # decode again rather than read rows_out back: the same bits, the table's row is in L2 from the
            # first pass, and no read of a value another thread of the block may not have stored yet
            j = c * BLOCK + offs
            mask = j < cols
            v = _decode(
                row, j, mask, grid_table, FMT, VALUES, NBYTES, ROW_BYTES, OFF_D, OFF_DMIN, OFF_SCALES, OFF_QS, OFF_QH
            )
            w = tl.load(w_ptr + j, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + j, (v * r * w).to(out_ptr.dtype.element_ty), mask=mask)


def _offset(fmt: Format, name: str) -> int:
    """Field `name`'s offset in a block of `fmt` as the device keeps it; 0 where the block has no such field (a d
    kept after the row's blocks: `layout.block_d`), which the decode then does not read."""
    names = {f.name for f in LAYOUTS[fmt].fields}
    if name not in names or kept_after_row(fmt, name):
        return 0
    return stored_offset(fmt, name)


def embed_norm(
    table_raw: torch.Tensor,
    fmt: Format,
    ids: torch.Tensor,
    w: torch.Tensor,
    rows_out: torch.Tensor,
    out: torch.Tensor,
    eps: float,
) -> None:
    """EmbedNorm: rows_out[i] = table[ids[i]] (dequantized in the kernel from the checkpoint's blocks) and
    out[i] = rows_out[i] / sqrt(mean(rows_out[i]^2) + eps) * w, one launch, a block a row.

    `table_raw` is the table's bytes on the device (uint8, 1-D or (vocab, row bytes)); `fmt` one of
    GATHER_FORMATS (every matrix format); `ids` int32 (rows,) on the device (a captured graph reads the
    step's token from it); `rows_out` and `out` (rows, w.numel()).
    """
    fmt = Format(fmt)
    if fmt not in GATHER_FORMATS:
        names = ", ".join(sorted(f.name for f in GATHER_FORMATS))
        raise ValueError(f"embed_norm decodes {names} rows, not {fmt.name}")
    if table_raw.dtype != torch.uint8:
        raise ValueError(f"embed_norm reads the table's bytes (uint8), not {table_raw.dtype}")
    cols = w.numel()
    rows = ids.numel()
    lay = LAYOUTS[fmt]
    # the 32- and 256-value formats name their code field qs (Q6_K: ql), their scales d / scales
    qs = "ql" if fmt is Format.Q6_K else "qs"
    tile = row_tile(cols)
    _embed_norm_kernel[(rows,)](
        table_raw,
        device_table(fmt, table_raw.device) if fmt in kernels.GRID_GEMV_FORMATS else table_raw,  # else unread
        ids,
        w,
        rows_out,
        out,
        rows_out.stride(0),
        out.stride(0),
        cols,
        float(eps),
        ROW_BYTES=stored_row_bytes(fmt, cols),
        FMT=int(fmt),
        VALUES=lay.values,
        NBYTES=stored_block_bytes(fmt),
        OFF_D=_offset(fmt, "d"),
        OFF_DMIN=_offset(fmt, gather_formats.MIN_FIELD.get(fmt, "dmin")),
        OFF_SCALES=_offset(fmt, gather_formats.SCALES_FIELD.get(fmt, "scales")),
        OFF_QS=_offset(fmt, qs),
        OFF_QH=_offset(fmt, gather_formats.HIGH_FIELD.get(fmt, "qh")),
        BLOCK=tile.block,
        CHUNKS=tile.chunks,
        num_warps=tile.warps,
        **pdl.options(),
    )
