"""Rotary position embedding on the device: QkNormRope, QkNormRopeKvAppend, RopeKvAppend, RopeQkOneLaunch,
and the plain KV-cache row write (SetRows).

A program takes a few rows of a few heads of one side (the query's and the key's tiles in one launch), pairs
of values (j, j + hd/2) in NEOX order, as Qwen rotates: its rows' angles are computed once for its heads, and
a 512-row prompt chunk takes a few hundred programs, not a one-warp block for each of its thousands of heads,
while a decode step's row still takes a program a head, a pair of values a thread (`rope_tile`). A head is
optionally RMS-normed with its weight first (Qwen3's q_norm / k_norm), then rotated by the angle of position
pos + i, computed in the kernel from the frequency base (no cos/sin table to keep in step with the cache
length). The rotated head lands in its own buffer, or (the KV-append forms) in the cache at row pos + i,
rounded to the cache's f16 or f32 there.

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
from fuselane.lanes.cuda.plan import attn_kernels, kernels
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


def _widths(hd: int, turned: int) -> tuple[int, int]:
    """(RH_P2, REST_P2): the pairs' tile and the unturned values' tile of a head."""
    return triton.next_power_of_2(turned // 2), triton.next_power_of_2(max(1, hd - turned))


def rope_tile(heads: int, hd: int, turned: int, rows: int) -> tuple[int, int, int]:
    """(rows, heads, warps) of a rotation launch's program, for heads of `hd` values, `turned` of them turning.
    Up to `attn_kernels.ROPE_ONE_HEAD_ROWS` rows (a decode step, a batch's step, a short chunk) a program takes one
    head of one row, a pair of values a thread: such a launch waits on its latency, not its work. Past that, a
    few heads (about `attn_kernels.ROPE_HEAD_VALUES` values of a row, at most `heads`, the wider side's) and as
    many rows of them as keep a program near `attn_kernels.ROPE_VALUES` values,
    `attn_kernels.ROPE_VALUES_A_THREAD` a thread."""
    if rows <= attn_kernels.ROPE_ONE_HEAD_ROWS:  # a thread a pair of the head's values, turned or not
        return 1, 1, max(1, min(attn_kernels.ROPE_WARPS, triton.next_power_of_2(hd // 2) // kernels.WARP))
    pairs, rest = _widths(hd, turned)
    per_head = 2 * pairs + (rest if turned < hd else 0)  # a partial rotary's head is no power of two
    tile_heads = _floor_pow2(min(triton.next_power_of_2(heads), attn_kernels.ROPE_HEAD_VALUES // per_head))
    tile_rows = _floor_pow2(min(triton.next_power_of_2(rows), attn_kernels.ROPE_VALUES // (tile_heads * per_head)))
    warps = tile_rows * tile_heads * per_head // (attn_kernels.ROPE_VALUES_A_THREAD * kernels.WARP)
    return tile_rows, tile_heads, _floor_pow2(min(attn_kernels.ROPE_WARPS, warps))


def _floor_pow2(n: int) -> int:
    """The largest power of two at most n, and 1 below 1: a tile's sides and a launch's warps are powers of two."""
    return 1 << max(0, n.bit_length() - 1)


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
def _turn_rows(src, dst, w_ptr, cos, sin, valid, eps, h0, H: tl.constexpr, H_TILE: tl.constexpr,
               HEAD_PITCH: tl.constexpr, HD: tl.constexpr, RH: tl.constexpr, RH_P2: tl.constexpr,
               REST_P2: tl.constexpr, NORM: tl.constexpr, FROM_L2: tl.constexpr = False):  # fmt: skip
    """Norm (with NORM) and turn heads h0 .. h0 + H_TILE - 1 (of H) of HD values of each row ([R] pointers
    `src`, heads HEAD_PITCH apart) into `dst` (heads HD apart): pairs (j, j + RH) by the row's `cos` and `sin`
    ([R, RH_P2]), the HD - 2 RH values after them (partial rotary) only normed. With FROM_L2 the heads are read
    past this SM's L1 (`.cg`): other programs of the same launch wrote them."""
    CACHE: tl.constexpr = ".cg" if FROM_L2 else ""
    PART: tl.constexpr = 2 * RH < HD  # a partial rotary: values after the pairs pass, only normed
    h = h0 + tl.arange(0, H_TILE)[None, :, None]
    j = tl.arange(0, RH_P2)[None, None, :]
    heads = valid[:, None, None] & (h < H)
    mask = heads & (j < RH)
    at = src[:, None, None] + h * HEAD_PITCH
    to = dst[:, None, None] + h * HD
    a = tl.load(at + j, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    b = tl.load(at + RH + j, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    if PART:
        rest = tl.arange(0, REST_P2)[None, None, :]
        rmask = heads & (rest < HD - 2 * RH)
        c = tl.load(at + 2 * RH + rest, mask=rmask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    if NORM:
        # one reduction over the pairs: each is a pass through shared memory and a barrier where a head
        # spreads over warps, which a decode step's launch of a program a head waits on
        squares = tl.sum(a * a + b * b, axis=2)
        if PART:
            squares += tl.sum(c * c, axis=2)
        r = tl.rsqrt(squares / HD + eps)[:, :, None]
        a = a * r * tl.load(w_ptr + j, mask=j < RH, other=0.0).to(tl.float32)
        b = b * r * tl.load(w_ptr + RH + j, mask=j < RH, other=0.0).to(tl.float32)
        if PART:
            c = c * r * tl.load(w_ptr + 2 * RH + rest, mask=rest < HD - 2 * RH, other=0.0).to(tl.float32)
    cos, sin = cos[:, None, :], sin[:, None, :]
    ty = dst.dtype.element_ty
    tl.store(to + j, (a * cos - b * sin).to(ty), mask=mask)
    tl.store(to + RH + j, (b * cos + a * sin).to(ty), mask=mask)
    if PART:
        tl.store(to + 2 * RH + rest, c.to(ty), mask=rmask)


@triton.jit
def rotate_head(src, dst, w_ptr, p, eps, freq_exp, yarn_low, yarn_inv, yarn_cut, HD: tl.constexpr,
                HALF_P2: tl.constexpr, NORM: tl.constexpr, FROM_L2: tl.constexpr = False,
                YARN: tl.constexpr = False):  # fmt: skip
    """Norm (with NORM) and turn the one head of `HD` values at `src` to position `p`, writing it at `dst`, as a
    launch turns its rows' heads (the QKV GEMV's rotation epilogue: the last program of a head turns it)."""
    at = tl.zeros([1], dtype=tl.int32)
    cos, sin = _angles(p, tl.arange(0, HALF_P2)[None, :], freq_exp, yarn_low, yarn_inv, yarn_cut, YARN)
    _turn_rows(src + at, dst + at, w_ptr, cos, sin, at == 0, eps, 0, 1, 1, HD, HD, HD // 2, HALF_P2, 1, NORM,
               FROM_L2)  # fmt: skip


@triton.jit
def _positions(pos_ptr, i, valid, PER_ROW: tl.constexpr):
    """Rows i's positions: pos[0] + i (a sequence's rows), or pos[i] (a batch's rows, each its own sequence)."""
    if PER_ROW:
        p = tl.load(pos_ptr + i, mask=valid, other=0)
    else:
        p = tl.load(pos_ptr) + i
    return p


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_w_ptr,
    k_w_ptr,
    pos_ptr,
    rows,
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
    KV_HEADS: tl.constexpr,
    H_TILE: tl.constexpr,
    HD: tl.constexpr,
    RH: tl.constexpr,
    RH_P2: tl.constexpr,
    REST_P2: tl.constexpr,
    NORM: tl.constexpr,
    Q_AT_POS: tl.constexpr,
    K_AT_POS: tl.constexpr,
    PER_ROW: tl.constexpr,
    Q_HEAD_PITCH: tl.constexpr,
    K_HEAD_PITCH: tl.constexpr,
    ROWS: tl.constexpr,
    YARN: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    # a program takes ROWS rows of H_TILE heads of one side (the query's tiles first, then the key's): its rows'
    # angles are computed once for all its heads
    pdl.begin(PDL)
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    tile = tl.program_id(1)
    Q_TILES: tl.constexpr = (HEADS + H_TILE - 1) // H_TILE
    valid = i < rows
    p = _positions(pos_ptr, i, valid, PER_ROW)
    cos, sin = _angles(p[:, None], tl.arange(0, RH_P2)[None, :], freq_exp, yarn_low, yarn_inv, yarn_cut, YARN)
    row = i.to(tl.int64)
    # each side names its own pointers: a name assigned in both branches would have to be one type
    if tile < Q_TILES:
        q_row = (p if Q_AT_POS else i).to(tl.int64)  # the cache's row pos + i, or the output's own row i
        _turn_rows(q_ptr + row * q_pitch, q_out_ptr + q_row * q_out_pitch, q_w_ptr, cos, sin, valid, eps,
                   tile * H_TILE, HEADS, H_TILE, Q_HEAD_PITCH, HD, RH, RH_P2, REST_P2, NORM)  # fmt: skip
    else:
        k_row = (p if K_AT_POS else i).to(tl.int64)
        _turn_rows(k_ptr + row * k_pitch, k_out_ptr + k_row * k_out_pitch, k_w_ptr, cos, sin, valid, eps,
                   (tile - Q_TILES) * H_TILE, KV_HEADS, H_TILE, K_HEAD_PITCH, HD, RH, RH_P2, REST_P2, NORM)  # fmt: skip


def check_head(hd: int) -> None:
    if hd % 2 or hd > attn_kernels.ROPE_HEAD:
        raise ValueError(f"a rotation takes an even head of at most {attn_kernels.ROPE_HEAD} values, not {hd}")


def _in_pitches(x: torch.Tensor, hd: int) -> tuple[int, int, int]:
    """(rows, row pitch, head pitch) of a rotation's input: rows x heads * hd, or rows x heads x hd (the heads a
    slice of a wider row: a gated query's heads, each followed by its gate)."""
    if x.stride(-1) != 1:
        raise ValueError("rope: the input's values must be unit-stride")
    if x.dim() == 3:
        return x.shape[0], x.stride(0), x.stride(1)
    return (x.shape[0], x.stride(0), hd) if x.dim() == 2 else (1, 0, hd)


def _turned(hd: int, rot: int) -> int:
    """The values a head turns, checked even and within the head (0: all)."""
    if rot % 2 or rot > hd:
        raise ValueError(f"a head of {hd} values turns an even number of them, not {rot}")
    return rot or hd


def _out_pitch(out: torch.Tensor, cache_row_pitch: int | None) -> int:
    if out.stride(-1) != 1:
        raise ValueError("rope: the output's values must be unit-stride")
    return out.stride(0) if cache_row_pitch is None else int(cache_row_pitch)


def _launch(q, k, q_out, k_out, weights, pos, pitches, *, heads, kv_heads, hd, base, eps, rot, yarn, at_pos,
            per_row) -> None:  # fmt: skip
    """One rotation launch of `heads` query heads and `kv_heads` key heads (0: the query's side alone), normed
    by `weights` (the query's and the key's norm weights) where given."""
    check_head(hd)
    rows, q_pitch, q_head_pitch = _in_pitches(q, hd)
    _, k_pitch, k_head_pitch = _in_pitches(k, hd)
    turned = _turned(hd, rot)
    tile_rows, tile_heads, warps = rope_tile(max(heads, kv_heads), hd, turned, rows)
    pairs, rest = _widths(hd, turned)
    tiles = triton.cdiv(heads, tile_heads) + triton.cdiv(kv_heads, tile_heads)
    _rope_kernel[(triton.cdiv(rows, tile_rows), tiles)](
        q, k, q_out, k_out, *(weights or (q, k)), pos, rows, q_pitch, k_pitch, *pitches, float(eps),
        **frequencies(base, turned, yarn),
        HEADS=heads, KV_HEADS=kv_heads, H_TILE=tile_heads, HD=hd, RH=turned // 2,
        RH_P2=pairs, REST_P2=rest,
        NORM=weights is not None, Q_AT_POS=at_pos[0] and not per_row, K_AT_POS=at_pos[1] and not per_row,
        PER_ROW=per_row, Q_HEAD_PITCH=q_head_pitch, K_HEAD_PITCH=k_head_pitch, ROWS=tile_rows,
        num_warps=warps, **pdl.options(),
    )  # fmt: skip


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
    way (a cache row's staging: the paged attention stores it into its block). One launch, a program a few
    rows (`rope_tile`). `x` may be rows x heads x hd, its heads apart (a slice's); `rot` (partial rotary) turns
    only each head's first `rot` values; `yarn` stretches the frequencies.
    """
    weights = None if norm_w is None else (norm_w, norm_w)
    _launch(x, x, out, out, weights, pos, (_out_pitch(out, cache_row_pitch), 0),
            heads=heads, kv_heads=0, hd=hd, base=base, eps=eps, rot=rot, yarn=yarn,
            at_pos=(cache_row_pitch is not None, False), per_row=per_row)  # fmt: skip


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
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("one launch rotates a query and a key both normed or neither")
    pitches = (_out_pitch(q_out, None), _out_pitch(k_out, k_cache_row_pitch))
    weights = None if q_norm_w is None else (q_norm_w, k_norm_w)
    _launch(q, k, q_out, k_out, weights, pos, pitches, heads=heads,
            kv_heads=kv_heads, hd=hd, base=base, eps=eps, rot=rot, yarn=yarn,
            at_pos=(False, k_cache_row_pitch is not None), per_row=per_row)  # fmt: skip


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
