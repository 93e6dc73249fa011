"""Rotary position embedding on the device: QkNormRope, QkNormRopeKvAppend, RopeKvAppend, RopeQkOneLaunch,
and the plain KV-cache row write (SetRows).

A block takes one head of one row, a pair of values (j, j + hd/2) a thread: NEOX order, as Qwen rotates.
The head is optionally RMS-normed with its weight first (Qwen3's q_norm / k_norm), then rotated by the angle
of position pos + i, computed in the kernel from the frequency base (no cos/sin table to keep in step with
the cache length). The rotated head lands in its own buffer, or (the KV-append forms) in the cache at row
pos + i, rounded to the cache's f16 or f32 there.

The position is read from a 1-element int32 device tensor, never passed as a number: a captured CUDA graph
replays the same launches at the next step's position without being captured again.

Angles: inv_freq_j = base^(-2j/hd) = 2^(j * (-2 log2(base) / hd)), the exponent's factor computed once on the
host in f64; angle = p * inv_freq_j in f32 (as Hugging Face and llama.cpp compute it). The angle is reduced
to [-pi, pi] with a two-part 2*pi before cos and sin, so an approximate GPU sine stays accurate at any
position; the reduction adds nothing to the f32 product's own rounding, p * inv_freq_j * 2^-24. YaRN's stretch
(`frequencies`, a Qwen file's `rope.scaling.type` yarn) multiplies inv_freq_j by 1 - ramp_j (1 - 1/factor) in f32
first, ramp_j = clamp((j - low) / width, 0, 1) from `Yarn.ramp`: one rounding more.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from fuselane.graph.ops import Yarn
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton import pdl

# 2*pi as an f32 and the f64 remainder it leaves: k * 2pi subtracted in two fused steps is exact to f32
# for k up to 2^24 / 2pi, far past any cache's length.
TWO_PI_HI: tl.constexpr = tl.constexpr(float(np.float32(2 * math.pi)))
TWO_PI_LO: tl.constexpr = tl.constexpr(2 * math.pi - float(np.float32(2 * math.pi)))
INV_TWO_PI: tl.constexpr = tl.constexpr(1 / (2 * math.pi))

# Values a set-rows block copies: a warp's 32 lanes four f32 (one 16-byte load) each, four warps.
SET_ROWS_WARPS = 4
SET_ROWS_BLOCK = SET_ROWS_WARPS * kernels.WARP * 4


def freq_exponent(base: float, hd: int) -> float:
    """log2 of the ratio between successive inverse frequencies: inv_freq_j = 2^(j * this)."""
    return -2.0 * math.log2(base) / hd


def frequencies(base: float, hd: int, yarn: Yarn | None) -> dict:
    """The rotation kernels' frequency arguments for heads turning `hd` values: the base's exponent
    (`freq_exponent`), and YaRN's ramp (its low end, the reciprocal of its width, and 1 - 1/factor) where given."""
    if yarn is None:
        return dict(freq_exp=freq_exponent(base, hd), yarn_low=0.0, yarn_inv=0.0, yarn_cut=0.0, YARN=False)
    low, width = yarn.ramp(hd, base)
    return dict(freq_exp=freq_exponent(base, hd), yarn_low=float(low), yarn_inv=1.0 / width,
                yarn_cut=1.0 - 1.0 / yarn.factor, YARN=True)  # fmt: skip


