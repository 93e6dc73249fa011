"""The cpu lane's kernels: one NumPy function per primitive spec, the reference every other lane is held to.

Each takes the spec, its input arrays (already viewed through their accesses) and the bound position, and
returns the op's result; the runner writes it to the op's destination. They compute in the dtype of their
inputs (f32 by default, f64 for reference runs), with no fusion and no shortcuts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from fuselane.graph.ops import (
    ArgMax,
    Attention,
    Elementwise,
    ElementwiseOp,
    Join,
    Matmul,
    PrimSpec,
    RmsNorm,
    Rope,
    RowsGather,
    SetRow,
    Slice,
    TakeRows,
    Unary,
    UnaryOp,
    Yarn,
)
from fuselane.lanes.cpu.gdn_kernels import GDN_KERNELS
from fuselane.lanes.cpu.latent_kernels import LATENT_KERNELS, inv_freq
from fuselane.lanes.cpu.moe_kernels import MOE_KERNELS

Kernel = Callable[[PrimSpec, list[np.ndarray], int], np.ndarray]


def rms_norm(spec: RmsNorm, args: list[np.ndarray], pos: int) -> np.ndarray:
    (x,) = args
    units = x.reshape(spec.rows, spec.cols)
    scale = 1.0 / np.sqrt(np.mean(units * units, axis=-1, keepdims=True) + units.dtype.type(spec.eps))
    return (units * scale).reshape(x.shape)


def elementwise(spec: Elementwise, args: list[np.ndarray], pos: int) -> np.ndarray:
    a, b = args
    if spec.row:
        units = a.reshape(-1, spec.cols)
        b = b.reshape(1, spec.cols)
    else:  # the same values, perhaps viewed as other units (a gate sliced a head at a time)
        units = a
        b = b.reshape(a.shape)
    out = units + b if spec.op is ElementwiseOp.ADD else units * b
    return out.reshape(a.shape)


def unary(spec: Unary, args: list[np.ndarray], pos: int) -> np.ndarray:
    (x,) = args
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x << 0, and x / inf is the right 0
        if spec.op is UnaryOp.SILU:
            return x / (1 + np.exp(-x))
        if spec.op is UnaryOp.SIGMOID:
            return 1 / (1 + np.exp(-x))
        if spec.op is UnaryOp.SOFTPLUS:
            return np.logaddexp(0, x)  # log(1 + exp(x)), without overflow
    raise NotImplementedError(spec.op)


def matmul(spec: Matmul, args: list[np.ndarray], pos: int) -> np.ndarray:
    x, w = args
    # a one-output product's weight may be stored as a vector (the shared expert's gate)
    return x.reshape(spec.m, spec.k) @ w.reshape(spec.n, spec.k).T


def rope_angles(
    positions: np.ndarray, hd: int, base: float, dtype: np.dtype, yarn: Yarn | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position's angle for each of the hd/2 frequencies (YaRN's where given), in f64."""
    angles = positions.astype(np.float64)[:, None] * inv_freq(hd, base, yarn)[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def rope(spec: Rope, args: list[np.ndarray], pos: int) -> np.ndarray:
    x = args[0]
    rot = spec.turned
    half = rot // 2
    positions = np.asarray(pos) if spec.batched else np.arange(pos, pos + spec.rows)
    cos, sin = rope_angles(positions, rot, spec.base, x.dtype, spec.yarn)
    cos, sin = cos[:, None, :], sin[:, None, :]
    whole = x.reshape(spec.rows, spec.heads, spec.hd)
    heads, kept = whole[..., :rot], whole[..., rot:]  # a partial rotary turns the first `rot` values only
    if spec.half:
        a, b = heads[..., :half], heads[..., half:]
    else:
        a, b = heads[..., 0::2], heads[..., 1::2]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    out = np.concatenate([ra, rb], axis=-1) if spec.half else np.stack([ra, rb], axis=-1).reshape(heads.shape)
    return np.concatenate([out, kept], axis=-1).reshape(x.shape)


def attention(spec: Attention, args: list[np.ndarray], pos) -> np.ndarray:
    q, k_cache, v_cache = args[0], args[1], args[2]
    if spec.batched:  # each row its own sequence: one query over its own block of the caches
        one = replace(spec, rows=1, batched=False)
        blocks = [
            attention(one, [q[i : i + 1], k_cache[i * spec.len :], v_cache[i * spec.len :]], int(p))
            for i, p in enumerate(np.asarray(pos))
        ]
        return np.concatenate(blocks, axis=0)
    rows, hd, vd, kv = spec.rows, spec.hd, spec.value_width, spec.kv_heads
    group = spec.heads // kv
    span = pos + rows
    qh = q.reshape(rows, kv, group, hd).transpose(1, 2, 0, 3)  # (kv, group, rows, hd)
    kh = k_cache[:span].reshape(span, kv, hd).transpose(1, 2, 0)  # (kv, hd, span)
    vh = v_cache[:span].reshape(span, kv, vd).transpose(1, 0, 2)  # (kv, span, vd)
    scores = (qh @ kh[:, None]) * q.dtype.type(spec.scale)  # (kv, group, rows, span)
    future = np.arange(span)[None, :] > (pos + np.arange(rows))[:, None]
    scores[..., future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out = weights @ vh[:, None]  # (kv, group, rows, vd)
    return out.transpose(2, 0, 1, 3).reshape(rows, spec.heads * vd)


def set_row(spec: SetRow, args: list[np.ndarray], pos: int) -> np.ndarray:
    return args[0].reshape(spec.rows, spec.cols)


def take_rows(spec: TakeRows, args: list[np.ndarray], pos: int) -> np.ndarray:
    return args[0].reshape(spec.rows, spec.cols)[spec.rows - spec.take :]


def slice_units(spec: Slice, args: list[np.ndarray], pos: int) -> np.ndarray:
    """`width` values at `start` of every `every`-wide unit: a copy (a lane with StridedRead reads it in place)."""
    units = args[0].reshape(spec.groups, spec.every)
    return units[:, spec.start : spec.start + spec.width].copy()


def join(spec: Join, args: list[np.ndarray], pos: int) -> np.ndarray:
    """Each head of each row: the first input's part of it, then the second's."""
    a, b = args
    ha = a.reshape(spec.rows, spec.heads, spec.wa // spec.heads)
    hb = b.reshape(spec.rows, spec.heads, spec.wb // spec.heads)
    return np.concatenate([ha, hb], axis=-1).reshape(spec.rows, spec.wa + spec.wb)


def argmax(spec: ArgMax, args: list[np.ndarray], pos: int) -> np.ndarray:
    """Each row's largest value's index (the first, on a tie), as the greedy sampler picks it."""
    return args[0].reshape(spec.rows, spec.cols).argmax(axis=-1)


KERNELS: dict[type, Kernel] = {
    RmsNorm: rms_norm,
    Elementwise: elementwise,
    Unary: unary,
    Matmul: matmul,
    Rope: rope,
    Attention: attention,
    SetRow: set_row,
    TakeRows: take_rows,
    Slice: slice_units,
    Join: join,
    ArgMax: argmax,
    **MOE_KERNELS,
    **GDN_KERNELS,
    **LATENT_KERNELS,
}

# RowsGather reads a table the runner may keep quantized, so the runner answers it itself.
GATHER = RowsGather
