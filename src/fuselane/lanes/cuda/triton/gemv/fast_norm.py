"""`epilogue.gemv_add_norm`'s contract on the fast decode GEMV's tile loop (`fast`): one launch for a
decode step's row, sum_out = x @ W^T + residual, then out = RMS norm of sum_out times norm_w.

Every program walks its BLOCK_N rows with `fast.row_dots` (the same per-format decode, prefetch and
tile plan as `fast`) and stores its rows of sum_out with `fast`'s own epilogue; then it counts itself
done on a self-resetting device counter, and the program that finds itself last reads the whole sum_out row
back and norms it. Unlike `gemv_add_norm`, the last program does not hold the row in registers: it walks it in
chunks of NORM_CHUNK values twice (the sum of squares, then the scaled store), re-reading sum_out from L2,
so any width n is taken (`supports_fast_add_norm`); a row of at most NORM_CHUNK values is read once.

The memory ordering is `gemv_add_norm`'s, copied: Triton's interpreter runs programs one after another and
cannot test it, so the comments at the counter say why the GPU's is right.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.epilogue import check_add_norm
from fuselane.lanes.cuda.triton.gemv.fast import GROUPS, check_one_row, launch_plan, row_dots
from fuselane.lanes.cuda.triton.gemv.parts import store_row
from fuselane.lanes.cuda.triton.quant import store_quantized

# Values of the row the last program takes a pass. A row that fits (every Qwen's hidden width, at most 8192)
# is held in registers whole and read from L2 once; a wider one is walked in chunks twice, each chunk a
# dependent round trip to L2 (~1 us), which at 1024 values a chunk left the 7B's 3584-wide norm a tail of
# ~8 round trips. Read at launch (a power of two); a smaller one lets the interpreter's tests walk the row
# in several chunks.
NORM_CHUNK = 8192


@triton.jit
def _fast_add_norm_kernel(
    x, w, n, res, sum_out, norm_w, out, counter, eps,
    FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FENCE: tl.constexpr, NORM_BLOCK: tl.constexpr, NORM_STEPS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past n read the last row (no masked weight loads, as `fast`); the store drops them
    w_rows = w + tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    y, _ = row_dots(w_rows, w_rows, x, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, False, PDL)
    # fast's epilogue: + residual (which may be sum_out itself: each program reads only the rows it writes)
    store_row(y, rows, n, sum_out, 0, x, x, res, False, False, True)

    norm_last(sum_out, norm_w, out, n, eps, counter, out, out, out, NORM_BLOCK, NORM_STEPS, False)


@triton.jit
def _write(y_norm, start, n, mask, out, oq, od, os_, Q8OUT: tl.constexpr):
    """Values start.. of the normed row: to `out`, and where Q8OUT also as int8 activations (`quant.Q8Acts`)."""
    offs = start + tl.arange(0, y_norm.shape[0])
    tl.store(out + offs, y_norm.to(out.dtype.element_ty), mask=mask)
    if Q8OUT:
        store_quantized(y_norm, start, n, oq, od, os_)


@triton.jit
def norm_last(sum_out, norm_w, out, n, eps, counter, oq, od, os_, NORM_BLOCK: tl.constexpr,
              NORM_STEPS: tl.constexpr, Q8OUT: tl.constexpr):  # fmt: skip
    """A launch's end: each program, its sum_out rows stored, counts itself done on `counter`; the last one
    norms the whole row (`norm_row`) and re-arms the counter."""
    # Why the last program sees every program's sum_out, on the GPU (epilogue's pattern):
    # - the block's barrier orders all its threads' stores before the counter's atomic, which one thread does
    #   (Triton lowers an atomic on a scalar pointer to one thread, its result broadcast through shared memory);
    # - that atomic is a release at gpu scope (acq_rel): the stores it orders are visible at gpu scope (in L2,
    #   as L1 writes through) to whoever acquires the counter's later value;
    # - the last program's atomic reads the value every other program's release wrote (a read-modify-write
    #   always reads the latest value in the counter's order), and is an acquire: everything those programs
    #   stored happens-before it, and the broadcast's barrier orders it before every thread's loads below;
    # - those loads read L2 (.cg), never this SM's L1 (`norm_row`).
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        norm_row(sum_out, norm_w, out, n, eps, oq, od, os_, NORM_BLOCK, NORM_STEPS, Q8OUT)
        # every other program has counted already: re-armed for the next launch (a CUDA graph's replay), which
        # stream order puts after this one's end, so no ordering is asked of the store
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def norm_row(sum_out, norm_w, out, n, eps, oq, od, os_, NORM_BLOCK: tl.constexpr, NORM_STEPS: tl.constexpr,
             Q8OUT: tl.constexpr):  # fmt: skip
    """The whole row's norm by one program that every program's sum_out is visible to: out = sum_out /
    sqrt(mean(sum_out^2) + eps) * norm_w (and its int8 form where Q8OUT); returns 1 / sqrt(mean(sum_out^2) + eps).
    Its loads read L2 (.cg), never this SM's L1: a line of sum_out may sit there stale, loaded as another tile's
    residual by an earlier program on this SM (sum_out may be the residual's buffer), and weak loads could hit
    it. Both passes of a chunked row load so: the second re-reads the row too."""
    offs = tl.arange(0, NORM_BLOCK)
    if NORM_STEPS == 1:  # the whole row in registers: one round trip to L2, not two a chunk
        mask = offs < n
        # the norm's weight loaded with the row, not after the sum of squares: the reduction's barriers would
        # hold its load behind them, a second round trip (to DRAM, where the step has evicted it) in the tail
        nw = tl.load(norm_w + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sum_out + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        r = tl.rsqrt(tl.sum(s * s, axis=0) / n + eps)
        y_norm = s * r * nw
        _write(y_norm, 0, n, mask, out, oq, od, os_, Q8OUT)
    else:
        # squares summed elementwise across chunks, reduced once: any order of n non-negative terms is within
        # gamma_n of the exact sum, the bound the norm's tests derive
        squares = tl.zeros([NORM_BLOCK], tl.float32)
        # the passes' count is a constexpr (the launch's cdiv(n, NORM_BLOCK)): a norm's width is a model's
        # constant, and the interpreter cannot loop to a runtime bound
        for step in range(NORM_STEPS):
            start = step * NORM_BLOCK
            mask = start + offs < n
            s = tl.load(sum_out + start + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            squares += s * s
        # the arithmetic of `norm.rms_norm`: r = 1 / sqrt(mean(s^2) + eps), out = (s * r) * w
        r = tl.rsqrt(tl.sum(squares, axis=0) / n + eps)
        for step in range(NORM_STEPS):
            start = step * NORM_BLOCK
            mask = start + offs < n
            s = tl.load(sum_out + start + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            y_norm = s * r * tl.load(norm_w + start + offs, mask=mask, other=0.0).to(tl.float32)
            _write(y_norm, start, n, mask, out, oq, od, os_, Q8OUT)
    return r


def supports_fast_add_norm(fmt: Format | int, n: int, m: int = 1) -> bool:
    """Whether `gemv_fast_add_norm` takes a product of `m` rows of x in `fmt` normed over `n` values: one row, a
    format `fast` takes; any n >= 1 (the last program walks the norm's row in chunks)."""
    return m == 1 and fmt in GROUPS and n >= 1


def check_fast_add_norm(x: Tensor, w: Tensor, fmt: Format, n: int, k: int, residual: Tensor, sum_out: Tensor,
                        norm_w: Tensor, out: Tensor, counter: Tensor) -> Tensor:  # fmt: skip
    """The operands of a fast GEMV with an add + norm (`gemv_fast_add_norm`'s), checked; x as one row (1, k)."""
    if not supports_fast_add_norm(fmt, n):
        raise ValueError(f"no fast GEMV with a norm for {Format(fmt).name} rows of {n}")
    x2 = x.view(1, -1) if x.dim() == 1 else x
    check_one_row(x2, k, [w], fmt, n)
    check_add_norm(residual, sum_out, norm_w, out, counter, n, x.device)
    return x2


def gemv_fast_add_norm(
    x: Tensor,
    w: Tensor,
    fmt: Format,
    n: int,
    k: int,
    residual: Tensor,
    sum_out: Tensor,
    norm_w: Tensor,
    eps: float,
    out: Tensor,
    counter: Tensor,
    *,
    block_n: int | None = None,
    warps: int | None = None,
) -> Tensor:
    """One launch: sum_out = x @ W^T + residual, then out = sum_out / sqrt(mean(sum_out^2) + eps) * norm_w, the
    norm done by the launch's last program over the sum_out it reads back; returns `out`.

    `epilogue.gemv_add_norm`'s contract on `fast`'s kernels: `x` is (1, k) or (k,), W the n x k
    checkpoint rows `w` in `fmt` (a format `fast` takes); `residual`, `sum_out`, `norm_w` and `out` hold n
    values each, contiguous. `sum_out` may be `residual`; `out` and `x` must not overlap either. `counter` is
    `epilogue.gemv_add_norm_counter`'s, at zero, and left at zero. `block_n` and `warps` override the
    format's tile, as in `fast`.
    """
    fmt = Format(fmt)
    x2 = check_fast_add_norm(x, w, fmt, n, k, residual, sum_out, norm_w, out, counter)
    if NORM_CHUNK < 1 or NORM_CHUNK & (NORM_CHUNK - 1):
        raise ValueError(f"NORM_CHUNK must be a power of two, not {NORM_CHUNK}")
    plan = launch_plan(fmt, k, block_n, warps, n=n)
    chunk = min(triton.next_power_of_2(n), NORM_CHUNK)
    _fast_add_norm_kernel[(triton.cdiv(n, plan["BLOCK_N"]),)](
        x2,
        w,
        n,
        residual,
        sum_out,
        norm_w,
        out,
        counter,
        float(eps),
        NORM_BLOCK=chunk,
        NORM_STEPS=triton.cdiv(n, chunk),
        **plan,
        **pdl.options(),
    )
    return out
