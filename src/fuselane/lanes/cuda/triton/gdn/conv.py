"""The causal depth-wise convolution of a gated delta-rule layer, with its state, in one launch.

A program owns a block of channels for a block of the step's rows (a decode step's one row; a chunk's rows
`row_tile` at a time, all at once): row t of channel c is sum_j w[c, j] * seq[t + j], where seq is the state's
taps - 1 rows (the inputs before this step, oldest first) followed by the step's rows. Only the first row
block reads the old state (a block is at least taps - 1 rows), and its program then moves the state to the
last taps - 1 inputs of seq, after its own reads and reading the old state only at rows it has not yet
written, so no program sees a half-moved state. SiLU (ConvBiasSilu) and, for the query and key channels, each head's L2
norm x / sqrt(sum x^2 + eps) (ConvSiluL2norm) ride the store: there a program's block is one head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import pdl

BLOCK = 128  # channels a program convolves where no head norm sets the block
# A chunk's rows a program convolves at once (`row_tile`): the rows run side by side, not one after another (a
# 512-row chunk's 8,192 channels took 64 programs a row at a time)
ROW_TILE = 16


@triton.jit
def conv_block(
    blk, rb, x_ptr, x_pitch, state_ptr, w_ptr, out_ptr, out_pitch, q_ptr, k_ptr, qk_pitch, rows, chan, eps,
    TAPS: tl.constexpr, BLOCK: tl.constexpr, RT: tl.constexpr, SILU: tl.constexpr, WRITE_OUT: tl.constexpr,
    SHIFT: tl.constexpr, NORMED: tl.constexpr, KW: tl.constexpr,
):  # fmt: skip
    """Block `blk` of a convolution's channels over row block `rb` of the step (RT rows, all at once), then, in
    the first row block's program, its state's shift (see the module)."""
    c = blk * BLOCK + tl.arange(0, BLOCK)
    cm = c < chan
    if WRITE_OUT:
        t = rb * RT + tl.arange(0, RT)
        tm = t < rows
        acc = tl.zeros((RT, BLOCK), dtype=tl.float32)
        for j in tl.static_range(TAPS):
            u = t + j - (TAPS - 1)  # the input's row in the step; below 0 the state's row TAPS - 1 + u
            live = cm[None, :] & tm[:, None]
            old = tl.load(state_ptr + (TAPS - 1 + u)[:, None] * chan + c[None, :], mask=live & (u < 0)[:, None],
                          other=0.0)  # fmt: skip
            new = tl.load(x_ptr + u[:, None] * x_pitch + c[None, :], mask=live & (u >= 0)[:, None], other=0.0)
            w = tl.load(w_ptr + c * TAPS + j, mask=cm, other=0.0)
            acc += (old + new) * w[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + t[:, None] * out_pitch + c[None, :], acc, mask=tm[:, None] & cm[None, :])
        if NORMED:  # a block is one head of the queries' and keys' channels
            if blk * BLOCK < 2 * KW:
                normed = acc / tl.sqrt(tl.sum(acc * acc, axis=1) + eps)[:, None]
                if blk * BLOCK < KW:
                    tl.store(q_ptr + t[:, None] * qk_pitch + c[None, :], normed, mask=tm[:, None])
                else:
                    tl.store(k_ptr + t[:, None] * qk_pitch + c[None, :] - KW, normed, mask=tm[:, None])
    if SHIFT:
        if rb == 0:  # the only program that read the old state (`row_tile`), after its reads
            for i in tl.static_range(TAPS - 1):
                src = rows - (TAPS - 1) + i  # the old state's rows read here are past every row written before
                kept = tl.load(state_ptr + (TAPS - 1 + src) * chan + c, mask=cm & (src < 0), other=0.0)
                fed = tl.load(x_ptr + src * x_pitch + c, mask=cm & (src >= 0), other=0.0)
                tl.store(state_ptr + i * chan + c, kept + fed, mask=cm)


def row_tile(rows: int, taps: int) -> int:
    """Rows a program convolves (RT): all of a step's few rows (a decode step's one) in one block, else ROW_TILE
    but never fewer than the state's taps - 1 rows, so only the first row block reads the old state and may
    move it."""
    if rows <= ROW_TILE:
        return triton.next_power_of_2(rows)
    return max(ROW_TILE, triton.next_power_of_2(taps - 1))


@triton.jit
def _conv_kernel(
    x_ptr, x_pitch, state_ptr, w_ptr, out_ptr, out_pitch, q_ptr, k_ptr, qk_pitch, rows, chan, eps,
    TAPS: tl.constexpr, BLOCK: tl.constexpr, RT: tl.constexpr, SILU: tl.constexpr, WRITE_OUT: tl.constexpr,
    SHIFT: tl.constexpr, NORMED: tl.constexpr, KW: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    conv_block(
        tl.program_id(0), tl.program_id(1), x_ptr, x_pitch, state_ptr, w_ptr, out_ptr, out_pitch, q_ptr, k_ptr,
        qk_pitch, rows, chan, eps, TAPS, BLOCK, RT, SILU, WRITE_OUT, SHIFT, NORMED, KW,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Normed:
    """Where a convolution's epilogue writes its query and key heads L2-normed: the first `key_width` channels
    are the queries, the next the keys, heads of `head` values."""

    q: Any  # (rows, key_width) f32
    k: Any  # (rows, key_width) f32
    key_width: int
    head: int
    eps: float


def conv(
    x: torch.Tensor, state: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, *, rows: int, chan: int,
    taps: int, silu: bool, shift: bool, normed: Normed | None = None,
) -> None:  # fmt: skip
    """Convolve `rows` rows of `x` (rows x chan, any row pitch) with the taps `w` (chan, taps) over `state`
    (taps - 1, chan, f32) into `out` (rows x chan), through SiLU where `silu`, the heads of `normed` L2-normed
    there too, and move the state on where `shift` (`out` None: the shift alone, ConvShift). One launch."""
    block = normed.head if normed is not None else BLOCK
    if normed is not None and (chan % block or normed.key_width % block):
        raise ValueError(f"a convolution's epilogue norms whole heads of {block} values")
    x2 = x.view(rows, -1) if x.is_contiguous() else x
    o = out if out is not None else x2
    qk = normed if normed is not None else None
    rt = row_tile(rows, taps)
    _conv_kernel[(triton.cdiv(chan, block), triton.cdiv(rows, rt) if out is not None else 1)](
        x2, x2.stride(0), state, w, o, o.view(rows, -1).stride(0) if out is not None else 0,
        qk.q if qk else o, qk.k if qk else o, qk.key_width if qk else 0, rows, chan, qk.eps if qk else 0.0,
        TAPS=taps, BLOCK=block, RT=rt, SILU=silu, WRITE_OUT=out is not None, SHIFT=shift, NORMED=qk is not None,
        KW=qk.key_width if qk else 0, **pdl.options(),
    )  # fmt: skip
