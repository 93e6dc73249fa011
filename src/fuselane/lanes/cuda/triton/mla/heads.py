"""Per-head products: out[m, h] = W[h] @ x[m, h], each of `heads` heads of each row times its own (b, a)
matrix, one launch for every head (the grid's third axis).

The query's unrotated part through the key half of the latent's expansion (`attn_k_b`, (h, kv_lora, nope))
and the attended latent through the value half (`attn_v_b`, (h, vdim, kv_lora)) are both stored as a head's
`b` checkpoint rows of `a` values, so a head is a GEMV over its own rows. A block format decodes the file's
bytes in registers through the GEMV's own helpers (`gemv.formats.dot_rows`); float rows (the converter's
f16 or f32, whatever their width; bf16 of a width that GEMV does not take) are read as floats. `x` is read in
place at any pitch: a head's `a` values start `x_head` apart and a row's heads `x_row` apart (the query's
unrotated slice is read where it lies).

With a rotation (`Turn`), the launch writes the query's join in place (JoinInPlace): each head's products, then
its rotated part, turned by one more column of programs as `parts.rope` turns it, so no join runs after.

With `out_q8` (GemvQuant: the value half's product, which `attn_output` reads in int8), each program also
writes its tile's int8 form, whole 32-value blocks of a head's outputs (the codes the `Quantize` launch would
write, `quant.store_quantized_rows`): a program takes `attn_kernels.HEAD_QUANT_ROWS` rows, so no block spans two
programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan import attn_kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.formats import SLOTS, dot_rows
from fuselane.lanes.cuda.triton.gemv.rows import plan, row_tiles, stages, tile
from fuselane.lanes.cuda.triton.mla import parts
from fuselane.lanes.cuda.triton.quant import QB_C, Q8Acts, store_quantized, store_quantized_rows

# Float rows the float kernel reads, by the torch dtype it views them as: BF16's as their 16 bits, widened in
# the kernel (the interpreter has no bfloat16), and only where the block formats' GEMV cannot take the rows
# (a width that is not whole 32-value units, as a tiny model's 16-value key half)
FLOATS = {Format.F32: torch.float32, Format.F16: torch.float16, Format.BF16: torch.int16}
BF16_SHIFT = tl.constexpr(16)  # a bf16's bits are an f32's upper half
# Output rows a program of the float kernel takes: a 32-value block, so it writes an int8 form too.
FLOAT_BLOCK_N = attn_kernels.HEAD_QUANT_ROWS


@triton.jit
def _rows_product(x, x_row, x_head, m, w, out, out_row, out_head, n, h, oq, od, os_, FMT: tl.constexpr,
                  ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past the head's end read its last row (no masked loads in the k loop); the store drops them.
    w_rows = w + (h * n).to(tl.int64) * ROW_BYTES + tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    mi = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    x_rows = x + tl.minimum(mi, m - 1).to(tl.int64) * x_row + h * x_head
    y = dot_rows(w_rows, x_rows, FMT, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES)
    mask = (mi < m)[:, None] & (rows < n)[None, :]
    tl.store(out + mi.to(tl.int64)[:, None] * out_row + h * out_head + rows[None, :], y, mask=mask)
    if QUANT:  # heads of whole blocks, no rotation: a row's values are its heads' outputs, out_row of them
        store_quantized_rows(y, mi, m, h * out_head + tl.program_id(0) * BLOCK_N, out_row, oq, od, os_)


@triton.jit
def _turn_rows(rx, rx_row, rx_head, out, out_row, out_head, n, m, h, pos, inv, first, COUNT: tl.constexpr,
               PAIRS: tl.constexpr, BLOCK_P: tl.constexpr, HALF: tl.constexpr, BATCHED: tl.constexpr):  # fmt: skip
    """Rows first.. first + COUNT - 1 (those under `m`) of head `h`'s rotated part, after its product's `n`
    values: the join's second part written in place."""
    for i in tl.static_range(COUNT):
        r = first + i
        if r < m:
            dst = out + r.to(tl.int64) * out_row + h * out_head + n
            parts.rope_row(rx, rx_row, rx_head, dst, pos, inv, r, h, PAIRS, BLOCK_P, HALF, BATCHED)


