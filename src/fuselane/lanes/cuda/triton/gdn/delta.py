"""The gated delta rule over every value head in one launch, its state kept in the `state` knob's precision.

Per value head h (reading key head h / (value heads / key heads)) with state S (dk x dv) and each row t in turn:
S = S exp(g); S += k (beta (v - S^T k))^T; o = S^T q, q scaled by 1/sqrt(dk). A program holds one head's state
for a block of `BV` value columns in f32 registers (the columns are independent: each reads all of k and q),
reads it once, runs the step's rows (a decode step's one; a chunk's rows in turn, where `chunked` does not take
the heads), and writes it back once, rounded to the state's dtype (f32 or bf16).
The gates come in already made (GdnGating, `gates`): beta and g a row and value head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import pdl

BV = 32  # value columns of a program: with dk = 128, a state block of 4096 f32 over four warps' registers


@triton.jit
def nearest_bf16(x):
    """x rounded to the nearest bf16 (ties to even) and kept as f32: the conversion after it is then exact,
    the same on the GPU and in the interpreter (which truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _delta_kernel(
    q_ptr, k_ptr, qk_pitch, v_ptr, v_pitch, g_ptr, b_ptr, gb_pitch, s_ptr, o_ptr, o_pitch, rows, scale,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PER: tl.constexpr, DK_P2: tl.constexpr,
    WRITE_O: tl.constexpr, WRITE_S: tl.constexpr, PDL: tl.constexpr,
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
        g = tl.load(g_ptr + t * gb_pitch + h)
        beta = tl.load(b_ptr + t * gb_pitch + h)
        s = s * tl.exp(g)
        remembered = tl.sum(s * k[:, None], axis=0)
        s += k[:, None] * ((v - remembered) * beta)[None, :]
        if WRITE_O:
            q = tl.load(q_ptr + t * qk_pitch + kh * DK + kk, mask=km, other=0.0) * scale
            tl.store(o_ptr + t * o_pitch + h * DV + vv, tl.sum(s * q[:, None], axis=0), mask=vm)
        t += 1
    if WRITE_S:
        if s_ptr.dtype.element_ty == tl.bfloat16:
            s = nearest_bf16(s)
        tl.store(s_at, s.to(s_ptr.dtype.element_ty), mask=sm)


def delta(
    q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, out: torch.Tensor | None, *, rows: int, heads: int, key_heads: int, dk: int, dv: int,
    scale: float, write_state: bool,
) -> None:  # fmt: skip
    """Run the rule over `rows` rows: q, k (rows x key_heads * dk, any row pitch), v (rows x heads * dv, any row
    pitch), g and beta (rows x heads), `state` (heads, dk, dv; f32 or bf16). Writes the output `out` (rows x
    heads * dv) where given (GatedDelta) and the state where `write_state` (DeltaState; both: GdnStep)."""
    k2, v2 = k.view(rows, -1) if k.is_contiguous() else k, v.view(rows, -1) if v.is_contiguous() else v
    q2 = k2 if q is None else (q.view(rows, -1) if q.is_contiguous() else q)
    if q2.stride(0) != k2.stride(0):
        raise ValueError("the rule reads its queries and keys at one row pitch")
    o = out.view(rows, -1) if out is not None else v2
    _delta_kernel[(heads, triton.cdiv(dv, BV))](
        q2, k2, k2.stride(0), v2, v2.stride(0), g, beta, heads, state, o, o.stride(0), rows, float(scale),
        DK=dk, DV=dv, BV=BV, PER=heads // key_heads, DK_P2=triton.next_power_of_2(dk),
        WRITE_O=out is not None, WRITE_S=write_state, **pdl.options(),
    )  # fmt: skip