def rope_warps(hd: int) -> int:
    """Warps of a rotation's block: a pair a thread, whole warps, at most `kernels.ROPE_THREADS` threads."""
    pairs = triton.next_power_of_2(max(1, hd // 2))
    return max(1, min(kernels.ROPE_THREADS, pairs) // kernels.WARP)


@triton.jit
def rotate_head(src, dst, w_ptr, p, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, HD: tl.constexpr,
                HALF_P2: tl.constexpr, NORM: tl.constexpr, FROM_L2: tl.constexpr = False, ROT: tl.constexpr = 0,
                YARN: tl.constexpr = False):  # fmt: skip
    """Norm (with NORM) and rotate the head of `HD` values at `src` to position `p`, writing it at `dst`. With
    FROM_L2 the head is read past this SM's L1 (`.cg`): other programs of the same launch wrote it. With ROT
    (0 < ROT < HD) only the first ROT values turn (partial rotary; `freq_exp` then of ROT), the rest pass. With
    YARN the frequencies are stretched (`frequencies`' yarn_* arguments)."""
    if ROT != 0 and ROT != HD:
        _rotate_part(src, dst, w_ptr, p, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, HD, HALF_P2, NORM, ROT, YARN)
    else:
        _rotate_whole(src, dst, w_ptr, p, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, HD, HALF_P2, NORM, FROM_L2,
                      YARN)  # fmt: skip


@triton.jit
def _angles(p, j, freq_exp, yarn_low, yarn_inv, yarn_cut, YARN: tl.constexpr):
    """cos and sin of position p times inv_freq_j (stretched by YaRN's ramp with YARN), the angle reduced to
    [-pi, pi] first."""
    inv_freq = tl.exp2(j.to(tl.float32) * freq_exp)
    if YARN:
        ramp = tl.minimum(tl.maximum((j.to(tl.float32) - yarn_low) * yarn_inv, 0.0), 1.0)
        inv_freq = inv_freq * (1.0 - ramp * yarn_cut)
    angle = p.to(tl.float32) * inv_freq
    turns = tl.floor(angle * INV_TWO_PI + 0.5)
    angle = tl.fma(turns, -TWO_PI_HI, angle)
    angle = tl.fma(turns, -TWO_PI_LO, angle)
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _rotate_part(src, dst, w_ptr, p, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, HD: tl.constexpr,
                 HALF_P2: tl.constexpr, NORM: tl.constexpr, ROT: tl.constexpr, YARN: tl.constexpr):  # fmt: skip
    """The first ROT values in NEOX pairs (j, j + ROT/2); the HD - ROT after them only normed."""
    RH: tl.constexpr = ROT // 2
    j = tl.arange(0, HALF_P2)
    mask = j < RH
    rest = tl.arange(0, 2 * HALF_P2)
    rmask = rest < HD - ROT
    a = tl.load(src + j, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + RH + j, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(src + ROT + rest, mask=rmask, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0) + tl.sum(c * c, axis=0)) / HD + eps)
        a = a * r * tl.load(w_ptr + j, mask=mask, other=0.0).to(tl.float32)
        b = b * r * tl.load(w_ptr + RH + j, mask=mask, other=0.0).to(tl.float32)
        c = c * r * tl.load(w_ptr + ROT + rest, mask=rmask, other=0.0).to(tl.float32)
    cos, sin = _angles(p, j, freq_exp, yarn_low, yarn_inv, yarn_cut, YARN)
    ty = dst.dtype.element_ty
    tl.store(dst + j, (a * cos - b * sin).to(ty), mask=mask)
    tl.store(dst + RH + j, (b * cos + a * sin).to(ty), mask=mask)
    tl.store(dst + ROT + rest, c.to(ty), mask=rmask)


@triton.jit
def _rotate_whole(src, dst, w_ptr, p, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, HD: tl.constexpr,
                  HALF_P2: tl.constexpr, NORM: tl.constexpr, FROM_L2: tl.constexpr, YARN: tl.constexpr):  # fmt: skip
    HALF: tl.constexpr = HD // 2
    CACHE: tl.constexpr = ".cg" if FROM_L2 else ""
    j = tl.arange(0, HALF_P2)
    mask = j < HALF
    a = tl.load(src + j, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    b = tl.load(src + HALF + j, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / HD + eps)
        a = a * r * tl.load(w_ptr + j, mask=mask, other=0.0).to(tl.float32)
        b = b * r * tl.load(w_ptr + HALF + j, mask=mask, other=0.0).to(tl.float32)
    cos, sin = _angles(p, j, freq_exp, yarn_low, yarn_inv, yarn_cut, YARN)
    ty = dst.dtype.element_ty
    tl.store(dst + j, (a * cos - b * sin).to(ty), mask=mask)
    tl.store(dst + HALF + j, (b * cos + a * sin).to(ty), mask=mask)


@triton.jit
def _position(pos_ptr, i, PER_ROW: tl.constexpr):
    """Row i's position: pos[0] + i (a sequence's rows), or pos[i] (a batch's rows, each its own sequence)."""
    if PER_ROW:
        p = tl.load(pos_ptr + i)
    else:
        p = tl.load(pos_ptr) + i
    return p


@triton.jit
def _rope_kernel(
    x_ptr,
    out_ptr,
    w_ptr,
    pos_ptr,
    x_pitch,
    out_pitch,
    eps,
    freq_exp,
    yarn_low,
    yarn_inv,
    yarn_cut,
    HD: tl.constexpr,
    HALF_P2: tl.constexpr,
    NORM: tl.constexpr,
    AT_POS: tl.constexpr,
    PER_ROW: tl.constexpr,
    HEAD_PITCH: tl.constexpr,
    ROT: tl.constexpr = 0,
    YARN: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl.begin(PDL)
    i = tl.program_id(0)
    head = tl.program_id(1)
    p = _position(pos_ptr, i, PER_ROW)
    dst_row = p if AT_POS else i  # the cache's row pos + i, or the output's own row i
    src = x_ptr + i.to(tl.int64) * x_pitch + head * HEAD_PITCH
    dst = out_ptr + dst_row.to(tl.int64) * out_pitch + head * HD
    rotate_head(src, dst, w_ptr, p, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, HD, HALF_P2, NORM, False, ROT, YARN)


def check_head(hd: int) -> None:
    if hd % 2 or hd > kernels.ROPE_HEAD:
        raise ValueError(f"a rotation takes an even head of at most {kernels.ROPE_HEAD} values, not {hd}")


def _in_pitches(x: torch.Tensor, hd: int) -> tuple[int, int, int]:
    """(rows, row pitch, head pitch) of a rotation's input: rows x heads * hd, or rows x heads x hd (the heads a
    slice of a wider row: a gated query's heads, each followed by its gate)."""
    if x.stride(-1) != 1:
        raise ValueError("rope: the input's values must be unit-stride")
    if x.dim() == 3:
        return x.shape[0], x.stride(0), x.stride(1)
    return (x.shape[0], x.stride(0), hd) if x.dim() == 2 else (1, 0, hd)


def _turned(hd: int, rot: int) -> int:
    """The values a head turns (0: all), checked even and within the head."""
    if rot % 2 or rot > hd:
        raise ValueError(f"a head of {hd} values turns an even number of them, not {rot}")
    return 0 if rot == hd else rot


def _out_pitch(out: torch.Tensor, cache_row_pitch: int | None) -> int:
    if out.stride(-1) != 1:
        raise ValueError("rope: the output's values must be unit-stride")
    return out.stride(0) if cache_row_pitch is None else int(cache_row_pitch)


def qk_norm_rope(
    x: torch.Tensor,
    out: torch.Tensor,
    pos: torch.Tensor,
    *,
    heads: int,
    hd: int,
    base: float,
    norm_w: torch.Tensor | None = None,
    eps: float = 0.0,
    cache_row_pitch: int | None = None,
    per_row: bool = False,
    rot: int = 0,
    yarn: Yarn | None = None,
) -> None:
    """Rotate each of `heads` heads of `hd` values of each row of `x` (rows, >= heads * hd, any row pitch) to
    position pos[0] + i (NEOX halves), after an RMS norm with weight `norm_w` (hd,) per head where given.

    Without `cache_row_pitch`, row i lands in row i of `out`; with it, `out` is the cache (2-D, f16 or f32) and
    row i lands at cache row pos[0] + i, `cache_row_pitch` values apart (RopeKvAppend / QkNormRopeKvAppend).
    `per_row`: row i is a batch's sequence i, at its own position pos[i], and lands at row i of `out` either
    way (a cache row's staging: the paged attention stores it into its block). One launch, a block a head of
    a row. `x` may be rows x heads x hd, its heads apart (a slice's); `rot`
    (partial rotary) turns only each head's first `rot` values; `yarn` stretches the frequencies.
    """
    check_head(hd)
    rows, x_pitch, head_pitch = _in_pitches(x, hd)
    rot = _turned(hd, rot)
    _rope_kernel[(rows, heads)](
        x,
        out,
        norm_w if norm_w is not None else x,
        pos,
        x_pitch,
        _out_pitch(out, cache_row_pitch),
        float(eps),
        **frequencies(base, rot or hd, yarn),
        HD=hd,
        HALF_P2=triton.next_power_of_2(hd // 2),
        NORM=norm_w is not None,
        AT_POS=cache_row_pitch is not None and not per_row,  # a batch's rows land at their own row
        PER_ROW=per_row,
        HEAD_PITCH=head_pitch,
        ROT=rot,
        num_warps=rope_warps(hd),
        **pdl.options(),
    )


@triton.jit
def _rope_qk_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_w_ptr,
    k_w_ptr,
    pos_ptr,
    q_pitch,
    k_pitch,
    q_out_pitch,
    k_out_pitch,
    eps,
    freq_exp,
    yarn_low,
    yarn_inv,
    yarn_cut,
    HEADS: tl.constexpr,
    HD: tl.constexpr,
    HALF_P2: tl.constexpr,
    NORM: tl.constexpr,
    K_AT_POS: tl.constexpr,
    PER_ROW: tl.constexpr,
    Q_HEAD_PITCH: tl.constexpr,
    K_HEAD_PITCH: tl.constexpr,
    ROT: tl.constexpr = 0,
    YARN: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    # blocks 0 .. HEADS-1 of a row take the query's heads, the rest the key's
    pdl.begin(PDL)
    i = tl.program_id(0)
    head = tl.program_id(1)
    p = _position(pos_ptr, i, PER_ROW)
    # each side names its own pointers: a name assigned in both branches would have to be one type
    if head < HEADS:
        q_src = q_ptr + i.to(tl.int64) * q_pitch + head * Q_HEAD_PITCH
        q_dst = q_out_ptr + i.to(tl.int64) * q_out_pitch + head * HD
        rotate_head(q_src, q_dst, q_w_ptr, p, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, HD, HALF_P2,
                    NORM, False, ROT, YARN)  # fmt: skip
    else:
        kh = head - HEADS
        k_row = p if K_AT_POS else i
        k_src = k_ptr + i.to(tl.int64) * k_pitch + kh * K_HEAD_PITCH
        k_dst = k_out_ptr + k_row.to(tl.int64) * k_out_pitch + kh * HD
        rotate_head(k_src, k_dst, k_w_ptr, p, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, HD, HALF_P2,
                    NORM, False, ROT, YARN)  # fmt: skip


def rope_q_k(
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    pos: torch.Tensor,
    *,
    heads: int,
    kv_heads: int,
    hd: int,
    base: float,
    q_norm_w: torch.Tensor | None = None,
    k_norm_w: torch.Tensor | None = None,
    eps: float = 0.0,
    k_cache_row_pitch: int | None = None,
    per_row: bool = False,
    rot: int = 0,
    yarn: Yarn | None = None,
) -> None:
    """RopeQkOneLaunch: `qk_norm_rope` of a layer's query (`heads` heads) and key (`kv_heads` heads) in one
    launch, at one position and head width, both normed or neither. With `k_cache_row_pitch` the key's row i
    lands in the cache `k_out` at row pos[0] + i (the key's KV append). `per_row`, `yarn`: as `qk_norm_rope`'s."""
    check_head(hd)
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("one launch rotates a query and a key both normed or neither")
    rows, q_pitch, q_head_pitch = _in_pitches(q, hd)
    _, k_pitch, k_head_pitch = _in_pitches(k, hd)
    rot = _turned(hd, rot)
    _rope_qk_kernel[(rows, heads + kv_heads)](
        q,
        k,
        q_out,
        k_out,
        q_norm_w if q_norm_w is not None else q,
        k_norm_w if k_norm_w is not None else k,
        pos,
        q_pitch,
        k_pitch,
        _out_pitch(q_out, None),
        _out_pitch(k_out, k_cache_row_pitch),
        float(eps),
        **frequencies(base, rot or hd, yarn),
        HEADS=heads,
        HD=hd,
        HALF_P2=triton.next_power_of_2(hd // 2),
        NORM=q_norm_w is not None,
        K_AT_POS=k_cache_row_pitch is not None and not per_row,
        PER_ROW=per_row,
        Q_HEAD_PITCH=q_head_pitch,
        K_HEAD_PITCH=k_head_pitch,
        ROT=rot,
        num_warps=rope_warps(hd),
        **pdl.options(),
    )


# --- the cache's plain row write -------------------------------------------------------------------------


@triton.jit
def _set_rows_kernel(x_ptr, cache_ptr, pos_ptr, x_pitch, cache_pitch, cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    row = (tl.load(pos_ptr) + i).to(tl.int64)
    v = tl.load(x_ptr + i.to(tl.int64) * x_pitch + offs, mask=mask, other=0.0)
    tl.store(cache_ptr + row * cache_pitch + offs, v.to(cache_ptr.dtype.element_ty), mask=mask)


def set_rows(x: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor) -> None:
    """SetRows: row i of `x` (rows, cols) into `cache` (2-D) at row pos[0] + i, rounded to the cache's dtype
    (f32 -> f16 to nearest, ties to even). The value half of a KV append."""
    x2 = x if x.dim() == 2 else x.view(1, -1)
    if x2.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("set_rows: the rows' values must be unit-stride")
    rows, cols = x2.shape
    _set_rows_kernel[(rows, triton.cdiv(cols, SET_ROWS_BLOCK))](
        x2,
        cache,
        pos,
        x2.stride(0),
        cache.stride(0),
        cols,
        BLOCK=SET_ROWS_BLOCK,
        num_warps=SET_ROWS_WARPS,
        **pdl.options(),
    )