@triton.jit
def rows_program(
    x, x_row, x_head, m, w, out, out_row, out_head, n, rx, rx_row, rx_head, pos, inv, oq, od, os_,
    FMT: tl.constexpr, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PAIRS: tl.constexpr, BLOCK_P: tl.constexpr,
    HALF: tl.constexpr, BATCHED: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """Head `program_id(2)`'s program of the block formats' kernel (the prologue's heads' programs too)."""
    # PAIRS > 0: the grid's last column of programs turns each head's rows (`Turn`) instead of a product tile
    h = tl.program_id(2)
    if PAIRS > 0:
        if tl.program_id(0) == tl.num_programs(0) - 1:
            _turn_rows(rx, rx_row, rx_head, out, out_row, out_head, n, m, h, pos, inv, tl.program_id(1) * BLOCK_M,
                       BLOCK_M, PAIRS, BLOCK_P, HALF, BATCHED)  # fmt: skip
        else:
            _rows_product(x, x_row, x_head, m, w, out, out_row, out_head, n, h, oq, od, os_, FMT, ROW_BYTES, STEPS,
                          UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES, False)  # fmt: skip
    else:
        _rows_product(x, x_row, x_head, m, w, out, out_row, out_head, n, h, oq, od, os_, FMT, ROW_BYTES, STEPS,
                      UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES, QUANT)  # fmt: skip


@triton.jit
def _head_rows_kernel(
    x, x_row, x_head, m, w, out, out_row, out_head, n, rx, rx_row, rx_head, pos, inv, oq, od, os_,
    FMT: tl.constexpr, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PAIRS: tl.constexpr, BLOCK_P: tl.constexpr,
    HALF: tl.constexpr, BATCHED: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.begin(PDL)
    rows_program(x, x_row, x_head, m, w, out, out_row, out_head, n, rx, rx_row, rx_head, pos, inv, oq, od, os_, FMT,
                 ROW_BYTES, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES, PAIRS, BLOCK_P, HALF, BATCHED,
                 QUANT)  # fmt: skip


@triton.jit
def _floats_product(x, x_row, x_head, w, out, out_row, out_head, n, a, h, mi, oq, od, os_, BLOCK_N: tl.constexpr,
                    BLOCK_A: tl.constexpr, BF16: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_A)
    keep = (rows < n)[:, None] & (cols < a)[None, :]
    wv = tl.load(w + (h * n + rows).to(tl.int64)[:, None] * a + cols[None, :], mask=keep, other=0)
    if BF16:
        wv = ((wv.to(tl.int32) & 0xFFFF) << BF16_SHIFT).to(tl.float32, bitcast=True)
    xv = tl.load(x + mi.to(tl.int64) * x_row + h * x_head + cols, mask=cols < a, other=0.0)
    y = tl.sum(wv.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    tl.store(out + mi.to(tl.int64) * out_row + h * out_head + rows, y, mask=rows < n)
    if QUANT:  # row mi's blocks of a row of out_row values
        row = mi.to(tl.int64)
        store_quantized(y, h * out_head + tl.program_id(0) * BLOCK_N, out_row, oq + row * out_row,
                        od + row * (out_row // QB_C), os_ + row * (out_row // QB_C * 2))  # fmt: skip


@triton.jit
def floats_program(
    x, x_row, x_head, w, out, out_row, out_head, n, a, rx, rx_row, rx_head, pos, inv, oq, od, os_,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, PAIRS: tl.constexpr, BLOCK_P: tl.constexpr, HALF: tl.constexpr,
    BATCHED: tl.constexpr, BF16: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """Head `program_id(2)`'s program of the float kernel, row `program_id(1)` (the prologue's too)."""
    h, mi = tl.program_id(2), tl.program_id(1)
    if PAIRS > 0:
        if tl.program_id(0) == tl.num_programs(0) - 1:
            dst = out + mi.to(tl.int64) * out_row + h * out_head + n
            parts.rope_row(rx, rx_row, rx_head, dst, pos, inv, mi, h, PAIRS, BLOCK_P, HALF, BATCHED)
        else:
            _floats_product(x, x_row, x_head, w, out, out_row, out_head, n, a, h, mi, oq, od, os_, BLOCK_N, BLOCK_A,
                            BF16, False)  # fmt: skip
    else:
        _floats_product(x, x_row, x_head, w, out, out_row, out_head, n, a, h, mi, oq, od, os_, BLOCK_N, BLOCK_A, BF16,
                        QUANT)  # fmt: skip


@triton.jit
def _head_floats_kernel(
    x, x_row, x_head, w, out, out_row, out_head, n, a, rx, rx_row, rx_head, pos, inv, oq, od, os_,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, PAIRS: tl.constexpr, BLOCK_P: tl.constexpr, HALF: tl.constexpr,
    BATCHED: tl.constexpr, BF16: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.begin(PDL)
    floats_program(x, x_row, x_head, w, out, out_row, out_head, n, a, rx, rx_row, rx_head, pos, inv, oq, od, os_,
                   BLOCK_N, BLOCK_A, PAIRS, BLOCK_P, HALF, BATCHED, BF16, QUANT)  # fmt: skip


def reads_floats(fmt: Format, a: int) -> bool:
    """Whether a head's `a`-value rows in `fmt` take the float kernel: F32 and F16 always, BF16 where its row is
    not whole units of the block formats' GEMV (which reads BF16 at its speed otherwise)."""
    return fmt in (Format.F32, Format.F16) or (fmt is Format.BF16 and a % SLOTS[fmt].unit != 0)


@dataclass(frozen=True, slots=True)
class Turn:
    """A rotation the product's launch writes beside each head's outputs (the query's join, JoinInPlace): each
    head's `hd` values of `x` (a head's `x_head` apart, a row's heads `x_row` apart) turned as `parts.rope` turns
    them, by the table `inv` at the position `pos`, into the `hd` values after the head's products."""

    x: torch.Tensor
    x_row: int
    x_head: int
    pos: torch.Tensor
    inv: torch.Tensor
    hd: int
    half: bool
    batched: bool = False

    def args(self) -> tuple:
        """The kernels' runtime arguments (rx, rx_row, rx_head, pos, inv)."""
        return self.x, self.x_row, self.x_head, self.pos, self.inv

    def constants(self) -> dict:
        """The kernels' constexprs (PAIRS, BLOCK_P, HALF, BATCHED)."""
        pairs = self.hd // 2
        return dict(PAIRS=pairs, BLOCK_P=triton.next_power_of_2(pairs), HALF=self.half, BATCHED=self.batched)


def _no_turn(out: torch.Tensor) -> tuple[tuple, dict]:
    """The kernels' rotation arguments where none is written (never read)."""
    return (out, 0, 0, out, out), dict(PAIRS=0, BLOCK_P=1, HALF=False, BATCHED=False)


@dataclass(frozen=True, slots=True)
class Launch:
    """A per-head product's launch, checked: the float kernel's or the block formats', its grid, its runtime
    arguments and its constexprs (`num_warps` among them) by name."""

    floats: bool
    grid: tuple[int, int, int]
    args: tuple
    constants: dict


def launch(
    x: torch.Tensor, x_row: int, x_head: int, m: int, w: torch.Tensor, fmt: Format, heads: int, a: int, b: int,
    out: torch.Tensor, turn: Turn | None = None, out_q8: Q8Acts | None = None,
) -> Launch:  # fmt: skip
    """`head_matmul`'s launch (its arguments as it takes them), checked."""
    fmt = Format(fmt)
    width = b + (turn.hd if turn is not None else 0)
    if out.stride(-1) != 1 or out.numel() != m * heads * width:
        raise ValueError(f"out must hold ({m}, {heads * width}) values with unit column stride")
    whole = turn is None and attn_kernels.head_product_quantizes(b)
    if out_q8 is not None and (not whole or tuple(out_q8.q.shape) != (m, heads * b)):
        raise ValueError(f"an int8 form is written for heads of whole 32-value blocks into ({m}, {heads * b}) codes")
    q8 = tuple(out_q8) if out_q8 is not None else (out, out, out)
    if turn is not None and (turn.hd % 2 or turn.inv.numel() != turn.hd // 2):
        raise ValueError(f"head_matmul: a rotation of {turn.hd} values needs {turn.hd // 2} frequencies")
    out_row = heads * width
    rargs, rconsts = (turn.args(), turn.constants()) if turn is not None else _no_turn(out)
    more = 1 if turn is not None else 0  # the rotation's column of programs
    quant = out_q8 is not None
    if reads_floats(fmt, a):
        grid = (triton.cdiv(b, FLOAT_BLOCK_N) + more, m, heads)
        args = (x, x_row, x_head, w.view(FLOATS[fmt]), out, out_row, width, b, a, *rargs, *q8)
        consts = dict(BLOCK_N=FLOAT_BLOCK_N, BLOCK_A=triton.next_power_of_2(a), **rconsts, BF16=fmt is Format.BF16,
                      QUANT=quant)  # fmt: skip
        return Launch(True, grid, args, consts)
    if fmt not in SLOTS:
        raise ValueError(f"no per-head product for {fmt.name} rows")
    block_n, warps = tile(fmt, b, a, m) if not quant else (attn_kernels.HEAD_QUANT_ROWS, attn_kernels.HEAD_QUANT_WARPS)
    block_m, m_tiles = row_tiles(m)
    steps, units, split = plan(fmt, a, block_n, warps, block_m)
    consts = dict(
        FMT=int(fmt), ROW_BYTES=stored_row_bytes(fmt, a), STEPS=steps, UNITS=units, SPLIT=split, BLOCK_M=block_m,
        BLOCK_N=block_n, STAGES=stages(fmt), **rconsts, QUANT=quant, num_warps=warps,
    )  # fmt: skip
    args = (x, x_row, x_head, m, w, out, out_row, width, b, *rargs, *q8)
    return Launch(False, (triton.cdiv(b, block_n) + more, m_tiles, heads), args, consts)


def head_matmul(
    x: torch.Tensor, x_row: int, x_head: int, m: int, w: torch.Tensor, fmt: Format, heads: int, a: int, b: int,
    out: torch.Tensor, turn: Turn | None = None, out_q8: Q8Acts | None = None,
) -> torch.Tensor:  # fmt: skip
    """out (m, heads * b) = each head's `a` values of each of the `m` rows of `x` (at pitches `x_row`,
    `x_head`) times its own `b` rows of `a` values of `w` (the checkpoint's bytes in `fmt`); returns `out`.
    With `turn`, out is (m, heads * (b + turn.hd)): each head's products, then its rotated part (one launch:
    the grid's last column of programs turns). With `out_q8` (m rows of heads * b), the launch writes out's
    int8 form too (heads of whole blocks, `attn_kernels.head_product_quantizes`, and no `turn`)."""
    run(launch(x, x_row, x_head, m, w, fmt, heads, a, b, out, turn, out_q8))
    return out


def run(go: Launch) -> None:
    """A per-head product's launch (`launch`) alone."""
    kernel = _head_floats_kernel if go.floats else _head_rows_kernel
    kernel[go.grid](*go.args, **go.constants, **pdl.options())
