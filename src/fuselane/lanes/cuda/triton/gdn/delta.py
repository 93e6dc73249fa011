"""The gated delta rule over every value head in one launch, its state kept in the `state` knob's precision.

Per value head h (reading key head h / (value heads / key heads)) with state S (dk x dv) and each row t in turn:
S = S exp(g); S += k (beta (v - S^T k))^T; o = S^T q, q scaled by 1/sqrt(dk). A program holds one head's state
for a block of `BV` value columns in f32 registers (the columns are independent: each reads all of k and q),
reads it once, runs the step's rows (a decode step's one; a chunk's rows in turn, where `chunked` does not take
the heads), and writes it back once, rounded to the state's dtype (f32 or bf16).
The gates come in already made (GdnGating, `gates`): beta and g a row and value head; or, where the step makes
them itself (`Raw`: the plan's `gates_in_step`), as b and a where the `ssm_ba` product wrote them, each program
making its head's beta = sigmoid(b) and g = A softplus(a + dt) as `gates` does, the same numbers.
Where the plan put the output's gated norm in the step (`Normed`: `norm_in_step`), a program holds a head's
whole value width and writes o / sqrt(mean(o^2) + eps) * w * silu(z), and its int8 form, as the norm's own
launch (`norm.gated_norm`) does, with the same helpers: one launch a decode step's linear layer less, at the
same speed (`kernels.GDN_NORM_MOST_DV`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gdn.gates import softplus
from fuselane.lanes.cuda.triton.gdn.norm import check_head_q8, gate_normed, store_head_q8
from fuselane.lanes.cuda.triton.quant import Q8Acts

BV = 32  # value columns of a program: with dk = 128, a state block of 4096 f32 over four warps' registers


@triton.jit
def nearest_bf16(x):
    """x rounded to the nearest bf16 (ties to even) and kept as f32: the conversion after it is then exact,
    the same on the GPU and in the interpreter (which truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@dataclass(frozen=True, slots=True)
class Raw:
    """The gates' inputs where the step makes them: b and a as (rows * key heads, value heads a key head) views
    of one product's groups (`gates.gates`' layout), dt and A (the file's `ssm_a`) a value head each."""

    b: Any
    a: Any
    dt: Any
    decay: Any


@triton.jit
def _gates(g_ptr, b_ptr, gb_pitch, dt_ptr, coef_ptr, t, h, HEADS: tl.constexpr, PER: tl.constexpr,
           RAW: tl.constexpr):  # fmt: skip
    """Row t's decay and beta of value head h: loaded, or made from its a and b (`RAW`) as `gates.gates` makes
    them."""
    if RAW:
        at = (t * (HEADS // PER) + h // PER) * gb_pitch + h % PER
        g = tl.load(coef_ptr + h) * softplus(tl.load(g_ptr + at) + tl.load(dt_ptr + h))
        beta = tl.sigmoid(tl.load(b_ptr + at))
    else:
        g = tl.load(g_ptr + t * gb_pitch + h)
        beta = tl.load(b_ptr + t * gb_pitch + h)
    return g, beta


@dataclass(frozen=True, slots=True)
class Normed:
    """The gated norm of the output where the step applies it (the plan's `norm_in_step`): each head's output
    o / sqrt(mean(o^2) + eps) * w * silu(z) is what the step writes, with its int8 form where `out_q8` is given.
    A program then holds a head's whole value width. w: (dv,); z: rows x heads * dv, any row pitch."""

    w: Any
    z: Any
    eps: float
    out_q8: Q8Acts | None


@triton.jit
def _delta_kernel(
    q_ptr, k_ptr, qk_pitch, v_ptr, v_pitch, g_ptr, b_ptr, gb_pitch, dt_ptr, coef_ptr, s_ptr, o_ptr, o_pitch, rows,
    scale, w_ptr, z_ptr, z_pitch, oq, od, os_, eps, HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BV: tl.constexpr, PER: tl.constexpr, DK_P2: tl.constexpr, RAW: tl.constexpr, WRITE_O: tl.constexpr,
    WRITE_S: tl.constexpr, NORM: tl.constexpr, Q8OUT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    h = tl.program_id(0)
    kk = tl.arange(0, DK_P2)
    vv = tl.program_id(1) * BV + tl.arange(0, BV)
    km, vm = kk < DK, vv < DV
    kh = h // PER
    s_at = s_ptr + h.to(tl.int64) * DK * DV + kk[:, None] * DV + vv[None, :]
    sm = km[:, None] & vm[None, :]
    s = tl.load(s_at, mask=sm, other=0.0).to(tl.float32)
    t = 0
    while t < rows:  # a while loop: the interpreter cannot range over a runtime bound
        k = tl.load(k_ptr + t * qk_pitch + kh * DK + kk, mask=km, other=0.0)
        v = tl.load(v_ptr + t * v_pitch + h * DV + vv, mask=vm, other=0.0)
        g, beta = _gates(g_ptr, b_ptr, gb_pitch, dt_ptr, coef_ptr, t, h, HEADS, PER, RAW)
        s = s * tl.exp(g)
        remembered = tl.sum(s * k[:, None], axis=0)
        s += k[:, None] * ((v - remembered) * beta)[None, :]
        if WRITE_O:
            q = tl.load(q_ptr + t * qk_pitch + kh * DK + kk, mask=km, other=0.0) * scale
            o = tl.sum(s * q[:, None], axis=0)
            if NORM:  # the program holds the head's whole value width (`Normed`)
                o = gate_normed(o, vv, vm, w_ptr, z_ptr + t * z_pitch + h * DV, eps, DV)
                if Q8OUT:
                    store_head_q8(o, t * HEADS + h, oq, od, os_, DV)
            tl.store(o_ptr + t * o_pitch + h * DV + vv, o, mask=vm)
        t += 1
    if WRITE_S:
        if s_ptr.dtype.element_ty == tl.bfloat16:
            s = nearest_bf16(s)
        tl.store(s_at, s.to(s_ptr.dtype.element_ty), mask=sm)


def delta(
    q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | Raw, beta: torch.Tensor | None,
    state: torch.Tensor, out: torch.Tensor | None, *, rows: int, heads: int, key_heads: int, dk: int, dv: int,
    scale: float, write_state: bool, normed: Normed | None = None,
) -> None:  # fmt: skip
    """Run the rule over `rows` rows: q, k (rows x key_heads * dk, any row pitch), v (rows x heads * dv, any row
    pitch), g and beta (rows x heads), or `Raw` gates in g (beta None), `state` (heads, dk, dv; f32 or bf16).
    Writes the output `out` (rows x heads * dv) where given (GatedDelta) and the state where `write_state`
    (DeltaState; both: GdnStep); with `normed` the output gated and normed (`Normed`, heads of at most
    `kernels.GDN_NORM_MOST_DV` values, whole 32-value blocks where it is quantized)."""
    k2, v2 = k.view(rows, -1) if k.is_contiguous() else k, v.view(rows, -1) if v.is_contiguous() else v
    q2 = k2 if q is None else (q.view(rows, -1) if q.is_contiguous() else q)
    if q2.stride(0) != k2.stride(0):
        raise ValueError("the rule reads its queries and keys at one row pitch")
    o = out.view(rows, -1) if out is not None else v2
    raw = isinstance(g, Raw)
    if raw and g.b.stride(0) != g.a.stride(0):
        raise ValueError("the step makes its gates from b and a out of one product's groups")
    gates = (g.a, g.b, g.b.stride(0), g.dt, g.decay) if raw else (g, beta, heads, g, g)
    # a normed step's program holds the head's whole value width (`kernels.GDN_NORM_MOST_DV`)
    bv, norm = BV if normed is None else triton.next_power_of_2(dv), _norm_args(normed, out, rows, heads, dv)
    _delta_kernel[(heads, triton.cdiv(dv, bv))](
        q2, k2, k2.stride(0), v2, v2.stride(0), *gates, state, o, o.stride(0), rows, float(scale), *norm,
        HEADS=heads, DK=dk, DV=dv, BV=bv, PER=heads // key_heads, DK_P2=triton.next_power_of_2(dk), RAW=raw,
        WRITE_O=out is not None, WRITE_S=write_state, NORM=normed is not None,
        Q8OUT=normed is not None and normed.out_q8 is not None, **pdl.options(),
    )  # fmt: skip


def _norm_args(normed: Normed | None, out: torch.Tensor | None, rows: int, heads: int, dv: int) -> tuple:
    """The kernel's gated-norm arguments (w, z, its row pitch, the int8 form's three tensors, eps), checked;
    placeholders where the step writes its output as it is."""
    if normed is None:
        return (out, out, 0, out, out, out, 0.0)
    if out is None or dv > kernels.GDN_NORM_MOST_DV:
        raise ValueError(f"the step norms its output in heads of at most {kernels.GDN_NORM_MOST_DV} values")
    z = normed.z.view(rows, -1) if normed.z.is_contiguous() else normed.z
    q8 = normed.out_q8
    check_head_q8(q8, rows * heads, dv)
    return (normed.w, z, z.stride(0), *(q8 if q8 is not None else (out, out, out)), float(normed.eps))
