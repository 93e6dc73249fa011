"""The decode down launch's product loop under MoeDown.READ_AHEAD (`down._kept_q8`): `gemv.q8.row_dots`'s
loop for one matrix (its chunks, prefetch depth and pinned loads), with the reads a program's end waits on
placed where their round trips run under the products' instead of after them.

Why: in sm_90 SASS of `row_dots` followed by the weighted combine (Qwen3-30B-A3B's Q4_K down,
`benchmarks/moe_registers.py --decode --sass`), the route weights' and the residual's loads sit after the
barrier of the tile's sum over its groups, so every program made one more dependent round trip to L2 after
its last dp4a, before its store and its count. ptxas moves no load across a barrier, so here each is
written where it may first be read: the route weights with the ids, before the wait for the launch before
(the routing writes both: `down._kept_q8` says why that is safe), and the arrays added in right after the
wait, before the pinned weights' barrier, so their loads are issued with the first chunk's activations.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv.q8 import GROUPS_C, PINNED_C, chunk_acts, chunk_sums, raw_chunk


@triton.jit
def kept_dots(w_rows, xq, xd, xs, route_w, a0, a1, row, first, live, D: tl.constexpr, FMT: tl.constexpr,
              BLOCK_N: tl.constexpr, TILE_N: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr,
              FENCE: tl.constexpr, DEPTH: tl.constexpr, ADDS: tl.constexpr, EARLY: tl.constexpr,
              PDL: tl.constexpr):  # fmt: skip
    """([BLOCK_N] f32, [TILE_N] f32): each tile row's x . row (`w_rows`, each with its own activation row's
    [BLOCK_N, 1] pointers) times its route weight (`route_w` pointers; 0 where not `live`), and the sum of
    the first ADDS arrays at TILE_N values of row `row` from value `first`. DEPTH chunks of weights are in flight
    while one is summed (1 to 3; `moe_kernels.moe_down_depth`), the first DEPTH read before the wait. EARLY: the
    first chunks' weights and the route weights are read before the wait for the launch before (PDL), the
    arrays added in after it."""
    CHUNKS: tl.constexpr = (N_UNITS + CHUNK - 1) // CHUNK
    PIN: tl.constexpr = FENCE == PINNED_C
    PARTIAL: tl.constexpr = N_UNITS % CHUNK != 0
    AHEAD: tl.constexpr = DEPTH if DEPTH < CHUNKS else CHUNKS  # chunks loaded before the loop: the row's first
    G: tl.constexpr = CHUNK * GROUPS_C[FMT]
    rw = tl.load(route_w, mask=live, other=0.0, cache_modifier=".cg")
    # the chunks ahead, held in three names (a stand-in where fewer), rotated as each is summed
    raw = raw_chunk(w_rows, 0, FMT, N_UNITS, CHUNK, PARTIAL and CHUNKS == 1, PIN)
    mid, far = raw, raw
    if AHEAD >= 2:
        mid = raw_chunk(w_rows, CHUNK, FMT, N_UNITS, CHUNK, PARTIAL and CHUNKS == 2, PIN)
    if AHEAD >= 3:
        far = raw_chunk(w_rows, 2 * CHUNK, FMT, N_UNITS, CHUNK, PARTIAL and CHUNKS == 3, PIN)
    acc = tl.zeros([BLOCK_N, G], tl.float32)
    if EARLY:  # the loads above issued before the wait (`q8.row_dots`' HOLD)
        tl.debug_barrier()
    pdl.wait(EARLY and PDL)
    res = adds(a0, a1, row, first, D, TILE_N, ADDS)
    if PIN:  # the first chunks' loads issued before any sum
        tl.debug_barrier()
    for c in range(0, CHUNKS - AHEAD):  # each iteration loads the chunk AHEAD on, then sums chunk c
        u0 = c * CHUNK
        nxt = raw_chunk(w_rows, u0 + AHEAD * CHUNK, FMT, N_UNITS, CHUNK, PARTIAL, PIN)
        if PIN:
            tl.debug_barrier()
        acts = chunk_acts(xq, xd, xs, u0, FMT, N_UNITS, BLOCK_N, CHUNK)
        if FENCE and not PIN:
            tl.debug_barrier()
        acc += chunk_sums(raw, acts, u0, FMT, N_UNITS, CHUNK, False)
        if AHEAD == 3:
            raw, mid, far = mid, far, nxt
        elif AHEAD == 2:
            raw, mid = mid, nxt
        else:
            raw = nxt
    # the last AHEAD chunks, already loaded
    if AHEAD >= 3:
        u3 = (CHUNKS - 3) * CHUNK
        acc += chunk_sums(raw, chunk_acts(xq, xd, xs, u3, FMT, N_UNITS, BLOCK_N, CHUNK), u3, FMT, N_UNITS, CHUNK,
                          False)  # fmt: skip
        raw, mid = mid, far
    if AHEAD >= 2:
        u2 = (CHUNKS - 2) * CHUNK
        acc += chunk_sums(raw, chunk_acts(xq, xd, xs, u2, FMT, N_UNITS, BLOCK_N, CHUNK), u2, FMT, N_UNITS, CHUNK,
                          False)  # fmt: skip
        raw = mid
    u1 = (CHUNKS - 1) * CHUNK
    acc += chunk_sums(raw, chunk_acts(xq, xd, xs, u1, FMT, N_UNITS, BLOCK_N, CHUNK), u1, FMT, N_UNITS, CHUNK,
                      PARTIAL)  # fmt: skip
    return tl.where(live, rw * tl.sum(acc, 1), 0.0), res  # a padding slot counts 0, as `row_dots`' caller's


@triton.jit
def adds(a0, a1, row, first, D: tl.constexpr, TILE_N: tl.constexpr, ADDS: tl.constexpr):
    """[TILE_N] f32: the sum of the first ADDS arrays added in (rows of D), at TILE_N values of row `row` from
    value `first` (0 for none)."""
    rc = tl.minimum(first + tl.arange(0, TILE_N), D - 1).to(tl.int64)
    res = tl.zeros([TILE_N], tl.float32)
    if ADDS >= 1:
        res += tl.load(a0 + row * D + rc)
    if ADDS >= 2:
        res += tl.load(a1 + row * D + rc)
    return res
