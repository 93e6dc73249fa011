"""The absorbed form's small launches: the join of each head's two parts (the query's absorbed latent and its
rotated part; the normed latent and the rotated shared key of a cache row), and the rotation of a head's
pairs by a table of frequencies.

The rotation takes DeepSeek's pairs (2j, 2j + 1) or NEOX's (j, j + hd/2), and its frequencies from a table
the binder computes once in f64 (`lanes.cpu.latent_kernels.inv_freq`: YaRN's stretch where the file has it),
so the kernel is the same for every scaling. The angle is the position (read on the device, so a captured
graph replays at any position) times the frequency, in f32. The input is read in place at any pitch (the
rotated slice of the query's projection, or of the latent's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import pdl

WARPS = 1


@triton.jit
def _join_kernel(a, a_row, b, b_row, out, HEADS: tl.constexpr, WA: tl.constexpr, WB: tl.constexpr,
                 BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl.begin(PDL)
    r, h = tl.program_id(0), tl.program_id(1)
    ia, ib = tl.arange(0, BLOCK_A), tl.arange(0, BLOCK_B)
    o = out + r.to(tl.int64) * HEADS * (WA + WB) + h * (WA + WB)
    va = tl.load(a + r.to(tl.int64) * a_row + h * WA + ia, mask=ia < WA)
    tl.store(o + ia, va, mask=ia < WA)
    vb = tl.load(b + r.to(tl.int64) * b_row + h * WB + ib, mask=ib < WB)
    tl.store(o + WA + ib, vb, mask=ib < WB)


def join(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, rows: int, heads: int, wa: int, wb: int) -> None:
    """out (rows, heads * (wa + wb)): each head's `wa` values of `a` (rows, heads * wa) then its `wb` of `b`;
    `a` and `b` unit-stride within a row, at any row pitch."""
    for t in (a, b, out):
        if t.stride(-1) != 1:
            raise ValueError("join: every row must be unit-stride")
    a_row = a.stride(0) if a.dim() == 2 else heads * wa
    b_row = b.stride(0) if b.dim() == 2 else heads * wb
    _join_kernel[(rows, heads)](
        a, a_row, b, b_row, out, heads, wa, wb, triton.next_power_of_2(wa), triton.next_power_of_2(wb),
        num_warps=WARPS, **pdl.options()
    )  # fmt: skip


@triton.jit
def _rope_kernel(x, x_row, x_head, out, pos, inv, HEADS: tl.constexpr, PAIRS: tl.constexpr,
                 BLOCK: tl.constexpr, HALF: tl.constexpr, BATCHED: tl.constexpr,
                 PDL: tl.constexpr = False):  # fmt: skip
    pdl.begin(PDL)
    r, h = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, BLOCK)
    keep = j < PAIRS
    if BATCHED:  # each row its own sequence at its own position
        p = tl.load(pos + r).to(tl.float32)
    else:
        p = (tl.load(pos) + r).to(tl.float32)
    angle = p * tl.load(inv + j, mask=keep, other=0.0)
    c, s = tl.cos(angle), tl.sin(angle)
    if HALF:  # NEOX: value j with j + hd/2
        first = j
        second = j + PAIRS
    else:  # DeepSeek: value 2j with 2j + 1
        first = 2 * j
        second = 2 * j + 1
    src = x + r.to(tl.int64) * x_row + h * x_head
    a = tl.load(src + first, mask=keep).to(tl.float32)
    b = tl.load(src + second, mask=keep).to(tl.float32)
    dst = out + (r.to(tl.int64) * HEADS + h) * (2 * PAIRS)
    tl.store(dst + first, a * c - b * s, mask=keep)
    tl.store(dst + second, a * s + b * c, mask=keep)


def rope(
    x: torch.Tensor, x_row: int, x_head: int, out: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, *,
    rows: int, heads: int, hd: int, half: bool, batched: bool = False,
) -> None:  # fmt: skip
    """out (rows, heads * hd), contiguous: each head of `x` (a head's `hd` values `x_head` apart, a row's heads
    `x_row` apart) turned by the angles (pos[0] + row) * inv[j] (pos[row] where `batched`), inv the hd/2
    frequencies (f32 on the device)."""
    if hd % 2 or inv.numel() != hd // 2:
        raise ValueError(f"rope: {hd} values need {hd // 2} frequencies, not {inv.numel()}")
    pairs = hd // 2
    _rope_kernel[(rows, heads)](
        x, x_row, x_head, out, pos, inv, heads, pairs, triton.next_power_of_2(pairs), half, batched,
        num_warps=WARPS, **pdl.options()
    )  # fmt: skip
