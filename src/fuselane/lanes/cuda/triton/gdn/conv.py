"""The causal depth-wise convolution of a gated delta-rule layer, with its state, in one launch.

A program owns a block of channels for every row of the step (a decode step's one row, or a chunk's rows in
turn): row t of channel c is sum_j w[c, j] * seq[t + j], where seq is the state's taps - 1 rows (the inputs
before this step, oldest first) followed by the step's rows. The same program then moves the state to the last
taps - 1 inputs of seq: it reads the old state only at rows it has not yet written, so no other program and no
later row sees a half-moved state. SiLU (ConvBiasSilu) and, for the query and key channels, each head's L2
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


@triton.jit
def conv_block(
    blk, x_ptr, x_pitch, state_ptr, w_ptr, out_ptr, out_pitch, q_ptr, k_ptr, qk_pitch, rows, chan, eps,
    TAPS: tl.constexpr, BLOCK: tl.constexpr, SILU: tl.constexpr, WRITE_OUT: tl.constexpr, SHIFT: tl.constexpr,
    NORMED: tl.constexpr, KW: tl.constexpr,
):  # fmt: skip
    """Block `blk` of a convolution's channels over the step's rows, then its state's shift (see the module)."""
    c = blk * BLOCK + tl.arange(0, BLOCK)
    cm = c < chan
    if WRITE_OUT:
        t = 0
        while t < rows:  # a while loop: the interpreter cannot range over a runtime bound
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for j in tl.static_range(TAPS):
                u = t + j - (TAPS - 1)  # the input's row in the step; below 0 the state's row TAPS - 1 + u
                old = tl.load(state_ptr + (TAPS - 1 + u) * chan + c, mask=cm & (u < 0), other=0.0)
                new = tl.load(x_ptr + u * x_pitch + c, mask=cm & (u >= 0), other=0.0)
                w = tl.load(w_ptr + c * TAPS + j, mask=cm, other=0.0)
                acc += (old + new) * w
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(out_ptr + t * out_pitch + c, acc, mask=cm)
            if NORMED:  # a block is one head of the queries' and keys' channels
                if blk * BLOCK < 2 * KW:
                    normed = acc / tl.sqrt(tl.sum(acc * acc, axis=0) + eps)
                    if blk * BLOCK < KW:
                        tl.store(q_ptr + t * qk_pitch + c, normed)
                    else:
                        tl.store(k_ptr + t * qk_pitch + c - KW, normed)
            t += 1
    if SHIFT:
        for i in tl.static_range(TAPS - 1):
            u = rows - (TAPS - 1) + i  # the old state's rows read here are past every row written before
            old = tl.load(state_ptr + (TAPS - 1 + u) * chan + c, mask=cm & (u < 0), other=0.0)
            new = tl.load(x_ptr + u * x_pitch + c, mask=cm & (u >= 0), other=0.0)
            tl.store(state_ptr + i * chan + c, old + new, mask=cm)


@triton.jit
def _conv_kernel(
    x_ptr, x_pitch, state_ptr, w_ptr, out_ptr, out_pitch, q_ptr, k_ptr, qk_pitch, rows, chan, eps,
    TAPS: tl.constexpr, BLOCK: tl.constexpr, SILU: tl.constexpr, WRITE_OUT: tl.constexpr, SHIFT: tl.constexpr,
    NORMED: tl.constexpr, KW: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    conv_block(
        tl.program_id(0), x_ptr, x_pitch, state_ptr, w_ptr, out_ptr, out_pitch, q_ptr, k_ptr, qk_pitch, rows,
        chan, eps, TAPS, BLOCK, SILU, WRITE_OUT, SHIFT, NORMED, KW,
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
    _conv_kernel[(triton.cdiv(chan, block),)](
        x2, x2.stride(0), state, w, o, o.view(rows, -1).stride(0) if out is not None else 0,
        qk.q if qk else o, qk.k if qk else o, qk.key_width if qk else 0, rows, chan, qk.eps if qk else 0.0,
        TAPS=taps, BLOCK=block, SILU=silu, WRITE_OUT=out is not None, SHIFT=shift, NORMED=qk is not None,
        KW=qk.key_width if qk else 0, **pdl.options(),
    )  # fmt: skip
