"""The gated RMS norm of the rule's output (GatedNorm) and the heads' L2 norm apart from the convolution (where
its epilogue does not take them), one launch each, a program a head of a row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import pdl


@triton.jit
def _gated_norm_kernel(x_ptr, w_ptr, z_ptr, out_ptr, eps, D: tl.constexpr, D_P2: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    u = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, D_P2)
    m = j < D
    x = tl.load(x_ptr + u * D + j, mask=m, other=0.0)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    z = tl.load(z_ptr + u * D + j, mask=m, other=0.0)
    w = tl.load(w_ptr + j, mask=m, other=0.0)
    tl.store(out_ptr + u * D + j, x * r * w * (z * tl.sigmoid(z)), mask=m)


def gated_norm(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor, out: torch.Tensor, *, units: int, d: int,
               eps: float) -> None:  # fmt: skip
    """out = x / sqrt(mean(x^2) + eps) * w * silu(z), each of `units` heads of `d` values (x, z, out contiguous,
    units x d; w: (d,))."""
    _gated_norm_kernel[(units,)](x, w, z, out, float(eps), D=d, D_P2=triton.next_power_of_2(d), **pdl.options())


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
