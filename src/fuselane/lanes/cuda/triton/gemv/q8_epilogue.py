"""The int8 GEMV's producers that quantize their own result (the plan's NormQuant and GluActMulQuant under
`activations=int8`), so the next product reads int8 without a launch of its own:

- `gemv_q8_add_norm`: `fast_norm`'s one-launch product + residual + RMS norm, reading a quantized
  activation; the last program norms the row and writes it as f32 and as a `Q8Acts`;
- `gemv_q8_gate_up_glu_q8`: the gate/up product with SwiGLU, writing its result as f32 and as a `Q8Acts`: a
  32-value block is quantized by the program that finishes it last (a self-resetting counter a block).

The memory ordering of both is `fast_norm`'s (its comments say why it holds on the GPU): every program's
stores, the block's barrier, an acq_rel atomic at gpu scope; the last program's loads go to L2 (.cg).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import QK, Format
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv import fast_norm
from fuselane.lanes.cuda.triton.gemv.epilogue import COUNTER_DTYPE, check_add_norm, check_row
from fuselane.lanes.cuda.triton.gemv.fast_norm import norm_last
from fuselane.lanes.cuda.triton.gemv.parts import check_rows, store_row
from fuselane.lanes.cuda.triton.gemv.q8 import check_aligned, row_dots, tile_plan
from fuselane.lanes.cuda.triton.quant import Q8Acts, check_acts, store_quantized

QB = tl.constexpr(QK)


@triton.jit
def _q8_add_norm_kernel(
    xq, xd, xs, w, n, res, sum_out, norm_w, out, oq, od, os_, counter, eps,
    FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FENCE: tl.constexpr, NORM_BLOCK: tl.constexpr, NORM_STEPS: tl.constexpr, DEPTH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w + tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    y, _ = row_dots(w_rows, w_rows, xq, xd, xs, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, False, DEPTH, PDL)
    store_row(y, rows, n, sum_out, 0, res, res, res, False, False, True)
    norm_last(sum_out, norm_w, out, n, eps, counter, oq, od, os_, NORM_BLOCK, NORM_STEPS, True)


@triton.jit
def _q8_glu_q8_kernel(
    xq, xd, xs, w_gate, w_up, n, out, oq, od, os_, counters,
    FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FENCE: tl.constexpr, DEPTH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_off = tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    w_g, w_u = w_gate + row_off, w_up + row_off
    gate, up = row_dots(w_g, w_u, xq, xd, xs, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, True, DEPTH, PDL)
    tl.store(out + rows, gate / (1.0 + tl.exp(-gate)) * up, mask=rows < n)
    quantize_block_last(out, pid, n, oq, od, os_, counters, BLOCK_N)


@triton.jit
def quantize_block_last(out, pid, n, oq, od, os_, counters, BLOCK_N: tl.constexpr):
    """After program `pid` stored its BLOCK_N values (a divisor of 32) of the row `out`: the block of 32 they are
    in is quantized into (oq, od, os_) by the last of its programs to finish (`counters`, one a block, each left
    at zero)."""
    tl.debug_barrier()
    blk = pid * BLOCK_N // QB
    done = tl.atomic_add(counters + blk, 1, sem="acq_rel", scope="gpu")
    if done == QB // BLOCK_N - 1:
        v = tl.load(out + blk * QB + tl.arange(0, QB), cache_modifier=".cg")
        store_quantized(v, blk * QB, n, oq, od, os_)
        tl.atomic_xchg(counters + blk, 0, sem="relaxed", scope="gpu")


def q8_counters(n: int, device) -> Tensor:
    """The zeroed counters `gemv_q8_gate_up_glu_q8` takes for an output of n values (one a 32-value block);
    each launch leaves them at zero."""
    return torch.zeros(triton.cdiv(n, QK), dtype=COUNTER_DTYPE, device=device)


def check_q8_out(out: Q8Acts, n: int) -> None:
    """A launch's quantized output of n values: whole 32-value blocks, one row's int8 codes and scales."""
    if n % QK:
        raise ValueError(f"a quantized output takes whole {QK}-value blocks, not {n} values")
    check_acts(Q8Acts(out.q.view(1, -1), out.d, out.s), n)


def gemv_q8_add_norm(
    x: Q8Acts, w: Tensor, fmt: Format, n: int, k: int, residual: Tensor, sum_out: Tensor, norm_w: Tensor,
    eps: float, out: Tensor, out_q8: Q8Acts, counter: Tensor, *, block_n: int | None = None,
    warps: int | None = None, per_thread: int | None = None,
) -> Tensor:  # fmt: skip
    """`fast_norm.gemv_fast_add_norm` on the quantized activation `x`: sum_out = x @ W^T + residual, out =
    the RMS norm of sum_out times norm_w, and `out_q8` = out quantized (n whole 32-value blocks); returns out."""
    fmt = Format(fmt)
    check_acts(x, k)
    check_rows(w, fmt, n, k)
    check_aligned([w], fmt)
    check_add_norm(residual, sum_out, norm_w, out, counter, n, x.q.device)
    check_q8_out(out_q8, n)
    plan = tile_plan(fmt, k, block_n, warps, per_thread, n=n)
    chunk = max(min(triton.next_power_of_2(n), fast_norm.NORM_CHUNK), QK)
    _q8_add_norm_kernel[(triton.cdiv(n, plan["BLOCK_N"]),)](
        *x, w, n, residual, sum_out, norm_w, out, *out_q8, counter, float(eps),
        NORM_BLOCK=chunk, NORM_STEPS=triton.cdiv(n, chunk), **plan, **pdl.options(),
    )  # fmt: skip
    return out


def gemv_q8_gate_up_glu_q8(
    x: Q8Acts, w_gate: Tensor, w_up: Tensor, fmt: Format, n: int, k: int, out: Tensor, out_q8: Q8Acts,
    counters: Tensor, *, block_n: int | None = None, warps: int | None = None, per_thread: int | None = None,
) -> Tensor:  # fmt: skip
    """`gemv_q8.gemv_q8_gate_up_glu` that also writes its result quantized into `out_q8` (n whole 32-value
    blocks); `counters` are `q8_counters(n)`'s. Returns out."""
    fmt = Format(fmt)
    check_acts(x, k)
    check_rows(w_gate, fmt, n, k)
    check_rows(w_up, fmt, n, k)
    check_aligned([w_gate, w_up], fmt)
    check_row(out, n, "out")
    check_q8_out(out_q8, n)
    plan = tile_plan(fmt, k, block_n, warps, per_thread, glu=True)
    if plan["BLOCK_N"] > QK or counters.numel() != n // QK or counters.dtype != COUNTER_DTYPE:
        raise ValueError(f"a tile of at most {QK} rows and q8_counters({n})")
    _q8_glu_q8_kernel[(triton.cdiv(n, plan["BLOCK_N"]),)](
        *x, w_gate, w_up, n, out, *out_q8, counters, **plan, **pdl.options()
    )
    return out
