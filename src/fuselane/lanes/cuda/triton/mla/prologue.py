"""The latent attention's prologue in one launch (MlaPrologue): the query's join and the cache row's, which a
decode step otherwise runs as two launches (JoinInPlace each) between the projection and the attention.

The query's join is `heads.head_matmul` with a `Turn` (each head's product by the key half, then its rotated
part); the cache row's is `parts.norm_rope` (the normed latent, then the rotated shared key, at the position).
They read the projection's two slices and write apart (the absorbed query; the cache row), so the launch lays
their programs side by side: the query's grid as `head_matmul` lays it, and one more plane on its third axis
(where the heads are) for the cache row's, whose first column norms each row of the program's tile and whose
second turns each row's key (the plane's other programs exit). Each program runs the code the two launches
run (`heads.rows_program` / `floats_program`, `parts.cache_row`), so the values are theirs; the cache row's norm
runs at the product's warps, not the norm launch's, so its sum may round in another order (within f32's
rounding of the same sum).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.mla import heads, parts


@triton.jit
def _prologue_rows_kernel(
    x, x_row, x_head, m, w, out, out_row, out_head, n, rx, rx_row, rx_head, pos, inv, oq, od, os_,
    cx, cx_row, cw, ck, ck_row, cout, cout_row, cpos, cinv, cols, eps,
    C_BLOCK: tl.constexpr, C_CHUNKS: tl.constexpr, C_PAIRS: tl.constexpr, C_BLOCK_P: tl.constexpr,
    C_HALF: tl.constexpr, C_BATCHED: tl.constexpr, C_AT_POS: tl.constexpr,
    FMT: tl.constexpr, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, UNITS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PAIRS: tl.constexpr, BLOCK_P: tl.constexpr,
    HALF: tl.constexpr, BATCHED: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.begin(PDL)
    if tl.program_id(2) == tl.num_programs(2) - 1:  # the cache row's plane: each row of the program's tile
        part = tl.program_id(0)
        if part < 2:
            for i in tl.static_range(BLOCK_M):
                r = tl.program_id(1) * BLOCK_M + i
                if r < m:
                    parts.cache_row(cx, cx_row, cw, ck, ck_row, cout, cout_row, cpos, cinv, cols, eps, r, part,
                                    C_BLOCK, C_CHUNKS, C_PAIRS, C_BLOCK_P, C_HALF, C_BATCHED, C_AT_POS)  # fmt: skip
    else:
        heads.rows_program(x, x_row, x_head, m, w, out, out_row, out_head, n, rx, rx_row, rx_head, pos, inv, oq, od,
                           os_, FMT, ROW_BYTES, STEPS, UNITS, SPLIT, BLOCK_M, BLOCK_N, STAGES, PAIRS, BLOCK_P, HALF,
                           BATCHED, QUANT)  # fmt: skip


@triton.jit
def _prologue_floats_kernel(
    x, x_row, x_head, w, out, out_row, out_head, n, a, rx, rx_row, rx_head, pos, inv, oq, od, os_,
    cx, cx_row, cw, ck, ck_row, cout, cout_row, cpos, cinv, cols, eps,
    C_BLOCK: tl.constexpr, C_CHUNKS: tl.constexpr, C_PAIRS: tl.constexpr, C_BLOCK_P: tl.constexpr,
    C_HALF: tl.constexpr, C_BATCHED: tl.constexpr, C_AT_POS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, PAIRS: tl.constexpr, BLOCK_P: tl.constexpr, HALF: tl.constexpr,
    BATCHED: tl.constexpr, BF16: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.begin(PDL)
    if tl.program_id(2) == tl.num_programs(2) - 1:  # the cache row's plane: a program a row and part
        part = tl.program_id(0)
        if part < 2:
            parts.cache_row(cx, cx_row, cw, ck, ck_row, cout, cout_row, cpos, cinv, cols, eps, tl.program_id(1), part,
                            C_BLOCK, C_CHUNKS, C_PAIRS, C_BLOCK_P, C_HALF, C_BATCHED, C_AT_POS)  # fmt: skip
    else:
        heads.floats_program(x, x_row, x_head, w, out, out_row, out_head, n, a, rx, rx_row, rx_head, pos, inv, oq, od,
                             os_, BLOCK_N, BLOCK_A, PAIRS, BLOCK_P, HALF, BATCHED, BF16, QUANT)  # fmt: skip


def prologue(query: heads.Launch, cache: parts.CacheJoin) -> None:
    """The query's join (`query`: `heads.launch` of `head_matmul` with a `Turn`) and the cache row's (`cache`) in
    one launch, their rows the same step's."""
    rows = query.grid[1] if query.floats else query.args[3]
    if query.constants["PAIRS"] == 0 or rows != cache.rows:
        raise ValueError("prologue: the query's join (a product with its rotation) and the cache row's, of one step")
    grid = (query.grid[0], query.grid[1], query.grid[2] + 1)  # the cache row's plane after the heads'
    kernel = _prologue_floats_kernel if query.floats else _prologue_rows_kernel
    kernel[grid](*query.args, *cache.args(), *cache.constants(), **query.constants, **pdl.options())
