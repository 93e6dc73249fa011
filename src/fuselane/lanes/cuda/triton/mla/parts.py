"""The absorbed form's small launches: the join of each head's two parts (the query's absorbed latent and its
rotated part; the normed latent and the rotated shared key of a cache row), the rotation of a head's pairs by
a table of frequencies, and the cache row's join written in place (`norm_rope`: the latent's norm and the key's
rotation in one launch, JoinInPlace; the query's is `heads.head_matmul` with a rotation).

The rotation takes DeepSeek's pairs (2j, 2j + 1) or NEOX's (j, j + hd/2), and its frequencies from a table
the binder computes once in f64 (`lanes.cpu.latent_kernels.inv_freq`: YaRN's stretch where the file has it),
so the kernel is the same for every scaling. The angle is the position (read on the device, so a captured
graph replays at any position) times the frequency, in f32. The input is read in place at any pitch (the
rotated slice of the query's projection, or of the latent's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import norm, pdl

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
def rope_row(x, x_row, x_head, dst, pos, inv, r, h, PAIRS: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr,
             BATCHED: tl.constexpr):  # fmt: skip
    """Row `r`'s head `h` of `x` turned into the `2 * PAIRS` values at `dst` (`_rope_kernel`'s program; the
    launches that write a join's two parts in place, `norm_rope` and `heads.head_matmul`'s rotation, call it)."""
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
    # in `dst`'s precision (a cache row's f16, to nearest: `rope.set_rows`' rounding)
    tl.store(dst + first, (a * c - b * s).to(dst.dtype.element_ty), mask=keep)
    tl.store(dst + second, (a * s + b * c).to(dst.dtype.element_ty), mask=keep)


@triton.jit
def _rope_kernel(x, x_row, x_head, out, pos, inv, HEADS: tl.constexpr, PAIRS: tl.constexpr,
                 BLOCK: tl.constexpr, HALF: tl.constexpr, BATCHED: tl.constexpr,
                 PDL: tl.constexpr = False):  # fmt: skip
    pdl.begin(PDL)
    r, h = tl.program_id(0), tl.program_id(1)
    dst = out + (r.to(tl.int64) * HEADS + h) * (2 * PAIRS)
    rope_row(x, x_row, x_head, dst, pos, inv, r, h, PAIRS, BLOCK, HALF, BATCHED)


@triton.jit
def cache_row(x, x_row, w, k, k_row, out, out_row, pos, inv, cols, eps, r, part, BLOCK: tl.constexpr,
              CHUNKS: tl.constexpr, PAIRS: tl.constexpr, BLOCK_P: tl.constexpr, HALF: tl.constexpr,
              BATCHED: tl.constexpr, AT_POS: tl.constexpr):  # fmt: skip
    """Row `r`'s `part` of the cache row's join: 0 its latent normed into the row's first `cols` values, 1 its
    key turned into the rest (`_norm_rope_kernel`'s two programs a row; the latent attention's prologue,
    `prologue.py`, calls it beside the query's join)."""
    if AT_POS:  # row r lands at the cache's row pos[0] + r, rounded to the cache's precision in the store
        out += tl.load(pos).to(tl.int64) * out_row
    if part == 0:  # the normed latent: the row's first `cols` values
        norm.rms_norm_unit(x, x, out, w, out, x_row, x_row, out_row, out_row, out, out, out, cols, eps,
                           r.to(tl.int64), 0, False, True, BLOCK, CHUNKS, False)  # fmt: skip
    else:  # the rotated key after it
        rope_row(k, k_row, 0, out + r.to(tl.int64) * out_row + cols, pos, inv, r, 0, PAIRS, BLOCK_P, HALF, BATCHED)


@triton.jit
def _norm_rope_kernel(x, x_row, w, k, k_row, out, out_row, pos, inv, cols, eps, BLOCK: tl.constexpr,
                      CHUNKS: tl.constexpr, PAIRS: tl.constexpr, BLOCK_P: tl.constexpr, HALF: tl.constexpr,
                      BATCHED: tl.constexpr, AT_POS: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl.begin(PDL)
    cache_row(x, x_row, w, k, k_row, out, out_row, pos, inv, cols, eps, tl.program_id(0), tl.program_id(1), BLOCK,
              CHUNKS, PAIRS, BLOCK_P, HALF, BATCHED, AT_POS)  # fmt: skip


@dataclass(frozen=True, slots=True)
class CacheJoin:
    """The cache row's join (JoinInPlace), each of `rows` rows: its latent `x` (rows, cols) normed by the weights
    `w` (as `norm.rms_norm`, bit for bit: its program at its warps), then its key's `hd` values of `k` (rows `k_row`
    apart) turned as `rope` turns them, by the table `inv` at the position `pos`, into `out` (rows, cols + hd).
    `at_pos`: `out` is the cache, row i written at its row pos[0] + i in its precision (as `rope.set_rows`
    rounds: to nearest, ties to even), so no row write follows."""

    x: torch.Tensor
    w: torch.Tensor
    eps: float
    k: torch.Tensor
    k_row: int
    out: torch.Tensor
    pos: torch.Tensor
    inv: torch.Tensor
    rows: int
    hd: int
    half: bool
    batched: bool = False
    at_pos: bool = False

    def __post_init__(self) -> None:
        if self.out.stride(-1) != 1 or self.x.stride(-1) != 1 or self.out.shape[-1] != self.w.numel() + self.hd:
            raise ValueError("norm_rope: unit-stride rows, the output as wide as the latent and the key")
        if self.at_pos and self.batched:
            raise ValueError("norm_rope: a batch's rows are written at their own positions by a row write")
        if self.hd % 2 or self.inv.numel() != self.hd // 2:
            raise ValueError(f"norm_rope: {self.hd} values need {self.hd // 2} frequencies, not {self.inv.numel()}")

    def args(self) -> tuple:
        """The kernels' runtime arguments (`cache_row`'s, up to the row)."""
        x, out = self.x, self.out
        return x, x.stride(0), self.w, self.k, self.k_row, out, out.stride(0), self.pos, self.inv, self.w.numel(), \
            float(self.eps)  # fmt: skip

    def constants(self) -> tuple:
        """The kernels' constexprs, in `cache_row`'s order (BLOCK, CHUNKS, PAIRS, BLOCK_P, HALF, BATCHED, AT_POS)."""
        tile = norm.row_tile(self.w.numel())
        pairs = self.hd // 2
        return tile.block, tile.chunks, pairs, triton.next_power_of_2(pairs), self.half, self.batched, self.at_pos

    def launch(self) -> None:
        """The join alone: one launch of two programs a row (the norm's at its warps)."""
        _norm_rope_kernel[(self.rows, 2)](
            *self.args(), *self.constants(), num_warps=norm.row_tile(self.w.numel()).warps, **pdl.options()
        )  # fmt: skip


def norm_rope(
    x: torch.Tensor, w: torch.Tensor, eps: float, k: torch.Tensor, k_row: int, out: torch.Tensor, pos: torch.Tensor,
    inv: torch.Tensor, *, rows: int, hd: int, half: bool, batched: bool = False, at_pos: bool = False,
) -> None:  # fmt: skip
    """The cache row's join (`CacheJoin`) in one launch of two programs a row (JoinInPlace)."""
    CacheJoin(x, w, eps, k, k_row, out, pos, inv, rows, hd, half, batched, at_pos).launch()


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
