"""Several causal convolutions of one step in one launch (ConvParts): at most four, each its own input, state,
taps and output, all of one length of taps, through the SiLU, the normed ones over heads of one width.

The launch's grid is (blocks of the widest part, parts): program (blk, p) runs block blk of part p exactly as
the convolution's own launch would (`conv.conv_block`: the rows, the SiLU, its heads' L2 norm where the part
norms them, the state's shift), so each part computes what it computes alone; a block past a narrower part's
channels does nothing (every load and store is masked by the part's channels). The block is one head where a
part norms its heads (every normed part one width: `plan/fits.py`), else `conv.BLOCK`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from fuselane.lanes.cuda.plan.kernels import CONV_PARTS
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gdn.conv import BLOCK, Normed, conv_block, row_tile


@dataclass(frozen=True, slots=True)
class Part:
    """One convolution of the launch: `x` (rows x chan, any row pitch), `state` (taps - 1, chan, f32), `w`
    (chan, taps, f32), `out` (rows x chan), its state moved on where `shift`, its heads in `normed` L2-normed."""

    x: Any
    state: Any
    w: Any
    out: Any
    chan: int
    shift: bool
    normed: Normed | None = None


@triton.jit
def _part(
    blk, rb, x_ptr, x_pitch, state_ptr, w_ptr, out_ptr, out_pitch, q_ptr, k_ptr, qk_pitch, rows, chan, eps,
    TAPS: tl.constexpr, BLOCK: tl.constexpr, RT: tl.constexpr, SHIFT: tl.constexpr, NORMED: tl.constexpr,
    KW: tl.constexpr,
):  # fmt: skip
    conv_block(
        blk, rb, x_ptr, x_pitch, state_ptr, w_ptr, out_ptr, out_pitch, q_ptr, k_ptr, qk_pitch, rows, chan, eps,
        TAPS, BLOCK, RT, True, True, SHIFT, NORMED, KW,
    )  # fmt: skip


@triton.jit
def _conv_parts_kernel(
    x0, xp0, s0, w0, o0, op0, q0, k0, qp0, c0, e0,
    x1, xp1, s1, w1, o1, op1, q1, k1, qp1, c1, e1,
    x2, xp2, s2, w2, o2, op2, q2, k2, qp2, c2, e2,
    x3, xp3, s3, w3, o3, op3, q3, k3, qp3, c3, e3,
    rows, TAPS: tl.constexpr, BLOCK: tl.constexpr, RT: tl.constexpr, PARTS: tl.constexpr,
    SH0: tl.constexpr, N0: tl.constexpr, KW0: tl.constexpr, SH1: tl.constexpr, N1: tl.constexpr, KW1: tl.constexpr,
    SH2: tl.constexpr, N2: tl.constexpr, KW2: tl.constexpr, SH3: tl.constexpr, N3: tl.constexpr, KW3: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    blk = tl.program_id(0)
    p = tl.program_id(1)
    rb = tl.program_id(2)
    if p == 0:
        _part(blk, rb, x0, xp0, s0, w0, o0, op0, q0, k0, qp0, rows, c0, e0, TAPS, BLOCK, RT, SH0, N0, KW0)
    if PARTS > 1:
        if p == 1:
            _part(blk, rb, x1, xp1, s1, w1, o1, op1, q1, k1, qp1, rows, c1, e1, TAPS, BLOCK, RT, SH1, N1, KW1)
    if PARTS > 2:
        if p == 2:
            _part(blk, rb, x2, xp2, s2, w2, o2, op2, q2, k2, qp2, rows, c2, e2, TAPS, BLOCK, RT, SH2, N2, KW2)
    if PARTS > 3:
        if p == 3:
            _part(blk, rb, x3, xp3, s3, w3, o3, op3, q3, k3, qp3, rows, c3, e3, TAPS, BLOCK, RT, SH3, N3, KW3)


def _block(parts: Sequence[Part]) -> int:
    """The launch's block: the normed parts' head (one width), else `conv.BLOCK`."""
    heads = {p.normed.head for p in parts if p.normed is not None}
    if len(heads) > 1:
        raise ValueError("a launch of convolutions norms heads of one width")
    block = heads.pop() if heads else BLOCK
    for p in parts:
        if p.normed is not None and (p.chan % block or p.normed.key_width % block):
            raise ValueError(f"a convolution's epilogue norms whole heads of {block} values")
    return block


def _args(p: Part, rows: int) -> tuple[list, tuple]:
    """A part's run-time arguments, and its constexprs (shift, normed, the queries' width)."""
    x2 = p.x.view(rows, -1) if p.x.is_contiguous() else p.x
    n = p.normed
    args = [x2, x2.stride(0), p.state, p.w, p.out, p.out.view(rows, -1).stride(0)]
    args += [n.q, n.k, n.key_width, p.chan, n.eps] if n is not None else [p.out, p.out, 0, p.chan, 0.0]
    return args, (p.shift, n is not None, n.key_width if n is not None else 0)


def conv_parts(parts: Sequence[Part], *, rows: int, taps: int) -> None:
    """Convolve each part's `rows` rows through the SiLU (its heads normed, its state moved, as it says), all in
    one launch. At most `CONV_PARTS` parts, one length of taps."""
    if not 0 < len(parts) <= CONV_PARTS:
        raise ValueError(f"a launch of convolutions takes 1 to {CONV_PARTS} parts, not {len(parts)}")
    block = _block(parts)
    runtime: list = []
    consts: dict[str, Any] = {}
    for i in range(CONV_PARTS):
        args, (shift, normed, kw) = _args(parts[min(i, len(parts) - 1)], rows)  # unused slots repeat the last
        runtime += args
        consts |= {f"SH{i}": shift, f"N{i}": normed, f"KW{i}": kw}
    rt = row_tile(rows, taps)
    grid = (max(triton.cdiv(p.chan, block) for p in parts), len(parts), triton.cdiv(rows, rt))
    _conv_parts_kernel[grid](*runtime, rows, TAPS=taps, BLOCK=block, RT=rt, PARTS=len(parts), **consts,
                             **pdl.options())  # fmt: skip
