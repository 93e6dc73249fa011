"""A decode GEMV launch in parts (`rows`, `fast`, `q8`): up to four products of one activation, programs
mapped to (part, tile) by the parts' cumulative tile counts, each part with its own epilogue (a bias, a
residual, or a row of a table at a position read on the device).

The grouped-argument convention: a kernel in parts takes its parts as one Triton tuple argument, `PartsArgs`
(each part's `PartArgs` (w, n, out, pitch, bias, pos), then the first tiles of parts 1-3), where it once
took 27 scalars. Triton flattens a tuple argument in order, so the kernel's parameters, their
specialization and the code are what they were; an item is read with a constant index (`parts.items[1].out`).

Host side: `Part` (what a caller asks for), the checks, `parts_args` (the one-row GEMVs' arguments) and
`pack_parts`. Device side: `part_rows` (this program's part and rows; `part_base` and `row_pointers` where the
parts' rows differ in size), `store_parts` (its epilogue), `pick`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes

PARTS_MOST = 4  # products one `gemv_fast_parts` launch takes

# Stand-in for a part's tile boundary when the launch has fewer parts: no program id reaches it.
NO_TILE = 2**31 - 1


class Part(NamedTuple):
    """One product of a launch in parts: `out` (m, n) = x @ W^T (+ `bias`), or, with `out_row` =
    (pos, pitch), row r written at row pos[0] + r of the table `out` whose rows are `pitch` values apart."""

    w: torch.Tensor
    n: int
    out: torch.Tensor
    bias: torch.Tensor | None = None
    out_row: tuple[torch.Tensor, int] | None = None


class PartArgs(NamedTuple):
    """One part as a kernel takes it: weights, rows, output and its row pitch, bias and position tensor
    (any device tensor stands in for an absent bias or position, and for an absent part's pointers: never
    read)."""

    w: Tensor
    n: int
    out: Tensor
    pitch: int
    bias: Tensor
    pos: Tensor


class PartsArgs(NamedTuple):
    """A launch in parts' one tuple argument: PARTS_MOST `PartArgs` (absent parts' stand-ins last) and
    `first`, the first tiles of parts 1-3 (NO_TILE for an absent part: no program reaches it)."""

    items: tuple[PartArgs, ...]
    first: tuple[int, ...]


def pack_parts(entries: Sequence[PartArgs], block_n: int, absent: PartArgs) -> tuple[PartsArgs, int]:
    """The `PartsArgs` of up to PARTS_MOST parts' checked arguments (`absent` in each missing part's place)
    and the launch's programs: each part's rows in tiles of `block_n`, part after part."""
    firsts: list[int] = []
    tiles = 0
    for e in entries:
        firsts.append(tiles)
        tiles += triton.cdiv(e.n, block_n)
    missing = PARTS_MOST - len(entries)
    return PartsArgs((*entries, *(absent,) * missing), (*firsts[1:], *(NO_TILE,) * missing)), tiles


def check_rows(w: torch.Tensor, fmt: Format, n: int, k: int) -> None:
    """`w` must hold n >= 1 checkpoint rows of k values in `fmt`, as a contiguous 1-D uint8 tensor."""
    want = n * stored_row_bytes(fmt, k)
    if n < 1 or w.dtype != torch.uint8 or w.dim() != 1 or not w.is_contiguous() or w.numel() != want:
        raise ValueError(f"{fmt.name} weights of {n} rows of {k} must be a contiguous 1-D uint8 tensor of {want} bytes")


def part_out(part: Part, m: int) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """(out, row pitch, position tensor or None) of a part, checked."""
    out, n = part.out, part.n
    if out.dim() != 2 or out.stride(1) != 1:
        raise ValueError("out must be a 2-D tensor with unit column stride")
    if part.out_row is None:
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out must be ({m}, {n}), got {tuple(out.shape)}")
        return out, out.stride(0), None
    # The position is on the device: the rows pos[0] .. pos[0] + m - 1 must exist, which only the caller knows.
    pos, pitch = part.out_row
    if not n <= pitch == out.stride(0) or pos.numel() < 1 or pos.is_floating_point():
        raise ValueError(f"out_row needs an integer position tensor and a pitch >= {n} equal to out's row stride")
    return out, pitch, pos


def check_bias(bias: torch.Tensor | None, n: int) -> None:
    """`bias`, where given, must be a contiguous (n,) tensor."""
    if bias is not None and (bias.dim() != 1 or bias.numel() != n or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous ({n},) tensor")


def check_glu_out(out: Tensor, n: int) -> None:
    """A one-row gate/up GLU's output: a contiguous f32 (1, n) tensor."""
    if tuple(out.shape) != (1, n) or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError(f"out must be a contiguous f32 (1, {n}) tensor")


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
def first_tile(part, parts):
    """The first tile of part `part` of `parts` (a `PartsArgs`)."""
    return pick(part, 0, parts.first[0], parts.first[1], parts.first[2])


