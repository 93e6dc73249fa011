"""The gated delta rule over a prefill chunk's rows in the chunked form: `CHUNK` rows at a time, the state read
once and written once, every step of the recurrence within a chunk folded into products (`tl.dot`).

As the cpu lane's `gdn_kernels.chunked` (the UT form of the Hugging Face and FLA reference), per value head and
chunk of rows with cum the running sum of the decays g: the delta updates of the chunk are one unit-lower-
triangular system (I + A), A = strictly_lower((beta k) k^T * exp(cum_i - cum_j)); its inverse T (forward
substitution, a row a step, in registers) gives each row's correction beyond what the state predicts,
v_new = T (beta v) - T (beta k exp(cum)) S; the rows' outputs are (q exp(cum)) S + (q k^T * decay) v_new; the
state moves to S exp(cum_last) + (k exp(cum_last - cum))^T v_new. Rows past the chunk's end are loaded as
zeros (k = 0, g = 0: they change nothing). A program holds one value head's state for `BV` value columns.

The products run by default in three TF32 tensor-core products a step (`CudaKnobs.delta_products=tf32x3`, about
f32's rounding), which ptxas holds in registers, or in f32 FMA products (`ieee`: the recurrence's numbers within
f32 roundoff), which spill: the 80B-A3B's pp512 measured 2,091 against 895 tok/s (H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.plan import gdn as facts
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gdn.delta import nearest_bf16

CHUNK = facts.DELTA_CHUNK  # rows a chunk (the reference's chunk size)
# How the chunk's unit-lower-triangular system is inverted: a row a step (63 dependent steps of two reductions
# over the chunk's rows), or in blocks of `SOLVE_BLOCK` rows (15 dependent products, then four more);
# `benchmarks/gdn_chunked.py` times both
SOLVES = ("rows", "blocks")
SOLVE_BLOCK = 16
# The forms of a launch (`chunked`): each chunk's system solved in a launch of its own (`prepare`), every chunk
# at once, then the state across the chunks (`recur`); or both in one launch, a chunk after another (64 programs
# for the 80B-A3B's 32 value heads, each solving its head's chunks in turn)
FORMS = facts.DELTA_FORMS
BV = 64  # value columns a program
MIN_DOT = facts.DELTA_MIN_DOT  # tl.dot's least extent: heads of fewer key values run the recurrence (`delta`)
PRECISIONS = ("tf32x3", "ieee")  # `tl.dot`'s input precisions the kernel takes, the default first (`delta_products`)
# A TF32x3 product's relative error, bounded: each operand split into a TF32 high half and the TF32 of its rest,
# whose own rounding and the dropped product of the two rests are each about 2^-22 of the product; 16 times
# f32's unit roundoff, which a test scales its f32 bound by
TF32X3_ROUNDOFF = 2.0**-20
WARPS = 8


@triton.jit
def _block_solve(a, eye, cr, C: tl.constexpr, SB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(I + a)^-1 for a strictly lower C x C `a`, in blocks of SB rows: the diagonal blocks' inverse D by forward
    substitution, row s of every block in one step (a product: a row's terms lie in its own block, its rows
    before s already final); then, with N = D a_o (a_o the part below the diagonal blocks, so N is strictly
    block-lower and N^(C/SB) = 0), (I + a)^-1 = (I + N)^-1 D = (I - N + N^2 - ...) D."""
    blk = cr // SB
    a_d = tl.where(blk[:, None] == blk[None, :], a, 0.0)
    d = eye
    for s in tl.static_range(1, SB):
        d = tl.where((cr % SB == s)[:, None], eye - tl.dot(a_d, d, input_precision=DOT_PRECISION), d)
    n = tl.dot(d, a - a_d, input_precision=DOT_PRECISION)
    series = eye
    power = eye
    for _ in tl.static_range(1, C // SB):
        power = -tl.dot(power, n, input_precision=DOT_PRECISION)
        series += power
    return tl.dot(series, d, input_precision=DOT_PRECISION)


@triton.jit
def _system(k, g, beta, cr, C: tl.constexpr, SB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A chunk's running decays `cum`, its rows' decays (i sees j <= i), beta k, and the inverse T of its
    unit-lower-triangular system."""
    upto = cr[:, None] >= cr[None, :]  # row i sees rows j <= i
    before = cr[:, None] > cr[None, :]
    cum = tl.cumsum(g, 0)
    decay = tl.where(upto, tl.exp(tl.where(upto, cum[:, None] - cum[None, :], 0.0)), 0.0)
    kb = k * beta[:, None]
    a = tl.where(before, tl.dot(kb, tl.trans(k), input_precision=DOT_PRECISION) * decay, 0.0)
    eye = tl.where(cr[:, None] == cr[None, :], 1.0, 0.0)
    if SB == 0:  # (I + a)^-1, a row a step: T_i = e_i - a_i T
        t = eye
        i = 1
        while i < C:
            a_i = tl.sum(tl.where(cr[:, None] == i, a, 0.0), 0)
            t = tl.where(cr[:, None] == i, t - tl.sum(a_i[:, None] * t, 0)[None, :], t)
            i += 1
    else:
        t = _block_solve(a, eye, cr, C, SB, DOT_PRECISION)
    return cum, decay, kb, t


@triton.jit
def _advance(s, k, cum, v_new, cr, C: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The state after the chunk: S exp(cum_last) + (k exp(cum_last - cum))^T v_new."""
    last = tl.sum(tl.where(cr == C - 1, cum, 0.0), 0)  # the padded rows' g = 0: the last real row's
    to_end = k * tl.exp(last - cum)[:, None]
    return s * tl.exp(last) + tl.dot(tl.trans(to_end), v_new, input_precision=DOT_PRECISION)


@triton.jit
def _state_block(s_ptr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PER: tl.constexpr):
    """A (value head, value columns) program's head, its key head, its key and value indices, and its block of
    the head's state in f32 with the block's pointers."""
    h = tl.program_id(0)
    kk = tl.arange(0, DK)
    vv = tl.program_id(1) * BV + tl.arange(0, BV)
    vm = vv < DV
    s_at = s_ptr + h.to(tl.int64) * DK * DV + kk[:, None] * DV + vv[None, :]
    return h, h // PER, kk, vv, vm, s_at, tl.load(s_at, mask=vm[None, :], other=0.0).to(tl.float32)


@triton.jit
def _store_state(s, s_at, vm):
    if s_at.dtype.element_ty == tl.bfloat16:
        s = nearest_bf16(s)
    tl.store(s_at, s.to(s_at.dtype.element_ty), mask=vm[None, :])


# The whole form: a program solves each chunk's system in turn, then moves its state across it.
@triton.jit
def _chunked_kernel(
    q_ptr, k_ptr, qk_pitch, v_ptr, v_pitch, g_ptr, b_ptr, gb_pitch, s_ptr, o_ptr, o_pitch, rows, scale,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PER: tl.constexpr, C: tl.constexpr,
    WRITE_O: tl.constexpr, WRITE_S: tl.constexpr, DOT_PRECISION: tl.constexpr, SB: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    h, kh, kk, vv, vm, s_at, s = _state_block(s_ptr, DK, DV, BV, PER)
    cr = tl.arange(0, C)
    c0 = 0
    while c0 < rows:  # a while loop: the interpreter cannot range over a runtime bound
        r = c0 + cr
        rm = r < rows
        k = tl.load(k_ptr + r[:, None] * qk_pitch + kh * DK + kk[None, :], mask=rm[:, None], other=0.0)
        v = tl.load(v_ptr + r[:, None] * v_pitch + h * DV + vv[None, :], mask=rm[:, None] & vm[None, :], other=0.0)
        g = tl.load(g_ptr + r * gb_pitch + h, mask=rm, other=0.0)
        beta = tl.load(b_ptr + r * gb_pitch + h, mask=rm, other=0.0)
        cum, decay, kb, t = _system(k, g, beta, cr, C, SB, DOT_PRECISION)
        new_v = tl.dot(t, v * beta[:, None], input_precision=DOT_PRECISION)
        k_decayed = tl.dot(t, kb * tl.exp(cum)[:, None], input_precision=DOT_PRECISION)
        v_new = new_v - tl.dot(k_decayed, s, input_precision=DOT_PRECISION)
        if WRITE_O:
            q = tl.load(q_ptr + r[:, None] * qk_pitch + kh * DK + kk[None, :], mask=rm[:, None], other=0.0) * scale
            inner = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay
            o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=DOT_PRECISION)
            o += tl.dot(inner, v_new, input_precision=DOT_PRECISION)
            tl.store(o_ptr + r[:, None] * o_pitch + h * DV + vv[None, :], o, mask=rm[:, None] & vm[None, :])
        s = _advance(s, k, cum, v_new, cr, C, DOT_PRECISION)
        c0 += C
    if WRITE_S:
        _store_state(s, s_at, vm)


# The split form's first launch, a program a (head, chunk), all at once: what of a chunk does not depend on the
# state. u = T (beta v) and w = T (beta k exp(cum)) at the chunk's rows of (rows, heads, dv|dk) scratch, and
# (WRITE_O) the rows' scaled, decayed q k^T as the chunk's (C, C) block.
@triton.jit
def _prepare_kernel(
    q_ptr, k_ptr, qk_pitch, v_ptr, v_pitch, g_ptr, b_ptr, gb_pitch, u_ptr, w_ptr, in_ptr, rows, scale,
    HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DVB: tl.constexpr, PER: tl.constexpr, C: tl.constexpr,
    WRITE_O: tl.constexpr, DOT_PRECISION: tl.constexpr, SB: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    h = tl.program_id(0)
    c = tl.program_id(1)
    kh = h // PER
    kk = tl.arange(0, DK)
    vv = tl.arange(0, DVB)
    vm = vv < DV
    cr = tl.arange(0, C)
    r = c * C + cr
    rm = r < rows
    k = tl.load(k_ptr + r[:, None] * qk_pitch + kh * DK + kk[None, :], mask=rm[:, None], other=0.0)
    v = tl.load(v_ptr + r[:, None] * v_pitch + h * DV + vv[None, :], mask=rm[:, None] & vm[None, :], other=0.0)
    g = tl.load(g_ptr + r * gb_pitch + h, mask=rm, other=0.0)
    beta = tl.load(b_ptr + r * gb_pitch + h, mask=rm, other=0.0)
    cum, decay, kb, t = _system(k, g, beta, cr, C, SB, DOT_PRECISION)
    u = tl.dot(t, v * beta[:, None], input_precision=DOT_PRECISION)
    tl.store(u_ptr + (r[:, None] * HEADS + h) * DV + vv[None, :], u, mask=rm[:, None] & vm[None, :])
    w = tl.dot(t, kb * tl.exp(cum)[:, None], input_precision=DOT_PRECISION)
    tl.store(w_ptr + (r[:, None] * HEADS + h) * DK + kk[None, :], w, mask=rm[:, None])
    if WRITE_O:
        q = tl.load(q_ptr + r[:, None] * qk_pitch + kh * DK + kk[None, :], mask=rm[:, None], other=0.0) * scale
        inner = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay
        block = in_ptr + ((c * HEADS + h) * C).to(tl.int64) * C
        tl.store(block + cr[:, None] * C + cr[None, :], inner)


# The split form's second launch, a program a (head, value columns): the state across the chunks in turn, each
# chunk's correction v_new = u - w S, its rows' outputs (q exp(cum)) S + inner v_new.
@triton.jit
def _recur_kernel(
    q_ptr, k_ptr, qk_pitch, g_ptr, gb_pitch, u_ptr, w_ptr, in_ptr, s_ptr, o_ptr, o_pitch, rows, scale,
    HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PER: tl.constexpr, C: tl.constexpr,
    WRITE_O: tl.constexpr, WRITE_S: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    h, kh, kk, vv, vm, s_at, s = _state_block(s_ptr, DK, DV, BV, PER)
    cr = tl.arange(0, C)
    c0 = 0
    while c0 < rows:
        r = c0 + cr
        rm = r < rows
        w = tl.load(w_ptr + (r[:, None] * HEADS + h) * DK + kk[None, :], mask=rm[:, None], other=0.0)
        u = tl.load(u_ptr + (r[:, None] * HEADS + h) * DV + vv[None, :], mask=rm[:, None] & vm[None, :], other=0.0)
        k = tl.load(k_ptr + r[:, None] * qk_pitch + kh * DK + kk[None, :], mask=rm[:, None], other=0.0)
        cum = tl.cumsum(tl.load(g_ptr + r * gb_pitch + h, mask=rm, other=0.0), 0)
        v_new = u - tl.dot(w, s, input_precision=DOT_PRECISION)
        if WRITE_O:
            q = tl.load(q_ptr + r[:, None] * qk_pitch + kh * DK + kk[None, :], mask=rm[:, None], other=0.0) * scale
            block = in_ptr + ((c0 // C * HEADS + h) * C).to(tl.int64) * C
            inner = tl.load(block + cr[:, None] * C + cr[None, :])
            o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=DOT_PRECISION)
            o += tl.dot(inner, v_new, input_precision=DOT_PRECISION)
            tl.store(o_ptr + r[:, None] * o_pitch + h * DV + vv[None, :], o, mask=rm[:, None] & vm[None, :])
        s = _advance(s, k, cum, v_new, cr, C, DOT_PRECISION)
        c0 += C
    if WRITE_S:
        _store_state(s, s_at, vm)


def takes(dk: int) -> bool:
    """Whether the chunked kernel takes heads of `dk` key values (a power of two, at least tl.dot's extent)."""
    return facts.delta_dot_heads(dk)


def split_values(rows: int, heads: int, dk: int, dv: int) -> int:
    """f32 values of the split form's scratch for a chunk of `rows`: u and w at each row and head, and each
    (chunk, head)'s (C, C) block of q k^T."""
    return rows * heads * (dk + dv) + triton.cdiv(rows, CHUNK) * heads * CHUNK * CHUNK


def _checked(precision: str, solve: str, dk: int) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"the chunked rule multiplies at one of {PRECISIONS}, not {precision!r}")
    if solve not in SOLVES:
        raise ValueError(f"the chunked rule solves its system as one of {SOLVES}, not {solve!r}")
    if not takes(dk):
        raise ValueError(f"the chunked rule takes heads of a power of two of at least {MIN_DOT} key values")


def _rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A (rows, width) view of an operand, or the strided view it is where it is not contiguous."""
    return x.view(rows, -1) if x.is_contiguous() else x


def _split_scratch(scratch: torch.Tensor, rows: int, heads: int, dk: int, dv: int) -> list[torch.Tensor]:
    """The split form's scratch cut into u, w and the blocks' q k^T."""
    need = split_values(rows, heads, dk, dv)
    if scratch.dtype != torch.float32 or scratch.numel() < need or not scratch.is_contiguous():
        raise ValueError(f"the split form's scratch must be {need} contiguous f32 values")
    return list(scratch[:need].split([rows * heads * dv, rows * heads * dk, need - rows * heads * (dk + dv)]))


def prepare(
    q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scratch: torch.Tensor, *, rows: int, heads: int, key_heads: int, dk: int, dv: int, scale: float,
    write_output: bool, precision: str = PRECISIONS[0], warps: int = WARPS, solve: str = SOLVES[0],
) -> None:  # fmt: skip
    """The split form's first launch: every (value head, block)'s system solved at once, u = T (beta v),
    w = T (beta k e^cum) and the block's decayed q k^T stored in `scratch` (`split_values` f32)."""
    _checked(precision, solve, dk)
    k2 = _rows(k, rows)
    q2 = k2 if q is None else _rows(q, rows)
    v2 = _rows(v, rows)
    u, w, inner = _split_scratch(scratch, rows, heads, dk, dv)
    _prepare_kernel[(heads, triton.cdiv(rows, CHUNK))](
        q2, k2, k2.stride(0), v2, v2.stride(0), g, beta, heads, u, w, inner, rows, float(scale),
        HEADS=heads, DVB=max(MIN_DOT, triton.next_power_of_2(dv)), SB=SOLVE_BLOCK if solve == "blocks" else 0,
        DK=dk, DV=dv, PER=heads // key_heads, C=CHUNK, WRITE_O=write_output, DOT_PRECISION=precision,
        num_warps=warps, **pdl.options(),
    )  # fmt: skip


def recur(
    q: torch.Tensor | None, k: torch.Tensor, g: torch.Tensor, state: torch.Tensor, out: torch.Tensor | None,
    scratch: torch.Tensor, *, rows: int, heads: int, key_heads: int, dk: int, dv: int, scale: float,
    write_state: bool, precision: str = PRECISIONS[0], bv: int = BV, warps: int = WARPS,
) -> None:  # fmt: skip
    """The split form's second launch: the state across the blocks from `prepare`'s scratch, the rows'
    outputs into `out` (where given) and the state written back where `write_state`."""
    _checked(precision, SOLVES[0], dk)
    k2 = _rows(k, rows)
    q2 = k2 if q is None else _rows(q, rows)
    o = out.view(rows, -1) if out is not None else k2
    bv = min(bv, max(MIN_DOT, triton.next_power_of_2(dv)))
    u, w, inner = _split_scratch(scratch, rows, heads, dk, dv)
    _recur_kernel[(heads, triton.cdiv(dv, bv))](
        q2, k2, k2.stride(0), g, heads, u, w, inner, state, o, o.stride(0), rows, float(scale),
        HEADS=heads, BV=bv, WRITE_S=write_state, DK=dk, DV=dv, PER=heads // key_heads, C=CHUNK,
        WRITE_O=out is not None, DOT_PRECISION=precision, num_warps=warps, **pdl.options(),
    )  # fmt: skip


def chunked(
    q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, out: torch.Tensor | None, *, rows: int, heads: int, key_heads: int, dk: int, dv: int,
    scale: float, write_state: bool, precision: str = PRECISIONS[0], bv: int = BV, warps: int = WARPS,
    solve: str = SOLVES[0], form: str = FORMS[0], scratch: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """`delta.delta`'s arguments and results, the rows `CHUNK` at a time, the products at `precision` (one of
    `PRECISIONS`), the system solved as `solve` says (one of `SOLVES`), a program `bv` value columns at `warps`
    warps (`benchmarks/gdn_chunked.py` times others). `form` (one of `FORMS`): "split" solves every chunk's
    system at once in a launch of its own, into `scratch` (`split_values` f32; allocated here where not
    given), then moves the state across the chunks in a second; "whole" does both in one launch, a chunk
    after another."""
    if form not in FORMS:
        raise ValueError(f"the chunked rule runs in one of the forms {FORMS}, not {form!r}")
    shape = dict(rows=rows, heads=heads, key_heads=key_heads, dk=dk, dv=dv, scale=scale, precision=precision,
                 warps=warps)  # fmt: skip
    if form == facts.DELTA_SPLIT:
        if scratch is None:
            scratch = torch.empty(split_values(rows, heads, dk, dv), dtype=torch.float32, device=k.device)
        prepare(q, k, v, g, beta, scratch, write_output=out is not None, solve=solve, **shape)
        recur(q, k, g, state, out, scratch, write_state=write_state, bv=bv, **shape)
        return
    _checked(precision, solve, dk)
    k2, v2 = _rows(k, rows), _rows(v, rows)
    q2 = k2 if q is None else _rows(q, rows)
    o = out.view(rows, -1) if out is not None else v2
    bv = min(bv, max(MIN_DOT, triton.next_power_of_2(dv)))
    _chunked_kernel[(heads, triton.cdiv(dv, bv))](
        q2, k2, k2.stride(0), v2, v2.stride(0), g, beta, heads, state, o, o.stride(0), rows, float(scale),
        BV=bv, WRITE_S=write_state, SB=SOLVE_BLOCK if solve == "blocks" else 0, DK=dk, DV=dv,
        PER=heads // key_heads, C=CHUNK, WRITE_O=out is not None, DOT_PRECISION=precision, num_warps=warps,
        **pdl.options(),
    )  # fmt: skip
