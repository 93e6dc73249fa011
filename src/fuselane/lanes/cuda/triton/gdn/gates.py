"""A delta rule's gates in one launch (GdnGating): beta = sigmoid(b) and the decay g = A * softplus(a + dt)
for every row and value head, b and a read where the layer's `ssm_ba` product wrote them (per key head: its
value heads' b, then their a, so value head h is at (h / per, h % per) of groups of 2 per values)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import pdl

SOFTPLUS_LINEAR = 20.0  # past it softplus(x) = x to f32's rounding (the exponential would overflow sooner)


@triton.jit
def softplus(x):
    """log(1 + exp(x)) without overflow."""
    return tl.where(x > SOFTPLUS_LINEAR, x, tl.log(1.0 + tl.exp(tl.minimum(x, SOFTPLUS_LINEAR))))


@triton.jit
def _gates_kernel(
    b_ptr, a_ptr, group_pitch, dt_ptr, decay_ptr, beta_out, g_out,
    HEADS: tl.constexpr, PER: tl.constexpr, KEY_HEADS: tl.constexpr, H_P2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    t = tl.program_id(0)
    h = tl.arange(0, H_P2)
    m = h < HEADS
    at = (t * KEY_HEADS + h // PER) * group_pitch + h % PER
    b = tl.load(b_ptr + at, mask=m, other=0.0)
    a = tl.load(a_ptr + at, mask=m, other=0.0)
    dt = tl.load(dt_ptr + h, mask=m, other=0.0)
    coef = tl.load(decay_ptr + h, mask=m, other=0.0)
    tl.store(beta_out + t * HEADS + h, tl.sigmoid(b), mask=m)
    tl.store(g_out + t * HEADS + h, coef * softplus(a + dt), mask=m)


def gates(
    b: torch.Tensor, a: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, beta_out: torch.Tensor,
    g_out: torch.Tensor, *, rows: int, heads: int, key_heads: int,
) -> None:  # fmt: skip
    """b and a: (rows * key_heads, heads / key_heads) views of groups `b.stride(0)` values apart; dt and decay
    (the file's `ssm_a`, -exp(A_log)): (heads,); beta_out, g_out: rows x heads. One launch."""
    if b.stride(0) != a.stride(0):
        raise ValueError("the gates read b and a out of one product's groups")
    _gates_kernel[(rows,)](
        b, a, b.stride(0), dt, decay, beta_out, g_out,
        HEADS=heads, PER=heads // key_heads, KEY_HEADS=key_heads, H_P2=triton.next_power_of_2(heads),
        **pdl.options(),
    )  # fmt: skip
