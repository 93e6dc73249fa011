"""A prefill chunk's products over f16 copies of the matrices (`prefill=f16-copy`), safe past f16's range.

cuBLAS multiplies f16 operands, and f16 holds no value past 65504, while a model's feed-forward activations
can reach 1e5-1e6 (llama.cpp's q8_1 form, an f32 scale a 32-value block, holds any of them). So the launch that
rounds the f32 activation to f16 (`to_f16`) also takes each row's largest |value|: a row past `gemm.F16_SAFE`
(2^14) is multiplied by the power of two 1/s that brings it under, and s (f32, one a row; 1 for a row that
fits) is written beside the f16 rows. The product's epilogue (`scaled_store`) multiplies each row by its s in
f32 before the bias and the residual (`gemm.store_tile`, the other prefill GEMMs' epilogue). A power of two
scales exactly, so a scaled row keeps f16's relative rounding (only a value the scale pushes below f16's
normals, 2^-14, rounds more: within 2^-25 s), and a row that fits is multiplied exactly as before: the same f16
operand, the same cuBLAS call, the same f32 adds in the same order.

The bound, 2^14 rather than 65504, leaves room to the product too, which cuBLAS rounds to f16: a scaled row's
product is at most 2^14 times the sum of a matrix row's |weights|, and far less where their signs mix. (A product
past 65504 all the same is not held: its f16 result is not finite, and the lane reports the op that made it.)

Launches a product: the rounding (which the cast to f16 took before), cuBLAS, and the epilogue (which took
torch's up-cast, its bias and residual adds and the copy into place before). Under `prefill=f16-scratch`
(`product_from_bytes`) no copy is kept: each product first decodes its matrix into one f16 scratch, a slab of
its rows at a time where it does not fit, one launch more a slab.

A gated pair (`gate_up_glu`, `gate_up_glu_from_bytes`) rounds its activation once for both products, and its
epilogue (`glu_store`) scales both back and joins them in the SwiGLU, so neither product is stored in f32.

An activation no later launch reads may be rounded into its own bytes (`to_f16_in_place`, each product's
`in_place`): row r's f16 values over the first half of its span, the same bits as the copy, without the copy's
buffer; the row is read twice (its largest value first), so the lane does so where memory asks
(`run/workspace`, the knob `round_in_place`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.plan.kernels import F16_SLAB_STEP
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemm import F16_SAFE, store_tile

# The f32 bit fields a power of two is built from: 2^e has the bits (e + BIAS) << MANTISSA_BITS.
MANTISSA_BITS = tl.constexpr(23)
MANTISSA_MASK = tl.constexpr((1 << 23) - 1)
EXPONENT_BIAS = tl.constexpr(127)
SAFE_EXPONENT = tl.constexpr(int(math.log2(F16_SAFE.value)))  # 14: the in-kernel GEMM's bound, 2^14
# A program rounds one row, a block of its values at a time.
ROW_BLOCK = 1024
ROW_WARPS = 4
# The epilogue's tile: elementwise, rows of a few hundred bytes a program.
STORE_M = 16
STORE_N = 128
STORE_WARPS = 4


@triton.jit
def row_exponent(amax):
    """e >= 0, the least with amax / 2^e <= 2^14 (0 for a row that fits), from amax's f32 bits: integer steps
    only, so the compiled kernel and the interpreter agree exactly (no approximate log2 or exp2)."""
    bits = amax.to(tl.int32, bitcast=True)
    # ceil(log2(amax)) of a normal f32: its exponent, one more where any mantissa bit is set
    ceil_log2 = ((bits + MANTISSA_MASK) >> MANTISSA_BITS) - EXPONENT_BIAS
    return tl.maximum(ceil_log2 - SAFE_EXPONENT, 0)


@triton.jit
def power_of_two(e):
    """2^e as f32, built from its bits (exact)."""
    return ((e + EXPONENT_BIAS) << MANTISSA_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _to_f16_kernel(x, x_pitch, out, out_pitch, scales, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    src, dst = x + row * x_pitch, out + row * out_pitch
    cols = tl.arange(0, BLOCK)
    # one pass rounds the row as it is (a row that fits, nearly every row, is read once) and finds its largest
    amax = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, K, BLOCK):
        c = c0 + cols
        v = tl.load(src + c, mask=c < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
        tl.store(dst + c, v.to(tl.float16), mask=c < K)
    e = row_exponent(tl.max(amax, 0))
    if e > 0:  # a row past 2^14: written again, times 2^-e (exact), over what the first pass wrote
        tl.debug_barrier()
        inv = power_of_two(-e)
        for c0 in range(0, K, BLOCK):
            c = c0 + cols
            v = tl.load(src + c, mask=c < K, other=0.0).to(tl.float32)
            tl.store(dst + c, (v * inv).to(tl.float16), mask=c < K)
    tl.store(scales + row, power_of_two(e))


@triton.jit
def _to_f16_in_place_kernel(x, pitch, scales, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    src = x + row * pitch
    dst = src.to(tl.pointer_type(tl.float16), bitcast=True)  # the row's own bytes: value c at byte 2c
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, K, BLOCK):  # the largest first: the rounding overwrites the values it would re-read
        c = c0 + cols
        amax = tl.maximum(amax, tl.abs(tl.load(src + c, mask=c < K, other=0.0)))
    e = row_exponent(tl.max(amax, 0))
    inv = power_of_two(-e)  # 1 for a row that fits: the cast's bits
    for c0 in range(0, K, BLOCK):
        c = c0 + cols
        v = tl.load(src + c, mask=c < K, other=0.0)
        # a block's f16 values land on f32 values of the same block or before it, which other warps may still
        # be loading: every load of the block first
        tl.debug_barrier()
        tl.store(dst + c, (v * inv).to(tl.float16), mask=c < K)
    tl.store(scales + row, power_of_two(e))


@triton.jit
def _scaled_store_kernel(
    y, y_pitch, scales, m, n, bias, res, res_pitch, out, out_pitch, pos,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, AT_ROW: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    xm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    keep = (xm < m)[:, None] & (rows < n)[None, :]
    acc = tl.load(y + xm[:, None].to(tl.int64) * y_pitch + rows[None, :], mask=keep, other=0.0).to(tl.float32)
    acc = acc * tl.load(scales + xm, mask=xm < m, other=1.0)[:, None]
    store_tile(acc, xm, rows, m, n, bias, res, res_pitch, out, out_pitch, pos, HAS_BIAS, HAS_RES, AT_ROW)


@triton.jit
def _scaled_glu_kernel(
    g, g_pitch, u, u_pitch, scales, m, n, out, out_pitch,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    xm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    keep = (xm < m)[:, None] & (cols < n)[None, :]
    s = tl.load(scales + xm, mask=xm < m, other=1.0)[:, None]
    at = xm[:, None].to(tl.int64)
    gate = tl.load(g + at * g_pitch + cols[None, :], mask=keep, other=0.0).to(tl.float32) * s
    up = tl.load(u + at * u_pitch + cols[None, :], mask=keep, other=0.0).to(tl.float32) * s
    # the GLU as `misc.glu_act_mul` takes it from the two products' f32 stores: the same bits, one launch
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out + at * out_pitch + cols[None, :], silu * up, mask=keep)


def to_f16(x: torch.Tensor, out: torch.Tensor, scales: torch.Tensor, *, block: int = ROW_BLOCK) -> None:
    """out (m, k) f16 = x (m, k, f32 or f16) / s, scales (m,) f32 = s: s = 1 for a row whose |values| are at most 2^14,
    else the least power of two that brings them under. Rows at any pitch, unit column stride. `block`, the
    values a step of the kernel takes, is a parameter only so tests reach several steps."""
    m, k = x.shape
    if x.dtype not in (torch.float32, torch.float16) or x.stride(1) != 1:
        raise ValueError(f"x must be an f32 or f16 (m, {k}) tensor with unit column stride")
    if out.dtype != torch.float16 or tuple(out.shape) != (m, k) or out.stride(1) != 1:
        raise ValueError(f"out must be an f16 ({m}, {k}) tensor with unit column stride")
    if scales.dtype != torch.float32 or scales.numel() != m or not scales.is_contiguous():
        raise ValueError(f"scales must be a contiguous f32 ({m},) tensor")
    block = min(block, triton.next_power_of_2(k))
    _to_f16_kernel[(m,)](
        x, x.stride(0), out, out.stride(0), scales, K=k, BLOCK=block, num_warps=ROW_WARPS, **pdl.options()
    )


def to_f16_in_place(x: torch.Tensor, scales: torch.Tensor, *, block: int = ROW_BLOCK) -> torch.Tensor:
    """`to_f16` of the f32 rows `x` (m, k, any pitch, unit column stride) into their own bytes, for an activation
    no later launch reads: row r's f16 values take the first 2k bytes of its span. Returns them as an (m, k) f16
    view (pitch twice x's). Each row is read twice (its largest |value| first), where `to_f16` reads a row that
    fits once: it saves the f16 copy's bytes, not time."""
    m, k = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"x must be an f32 (m, {k}) tensor with unit column stride")
    if scales.dtype != torch.float32 or scales.numel() != m or not scales.is_contiguous():
        raise ValueError(f"scales must be a contiguous f32 ({m},) tensor")
    block = min(block, triton.next_power_of_2(k))
    _to_f16_in_place_kernel[(m,)](x, x.stride(0), scales, K=k, BLOCK=block, num_warps=ROW_WARPS, **pdl.options())
    return torch.as_strided(x.view(torch.float16), (m, k), (2 * x.stride(0), 1))


