"""A delta rule's gates in one launch (GdnGating): beta = sigmoid(b) and the decay g = A * softplus(a + dt)
for every row and value head, b and a read where the layer's `ssm_ba` product wrote them (per key head: its
value heads' b, then their a, so value head h is at (h / per, h % per) of groups of 2 per values).

`projected` is the gates with that product in the same launch (GdnGateProjections, from the lane's f32 copy of
an `ssm_ba` matrix of floats): a program a row takes every value head's b and a row of the matrix, a dot product
each over the layer's input in f32, then the gates in registers; neither b nor a is written."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import pdl

BK = 64  # input values a step of the projection's dot products reads (a power of two: tl.arange)
# past it softplus(x) = x to f32's rounding (the exponential would overflow sooner); a constexpr: the compiler
# reads no plain global in a kernel
SOFTPLUS_LINEAR = tl.constexpr(20.0)


@triton.jit
def softplus(x):
    """log(1 + exp(x)) without overflow."""
    return tl.where(x > SOFTPLUS_LINEAR, x, tl.log(1.0 + tl.exp(tl.minimum(x, SOFTPLUS_LINEAR))))


@triton.jit
def _store_gates(b, a, dt_ptr, decay_ptr, beta_row, g_row, h, m):
    """A row's gates from its b and a values, heads `h`: beta = sigmoid(b), g = decay * softplus(a + dt)."""
    dt = tl.load(dt_ptr + h, mask=m, other=0.0)
    coef = tl.load(decay_ptr + h, mask=m, other=0.0)
    tl.store(beta_row + h, tl.sigmoid(b), mask=m)
    tl.store(g_row + h, coef * softplus(a + dt), mask=m)


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
    _store_gates(b, a, dt_ptr, decay_ptr, beta_out + t * HEADS, g_out + t * HEADS, h, m)


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


@triton.jit
def _projected_kernel(
    x_ptr, x_pitch, w_ptr, dt_ptr, decay_ptr, beta_out, g_out, K,
    HEADS: tl.constexpr, PER: tl.constexpr, H_P2: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_P2)
    m = h < HEADS
    b_row = (h // PER) * 2 * PER + h % PER  # the matrix's row of value head h's b; its a is PER rows on
    acc_b = tl.zeros((H_P2,), dtype=tl.float32)
    acc_a = tl.zeros((H_P2,), dtype=tl.float32)
    k0 = 0
    while k0 < K:  # a while loop: the interpreter cannot range over a runtime bound
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        x = tl.load(x_ptr + t * x_pitch + kk, mask=km, other=0.0)
        wm = m[:, None] & km[None, :]
        wb = tl.load(w_ptr + b_row[:, None] * K + kk[None, :], mask=wm, other=0.0)
        wa = tl.load(w_ptr + (b_row + PER)[:, None] * K + kk[None, :], mask=wm, other=0.0)
        acc_b += tl.sum(wb * x[None, :], axis=1)
        acc_a += tl.sum(wa * x[None, :], axis=1)
        k0 += BK
    _store_gates(acc_b, acc_a, dt_ptr, decay_ptr, beta_out + t * HEADS, g_out + t * HEADS, h, m)


def projected(
    x: torch.Tensor, w: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, beta_out: torch.Tensor,
    g_out: torch.Tensor, *, rows: int, heads: int, key_heads: int, k: int,
) -> None:  # fmt: skip
    """The gates of `rows` rows of `x` (rows x k, any row pitch) through the `ssm_ba` matrix `w` (2 heads, k;
    f32, contiguous; per key head its value heads' b rows, then their a rows): beta_out = sigmoid(x w_b^T),
    g_out = decay * softplus(x w_a^T + dt), rows x heads each. One launch."""
    if tuple(w.shape) != (2 * heads, k) or not w.is_contiguous() or w.dtype != torch.float32:
        raise ValueError(f"the gates' projection takes a contiguous f32 ({2 * heads}, {k}) matrix")
    x2 = x.view(rows, -1) if x.is_contiguous() else x
    _projected_kernel[(rows,)](
        x2, x2.stride(0), w, dt, decay, beta_out, g_out, k,
        HEADS=heads, PER=heads // key_heads, H_P2=triton.next_power_of_2(heads), BK=BK, **pdl.options(),
    )  # fmt: skip
