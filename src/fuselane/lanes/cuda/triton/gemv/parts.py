"""A decode GEMV launch in parts (`gemv_fast`, `gemv_q8`): up to four products of one activation, programs
mapped to (part, tile) by the parts' cumulative tile counts, each part with its own epilogue (a bias, a
residual, or a row of a table at a position read on the device).

The kernels call `part_rows` for their program's part and rows and `store_parts` for its epilogue; the
launchers build the arguments with `parts_args`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.triton.gemv.rows import Part, _check_bias, _out_args, check_rows

PARTS_MOST = 4  # products one `gemv_fast_parts` launch takes
NO_TILE = 2**31 - 1  # stand-in tile boundary of an absent part: no program id reaches it


@triton.jit
def pick(part, a0, a1, a2, a3):
    """Argument `part` of a0..a3 (a scalar select; an absent part's stand-ins are never picked)."""
    return tl.where(part == 0, a0, tl.where(part == 1, a1, tl.where(part == 2, a2, a3)))


@triton.jit
def store_row(
    y, rows, n, out, pitch, bias, pos, res, HAS_BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr
):
    """The epilogue: + bias, + residual, stored in row 0 (or row pos[0]) of `out`; rows past n dropped."""
    keep = rows < n
    if HAS_BIAS:
        y += tl.load(bias + rows, mask=keep, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(res + rows, mask=keep, other=0.0).to(tl.float32)
    at = 0
    if AT_ROW:
        at = tl.load(pos).to(tl.int64) * pitch
    tl.store(out + at + rows, y, mask=keep)


@triton.jit
def part_rows(w0, n0, w1, n1, w2, n2, w3, n3, t1, t2, t3, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr):
    """A launch in parts: this program's part (part p owns tiles [t_p, t_{p+1}), an absent one NO_TILE), its
    rows, the part's n, and the rows' weight pointers (rows past n read its last row: no masked weight loads;
    the store drops them)."""
    pid = tl.program_id(0)
    part = (pid >= t1).to(tl.int32) + (pid >= t2).to(tl.int32) + (pid >= t3).to(tl.int32)
    w, n = pick(part, w0, w1, w2, w3), pick(part, n0, n1, n2, n3)
    rows = (pid - pick(part, 0, t1, t2, t3)) * BLOCK_N + tl.arange(0, BLOCK_N)
    return part, rows, n, w + tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES


@triton.jit
def store_parts(
    y, rows, part, n,
    out0, pitch0, bias0, pos0, out1, pitch1, bias1, pos1, out2, pitch2, bias2, pos2, out3, pitch3, bias3, pos3,
    res, PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """A part's epilogue (`_store`): BIAS and AT_ROW hold a bit a part; the residual is part 0's."""
    if part == 0:
        store_row(y, rows, n, out0, pitch0, bias0, pos0, res, BIAS & 1, AT_ROW & 1, HAS_RES)
    if PARTS > 1:
        if part == 1:
            store_row(y, rows, n, out1, pitch1, bias1, pos1, res, (BIAS >> 1) & 1, (AT_ROW >> 1) & 1, False)
    if PARTS > 2:
        if part == 2:
            store_row(y, rows, n, out2, pitch2, bias2, pos2, res, (BIAS >> 2) & 1, (AT_ROW >> 2) & 1, False)
    if PARTS > 3:
        if part == 3:
            store_row(y, rows, n, out3, pitch3, bias3, pos3, res, (BIAS >> 3) & 1, (AT_ROW >> 3) & 1, False)


def out_args(part: Part) -> tuple[Tensor, int, Tensor | None]:
    """(out, row pitch, position tensor or None) of a one-row part, checked as `gemv` checks its parts; the
    out is f32, or f16 where it is a KV-cache row (the store rounds the f32 sums to the pointer's type)."""
    if part.out.dtype not in (torch.float32, torch.float16):
        raise ValueError("out must be a 2-D f32 or f16 tensor with unit column stride")
    _check_bias(part.bias, part.n)
    return _out_args(part, 1)


def parts_args(parts: Sequence[Part | tuple], fmt: Format, k: int, block_n: int, stand_in: Tensor,
               residual: Tensor | None) -> tuple[list, dict, int]:  # fmt: skip
    """A launch in parts' arguments after its activation: each part's (w, n, out, pitch, bias, pos), the
    first tiles of parts 1-3, the residual; its flags; and its programs. `stand_in` (any device tensor)
    stands in for an absent pointer, which is never read."""
    parts = [Part(*p) for p in parts]
    if not 1 <= len(parts) <= PARTS_MOST:
        raise ValueError(f"a launch in parts takes 1..{PARTS_MOST} parts, not {len(parts)}")
    args: list = []
    firsts: list[int] = []
    tiles = bias_bits = row_bits = 0
    for i, p in enumerate(parts):
        check_rows(p.w, fmt, p.n, k)
        out, pitch, pos = out_args(p)
        bias_bits |= (p.bias is not None) << i
        row_bits |= (pos is not None) << i
        args += [p.w, p.n, out, pitch, stand_in if p.bias is None else p.bias, stand_in if pos is None else pos]
        firsts.append(tiles)
        tiles += triton.cdiv(p.n, block_n)
    for _ in range(len(parts), PARTS_MOST):
        args += [parts[0].w, 1, stand_in, 0, stand_in, stand_in]  # picked only as a select's other arm
    firsts = firsts[1:] + [NO_TILE] * (PARTS_MOST - len(parts))
    if residual is not None and (tuple(residual.shape) != (1, parts[0].n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be (1, {parts[0].n}) with unit column stride")
    flags = dict(PARTS=len(parts), BIAS=bias_bits, AT_ROW=row_bits, HAS_RES=residual is not None)
    return [*args, *firsts, stand_in if residual is None else residual], flags, tiles