def scaled_store(
    y: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_row: tuple[torch.Tensor, int] | None = None,
) -> None:
    """out (m, n) = y (m, n, f16) * s (one a row) (+ bias) (+ residual), in f32, stored in out's type; with
    `out_row` = (pos, pitch) the rows land from row pos[0] of the table `out`, as `gemm.gemm`'s do."""
    m, n = y.shape
    if y.stride(1) != 1 or out.stride(1) != 1 or (out_row is None and tuple(out.shape) != (m, n)):
        raise ValueError(f"y and out must be ({m}, {n}) tensors with unit column stride")
    if residual is not None and (tuple(residual.shape) != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be ({m}, {n}) with unit column stride")
    if bias is not None and (bias.numel() != n or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous ({n},) tensor")
    pos, pitch = out_row if out_row is not None else (scales, out.stride(0))
    grid = (triton.cdiv(n, STORE_N), triton.cdiv(m, STORE_M))
    _scaled_store_kernel[grid](
        y, y.stride(0), scales, m, n,
        y if bias is None else bias,
        y if residual is None else residual,
        out.stride(0) if residual is None else residual.stride(0),
        out, pitch, pos,
        BLOCK_M=STORE_M, BLOCK_N=STORE_N,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, AT_ROW=out_row is not None,
        num_warps=STORE_WARPS, **pdl.options(),
    )  # fmt: skip


def glu_store(gate: torch.Tensor, up: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """out (m, n, f32) = silu(gate * s) * (up * s), s one a row: a gated pair's two f16 products (cuBLAS's,
    of the rows `to_f16` scaled) scaled back and joined in f32, so neither product is ever stored in f32."""
    m, n = gate.shape
    for name, t in (("gate", gate), ("up", up), ("out", out)):
        if tuple(t.shape) != (m, n) or t.stride(1) != 1:
            raise ValueError(f"{name} must be an ({m}, {n}) tensor with unit column stride")
    if out.dtype != torch.float32:
        raise ValueError("out must be f32")
    grid = (triton.cdiv(n, STORE_N), triton.cdiv(m, STORE_M))
    _scaled_glu_kernel[grid](
        gate, gate.stride(0), up, up.stride(0), scales, m, n, out, out.stride(0),
        BLOCK_M=STORE_M, BLOCK_N=STORE_N, num_warps=STORE_WARPS, **pdl.options(),
    )  # fmt: skip


def gate_up_glu(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, *, in_place: bool = False
) -> torch.Tensor:
    """out (m, n, f32) = silu(x @ gate^T) * (x @ up^T), gate and up the (n, k) f16 copies of a gated pair: x
    rounded once for both products (into its own bytes with `in_place`, where x dies here), the GLU in the
    products' epilogue (`glu_store`). Returns `out`."""
    x16, scales = _rounded(x, in_place)
    glu_store(x16 @ gate.T, x16 @ up.T, scales, out)
    return out


def gate_up_glu_from_bytes(
    x: torch.Tensor, gate: tuple[torch.Tensor, Any], up: tuple[torch.Tensor, Any], n: int, k: int,
    scratch: torch.Tensor, out: torch.Tensor, *, in_place: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`gate_up_glu` with the pair's matrices as checkpoint rows, each (bytes, format): a slab of the gate's rows
    and the same slab of the up's decoded side by side into `scratch` (`prefill=f16-scratch`), one cuBLAS
    product over both, the GLU in its epilogue into those columns of `out`. Returns `out`."""
    from fuselane.lanes.cuda.triton.gemv.epilogue import dequantize

    x16, scales = _rounded(x, in_place)
    rows = _slab_rows(n, scratch.numel() // (2 * k))
    if rows < 1:
        raise ValueError(f"a scratch of {scratch.numel()} values holds no pair of rows of {k}")
    for n0 in range(0, n, rows):
        s = min(n, n0 + rows) - n0
        pair = scratch[: 2 * s * k].view(2 * s, k)
        for half, (w, fmt) in enumerate((gate, up)):
            row_bytes = w.numel() // n
            dequantize(w[n0 * row_bytes : (n0 + s) * row_bytes], fmt, s, k, pair[half * s : (half + 1) * s])
        both = x16 @ pair.T
        glu_store(both[:, :s], both[:, s:], scales, out[:, n0 : n0 + s])
        del both  # else the next slab's product is allocated while this one is still held: two at once
    return out


def _slab_rows(n: int, fits: int) -> int:
    """The rows of a matrix a slab takes: all n where they fit, else as few slabs as whole
    `kernels.F16_SLAB_STEP`s of the `fits` the scratch holds allow, their rows as even as whole steps make them
    (only a scratch of fewer rows than a step takes all it holds).

    Why even: a last slab of the leftover rows made a narrow product (a 7B's down in slabs of 1,664, 1,664 and
    256 rows), which cuBLAS runs on a few of the chip's SMs for the whole of its long k; 1,280, 1,280 and 1,024
    are the same three slabs, each wide enough to fill it."""
    if fits >= n:
        return n
    most = fits // F16_SLAB_STEP * F16_SLAB_STEP
    if most == 0:
        return fits
    slabs = math.ceil(n / most)
    return math.ceil(n / slabs / F16_SLAB_STEP) * F16_SLAB_STEP


def _rounded(x: torch.Tensor, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x rounded to f16 under its rows' scales, the scales): `to_f16` into a fresh buffer, or with `in_place`
    (x dies at this product) `to_f16_in_place` into x's own bytes."""
    m, k = x.shape
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    if in_place:
        return to_f16_in_place(x, scales), scales
    x16 = torch.empty((m, k), dtype=torch.float16, device=x.device)
    to_f16(x, x16, scales)
    return x16, scales


def product_from_bytes(
    x: torch.Tensor, w: torch.Tensor, fmt: Any, n: int, k: int, scratch: torch.Tensor, out: torch.Tensor,
    *, in_place: bool = False, **epilogue: Any,
) -> torch.Tensor:  # fmt: skip
    """`product` of x (m, k, f32) and the n x k checkpoint rows `w` (1-D uint8, in `fmt`), the matrix decoded to
    f16 into `scratch` (1-D f16, shared by every product: `prefill=f16-scratch`) just before cuBLAS takes it,
    rather than kept as a copy. A matrix past the scratch (a vocabulary's output rows) goes in slabs of its
    rows, each multiplied into its columns of `out`. With `in_place` x (dying here) is rounded in its own
    bytes. Returns `out`."""
    from fuselane.lanes.cuda.triton.gemv.epilogue import dequantize

    x16, scales = _rounded(x, in_place)
    rows = _slab_rows(n, scratch.numel() // k)
    if rows < 1:
        raise ValueError(f"a scratch of {scratch.numel()} values holds no row of {k}")
    row_bytes = w.numel() // n
    bias, residual, out_row = (epilogue.get(e) for e in ("bias", "residual", "out_row"))
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        dense = dequantize(w[n0 * row_bytes : n1 * row_bytes], fmt, n1 - n0, k, scratch[: (n1 - n0) * k].view(-1, k))
        scaled_store(
            x16 @ dense.T, scales, out[:, n0:n1],
            bias=None if bias is None else bias[n0:n1],
            residual=None if residual is None else residual[:, n0:n1],
            out_row=out_row,
        )  # fmt: skip
    return out


def product(
    x: torch.Tensor, dense: torch.Tensor, out: torch.Tensor, *, in_place: bool = False, **epilogue: Any
) -> torch.Tensor:
    """out (m, n) = x (m, k, f32) @ dense^T (dense the (n, k) f16 copy of a matrix) with `scaled_store`'s
    `epilogue` (bias, residual, out_row): x rounded to f16 under its rows' scales (into its own bytes with
    `in_place`, where x dies at this product), multiplied by cuBLAS, scaled back in f32; returns `out`."""
    x16, scales = _rounded(x, in_place)
    scaled_store(x16 @ dense.T, scales, out, **epilogue)
    return out