@triton.jit
def part_base(parts, BLOCK_N: tl.constexpr):
    """A launch in parts (`parts`: a `PartsArgs`): this program's part (part p owns tiles [t_p, t_{p+1}), an
    absent one NO_TILE), its rows, the part's n, and the part's weights (its first row)."""
    pid = tl.program_id(0)
    t, p = parts.first, parts.items
    part = (pid >= t[0]).to(tl.int32) + (pid >= t[1]).to(tl.int32) + (pid >= t[2]).to(tl.int32)
    w, n = pick(part, p[0].w, p[1].w, p[2].w, p[3].w), pick(part, p[0].n, p[1].n, p[2].n, p[3].n)
    rows = (pid - first_tile(part, parts)) * BLOCK_N + tl.arange(0, BLOCK_N)
    return part, rows, n, w


@triton.jit
def row_pointers(w, rows, n, ROW_BYTES: tl.constexpr):
    """The rows' weight pointers from a part's first row (rows past n read its last row: no masked weight
    loads; the store drops them)."""
    return w + tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES


@triton.jit
def part_rows(parts, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr):
    """`part_base` with the rows' weight pointers (`row_pointers`) in place of the part's first row."""
    part, rows, n, w = part_base(parts, BLOCK_N)
    return part, rows, n, row_pointers(w, rows, n, ROW_BYTES)


@triton.jit
def store_parts(y, rows, part, n, parts, res, PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr,
                HAS_RES: tl.constexpr):  # fmt: skip
    """A part's epilogue (`store_row`) from `parts` (a `PartsArgs`): BIAS and AT_ROW hold a bit a part; the
    residual is part 0's."""
    p = parts.items
    if part == 0:
        store_row(y, rows, n, p[0].out, p[0].pitch, p[0].bias, p[0].pos, res, BIAS & 1, AT_ROW & 1, HAS_RES)
    for i in tl.static_range(1, PARTS):
        if part == i:
            store_row(
                y, rows, n, p[i].out, p[i].pitch, p[i].bias, p[i].pos, res, (BIAS >> i) & 1, (AT_ROW >> i) & 1, False
            )


def out_args(part: Part) -> tuple[Tensor, int, Tensor | None]:
    """(out, row pitch, position tensor or None) of a one-row part, checked as `gemv` checks its parts; the
    out is f32, or f16 where it is a KV-cache row (the store rounds the f32 sums to the pointer's type)."""
    if part.out.dtype not in (torch.float32, torch.float16):
        raise ValueError("out must be a 2-D f32 or f16 tensor with unit column stride")
    check_bias(part.bias, part.n)
    return part_out(part, 1)


def part_formats(fmt: Format | Sequence[Format], count: int) -> list[Format]:
    """Each of `count` parts' format: `fmt` for all, or one a part."""
    if isinstance(fmt, Sequence):
        if len(fmt) != count:
            raise ValueError(f"{len(fmt)} formats for {count} parts")
        return [Format(f) for f in fmt]
    return [Format(fmt)] * count


def parts_args(parts: Sequence[Part | tuple], fmt: Format | Sequence[Format], k: int, block_n: int,
               stand_in: Tensor, residual: Tensor | None) -> tuple[list, dict, int]:  # fmt: skip
    """A one-row launch in parts' arguments after its activation: its `PartsArgs` and the residual; its
    flags; and its programs. `fmt`: the parts' format, or each part's (`part_formats`). `stand_in` (any
    device tensor) stands in for an absent pointer, never read."""
    parts = [Part(*p) for p in parts]
    if not 1 <= len(parts) <= PARTS_MOST:
        raise ValueError(f"a launch in parts takes 1..{PARTS_MOST} parts, not {len(parts)}")
    fmts = part_formats(fmt, len(parts))
    entries: list[PartArgs] = []
    bias_bits = row_bits = 0
    for i, p in enumerate(parts):
        check_rows(p.w, fmts[i], p.n, k)
        out, pitch, pos = out_args(p)
        bias_bits |= (p.bias is not None) << i
        row_bits |= (pos is not None) << i
        entries.append(
            PartArgs(p.w, p.n, out, pitch, stand_in if p.bias is None else p.bias, stand_in if pos is None else pos)
        )
    # an absent part is picked only as a select's other arm
    packed, tiles = pack_parts(entries, block_n, PartArgs(parts[0].w, 1, stand_in, 0, stand_in, stand_in))
    if residual is not None and (tuple(residual.shape) != (1, parts[0].n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be (1, {parts[0].n}) with unit column stride")
    flags = dict(PARTS=len(parts), BIAS=bias_bits, AT_ROW=row_bits, HAS_RES=residual is not None)
    return [packed, stand_in if residual is None else residual], flags, tiles
