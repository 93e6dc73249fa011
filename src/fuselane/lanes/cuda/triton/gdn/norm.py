"""The gated RMS norm of the rule's output (GatedNorm) and the heads' L2 norm apart from the convolution (where
its epilogue does not take them), one launch each, a program a head of a row.

Under int8 activations the gated norm writes its result's int8 form in its store too (GdnOutputQuant, for
`ssm_out`'s int8 GEMV): a head of whole 32-value blocks is whole blocks of its row, so a program quantizes its
own head's blocks (`quant.quantize_block`, the arithmetic of the `Quantize` launch it replaces)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.gguf.formats import QK
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.quant import QB_C, Q8Acts, check_acts, quantize_block


@triton.jit
def store_head_q8(v, u, oq, od, os_, D: tl.constexpr):
    """Quantize head u's values v [D_P2] (its first D live, D whole 32-value blocks) into a Q8Acts' codes,
    scales and sums, the head's blocks at u * D / 32 of the flat rows; the blocks past D dropped."""
    B: tl.constexpr = v.shape[0] // QB_C
    codes, d, sums = quantize_block(tl.reshape(v, [B, QB_C]), QB_C)
    blk = tl.arange(0, B)
    live = blk < D // QB_C
    at = u * (D // QB_C) + blk
    tl.store(oq + at[:, None] * QB_C + tl.arange(0, QB_C)[None, :], codes, mask=live[:, None])
    tl.store(od + at, d, mask=live)
    tl.store(os_ + at[:, None] * 2 + tl.arange(0, 2)[None, :], sums, mask=live[:, None])


@triton.jit
def gate_normed(x, j, m, w_ptr, z_ptr, eps, D: tl.constexpr):
    """A head's values x [D_P2] (those at `j` under `m` live, the rest zero) normed and gated: x / sqrt(mean(x^2)
    + eps) * w * silu(z), z the head's gate values at z_ptr."""
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    z = tl.load(z_ptr + j, mask=m, other=0.0)
    w = tl.load(w_ptr + j, mask=m, other=0.0)
    return x * r * w * (z * tl.sigmoid(z))


@triton.jit
def _gated_norm_kernel(
    x_ptr, w_ptr, z_ptr, out_ptr, oq, od, os_, eps,
    D: tl.constexpr, D_P2: tl.constexpr, Q8OUT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    u = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, D_P2)
    m = j < D
    x = tl.load(x_ptr + u * D + j, mask=m, other=0.0)
    y = gate_normed(x, j, m, w_ptr, z_ptr + u * D, eps, D)
    tl.store(out_ptr + u * D + j, y, mask=m)
    if Q8OUT:
        store_head_q8(y, u, oq, od, os_, D)


def check_head_q8(out_q8: Q8Acts | None, units: int, d: int) -> None:
    """Refuse an int8 form (where given) that `store_head_q8` cannot write for `units` heads of `d` values:
    heads not whole 32-value blocks, or a form not of their values."""
    if out_q8 is None:
        return
    if d % QK:
        raise ValueError(f"the gated norm quantizes heads of whole {QK}-value blocks, not {d}")
    check_acts(out_q8, out_q8.q.shape[1], out_q8.q.shape[0])
    if out_q8.q.numel() != units * d:
        raise ValueError("the gated norm's int8 form holds its output's values")


def gated_norm(
    x: torch.Tensor, w: torch.Tensor, z: torch.Tensor, out: torch.Tensor, *, units: int, d: int, eps: float,
    out_q8: Q8Acts | None = None,
) -> None:  # fmt: skip
    """out = x / sqrt(mean(x^2) + eps) * w * silu(z), each of `units` heads of `d` values (x, z, out contiguous,
    units x d; w: (d,)). With `out_q8` (GdnOutputQuant: heads of whole 32-value blocks, the Q8Acts of the
    output's rows) the launch writes the result's int8 form too."""
    check_head_q8(out_q8, units, d)
    q = out_q8 if out_q8 is not None else (out, out, out)
    _gated_norm_kernel[(units,)](
        x, w, z, out, *q, float(eps),
        D=d, D_P2=triton.next_power_of_2(d), Q8OUT=out_q8 is not None, **pdl.options(),
    )  # fmt: skip


@triton.jit
def _l2_kernel(x_ptr, x_pitch, out_ptr, eps, PER_ROW: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
               PDL: tl.constexpr):  # fmt: skip
    pdl.begin(PDL)
    u = tl.program_id(0)
    j = tl.arange(0, D_P2)
    m = j < D
    x = tl.load(x_ptr + (u // PER_ROW) * x_pitch + (u % PER_ROW) * D + j, mask=m, other=0.0)
    tl.store(out_ptr + u.to(tl.int64) * D + j, x / tl.sqrt(tl.sum(x * x, axis=0) + eps), mask=m)


def l2_norm(x: torch.Tensor, out: torch.Tensor, *, units: int, d: int, eps: float) -> None:
    """Each head of `d` values of x (rows x heads * d, any row pitch) over sqrt(its sum of squares + eps), into
    `out` (units x d, contiguous)."""
    rows = x.shape[0] if x.dim() == 2 else 1
    pitch = x.stride(0) if x.dim() == 2 else 0
    per_row = units // rows
    _l2_kernel[(units,)](x, pitch, out, float(eps), PER_ROW=per_row, D=d, D_P2=triton.next_power_of_2(d),
                         **pdl.options())  # fmt: skip
